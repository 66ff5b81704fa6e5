package blocks

import (
	"fmt"

	"github.com/google/btree"
)

// btreeDegree is the B-tree's minimum degree. 32 keeps a node's keys within
// a few cache lines and the tree shallow for tens of thousands of blocks.
const btreeDegree = 32

func lessBlock(a, b *Block) bool {
	if as, bs := a.Segment.Stream, b.Segment.Stream; as != bs {
		return as < bs
	}
	if a.Size != b.Size {
		return a.Size < b.Size
	}
	return a.Ptr < b.Ptr
}

// lessSizeAddr orders the blocks of one stream.
func lessSizeAddr(a, b *Block) bool {
	if a.Size != b.Size {
		return a.Size < b.Size
	}
	return a.Ptr < b.Ptr
}

// FreeIndex holds free blocks ordered by (stream, size, address): the order
// best fit needs. Insert and Delete allocate nothing once the tree's node
// free list is warm. An index from NewStreamFreeIndex holds one stream's
// blocks only, and its comparisons never load a block's Segment.
type FreeIndex struct {
	tree   *btree.BTreeG[*Block]
	bytes  uint64
	single bool   // one stream only
	stream uint64 // that stream
	// pivot is the search key; a field so that searches do not allocate.
	pivot    Block
	pivotSeg Segment
}

// NewFreeIndex returns an empty index.
func NewFreeIndex() *FreeIndex {
	idx := &FreeIndex{
		tree: btree.NewWithFreeListG(btreeDegree, lessBlock, btree.NewFreeListG[*Block](1024)),
	}
	idx.pivot.Segment = &idx.pivotSeg
	return idx
}

// NewStreamFreeIndex returns an empty index for the blocks of one stream,
// ordered by (size, address). Inserting a block of another stream panics.
func NewStreamFreeIndex(stream uint64) *FreeIndex {
	idx := &FreeIndex{
		tree:   btree.NewWithFreeListG(btreeDegree, lessSizeAddr, btree.NewFreeListG[*Block](1024)),
		single: true,
		stream: stream,
	}
	idx.pivot.Segment = &idx.pivotSeg
	return idx
}

// Len returns the number of blocks in the index.
func (x *FreeIndex) Len() int { return x.tree.Len() }

// Bytes returns the total size of the blocks in the index.
func (x *FreeIndex) Bytes() uint64 { return x.bytes }

// Insert adds b, which must be free and not already indexed.
func (x *FreeIndex) Insert(b *Block) {
	if b.indexed {
		panic(fmt.Sprintf("blocks: %v inserted twice", b))
	}
	if x.single && b.Segment.Stream != x.stream {
		panic(fmt.Sprintf("blocks: %v of stream %#x inserted in the index of stream %#x", b, b.Segment.Stream, x.stream))
	}
	b.indexed = true
	x.bytes += b.Size
	x.tree.ReplaceOrInsert(b)
}

// Delete removes b, which must be indexed.
func (x *FreeIndex) Delete(b *Block) {
	if !b.indexed {
		panic(fmt.Sprintf("blocks: %v deleted but not indexed", b))
	}
	if _, ok := x.tree.Delete(b); !ok {
		panic(fmt.Sprintf("blocks: %v marked indexed but missing from the tree", b))
	}
	b.indexed = false
	x.bytes -= b.Size
}

// LowerBound returns the first block of stream whose size is at least size
// (the smallest such block, the lowest address among equals), or nil.
func (x *FreeIndex) LowerBound(stream, size uint64) *Block {
	x.pivotSeg.Stream, x.pivot.Size, x.pivot.Ptr = stream, size, 0
	var found *Block
	if x.single {
		if stream != x.stream {
			return nil
		}
		x.tree.AscendGreaterOrEqual(&x.pivot, func(b *Block) bool {
			found = b
			return false
		})
		return found
	}
	x.tree.AscendGreaterOrEqual(&x.pivot, func(b *Block) bool {
		if b.Segment.Stream == stream {
			found = b
		}
		return false
	})
	return found
}

// LowerBoundExcept is LowerBound passing over skip: the first block of
// stream whose size is at least size, other than skip, in one descent.
func (x *FreeIndex) LowerBoundExcept(stream, size uint64, skip *Block) *Block {
	if x.single && stream != x.stream {
		return nil
	}
	x.pivotSeg.Stream, x.pivot.Size, x.pivot.Ptr = stream, size, 0
	var found *Block
	x.tree.AscendGreaterOrEqual(&x.pivot, func(b *Block) bool {
		if b == skip {
			return true
		}
		if x.single || b.Segment.Stream == stream {
			found = b
		}
		return false
	})
	return found
}

// After returns the block that follows b, which must be indexed, in
// (stream, size, address) order when it belongs to b's stream, or nil.
func (x *FreeIndex) After(b *Block) *Block {
	if !b.indexed {
		panic(fmt.Sprintf("blocks: After(%v), which is not indexed", b))
	}
	var found *Block
	x.tree.AscendGreaterOrEqual(b, func(c *Block) bool {
		if c == b {
			return true
		}
		if x.single || c.Segment.Stream == b.Segment.Stream {
			found = c
		}
		return false
	})
	return found
}

// DescendStream calls fn for the blocks of stream whose size is below
// limit, largest first, until fn returns false.
func (x *FreeIndex) DescendStream(stream, limit uint64, fn func(*Block) bool) {
	if x.single && stream != x.stream {
		return
	}
	x.pivotSeg.Stream, x.pivot.Size, x.pivot.Ptr = stream, limit, 0
	x.tree.DescendLessOrEqual(&x.pivot, func(b *Block) bool {
		if b.Segment.Stream != stream {
			return false
		}
		if b.Size >= limit {
			return true
		}
		return fn(b)
	})
}

// Largest returns the largest block of any stream, or nil. It costs
// O(streams · log n): the last block of each stream is its largest.
func (x *FreeIndex) Largest() *Block {
	if x.single {
		b, _ := x.tree.Max()
		return b
	}
	var best *Block
	last, ok := x.tree.Max()
	for ok {
		if best == nil || last.Size > best.Size {
			best = last
		}
		stream := last.Segment.Stream
		if stream == 0 {
			break
		}
		// The greatest block of a lower stream: descend from (stream, 0, 0),
		// skipping the pivot itself should a block ever equal it.
		x.pivotSeg.Stream, x.pivot.Size, x.pivot.Ptr = stream, 0, 0
		ok = false
		x.tree.DescendLessOrEqual(&x.pivot, func(b *Block) bool {
			if b.Segment.Stream == stream {
				return true
			}
			last, ok = b, true
			return false
		})
	}
	return best
}

// Ascend calls fn for every block in (stream, size, address) order until
// fn returns false. fn must not modify the index; collect first.
func (x *FreeIndex) Ascend(fn func(*Block) bool) {
	x.tree.Ascend(fn)
}
