package allocator

import (
	"fmt"
	"time"

	"github.com/allocd/allocd/allocator/internal/vmm"
)

// Stat is one PyTorch-style statistic: its current value, its peak since the
// last ResetPeakStats, and the running totals added and removed.
type Stat struct {
	Current   int64
	Peak      int64
	Allocated int64
	Freed     int64
}

func (s *Stat) add(n int64) {
	s.Current += n
	s.Allocated += n
	if s.Current > s.Peak {
		s.Peak = s.Current
	}
}

func (s *Stat) sub(n int64) {
	s.Current -= n
	s.Freed += n
}

// Pool indexes a StatArray.
type Pool int

// The pools a StatArray splits a statistic into, in PyTorch's order.
const (
	PoolAll Pool = iota
	PoolSmall
	PoolLarge
	numPools
)

// String returns PyTorch's name for the pool: "all", "small_pool" or
// "large_pool".
func (p Pool) String() string {
	switch p {
	case PoolAll:
		return "all"
	case PoolSmall:
		return "small_pool"
	case PoolLarge:
		return "large_pool"
	}
	return fmt.Sprintf("Pool(%d)", int(p))
}

// StatArray is a statistic for all pools together and for each pool.
type StatArray [numPools]Stat

func (a *StatArray) add(pool Pool, n int64) {
	a[PoolAll].add(n)
	a[pool].add(n)
}

func (a *StatArray) sub(pool Pool, n int64) {
	a[PoolAll].sub(n)
	a[pool].sub(n)
}

// DeviceMallocBuckets are the upper bounds, in seconds, of the device-malloc
// latency histogram in Stats.
var DeviceMallocBuckets = [...]float64{10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3}

// Histogram is a cumulative-free latency histogram: Counts[i] counts the
// observations v with DeviceMallocBuckets[i-1] < v <= DeviceMallocBuckets[i];
// the last count is for observations above every bound.
type Histogram struct {
	Counts [len(DeviceMallocBuckets) + 1]uint64
	Count  uint64
	Sum    float64 // seconds
}

func (h *Histogram) observe(d time.Duration) {
	v := d.Seconds()
	i := 0
	for i < len(DeviceMallocBuckets) && v > DeviceMallocBuckets[i] {
		i++
	}
	h.Counts[i]++
	h.Count++
	h.Sum += v
}

