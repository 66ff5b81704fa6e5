package bench

import (
	"bytes"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/trace"
	"github.com/allocd/allocd/workload"
)

// TestSnapshotRoundTrip: read each recorded trace, replay it with history
// recording on, write allocd's snapshot as a pickle, read that back with
// our own reader: the allocations and frees come back in the same order,
// with the same sizes, and streams map one to one.
func TestSnapshotRoundTrip(t *testing.T) {
	eachTrace(t, func(t *testing.T, name, path string) {
		ops, plan := loadOps(t, path)
		sim, err := simdev.New(simdev.Config{Capacity: 141 << 30, ManualEvents: true, Addresses: plan})
		if err != nil {
			t.Fatal(err)
		}
		a, err := allocator.New(sim, allocator.DefaultConfig(), allocator.WithHistory(4_000_000))
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		if _, err := workload.Replay(ops, a, workload.ReplayOptions{}); err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if err := a.WriteSnapshot(&buf); err != nil {
			t.Fatal(err)
		}
		back, err := trace.Read(&buf, trace.ReadOptions{})
		if err != nil {
			t.Fatalf("our reader rejects our snapshot: %v", err)
		}
		got := trace.BuildOps(back.DeviceTraces[0])
		want, gotSeq := primaryOps(ops.Ops), primaryOps(got.Ops)
		if len(gotSeq) != len(want) {
			t.Fatalf("%d allocations and frees came back, want %d", len(gotSeq), len(want))
		}
		streams := map[uint64]uint64{}
		for i := range want {
			w, g := want[i], gotSeq[i]
			if w.Kind != g.Kind || w.ID != g.ID || w.Size != g.Size {
				t.Fatalf("operation %d: got %v #%d of %d bytes, want %v #%d of %d bytes", i, g.Kind, g.ID, g.Size, w.Kind, w.ID, w.Size)
			}
			if s, ok := streams[w.Stream]; ok && s != g.Stream {
				t.Fatalf("operation %d: trace stream %#x maps to two streams", i, w.Stream)
			}
			streams[w.Stream] = g.Stream
		}
		if got.UnmatchedFrees != 0 {
			t.Errorf("%d unmatched frees in our own history", got.UnmatchedFrees)
		}
	})
}

// primaryOps keeps the allocations and frees (not the deferred
// completions, whose position depends on when events are polled).
func primaryOps(ops []trace.Op) []trace.Op {
	out := make([]trace.Op, 0, len(ops))
	for _, op := range ops {
		if op.Kind != trace.OpFreeCompleted {
			out = append(out, op)
		}
	}
	return out
}
