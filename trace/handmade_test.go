package trace

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"math/big"
	"reflect"
	"strings"
	"testing"

	"github.com/allocd/allocd/internal/pickle"
	"github.com/allocd/allocd/snapshot"
)

// pk builds a pickle opcode by opcode.
type pk []byte

func newPK(proto byte) pk { return pk{pickle.Proto, proto} }

func (p pk) op(b ...byte) pk { return append(p, b...) }

func (p pk) str(s string) pk {
	if len(s) < 256 {
		return append(append(p, pickle.ShortBinUnicode, byte(len(s))), s...)
	}
	p = append(p, pickle.BinUnicode)
	p = binary.LittleEndian.AppendUint32(p, uint32(len(s)))
	return append(p, s...)
}

// long1 writes LONG1 with the given little-endian two's complement bytes.
func (p pk) long1(b ...byte) pk { return append(append(p, pickle.Long1, byte(len(b))), b...) }

func (p pk) int(i int64) pk {
	switch {
	case i >= 0 && i < 256:
		return append(p, pickle.BinInt1, byte(i))
	case i >= 0 && i < 65536:
		return binary.LittleEndian.AppendUint16(append(p, pickle.BinInt2), uint16(i))
	case i >= math.MinInt32 && i <= math.MaxInt32:
		return binary.LittleEndian.AppendUint32(append(p, pickle.BinInt), uint32(int32(i)))
	}
	return p.long1(binary.LittleEndian.AppendUint64(nil, uint64(i))...)
}

func (p pk) float(f float64) pk {
	return binary.BigEndian.AppendUint64(append(p, pickle.BinFloat), math.Float64bits(f))
}

// entry writes an entry dict: EMPTY_DICT MARK action .. time_us SETITEMS.
func (p pk) entry(action string, addr, size, stream, t int64) pk {
	p = p.op(pickle.EmptyDict, pickle.Mark).str("action").str(action).str("addr").int(addr).
		str("size").int(size).str("stream").int(stream).str("time_us").int(t)
	return p.op(pickle.SetItems)
}

// snap wraps trace entries (already written by body) into a one-device
// snapshot: {"device_traces": [[...]], "segments": []}.
func snap(proto byte, body func(pk) pk) []byte {
	p := newPK(proto).op(pickle.EmptyDict, pickle.Mark).str("device_traces").op(pickle.EmptyList, pickle.EmptyList, pickle.Mark)
	p = body(p)
	p = p.op(pickle.Appends, pickle.Append).str("segments").op(pickle.EmptyList, pickle.SetItems, pickle.Stop)
	return p
}

