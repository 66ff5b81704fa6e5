package blocks

import (
	"strings"
	"testing"
)

// fixture builds one 8 KiB segment split into four 2 KiB blocks, the
// middle two free (merged into one), and an index holding the free block.
func fixture(t *testing.T) ([]*Segment, *FreeIndex, *Recycler, []*Block) {
	t.Helper()
	var r Recycler
	seg := &Segment{Ptr: 0x10000, Size: 8192, Stream: 1}
	head := r.Get()
	head.Ptr, head.Size, head.Segment = seg.Ptr, seg.Size, seg
	seg.Head = head
	b1 := Split(head, 2048, &r)
	b2 := Split(b1, 2048, &r)
	b3 := Split(b2, 2048, &r)
	for _, b := range []*Block{head, b1, b2, b3} {
		b.Allocated = true
	}
	idx := NewStreamFreeIndex(1)
	b1.Allocated = false
	idx.Insert(b1)
	b2.Allocated = false
	idx.Delete(b1)
	if n, bytes := Merge(b2, idx, &r); n != 0 || bytes != 0 {
		t.Fatalf("merge with an unindexed neighbour: %d %d", n, bytes)
	}
	idx.Insert(b1)
	// Proper merge: b2 absorbs b1 (its free, indexed predecessor).
	if n, bytes := Merge(b2, idx, &r); n != 1 || bytes != 2048 {
		t.Fatalf("Merge = %d, %d; want 1, 2048", n, bytes)
	}
	idx.Insert(b2)
	return []*Segment{seg}, idx, &r, []*Block{head, b2, b3}
}

func TestSplitMergeCheck(t *testing.T) {
	segs, idx, _, bs := fixture(t)
	tot, err := Check(segs, idx)
	if err != nil {
		t.Fatal(err)
	}
	if tot.Blocks != 3 || tot.FreeBytes != 4096 || tot.AllocatedBytes != 4096 || tot.InactiveSplitCount != 1 {
		t.Errorf("totals %+v", tot)
	}
	if bs[1].Ptr != 0x10000+2048 || bs[1].Size != 4096 || bs[1].Prev != bs[0] || bs[0].Next != bs[1] {
		t.Errorf("merged block %v has wrong links or extent", bs[1])
	}
	if got := idx.LowerBound(1, 3000); got != bs[1] {
		t.Errorf("LowerBound(1, 3000) = %v", got)
	}
	if got := idx.LowerBound(1, 5000); got != nil {
		t.Errorf("LowerBound beyond the largest = %v", got)
	}
	if got := idx.LowerBound(2, 1); got != nil {
		t.Errorf("LowerBound on another stream = %v", got)
	}
	if got := idx.Largest(); got != bs[1] {
		t.Errorf("Largest = %v", got)
	}
}

// TestCheckFindsCorruption: each corruption is reported, so Check can fail.
func TestCheckFindsCorruption(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(segs []*Segment, idx *FreeIndex, bs []*Block)
		want    string
	}{
		{"gap", func(_ []*Segment, _ *FreeIndex, bs []*Block) { bs[2].Ptr += 512 }, "gap or overlap"},
		{"size mismatch", func(s []*Segment, _ *FreeIndex, _ []*Block) { s[0].Size += 512 }, "add up to"},
		{"broken prev link", func(_ []*Segment, _ *FreeIndex, bs []*Block) { bs[2].Prev = bs[0] }, "Prev does not point"},
		{"free block not indexed", func(_ []*Segment, _ *FreeIndex, bs []*Block) { bs[2].Allocated = false }, "not in the free index"},
		{"unmerged neighbours", func(_ []*Segment, idx *FreeIndex, bs []*Block) { bs[2].Allocated = false; idx.Insert(bs[2]) }, "not merged"},
		{"allocated block indexed", func(_ []*Segment, idx *FreeIndex, bs []*Block) { bs[1].Allocated = true }, "in the free index"},
		{"indexed block resized", func(_ []*Segment, _ *FreeIndex, bs []*Block) { bs[1].Size += 512 }, "changed while indexed"},
		{"odd size", func(_ []*Segment, _ *FreeIndex, bs []*Block) { bs[0].Size = 100 }, "multiple of 512"},
		{"foreign block indexed", func(_ []*Segment, idx *FreeIndex, _ []*Block) {
			seg := &Segment{Ptr: 0x90000, Size: 512, Stream: 1}
			idx.Insert(&Block{Ptr: 0x90000, Size: 512, Segment: seg})
		}, "belongs to no segment"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			segs, idx, _, bs := fixture(t)
			tc.corrupt(segs, idx, bs)
			_, err := Check(segs, idx)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Check = %v, want a report containing %q", err, tc.want)
			}
		})
	}
}

