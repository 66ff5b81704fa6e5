// Package snapshot is the model of a PyTorch CUDA memory snapshot, the
// dict that torch.cuda.memory._snapshot() returns: segments, their blocks,
// and per-device traces of entries with their stack frames. The allocator
// produces it, package trace reads it from pickles and RMM logs, and
// WritePickle writes it as a pickle that PyTorch's tools read.
//
// # Writing
//
// WritePickle writes a Snapshot with the dict layout and key names PyTorch
// uses, using only opcodes that Python's pickle and the memory_viz web page's
// own unpickler (torch/utils/viz/MemoryViz.js) understand, so that
// torch.cuda._memory_viz and https://pytorch.org/memory_viz read it.
package snapshot

// Action is the kind of a trace entry, spelled as PyTorch spells it in the
// snapshot ("alloc", "free_requested", ...).
type Action string

// The actions PyTorch's CUDA caching allocator records (TraceEntry::Action in
// c10/cuda/CUDACachingAllocator.h). trace.Read rejects any other action.
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

// BlockState is the state of a block in a snapshot, spelled as PyTorch
// spells it.
type BlockState string

// The block states of PyTorch's snapshots.
const (
	// BlockActiveAllocated is a block handed out and not yet freed.
	BlockActiveAllocated BlockState = "active_allocated"
	// BlockActivePendingFree is a freed block whose memory another stream
	// may still use (it waits for events recorded by RecordStream).
	BlockActivePendingFree BlockState = "active_pending_free"
	// BlockInactive is a free (cached) block.
	BlockInactive BlockState = "inactive"
)

// Entry is one event of a device trace. Its JSON form uses PyTorch's key
// names; for ActionOOM the "addr" key holds the device's free bytes (the
// pickle names it "device_free", as PyTorch does).
type Entry struct {
	// Action says what happened.
	Action Action `json:"action"`
	// Addr is the device address of the block or segment; for ActionOOM it
	// is the device's free memory in bytes, as PyTorch records it.
	Addr uint64 `json:"addr"`
	// Size is the size in bytes (the requested size for an OOM).
	Size uint64 `json:"size"`
	// Stream is the raw cudaStream_t value (0 for the default stream).
	// PyTorch pickles it as a signed 64-bit integer; negative values are
	// kept as their two's complement.
	Stream uint64 `json:"stream"`
	// TimeUS is the time of the event in microseconds, as recorded.
	TimeUS int64 `json:"time_us"`
	// Frames is the stack of the event, innermost first: the Python stack
	// of a PyTorch snapshot (nil unless trace.ReadOptions.Frames was set), or the
	// Go call site of an allocd allocation recorded with a stack depth.
	// Entries recorded with the same stack may share one slice: treat it
	// as read-only.
	Frames []Frame `json:"frames,omitempty"`
}

// Frame is one frame of a recorded stack.
type Frame struct {
	Filename string `json:"filename"`
	Line     int    `json:"line"`
	Name     string `json:"name"`
}

// Block is one block of a segment at the moment of the snapshot.
type Block struct {
	// Address is the block's device address.
	Address uint64 `json:"address"`
	// Size is the block's size in bytes.
	Size uint64 `json:"size"`
	// RequestedSize is the size the caller asked for.
	RequestedSize uint64 `json:"requested_size"`
	// State is BlockActiveAllocated, BlockActivePendingFree or
	// BlockInactive (trace.Read keeps whatever the pickle says).
	State BlockState `json:"state"`
	// Frames is the stack that allocated the block, innermost first; nil
	// unless recorded (trace.ReadOptions.Frames when reading). Read-only, may be
	// shared.
	Frames []Frame `json:"frames,omitempty"`
}

// Segment is one device allocation (cudaMalloc or expandable range) at the
// moment of the snapshot.
type Segment struct {
	// Device is the CUDA device index.
	Device int `json:"device"`
	// Address is the segment's first device address.
	Address uint64 `json:"address"`
	// TotalSize is the segment's size in bytes.
	TotalSize uint64 `json:"total_size"`
	// AllocatedSize is the sum of its allocated blocks' sizes.
	AllocatedSize uint64 `json:"allocated_size"`
	// ActiveSize is the sum of its active (allocated or pending) blocks'
	// sizes.
	ActiveSize uint64 `json:"active_size"`
	// RequestedSize is the sum of its active blocks' requested sizes.
	RequestedSize uint64 `json:"requested_size"`
	// Stream is the raw cudaStream_t the segment belongs to.
	Stream uint64 `json:"stream"`
	// SegmentType is "large" or "small".
	SegmentType string `json:"segment_type"`
	// IsExpandable is true for an expandable segment.
	IsExpandable bool `json:"is_expandable"`
	// PoolID is the private pool that owns the segment (torch's
	// MempoolId_t), {0, 0} for the general cache.
	PoolID [2]uint64 `json:"segment_pool_id"`
	// Blocks tile the segment in address order.
	Blocks []Block `json:"blocks"`
	// Frames is the stack that allocated the segment, innermost first; nil
	// unless recorded. Read-only, may be shared.
	Frames []Frame `json:"frames,omitempty"`
}

// Snapshot is a memory snapshot in the shape of
// torch.cuda.memory._snapshot(): what trace.Read decodes, what WritePickle
// writes, and (with encoding/json) its JSON view, with PyTorch's key names.
type Snapshot struct {
	// Segments are the allocator's segments when the snapshot was taken.
	Segments []Segment `json:"segments"`
	// DeviceTraces holds one trace per device, indexed by device; a device
	// with history recording off has an empty trace.
	DeviceTraces [][]Entry `json:"device_traces"`
	// AllocatorSettings is the snapshot's "allocator_settings" dict, decoded
	// generically: strings, bool, int64 (uint64 or *big.Int when larger),
	// float64, nil, []byte, []any (lists and tuples) and map[string]any.
	// Nil when the snapshot has none.
	AllocatorSettings map[string]any `json:"allocator_settings"`
}

// Merge combines snapshots of several devices into one, as
// torch.cuda.memory._snapshot() covers every device: the segments of each
// in the order given, and device_traces indexed by device, where the
// entries of every snapshot's trace at position d are appended to
// position d of the result (so snapshots of distinct devices, each with
// its trace at its own index, land side by side). AllocatorSettings is
// the first non-nil one. Nil snapshots are skipped; the result shares the
// Frames slices of its inputs.
func Merge(snaps ...*Snapshot) *Snapshot {
	out := &Snapshot{Segments: []Segment{}, DeviceTraces: [][]Entry{}}
	for _, s := range snaps {
		if s == nil {
			continue
		}
		out.Segments = append(out.Segments, s.Segments...)
		for d, tr := range s.DeviceTraces {
			for len(out.DeviceTraces) <= d {
				out.DeviceTraces = append(out.DeviceTraces, []Entry{})
			}
			out.DeviceTraces[d] = append(out.DeviceTraces[d], tr...)
		}
		if out.AllocatorSettings == nil {
			out.AllocatorSettings = s.AllocatorSettings
		}
	}
	return out
}