func mustRead(t *testing.T, data []byte, opt ReadOptions) *snapshot.Snapshot {
	t.Helper()
	s, err := decodeBytes(data, opt)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestHandmadeSnapshot(t *testing.T) {
	for _, proto := range []byte{2, 3, 4, 5} {
		data := snap(proto, func(p pk) pk {
			return p.entry("alloc", 0x7f0000000000, 512, 0, 10).
				entry("free_requested", 0x7f0000000000, 512, 0, 11).
				entry("free_completed", 0x7f0000000000, 512, 0, 12)
		})
		s := mustRead(t, data, ReadOptions{})
		want := [][]snapshot.Entry{{
			{Action: snapshot.ActionAlloc, Addr: 0x7f0000000000, Size: 512, TimeUS: 10},
			{Action: snapshot.ActionFreeRequested, Addr: 0x7f0000000000, Size: 512, TimeUS: 11},
			{Action: snapshot.ActionFreeCompleted, Addr: 0x7f0000000000, Size: 512, TimeUS: 12},
		}}
		if !reflect.DeepEqual(s.DeviceTraces, want) || len(s.Segments) != 0 || s.AllocatorSettings != nil {
			t.Errorf("protocol %d: %+v", proto, s)
		}
	}
}

// TestHandmadeValues covers integer encodings, float times, big and negative
// numbers and every action.
func TestHandmadeValues(t *testing.T) {
	full := func(action string, addr, stream, time func(pk) pk) []byte {
		return snap(2, func(p pk) pk {
			p = p.op(pickle.EmptyDict, pickle.Mark).str("action").str(action).str("addr")
			p = addr(p).str("size").int(7).str("stream")
			p = stream(p).str("time_us")
			return time(p).op(pickle.SetItems)
		})
	}
	i := func(v int64) func(pk) pk { return func(p pk) pk { return p.int(v) } }
	l := func(b ...byte) func(pk) pk { return func(p pk) pk { return p.long1(b...) } }
	f := func(v float64) func(pk) pk { return func(p pk) pk { return p.float(v) } }
	cases := []struct {
		name    string
		data    []byte
		want    snapshot.Entry
		wantErr error
	}{
		{"binint1", full("alloc", i(200), i(0), i(5)), snapshot.Entry{Action: snapshot.ActionAlloc, Addr: 200, Size: 7, TimeUS: 5}, nil},
		{"binint2", full("alloc", i(60000), i(0), i(5)), snapshot.Entry{Action: snapshot.ActionAlloc, Addr: 60000, Size: 7, TimeUS: 5}, nil},
		{"binint", full("alloc", i(1<<30), i(0), i(-5)), snapshot.Entry{Action: snapshot.ActionAlloc, Addr: 1 << 30, Size: 7, TimeUS: -5}, nil},
		{"long1 zero length", full("alloc", l(), i(0), i(5)), snapshot.Entry{Action: snapshot.ActionAlloc, Size: 7, TimeUS: 5}, nil},
		{"long1 addr", full("alloc", i(0x7fe415000000), i(0), i(1796216773651979)),
			snapshot.Entry{Action: snapshot.ActionAlloc, Addr: 0x7fe415000000, Size: 7, TimeUS: 1796216773651979}, nil},
		{"long1 9 bytes max uint64", full("alloc", l(0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0), i(0), i(5)),
			snapshot.Entry{Action: snapshot.ActionAlloc, Addr: math.MaxUint64, Size: 7, TimeUS: 5}, nil},
		{"long1 negative stream", full("alloc", i(1), l(0xff), i(5)),
			snapshot.Entry{Action: snapshot.ActionAlloc, Addr: 1, Size: 7, Stream: math.MaxUint64, TimeUS: 5}, nil},
		{"long1 int64 min stream", full("alloc", i(1), l(0, 0, 0, 0, 0, 0, 0, 0x80), i(5)),
			snapshot.Entry{Action: snapshot.ActionAlloc, Addr: 1, Size: 7, Stream: 1 << 63, TimeUS: 5}, nil},
		{"binfloat time", full("alloc", i(1), i(0), f(1.5e15+0.75)),
			snapshot.Entry{Action: snapshot.ActionAlloc, Addr: 1, Size: 7, TimeUS: 1.5e15}, nil},
		{"every action", full("segment_unmap", i(1), i(0), i(5)), snapshot.Entry{Action: snapshot.ActionSegmentUnmap, Addr: 1, Size: 7, TimeUS: 5}, nil},
		{"negative addr", full("alloc", l(0xfe), i(0), i(5)), snapshot.Entry{}, ErrMalformed},
		{"addr beyond uint64", full("alloc", l(0, 0, 0, 0, 0, 0, 0, 0, 1), i(0), i(5)), snapshot.Entry{}, ErrMalformed},
		{"huge long1", full("alloc", l(bytes.Repeat([]byte{0x11}, 200)...), i(0), i(5)), snapshot.Entry{}, ErrMalformed},
		{"nan time", full("alloc", i(1), i(0), f(math.NaN())), snapshot.Entry{}, ErrMalformed},
		{"string addr", full("alloc", func(p pk) pk { return p.str("x") }, i(0), i(5)), snapshot.Entry{}, ErrMalformed},
		{"unknown action", full("garbage_collect", i(1), i(0), i(5)), snapshot.Entry{}, ErrUnknownAction},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, err := decodeBytes(c.data, ReadOptions{})
			if c.wantErr != nil {
				if !errors.Is(err, c.wantErr) {
					t.Fatalf("err = %v, want %v", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := s.DeviceTraces[0][0]; !reflect.DeepEqual(got, c.want) {
				t.Errorf("entry = %+v, want %+v", got, c.want)
			}
		})
	}
}

func TestUnknownActionNamesEntry(t *testing.T) {
	data := snap(4, func(p pk) pk {
		return p.entry("alloc", 1, 2, 0, 3).entry("alloc", 5, 2, 0, 3).entry("free_everything", 1, 2, 0, 4)
	})
	_, err := decodeBytes(data, ReadOptions{})
	if !errors.Is(err, ErrUnknownAction) || !strings.Contains(err.Error(), `device_traces[0][2]: action "free_everything"`) {
		t.Errorf("err = %v", err)
	}
	var de *DecodeError
	if !errors.As(err, &de) || de.Offset <= 0 {
		t.Errorf("err %v has no offset", err)
	}
}

func TestOOMUsesDeviceFree(t *testing.T) {
	data := snap(4, func(p pk) pk {
		return p.op(pickle.EmptyDict, pickle.Mark).str("action").str("oom").str("device_free").int(123).
			str("size").int(1 << 40).str("stream").int(0).str("time_us").int(9).op(pickle.SetItems)
	})
	s := mustRead(t, data, ReadOptions{})
	if e := s.DeviceTraces[0][0]; !reflect.DeepEqual(e, snapshot.Entry{Action: snapshot.ActionOOM, Addr: 123, Size: 1 << 40, TimeUS: 9}) {
		t.Errorf("oom = %+v", e)
	}
}

func TestTopLevelShapes(t *testing.T) {
	cases := []struct {
		name    string
		data    []byte
		wantErr error
	}{
		{"empty device_traces", newPK(4).op(pickle.EmptyDict).str("device_traces").op(pickle.EmptyList, pickle.SetItem, pickle.Stop), nil},
		{"segments only", newPK(4).op(pickle.EmptyDict).str("segments").op(pickle.EmptyList, pickle.SetItem, pickle.Stop), nil},
		{"empty dict", newPK(4).op(pickle.EmptyDict, pickle.Stop), ErrNotSnapshot},
		{"other keys", newPK(4).op(pickle.EmptyDict).str("x").int(1).op(pickle.SetItem, pickle.Stop), ErrNotSnapshot},
		{"a list", newPK(4).op(pickle.EmptyList, pickle.Mark).int(1).int(2).op(pickle.Appends, pickle.Stop), ErrNotSnapshot},
		{"a list of snapshots", newPK(4).op(pickle.EmptyList, pickle.EmptyDict).str("device_traces").op(pickle.EmptyList, pickle.SetItem, pickle.Append, pickle.Stop), ErrNotSnapshot},
		{"an int", newPK(2).int(5).op(pickle.Stop), ErrNotSnapshot},
		{"None", newPK(2).op(pickle.None, pickle.Stop), ErrNotSnapshot},
		{"device_traces not a list", newPK(4).op(pickle.EmptyDict).str("device_traces").int(3).op(pickle.SetItem, pickle.Stop), ErrMalformed},
		{"device_traces a dict", newPK(4).op(pickle.EmptyDict).str("device_traces").op(pickle.EmptyDict, pickle.SetItem, pickle.Stop), ErrMalformed},
		{"trace item not a dict", newPK(4).op(pickle.EmptyDict).str("device_traces").op(pickle.EmptyList, pickle.EmptyList).int(1).op(pickle.Append, pickle.Append, pickle.SetItem, pickle.Stop), ErrMalformed},
		{"entry without action", snap(4, func(p pk) pk { return p.op(pickle.EmptyDict).str("addr").int(1).op(pickle.SetItem) }), ErrMalformed},
		{"protocol 1", pk{pickle.Proto, 1, pickle.None, pickle.Stop}, ErrNotSnapshot},
		{"protocol 6", pk{pickle.Proto, 6, pickle.None, pickle.Stop}, ErrNotSnapshot},
		{"not a pickle", []byte("hello, world"), ErrNotSnapshot},
		{"empty input", nil, ErrNotSnapshot},
		{"protocol 0 pickle", []byte("(dp0\nS'a'\np1\nI1\ns."), ErrNotSnapshot},
		{"global", newPK(2).op('c').op([]byte("os\nsystem\n")...).op(pickle.Stop), ErrUnsupportedOpcode},
		{"not an opcode", newPK(4).op(0xff), ErrUnsupportedOpcode},
		{"memo get of a missing key", newPK(4).op(pickle.EmptyDict, pickle.Memoize, pickle.BinGet, 7, pickle.Stop), ErrMalformed},
		{"long memo get of a missing key", newPK(4).op(pickle.LongBinGet, 0, 0, 0, 1, pickle.Stop), ErrMalformed},
		{"append on empty stack", newPK(4).op(pickle.Append), ErrMalformed},
		{"appends without mark", newPK(4).op(pickle.EmptyList, pickle.Appends), ErrMalformed},
		{"setitems odd", newPK(4).op(pickle.EmptyDict, pickle.Mark).str("a").op(pickle.SetItems), ErrMalformed},
		{"setitems on a list", newPK(4).op(pickle.EmptyDict).str("device_traces").op(pickle.EmptyList, pickle.Mark).str("a").int(1).op(pickle.SetItems), ErrMalformed},
		{"append to a dict", newPK(4).op(pickle.EmptyDict).int(1).op(pickle.Append), ErrMalformed},
		{"append to an int", newPK(4).int(1).int(1).op(pickle.Append), ErrMalformed},
		{"stop on empty stack", newPK(4).op(pickle.Stop), ErrMalformed},
		{"pop mark without mark", newPK(4).op(pickle.PopMark), ErrMalformed},
		{"negative string length", newPK(4).op(pickle.BinString, 0xff, 0xff, 0xff, 0xff), ErrMalformed},
		{"4 GiB string length", newPK(4).op(pickle.BinUnicode, 0xff, 0xff, 0xff, 0xff), ErrTooLarge},
		{"memoize across mark", newPK(4).op(pickle.Mark, pickle.Memoize), ErrMalformed},
		{"truncated", newPK(4).op(pickle.EmptyDict), ErrTruncated},
		{"truncated string", newPK(4).op(pickle.BinUnicode, 9, 0, 0, 0).op([]byte("abc")...), ErrTruncated},
		{"long string length", newPK(4).op(pickle.BinUnicode8, 0, 0, 0, 0, 1, 0, 0, 0), ErrTooLarge},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := decodeBytes(c.data, ReadOptions{})
			if c.wantErr == nil && err != nil || !errors.Is(err, c.wantErr) {
				t.Fatalf("err = %v, want %v", err, c.wantErr)
			}
			if err != nil {
				var de *DecodeError
				if !errors.As(err, &de) {
					t.Errorf("%v is not a *DecodeError", err)
				}
			}
		})
	}
}

