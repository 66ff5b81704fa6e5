// Package blocks holds the caching allocator's data structures and nothing
// of its policy: Block and Segment, the free index of one stream's blocks
// ordered by (size, address) in size bins of B+trees, split and merge, a
// recycler that keeps Block structs off the Go heap in steady state, and
// Check, which walks all of it and reports every broken invariant.
//
// A Segment is one device allocation. It is tiled exactly by a doubly linked
// chain of Blocks in address order; a Block is either allocated (handed out),
// pending (freed by its owner but still in use by a stream whose event has
// not completed) or free (available for reuse). A free block enters a
// FreeIndex after Merge has joined it with its free neighbours, so no two
// indexed blocks sit side by side. A caller may hold a free block out of
// every index for a while, unmerged (the allocator's front cache parks
// one per stream): it may then sit beside an indexed free block until it
// is merged and indexed. Check wants every free block indexed and none
// beside another.
//
// An expandable segment (Segment.Expandable) is a reserved range of virtual
// addresses into which physical pages are mapped on demand. Its blocks tile
// the whole range; those over unmapped pages are marked Unmapped. An
// unmapped block is never allocated nor indexed, starts and ends on page
// boundaries, and merges only with unmapped neighbours: a mapped free block
// and an unmapped block may sit side by side.
//
// Nothing here locks; the allocator serialises access.
package blocks

import (
	"fmt"
)

// Block is a contiguous range of one Segment.
type Block struct {
	// Ptr is the device address of the block's first byte.
	Ptr uint64
	// Size is the block's size in bytes (a multiple of 512).
	Size uint64
	// Requested is the size the caller asked for when the block was handed
	// out (0 while free).
	Requested uint64
	// Prev and Next link the blocks of one segment in address order.
	Prev, Next *Block
	// Segment is the segment the block belongs to.
	Segment *Segment
	// Allocated is true from Malloc until Free.
	Allocated bool
	// EventCount is the number of stream events that must complete before a
	// freed block may be reused.
	EventCount int
	// StreamUses lists streams other than the segment's own that used the
	// block while allocated (RecordStream).
	StreamUses []uint64
	// GCBase is the allocator's free-search count when the block was last
	// handed out; the garbage collector ages blocks by it.
	GCBase uint64
	// Lent is true from Malloc until Free for a block of an expandable
	// segment handed out to Borrower, a stream other than the segment's
	// (the allocator lends one when it cannot map memory for Borrower).
	Lent bool
	// Borrower is the stream a Lent block is allocated to.
	Borrower uint64
	// Unmapped is true for a block of an expandable segment whose pages
	// are not backed by physical memory. It is always false in an
	// ordinary segment.
	Unmapped bool
	// indexed is true while the block is in a FreeIndex.
	indexed bool
}

// Stream returns the stream the block's segment belongs to.
func (b *Block) Stream() uint64 { return b.Segment.Stream }

// Free reports whether the block is available for reuse: not allocated and
// not waiting for an event.
func (b *Block) Free() bool { return !b.Allocated && b.EventCount == 0 }

// IsSplit reports whether the block shares its segment with other blocks.
func (b *Block) IsSplit() bool { return b.Prev != nil || b.Next != nil }

// Indexed reports whether the block is in a FreeIndex.
func (b *Block) Indexed() bool { return b.indexed }

// String formats the block for error messages.
func (b *Block) String() string {
	state := "free"
	switch {
	case b.Allocated:
		state = "allocated"
	case b.EventCount > 0:
		state = "pending"
	case b.Unmapped:
		state = "unmapped"
	}
	return fmt.Sprintf("block[%#x +%d %s]", b.Ptr, b.Size, state)
}

// Segment is one device allocation, tiled by its blocks.
type Segment struct {
	// Ptr is the device address returned by the device malloc.
	Ptr uint64
	// Size is the segment's size in bytes.
	Size uint64
	// Stream is the stream the segment was allocated for; its blocks serve
	// only that stream. A private pool's segment has a pool stream
	// (PoolStream): DeviceStream gives the stream it was allocated for.
	Stream uint64
	// Small is true for the small pool (requests of at most 1 MiB).
	Small bool
	// Head is the block at the segment's first byte.
	Head *Block
	// Index is the segment's position in its owner's list (maintained by
	// the owner, used for O(1) removal).
	Index int
	// Expandable marks a reserved virtual range whose pages are mapped on
	// demand (expandable_segments:True). Ptr and Size are then the whole
	// reservation, and only Mapped bytes of it are backed by memory.
	Expandable bool
	// PageSize is the mapping granularity of an expandable segment (2 MiB
	// in the small pool, 20 MiB in the large); 0 otherwise.
	PageSize uint64
	// Mapped is the number of bytes of an expandable segment backed by
	// physical pages (the sum of its blocks that are not Unmapped).
	Mapped uint64
}

// Whole reports whether the segment is a single free block, i.e. can be
// returned to the device.
func (s *Segment) Whole() bool {
	return s.Head != nil && s.Head.Next == nil && s.Head.Free()
}

// Recycler hands out Block structs and takes them back, so that splitting
// and merging allocate nothing on the Go heap once warm. It allocates
// Blocks a slab at a time, so that the Blocks of one recycler (one
// allocator shard) share cache lines only with each other: goroutines
// working on different recyclers do not write to the same lines.
type Recycler struct {
	free []*Block
}

