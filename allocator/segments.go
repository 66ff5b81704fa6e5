package allocator

// The segment source: where the pools' segments come from and where they
// go back. A Malloc reads allocator (allocator.go) → stream pool
// (shard.go, front.go) → free index (package blocks) → source. The source
// is one of two:
//
//   - mallocSource (this file): one device malloc per segment. It owns
//     the device calls and the segment table's and statistics'
//     bookkeeping; the allocator's growMalloc, allocBlock and releaseBlock
//     around it are PyTorch's alloc_block with its escalation on out of
//     memory and the garbage collector, which walk the pools;
//   - expandable segments (expandable_segments:True): virtual ranges per
//     stream and pool, grown by mapping pages. Their memory (ranges,
//     pages, runs, handles) is a vmm.Space (package
//     allocator/internal/vmm); the allocator's growExpandable and
//     releaseExpandable around it (expandable.go) are its policy.
//
// Both run in world mode; with release_lock_on_cudamalloc, allocBlock
// leaves world mode around the device malloc, and the other goroutines'
// calls may change the cache meanwhile.

import (
	"errors"
	"fmt"
	"math"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// source is a segment source: the part of it the allocator reaches
// through an interface. grow and releaseCached are called by the concrete
// type (backend.go says why).
type source interface {
	// close returns everything to the device, live blocks included.
	close() []error
	// check reports every broken invariant of the source's own state.
	check() []error
}

// grow and releaseSourceCached call the growth (growMalloc,
// growExpandable) and the cache release (releaseWhole, releaseExpandable)
// of the segment source in use by the concrete type, as backendMalloc
// does the backend's.
func (a *Allocator) grow(c *call, p *pool, stream cudart.Stream, size, rounded uint64) (*blocks.Block, error) {
	if a.exp != nil {
		return a.growExpandable(c, p, stream, size, rounded)
	}
	return a.growMalloc(c, p, stream, size, rounded)
}

func (a *Allocator) releaseSourceCached(c *call) error {
	if a.exp != nil {
		return a.releaseExpandable(c)
	}
	return a.releaseWhole(c)
}

// segTable is every segment the allocator holds from the device, whatever
// source made it, and the bytes they hold. A segment's Index is its place
// in list.
type segTable struct {
	list     []*blocks.Segment
	reserved uint64 // bytes held from the device
}

// add appends seg, whose Index must be len(list).
func (t *segTable) add(seg *blocks.Segment) {
	t.list = append(t.list, seg)
}

// remove takes seg out of the list, moving the last segment into its place.
func (t *segTable) remove(seg *blocks.Segment) {
	last := t.list[len(t.list)-1]
	t.list[seg.Index] = last
	last.Index = seg.Index
	t.list[len(t.list)-1] = nil
	t.list = t.list[:len(t.list)-1]
}

// mallocSource is the source of cudaMalloc segments: it makes and frees
// them on the device and keeps the segment table, the reserved bytes and
// the segment statistics in step with the device. The policy around it
// (the cap, the escalation on out of memory, the world lock, the
// directory, the history) is the allocator's, below.
type mallocSource struct {
	dev      cudart.Device
	table    *segTable // shared with the allocator and its other sources
	stats    *Stats    // the allocator's
	maxSplit uint64    // max_split_size: segments from here up are oversize
}

// malloc asks the device for allocSize bytes and says how long it took.
func (m *mallocSource) malloc(allocSize uint64) (cudart.Ptr, time.Duration, error) {
	t0 := time.Now()
	ptr, err := m.dev.Malloc(allocSize)
	return ptr, time.Since(t0), err
}

// adopt makes the device memory at ptr a segment of pool p on stream and
// counts it; it returns the segment's one block, not indexed.
func (m *mallocSource) adopt(p *pool, stream cudart.Stream, ptr cudart.Ptr, allocSize uint64, took time.Duration) *blocks.Block {
	m.stats.DeviceMallocLatency.observe(took)
	seg := &blocks.Segment{Ptr: uint64(ptr), Size: allocSize, Stream: uint64(stream), Small: p.small, Index: len(m.table.list)}
	b := p.recycler.Get()
	b.Ptr, b.Size, b.Segment = uint64(ptr), allocSize, seg
	seg.Head = b
	m.table.add(seg)
	m.table.reserved += allocSize
	m.stats.Segment.add(p.stat, 1)
	m.stats.ReservedBytes.add(p.stat, int64(allocSize))
	if allocSize >= m.maxSplit {
		m.stats.OversizeSegments.add(1)
	}
	m.stats.NumDeviceAlloc++
	return b
}

// release returns b, a whole free segment of pool p, to the device and
// takes it out of p's free index and the counts. b itself is left for the
// caller to recycle.
func (m *mallocSource) release(p *pool, b *blocks.Block) error {
	seg := b.Segment
	if err := m.dev.Free(cudart.Ptr(seg.Ptr)); err != nil {
		return fmt.Errorf("allocator: device free of segment %#x: %w", seg.Ptr, err)
	}
	p.free.Delete(b)
	m.table.remove(seg)
	m.table.reserved -= seg.Size
	m.stats.Segment.sub(p.stat, 1)
	m.stats.ReservedBytes.sub(p.stat, int64(seg.Size))
	if seg.Size >= m.maxSplit {
		m.stats.OversizeSegments.sub(1)
	}
	m.stats.NumDeviceFree++
	return nil
}

// close frees every segment.
func (m *mallocSource) close() []error {
	var errs []error
	for _, seg := range m.table.list {
		if err := m.dev.Free(cudart.Ptr(seg.Ptr)); err != nil {
			errs = append(errs, fmt.Errorf("allocator: device free of segment %#x: %w", seg.Ptr, err))
			continue
		}
		m.stats.NumDeviceFree++
	}
	return errs
}

// check: without expandable_segments no segment is expandable.
func (m *mallocSource) check() []error {
	n := 0
	for _, s := range m.table.list {
		if s.Expandable {
			n++
		}
	}
	if n > 0 {
		return []error{fmt.Errorf("%d expandable segments without expandable_segments:True", n)}
	}
	return nil
}

// releaseWhole is the cudaMalloc source's releaseCached: it releases
// every whole free segment, large pools first.
func (a *Allocator) releaseWhole(c *call) error {
	if err := a.releaseAll(c, a.collectWhole(false)); err != nil {
		return err
	}
	return a.releaseAll(c, a.collectWhole(true))
}

// allocationSize is PyTorch's get_allocation_size: the segment size for a
// rounded request.
func allocationSize(size uint64) uint64 {
	switch {
	case size <= smallSize:
		return smallBuffer
	case size < minLargeAlloc:
		return largeBuffer
	}
	return (size + roundLarge - 1) / roundLarge * roundLarge
}

// growMalloc is the cudaMalloc source's grow, PyTorch's malloc after get_free_block fails: it obtains a new
// segment for a request that no cached block serves,
// following PyTorch's escalation: garbage-collect aged blocks (when
// configured), ask the device, release oversize cached blocks and ask
// again, release every cached segment and ask a last time.
func (a *Allocator) growMalloc(c *call, p *pool, stream cudart.Stream, size, rounded uint64) (*blocks.Block, error) {
	// While a capture is under way nothing is released: a device free
	// or an event wait would end it (pools.go).
	capturing := a.capturing > 0
	if a.gcEnabled() && !capturing {
		a.garbageCollect(c)
	}
	allocSize := allocationSize(rounded)
	b, err := a.allocBlock(c, p, stream, allocSize, false)
	if b == nil && err == nil && !capturing && a.releaseAvailableCachedBlocks(c, p, uint64(stream), rounded) {
		b, err = a.allocBlock(c, p, stream, allocSize, false)
	}
	if b == nil && err == nil && !capturing {
		if err = a.releaseCachedBlocks(c); err == nil {
			b, err = a.allocBlock(c, p, stream, allocSize, true)
		}
	}
	if err != nil {
		return nil, err
	}
	if b == nil {
		return nil, a.outOfMemory(c, size, allocSize, stream, c.devErr)
	}
	return b, nil
}

// allocBlock is PyTorch's alloc_block: one device malloc of a new segment.
// It returns (nil, nil) when the device is out of memory (c.devErr says
// why) or the cap is reached (c.devErr nil), and an error for any other
// device failure.
func (a *Allocator) allocBlock(c *call, p *pool, stream cudart.Stream, allocSize uint64, isRetry bool) (*blocks.Block, error) {
	if isRetry {
		a.stats.NumAllocRetries++
	}
	c.devErr = nil
	if a.capped && a.segs.reserved+allocSize > a.allowed {
		return nil, nil
	}
	var ptr cudart.Ptr
	var elapsed time.Duration
	var err error
	if a.cfg.ReleaseLockOnDeviceMalloc {
		a.unlockedMallocs++
		a.unlockWorld()
		ptr, elapsed, err = a.mal.malloc(allocSize)
		a.lockWorld()
		a.unlockedMallocs--
		if err == nil && a.closed {
			_ = a.dev.Free(ptr)
			return nil, fmt.Errorf("allocator: malloc: %w", ErrClosed)
		}
	} else {
		ptr, elapsed, err = a.mal.malloc(allocSize)
	}
	if err != nil {
		if errors.Is(err, cudart.ErrOutOfMemory) {
			c.devErr = err
			return nil, nil
		}
		return nil, fmt.Errorf("allocator: device malloc of %d bytes: %w", allocSize, err)
	}
	b := a.mal.adopt(p, stream, ptr, allocSize, elapsed)
	seg := b.Segment
	a.dirAdd(seg)
	a.record(c, actionSegmentAlloc, seg.Ptr, allocSize, stream)
	a.log.Debug("segment allocated", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", allocSize),
		zap.Bool("small_pool", p.small), zap.Uint64("stream", uint64(stream)),
		zap.Uint64("reserved_bytes", a.segs.reserved), zap.Duration("took", elapsed))
	return b, nil
}

// releaseBlock returns a whole free segment to the device.
func (a *Allocator) releaseBlock(c *call, b *blocks.Block) error {
	seg := b.Segment
	p := a.poolOf(b)
	if err := a.mal.release(p, b); err != nil {
		return err
	}
	a.dirRemove(seg)
	a.record(c, actionSegmentFree, seg.Ptr, seg.Size, cudart.Stream(seg.Stream))
	a.log.Debug("segment released", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", seg.Size),
		zap.Uint64("reserved_bytes", a.segs.reserved))
	p.recycler.Put(b)
	return nil
}

// releaseAll releases every collected block, stopping at the first error.
func (a *Allocator) releaseAll(c *call, list []*blocks.Block) error {
	for _, b := range list {
		if err := a.releaseBlock(c, b); err != nil {
			return err
		}
	}
	return nil
}

// collectWhole gathers the free blocks of one kind of pool, in every
// stream, that are whole segments.
func (a *Allocator) collectWhole(small bool) []*blocks.Block {
	list := a.scratch[:0]
	for _, p := range a.pools(small) {
		p.free.Ascend(func(b *blocks.Block) bool {
			if !b.IsSplit() {
				list = append(list, b)
			}
			return true
		})
	}
	a.scratch = list[:0]
	return list
}

// releaseAvailableCachedBlocks is PyTorch's release_available_cached_blocks:
// with max_split_size set, release one oversize cached block large enough
// for the request, or else oversize blocks from the largest down until
// enough bytes are freed. It reports whether it released enough.
func (a *Allocator) releaseAvailableCachedBlocks(c *call, p *pool, stream, size uint64) bool {
	maxSplit := a.cfg.MaxSplitSize
	if maxSplit == math.MaxUint64 {
		return false
	}
	key := max(size, maxSplit)
	if b := p.free.LowerBound(stream, key); b != nil {
		if b.IsSplit() {
			return false
		}
		return a.releaseBlock(c, b) == nil
	}
	list := a.scratch[:0]
	var total uint64
	p.free.DescendStream(stream, key, func(b *blocks.Block) bool {
		if b.Size < maxSplit || total >= key {
			return false
		}
		if !b.IsSplit() {
			list = append(list, b)
			total += b.Size
		}
		return true
	})
	a.scratch = list[:0]
	if err := a.releaseAll(c, list); err != nil {
		return false
	}
	return total >= key
}

// garbageCollect is PyTorch's garbage_collect_cached_blocks: once reserved
// memory passes threshold × allowed, release unsplit large cached blocks
// whose age is at least the average, repeatedly, until enough is freed.
func (a *Allocator) garbageCollect(c *call) {
	threshold := uint64(a.cfg.GarbageCollectionThreshold * float64(a.allowed))
	if a.segs.reserved <= threshold {
		return
	}
	target := a.segs.reserved - threshold
	large := a.pools(false)
	age := func(b *blocks.Block) uint64 { return a.gcSearches[PoolLarge] - b.GCBase }
	var totalAge uint64
	count := 0
	for _, p := range large {
		p.free.Ascend(func(b *blocks.Block) bool {
			if !b.IsSplit() {
				totalAge += age(b)
				count++
			}
			return true
		})
	}
	var reclaimed uint64
	for freed := true; reclaimed < target && freed && count > 0; {
		threshold := float64(totalAge) / float64(count)
		freed = false
		list := a.scratch[:0]
		for _, p := range large {
			p.free.Ascend(func(b *blocks.Block) bool {
				if !b.IsSplit() && float64(age(b)) >= threshold {
					list = append(list, b)
				}
				return true
			})
		}
		a.scratch = list[:0]
		for _, b := range list {
			g, size := age(b), b.Size
			if a.releaseBlock(c, b) != nil {
				return
			}
			freed = true
			reclaimed += size
			totalAge -= g
			count--
		}
	}
}