func TestUnsupportedOpcodeMessage(t *testing.T) {
	data := newPK(2).op(pickle.EmptyDict).op('c').op([]byte("os\nsystem\n")...)
	_, err := decodeBytes(data, ReadOptions{})
	if err == nil || !strings.Contains(err.Error(), "GLOBAL") || !strings.Contains(err.Error(), "offset 3") {
		t.Errorf("err = %v, want GLOBAL at offset 3", err)
	}
}

// framesPickle has entries with inline, shared and single-frame stacks.
func framesPickle() []byte {
	frame := func(p pk, name string, line int64) pk {
		return p.op(pickle.EmptyDict, pickle.Memoize, pickle.Mark).str("name").str(name).str("filename").str("f.py").str("line").int(line).op(pickle.SetItems)
	}
	return snap(4, func(p pk) pk {
		p = p.op(pickle.EmptyDict, pickle.Mark).str("action").str("alloc").str("addr").int(1).str("frames").op(pickle.EmptyList, pickle.Memoize, pickle.Mark)
		p = frame(p, "inner", 10) // memo 1 (the list is memo 0)
		p = frame(p, "outer", 20) // memo 2
		p = p.op(pickle.Appends, pickle.SetItems)
		// The second entry shares the list; the third holds one shared frame.
		p = p.op(pickle.EmptyDict, pickle.Mark).str("action").str("alloc").str("frames").op(pickle.BinGet, 0, pickle.SetItems)
		p = p.op(pickle.EmptyDict, pickle.Mark).str("action").str("alloc").str("frames").op(pickle.EmptyList, pickle.BinGet, 2, pickle.Append, pickle.SetItems)
		return p.op(pickle.EmptyDict).str("action").str("snapshot").op(pickle.SetItem)
	})
}

