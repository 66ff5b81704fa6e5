package snapshot_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"math"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// tracesDir holds the recorded PyTorch traces (testdata/traces/README.md).
const tracesDir = "../testdata/traces"

// longTrace reports the traces that -short leaves out of the round trips:
// gpt2m_generate and llm_decode_varlen, with 913,006 and 613,812 entries,
// take longer than the eight others together.
func longTrace(file string) bool {
	return file == "gpt2m_generate.pickle.gz" || file == "llm_decode_varlen.pickle.gz"
}

// roundTrip writes s and reads it back with frames.
func roundTrip(t *testing.T, s *snapshot.Snapshot) (*snapshot.Snapshot, []byte) {
	t.Helper()
	var buf bytes.Buffer
	if err := snapshot.WritePickle(&buf, s); err != nil {
		t.Fatal(err)
	}
	back, err := trace.Read(bytes.NewReader(buf.Bytes()), trace.ReadOptions{Frames: true})
	if err != nil {
		t.Fatal(err)
	}
	return back, buf.Bytes()
}

// sameSnapshot compares snapshots, taking nil settings as an empty dict
// (WritePickle writes {} as PyTorch always has the key).
func sameSnapshot(a, b *snapshot.Snapshot) bool {
	norm := func(s *snapshot.Snapshot) snapshot.Snapshot {
		c := *s
		if c.AllocatorSettings == nil {
			c.AllocatorSettings = map[string]any{}
		}
		return c
	}
	return reflect.DeepEqual(norm(a), norm(b))
}

func TestWriteRoundTripTestdata(t *testing.T) {
	paths, _ := filepath.Glob("../trace/testdata/*.pickle")
	for _, path := range paths {
		s, err := trace.ReadFile(path, trace.ReadOptions{Frames: true})
		if err != nil {
			t.Fatal(err)
		}
		back, _ := roundTrip(t, s)
		if !sameSnapshot(s, back) {
			t.Errorf("%s: round trip differs:\n%+v\n%+v", path, s, back)
		}
	}
}

func TestWriteRoundTripValues(t *testing.T) {
	s := &snapshot.Snapshot{
		Segments: []snapshot.Segment{{Device: 3, Address: math.MaxUint64, TotalSize: 1 << 40, Stream: math.MaxUint64,
			SegmentType: "large", IsExpandable: true, Frames: []snapshot.Frame{{Filename: "s.py", Line: 1, Name: "seg"}},
			Blocks: []snapshot.Block{{Address: 1, Size: 2, RequestedSize: 1, State: "active_pending_free", Frames: []snapshot.Frame{{Filename: "b.py", Line: 2, Name: "blk"}}}}}},
		DeviceTraces: [][]snapshot.Entry{{}, {
			{Action: snapshot.ActionAlloc, Addr: 1 << 63, Size: 70000, Stream: 1 << 63, TimeUS: -1,
				Frames: []snapshot.Frame{{Filename: "a.py", Line: 1 << 40, Name: "f"}, {Filename: string(bytes.Repeat([]byte("x"), 300)), Line: -7, Name: ""}}},
			{Action: snapshot.ActionOOM, Addr: 5, Size: 6, TimeUS: math.MinInt64},
			{Action: snapshot.ActionSnapshot, TimeUS: math.MaxInt64},
		}},
		AllocatorSettings: map[string]any{"s": "x", "i": int64(-129), "u": uint64(math.MaxUint64), "f": 0.25,
			"b": true, "n": nil, "l": []any{int64(1), "two", []any{}}, "m": map[string]any{"k": false},
			"big": new(big.Int).Neg(new(big.Int).Lsh(big.NewInt(1), 100)), "bytes": []byte{0, 1}},
	}
	back, _ := roundTrip(t, s)
	if !sameSnapshot(s, back) {
		t.Errorf("round trip differs:\n%+v\n%+v", s, back)
	}
	// Settings of other Go integer types come back as int64 or uint64.
	s2 := &snapshot.Snapshot{DeviceTraces: [][]snapshot.Entry{}, AllocatorSettings: map[string]any{"a": 3, "b": int8(-4), "c": uint16(5), "d": float32(0.5)}}
	back, _ = roundTrip(t, s2)
	want := map[string]any{"a": int64(3), "b": int64(-4), "c": int64(5), "d": 0.5}
	if !reflect.DeepEqual(back.AllocatorSettings, want) {
		t.Errorf("settings %v, want %v", back.AllocatorSettings, want)
	}
}

// TestWriteSharesFrames: entries sharing a Frames slice share one list.
func TestWriteSharesFrames(t *testing.T) {
	stack := []snapshot.Frame{{Filename: "train.py", Line: 3, Name: "step"}}
	var tr []snapshot.Entry
	for i := 0; i < 100; i++ {
		tr = append(tr, snapshot.Entry{Action: snapshot.ActionAlloc, Addr: uint64(i), Frames: stack})
	}
	_, data := roundTrip(t, &snapshot.Snapshot{DeviceTraces: [][]snapshot.Entry{tr}})
	if n := bytes.Count(data, []byte("train.py")); n != 1 {
		t.Errorf("file name written %d times", n)
	}
}

