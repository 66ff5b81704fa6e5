package trace

import "github.com/allocd/allocd/snapshot"

// OpKind is the kind of a replayable operation.
type OpKind uint8

const (
	// OpAlloc allocates Op.Size bytes on Op.Stream under the new Op.ID.
	OpAlloc OpKind = iota + 1
	// OpFree frees the allocation Op.ID (the trace's free_requested, or its
	// free_completed when the trace has no free_requested for the block).
	OpFree
	// OpFreeCompleted returns Op.ID's block to the pool: it follows an
	// OpFree of the same ID that has Deferred set, and marks where the
	// stream that still used the block let it go.
	OpFreeCompleted
)

func (k OpKind) String() string {
	switch k {
	case OpAlloc:
		return "alloc"
	case OpFree:
		return "free"
	case OpFreeCompleted:
		return "free_completed"
	}
	return "OpKind(" + itoa(int(k)) + ")"
}

// Op is one replayable operation derived from a device trace.
type Op struct {
	Kind OpKind
	// Deferred is set on an OpFree whose block went back to the pool only
	// at a later OpFreeCompleted, with other allocations or frees in
	// between: the block was still in use by another stream (RecordStream).
	// When it is false, the block returns to the pool at the OpFree and no
	// OpFreeCompleted follows.
	Deferred bool
	// ID is the dense allocation ID: 0, 1, 2 ... in order of OpAlloc.
	ID int32
	// Size is the allocation's size in bytes (the alloc entry's size).
	Size uint64
	// Stream is the allocation's raw cudaStream_t.
	Stream uint64
}

// Ops is a device trace prepared for replay.
type Ops struct {
	// Ops are the operations in trace order.
	Ops []Op
	// NumIDs is the number of allocations, so IDs are 0..NumIDs-1.
	NumIDs int
	// UnmatchedFrees counts free_requested and free_completed entries of an
	// address with no live allocation (allocated before the trace started,
	// or already freed); they produce no op.
	UnmatchedFrees int
	// DoubleFrees counts the unmatched frees of an address whose last
	// allocation was already freed: a second free_requested, or a
	// free_completed after the free had completed. They are included in
	// UnmatchedFrees.
	DoubleFrees int
	// DuplicateAllocs counts allocs at an address that was still
	// allocated: the trace lost the free of the earlier allocation, which
	// stays live (and is counted in LiveAtEnd).
	DuplicateAllocs int
	// UncompletedFrees counts allocations whose free_requested has no
	// free_completed by the end of the trace; their OpFree is not Deferred.
	UncompletedFrees int
	// LiveAtEnd counts allocations never freed by the end of the trace,
	// including an allocation whose address was allocated again while it
	// was live (the trace lost its free).
	LiveAtEnd int
	// Streams lists the distinct streams of the allocations, in order of
	// first use.
	Streams []uint64
	// Ignored counts the entries BuildOps does not replay (segment_alloc,
	// segment_free, segment_map, segment_unmap, snapshot, oom, and any
	// other action), by action.
	Ignored map[snapshot.Action]int
}

// liveAlloc is an allocation that has not been freed yet.
type liveAlloc struct {
	id     int32
	size   uint64
	stream uint64
}

// pendingFree is an allocation whose free was requested but not completed.
type pendingFree struct {
	liveAlloc
	op      int // index of its OpFree in Ops
	primary int // alloc and free ops emitted before it
}

// BuildOps turns one device trace into replayable Ops (workload.Replay). Each
// alloc gets a fresh dense ID (addresses are reused over time). A
// free_requested of a live address becomes an OpFree of its ID; its
// free_completed is dropped when no alloc or free of another ID came in
// between, and otherwise marks the OpFree Deferred and becomes an
// OpFreeCompleted. A free_completed without a free_requested (older PyTorch)
// is the free. Frees of unknown addresses are counted, never fatal.
func BuildOps(entries []snapshot.Entry) Ops {
	b := opsBuilder{
		live:    make(map[uint64]liveAlloc),
		pending: make(map[uint64]pendingFree),
		freed:   make(map[uint64]bool),
		streams: make(map[uint64]bool),
	}
	b.out.Ops = make([]Op, 0, len(entries)*2/3+1)
	for i := range entries {
		b.add(&entries[i])
	}
	b.out.LiveAtEnd = len(b.live) + b.out.DuplicateAllocs
	b.out.UncompletedFrees = len(b.pending)
	return b.out
}

type opsBuilder struct {
	out     Ops
	live    map[uint64]liveAlloc   // by address
	pending map[uint64]pendingFree // by address
	freed   map[uint64]bool        // addresses whose last free completed
	streams map[uint64]bool
	primary int // alloc and free ops emitted so far
}

func (b *opsBuilder) add(e *snapshot.Entry) {
	switch e.Action {
	case snapshot.ActionAlloc:
		b.alloc(e)
	case snapshot.ActionFreeRequested:
		b.freeRequested(e)
	case snapshot.ActionFreeCompleted:
		b.freeCompleted(e)
	default:
		if b.out.Ignored == nil {
			b.out.Ignored = make(map[snapshot.Action]int)
		}
		b.out.Ignored[e.Action]++
	}
}

func (b *opsBuilder) alloc(e *snapshot.Entry) {
	a := liveAlloc{id: int32(b.out.NumIDs), size: e.Size, stream: e.Stream}
	b.out.NumIDs++
	if _, ok := b.live[e.Addr]; ok {
		b.out.DuplicateAllocs++
	}
	delete(b.freed, e.Addr)
	b.live[e.Addr] = a
	if !b.streams[e.Stream] {
		b.streams[e.Stream] = true
		b.out.Streams = append(b.out.Streams, e.Stream)
	}
	b.emit(OpAlloc, a)
}

func (b *opsBuilder) freeRequested(e *snapshot.Entry) {
	a, ok := b.live[e.Addr]
	if !ok {
		b.out.UnmatchedFrees++
		if _, pending := b.pending[e.Addr]; pending || b.freed[e.Addr] {
			b.out.DoubleFrees++
		}
		return
	}
	delete(b.live, e.Addr)
	if _, ok := b.pending[e.Addr]; ok {
		// A free of this address was never completed, yet the block was
		// handed out again: the trace lost that free_completed.
		b.out.UncompletedFrees++
	}
	b.pending[e.Addr] = pendingFree{liveAlloc: a, op: len(b.out.Ops), primary: b.primary}
	b.emit(OpFree, a)
}

func (b *opsBuilder) freeCompleted(e *snapshot.Entry) {
	if p, ok := b.pending[e.Addr]; ok {
		delete(b.pending, e.Addr)
		b.freed[e.Addr] = true
		if b.primary > p.primary+1 { // ops of other IDs since the OpFree
			b.out.Ops[p.op].Deferred = true
			b.out.Ops = append(b.out.Ops, Op{Kind: OpFreeCompleted, ID: p.id, Size: p.size, Stream: p.stream})
		}
		return
	}
	if a, ok := b.live[e.Addr]; ok { // no free_requested: this is the free
		delete(b.live, e.Addr)
		b.freed[e.Addr] = true
		b.emit(OpFree, a)
		return
	}
	b.out.UnmatchedFrees++
	if b.freed[e.Addr] {
		b.out.DoubleFrees++
	}
}

// emit appends an alloc or free op.
func (b *opsBuilder) emit(k OpKind, a liveAlloc) {
	b.out.Ops = append(b.out.Ops, Op{Kind: k, ID: a.id, Size: a.size, Stream: a.stream})
	b.primary++
}
