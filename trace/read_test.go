package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/allocd/allocd/snapshot"
)

// expected.json is written by testdata/gen.py from Python's own decoding of
// each test pickle.
type pyExpected map[string]struct {
	Opcodes []string  `json:"opcodes"`
	Summary pySummary `json:"summary"`
}

type pySummary struct {
	Segments []struct {
		Device        int     `json:"device"`
		Address       uint64  `json:"address"`
		TotalSize     uint64  `json:"total_size"`
		AllocatedSize uint64  `json:"allocated_size"`
		ActiveSize    uint64  `json:"active_size"`
		RequestedSize uint64  `json:"requested_size"`
		Stream        uint64  `json:"stream"`
		SegmentType   string  `json:"segment_type"`
		IsExpandable  bool    `json:"is_expandable"`
		Frames        [][]any `json:"frames"`
		Blocks        []struct {
			Address       uint64  `json:"address"`
			Size          uint64  `json:"size"`
			RequestedSize uint64  `json:"requested_size"`
			State         string  `json:"state"`
			Frames        [][]any `json:"frames"`
		} `json:"blocks"`
	} `json:"segments"`
	DeviceTraces []struct {
		N         int            `json:"n"`
		Actions   map[string]int `json:"actions"`
		SumAddr   uint64         `json:"sum_addr"`
		SumSize   uint64         `json:"sum_size"`
		SumTime   uint64         `json:"sum_time"`
		SumStream uint64         `json:"sum_stream"`
		Entries   []struct {
			Action string  `json:"action"`
			Addr   uint64  `json:"addr"`
			Size   uint64  `json:"size"`
			Stream uint64  `json:"stream"`
			TimeUS int64   `json:"time_us"`
			Frames [][]any `json:"frames"`
		} `json:"entries"`
	} `json:"device_traces"`
	AllocatorSettings map[string]any `json:"allocator_settings"`
}

