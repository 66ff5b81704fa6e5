package blocks

import (
	"fmt"
	"math/bits"
)

// The free index is segregated by size class: each class (bin) of sizes
// keeps its blocks in a tree of its own (tree.go), ordered by (size,
// address), and a two-level bitmap says which bins hold any. Bins follow
// one another in size order, so the index's order is the bins' in turn:
// exactly the (size, address) order best fit needs, with no difference in
// what a search finds.
//
// What the bins buy is the cost of a real mix. A stream's pool holds a
// hundred or two free blocks of many sizes, and every Malloc and Free of
// a mix inserts or deletes one to three of them. In one tree each change
// descends from the root and shifts half a leaf of entries; in a bin of a
// few blocks it is a search of a short leaf and a shift of an entry or
// two. A search whose bin holds nothing large enough moves to the next
// non-empty bin with two bit scans.
//
// A bin spans a sixteenth of a power of two: sizes below 16 have a bin
// each, and above, the bin of a size is its exponent and its four bits
// after the leading one. Bins come in groups of 64, one bitmap word each,
// made when one of their bins first gets a block and kept after: a
// workload's sizes span a few powers of two, so an index holds a few
// groups, and a bin's tree is found with two loads and no hashing.

const (
	binSubBits = 4                                   // bins per power of two: 1 << binSubBits
	numBins    = (64 - binSubBits + 1) << binSubBits // bins 0..975 hold every uint64 size
	binWords   = (numBins + 63) / 64                 // bitmap words, and groups of bins
)

// binGroup holds the trees of 64 consecutive bins.
type binGroup [64]tree

// binOf returns the bin of size: monotone in size.
func binOf(size uint64) int {
	if size < 1<<binSubBits {
		return int(size)
	}
	e := bits.Len64(size) - 1 // at least binSubBits
	return (e-binSubBits+1)<<binSubBits | int(size>>(e-binSubBits)&(1<<binSubBits-1))
}

// FreeIndex holds the free blocks of one stream ordered by (size,
// address): the order best fit needs. Insert and Delete allocate nothing
// once the index has held its largest number of blocks in each bin.
type FreeIndex struct {
	groups  [binWords]*binGroup // bin i is groups[i>>6][i&63]
	words   [binWords]uint64    // bit i: bin i holds a block
	summary uint64              // bit w: words[w] is not zero
	spare   spares              // nodes the bins' trees dropped
	len     int
	bytes   uint64
	stream  uint64
	// found is where the last search found its block, until the index
	// changes: a Malloc searches and then deletes the block it found, and
	// Delete takes it from there instead of searching again.
	found at
}

// at is a position in the index: a bin and a position in its tree, or past
// the end when p is not valid.
type at struct {
	bin int
	p   pos
}

func (a at) valid() bool { return a.p.valid() }

// NewStreamFreeIndex returns an empty index for the blocks of stream.
// Inserting a block of another stream panics.
func NewStreamFreeIndex(stream uint64) *FreeIndex {
	return &FreeIndex{stream: stream}
}

// Len returns the number of blocks in the index.
func (x *FreeIndex) Len() int { return x.len }

// Bytes returns the total size of the blocks in the index.
func (x *FreeIndex) Bytes() uint64 { return x.bytes }

// Insert adds b, which must be free and not already indexed. b's Size and
// Ptr must not change until it is deleted: the index files it under them.
func (x *FreeIndex) Insert(b *Block) {
	if b.indexed {
		panic(fmt.Sprintf("blocks: %v inserted twice", b))
	}
	if b.Segment.Stream != x.stream {
		panic(fmt.Sprintf("blocks: %v of stream %#x inserted in the index of stream %#x", b, b.Segment.Stream, x.stream))
	}
	b.indexed = true
	x.bytes += b.Size
	x.len++
	x.found = at{}
	i := binOf(b.Size)
	g := x.groups[i>>6]
	if g == nil {
		g = new(binGroup)
		for k := range g {
			g[k].spare = &x.spare
		}
		x.groups[i>>6] = g
	}
	t := &g[i&63]
	if t.len == 0 {
		x.words[i>>6] |= 1 << (i & 63)
		x.summary |= 1 << (i >> 6)
	}
	t.insert(entry{size: b.Size, ptr: b.Ptr, b: b})
}

