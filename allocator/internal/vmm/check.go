package vmm

import (
	"fmt"
	"slices"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// Check compares the Space with its blocks and with table, the caller's
// list of every segment (a segment's Index is its place there): every
// expandable segment in table is registered and nothing else is, the
// mapped pages are tiled by runs, a page is mapped exactly when a mapped
// block covers part of it, the mapped bytes add up, and every standby
// mapping lies in unmapped pages, inside one unmapped block, over no
// other, is listed where its handle's are, and has a run of its length in
// the handle cache or mapped elsewhere (or one Close will release). It
// reports every broken invariant.
func (s *Space) Check(table []*blocks.Segment) []error {
	var errs []error
	n := 0
	for _, seg := range table {
		if seg.Expandable {
			n++
		}
	}
	cached := make(map[cudart.Handle]bool, len(s.cache))
	var cachedBytes uint64
	for _, r := range s.cache {
		if r.h == 0 || r.pages == 0 || cached[r.h] {
			errs = append(errs, fmt.Errorf("handle cache: run %#x of %d pages is empty or twice in the cache", uint64(r.h), r.pages))
		}
		cached[r.h] = true
		cachedBytes += r.bytes()
	}
	if cachedBytes != s.cachedBytes {
		errs = append(errs, fmt.Errorf("handle cache: %d bytes in its runs, %d counted", cachedBytes, s.cachedBytes))
	}
	if n != len(s.segs) {
		errs = append(errs, fmt.Errorf("%d expandable segments in the segment list, %d registered", n, len(s.segs)))
	}
	var mappedBytes uint64
	for i, es := range s.segs {
		seg := es.seg
		mappedBytes += seg.Mapped
		if i > 0 && s.segs[i-1].seg.Ptr >= seg.Ptr {
			errs = append(errs, fmt.Errorf("expandable segments out of address order at %#x", seg.Ptr))
		}
		if seg.Index >= len(table) || table[seg.Index] != seg {
			errs = append(errs, fmt.Errorf("expandable segment %#x is not in the segment list", seg.Ptr))
			continue
		}
		if seg.PageSize == 0 || seg.Size%seg.PageSize != 0 {
			continue // blocks.Check reports it
		}
		mapped := func(i uint64) bool { return i < uint64(len(es.mapped)) && es.mapped[i] }
		var pages uint64
		for i := range es.mapped {
			if es.mapped[i] {
				pages++
			}
		}
		errs = append(errs, es.checkRuns(s.maxRunPages(seg))...)
		for _, h := range es.handles {
			if h != 0 && cached[h] {
				errs = append(errs, fmt.Errorf("expandable segment %#x: handle %#x is mapped and in the handle cache", seg.Ptr, uint64(h)))
			}
		}
		if pages*seg.PageSize != seg.Mapped {
			errs = append(errs, fmt.Errorf("expandable segment %#x: %d pages mapped, %d bytes in mapped blocks", seg.Ptr, pages, seg.Mapped))
		}
		for b := seg.Head; b != nil; b = b.Next {
			off := b.Ptr - seg.Ptr
			first, last := off/seg.PageSize, (off+b.Size+seg.PageSize-1)/seg.PageSize
			for i := first; i < last; i++ {
				if mapped(i) == b.Unmapped {
					errs = append(errs, fmt.Errorf("expandable segment %#x: page %d (at %#x) is mapped=%v under %v", seg.Ptr, i, es.addr(i), mapped(i), b))
					break
				}
			}
		}
	}
	errs = append(errs, s.checkStandby()...)
	if mappedBytes+s.cachedBytes != s.reserved {
		errs = append(errs, fmt.Errorf("expandable segments: %d bytes mapped in their segments and %d cached, %d reserved", mappedBytes, s.cachedBytes, s.reserved))
	}
	return errs
}

// checkRuns checks that the mapped pages are tiled by runs of 1 to
// maxRun pages, each with a handle, and that nothing else carries a run
// length or a handle.
func (es *expSegment) checkRuns(maxRun uint64) []error {
	var errs []error
	if len(es.run) != len(es.mapped) || len(es.handles) != len(es.mapped) {
		return []error{fmt.Errorf("expandable segment %#x: %d pages, %d run lengths, %d handles", es.seg.Ptr, len(es.mapped), len(es.run), len(es.handles))}
	}
	for i := uint64(0); i < uint64(len(es.mapped)); {
		n := uint64(es.run[i])
		switch {
		case !es.mapped[i]:
			if n != 0 || es.handles[i] != 0 {
				errs = append(errs, fmt.Errorf("expandable segment %#x: unmapped page %d has a run of %d pages, handle %#x", es.seg.Ptr, i, n, uint64(es.handles[i])))
			}
			i++
			continue
		case n == 0 || n > maxRun:
			return append(errs, fmt.Errorf("expandable segment %#x: mapped page %d starts a run of %d pages (want 1 to %d after the previous run)", es.seg.Ptr, i, n, maxRun))
		case es.handles[i] == 0:
			errs = append(errs, fmt.Errorf("expandable segment %#x: the run at page %d has no handle", es.seg.Ptr, i))
		}
		for j := i + 1; j < i+n; j++ {
			if j >= uint64(len(es.mapped)) || !es.mapped[j] || es.run[j] != 0 || es.handles[j] != 0 {
				return append(errs, fmt.Errorf("expandable segment %#x: the %d-page run at page %d is broken at page %d", es.seg.Ptr, n, i, j))
			}
		}
		i += n
	}
	return errs
}

// checkStandby checks the standby mappings of every range against the
// runs mapped, the handle cache (cached, by handle) and the list of where
// each handle has them.
func (s *Space) checkStandby() []error {
	var errs []error
	runs := make(map[cudart.Handle]uint64) // each run's length in pages, live or cached
	for _, r := range s.cache {
		runs[r.h] = r.pages
	}
	for _, es := range s.segs {
		for i, h := range es.handles {
			if h != 0 {
				runs[h] = uint64(es.run[i])
			}
		}
	}
	listed := 0
	for h, ps := range s.standbys {
		if len(ps) == 0 {
			errs = append(errs, fmt.Errorf("standby mappings: handle %#x is listed with none", uint64(h)))
		}
		for _, p := range ps {
			if p.page >= uint64(len(p.es.sbHandles)) || p.es.sbHandles[p.page] != h {
				errs = append(errs, fmt.Errorf("standby mappings: handle %#x is listed at page %d of segment %#x, which does not hold it", uint64(h), p.page, p.es.seg.Ptr))
			}
		}
		listed += len(ps)
	}
	found := 0
	for _, es := range s.segs {
		seg := es.seg
		if len(es.standby) != len(es.mapped) || len(es.sbHandles) != len(es.mapped) || len(es.sbPend) != len(es.mapped) {
			errs = append(errs, fmt.Errorf("expandable segment %#x: %d pages, %d standby lengths, %d standby handles, %d standby events",
				seg.Ptr, len(es.mapped), len(es.standby), len(es.sbHandles), len(es.sbPend)))
			continue
		}
		var in uint64 // pages of es still inside the standby mapping seen last
		for i := range es.standby {
			n, h := uint64(es.standby[i]), es.sbHandles[i]
			if n == 0 {
				if h != 0 {
					errs = append(errs, fmt.Errorf("expandable segment %#x: page %d has standby handle %#x and no length", seg.Ptr, i, uint64(h)))
				}
				if in > 0 {
					if es.mapped[i] {
						errs = append(errs, fmt.Errorf("expandable segment %#x: page %d is mapped inside a standby mapping", seg.Ptr, i))
					}
					in--
				}
				continue
			}
			found++
			if in > 0 {
				errs = append(errs, fmt.Errorf("expandable segment %#x: a standby mapping starts at page %d, inside another", seg.Ptr, i))
			}
			in = n - 1
			if es.mapped[i] || uint64(i)+n > uint64(len(es.mapped)) {
				errs = append(errs, fmt.Errorf("expandable segment %#x: the %d-page standby mapping at page %d is over mapped pages or past the last", seg.Ptr, n, i))
			}
			if !slices.Contains(s.standbys[h], place{es, uint64(i)}) {
				errs = append(errs, fmt.Errorf("expandable segment %#x: the standby mapping of handle %#x at page %d is not listed", seg.Ptr, uint64(h), i))
			}
			if l, ok := runs[h]; ok && l != n || !ok && !slices.Contains(s.orphans, h) {
				errs = append(errs, fmt.Errorf("expandable segment %#x: the %d-page standby mapping at page %d has handle %#x, which is no run of that length, cached or mapped", seg.Ptr, n, i, uint64(h)))
			}
			if b := blockAt(seg, es.addr(uint64(i))); b == nil || !b.Unmapped || b.Ptr+b.Size < es.addr(uint64(i)+n) {
				errs = append(errs, fmt.Errorf("expandable segment %#x: the %d-page standby mapping at page %d is not inside one unmapped block (%v)", seg.Ptr, n, i, b))
			}
		}
	}
	if found != listed {
		errs = append(errs, fmt.Errorf("standby mappings: %d in the ranges, %d listed", found, listed))
	}
	// Every pending is held by as many cached runs and standby mappings
	// as its count says, and by parkWith.
	held := make(map[*pending]int)
	if p := s.parkWith; p != nil {
		held[p]++
	}
	for _, r := range s.cache {
		if r.pend != nil {
			held[r.pend]++
		}
	}
	for _, es := range s.segs {
		for i, p := range es.sbPend {
			if p != nil {
				held[p]++
				if i >= len(es.standby) || es.standby[i] == 0 {
					errs = append(errs, fmt.Errorf("expandable segment %#x: page %d waits for an event and holds no standby mapping", es.seg.Ptr, i))
				}
			}
		}
	}
	for p, n := range held {
		if p.refs != n {
			errs = append(errs, fmt.Errorf("the event of a reclaim on stream %#x is held %d times, counted %d", p.stream, n, p.refs))
		}
	}
	return errs
}

// blockAt returns the block of seg that holds addr, nil if none does.
func blockAt(seg *blocks.Segment, addr uint64) *blocks.Block {
	for b := seg.Head; b != nil; b = b.Next {
		if addr >= b.Ptr && addr < b.Ptr+b.Size {
			return b
		}
	}
	return nil
}
