package allocator

import (
	"sort"
	"time"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// Trace actions, with PyTorch's names (TraceEntry::Action).
const (
	actionAlloc          = "alloc"
	actionFreeRequested  = "free_requested"
	actionFreeCompleted  = "free_completed"
	actionSegmentAlloc   = "segment_alloc"
	actionSegmentFree    = "segment_free"
	actionSegmentMap     = "segment_map"
	actionSegmentUnmap   = "segment_unmap"
	actionOOM            = "oom"
	actionSnapshotMarker = "snapshot"
)

// TraceEntry is one recorded allocator event, named as in PyTorch's
// snapshot device_traces.
type TraceEntry struct {
	// Action is one of alloc, free_requested, free_completed,
	// segment_alloc, segment_free, segment_map, segment_unmap, oom.
	Action string
	// Addr is the block or segment address; for oom, the device's free
	// bytes at the failure, as PyTorch records it.
	Addr uint64
	// Size is, as PyTorch records it, the size the caller asked for (alloc,
	// free_requested, free_completed), the segment or mapping size
	// (segment_*), or the size asked of the device (oom).
	Size uint64
	// Stream is the stream of the block or segment.
	Stream uint64
	// TimeUS is the wall-clock time in microseconds since the Unix epoch.
	TimeUS int64
}

// history is a bounded ring of trace entries.
type history struct {
	ring  []TraceEntry
	next  int
	full  bool
	start time.Time
}

func newHistory(limit int) *history {
	return &history{ring: make([]TraceEntry, limit), start: time.Now()}
}

func (h *history) add(e TraceEntry) {
	h.ring[h.next] = e
	h.next++
	if h.next == len(h.ring) {
		h.next, h.full = 0, true
	}
}

func (h *history) entries() []TraceEntry {
	if !h.full {
		return append([]TraceEntry(nil), h.ring[:h.next]...)
	}
	out := make([]TraceEntry, 0, len(h.ring))
	out = append(out, h.ring[h.next:]...)
	return append(out, h.ring[:h.next]...)
}

// WithHistory turns on history recording: the last limit allocator events
// are kept in a ring and returned in Snapshot's DeviceTraces. Recording
// reads the clock on every event; off (the default) it costs one nil check.
func WithHistory(limit int) Option {
	return func(o *options) { o.historyLimit = max(limit, 0) }
}

// record adds an event to the history when recording is on.
func (a *Allocator) record(action string, addr, size uint64, stream cudart.Stream) {
	if a.history == nil {
		return
	}
	a.history.add(TraceEntry{Action: action, Addr: addr, Size: size, Stream: uint64(stream), TimeUS: time.Now().UnixMicro()})
}

// BlockInfo describes one block of a segment in a Snapshot.
type BlockInfo struct {
	Address       uint64
	Size          uint64
	RequestedSize uint64
	// State is "active_allocated", "active_pending_free" or "inactive", as
	// in PyTorch's snapshots.
	State string
}

// SegmentInfo describes one segment in a Snapshot.
type SegmentInfo struct {
	Device        int
	Address       uint64
	TotalSize     uint64
	Stream        uint64
	SegmentType   string // "small" or "large"
	AllocatedSize uint64
	ActiveSize    uint64
	RequestedSize uint64
	// IsExpandable marks one contiguous mapped range of an expandable
	// segment; Address and TotalSize are the range's, and unmapped address
	// space is not listed, as in PyTorch's snapshots.
	IsExpandable bool
	Blocks       []BlockInfo
}

// Snapshot is the allocator's state in the shape of
// torch.cuda.memory._snapshot(): segments sorted by address, each with its
// blocks, and the recorded history (empty unless WithHistory).
type Snapshot struct {
	Segments     []SegmentInfo
	DeviceTraces [][]TraceEntry
	// Config is the configuration string in effect (allocator_settings).
	Config string
}

// Snapshot returns the allocator's segments and blocks, and its history
// when recording is on.
func (a *Allocator) Snapshot() Snapshot {
	a.mu.Lock()
	defer a.mu.Unlock()
	snap := Snapshot{Segments: make([]SegmentInfo, 0, len(a.segments)), Config: a.cfg.String()}
	for _, s := range a.segments {
		if s.Expandable {
			snap.Segments = a.appendExpandableInfo(snap.Segments, s)
			continue
		}
		si := a.segmentInfo(s, s.Ptr)
		si.TotalSize = s.Size
		for b := s.Head; b != nil; b = b.Next {
			si.addBlock(b)
		}
		snap.Segments = append(snap.Segments, si)
	}
	sort.Slice(snap.Segments, func(i, j int) bool { return snap.Segments[i].Address < snap.Segments[j].Address })
	var traces []TraceEntry
	if a.history != nil {
		traces = a.history.entries()
	}
	snap.DeviceTraces = [][]TraceEntry{traces}
	return snap
}

// segmentInfo describes segment s from address addr on, without blocks.
func (a *Allocator) segmentInfo(s *blocks.Segment, addr uint64) SegmentInfo {
	si := SegmentInfo{Device: a.info.Index, Address: addr, Stream: s.Stream, SegmentType: "large", IsExpandable: s.Expandable}
	if s.Small {
		si.SegmentType = "small"
	}
	return si
}

// addBlock appends b to the segment's blocks and adds up its sizes.
func (si *SegmentInfo) addBlock(b *blocks.Block) {
	bi := BlockInfo{Address: b.Ptr, Size: b.Size, RequestedSize: b.Requested, State: "inactive"}
	switch {
	case b.Allocated:
		bi.State = "active_allocated"
		si.AllocatedSize += b.Size
		si.ActiveSize += b.Size
		si.RequestedSize += b.Requested
	case b.EventCount > 0:
		bi.State = "active_pending_free"
		si.ActiveSize += b.Size
		si.RequestedSize += b.Requested
	}
	si.Blocks = append(si.Blocks, bi)
}
