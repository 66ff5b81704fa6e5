package main

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// serveTestTrace is the trace the serve tests replay.
const serveTestTrace = "../../testdata/resnet50_train.pickle.gz"

func needServeTestTrace(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(serveTestTrace); err != nil {
		t.Skipf("no test trace: %v", err)
	}
}

func newLoadAllocator(t *testing.T, manualEvents bool) *allocator.Allocator {
	t.Helper()
	dev, err := cudart.NewSim(cudart.SimConfig{Capacity: 141 << 30, ManualEvents: manualEvents})
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
	p := newServePacer(context.Background(), 2000)
	t0 := time.Now()
	for i := range 200 {
		p.observe(i)
	}
	if d := time.Since(t0); d < 90*time.Millisecond || d > 2*time.Second {
		t.Errorf("200 operations at 2000/s took %v, want about 100ms", d)
	}

	unpaced := newServePacer(context.Background(), 0)
	t0 = time.Now()
	for i := range 100000 {
		unpaced.observe(i)
	}
	if d := time.Since(t0); d > 100*time.Millisecond {
		t.Errorf("unpaced observe took %v for 100000 operations", d)
	}

	ctx, cancel := context.WithCancel(context.Background())
	slow := newServePacer(ctx, 1) // one a second
	time.AfterFunc(50*time.Millisecond, cancel)
	t0 = time.Now()
	for i := range 10 {
		slow.observe(i)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Errorf("a cancelled pacer still slept: %v", d)
	}
}

func TestSyntheticWorkload(t *testing.T) {
	a := newLoadAllocator(t, false)
	w, err := newServeWorkload(serveFlags{synthetic: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := w.run(ctx, a, 0, zap.NewNop()); err != nil {
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
	needServeTestTrace(t)
	w, err := newServeWorkload(serveFlags{replay: serveTestTrace, loop: true})
	if err != nil {
		t.Fatal(err)
	}
	a := newLoadAllocator(t, true)
	perPass := w.ops.NumIDs
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.run(ctx, a, 0, zap.NewNop()) }()
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
	needServeTestTrace(t)
	w, err := newServeWorkload(serveFlags{replay: serveTestTrace, rate: 0})
	if err != nil {
		t.Fatal(err)
	}
	a := newLoadAllocator(t, true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.run(ctx, a, 0, zap.NewNop()) }()
	total := int64(w.ops.NumIDs)
	deadline := time.After(time.Minute)
	for a.Stats().Allocation[allocator.PoolAll].Allocated < total {
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
	if got, want := st.Allocation[allocator.PoolAll].Current, int64(w.ops.LiveAtEnd); got != want {
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

func TestServeFlagErrors(t *testing.T) {
	for _, c := range []struct {
		f    serveFlags
		want string
	}{
		{serveFlags{device: "gpu", simCapacity: "1GiB"}, "--device"},
		{serveFlags{device: "sim", simCapacity: "lots"}, "--sim-capacity"},
		{serveFlags{device: "cuda", simCapacity: "1GiB", replay: "x"}, "simulated devices only"},
		{serveFlags{device: "cuda:1", simCapacity: "1GiB", synthetic: true}, "simulated devices only"},
		{serveFlags{device: "cuda:all", simCapacity: "1GiB", synthetic: true}, "simulated devices only"},
		{serveFlags{device: "sim:0", simCapacity: "1GiB"}, "1 to 64"},
		{serveFlags{device: "sim:65", simCapacity: "1GiB"}, "1 to 64"},
		{serveFlags{device: "cuda:some", simCapacity: "1GiB"}, "cuda:N"},
		{serveFlags{device: "sim", simCapacity: "1GiB", replay: "x", synthetic: true}, "exclusive"},
		{serveFlags{device: "sim", simCapacity: "1GiB", loop: true}, "--loop"},
		{serveFlags{device: "sim", simCapacity: "1GiB", rate: -1}, "--replay-rate"},
		{serveFlags{device: "sim", simCapacity: "1GiB", history: -1}, "--history"},
	} {
		if _, _, err := checkServeFlags(c.f); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("checkServeFlags(%+v) = %v, want an error about %s", c.f, err, c.want)
		}
	}
	if _, err := newServeWorkload(serveFlags{replay: "testdata/does-not-exist.pickle"}); err == nil || !strings.Contains(err.Error(), "--replay") {
		t.Errorf("newServeWorkload of a missing file = %v", err)
	}
	if _, err := newLoggerTo(os.Stderr, false, "verbose"); err == nil || !strings.Contains(err.Error(), "--log-level") {
		t.Errorf("newLoggerTo(verbose) = %v", err)
	}
}

// TestServeReplayDevice: for a replay, the simulated device has manual
// events and hands out the trace's recorded segment addresses.
func TestServeReplayDevice(t *testing.T) {
	needServeTestTrace(t)
	f := serveFlags{device: "sim", simCapacity: "141GiB", replay: serveTestTrace}
	spec, capacity, err := checkServeFlags(f)
	if err != nil {
		t.Fatal(err)
	}
	w, err := newServeWorkload(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.addresses) == 0 {
		t.Fatal("no segment addresses read from the trace")
	}
	devs, err := openServeDevices(spec, capacity, w)
	if err != nil {
		t.Fatal(err)
	}
	defer closeDevices(devs)
	dev := devs[0]
	sim := dev.(*cudart.Sim)
	if len(devs) != 1 || !sim.ManualEvents() {
		t.Errorf("replay devices: %d, manual events %v; want 1 with manual events", len(devs), sim.ManualEvents())
	}
	first := w.addresses[0]
	if p, err := dev.Malloc(first.Size); err != nil || p != first.Addr {
		t.Errorf("first Malloc = %#x, %v; want the trace's %#x", uint64(p), err, uint64(first.Addr))
	}
	syn, err := openServeDevices(spec, capacity, &serveWorkload{})
	if err != nil {
		t.Fatal(err)
	}
	defer closeDevices(syn)
	if syn[0].(*cudart.Sim).ManualEvents() {
		t.Error("synthetic workload's device has manual events")
	}

	// On sim:3 every device replays with manual events, and device i gets
	// the trace's addresses moved by i TiB: no two devices share one.
	spec3, _, err := checkServeFlags(serveFlags{device: "sim:3", simCapacity: "141GiB", replay: serveTestTrace})
	if err != nil {
		t.Fatal(err)
	}
	devs3, err := openServeDevices(spec3, capacity, w)
	if err != nil {
		t.Fatal(err)
	}
	defer closeDevices(devs3)
	if len(devs3) != 3 {
		t.Fatalf("sim:3 opened %d devices", len(devs3))
	}
	for i, dev := range devs3 {
		sim := dev.(*cudart.Sim)
		if dev.Info().Index != i || !sim.ManualEvents() {
			t.Errorf("device %d: index %d, manual events %v", i, dev.Info().Index, sim.ManualEvents())
		}
		want := first.Addr + cudart.Ptr(i)<<40
		if p, err := dev.Malloc(first.Size); err != nil || p != want {
			t.Errorf("device %d: first Malloc = %#x, %v; want %#x", i, uint64(p), err, uint64(want))
		}
	}
}
