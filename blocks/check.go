package blocks

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
)

// Totals are the byte and block counts Check derives by walking segments;
// the allocator compares them with its statistics.
type Totals struct {
	// Segments counts every segment, ExpandableSegments the expandable
	// ones among them.
	Segments           int
	ExpandableSegments int
	// SegmentBytes is the memory the segments hold from the device: an
	// ordinary segment's size, an expandable segment's mapped bytes.
	SegmentBytes uint64
	// AddressSpace is the virtual address space of the expandable
	// segments (their reservations, mapped or not).
	AddressSpace uint64
	// UnmappedCount and UnmappedBytes count the unmapped blocks of
	// expandable segments (neither free nor allocated).
	UnmappedCount  int
	UnmappedBytes  uint64
	Blocks         int
	AllocatedCount int
	AllocatedBytes uint64
	// RequestedBytes sums the requested sizes of allocated and pending
	// blocks (PyTorch counts requested bytes while a block is active).
	RequestedBytes uint64
	// Pending counts blocks freed but waiting for stream events.
	PendingCount int
	PendingBytes uint64
	FreeCount    int
	FreeBytes    uint64
	// InactiveSplit counts free blocks in split ordinary segments, as
	// PyTorch's inactive_split does (it leaves expandable segments out).
	InactiveSplitCount int
	InactiveSplitBytes uint64
}

// maxReported caps the problems Check lists, so a badly broken structure
// still yields a readable error.
const maxReported = 32

