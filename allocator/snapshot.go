package allocator

import (
	"fmt"
	"io"
	"sort"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/snapshot"
)

// Snapshot returns the allocator's state in the shape of
// torch.cuda.memory._snapshot(), as the one snapshot model of package
// snapshot: segments sorted by address, each with its blocks (an expandable
// segment as one segment per contiguous mapped range), and DeviceTraces
// with one trace per device index up to this device's, this device's
// history at its index (empty unless history is recorded) and the others
// empty, so that snapshots of several devices merge with snapshot.Merge.
// AllocatorSettings holds "PYTORCH_CUDA_ALLOC_CONF" (Config().String())
// and "backend": "allocd". Frames appear when history records stacks.
//
// encoding/json renders the result with PyTorch's key names; WriteSnapshot
// writes it as the pickle memory_viz opens. The snapshot shares nothing
// mutable with the allocator.
func (a *Allocator) Snapshot() *snapshot.Snapshot {
	a.lockWorld()
	defer a.unlockWorld()
	snap := &snapshot.Snapshot{
		Segments: make([]snapshot.Segment, 0, len(a.segs.list)),
		AllocatorSettings: map[string]any{
			"PYTORCH_CUDA_ALLOC_CONF": a.cfg.String(),
			"backend":                 "allocd",
		},
	}
	for _, s := range a.segs.list {
		if s.Expandable {
			snap.Segments = a.appendExpandableInfo(snap.Segments, s)
			continue
		}
		si := a.segmentInfo(s, s.Ptr)
		si.TotalSize = s.Size
		for b := s.Head; b != nil; b = b.Next {
			a.addBlock(&si, b)
		}
		snap.Segments = append(snap.Segments, si)
	}
	sort.Slice(snap.Segments, func(i, j int) bool { return snap.Segments[i].Address < snap.Segments[j].Address })
	idx := max(a.info.Index, 0)
	snap.DeviceTraces = make([][]snapshot.Entry, idx+1)
	for i := range snap.DeviceTraces {
		snap.DeviceTraces[i] = []snapshot.Entry{}
	}
	if a.history != nil {
		snap.DeviceTraces[idx] = a.history.traceEntries()
	}
	return snap
}

// WriteSnapshot writes Snapshot() to w as the pickle that
// torch.cuda.memory._dump_snapshot writes, which pytorch.org/memory_viz
// and torch.cuda._memory_viz open (snapshot.WritePickle). It returns the
// first error of w.
func (a *Allocator) WriteSnapshot(w io.Writer) error {
	if err := snapshot.WritePickle(w, a.Snapshot()); err != nil {
		return fmt.Errorf("allocator: writing a snapshot: %w", err)
	}
	return nil
}

// segmentInfo describes segment s from address addr on, without blocks.
func (a *Allocator) segmentInfo(s *blocks.Segment, addr uint64) snapshot.Segment {
	si := snapshot.Segment{Device: a.info.Index, Address: addr, Stream: blocks.DeviceStream(s.Stream), SegmentType: "large",
		IsExpandable: s.Expandable, PoolID: a.poolIDOf(s.Stream), Blocks: []snapshot.Block{}}
	if s.Small {
		si.SegmentType = "small"
	}
	return si
}

// addBlock appends b to the segment's blocks and adds up its sizes.
func (a *Allocator) addBlock(si *snapshot.Segment, b *blocks.Block) {
	bi := snapshot.Block{Address: b.Ptr, Size: b.Size, RequestedSize: b.Requested, State: snapshot.BlockInactive}
	switch {
	case b.Allocated:
		bi.State = snapshot.BlockActiveAllocated
		si.AllocatedSize += b.Size
		si.ActiveSize += b.Size
		si.RequestedSize += b.Requested
		if h := a.history; h != nil && h.live != nil {
			bi.Frames = h.resolve(h.live[b.Ptr])
		}
	case b.EventCount > 0:
		bi.State = snapshot.BlockActivePendingFree
		si.ActiveSize += b.Size
		si.RequestedSize += b.Requested
	}
	si.Blocks = append(si.Blocks, bi)
}
