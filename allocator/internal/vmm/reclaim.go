package vmm

import (
	"slices"
	"sort"

	"github.com/allocd/allocd/blocks"
)

// reclaimCand is a free block that reclaim may unmap and the bytes of its
// whole runs.
type reclaimCand struct {
	b     *blocks.Block
	bytes uint64
}

// GrowthExcess is how far serving size bytes from the candidate c would
// raise reserved memory above what reclaim allows, 0 when not at all:
// above the high-water mark and more than the slack above allocated (the
// figure now, the request included, which the caller passes); the slack
// is 1/32 of the largest allocated figure seen at a mapping. A growth
// past the high-water mark while allocated is below its own peak is
// fragmentation, and reclaim moves free pages to serve it. What the
// handle cache holds that c's segment can map is already reserved, so
// only the rest of the pages to map counts. It also remembers c and the
// blocks after it that the request would use, which Choose then leaves
// alone.
func (s *Space) GrowthExcess(c *blocks.Block, size, allocated uint64) uint64 {
	s.allocMark = max(s.allocMark, allocated)
	s.allocNow = allocated
	chain := s.chain[:0]
	var need uint64
	rem := size
	for x := c; x != nil && rem > 0; x = x.Next {
		chain = append(chain, x)
		if !x.Unmapped {
			rem -= min(rem, x.Size)
			continue
		}
		page := x.Segment.PageSize
		m := min((min(rem, x.Size)+page-1)/page*page, x.Size)
		need += m
		if m < x.Size {
			break
		}
		rem -= min(rem, x.Size)
	}
	s.chain = chain
	if need > 0 {
		need -= min(need, s.cachedFor(c.Segment))
	}
	return s.excessAt(need, allocated)
}

// SmallGrowthExcess is GrowthExcess for a request of the small pool
// that no free block holds, without looking for the block (Find walks a
// range's blocks): the request is at most 1 MiB, so growing for it maps
// one page, or none when the handle cache holds a one-page run. It is
// for a caller that serves such a request elsewhere when it passes what
// reclaim allows, and leaves what Choose excludes as it was.
func (s *Space) SmallGrowthExcess(allocated uint64) uint64 {
	s.allocMark = max(s.allocMark, allocated)
	return s.excessAt(s.smallNeed(), allocated)
}

// SmallAtLimit reports what SmallGrowthExcess(allocated) > 0 would, for a
// caller that knows no more than an upper bound of the allocated figure,
// without changing anything: true only when the call would also change
// nothing (allocated is at most the largest allocated figure seen, which
// SmallGrowthExcess would raise). Since what reclaim allows never falls as
// allocated memory falls, true for a bound is true for every figure below
// it. The allocator's hot path reads it under one shard lock, which the
// Space's writers (world mode, every shard lock) exclude.
func (s *Space) SmallAtLimit(allocated uint64) bool {
	return allocated <= s.allocMark && s.excessAt(s.smallNeed(), allocated) > 0
}

// smallNeed is what a small-pool growth maps: one page, or none when the
// handle cache holds a one-page run (cachedFor of a small range).
func (s *Space) smallNeed() uint64 {
	for _, r := range s.cache {
		if r.page == s.cfg.SmallPage && r.pages == 1 {
			return 0
		}
	}
	return s.cfg.SmallPage
}

// excessAt is how far mapping need more bytes would take reserved memory
// past what reclaim allows with allocated bytes in use. It changes
// nothing.
func (s *Space) excessAt(need, allocated uint64) uint64 {
	limit := max(s.mark, allocated+s.reclaimSlack())
	if s.reserved+need <= limit {
		return 0
	}
	return s.reserved + need - limit
}

// reclaimSlack is how far reserved memory may rise above allocated memory
// before a mapping past the high-water mark reclaims: 1/reclaimSlackDiv of
// the largest allocated figure seen at a mapping (allocMark).
func (s *Space) reclaimSlack() uint64 {
	return s.allocMark / reclaimSlackDiv / s.cfg.SmallPage * s.cfg.SmallPage
}

// The reclaim policy's two fractions (docs/fragmentation.md has the
// measurements that chose them): reserved memory may pass the high-water
// mark without a reclaim while it stays within a slack above allocated
// memory of 1/32 of the largest allocated figure, and a reclaim unmaps
// 1/128 of the mark more than it must.
const (
	reclaimSlackDiv    = 32
	reclaimHeadroomDiv = 128
)

// Choose picks, from the free blocks in free (of every stream's pools),
// those whose whole runs a reclaim unmaps so that at least want bytes,
// and if the blocks allow reclaimHeadroom more, are unmapped: the
// smallest block whose runs cover that target, else the largest blocks
// first. It leaves out the blocks of the last GrowthExcess's request,
// blocks of ordinary segments and, with Config.Coarse, blocks whose whole
// runs come to less than coarseMinMove. The list it returns is reused by
// the next call; it is empty when no block qualifies.
func (s *Space) Choose(free []*blocks.Block, want uint64) []*blocks.Block {
	cands := s.cands[:0]
	for _, b := range free {
		if b.Segment.Expandable && !slices.Contains(s.chain, b) {
			if n := s.Unmappable(b); n > 0 && (!s.cfg.Coarse || n >= coarseMinMove) {
				cands = append(cands, reclaimCand{b, n})
			}
		}
	}
	s.cands = cands[:0]
	list := s.scratch[:0]
	if len(cands) == 0 {
		return list
	}
	target := s.Target(want)
	sort.SliceStable(cands, func(i, j int) bool { return cands[i].bytes > cands[j].bytes })
	for i := len(cands) - 1; i >= 0; i-- {
		if cands[i].bytes >= target {
			cands = cands[i : i+1] // the smallest that covers the target
			break
		}
	}
	var got uint64
	for _, cand := range cands {
		if got >= target {
			break
		}
		list = append(list, cand.b)
		got += cand.bytes
	}
	s.scratch = list[:0]
	return list
}

// Target is how many bytes a reclaim of want bytes unmaps when free
// blocks allow: want and the headroom.
func (s *Space) Target(want uint64) uint64 { return want + s.reclaimHeadroom() }

// coarseMinMove is the shortest free stretch that coarse reclaim moves:
// the longest run. Moving it costs one unmap and a map per run, less than
// growing by as much in PyTorch's 20 MiB pages.
const coarseMinMove = maxRunBytes

// reclaimHeadroom is how much more than the excess a reclaim unmaps when
// free blocks allow: 1/128 of the high-water mark, in whole small pages.
// Peak reserved memory hardly depends on it (a reclaim never maps), but
// without it a workload whose requests grow a little every step (a
// decoder's key-value cache) reclaims, and so synchronises, on nearly
// every step: with it the following mappings fit under the mark until the
// headroom is used up.
func (s *Space) reclaimHeadroom() uint64 {
	return s.mark / reclaimHeadroomDiv / s.cfg.SmallPage * s.cfg.SmallPage
}