// Stats is a consistent copy of the allocator's counters, taken under one
// lock. Field names follow torch.cuda.memory_stats(); Flat renders PyTorch's
// key map.
type Stats struct {
	// Allocation counts live blocks handed out by Malloc.
	Allocation StatArray
	// Segment counts device allocations (cudaMalloc calls) held.
	Segment StatArray
	// Active counts blocks in use, including those freed but still awaiting
	// a stream's event.
	Active StatArray
	// InactiveSplit counts free blocks that are part of a split segment
	// (cannot be returned to the device).
	InactiveSplit StatArray
	// AllocatedBytes is the rounded size of live allocations.
	AllocatedBytes StatArray
	// ReservedBytes is the size of all segments held.
	ReservedBytes StatArray
	// ActiveBytes is the size of active blocks.
	ActiveBytes StatArray
	// InactiveSplitBytes is the size of inactive split blocks.
	InactiveSplitBytes StatArray
	// RequestedBytes is the size callers asked for, before rounding.
	RequestedBytes StatArray

	// OversizeAllocations counts live allocations of at least
	// max_split_size; OversizeSegments the segments holding them.
	OversizeAllocations Stat
	OversizeSegments    Stat

	// NumAllocRetries counts mallocs that freed cached memory and retried
	// after the device said no.
	NumAllocRetries int64
	// NumOOMs counts mallocs that failed with an out-of-memory error.
	NumOOMs int64
	// NumSyncAllStreams counts times the allocator waited for every pending
	// event (OOM path, EmptyCache).
	NumSyncAllStreams int64
	// NumDeviceAlloc and NumDeviceFree count device malloc and free calls.
	NumDeviceAlloc int64
	NumDeviceFree  int64
	// NumEmptyCache counts EmptyCache calls.
	NumEmptyCache int64
	// NumPagesMoved counts expandable-segment pages that reclaim unmapped
	// from a free block and mapped again for a request, in the growing
	// stream's range: the same physical page, moved (allocd only; not a
	// PyTorch key). Their unmappings and mappings also count in
	// NumDeviceFree and NumDeviceAlloc.
	NumPagesMoved int64
	// NumPagesMovedAcrossStreams counts the pages of NumPagesMoved that
	// left one stream's range for another stream's (allocd only).
	NumPagesMovedAcrossStreams int64
	// NumReclaims counts expandable-segment reclaims: mappings that would
	// have raised reserved memory above its high-water mark and unmapped
	// free pages first. Each waits once for the streams that own those
	// pages (allocd only; not a PyTorch key).
	NumReclaims int64
	// NumSmallFromLarge counts small requests (up to 1 MiB) that
	// expandable segments served from a free block of the stream's large
	// pool rather than grow the small pool past what reclaim allows
	// (allocd only; not a PyTorch key).
	NumSmallFromLarge int64
	// NumLends counts free blocks of one stream's expandable segment
	// handed out to a request on another stream that the device or the
	// per-process cap refused to map for, even after cached memory was
	// released, instead of failing (allocd only; not a PyTorch key).
	NumLends int64
	// MaxSplitSize is the max_split_size in effect (bytes); -1 when unset,
	// as PyTorch reports it.
	MaxSplitSize int64

	// LargestFreeBlock is the size of the largest cached free block.
	LargestFreeBlock int64
	// NumEscalations counts cached mallocs and frees that took every
	// stream's lock to settle a peak (allocd only; not a PyTorch key): a
	// measure of the contention between streams that the hot path pays.
	NumEscalations int64
	// NumCapBorrows counts cached mallocs and frees whose change passed
	// their stream's share of the slack under a peak, so that they took
	// more from the slack that all streams share (allocd only; not a
	// PyTorch key). NumCapSteals counts the other streams' locks those
	// borrows took to move the slack the other streams held but did not
	// use back into the shared part. Both touch memory that other streams'
	// hot paths touch too: with NumEscalations they measure what keeping
	// the peaks exact costs concurrent streams.
	NumCapBorrows, NumCapSteals int64
	// HandleCacheBytes is the physical memory of expandable segments that
	// reclaim unmapped and kept, mapped nowhere, for the next growths to
	// map again instead of creating new memory (allocd only; not a
	// PyTorch key). It is held from the device, so ReservedBytes counts
	// it; EmptyCache, the out-of-memory path and a cap release it.
	HandleCacheBytes int64
	// PrivateReservedBytes and PrivateAllocatedBytes are the parts of
	// ReservedBytes and AllocatedBytes (all pools) that private pools
	// (CUDA graphs, MemPool; CreatePool) hold and have allocated (allocd
	// only; not PyTorch keys). Only Stats fills them in.
	PrivateReservedBytes  int64
	PrivateAllocatedBytes int64
	// VMM counts the driver's virtual memory calls that expandable
	// segments made, and the time they took (allocd only).
	VMM VMMCalls
	// DeviceMallocLatency observes each device malloc (slow path only).
	DeviceMallocLatency Histogram
}

// VMMCalls counts the driver's virtual memory calls of expandable
// segments, and their time: Creates (cuMemCreate), Maps (handles mapped
// with cuMemMap), Grants (cuMemSetAccess, one per range mapped in one
// call; MapTime includes them), Unmaps (cuMemUnmap calls, one per
// contiguous stretch of runs) and Releases (cuMemRelease). Reserving and
// releasing address ranges, once per stream and pool, are left out.
type VMMCalls = vmm.Calls