// Delete removes b, which must be indexed.
func (x *FreeIndex) Delete(b *Block) {
	if !b.indexed {
		panic(fmt.Sprintf("blocks: %v deleted but not indexed", b))
	}
	f := x.found
	x.found = at{}
	i := binOf(b.Size)
	t := x.bin(i)
	if t == nil || !(f.bin == i && f.p.valid() && f.p.i < f.p.l.n && f.p.block() == b && t.removeAt(f.p)) && !t.remove(b, b.Size, b.Ptr) {
		panic(fmt.Sprintf("blocks: %v marked indexed but missing from the index", b))
	}
	if t.len == 0 {
		if x.words[i>>6] &^= 1 << (i & 63); x.words[i>>6] == 0 {
			x.summary &^= 1 << (i >> 6)
		}
	}
	b.indexed = false
	x.bytes -= b.Size
	x.len--
}

// bin returns the tree of bin i, or nil when its group was never made.
func (x *FreeIndex) bin(i int) *tree {
	g := x.groups[i>>6]
	if g == nil {
		return nil
	}
	return &g[i&63]
}

// nextBin returns the first bin from i on that holds a block, or -1.
func (x *FreeIndex) nextBin(i int) int {
	if i >= numBins {
		return -1
	}
	w := i >> 6
	if m := x.words[w] >> (i & 63); m != 0 {
		return i + bits.TrailingZeros64(m)
	}
	s := x.summary >> (w + 1)
	if s == 0 {
		return -1
	}
	w += 1 + bits.TrailingZeros64(s)
	return w<<6 + bits.TrailingZeros64(x.words[w])
}

// prevBin returns the last bin up to i that holds a block, or -1.
func (x *FreeIndex) prevBin(i int) int {
	if i < 0 {
		return -1
	}
	w := i >> 6
	if m := x.words[w] << (63 - i&63); m != 0 {
		return i - bits.LeadingZeros64(m)
	}
	s := x.summary & (1<<w - 1)
	if s == 0 {
		return -1
	}
	w = 63 - bits.LeadingZeros64(s)
	return w<<6 + 63 - bits.LeadingZeros64(x.words[w])
}

// lowerBound returns the position of the first block at or after (size,
// ptr).
func (x *FreeIndex) lowerBound(size, ptr uint64) at {
	i := binOf(size)
	if t := x.bin(i); t != nil && t.len > 0 {
		if p := t.lowerBound(size, ptr); p.valid() {
			return at{i, p}
		}
	}
	return x.headFrom(i + 1)
}

// headFrom returns the first position of the first bin from i on that
// holds a block.
func (x *FreeIndex) headFrom(i int) at {
	if i = x.nextBin(i); i < 0 {
		return at{}
	}
	return at{i, x.bin(i).head()}
}

// tailTo returns the last position of the last bin up to i that holds a
// block.
func (x *FreeIndex) tailTo(i int) at {
	if i = x.prevBin(i); i < 0 {
		return at{}
	}
	return at{i, x.bin(i).tail()}
}

func (x *FreeIndex) next(a at) at {
	if p := a.p.next(); p.valid() {
		return at{a.bin, p}
	}
	return x.headFrom(a.bin + 1)
}

func (x *FreeIndex) prev(a at) at {
	if p := a.p.prev(); p.valid() {
		return at{a.bin, p}
	}
	return x.tailTo(a.bin - 1)
}

// LowerBound returns the first block of stream whose size is at least size
// (the smallest such block, the lowest address among equals), or nil.
func (x *FreeIndex) LowerBound(stream, size uint64) *Block {
	if stream != x.stream {
		return nil
	}
	if a := x.lowerBound(size, 0); a.valid() {
		x.found = a
		return a.p.block()
	}
	return nil
}