// recyclerSlab is how many Blocks a Recycler allocates at once.
const recyclerSlab = 32

// Get returns a zeroed Block.
func (r *Recycler) Get() *Block {
	if len(r.free) == 0 {
		slab := make([]Block, recyclerSlab)
		for i := range slab {
			r.free = append(r.free, &slab[len(slab)-1-i])
		}
	}
	n := len(r.free)
	b := r.free[n-1]
	r.free[n-1] = nil
	r.free = r.free[:n-1]
	return b
}

// Put returns b for reuse. b must no longer be referenced.
func (r *Recycler) Put(b *Block) {
	uses := b.StreamUses[:0]
	*b = Block{StreamUses: uses}
	r.free = append(r.free, b)
}

// Split cuts b in two: b keeps its first size bytes and a block taken from r
// gets the rest, linked after b. It returns the remainder, which carries no
// state (not allocated, no events). b must not be indexed.
func Split(b *Block, size uint64, r *Recycler) *Block {
	if b.indexed {
		panic("blocks: Split of an indexed block")
	}
	if size == 0 || size >= b.Size {
		panic(fmt.Sprintf("blocks: Split of %v at %d", b, size))
	}
	rest := r.Get()
	rest.Ptr = b.Ptr + size
	rest.Size = b.Size - size
	rest.Segment = b.Segment
	rest.GCBase = b.GCBase
	rest.Prev = b
	rest.Next = b.Next
	if b.Next != nil {
		b.Next.Prev = rest
	}
	b.Next = rest
	b.Size = size
	return rest
}

// Merge absorbs b's free neighbours into b, removing them from idx and
// returning their structs to r. b must be free and not indexed. It returns
// how many neighbours were absorbed and their total size.
func Merge(b *Block, idx *FreeIndex, r *Recycler) (n int, bytes uint64) {
	if p := b.Prev; p != nil && p.indexed {
		idx.Delete(p)
		n, bytes = n+1, bytes+absorbPrev(b, r)
	}
	if q := b.Next; q != nil && q.indexed {
		idx.Delete(q)
		n, bytes = n+1, bytes+absorbNext(b, r)
	}
	return n, bytes
}

// MergeUnmapped absorbs b's unmapped neighbours into b, returning their
// structs to r. b must be an unmapped block of an expandable segment. It
// returns how many neighbours were absorbed and their total size.
func MergeUnmapped(b *Block, r *Recycler) (n int, bytes uint64) {
	if !b.Unmapped {
		panic(fmt.Sprintf("blocks: MergeUnmapped of mapped %v", b))
	}
	if p := b.Prev; p != nil && p.Unmapped {
		n, bytes = n+1, bytes+absorbPrev(b, r)
	}
	if q := b.Next; q != nil && q.Unmapped {
		n, bytes = n+1, bytes+absorbNext(b, r)
	}
	return n, bytes
}

// absorbPrev extends b down over its predecessor, unlinks the predecessor
// and returns it to r; it returns the predecessor's size.
func absorbPrev(b *Block, r *Recycler) uint64 {
	p := b.Prev
	size := p.Size
	b.Ptr = p.Ptr
	b.Size += size
	b.Prev = p.Prev
	if p.Prev != nil {
		p.Prev.Next = b
	} else {
		b.Segment.Head = b
	}
	r.Put(p)
	return size
}

// absorbNext extends b up over its successor, unlinks the successor and
// returns it to r; it returns the successor's size.
func absorbNext(b *Block, r *Recycler) uint64 {
	q := b.Next
	size := q.Size
	b.Size += size
	b.Next = q.Next
	if q.Next != nil {
		q.Next.Prev = b
	}
	r.Put(q)
	return size
}

// Private pools' streams. An allocator keeps a private memory pool's
// blocks apart from the general cache's by giving its segments a pool
// stream: the device stream with PoolStreamBit set and the pool's
// sequence number in the bits from PoolSeqShift up. Blocks never cross
// streams, so a pool's free blocks serve only the allocations routed to
// the pool. A device stream must be below 1<<PoolSeqShift to be routed
// into a pool: CUDA streams are host pointers, and user-space addresses
// stay below 1<<47.
const (
	PoolStreamBit = 1 << 63
	PoolSeqShift  = 47
	// MaxPoolSeq is the largest sequence number a pool stream holds.
	MaxPoolSeq = 1<<(63-PoolSeqShift) - 1
)

// PoolStream returns the pool stream of the private pool numbered seq
// (1..MaxPoolSeq) on device stream s, and false when s is too large to
// carry one.
func PoolStream(seq, s uint64) (uint64, bool) {
	if s>>PoolSeqShift != 0 || seq == 0 || seq > MaxPoolSeq {
		return 0, false
	}
	return PoolStreamBit | seq<<PoolSeqShift | s, true
}

// DeviceStream returns the device stream of stream s: s itself, or for a
// pool stream the stream it was made from.
func DeviceStream(s uint64) uint64 {
	if s&PoolStreamBit == 0 {
		return s
	}
	return s & (1<<PoolSeqShift - 1)
}

// PoolSeq returns the pool sequence number of stream s, 0 when s is not a
// pool stream.
func PoolSeq(s uint64) uint64 {
	if s&PoolStreamBit == 0 {
		return 0
	}
	return s &^ PoolStreamBit >> PoolSeqShift
}
