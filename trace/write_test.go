package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"
)

// roundTrip writes s and reads it back with frames.
func roundTrip(t *testing.T, s *Snapshot) (*Snapshot, []byte) {
	t.Helper()
	var buf bytes.Buffer
	if err := WritePickle(&buf, s); err != nil {
		t.Fatal(err)
	}
	back, err := decodeBytes(buf.Bytes(), ReadOptions{Frames: true})
	if err != nil {
		t.Fatal(err)
	}
	return back, buf.Bytes()
}

// sameSnapshot compares snapshots, taking nil settings as an empty dict
// (WritePickle writes {} as PyTorch always has the key).
func sameSnapshot(a, b *Snapshot) bool {
	norm := func(s *Snapshot) Snapshot {
		c := *s
		if c.AllocatorSettings == nil {
			c.AllocatorSettings = map[string]any{}
		}
		return c
	}
	return reflect.DeepEqual(norm(a), norm(b))
}

func TestWriteRoundTripTestdata(t *testing.T) {
	paths, _ := filepath.Glob("testdata/*.pickle")
	for _, path := range paths {
		s, err := ReadFile(path, ReadOptions{Frames: true})
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
	s := &Snapshot{
		Segments: []Segment{{Device: 3, Address: math.MaxUint64, TotalSize: 1 << 40, Stream: math.MaxUint64,
			SegmentType: "large", IsExpandable: true, Frames: []Frame{{Filename: "s.py", Line: 1, Name: "seg"}},
			Blocks: []Block{{Address: 1, Size: 2, RequestedSize: 1, State: "active_pending_free", Frames: []Frame{{Filename: "b.py", Line: 2, Name: "blk"}}}}}},
		DeviceTraces: [][]Entry{{}, {
			{Action: ActionAlloc, Addr: 1 << 63, Size: 70000, Stream: 1 << 63, TimeUS: -1,
				Frames: []Frame{{Filename: "a.py", Line: 1 << 40, Name: "f"}, {Filename: string(bytes.Repeat([]byte("x"), 300)), Line: -7, Name: ""}}},
			{Action: ActionOOM, Addr: 5, Size: 6, TimeUS: math.MinInt64},
			{Action: ActionSnapshot, TimeUS: math.MaxInt64},
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
	s2 := &Snapshot{DeviceTraces: [][]Entry{}, AllocatorSettings: map[string]any{"a": 3, "b": int8(-4), "c": uint16(5), "d": float32(0.5)}}
	back, _ = roundTrip(t, s2)
	want := map[string]any{"a": int64(3), "b": int64(-4), "c": int64(5), "d": 0.5}
	if !reflect.DeepEqual(back.AllocatorSettings, want) {
		t.Errorf("settings %v, want %v", back.AllocatorSettings, want)
	}
}

// TestWriteSharesFrames: entries sharing a Frames slice share one list.
func TestWriteSharesFrames(t *testing.T) {
	stack := []Frame{{Filename: "train.py", Line: 3, Name: "step"}}
	var tr []Entry
	for i := 0; i < 100; i++ {
		tr = append(tr, Entry{Action: ActionAlloc, Addr: uint64(i), Frames: stack})
	}
	_, data := roundTrip(t, &Snapshot{DeviceTraces: [][]Entry{tr}})
	if n := bytes.Count(data, []byte("train.py")); n != 1 {
		t.Errorf("file name written %d times", n)
	}
}

func TestWriteErrors(t *testing.T) {
	if err := WritePickle(&bytes.Buffer{}, nil); err == nil {
		t.Error("nil snapshot: no error")
	}
	err := WritePickle(&bytes.Buffer{}, &Snapshot{AllocatorSettings: map[string]any{"x": []any{struct{}{}}}})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte(`allocator_settings["x"][0]`)) {
		t.Errorf("unsupported value: %v", err)
	}
	boom := errors.New("boom")
	if err := WritePickle(failWriter{boom}, &Snapshot{}); !errors.Is(err, boom) {
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
		s, err := ReadFile(path, ReadOptions{Frames: true})
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
	inputs, _ := filepath.Glob("testdata/*.pickle")
	inputs = append(inputs, filepath.Join(tracesDir, "resnet50_train.pickle.gz"))
	dir := t.TempDir()
	for _, in := range inputs {
		s, err := ReadFile(in, ReadOptions{Frames: true})
		if err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, filepath.Base(in)+".out")
		f, err := os.Create(out)
		if err != nil {
			t.Fatal(err)
		}
		if err := WritePickle(f, s); err != nil {
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
			Actions                  map[Action]int
		}
		if err := json.Unmarshal(res, &got); err != nil {
			t.Fatalf("%s: %v: %s", in, err, res)
		}
		want := got
		want.Segments, want.Blocks, want.Frames, want.Entries, want.Actions = len(s.Segments), 0, 0, nil, map[Action]int{}
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