// LowerBoundExcept is LowerBound passing over skip: the first block of
// stream whose size is at least size, other than skip.
func (x *FreeIndex) LowerBoundExcept(stream, size uint64, skip *Block) *Block {
	if stream != x.stream {
		return nil
	}
	a := x.lowerBound(size, 0)
	if a.valid() && a.p.block() == skip {
		a = x.next(a)
	}
	if a.valid() {
		x.found = a
		return a.p.block()
	}
	return nil
}

// After returns the block that follows b, which must be indexed, in
// (size, address) order, or nil.
func (x *FreeIndex) After(b *Block) *Block {
	var a at
	i := binOf(b.Size)
	if t := x.bin(i); b.indexed && t != nil {
		a = at{i, t.find(b, b.Size, b.Ptr)}
	}
	if !a.valid() {
		panic(fmt.Sprintf("blocks: After(%v), which is not indexed", b))
	}
	if a = x.next(a); a.valid() {
		return a.p.block()
	}
	return nil
}

// DescendStream calls fn for the blocks of stream whose size is below
// limit, largest first, until fn returns false.
func (x *FreeIndex) DescendStream(stream, limit uint64, fn func(*Block) bool) {
	if stream != x.stream {
		return
	}
	a := x.lowerBound(limit, 0)
	if a.valid() {
		a = x.prev(a)
	} else {
		a = x.tailTo(numBins - 1)
	}
	for ; a.valid(); a = x.prev(a) {
		if !fn(a.p.block()) {
			return
		}
	}
}

// Largest returns the largest block (the highest address among equals),
// or nil.
func (x *FreeIndex) Largest() *Block {
	if a := x.tailTo(numBins - 1); a.valid() {
		return a.p.block()
	}
	return nil
}

// Ascend calls fn for every block in (size, address) order until fn
// returns false. fn must not modify the index; collect first.
func (x *FreeIndex) Ascend(fn func(*Block) bool) {
	for a := x.headFrom(0); a.valid(); a = x.next(a) {
		if !fn(a.p.block()) {
			return
		}
	}
}

// ascendEntries is Ascend with the size and address each block is filed
// under, for Check.
func (x *FreeIndex) ascendEntries(fn func(e *entry)) {
	for a := x.headFrom(0); a.valid(); a = x.next(a) {
		fn(a.p.entry())
	}
}

// check walks every bin and reports the first broken invariant: each bin's
// tree is sound and holds only sizes of its bin, the bitmap marks exactly
// the bins that hold blocks, and the bins' blocks add up to the index's
// count.
func (x *FreeIndex) check() error {
	n := 0
	for i := range numBins {
		t := x.bin(i)
		marked := x.words[i>>6]&(1<<(i&63)) != 0
		if t == nil {
			if marked {
				return fmt.Errorf("bin %d is marked but has no tree", i)
			}
			continue
		}
		if err := t.check(); err != nil {
			return fmt.Errorf("bin %d: %w", i, err)
		}
		if marked != (t.len > 0) {
			return fmt.Errorf("bin %d holds %d blocks and is marked %v", i, t.len, marked)
		}
		for p := t.head(); p.valid(); p = p.next() {
			if e := p.entry(); binOf(e.size) != i {
				return fmt.Errorf("bin %d holds size %d, of bin %d", i, e.size, binOf(e.size))
			}
		}
		n += t.len
	}
	for w, word := range x.words {
		if (word != 0) != (x.summary&(1<<w) != 0) {
			return fmt.Errorf("the summary's bit %d disagrees with its word", w)
		}
	}
	if x.summary>>binWords != 0 {
		return fmt.Errorf("the summary marks words past the bins")
	}
	if n != x.len {
		return fmt.Errorf("the bins hold %d blocks, the index counts %d", n, x.len)
	}
	return nil
}
