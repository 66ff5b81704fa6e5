package trace

// Action is the kind of a trace entry, spelled as PyTorch spells it in the
// snapshot ("alloc", "free_requested", ...).
type Action string

// The actions PyTorch's CUDA caching allocator records (TraceEntry::Action in
// c10/cuda/CUDACachingAllocator.h). Read rejects any other action.
const (
	// ActionAlloc is a block handed out to the caller.
	ActionAlloc Action = "alloc"
	// ActionFreeRequested is the caller's free of a block.
	ActionFreeRequested Action = "free_requested"
	// ActionFreeCompleted is the block's return to the pool; later than
	// ActionFreeRequested when another stream still used the block.
	ActionFreeCompleted Action = "free_completed"
	// ActionSegmentAlloc is a cudaMalloc of a new segment.
	ActionSegmentAlloc Action = "segment_alloc"
	// ActionSegmentFree is a cudaFree of a segment.
	ActionSegmentFree Action = "segment_free"
	// ActionSegmentMap is a mapping of pages into an expandable segment.
	ActionSegmentMap Action = "segment_map"
	// ActionSegmentUnmap is an unmapping of pages from an expandable segment.
	ActionSegmentUnmap Action = "segment_unmap"
	// ActionSnapshot marks the moment a snapshot was taken.
	ActionSnapshot Action = "snapshot"
	// ActionOOM is an out-of-memory failure; Entry.Addr holds the device's
	// free bytes at that moment (the snapshot's "device_free" key).
	ActionOOM Action = "oom"
)

// Known reports whether a is one of the actions PyTorch records.
func (a Action) Known() bool {
	switch a {
	case ActionAlloc, ActionFreeRequested, ActionFreeCompleted,
		ActionSegmentAlloc, ActionSegmentFree, ActionSegmentMap,
		ActionSegmentUnmap, ActionSnapshot, ActionOOM:
		return true
	}
	return false
}

// Entry is one event of a device trace.
type Entry struct {
	// Action says what happened.
	Action Action
	// Addr is the device address of the block or segment; for ActionOOM it
	// is the device's free memory in bytes, as PyTorch records it.
	Addr uint64
	// Size is the size in bytes (the requested size for an OOM).
	Size uint64
	// Stream is the raw cudaStream_t value (0 for the default stream).
	// PyTorch pickles it as a signed 64-bit integer; negative values are
	// kept as their two's complement.
	Stream uint64
	// TimeUS is the time of the event in microseconds, as recorded.
	TimeUS int64
	// Frames is the Python stack of the event, innermost first; nil unless
	// ReadOptions.Frames was set. Entries recorded with the same stack may
	// share one slice: treat it as read-only.
	Frames []Frame
}

// Frame is one frame of a recorded stack.
type Frame struct {
	Filename string
	Line     int
	Name     string
}

// Block is one block of a segment at the moment of the snapshot.
type Block struct {
	// Address is the block's device address.
	Address uint64
	// Size is the block's size in bytes.
	Size uint64
	// RequestedSize is the size the caller asked for.
	RequestedSize uint64
	// State is "active_allocated", "active_pending_free" or "inactive".
	State string
	// Frames is the stack that allocated the block, innermost first; nil
	// unless ReadOptions.Frames was set. Read-only, may be shared.
	Frames []Frame
}

// Segment is one device allocation (cudaMalloc or expandable range) at the
// moment of the snapshot.
type Segment struct {
	// Device is the CUDA device index.
	Device int
	// Address is the segment's first device address.
	Address uint64
	// TotalSize is the segment's size in bytes.
	TotalSize uint64
	// AllocatedSize is the sum of its allocated blocks' sizes.
	AllocatedSize uint64
	// ActiveSize is the sum of its active (allocated or pending) blocks'
	// sizes.
	ActiveSize uint64
	// RequestedSize is the sum of its active blocks' requested sizes.
	RequestedSize uint64
	// Stream is the raw cudaStream_t the segment belongs to.
	Stream uint64
	// SegmentType is "large" or "small".
	SegmentType string
	// IsExpandable is true for an expandable segment.
	IsExpandable bool
	// Blocks tile the segment in address order.
	Blocks []Block
	// Frames is the stack that allocated the segment, innermost first; nil
	// unless ReadOptions.Frames was set. Read-only, may be shared.
	Frames []Frame
}

// Snapshot is a decoded memory snapshot.
type Snapshot struct {
	// Segments are the allocator's segments when the snapshot was taken.
	Segments []Segment
	// DeviceTraces holds one trace per device, indexed by device; a device
	// with history recording off has an empty trace.
	DeviceTraces [][]Entry
	// AllocatorSettings is the snapshot's "allocator_settings" dict, decoded
	// generically: strings, bool, int64 (uint64 or *big.Int when larger),
	// float64, nil, []byte, []any (lists and tuples) and map[string]any.
	// Nil when the snapshot has none.
	AllocatorSettings map[string]any
}