func TestRecyclerReuses(t *testing.T) {
	var r Recycler
	b := r.Get()
	b.Size, b.StreamUses = 512, append(b.StreamUses, 7)
	r.Put(b)
	c := r.Get()
	if c != b || c.Size != 0 || len(c.StreamUses) != 0 || cap(c.StreamUses) == 0 {
		t.Fatalf("recycled block not reset or not reused: %+v", c)
	}
}

// expandableFixture builds an expandable segment of four 2 KiB pages,
// pages 0 and 2 mapped: [1 KiB allocated][1 KiB free] [unmapped page]
// [2 KiB free] [unmapped page]. A free block beside an unmapped one is
// not merged with it.
func expandableFixture(t *testing.T) (*Segment, *FreeIndex, *Recycler, []*Block) {
	t.Helper()
	var r Recycler
	seg := &Segment{Ptr: 0x40000, Size: 8192, Stream: 1, Expandable: true, PageSize: 2048, Mapped: 4096}
	head := r.Get()
	head.Ptr, head.Size, head.Segment = seg.Ptr, seg.Size, seg
	seg.Head = head
	b1 := Split(head, 1024, &r)
	b2 := Split(b1, 1024, &r)
	b3 := Split(b2, 2048, &r)
	b4 := Split(b3, 2048, &r)
	head.Allocated = true
	b2.Unmapped, b4.Unmapped = true, true
	idx := NewStreamFreeIndex(1)
	idx.Insert(b1)
	idx.Insert(b3)
	return seg, idx, &r, []*Block{head, b1, b2, b3, b4}
}

func TestCheckExpandable(t *testing.T) {
	seg, idx, _, _ := expandableFixture(t)
	tot, err := Check([]*Segment{seg}, idx)
	if err != nil {
		t.Fatal(err)
	}
	if tot.ExpandableSegments != 1 || tot.SegmentBytes != 4096 || tot.AddressSpace != 8192 || tot.UnmappedCount != 2 ||
		tot.UnmappedBytes != 4096 || tot.FreeCount != 2 || tot.FreeBytes != 3072 || tot.InactiveSplitCount != 0 {
		t.Errorf("totals %+v", tot)
	}
	for _, tc := range []struct {
		name    string
		corrupt func(seg *Segment, idx *FreeIndex, r *Recycler, bs []*Block)
		want    string
	}{
		{"unmapped block indexed", func(_ *Segment, idx *FreeIndex, _ *Recycler, bs []*Block) { idx.Insert(bs[2]) }, "unmapped block[0x40800 +2048 unmapped] is in the free index"},
		{"unmapped neighbours", func(_ *Segment, _ *FreeIndex, r *Recycler, bs []*Block) {
			Split(bs[4], 1024, r).Unmapped = true
		}, "not merged"},
		{"unmapped off the page grid", func(_ *Segment, _ *FreeIndex, _ *Recycler, bs []*Block) {
			bs[3].Size -= 512
			bs[4].Ptr -= 512
			bs[4].Size += 512
		}, "page boundaries"},
		{"mapped bytes", func(seg *Segment, _ *FreeIndex, _ *Recycler, _ []*Block) { seg.Mapped = 2048 }, "mapped blocks add up to 4096"},
		{"unmapped and allocated", func(_ *Segment, _ *FreeIndex, _ *Recycler, bs []*Block) { bs[2].Allocated = true }, "unmapped but allocated"},
		{"page size", func(seg *Segment, _ *FreeIndex, _ *Recycler, _ []*Block) { seg.PageSize = 3000 }, "whole number"},
		{"free neighbours", func(_ *Segment, idx *FreeIndex, r *Recycler, bs []*Block) {
			idx.Delete(bs[3])
			idx.Insert(Split(bs[3], 1024, r))
			idx.Insert(bs[3])
		}, "not merged"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seg, idx, r, bs := expandableFixture(t)
			tc.corrupt(seg, idx, r, bs)
			_, err := Check([]*Segment{seg}, idx)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Check = %v, want a report containing %q", err, tc.want)
			}
		})
	}
	// An unmapped block in an ordinary segment is an error.
	segs, idx2, _, bs := fixture(t)
	bs[2].Allocated, bs[2].Unmapped = false, true
	if _, err := Check(segs, idx2); err == nil || !strings.Contains(err.Error(), "unmapped in an ordinary segment") {
		t.Errorf("Check = %v", err)
	}
}

