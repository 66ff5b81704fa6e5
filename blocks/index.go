package blocks

import "fmt"

// FreeIndex holds the free blocks of one stream ordered by (size,
// address): the order best fit needs. Insert and Delete allocate nothing
// once the index has held its largest number of blocks (tree.go).
type FreeIndex struct {
	tree   tree
	bytes  uint64
	stream uint64
	// found is where the last search found its block, until the index
	// changes: a Malloc searches and then deletes the block it found, and
	// Delete takes it from there instead of searching again.
	found pos
}

// NewStreamFreeIndex returns an empty index for the blocks of stream.
// Inserting a block of another stream panics.
func NewStreamFreeIndex(stream uint64) *FreeIndex {
	return &FreeIndex{stream: stream}
}

// Len returns the number of blocks in the index.
func (x *FreeIndex) Len() int { return x.tree.len }

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
	x.found = pos{}
	x.tree.insert(entry{size: b.Size, ptr: b.Ptr, b: b})
}

// Delete removes b, which must be indexed.
func (x *FreeIndex) Delete(b *Block) {
	if !b.indexed {
		panic(fmt.Sprintf("blocks: %v deleted but not indexed", b))
	}
	f := x.found
	x.found = pos{}
	if !(f.valid() && f.i < f.l.n && f.block() == b && x.tree.removeAt(f)) && !x.tree.remove(b, b.Size, b.Ptr) {
		panic(fmt.Sprintf("blocks: %v marked indexed but missing from the index", b))
	}
	b.indexed = false
	x.bytes -= b.Size
}

// LowerBound returns the first block of stream whose size is at least size
// (the smallest such block, the lowest address among equals), or nil.
func (x *FreeIndex) LowerBound(stream, size uint64) *Block {
	if stream != x.stream {
		return nil
	}
	if p := x.tree.lowerBound(size, 0); p.valid() {
		x.found = p
		return p.block()
	}
	return nil
}

// LowerBoundExcept is LowerBound passing over skip: the first block of
// stream whose size is at least size, other than skip.
func (x *FreeIndex) LowerBoundExcept(stream, size uint64, skip *Block) *Block {
	if stream != x.stream {
		return nil
	}
	p := x.tree.lowerBound(size, 0)
	if p.valid() && p.block() == skip {
		p = p.next()
	}
	if p.valid() {
		x.found = p
		return p.block()
	}
	return nil
}

// After returns the block that follows b, which must be indexed, in
// (size, address) order, or nil.
func (x *FreeIndex) After(b *Block) *Block {
	p := x.tree.find(b, b.Size, b.Ptr)
	if !b.indexed || !p.valid() {
		panic(fmt.Sprintf("blocks: After(%v), which is not indexed", b))
	}
	if p = p.next(); p.valid() {
		return p.block()
	}
	return nil
}

// DescendStream calls fn for the blocks of stream whose size is below
// limit, largest first, until fn returns false.
func (x *FreeIndex) DescendStream(stream, limit uint64, fn func(*Block) bool) {
	if stream != x.stream {
		return
	}
	p := x.tree.lowerBound(limit, 0)
	if p.valid() {
		p = p.prev()
	} else {
		p = x.tree.tail()
	}
	for ; p.valid(); p = p.prev() {
		if !fn(p.block()) {
			return
		}
	}
}

// Largest returns the largest block (the highest address among equals),
// or nil.
func (x *FreeIndex) Largest() *Block {
	if p := x.tree.tail(); p.valid() {
		return p.block()
	}
	return nil
}

// Ascend calls fn for every block in (size, address) order until fn
// returns false. fn must not modify the index; collect first.
func (x *FreeIndex) Ascend(fn func(*Block) bool) {
	for p := x.tree.head(); p.valid(); p = p.next() {
		if !fn(p.block()) {
			return
		}
	}
}

// ascendEntries is Ascend with the size and address each block is filed
// under, for Check.
func (x *FreeIndex) ascendEntries(fn func(e *entry)) {
	for p := x.tree.head(); p.valid(); p = p.next() {
		fn(p.entry())
	}
}