func loadExpected(t *testing.T) pyExpected {
	t.Helper()
	b, err := os.ReadFile("testdata/expected.json")
	if err != nil {
		t.Fatal(err)
	}
	var e pyExpected
	if err := json.Unmarshal(b, &e); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestReadMatchesPython decodes every test pickle, with and without frames,
// and compares the result with what Python's pickle module decoded.
func TestReadMatchesPython(t *testing.T) {
	for name, want := range loadExpected(t) {
		for _, frames := range []bool{false, true} {
			t.Run(name+map[bool]string{false: "", true: "/frames"}[frames], func(t *testing.T) {
				s, err := ReadFile(filepath.Join("testdata", name), ReadOptions{Frames: frames})
				if err != nil {
					t.Fatal(err)
				}
				compareSummary(t, s, want.Summary, frames)
			})
		}
	}
}

func compareSummary(t *testing.T, s *snapshot.Snapshot, want pySummary, frames bool) {
	t.Helper()
	if len(s.Segments) != len(want.Segments) {
		t.Fatalf("%d segments, want %d", len(s.Segments), len(want.Segments))
	}
	for i, ws := range want.Segments {
		g := s.Segments[i]
		if g.Device != ws.Device || g.Address != ws.Address || g.TotalSize != ws.TotalSize ||
			g.AllocatedSize != ws.AllocatedSize || g.ActiveSize != ws.ActiveSize ||
			g.RequestedSize != ws.RequestedSize || g.Stream != ws.Stream ||
			g.SegmentType != ws.SegmentType || g.IsExpandable != ws.IsExpandable ||
			len(g.Blocks) != len(ws.Blocks) {
			t.Fatalf("segment %d = %+v, want %+v", i, g, ws)
		}
		compareFrames(t, g.Frames, ws.Frames, frames, "segment")
		for j, wb := range ws.Blocks {
			gb := g.Blocks[j]
			if gb.Address != wb.Address || gb.Size != wb.Size || gb.RequestedSize != wb.RequestedSize || string(gb.State) != wb.State {
				t.Errorf("segment %d block %d = %+v, want %+v", i, j, gb, wb)
			}
			compareFrames(t, gb.Frames, wb.Frames, frames, "block")
		}
	}
	if len(s.DeviceTraces) != len(want.DeviceTraces) {
		t.Fatalf("%d device traces, want %d", len(s.DeviceTraces), len(want.DeviceTraces))
	}
	for dev, wt := range want.DeviceTraces {
		tr := s.DeviceTraces[dev]
		if len(tr) != wt.N {
			t.Fatalf("device %d: %d entries, want %d", dev, len(tr), wt.N)
		}
		actions := map[string]int{}
		var sumAddr, sumSize, sumTime, sumStream uint64
		for _, e := range tr {
			actions[string(e.Action)]++
			sumAddr += e.Addr
			sumSize += e.Size
			sumTime += uint64(e.TimeUS)
			sumStream += e.Stream
		}
		if !reflect.DeepEqual(actions, wt.Actions) && !(len(actions) == 0 && len(wt.Actions) == 0) {
			t.Errorf("device %d: actions %v, want %v", dev, actions, wt.Actions)
		}
		if sumAddr != wt.SumAddr || sumSize != wt.SumSize || sumTime != wt.SumTime || sumStream != wt.SumStream {
			t.Errorf("device %d: sums addr/size/time/stream %d/%d/%d/%d, want %d/%d/%d/%d", dev,
				sumAddr, sumSize, sumTime, sumStream, wt.SumAddr, wt.SumSize, wt.SumTime, wt.SumStream)
		}
		for i, we := range wt.Entries {
			e := tr[i]
			if string(e.Action) != we.Action || e.Addr != we.Addr || e.Size != we.Size ||
				e.Stream != we.Stream || e.TimeUS != we.TimeUS {
				t.Errorf("device %d entry %d = %+v, want %+v", dev, i, e, we)
			}
			compareFrames(t, e.Frames, we.Frames, frames, "entry")
		}
	}
	if !sameJSON(t, s.AllocatorSettings, want.AllocatorSettings) {
		t.Errorf("allocator_settings = %v, want %v", s.AllocatorSettings, want.AllocatorSettings)
	}
}

// compareFrames compares decoded frames with Python's [filename, line, name]
// lists; without ReadOptions.Frames there must be none.
func compareFrames(t *testing.T, got []snapshot.Frame, want [][]any, decoded bool, what string) {
	t.Helper()
	if !decoded {
		want = nil
	}
	if len(got) != len(want) {
		t.Fatalf("%s: %d frames, want %d", what, len(got), len(want))
	}
	for k, f := range got {
		wf := snapshot.Frame{Filename: want[k][0].(string), Line: int(want[k][1].(float64)), Name: want[k][2].(string)}
		if f != wf {
			t.Errorf("%s frame %d = %+v, want %+v", what, k, f, wf)
		}
	}
}

// sameJSON compares two values through their JSON encoding.
func sameJSON(t *testing.T, a, b any) bool {
	t.Helper()
	var x, y any
	for _, p := range []struct {
		v   any
		dst *any
	}{{a, &x}, {b, &y}} {
		j, err := json.Marshal(p.v)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(j, p.dst); err != nil {
			t.Fatal(err)
		}
	}
	return reflect.DeepEqual(x, y)
}

// TestGzipAndPlainAgree checks that detection is by content: the gzip copy
// decodes to the same snapshot as the plain file, whatever the names.
func TestGzipAndPlainAgree(t *testing.T) {
	plain, err := os.ReadFile("testdata/small.p4.pickle")
	if err != nil {
		t.Fatal(err)
	}
	gz, err := os.ReadFile("testdata/small.p4.pickle.gz")
	if err != nil {
		t.Fatal(err)
	}
	a, err := Read(bytes.NewReader(plain), ReadOptions{Frames: true})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Read(bytes.NewReader(gz), ReadOptions{Frames: true})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(a, b) {
		t.Errorf("gzip and plain differ:\n%+v\n%+v", a, b)
	}
	// A gzip file named .pickle and a plain one named .gz.
	dir := t.TempDir()
	for name, data := range map[string][]byte{"x.pickle": gz, "y.pickle.gz": plain} {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		c, err := ReadFile(p, ReadOptions{Frames: true})
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(a, c) {
			t.Errorf("%s decodes differently", name)
		}
	}
}

// TestGzipDamage: a corrupt or cut gzip stream is an error of the right kind.
func TestGzipDamage(t *testing.T) {
	gz, err := os.ReadFile("testdata/small.p4.pickle.gz")
	if err != nil {
		t.Fatal(err)
	}
	cut := gz[:len(gz)-20]
	if _, err := Read(bytes.NewReader(cut), ReadOptions{}); !errors.Is(err, ErrTruncated) {
		t.Errorf("cut gzip: %v, want ErrTruncated", err)
	}
	bad := append([]byte(nil), gz...)
	bad[len(bad)-6] ^= 0xff // the CRC
	if _, err := Read(bytes.NewReader(bad), ReadOptions{}); !errors.Is(err, ErrMalformed) {
		t.Errorf("bad CRC: %v, want ErrMalformed", err)
	}
	hdr := append([]byte(nil), gz...)
	hdr[2] = 7 // compression method
	if _, err := Read(bytes.NewReader(hdr), ReadOptions{}); !errors.Is(err, ErrMalformed) {
		t.Errorf("bad header: %v, want ErrMalformed", err)
	}
}

// TestEveryPrefixFails cuts each test file at every length: each prefix is
// an error (never a panic, never a snapshot).
func TestEveryPrefixFails(t *testing.T) {
	for _, name := range []string{"small.p2.pickle", "small.p4.pickle", "frames.p4.pickle", "small.p4.pickle.gz"} {
		data, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		for n := 0; n < len(data); n++ {
			for _, frames := range []bool{false, true} {
				s, err := decodeBytes(data[:n], ReadOptions{Frames: frames})
				if err == nil {
					t.Fatalf("%s[:%d]: no error, snapshot %+v", name, n, s)
				}
				var de *DecodeError
				if !errors.As(err, &de) {
					t.Fatalf("%s[:%d]: %v is not a *DecodeError", name, n, err)
				}
				if n > 0 && !strings.HasSuffix(name, ".gz") && !errors.Is(err, ErrTruncated) {
					t.Fatalf("%s[:%d]: %v, want ErrTruncated", name, n, err)
				}
			}
		}
	}
}
