package vmm

import (
	"fmt"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// Check compares the Space with its blocks and with table, the caller's
// list of every segment (a segment's Index is its place there): every
// expandable segment in table is registered and nothing else is, the
// mapped pages are tiled by runs, a page is mapped exactly when a mapped
// block covers part of it, and the mapped bytes add up. It reports every
// broken invariant.
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
