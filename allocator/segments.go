package allocator

// The segment source: where the pools' segments come from and where they
// go back. A Malloc reads allocator (allocator.go) → stream pool
// (shard.go, front.go) → free index (package blocks) → source. The source
// is one of two:
//
//   - mallocSource (this file): one device malloc per segment, PyTorch's
//     alloc_block, with its escalation on out of memory and the
//     garbage collector;
//   - *expandable (expandable.go): virtual ranges per stream and pool,
//     grown by mapping pages (expandable_segments:True).
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

// source is a segment source.
type source interface {
	// grow finds room for a request of size bytes (rounded) on stream
	// that the pool's free index could not serve, releasing cached memory
	// and asking again as the policy says, and returns a free block of at
	// least rounded bytes that is not indexed; or an *OOMError, counted.
	grow(c *call, p *pool, stream cudart.Stream, size, rounded uint64) (*blocks.Block, error)
	// releaseCached returns what the cache holds unused to the device
	// (PyTorch's release_cached_blocks, after the events are waited for).
	releaseCached(c *call) error
	// close returns everything to the device, live blocks included.
	close() []error
	// check reports every broken invariant of the source's own state.
	check() []error
}

// mallocSource is the source of cudaMalloc segments.
type mallocSource struct{ a *Allocator }

// releaseCached releases every whole free segment, large pools first.
func (m mallocSource) releaseCached(c *call) error {
	if err := m.a.releaseAll(c, m.a.collectWhole(false)); err != nil {
		return err
	}
	return m.a.releaseAll(c, m.a.collectWhole(true))
}

// close frees every segment.
func (m mallocSource) close() []error {
	a := m.a
	var errs []error
	for _, seg := range a.segments {
		if err := a.dev.Free(cudart.Ptr(seg.Ptr)); err != nil {
			errs = append(errs, fmt.Errorf("allocator: device free of segment %#x: %w", seg.Ptr, err))
			continue
		}
		a.stats.NumDeviceFree++
	}
	return errs
}

// check: without expandable_segments no segment is expandable.
func (m mallocSource) check() []error {
	n := 0
	for _, s := range m.a.segments {
		if s.Expandable {
			n++
		}
	}
	if n > 0 {
		return []error{fmt.Errorf("%d expandable segments without expandable_segments:True", n)}
	}
	return nil
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

// grow is PyTorch's malloc after get_free_block fails: it obtains a new
// segment for a request that no cached block serves,
// following PyTorch's escalation: garbage-collect aged blocks (when
// configured), ask the device, release oversize cached blocks and ask
// again, release every cached segment and ask a last time.
func (m mallocSource) grow(c *call, p *pool, stream cudart.Stream, size, rounded uint64) (*blocks.Block, error) {
	a := m.a
	if a.gcEnabled() {
		a.garbageCollect(c)
	}
	allocSize := allocationSize(rounded)
	b, err := a.allocBlock(c, p, stream, allocSize, false)
	if b == nil && err == nil && a.releaseAvailableCachedBlocks(c, p, uint64(stream), rounded) {
		b, err = a.allocBlock(c, p, stream, allocSize, false)
	}
	if b == nil && err == nil {
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
	if a.capped && a.reserved+allocSize > a.allowed {
		return nil, nil
	}
	t0 := time.Now()
	var ptr cudart.Ptr
	var err error
	if a.cfg.ReleaseLockOnDeviceMalloc {
		a.unlockWorld()
		ptr, err = a.dev.Malloc(allocSize)
		a.lockWorld()
		if err == nil && a.closed {
			_ = a.dev.Free(ptr)
			return nil, fmt.Errorf("allocator: malloc: %w", ErrClosed)
		}
	} else {
		ptr, err = a.dev.Malloc(allocSize)
	}
	elapsed := time.Since(t0)
	if err != nil {
		if errors.Is(err, cudart.ErrOutOfMemory) {
			c.devErr = err
			return nil, nil
		}
		return nil, fmt.Errorf("allocator: device malloc of %d bytes: %w", allocSize, err)
	}
	a.stats.DeviceMallocLatency.observe(elapsed)
	seg := &blocks.Segment{Ptr: uint64(ptr), Size: allocSize, Stream: uint64(stream), Small: p.small, Index: len(a.segments)}
	b := p.recycler.Get()
	b.Ptr, b.Size, b.Segment = uint64(ptr), allocSize, seg
	seg.Head = b
	a.segments = append(a.segments, seg)
	a.dirAdd(seg)
	a.reserved += allocSize
	a.stats.Segment.add(p.stat, 1)
	a.stats.ReservedBytes.add(p.stat, int64(allocSize))
	if allocSize >= a.cfg.MaxSplitSize {
		a.stats.OversizeSegments.add(1)
	}
	a.stats.NumDeviceAlloc++
	a.record(c, actionSegmentAlloc, seg.Ptr, allocSize, stream)
	a.log.Debug("segment allocated", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", allocSize),
		zap.Bool("small_pool", p.small), zap.Uint64("stream", uint64(stream)),
		zap.Uint64("reserved_bytes", a.reserved), zap.Duration("took", elapsed))
	return b, nil
}

// releaseBlock returns a whole free segment to the device.
func (a *Allocator) releaseBlock(c *call, b *blocks.Block) error {
	seg := b.Segment
	p := a.poolOf(b)
	if err := a.dev.Free(cudart.Ptr(seg.Ptr)); err != nil {
		return fmt.Errorf("allocator: device free of segment %#x: %w", seg.Ptr, err)
	}
	p.free.Delete(b)
	last := a.segments[len(a.segments)-1]
	a.segments[seg.Index] = last
	last.Index = seg.Index
	a.segments[len(a.segments)-1] = nil
	a.segments = a.segments[:len(a.segments)-1]
	a.dirRemove(seg)
	a.reserved -= seg.Size
	a.stats.Segment.sub(p.stat, 1)
	a.stats.ReservedBytes.sub(p.stat, int64(seg.Size))
	if seg.Size >= a.cfg.MaxSplitSize {
		a.stats.OversizeSegments.sub(1)
	}
	a.stats.NumDeviceFree++
	a.record(c, actionSegmentFree, seg.Ptr, seg.Size, cudart.Stream(seg.Stream))
	a.log.Debug("segment released", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", seg.Size),
		zap.Uint64("reserved_bytes", a.reserved))
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
	if a.reserved <= threshold {
		return
	}
	target := a.reserved - threshold
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
