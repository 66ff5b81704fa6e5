package trace

import (
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/allocd/allocd/snapshot"
)

// sharedTrace is what Python's pickle (and a Python model of BuildOps)
// reported for the first five recorded traces of tracesDir, computed when
// the traces were added:
//
//	s = pickle.load(gzip.open(f)); tr = s["device_traces"][0]
//	len(tr), len(s["segments"]), collections.Counter(e["action"] for e in tr)
type sharedTrace struct {
	entries, segments, blocks int
	actions                   map[snapshot.Action]int
	sumAddr, sumSize          uint64 // sums mod 2**64 over the trace
	sumTime, sumStream        uint64
	framed, frames            int // entries with frames, frames in all
	ops                       opsFigures
}

type opsFigures struct {
	ops, ids, unmatched, live, uncompleted, deferred int
}

var sharedTraceFigures = map[string]sharedTrace{
	"gpt2_train.pickle.gz": {
		entries: 44462, segments: 137, blocks: 141,
		actions: map[snapshot.Action]int{snapshot.ActionAlloc: 14777, snapshot.ActionFreeRequested: 14774, snapshot.ActionFreeCompleted: 14774, snapshot.ActionSegmentAlloc: 137},
		sumAddr: 6234051569791920640, sumSize: 755508059166, sumTime: 6076413702529027721, sumStream: 0,
		ops: opsFigures{ops: 29551, ids: 14777, live: 3},
	},
	"gpt2_train_varlen.pickle.gz": {
		entries: 68254, segments: 205, blocks: 208,
		actions: map[snapshot.Action]int{snapshot.ActionAlloc: 22685, snapshot.ActionFreeRequested: 22682, snapshot.ActionFreeCompleted: 22682, snapshot.ActionSegmentAlloc: 205},
		sumAddr: 9560551766197852672, sumSize: 536579167959, sumTime: 11918515041342277014, sumStream: 0,
		ops: opsFigures{ops: 45367, ids: 22685, live: 3},
	},
	"gpt2m_generate.pickle.gz": {
		entries: 913006, segments: 179, blocks: 180,
		actions: map[snapshot.Action]int{snapshot.ActionAlloc: 304277, snapshot.ActionFreeRequested: 304275, snapshot.ActionFreeCompleted: 304275, snapshot.ActionSegmentAlloc: 179},
		sumAddr: 17701771457604699136, sumSize: 690830089581, sumTime: 16643218084729350028, sumStream: 0,
		ops: opsFigures{ops: 608552, ids: 304277, live: 2},
	},
	"multistream_prefetch.pickle.gz": {
		entries: 29110, segments: 33, blocks: 37,
		actions: map[snapshot.Action]int{snapshot.ActionAlloc: 9695, snapshot.ActionFreeRequested: 9692, snapshot.ActionFreeCompleted: 9690, snapshot.ActionSegmentAlloc: 33},
		sumAddr: 4073000682107267584, sumSize: 100483269928, sumTime: 15394384935781147695, sumStream: 69847401888,
		ops: opsFigures{ops: 19425, ids: 9695, live: 3, uncompleted: 2, deferred: 38},
	},
	"resnet50_train.pickle.gz": {
		entries: 19958, segments: 104, blocks: 105,
		actions: map[snapshot.Action]int{snapshot.ActionAlloc: 6620, snapshot.ActionFreeRequested: 6617, snapshot.ActionFreeCompleted: 6617, snapshot.ActionSegmentAlloc: 104},
		sumAddr: 2804305012043374080, sumSize: 262237050960, sumTime: 17402150074264125842, sumStream: 0,
		framed: 8975, frames: 129032,
		ops: opsFigures{ops: 13237, ids: 6620, live: 3},
	},
}

// TestSharedTraces reads each trace of sharedTraceFigures and checks it
// against Python. A missing trace fails the test.
func TestSharedTraces(t *testing.T) {
	for _, name := range slices.Sorted(maps.Keys(sharedTraceFigures)) {
		want := sharedTraceFigures[name]
		t.Run(name, func(t *testing.T) {
			if testing.Short() && want.entries > 100000 {
				t.Skip("large trace in -short mode")
			}
			path := filepath.Join(tracesDir, name)
			s, err := ReadFile(path, ReadOptions{Frames: want.frames > 0})
			if err != nil {
				t.Fatal(err)
			}
			checkShared(t, s, want)
		})
	}
}