// Flat returns the statistics under PyTorch's flat keys, as
// torch.cuda.memory_stats() names them: "allocated_bytes.all.current",
// "segment.large_pool.peak", "num_ooms", …; allocd's own expandable
// reclaim counters follow the same style: "num_reclaims",
// "num_pages_moved", "num_pages_moved_across_streams",
// "handle_cache_bytes"; the private pools' "private_reserved_bytes"
// and "private_allocated_bytes"; and expandable segments' virtual memory
// calls (VMM): "num_handles_created", "num_handles_released",
// "num_runs_revived", "num_reclaim_waits", "vmm_total_ns" and
// "vmm_sync_ns".
func (s *Stats) Flat() map[string]int64 {
	m := make(map[string]int64, 128)
	for _, st := range s.namedArrays() {
		for p := PoolAll; p < numPools; p++ {
			putStat(m, st.name+"."+p.String(), st.a[p])
		}
	}
	putStat(m, "oversize_allocations", s.OversizeAllocations)
	putStat(m, "oversize_segments", s.OversizeSegments)
	m["num_alloc_retries"] = s.NumAllocRetries
	m["num_ooms"] = s.NumOOMs
	m["num_sync_all_streams"] = s.NumSyncAllStreams
	m["num_device_alloc"] = s.NumDeviceAlloc
	m["num_device_free"] = s.NumDeviceFree
	m["max_split_size"] = s.MaxSplitSize
	m["num_reclaims"] = s.NumReclaims
	m["num_pages_moved"] = s.NumPagesMoved
	m["num_pages_moved_across_streams"] = s.NumPagesMovedAcrossStreams
	m["num_lends"] = s.NumLends
	m["num_small_from_large"] = s.NumSmallFromLarge
	m["handle_cache_bytes"] = s.HandleCacheBytes
	m["private_reserved_bytes"] = s.PrivateReservedBytes
	m["private_allocated_bytes"] = s.PrivateAllocatedBytes
	m["num_handles_created"] = s.VMM.Creates
	m["num_handles_released"] = s.VMM.Releases
	m["num_runs_revived"] = s.VMM.Revived
	m["num_reclaim_waits"] = s.VMM.Waits
	m["vmm_total_ns"] = s.VMM.Total().Nanoseconds()
	m["vmm_sync_ns"] = s.VMM.SyncTime.Nanoseconds()
	return m
}

// AccumulatedSince returns s with its accumulated totals counted from
// base, a Stats of the same allocator taken earlier: each Stat's Allocated
// and Freed, NumAllocRetries, NumOOMs, NumSyncAllStreams, NumDeviceAlloc and
// NumDeviceFree less base's. These are what PyTorch's
// reset_accumulated_memory_stats sets to zero; currents, peaks and every
// other field are s's. So a view that keeps a base taken at its reset
// shows PyTorch's figures while the allocator's own counters, which
// Prometheus reads, stay monotonic. After such a reset a Stat's Current is
// no longer Allocated − Freed, as in PyTorch.
func (s Stats) AccumulatedSince(base *Stats) Stats {
	arrs, bases := s.namedArrays(), base.namedArrays()
	for i := range arrs {
		for p := range numPools {
			arrs[i].a[p].Allocated -= bases[i].a[p].Allocated
			arrs[i].a[p].Freed -= bases[i].a[p].Freed
		}
	}
	for _, st := range [...]struct{ s, b *Stat }{
		{&s.OversizeAllocations, &base.OversizeAllocations},
		{&s.OversizeSegments, &base.OversizeSegments},
	} {
		st.s.Allocated -= st.b.Allocated
		st.s.Freed -= st.b.Freed
	}
	s.NumAllocRetries -= base.NumAllocRetries
	s.NumOOMs -= base.NumOOMs
	s.NumSyncAllStreams -= base.NumSyncAllStreams
	s.NumDeviceAlloc -= base.NumDeviceAlloc
	s.NumDeviceFree -= base.NumDeviceFree
	return s
}

func putStat(m map[string]int64, prefix string, s Stat) {
	m[prefix+".current"] = s.Current
	m[prefix+".peak"] = s.Peak
	m[prefix+".allocated"] = s.Allocated
	m[prefix+".freed"] = s.Freed
}

func (s *Stat) resetPeak() { s.Peak = s.Current }
func (a *StatArray) resetPeak() {
	for i := range a {
		a[i].resetPeak()
	}
}

// namedStatArray is a StatArray with its PyTorch name.
type namedStatArray struct {
	name string
	a    *StatArray
}

// namedArrays lists the per-pool statistics in PyTorch's order.
func (s *Stats) namedArrays() [9]namedStatArray {
	return [9]namedStatArray{
		{"allocation", &s.Allocation},
		{"segment", &s.Segment},
		{"active", &s.Active},
		{"inactive_split", &s.InactiveSplit},
		{"allocated_bytes", &s.AllocatedBytes},
		{"reserved_bytes", &s.ReservedBytes},
		{"active_bytes", &s.ActiveBytes},
		{"inactive_split_bytes", &s.InactiveSplitBytes},
		{"requested_bytes", &s.RequestedBytes},
	}
}
