package bench

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/trace"
	"github.com/allocd/allocd/workload"
)

// tracesDir holds the recorded PyTorch traces the tests replay;
// testdata/traces/README.md says where each comes from and gives PyTorch's
// figures for it.
const tracesDir = "../testdata/traces"

// traceNames are the traces of tracesDir: the five PyTorch's own replay
// measured (pytorchNative, pytorchExpandable), then the project's five
// (pytorchRecorded).
var traceNames = []string{
	"gpt2_train", "gpt2_train_varlen", "gpt2m_generate", "multistream_prefetch", "resnet50_train",
	"vit_b16_train", "segment_varsize", "moe_train", "llm_decode_varlen", "varlen_inference",
}

// traceFile is the path of the named trace; the test fails if it is missing.
func traceFile(tb testing.TB, name string) string {
	tb.Helper()
	path := filepath.Join(tracesDir, name+".pickle.gz")
	if _, err := os.Stat(path); err != nil {
		tb.Fatalf("recorded trace %s: %v", name, err)
	}
	return path
}

// traceFiles are the paths of every trace of traceNames. The test fails if
// one is missing, or if tracesDir holds a trace that traceNames lacks (its
// PyTorch figures belong here and in the README).
func traceFiles(tb testing.TB) []string {
	tb.Helper()
	var paths []string
	for _, name := range traceNames {
		paths = append(paths, traceFile(tb, name))
	}
	found, _ := filepath.Glob(filepath.Join(tracesDir, "*.pickle.gz"))
	for _, path := range found {
		if !slices.Contains(traceNames, traceName(path)) {
			tb.Errorf("%s: a trace without PyTorch's figures; add it to traceNames", path)
		}
	}
	return paths
}

func traceName(path string) string {
	return strings.TrimSuffix(filepath.Base(path), ".pickle.gz")
}

// longTrace reports the traces that -short leaves out: gpt2m_generate and
// llm_decode_varlen, with 608,552 and 409,172 operations, take longer than
// the eight others together (under -race, several times longer).
func longTrace(name string) bool { return name == "gpt2m_generate" || name == "llm_decode_varlen" }

// eachTrace runs fn as a subtest named for each recorded trace, with the
// trace's name and path, skipping the long traces in -short mode.
func eachTrace(t *testing.T, fn func(t *testing.T, name, path string)) {
	for _, path := range traceFiles(t) {
		name := traceName(path)
		t.Run(name, func(t *testing.T) {
			if testing.Short() && longTrace(name) {
				t.Skip("long trace in -short mode")
			}
			fn(t, name, path)
		})
	}
}

// pytorchNative holds PyTorch's peak allocated and peak reserved MiB on the
// first five traces with the default configuration, as PyTorch's own
// allocator reached them replaying each trace (testdata/traces/README.md).
var pytorchNative = map[string]struct{ allocatedMiB, reservedMiB float64 }{
	"gpt2_train":           {7365, 7708},
	"gpt2_train_varlen":    {9009, 9970},
	"gpt2m_generate":       {2347, 3054},
	"multistream_prefetch": {445, 616},
	"resnet50_train":       {3067, 3622},
}

// pytorchExpandable holds PyTorch's peak reserved MiB on the first five
// traces with expandable_segments:True (testdata/traces/README.md).
var pytorchExpandable = map[string]float64{
	"gpt2_train":           7886,
	"gpt2_train_varlen":    9694,
	"gpt2m_generate":       2446,
	"multistream_prefetch": 502,
	"resnet50_train":       3096,
}

// peaks are peak allocated and peak reserved bytes.
type peaks struct{ allocated, reserved int64 }

// pytorchRecorded holds what torch.cuda.memory_stats() reported for the
// project's five recorded runs, default and expandable_segments:True, in
// bytes (testdata/traces/README.md). before is what the workloads that ran
// earlier in the same process left allocated (cuBLAS workspaces): those
// blocks count in PyTorch's figures but are not in the trace.
var pytorchRecorded = map[string]struct {
	native, expandable peaks
	before             int64
}{
	"vit_b16_train":     {peaks{3_561_254_912, 3_892_314_112}, peaks{3_544_567_808, 3_659_530_240}, 0},
	"segment_varsize":   {peaks{2_207_808_000, 2_709_520_384}, peaks{2_194_799_104, 2_218_786_816}, 65 << 20},
	"moe_train":         {peaks{3_682_046_464, 4_150_263_808}, peaks{3_660_726_784, 3_732_930_560}, 65 << 20},
	"llm_decode_varlen": {peaks{956_418_560, 1_201_668_096}, peaks{954_897_920, 1_042_284_544}, 65 << 20},
	"varlen_inference":  {peaks{4_878_756_864, 7_021_264_896}, peaks{4_861_680_128, 5_630_853_120}, 65 << 20},
}

