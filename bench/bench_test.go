package bench

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/trace"
)

// sharedTraces is where CI and developers find the shared PyTorch traces:
// beside the checkout.
const sharedTraces = "../../shared/traces"

func newSimAllocator(tb testing.TB, conf string, manualEvents bool) *allocator.Allocator {
	tb.Helper()
	sim, err := cudart.NewSim(cudart.SimConfig{Capacity: 141 << 30, ManualEvents: manualEvents})
	if err != nil {
		tb.Fatal(err)
	}
	cfg, err := allocator.ParseConfig(conf)
	if err != nil {
		tb.Fatal(err)
	}
	a, err := allocator.New(sim, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = a.Close() })
	return a
}

// BenchmarkPair is the cached malloc+free pair: it must allocate nothing.
func BenchmarkPair(b *testing.B) {
	for _, size := range PairSizes {
		b.Run(fmt.Sprintf("size=%d", size), func(b *testing.B) {
			a := newSimAllocator(b, "", false)
			if err := pairOnce(a, size); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				if err := pairOnce(a, size); err != nil {
					b.Fatal(err)
				}
			}
			if n := a.Stats().NumDeviceAlloc; n != 1 {
				b.Fatalf("%d device mallocs: the pair did not stay cached", n)
			}
		})
	}
}

// TestPairAllocatesNothing pins the hot path's zero heap allocations.
func TestPairAllocatesNothing(t *testing.T) {
	for _, size := range PairSizes {
		a := newSimAllocator(t, "", false)
		if err := pairOnce(a, size); err != nil {
			t.Fatal(err)
		}
		if allocs := testing.AllocsPerRun(1000, func() { _ = pairOnce(a, size) }); allocs != 0 {
			t.Errorf("pair/%d: %.1f heap allocations per pair, want 0", size, allocs)
		}
	}
}

// BenchmarkMixed is DESIGN.md §7's mixed workload; it reports ns per step
// and aggregate Mops/s over all goroutines.
func BenchmarkMixed(b *testing.B) {
	steps := MixedSteps
	if testing.Short() {
		steps = 20_000
	}
	for _, threads := range MixedThreads {
		b.Run(fmt.Sprintf("threads=%d", threads), func(b *testing.B) {
			a := newSimAllocator(b, "", false)
			var last MixedResult
			b.ReportAllocs()
			for b.Loop() {
				r, err := Mixed(a, threads, steps)
				if err != nil {
					b.Fatal(err)
				}
				last = r
			}
			b.ReportMetric(last.NsPerOp(), "ns/step")
			b.ReportMetric(last.MopsPerSec(), "Mops/s")
			b.ReportMetric(float64(last.PeakReserved)/(1<<20), "peak-reserved-MiB")
			b.ReportMetric(float64(last.PeakAllocated)/(1<<20), "peak-allocated-MiB")
		})
	}
}

func sharedTraceFiles(tb testing.TB) []string {
	files, _ := filepath.Glob(filepath.Join(sharedTraces, "*.pickle.gz"))
	if len(files) == 0 {
		tb.Skipf("no traces in %s", sharedTraces)
	}
	return files
}

func traceName(path string) string {
	return strings.TrimSuffix(filepath.Base(path), ".pickle.gz")
}

func loadOps(tb testing.TB, path string) *trace.Ops {
	tb.Helper()
	snap, err := trace.ReadFile(path, trace.ReadOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	ops := trace.BuildOps(snap.DeviceTraces[0])
	return &ops
}

// BenchmarkReplay replays every shared trace on a fresh Sim-backed
// allocator per iteration and reports ns per operation and the peaks.
func BenchmarkReplay(b *testing.B) {
	for _, path := range sharedTraceFiles(b) {
		b.Run(traceName(path), func(b *testing.B) {
			ops := loadOps(b, path)
			var last ReplayResult
			for b.Loop() {
				b.StopTimer()
				a := newSimAllocator(b, "", true)
				b.StartTimer()
				r, err := Replay(ops, a, ReplayOptions{})
				if err != nil {
					b.Fatal(err)
				}
				last = r
			}
			b.ReportMetric(last.NsPerOp(), "ns/trace-op")
			b.ReportMetric(float64(last.PeakAllocated)/(1<<20), "peak-allocated-MiB")
			b.ReportMetric(float64(last.PeakReserved)/(1<<20), "peak-reserved-MiB")
			b.ReportMetric(float64(last.DeviceMallocs), "device-mallocs")
		})
	}
}

// pytorchNativePeakReservedMiB is PyTorch's peak reserved on each shared
// trace with the default configuration (../shared/traces/ANCHORS.md).
var pytorchNativePeakReservedMiB = map[string]int64{
	"gpt2_train":           7708,
	"gpt2_train_varlen":    9970,
	"gpt2m_generate":       3054,
	"multistream_prefetch": 616,
	"resnet50_train":       3622,
}

// TestReplayNoWorseThanPyTorch: with the default configuration, replaying
// each shared trace reserves no more than PyTorch did.
func TestReplayNoWorseThanPyTorch(t *testing.T) {
	for _, path := range sharedTraceFiles(t) {
		name := traceName(path)
		t.Run(name, func(t *testing.T) {
			if testing.Short() && name == "gpt2m_generate" {
				t.Skip("long trace")
			}
			ops := loadOps(t, path)
			a := newSimAllocator(t, "", true)
			r, err := Replay(ops, a, ReplayOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Check(); err != nil {
				t.Fatal(err)
			}
			want, ok := pytorchNativePeakReservedMiB[name]
			got := r.PeakReserved >> 20
			t.Logf("%s: ops %d, peak allocated %d MiB, peak reserved %d MiB (PyTorch %d MiB), device mallocs %d",
				name, r.Ops, r.PeakAllocated>>20, got, want, r.DeviceMallocs)
			if ok && got > want {
				t.Errorf("peak reserved %d MiB exceeds PyTorch's %d MiB", got, want)
			}
			if r.FailedAllocs != 0 {
				t.Errorf("%d allocations failed", r.FailedAllocs)
			}
		})
	}
}
