package workload

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/trace"
)

// TestReplayWarm: the warm pass of a recorded trace runs from the cache
// the first pass filled (no device malloc), counts the same operations as
// a cold replay, and leaves no stream behind; with events (the Sim's
// RecordStream path) and with delayed frees (a GPU's).
func TestReplayWarm(t *testing.T) {
	for _, c := range []struct {
		trace  string
		events bool
	}{
		{"resnet50_train", true},
		{"multistream_prefetch", true},
		{"multistream_prefetch", false},
	} {
		tr, err := LoadTrace("../testdata/traces/" + c.trace + ".pickle.gz")
		if err != nil {
			t.Fatal(err)
		}
		cold, err := Replay(&tr.Ops, newLoadAllocator(t, c.events), ReplayOptions{})
		if err != nil {
			t.Fatal(err)
		}
		a := newLoadAllocator(t, c.events)
		warm, err := ReplayWarm(&tr.Ops, a, ReplayOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if cold.DeviceMallocs == 0 || warm.DeviceMallocs != 0 || warm.DeviceMallocTime != 0 {
			t.Errorf("%s (events %v): %d device mallocs cold, %d (%v) warm; want some, then none",
				c.trace, c.events, cold.DeviceMallocs, warm.DeviceMallocs, warm.DeviceMallocTime)
		}
		if warm.Ops != cold.Ops || warm.Elapsed <= 0 || warm.PeakReserved != cold.PeakReserved {
			t.Errorf("%s (events %v): warm %d ops in %v, peak reserved %d; cold %d ops, %d",
				c.trace, c.events, warm.Ops, warm.Elapsed, warm.PeakReserved, cold.Ops, cold.PeakReserved)
		}
		if live := a.Device().(*simdev.Sim).Counters().LiveStream; live != 0 {
			t.Errorf("%s (events %v): %d streams left after the warm replay", c.trace, c.events, live)
		}
	}
}

// TestReplayCountsOps: Ops counts allocations and frees, not a deferred
// free's completion, whether the replay runs to the end, stops at Stop,
// or runs without the allocator (DriverCost); a free of an allocation the
// driver gave no address fails the dry run.
func TestReplayCountsOps(t *testing.T) {
	ops := &trace.Ops{NumIDs: 2, Streams: []uint64{0, 7}, Ops: []trace.Op{
		{Kind: trace.OpAlloc, ID: 0, Size: 512, Stream: 7},
		{Kind: trace.OpAlloc, ID: 1, Size: 1 << 20},
		{Kind: trace.OpFree, ID: 0, Deferred: true},
		{Kind: trace.OpFree, ID: 1},
		{Kind: trace.OpFreeCompleted, ID: 0},
	}}
	for _, c := range []struct {
		name   string
		stop   int
		events bool
		want   int
	}{
		{"whole, events", 0, true, 4},
		{"whole, delayed frees", 0, false, 4},
		{"stopped", 2, true, 2},
	} {
		r, err := Replay(ops, newLoadAllocator(t, c.events), ReplayOptions{Stop: c.stop})
		if err != nil || r.Ops != c.want {
			t.Errorf("%s: %d ops, err %v; want %d", c.name, r.Ops, err, c.want)
		}
	}
	d, err := DriverCost(ops)
	if err != nil || d.Ops != 4 || d.Elapsed <= 0 {
		t.Errorf("DriverCost: %d ops in %v, err %v; want 4", d.Ops, d.Elapsed, err)
	}
	// A free of an allocation without an address (one that failed, or of
	// size 0, or, as here, never made) is skipped, as the anchor's loop
	// skips a null pointer, with the allocator and without.
	bad := &trace.Ops{NumIDs: 2, Ops: []trace.Op{{Kind: trace.OpFree, ID: 0}, {Kind: trace.OpAlloc, ID: 1, Size: 0}, {Kind: trace.OpFree, ID: 1}}}
	if r, err := DriverCost(bad); err != nil || r.Ops != 3 {
		t.Errorf("DriverCost of frees without an address: %d ops, err %v; want 3", r.Ops, err)
	}
	if r, err := Replay(bad, newLoadAllocator(t, false), ReplayOptions{}); err != nil || r.Ops != 3 {
		t.Errorf("Replay of frees without an address: %d ops, err %v; want 3", r.Ops, err)
	}
}

// BenchmarkReplayDriver reports DriverCost on the recorded trace: the
// replay loop's own cost per operation, the allocator left out.
func BenchmarkReplayDriver(b *testing.B) {
	tr, err := LoadTrace(testTrace)
	if err != nil {
		b.Fatal(err)
	}
	var last ReplayResult
	for b.Loop() {
		if last, err = DriverCost(&tr.Ops); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(last.NsPerOp(), "ns/trace-op")
}

// TestReplayStopsBetweenChunks: a context cancelled during a replay stops
// it at the next check, every replayChunk operations, with Ops counting
// what ran before.
func TestReplayStopsBetweenChunks(t *testing.T) {
	tr := loadTestTrace(t)
	if len(tr.Ops.Ops) <= replayChunk {
		t.Fatalf("the test trace has %d operations, want more than %d", len(tr.Ops.Ops), replayChunk)
	}
	want := 0
	for _, op := range tr.Ops.Ops[:replayChunk] {
		if op.Kind != trace.OpFreeCompleted {
			want++
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r, err := Replay(&tr.Ops, newLoadAllocator(t, true), ReplayOptions{Ctx: ctx, Observe: func(i int) {
		if i == 100 {
			cancel()
		}
	}})
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), fmt.Sprintf("stopped at operation %d", replayChunk)) || r.Ops != want {
		t.Errorf("cancelled at operation 100: %d ops, err %v; want %d ops, stopped at operation %d", r.Ops, err, want, replayChunk)
	}
}
