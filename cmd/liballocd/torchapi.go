//go:build cgo

package main

/*
#include <stddef.h>
#include <stdint.h>
#include "exports.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/snapshot"
)

// The exports that allocd_torch's CUDAAllocator (python/allocd_torch/
// _allocator.cpp) answers torch's own APIs with: getDeviceStats,
// resetAccumulatedStats, getMemoryFraction, cacheInfo and snapshot. Their
// results travel as arrays of int64 in the fixed layouts below, which that
// file decodes; a layout that changes changes its version.

// deviceStatsLen is the number of values allocd_device_stats writes, in
// this order (c10::CachingDeviceAllocator::DeviceStats' fields):
//
//	0..107  allocation, segment, active, inactive_split, allocated_bytes,
//	        reserved_bytes, active_bytes, inactive_split_bytes,
//	        requested_bytes: for each, the pools all, small, large, and for
//	        each pool current, peak, allocated, freed
//	108..111  oversize_allocations: current, peak, allocated, freed
//	112..115  oversize_segments: the same
//	116..121  num_alloc_retries, num_ooms, num_sync_all_streams,
//	          num_device_alloc, num_device_free, max_split_size
const deviceStatsLen = 9*3*4 + 4 + 4 + 6

// deviceStatsValues lays st out as deviceStatsLen values.
func deviceStatsValues(st *allocator.Stats) []int64 {
	out := make([]int64, 0, deviceStatsLen)
	stat := func(s allocator.Stat) { out = append(out, s.Current, s.Peak, s.Allocated, s.Freed) }
	for _, arr := range []*allocator.StatArray{&st.Allocation, &st.Segment, &st.Active, &st.InactiveSplit,
		&st.AllocatedBytes, &st.ReservedBytes, &st.ActiveBytes, &st.InactiveSplitBytes, &st.RequestedBytes} {
		for _, s := range arr {
			stat(s)
		}
	}
	stat(st.OversizeAllocations)
	stat(st.OversizeSegments)
	return append(out, st.NumAllocRetries, st.NumOOMs, st.NumSyncAllStreams, st.NumDeviceAlloc, st.NumDeviceFree, st.MaxSplitSize)
}

// snapshotFormat is the version of flattenSnapshot's layout, its first
// value. 2 added each segment's pool id.
const snapshotFormat = 2

// Trace actions as numbers: the order of c10's TraceEntry::Action.
var actionCodes = map[snapshot.Action]int64{
	snapshot.ActionAlloc:         0,
	snapshot.ActionFreeRequested: 1,
	snapshot.ActionFreeCompleted: 2,
	snapshot.ActionSegmentAlloc:  3,
	snapshot.ActionSegmentFree:   4,
	snapshot.ActionSegmentMap:    5,
	snapshot.ActionSegmentUnmap:  6,
	snapshot.ActionSnapshot:      7,
	snapshot.ActionOOM:           8,
}

// Block states as numbers, and the number of values of each part of
// flattenSnapshot's layout.
const (
	stateInactive          = 0
	stateActiveAllocated   = 1
	stateActivePendingFree = 2

	snapshotHeaderFields = 3
	segmentFields        = 12
	blockFields          = 4
	traceEntryFields     = 5
)

// flattenSnapshot lays s out as int64 values, the layout of
// allocd_snapshot_flat:
//
//	snapshotFormat, number of segments, number of device traces
//	per segment: device, address, total_size, requested_size,
//	    allocated_size, active_size, stream, is_large (0/1),
//	    is_expandable (0/1), the two values of the private pool that owns
//	    it (torch's MempoolId_t; 0, 0 for the general cache), number of
//	    blocks;
//	    then per block: address, size, requested_size, state
//	    (0 inactive, 1 active_allocated, 2 active_pending_free)
//	per device trace: number of entries;
//	    then per entry: action (TraceEntry::Action's order), addr (the
//	    device's free bytes for an OOM), size, stream, time in
//	    microseconds since the Unix epoch
//
// Without traces the trace count is 0. Addresses, sizes, streams and pool
// ids are uint64 values stored as int64 bits.
func flattenSnapshot(s *snapshot.Snapshot, traces bool) ([]int64, error) {
	n := snapshotHeaderFields
	for i := range s.Segments {
		n += segmentFields + blockFields*len(s.Segments[i].Blocks)
	}
	if traces {
		for _, tr := range s.DeviceTraces {
			n += 1 + traceEntryFields*len(tr)
		}
	}
	out := make([]int64, 0, n)
	ntraces := 0
	if traces {
		ntraces = len(s.DeviceTraces)
	}
	out = append(out, snapshotFormat, int64(len(s.Segments)), int64(ntraces))
	for i := range s.Segments {
		sg := &s.Segments[i]
		var large, exp int64
		if sg.SegmentType == "large" {
			large = 1
		}
		if sg.IsExpandable {
			exp = 1
		}
		out = append(out, int64(sg.Device), int64(sg.Address), int64(sg.TotalSize), int64(sg.RequestedSize),
			int64(sg.AllocatedSize), int64(sg.ActiveSize), int64(sg.Stream), large, exp,
			int64(sg.PoolID[0]), int64(sg.PoolID[1]), int64(len(sg.Blocks)))
		for j := range sg.Blocks {
			b := &sg.Blocks[j]
			var state int64
			switch b.State {
			case snapshot.BlockInactive:
				state = stateInactive
			case snapshot.BlockActiveAllocated:
				state = stateActiveAllocated
			case snapshot.BlockActivePendingFree:
				state = stateActivePendingFree
			default:
				return nil, fmt.Errorf("allocd: snapshot: block %#x has state %q", b.Address, b.State)
			}
			out = append(out, int64(b.Address), int64(b.Size), int64(b.RequestedSize), state)
		}
	}
	if traces {
		for _, tr := range s.DeviceTraces {
			out = append(out, int64(len(tr)))
			for k := range tr {
				e := &tr[k]
				code, ok := actionCodes[e.Action]
				if !ok {
					return nil, fmt.Errorf("allocd: snapshot: trace entry with action %q", e.Action)
				}
				out = append(out, code, int64(e.Addr), int64(e.Size), int64(e.Stream), e.TimeUS)
			}
		}
	}
	return out, nil
}

// copyValues copies vals into buf when it holds n ≥ len(vals) values, and
// returns len(vals) either way.
func copyValues(vals []int64, buf *C.longlong, n C.size_t) C.longlong {
	if buf != nil && int(n) >= len(vals) {
		copy(unsafe.Slice((*int64)(unsafe.Pointer(buf)), len(vals)), vals)
	}
	return C.longlong(len(vals))
}

// liballocd_go_device_stats is allocd_device_stats: device's statistics
// as deviceStatsLen values (zero for a device not created), written when
// n is large enough; it returns deviceStatsLen, or -1.
//
//export liballocd_go_device_stats
func liballocd_go_device_stats(device C.int, buf *C.longlong, n C.size_t) (rc C.longlong) {
	defer recovered("allocd_device_stats")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return C.longlong(fail(err))
	}
	st := l.deviceStats(int(device))
	return copyValues(deviceStatsValues(&st), buf, n)
}

//export liballocd_go_reset_accumulated_stats
func liballocd_go_reset_accumulated_stats(device C.int) (rc C.int) {
	defer recovered("allocd_reset_accumulated_stats")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return fail(err)
	}
	if err := l.resetAccumulatedStats(int(device)); err != nil {
		return fail(err)
	}
	return 0
}

// liballocd_go_memory_fraction is allocd_memory_fraction: the fraction of
// device's memory the allocator may hold (set_per_process_memory_fraction),
// 1 when none is set or the device's allocator does not exist yet.
//
//export liballocd_go_memory_fraction
func liballocd_go_memory_fraction(device C.int) C.double {
	defer recovered("allocd_memory_fraction")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return 1
	}
	if a := l.alloc(int(device)); a != nil {
		if f := a.Config().PerProcessMemoryFraction; f > 0 {
			return C.double(f)
		}
	}
	return 1
}

//export liballocd_go_largest_free_block
func liballocd_go_largest_free_block(device C.int) C.longlong {
	return query("allocd_largest_free_block", device, func(l *lib, d int) int64 {
		if a := l.alloc(d); a != nil {
			return a.Stats().LargestFreeBlock
		}
		return 0
	})
}

// liballocd_go_snapshot_flat is allocd_snapshot_flat: the snapshot of
// every device (Devices.Snapshot) as flattenSnapshot's values, written
// when n is large enough; it returns how many there are, or -1. The
// caller whose buffer was too small asks again with a larger one (the
// state may have grown meanwhile).
//
//export liballocd_go_snapshot_flat
func liballocd_go_snapshot_flat(traces C.int, buf *C.longlong, n C.size_t) (rc C.longlong) {
	defer recovered("allocd_snapshot_flat")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return C.longlong(fail(err))
	}
	vals, err := flattenSnapshot(l.devs.Snapshot(), traces != 0)
	if err != nil {
		return C.longlong(fail(err))
	}
	return copyValues(vals, buf, n)
}