// TestFrames: frames are decoded only when asked, and shared lists and
// frame dicts (memo references) decode like inline ones.
func TestFrames(t *testing.T) {
	data := framesPickle()
	inner, outer := snapshot.Frame{Filename: "f.py", Line: 10, Name: "inner"}, snapshot.Frame{Filename: "f.py", Line: 20, Name: "outer"}
	s := mustRead(t, data, ReadOptions{Frames: true})
	tr := s.DeviceTraces[0]
	if len(tr) != 4 || !reflect.DeepEqual(tr[0].Frames, []snapshot.Frame{inner, outer}) ||
		!reflect.DeepEqual(tr[1].Frames, []snapshot.Frame{inner, outer}) || !reflect.DeepEqual(tr[2].Frames, []snapshot.Frame{outer}) || tr[3].Frames != nil {
		t.Errorf("with frames: %+v", tr)
	}
	s = mustRead(t, data, ReadOptions{})
	for i, e := range s.DeviceTraces[0] {
		if e.Frames != nil {
			t.Errorf("entry %d has frames %v without ReadOptions.Frames", i, e.Frames)
		}
	}
}

// nestedPickle has typed keys after dict and list values, single-item
// containers and an empty device trace.
func nestedPickle() []byte {
	p := newPK(4).op(pickle.EmptyDict, pickle.Mark)
	p = p.str("allocator_settings").op(pickle.EmptyDict).str("roundup_power2_divisions").op(pickle.EmptyDict).str("1").int(4).op(pickle.SetItem, pickle.SetItem)
	p = p.str("external_annotations").op(pickle.EmptyList, pickle.EmptyDict).str("stage").str("START").op(pickle.SetItem, pickle.Append)
	p = p.str("device_traces").op(pickle.EmptyList, pickle.Mark, pickle.EmptyList) // device 0: empty
	p = p.op(pickle.EmptyList).entry("alloc", 1, 2, 3, 4).op(pickle.Append)        // device 1: one entry
	p = p.op(pickle.Appends)
	p = p.str("segments").op(pickle.EmptyList, pickle.EmptyDict, pickle.Mark).str("address").int(64).str("blocks").
		op(pickle.EmptyList, pickle.EmptyDict).str("size").int(64).op(pickle.SetItem, pickle.Append).str("total_size").int(64).
		op(pickle.SetItems, pickle.Append)
	p = p.op(pickle.SetItems, pickle.Stop)
	return p
}