func TestMergeUnmapped(t *testing.T) {
	seg, idx, r, bs := expandableFixture(t)
	// Unmap the free page between the two unmapped ones: all three merge.
	idx.Delete(bs[3])
	bs[3].Unmapped = true
	if n, bytes := MergeUnmapped(bs[3], r); n != 2 || bytes != 4096 {
		t.Fatalf("MergeUnmapped = %d, %d; want 2, 4096", n, bytes)
	}
	seg.Mapped -= 2048
	if bs[3].Ptr != 0x40800 || bs[3].Size != 6144 || bs[3].Prev != bs[1] || bs[3].Next != nil || bs[1].Next != bs[3] {
		t.Errorf("merged block %v has wrong links or extent", bs[3])
	}
	if _, err := Check([]*Segment{seg}, idx); err != nil {
		t.Fatal(err)
	}
}

func TestFreeIndexAfter(t *testing.T) {
	var r Recycler
	idx := NewStreamFreeIndex(1)
	mk := func(stream, ptr, size uint64) *Block {
		b := r.Get()
		b.Ptr, b.Size, b.Segment = ptr, size, &Segment{Stream: stream}
		idx.Insert(b)
		return b
	}
	a := mk(1, 0x1000, 512)
	b := mk(1, 0x2000, 1024)
	c := mk(1, 0x3000, 1024)
	for _, tc := range []struct{ from, want *Block }{{a, b}, {b, c}, {c, nil}} {
		if got := idx.After(tc.from); got != tc.want {
			t.Errorf("After(%v) = %v, want %v", tc.from, got, tc.want)
		}
	}
}

// TestStreamFreeIndex: an index of one stream orders by (size, address),
// answers nothing for other streams and refuses their blocks.
func TestStreamFreeIndex(t *testing.T) {
	var r Recycler
	idx := NewStreamFreeIndex(7)
	seg := &Segment{Stream: 7}
	mk := func(ptr, size uint64) *Block {
		b := r.Get()
		b.Ptr, b.Size, b.Segment = ptr, size, seg
		idx.Insert(b)
		return b
	}
	a := mk(0x3000, 1024)
	b := mk(0x1000, 2048)
	c := mk(0x2000, 1024)
	if got := idx.LowerBound(7, 1000); got != c {
		t.Errorf("LowerBound(7, 1000) = %v, want %v", got, c)
	}
	if got := idx.LowerBound(7, 1025); got != b {
		t.Errorf("LowerBound(7, 1025) = %v, want %v", got, b)
	}
	if got := idx.LowerBound(8, 512); got != nil {
		t.Errorf("LowerBound of another stream = %v", got)
	}
	if got := idx.After(c); got != a {
		t.Errorf("After(%v) = %v, want %v", c, got, a)
	}
	if got := idx.Largest(); got != b {
		t.Errorf("Largest = %v, want %v", got, b)
	}
	var sizes []uint64
	idx.DescendStream(7, 2048, func(x *Block) bool { sizes = append(sizes, x.Size); return true })
	if len(sizes) != 2 || sizes[0] != 1024 {
		t.Errorf("DescendStream below 2048: %v", sizes)
	}
	defer func() {
		if recover() == nil {
			t.Error("a block of stream 8 went into the index of stream 7")
		}
	}()
	o := r.Get()
	o.Ptr, o.Size, o.Segment = 0x9000, 512, &Segment{Stream: 8}
	idx.Insert(o)
}

// TestLowerBoundExcept: the first fitting block other than the one
// skipped, in either kind of index.
func TestLowerBoundExcept(t *testing.T) {
	for _, idx := range []*FreeIndex{NewStreamFreeIndex(1)} {
		var r Recycler
		seg := &Segment{Stream: 1}
		mk := func(ptr, size uint64) *Block {
			b := r.Get()
			b.Ptr, b.Size, b.Segment = ptr, size, seg
			idx.Insert(b)
			return b
		}
		a := mk(0x1000, 1024)
		b := mk(0x2000, 2048)
		if got := idx.LowerBoundExcept(1, 1024, a); got != b {
			t.Errorf("skipping %v: %v, want %v", a, got, b)
		}
		if got := idx.LowerBoundExcept(1, 1024, b); got != a {
			t.Errorf("skipping %v: %v, want %v", b, got, a)
		}
		if got := idx.LowerBoundExcept(1, 1500, b); got != nil {
			t.Errorf("skipping the only fit: %v", got)
		}
		if got := idx.LowerBoundExcept(2, 512, nil); got != nil {
			t.Errorf("another stream: %v", got)
		}
	}
}
