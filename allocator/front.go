package allocator

// The front cache: one parked block per shard in front of the free index.
//
// A cached Free does not merge its block and insert it into the free index at
// once: it parks it in its shard, with the statistics already settled as
// if PyTorch's free_block had merged it. The shard's next call decides:
// a Malloc of exactly the parked size takes it back when PyTorch's best
// fit would have chosen the same place (no free block before it, the
// merged block ranking first in (size, address) order, and the split that
// PyTorch would make leaving the same remainder); any other call first
// flushes it (merge and insert, the statistics unchanged). So a
// malloc/free pair of one size touches the free index only to read it, while
// every placement, every split and every statistic stay exactly those of
// PyTorch's policy: replays show the same peaks. World mode flushes every
// shard before anything else (lockWorld), so device mallocs, EmptyCache,
// the OOM path, snapshots and statistics reads never see a parked block;
// Check inspects the parked blocks before flushing them.
//
// Blocks of expandable segments park too. PyTorch's policy differs there
// in three ways, which takeParked follows: a free block merges only with
// mapped free neighbours (unmapped pages are not indexed, so Merge leaves
// them); best fit walks on from the smallest block that fits to the next
// ones while they can grow to less (vmm.Fit: a block's own size plus the
// unmapped pages right after it); and any remainder of at least one
// minimum block splits off, with no inactive-split statistics.

import (
	"fmt"

	"github.com/allocd/allocd/allocator/internal/vmm"
	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// park ends the free of b, already released, without merging it: the
// statistics change by d, b's freeDelta, as freeBlock's would, and b
// waits in the shard's slot.
func (a *Allocator) park(sh *shard, pl *pool, b *blocks.Block, d *delta) {
	sh.stats.apply(pl.stat, d)
	b.Requested = 0
	sh.parked = b
}

// flushParked merges the parked block with its free neighbours and
// indexes it, as freeBlock does, without touching the statistics (park
// counted it).
func (a *Allocator) flushParked(sh *shard) {
	b := sh.parked
	sh.parked = nil
	p := &sh.large
	if b.Segment.Small {
		p = &sh.small
	}
	blocks.Merge(b, p.free, &p.recycler)
	p.free.Insert(b)
}

// flushAll flushes every shard (world mode).
func (a *Allocator) flushAll() {
	for _, sh := range a.shards {
		if sh.parked != nil {
			a.flushParked(sh)
		}
	}
}

// takeParked hands out the parked block for a request of size bytes
// (rounded) when PyTorch's policy would place it there, and returns 0,
// having changed nothing, otherwise.
func (a *Allocator) takeParked(sh *shard, size, rounded uint64) cudart.Ptr {
	b := sh.parked
	if b.Size != rounded {
		return 0
	}
	p := sh.poolFor(rounded)
	if b.Segment.Small != p.small {
		return 0
	}
	// PyTorch merged b with its free neighbours into m. A free block
	// before b moves m's start: the request would land there.
	if l := b.Prev; l != nil && l.Indexed() {
		return 0
	}
	right := b.Next
	if right != nil && !right.Indexed() {
		right = nil
	}
	msize := b.Size
	if right != nil {
		msize += right.Size
	}
	maxSplit := a.cfg.MaxSplitSize
	if rounded < maxSplit && msize >= maxSplit {
		return 0 // getFreeBlock would refuse m
	}
	if rounded >= maxSplit && msize >= rounded+a.cfg.MaxNonSplitRounding {
		return 0
	}
	exp := b.Segment.Expandable
	if right != nil && !p.small && !exp && !(rounded < maxSplit && right.Size > smallSize) {
		return 0 // m would be handed out whole, not split at b's end
	}
	// Best fit: m must come first in (size, address) order among the free
	// blocks PyTorch would see (right is inside m there).
	var x *blocks.Block
	if n := p.free.Len(); n > 1 || n == 1 && right == nil {
		x = p.free.LowerBoundExcept(uint64(sh.stream), rounded, right)
	}
	if x != nil && (x.Size < msize || x.Size == msize && x.Ptr < b.Ptr) {
		return 0
	}
	if exp && x != nil {
		// x follows m in that order: get_free_block's walk moves on to it
		// when it can grow to less than m (vmm.Fit).
		after := b.Next
		if right != nil {
			after = right.Next
		}
		if vmm.GrowableSize(x.Size, x.Next) < vmm.GrowableSize(msize, after) {
			return 0
		}
	}
	// allocFoundBlock's statistics on m, which hands out rounded bytes
	// (the checks above leave it whole or split at b's end).
	wasSplit := b.Prev != nil || (right == nil && b.Next != nil) || (right != nil && right.Next != nil)
	var d delta
	mallocDelta(&d, exp, wasSplit, splits(p.small, exp, msize, rounded, maxSplit), msize, rounded, size, maxSplit)
	if !a.fitsOrBorrow(sh, p.stat, &d) {
		return 0
	}
	sh.parked = nil
	b.Allocated = true
	b.Requested = size
	sh.active.put(b.Ptr, b)
	sh.stats.apply(p.stat, &d)
	return cudart.Ptr(b.Ptr)
}

// checkParked reports broken invariants of the parked blocks (world
// locks held, before flushAll): a parked block is free, not indexed, not
// waiting for events, not lent, not in an active map, mapped, of a
// segment of its shard's stream in the segment table, and one of that
// segment's blocks.
func (a *Allocator) checkParked() []error {
	var errs []error
	for _, sh := range a.shards {
		b := sh.parked
		if b == nil {
			continue
		}
		if b.Allocated || b.Indexed() || b.EventCount > 0 || b.Unmapped || b.Lent || b.Requested != 0 {
			errs = append(errs, fmt.Errorf("parked %v of stream %#x is allocated, indexed, pending, unmapped, lent or keeps a requested size", b, uint64(sh.stream)))
		}
		if sh.active.get(b.Ptr) != nil {
			errs = append(errs, fmt.Errorf("parked %v is in the active map", b))
		}
		s := b.Segment
		if s == nil || s.Stream != uint64(sh.stream) || s.Index >= len(a.segs.list) || a.segs.list[s.Index] != s {
			errs = append(errs, fmt.Errorf("parked %v is not in a segment of stream %#x", b, uint64(sh.stream)))
			continue
		}
		found := false
		for x := s.Head; x != nil; x = x.Next {
			found = found || x == b
		}
		if !found {
			errs = append(errs, fmt.Errorf("parked %v is not among its segment's blocks", b))
		}
	}
	return errs
}