// TestKeyOrderAndNesting: typed keys after a dict-valued and a list-valued
// key, single-item containers (SETITEM, APPEND) and nested lists all land
// in the right place.
func TestKeyOrderAndNesting(t *testing.T) {
	p := nestedPickle()
	s := mustRead(t, p, ReadOptions{})
	want := &snapshot.Snapshot{
		Segments:          []snapshot.Segment{{Address: 64, TotalSize: 64, Blocks: []snapshot.Block{{Size: 64}}}},
		DeviceTraces:      [][]snapshot.Entry{{}, {{Action: snapshot.ActionAlloc, Addr: 1, Size: 2, Stream: 3, TimeUS: 4}}},
		AllocatorSettings: map[string]any{"roundup_power2_divisions": map[string]any{"1": int64(4)}},
	}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("got  %+v\nwant %+v", s, want)
	}
}

// settingsPickle has allocator_settings with every scalar kind.
func settingsPickle() []byte {
	p := newPK(4).op(pickle.EmptyDict, pickle.Mark).str("device_traces").op(pickle.EmptyList).str("allocator_settings").op(pickle.EmptyDict, pickle.Mark)
	p = p.str("none").op(pickle.None).str("t").op(pickle.NewTrue).str("f").op(pickle.NewFalse).str("i").int(-3).str("fl").float(0.5)
	p = p.str("big").long1(append(make([]byte, 10), 1)...).str("u").long1(0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0)
	p = p.str("bytes").op(pickle.ShortBinBytes, 2, 'h', 'i').str("tuple").int(1).int(2).op(pickle.Tuple2)
	p = p.str("empty").op(pickle.EmptyTuple).str("list").op(pickle.Mark).int(1).op(pickle.List)
	p = p.str("dict").op(pickle.Mark).str("k").str("v").op(pickle.Dict)
	p = p.op(pickle.SetItems, pickle.SetItems, pickle.Stop)
	return p
}

// TestGenericSettings decodes every scalar kind in allocator_settings.
func TestGenericSettings(t *testing.T) {
	huge := new(big.Int).Lsh(big.NewInt(1), 80)
	p := settingsPickle()
	s := mustRead(t, p, ReadOptions{})
	want := map[string]any{"none": nil, "t": true, "f": false, "i": int64(-3), "fl": 0.5,
		"big": huge, "u": uint64(math.MaxUint64), "bytes": []byte("hi"), "tuple": []any{int64(1), int64(2)},
		"empty": []any{}, "list": []any{int64(1)}, "dict": map[string]any{"k": "v"}}
	if !reflect.DeepEqual(s.AllocatorSettings, want) {
		t.Errorf("got  %#v\nwant %#v", s.AllocatorSettings, want)
	}
}

