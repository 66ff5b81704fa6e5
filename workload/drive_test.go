package workload

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"go.uber.org/zap"
)

// testTrace is the small trace in the repository
// (testdata/traces/README.md).
const testTrace = "../testdata/traces/resnet50_train.pickle.gz"

// loadTestTrace is the small trace in the repository, loaded for replay.
func loadTestTrace(t *testing.T) *Trace {
	t.Helper()
	tr, err := LoadTrace(testTrace)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func newLoadAllocator(t *testing.T, manualEvents bool) *allocator.Allocator {
	t.Helper()
	dev, err := simdev.New(simdev.Config{Capacity: 141 << 30, ManualEvents: manualEvents})
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(dev, allocator.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	return a
}

func TestPacer(t *testing.T) {
	p := NewPacer(context.Background(), 2000)
	t0 := time.Now()
	for i := range 200 {
		p.Observe(i)
	}
	if d := time.Since(t0); d < 90*time.Millisecond || d > 2*time.Second {
		t.Errorf("200 operations at 2000/s took %v, want about 100ms", d)
	}

	unpaced := NewPacer(context.Background(), 0)
	t0 = time.Now()
	for i := range 100000 {
		unpaced.Observe(i)
	}
	if d := time.Since(t0); d > 100*time.Millisecond {
		t.Errorf("unpaced observe took %v for 100000 operations", d)
	}

	ctx, cancel := context.WithCancel(context.Background())
	slow := NewPacer(ctx, 1) // one a second
	time.AfterFunc(50*time.Millisecond, cancel)
	t0 = time.Now()
	for i := range 10 {
		slow.Observe(i)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Errorf("a cancelled pacer still slept: %v", d)
	}
}

func TestSyntheticWorkload(t *testing.T) {
	a := newLoadAllocator(t, false)
	w := &Load{Loop: true}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := w.Run(ctx, a, 0, zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	st := a.Stats()
	if st.Allocation[allocator.PoolAll].Allocated < 100 || st.NumDeviceAlloc == 0 {
		t.Errorf("synthetic workload made %d allocations and %d device mallocs", st.Allocation[allocator.PoolAll].Allocated, st.NumDeviceAlloc)
	}
	if n := st.Allocation[allocator.PoolAll].Current; n != 0 {
		t.Errorf("%d allocations still live after the workload stopped", n)
	}
	if err := a.Check(); err != nil {
		t.Error(err)
	}
}

// TestReplayWorkloadLoops replays the test trace unpaced until at least
// two passes are done, then stops it: nothing stays allocated.
func TestReplayWorkloadLoops(t *testing.T) {
	w := &Load{Trace: loadTestTrace(t), Loop: true}
	a := newLoadAllocator(t, true)
	perPass := w.Trace.Ops.NumIDs
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, a, 0, zap.NewNop()) }()
	deadline := time.After(2 * time.Minute)
	for a.Stats().Allocation[allocator.PoolAll].Allocated < int64(2*perPass) {
		select {
		case err := <-done:
			t.Fatalf("replay stopped early: %v", err)
		case <-deadline:
			t.Fatal("two passes took more than two minutes")
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	st := a.Stats()
	if n := st.Allocation[allocator.PoolAll].Current; n != 0 {
		t.Errorf("%d allocations still live after the replay stopped", n)
	}
	if st.NumEmptyCache == 0 {
		t.Error("no empty cache between passes")
	}
	if err := a.Check(); err != nil {
		t.Error(err)
	}
}

// TestReplayWorkloadOnce replays the trace once and keeps its final state
// until stopped.
func TestReplayWorkloadOnce(t *testing.T) {
	w := &Load{Trace: loadTestTrace(t)}
	a := newLoadAllocator(t, true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx, a, 0, zap.NewNop()) }()
	total := int64(w.Trace.Ops.NumIDs)
	deadline := time.After(time.Minute)
	// The pass is over once every allocation was made and what the trace
	// frees after its last one is freed; a fixed wait after the last
	// allocation could end before those frees on a loaded machine.
	for st := a.Stats(); st.Allocation[allocator.PoolAll].Allocated < total ||
		st.Allocation[allocator.PoolAll].Current != int64(w.Trace.Ops.LiveAtEnd); st = a.Stats() {
		select {
		case err := <-done:
			t.Fatalf("replay returned before shutdown: %v", err)
		case <-deadline:
			t.Fatal("one pass took more than a minute")
		case <-time.After(10 * time.Millisecond):
		}
	}
	time.Sleep(50 * time.Millisecond)
	st := a.Stats()
	if got := st.Allocation[allocator.PoolAll].Allocated; got != total {
		t.Errorf("%d allocations after one pass, want %d (the trace's)", got, total)
	}
	if got, want := st.Allocation[allocator.PoolAll].Current, int64(w.Trace.Ops.LiveAtEnd); got != want {
		t.Errorf("%d allocations live after the pass, want the trace's %d", got, want)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := a.Stats().Allocation[allocator.PoolAll].Current; n != 0 {
		t.Errorf("%d allocations still live after the replay stopped", n)
	}
}

// TestPacerDue: the due time of an operation never overflows. A rate too
// small for the due time to fit, or NaN, gives the largest due time (the
// workload waits), never a time in the past (the workload would run
// unpaced).
func TestPacerDue(t *testing.T) {
	for _, tc := range []struct {
		n, rate float64
		want    time.Duration
	}{
		{1, 1000, time.Millisecond},
		{3, 2, 1500 * time.Millisecond},
		{1e6, 1e9, time.Millisecond},
		{1, 1e-300, maxPacerDue},
		{1, 5e-324, maxPacerDue},
		{1, math.NaN(), maxPacerDue},
		{math.Inf(1), math.Inf(1), maxPacerDue},
		{1e12, 0.01, maxPacerDue}, // 1e14 s: beyond 146 years
		{1, math.Inf(1), 0},
		{1, -1, 0},
	} {
		if got := pacerDue(tc.n, tc.rate); got != tc.want {
			t.Errorf("pacerDue(%g, %g) = %v, want %v", tc.n, tc.rate, got, tc.want)
		}
	}
}

// TestPacerTinyRate: a pacer at a rate too small to represent (which the
// flags reject) holds the workload until its context ends instead of
// running it unpaced.
func TestPacerTinyRate(t *testing.T) {
	for _, rate := range []float64{1e-300, math.NaN()} {
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		p := NewPacer(ctx, rate)
		t0 := time.Now()
		done := 0
		for i := range 1000 {
			p.Observe(i)
			if ctx.Err() == nil {
				done++
			}
		}
		cancel()
		if d := time.Since(t0); done > 1 || d < 100*time.Millisecond || d > 5*time.Second {
			t.Errorf("rate %g: %d operations before the context ended, %v in all; want 1, then a wait until the context ended (150ms)", rate, done, d)
		}
	}
}

// TestLoadTraceErrors: every error of LoadTrace names the file, and a
// snapshot without a device trace is refused with a word on recording one.
func TestLoadTraceErrors(t *testing.T) {
	if _, err := LoadTrace("no/such/trace.pickle"); err == nil || !strings.Contains(err.Error(), "no/such/trace.pickle") {
		t.Errorf("LoadTrace of a missing file = %v", err)
	}
	path := filepath.Join(t.TempDir(), "empty.pickle")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := snapshot.WritePickle(f, &snapshot.Snapshot{}); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadTrace(path); err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "_record_memory_history") {
		t.Errorf("LoadTrace of a snapshot without a trace = %v", err)
	}
}