func checkShared(t *testing.T, s *snapshot.Snapshot, want sharedTrace) {
	t.Helper()
	if len(s.DeviceTraces) != 1 || len(s.DeviceTraces[0]) != want.entries {
		t.Fatalf("traces %d, entries %d, want 1, %d", len(s.DeviceTraces), len(s.DeviceTraces[0]), want.entries)
	}
	blocks := 0
	for _, seg := range s.Segments {
		blocks += len(seg.Blocks)
	}
	if len(s.Segments) != want.segments || blocks != want.blocks {
		t.Errorf("segments %d, blocks %d, want %d, %d", len(s.Segments), blocks, want.segments, want.blocks)
	}
	tr := s.DeviceTraces[0]
	actions := map[snapshot.Action]int{}
	var sumAddr, sumSize, sumTime, sumStream uint64
	framed, frames := 0, 0
	for _, e := range tr {
		actions[e.Action]++
		sumAddr += e.Addr
		sumSize += e.Size
		sumTime += uint64(e.TimeUS)
		sumStream += e.Stream
		if len(e.Frames) > 0 {
			framed++
			frames += len(e.Frames)
		}
	}
	if !reflect.DeepEqual(actions, want.actions) {
		t.Errorf("actions %v, want %v", actions, want.actions)
	}
	if sumAddr != want.sumAddr || sumSize != want.sumSize || sumTime != want.sumTime || sumStream != want.sumStream {
		t.Errorf("sums %d/%d/%d/%d, want %d/%d/%d/%d", sumAddr, sumSize, sumTime, sumStream,
			want.sumAddr, want.sumSize, want.sumTime, want.sumStream)
	}
	if framed != want.framed || frames != want.frames {
		t.Errorf("%d entries with %d frames, want %d with %d", framed, frames, want.framed, want.frames)
	}
	if s.AllocatorSettings["max_split_size"] != int64(-1) {
		t.Errorf("allocator_settings = %v", s.AllocatorSettings)
	}
	ops := BuildOps(tr)
	deferred := 0
	for _, op := range ops.Ops {
		if op.Deferred {
			deferred++
		}
	}
	got := opsFigures{len(ops.Ops), ops.NumIDs, ops.UnmatchedFrees, ops.LiveAtEnd, ops.UncompletedFrees, deferred}
	if got != want.ops {
		t.Errorf("BuildOps: %+v, want %+v", got, want.ops)
	}
	if n := ops.Ignored[snapshot.ActionSegmentAlloc]; n != want.actions[snapshot.ActionSegmentAlloc] {
		t.Errorf("ignored segment_alloc %d, want %d", n, want.actions[snapshot.ActionSegmentAlloc])
	}
}

// TestLimitFigures pins what docs/replay.md's table of limits says of the
// largest recorded trace, gpt2m_generate (913,006 entries): it is 65.6 MB
// decompressed, and the reader's estimate of the memory it keeps is
// between 129 and 130 MiB, so a MaxMemory of 129 MiB refuses it and one of
// 130 MiB reads it.
func TestLimitFigures(t *testing.T) {
	if testing.Short() {
		t.Skip("reads the largest trace three times")
	}
	path := filepath.Join(tracesDir, "gpt2m_generate.pickle.gz")
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	z, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(io.Discard, z)
	if err != nil {
		t.Fatal(err)
	}
	if mb := fmt.Sprintf("%.1f", float64(n)/1e6); mb != "65.6" {
		t.Errorf("%s decompresses to %s MB; docs/replay.md says 65.6", path, mb)
	}
	if _, err := ReadFile(path, ReadOptions{MaxMemory: 129 << 20}); !errors.Is(err, ErrTooLarge) {
		t.Errorf("MaxMemory 129 MiB: %v, want ErrTooLarge", err)
	}
	if _, err := ReadFile(path, ReadOptions{MaxMemory: 130 << 20}); err != nil {
		t.Errorf("MaxMemory 130 MiB: %v", err)
	}
}