// TestBatches: a trace of 2500 entries pickled in batches of 1000 (and the
// jit pickler's single batch) decodes in order.
func TestBatches(t *testing.T) {
	for _, batch := range []int{1000, 2500} {
		p := newPK(2).op(pickle.EmptyDict, pickle.Mark).str("device_traces").op(pickle.EmptyList, pickle.EmptyList)
		for i := 0; i < 2500; i += batch {
			n := min(batch, 2500-i)
			p = p.op(pickle.Mark)
			for j := i; j < i+n; j++ {
				p = p.entry("alloc", int64(j), 1, 0, int64(j))
			}
			p = p.op(pickle.Appends)
		}
		p = p.op(pickle.Append).op(pickle.SetItems, pickle.Stop)
		s := mustRead(t, p, ReadOptions{})
		tr := s.DeviceTraces[0]
		if len(tr) != 2500 {
			t.Fatalf("batch %d: %d entries", batch, len(tr))
		}
		for i, e := range tr {
			if e.Addr != uint64(i) || e.TimeUS != int64(i) {
				t.Fatalf("batch %d: entry %d = %+v", batch, i, e)
			}
		}
	}
}

// TestSharedEntryDict: a memoized entry dict used again in a later batch is
// an error, never a silently wrong entry.
func TestSharedEntryDict(t *testing.T) {
	data := snap(4, func(p pk) pk {
		p = p.op(pickle.EmptyDict, pickle.Memoize, pickle.Mark).str("action").str("alloc").str("addr").int(1).op(pickle.SetItems)
		p = p.entry("alloc", 2, 1, 0, 0).op(pickle.Appends, pickle.Mark)
		return p.op(pickle.BinGet, 1).entry("alloc", 3, 1, 0, 0)
	})
	if _, err := decodeBytes(data, ReadOptions{}); !errors.Is(err, ErrMalformed) {
		t.Errorf("err = %v, want ErrMalformed", err)
	}
}

// errReader fails after its data.
type errReader struct {
	data []byte
	err  error
}

func (r *errReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, r.err
	}
	n := copy(p, r.data)
	r.data = r.data[n:]
	return n, nil
}

func TestReaderError(t *testing.T) {
	boom := errors.New("boom")
	data := snap(4, func(p pk) pk { return p.entry("alloc", 1, 2, 0, 3) })
	for _, n := range []int{0, 1, 5, len(data) - 1} {
		_, err := Read(&errReader{data: data[:n], err: boom}, ReadOptions{})
		if !errors.Is(err, boom) {
			t.Errorf("after %d bytes: err = %v, want boom", n, err)
		}
	}
}

// TestDuplicateKeys: as in Python, the last value of a repeated key wins,
// whatever the earlier one was (here an unknown action, then a known one).
func TestDuplicateKeys(t *testing.T) {
	data := snap(4, func(p pk) pk {
		p = p.op(pickle.EmptyDict, pickle.Mark).str("frames").op(pickle.EmptyList, pickle.EmptyDict).str("name").str("f").op(pickle.SetItem, pickle.Append)
		p = p.str("action").str("bogus").str("addr").int(1).str("action").str("free_requested").str("addr").int(2)
		return p.op(pickle.SetItems)
	})
	s := mustRead(t, data, ReadOptions{Frames: true})
	want := snapshot.Entry{Action: snapshot.ActionFreeRequested, Addr: 2, Frames: []snapshot.Frame{{Name: "f"}}}
	if got := s.DeviceTraces[0][0]; !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v, want %+v", got, want)
	}
}

// TestChangedAfterUse: a list that receives items after its parent took it
// is an error, not a silently shorter trace.
func TestChangedAfterUse(t *testing.T) {
	p := newPK(4).op(pickle.EmptyDict, pickle.Mark).str("device_traces").op(pickle.EmptyList, pickle.EmptyList, pickle.Memoize)
	p = p.entry("alloc", 1, 2, 0, 0).op(pickle.Append, pickle.Append) // the trace joins device_traces
	p = p.op(pickle.BinGet, 0).entry("alloc", 3, 4, 0, 0).op(pickle.Append, pickle.Pop)
	p = p.op(pickle.SetItems, pickle.Stop)
	if _, err := decodeBytes(p, ReadOptions{}); !errors.Is(err, ErrMalformed) {
		t.Errorf("err = %v, want ErrMalformed", err)
	}
}