// checkRecorded compares a replay of one of the project's traces with
// PyTorch's recorded run: peak allocated is PyTorch's less the blocks
// allocated before the trace began, exactly. Where nothing was allocated
// before, peak reserved matches to the byte. Otherwise, when bounded is
// set, peak reserved is at most PyTorch's and short of it by no more than
// those blocks rounded up to the 2 MiB of a segment; with expandable
// segments the earlier blocks sit inside the segment the trace grows and
// change where it grows, so its reserved figure is not compared.
func checkRecorded(t *testing.T, conf string, r workload.ReplayResult, want peaks, before int64, bounded bool) {
	t.Helper()
	t.Logf("%s: peak allocated %d (PyTorch %d, %d before the trace), peak reserved %d (PyTorch %d)",
		conf, r.PeakAllocated, want.allocated, before, r.PeakReserved, want.reserved)
	if r.PeakAllocated+before != want.allocated {
		t.Errorf("%s: peak allocated %d + %d allocated before the trace, PyTorch's %d", conf, r.PeakAllocated, before, want.allocated)
	}
	if before != 0 && !bounded {
		return
	}
	slack := (before + 2<<20 - 1) &^ (2<<20 - 1)
	if r.PeakReserved > want.reserved || want.reserved-r.PeakReserved > slack {
		t.Errorf("%s: peak reserved %d, PyTorch's %d: want at most that and at least %d", conf, r.PeakReserved, want.reserved, want.reserved-slack)
	}
}

// The ways replayTrace replays a trace on the simulated device.
const (
	// modeDefault: the default configuration, at the recorded segment
	// addresses, manual events; the allocator checked after the replay.
	modeDefault = "default"
	// modeExpandable: expandable_segments:True with allocd's reclaim
	// (replayExpandableVMM).
	modeExpandable = "expandable"
	// modePyTorchExpandable: expandable_segments:True with
	// WithPyTorchExpandable.
	modePyTorchExpandable = "pytorch-expandable"
	// modeExpandableCoarse: expandable_segments:True with
	// expandable_reclaim:coarse.
	modeExpandableCoarse = "expandable-coarse"
)

// replayed is one replay of a trace, and the virtual memory calls the Sim
// served (expandable modes only).
type replayed struct {
	r   workload.ReplayResult
	vmm simdev.VMMCounters
}

var (
	replayMu   sync.Mutex
	replayDone = map[string]replayed{}
)

// replayTrace replays the named trace of tracesDir in mode, once per test
// binary: the tests that compare the replays with PyTorch's figures and the
// one that compares them with the docs share each replay. The first caller
// checks the replay (the allocator's invariants, no failed allocation) and
// fails if it does not hold; later callers get the result it produced.
func replayTrace(t *testing.T, name, mode string) replayed {
	t.Helper()
	replayMu.Lock()
	defer replayMu.Unlock()
	if r, ok := replayDone[name+"/"+mode]; ok {
		return r
	}
	ops, plan := loadOps(t, traceFile(t, name))
	var out replayed
	switch mode {
	case modeDefault:
		a := newSimAllocator(t, "", true, plan...)
		out.r = replayChecked(t, ops, a)
	case modeExpandable:
		out.r, out.vmm = replayExpandableVMM(t, ops)
	case modePyTorchExpandable:
		out.r, out.vmm = replayExpandableVMM(t, ops, allocator.WithPyTorchExpandable())
	case modeExpandableCoarse:
		out.r, out.vmm = replayConfVMM(t, ops, "expandable_segments:True,expandable_reclaim:coarse")
	default:
		t.Fatalf("replay mode %q", mode)
	}
	if !t.Failed() {
		replayDone[name+"/"+mode] = out
	}
	return out
}

// replayChecked replays ops on a and fails the test if the replay fails,
// Check finds a broken invariant after it, or an allocation failed.
func replayChecked(t *testing.T, ops *trace.Ops, a *allocator.Allocator) workload.ReplayResult {
	t.Helper()
	return replayCheckedWith(t, ops, a, workload.ReplayOptions{})
}

// replayCheckedWith is replayChecked with the replay options opt (the
// streams of an earlier pass, say).
func replayCheckedWith(t *testing.T, ops *trace.Ops, a *allocator.Allocator, opt workload.ReplayOptions) workload.ReplayResult {
	t.Helper()
	r, err := workload.Replay(ops, a, opt)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	if r.FailedAllocs != 0 {
		t.Fatalf("%d allocations failed", r.FailedAllocs)
	}
	return r
}