func TestWriteErrors(t *testing.T) {
	if err := snapshot.WritePickle(&bytes.Buffer{}, nil); err == nil {
		t.Error("nil snapshot: no error")
	}
	err := snapshot.WritePickle(&bytes.Buffer{}, &snapshot.Snapshot{AllocatorSettings: map[string]any{"x": []any{struct{}{}}}})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte(`allocator_settings["x"][0]`)) {
		t.Errorf("unsupported value: %v", err)
	}
	boom := errors.New("boom")
	if err := snapshot.WritePickle(failWriter{boom}, &snapshot.Snapshot{}); !errors.Is(err, boom) {
		t.Errorf("writer error: %v", err)
	}
}

type failWriter struct{ err error }

func (w failWriter) Write([]byte) (int, error) { return 0, w.err }

// TestWriteSharedTracesRoundTrip writes each recorded trace back and reads
// it again.
func TestWriteSharedTracesRoundTrip(t *testing.T) {
	paths, _ := filepath.Glob(filepath.Join(tracesDir, "*.pickle.gz"))
	if len(paths) < 10 {
		t.Fatalf("%d traces in %s, want the ten of its README", len(paths), tracesDir)
	}
	for _, path := range paths {
		if testing.Short() && longTrace(filepath.Base(path)) {
			continue
		}
		s, err := trace.ReadFile(path, trace.ReadOptions{Frames: true})
		if err != nil {
			t.Fatal(err)
		}
		back, _ := roundTrip(t, s)
		if !sameSnapshot(s, back) {
			t.Errorf("%s: round trip differs", filepath.Base(path))
		}
	}
}

// pyCheck loads a pickle with Python's pickle module, checks that every key
// torch.cuda._memory_viz (segsum, trace, segments) and MemoryViz.js read is
// there, and prints counts for the Go side to compare.
const pyCheck = `
import json, pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
for k in ("segments", "device_traces", "allocator_settings"):
    assert k in s, k
segkeys = ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
           "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks")
out = {"segments": len(s["segments"]), "blocks": 0, "entries": [], "frames": 0, "actions": {}}
for seg in s["segments"]:
    for k in segkeys:
        assert k in seg, k
    out["frames"] += len(seg["frames"])
    for b in seg["blocks"]:
        for k in ("address", "size", "requested_size", "state", "frames"):
            assert k in b, k
        out["blocks"] += 1
        out["frames"] += len(b["frames"])
for d in s["device_traces"]:
    out["entries"].append(len(d))
    for e in d:
        for k in ("action", "size", "stream", "time_us", "frames"):
            assert k in e, k
        assert ("device_free" if e["action"] == "oom" else "addr") in e
        for f in e["frames"]:
            assert isinstance(f["filename"], str) and isinstance(f["line"], int) and isinstance(f["name"], str)
        out["frames"] += len(e["frames"])
        out["actions"][e["action"]] = out["actions"].get(e["action"], 0) + 1
print(json.dumps(out))
`

// TestWritePythonReads checks the written pickles with python3, if present.
func TestWritePythonReads(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3")
	}
	inputs, _ := filepath.Glob("../trace/testdata/*.pickle")
	inputs = append(inputs, filepath.Join(tracesDir, "resnet50_train.pickle.gz"))
	dir := t.TempDir()
	for _, in := range inputs {
		s, err := trace.ReadFile(in, trace.ReadOptions{Frames: true})
		if err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, filepath.Base(in)+".out")
		f, err := os.Create(out)
		if err != nil {
			t.Fatal(err)
		}
		if err := snapshot.WritePickle(f, s); err != nil {
			t.Fatal(err)
		}
		f.Close()
		res, err := exec.Command(py, "-c", pyCheck, out).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: python3: %v\n%s", in, err, res)
		}
		var got struct {
			Segments, Blocks, Frames int
			Entries                  []int
			Actions                  map[snapshot.Action]int
		}
		if err := json.Unmarshal(res, &got); err != nil {
			t.Fatalf("%s: %v: %s", in, err, res)
		}
		want := got
		want.Segments, want.Blocks, want.Frames, want.Entries, want.Actions = len(s.Segments), 0, 0, nil, map[snapshot.Action]int{}
		for _, seg := range s.Segments {
			want.Blocks += len(seg.Blocks)
			want.Frames += len(seg.Frames)
			for _, b := range seg.Blocks {
				want.Frames += len(b.Frames)
			}
		}
		for _, tr := range s.DeviceTraces {
			want.Entries = append(want.Entries, len(tr))
			for _, e := range tr {
				want.Actions[e.Action]++
				want.Frames += len(e.Frames)
			}
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: python3 reads %+v, want %+v", in, got, want)
		}
	}
}

func BenchmarkWriteGPT2MGenerate(b *testing.B) {
	s, err := trace.ReadFile(filepath.Join(tracesDir, "gpt2m_generate.pickle.gz"), trace.ReadOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := snapshot.WritePickle(io.Discard, s); err != nil {
			b.Fatal(err)
		}
	}
}
