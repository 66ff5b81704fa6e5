package bench

import (
	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/trace"
)

// TraceSnapshot converts an allocator snapshot into the trace package's
// model of PyTorch's snapshot, which trace.WritePickle writes in the form
// torch.cuda._memory_viz reads. Streams are the device's stream handles.
func TraceSnapshot(s allocator.Snapshot) *trace.Snapshot {
	out := &trace.Snapshot{
		Segments:          make([]trace.Segment, len(s.Segments)),
		DeviceTraces:      make([][]trace.Entry, len(s.DeviceTraces)),
		AllocatorSettings: map[string]any{"PYTORCH_CUDA_ALLOC_CONF": s.Config, "backend": "allocd"},
	}
	for i, seg := range s.Segments {
		ts := trace.Segment{
			Device: seg.Device, Address: seg.Address, TotalSize: seg.TotalSize,
			AllocatedSize: seg.AllocatedSize, ActiveSize: seg.ActiveSize, RequestedSize: seg.RequestedSize,
			Stream: seg.Stream, SegmentType: seg.SegmentType, IsExpandable: seg.IsExpandable,
			Blocks: make([]trace.Block, len(seg.Blocks)),
		}
		for j, b := range seg.Blocks {
			ts.Blocks[j] = trace.Block{Address: b.Address, Size: b.Size, RequestedSize: b.RequestedSize, State: b.State}
		}
		out.Segments[i] = ts
	}
	for d, entries := range s.DeviceTraces {
		te := make([]trace.Entry, len(entries))
		for i, e := range entries {
			te[i] = trace.Entry{Action: trace.Action(e.Action), Addr: e.Addr, Size: e.Size, Stream: e.Stream, TimeUS: e.TimeUS}
		}
		out.DeviceTraces[d] = te
	}
	return out
}