// Check walks every segment and the free indexes and reports every broken
// invariant it finds, joined into one error (nil when all hold):
//
//   - a segment's blocks tile it exactly: the head starts at the segment's
//     address, each block starts where its predecessor ends, Prev and Next
//     agree, and the sizes add up to the segment's size;
//   - every block points back to its segment and has a positive size that
//     is a multiple of 512;
//   - every free block is indexed, and every indexed block is free and
//     belongs to one of the segments;
//   - no two free blocks are neighbours (they would have been merged);
//   - the index files each block under its current size, address and
//     stream, and its byte count equals the sum of its blocks;
//   - no segment lies at address 0, wraps past 2^64 or overlaps another
//     (checkRanges);
//   - in an expandable segment, unmapped blocks are free, not indexed,
//     start and end on page boundaries and never neighbour each other (a
//     mapped free block beside an unmapped one is fine), and the mapped
//     blocks add up to the segment's Mapped bytes, a whole number of pages;
//     an ordinary segment has no unmapped block.
//
// idx is the free index of each pool; a segment's free blocks may be in any
// of them.
func Check(segments []*Segment, idx ...*FreeIndex) (Totals, error) {
	var t Totals
	var errs []error
	report := func(format string, args ...any) {
		if len(errs) < maxReported {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	for _, e := range checkRanges(segments) {
		report("%w", e)
	}
	owned := make(map[*Block]bool)
	for i, s := range segments {
		t.Segments++
		if s.Expandable {
			t.ExpandableSegments++
			t.AddressSpace += s.Size
			t.SegmentBytes += s.Mapped
			if s.PageSize == 0 || s.PageSize%512 != 0 || s.Size%s.PageSize != 0 {
				report("expandable segment %#x: size %d is not a whole number of %d-byte pages", s.Ptr, s.Size, s.PageSize)
				continue
			}
		} else {
			t.SegmentBytes += s.Size
		}
		if s.Index != i {
			report("segment %#x: index %d, found at %d", s.Ptr, s.Index, i)
		}
		if s.Head == nil {
			report("segment %#x: no head block", s.Ptr)
			continue
		}
		if s.Head.Prev != nil {
			report("segment %#x: head %v has a predecessor", s.Ptr, s.Head)
		}
		next := s.Ptr
		var sum, mapped uint64
		var prev *Block
		for b := s.Head; b != nil; b = b.Next {
			if owned[b] {
				report("segment %#x: block %v appears twice (cycle or shared block)", s.Ptr, b)
				break
			}
			owned[b] = true
			t.Blocks++
			if b.Segment != s {
				report("segment %#x: %v points to another segment", s.Ptr, b)
			}
			if b.Prev != prev {
				report("segment %#x: %v: Prev does not point to the block before it", s.Ptr, b)
			}
			if b.Ptr != next {
				report("segment %#x: %v starts at %#x, expected %#x (gap or overlap)", s.Ptr, b, b.Ptr, next)
			}
			if b.Size == 0 || b.Size%512 != 0 {
				report("segment %#x: %v: size is not a positive multiple of 512", s.Ptr, b)
			}
			switch {
			case b.Unmapped:
				t.UnmappedCount++
				t.UnmappedBytes += b.Size
				switch {
				case !s.Expandable:
					report("segment %#x: %v is unmapped in an ordinary segment", s.Ptr, b)
				case b.Allocated || b.EventCount != 0:
					report("segment %#x: %v is unmapped but allocated or pending", s.Ptr, b)
				case (b.Ptr-s.Ptr)%s.PageSize != 0 || b.Size%s.PageSize != 0:
					report("segment %#x: unmapped %v does not start and end on %d-byte page boundaries", s.Ptr, b, s.PageSize)
				}
				if b.indexed {
					report("segment %#x: unmapped %v is in the free index", s.Ptr, b)
				}
				if prev != nil && prev.Unmapped {
					report("segment %#x: unmapped %v and %v are neighbours, not merged", s.Ptr, prev, b)
				}
			case b.Allocated:
				t.AllocatedCount++
				t.AllocatedBytes += b.Size
				t.RequestedBytes += b.Requested
				if b.indexed {
					report("segment %#x: allocated %v is in the free index", s.Ptr, b)
				}
			case b.EventCount > 0:
				t.PendingCount++
				t.PendingBytes += b.Size
				t.RequestedBytes += b.Requested
				if b.indexed {
					report("segment %#x: pending %v is in the free index", s.Ptr, b)
				}
			default:
				t.FreeCount++
				t.FreeBytes += b.Size
				if b.IsSplit() && !s.Expandable {
					t.InactiveSplitCount++
					t.InactiveSplitBytes += b.Size
				}
				if !b.indexed {
					report("segment %#x: free %v is not in the free index", s.Ptr, b)
				}
				if prev != nil && prev.Free() && !prev.Unmapped {
					report("segment %#x: free %v and %v are neighbours, not merged", s.Ptr, prev, b)
				}
			}
			if b.EventCount < 0 {
				report("segment %#x: %v: negative event count %d", s.Ptr, b, b.EventCount)
			}
			next = b.Ptr + b.Size
			sum += b.Size
			if !b.Unmapped {
				mapped += b.Size
			}
			prev = b
		}
		if sum != s.Size {
			report("segment %#x: blocks add up to %d bytes, segment is %d", s.Ptr, sum, s.Size)
		}
		if s.Expandable && (mapped != s.Mapped || mapped%s.PageSize != 0) {
			report("expandable segment %#x: mapped blocks add up to %d bytes, segment says %d mapped in %d-byte pages", s.Ptr, mapped, s.Mapped, s.PageSize)
		}
	}
	var indexed int
	for _, x := range idx {
		var bytes uint64
		x.ascendEntries(func(k *entry) {
			b := k.b
			indexed++
			bytes += b.Size
			if k.size != b.Size || k.ptr != b.Ptr || b.Segment == nil || b.Segment.Stream != x.stream {
				report("index of stream %#x files %v under size %d, address %#x: the block changed while indexed", x.stream, b, k.size, k.ptr)
			}
			if !b.indexed {
				report("index holds %v not marked indexed", b)
			}
			if !b.Free() {
				report("index holds %v, which is not free", b)
			}
			if !owned[b] {
				report("index holds %v, which belongs to no segment", b)
			}
		})
		if err := x.check(); err != nil {
			report("index of stream %#x: %v", x.stream, err)
		}
		if bytes != x.bytes {
			report("index counts %d bytes, its blocks add up to %d", x.bytes, bytes)
		}
	}
	if indexed != t.FreeCount {
		report("indexes hold %d blocks, segments have %d free blocks", indexed, t.FreeCount)
	}
	return t, errors.Join(errs...)
}

// checkRanges reports the segments whose address ranges are impossible: at
// address 0 (a block there could never be freed: a free of 0 does
// nothing), wrapping past 2^64, or overlapping another segment.
func checkRanges(segments []*Segment) []error {
	var errs []error
	sorted := make([]*Segment, 0, len(segments))
	for _, s := range segments {
		switch {
		case s.Ptr == 0:
			errs = append(errs, fmt.Errorf("segment [%#x, +%d) starts at address 0", s.Ptr, s.Size))
		case s.Size > 0 && s.Ptr+s.Size-1 < s.Ptr:
			errs = append(errs, fmt.Errorf("segment [%#x, +%d) wraps past 2^64", s.Ptr, s.Size))
		default:
			sorted = append(sorted, s)
		}
	}
	slices.SortFunc(sorted, func(a, b *Segment) int { return cmp.Compare(a.Ptr, b.Ptr) })
	for i := 1; i < len(sorted); i++ {
		if a, b := sorted[i-1], sorted[i]; a.Ptr+a.Size > b.Ptr {
			errs = append(errs, fmt.Errorf("segments [%#x, +%d) and [%#x, +%d) overlap", a.Ptr, a.Size, b.Ptr, b.Size))
		}
	}
	return errs
}
