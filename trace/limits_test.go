package trace

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"io"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allocd/allocd/internal/pickle"
)

// heapBudget is what reading any bomb may add to the Go heap.
const heapBudget = 256 << 20

// gzipOf compresses what gen writes, streaming: a bomb of gigabytes is
// never held uncompressed.
func gzipOf(t testing.TB, gen func(w io.Writer)) []byte {
	t.Helper()
	var b bytes.Buffer
	zw, err := gzip.NewWriterLevel(&b, gzip.BestSpeed)
	if err != nil {
		t.Fatal(err)
	}
	cw := &countWriter{w: zw}
	gen(cw)
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	c.n += int64(len(p))
	return c.w.Write(p)
}

// repeat writes pattern n times, in large writes.
func repeat(w io.Writer, pattern []byte, n int) {
	chunk := bytes.Repeat(pattern, max(1, min(n, (1<<20)/len(pattern))))
	per := len(chunk) / len(pattern)
	for n > 0 {
		k := min(n, per)
		_, _ = w.Write(chunk[:k*len(pattern)])
		n -= k
	}
}

// peakHeap runs f and returns the largest growth of the Go heap's live and
// not yet swept objects seen while it ran, sampled every 200µs, with the GC
// asked to keep the heap under heapBudget.
func peakHeap(f func()) uint64 {
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(heapBudget))
	runtime.GC()
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	read := func() uint64 { metrics.Read(sample); return sample[0].Value.Uint64() }
	base := read()
	var peak atomic.Uint64
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(200 * time.Microsecond)
		defer tick.Stop()
		for {
			if h := read(); h > peak.Load() {
				peak.Store(h)
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	f()
	if h := read(); h > peak.Load() {
		peak.Store(h)
	}
	close(done)
	<-stopped
	if p := peak.Load(); p > base {
		return p - base
	}
	return 0
}

// bomb is a hostile input and the outcome Read must reach within
// heapBudget: success, or an error wrapping want.
type bomb struct {
	name string
	gen  func(w io.Writer) // the input, uncompressed
	opt  ReadOptions
	want error  // nil: Read succeeds
	msg  string // a part of the error message
}

// openSnap writes the start of {"device_traces": [[...]] ... } up to the
// open trace list, as snap does.
func openTrace(w io.Writer) {
	_, _ = w.Write(newPK(4).op(pickle.EmptyDict, pickle.Mark).str("device_traces").op(pickle.EmptyList, pickle.EmptyList, pickle.Mark))
}

func closeTrace(w io.Writer) {
	_, _ = w.Write(pk{}.op(pickle.Appends, pickle.Append).str("segments").op(pickle.EmptyList, pickle.SetItems, pickle.Stop))
}

var bombs = []bomb{
	{name: "a million empty device traces", gen: func(w io.Writer) {
		_, _ = w.Write(newPK(4).op(pickle.EmptyDict, pickle.Mark).str("device_traces").op(pickle.EmptyList))
		for range 1000 {
			_, _ = w.Write([]byte{pickle.Mark})
			repeat(w, []byte{pickle.EmptyList}, 1000)
			_, _ = w.Write([]byte{pickle.Appends})
		}
		_, _ = w.Write(pk{}.op(pickle.SetItems, pickle.Stop))
	}, want: ErrTooLarge, msg: "MaxDevices"},
	{name: "50M DUP opcodes", gen: func(w io.Writer) {
		_, _ = w.Write(newPK(4).op(pickle.None))
		repeat(w, []byte{pickle.Dup}, 50_000_000)
		_, _ = w.Write([]byte{pickle.Stop})
	}, want: ErrTooLarge, msg: "MaxStack"},
	{name: "50M DUP opcodes appended to a skipped list", gen: func(w io.Writer) {
		openTrace(w)
		_, _ = w.Write(pk{}.op(pickle.Appends, pickle.Append).str("junk").op(pickle.EmptyList))
		for range 50_000 {
			_, _ = w.Write([]byte{pickle.Mark, pickle.None})
			repeat(w, []byte{pickle.Dup}, 999)
			_, _ = w.Write([]byte{pickle.Appends})
		}
		_, _ = w.Write(pk{}.str("segments").op(pickle.EmptyList, pickle.SetItems, pickle.Stop))
	}},
	{name: "a 1 GiB string under an ignored key", gen: func(w io.Writer) {
		openTrace(w)
		_, _ = w.Write(pk{}.op(pickle.Appends, pickle.Append).str("junk").op(pickle.BinUnicode8))
		_, _ = w.Write(binary.LittleEndian.AppendUint64(nil, 1<<30))
		repeat(w, []byte("a"), 1<<30)
		_, _ = w.Write(pk{}.str("segments").op(pickle.EmptyList, pickle.SetItems, pickle.Stop))
	}},
	{name: "a 1 GiB string as an entry's ignored field", gen: func(w io.Writer) {
		openTrace(w)
		_, _ = w.Write(pk{}.op(pickle.EmptyDict, pickle.Mark).str("action").str("alloc").str("compile_context").op(pickle.BinUnicode))
		_, _ = w.Write(binary.LittleEndian.AppendUint32(nil, 1<<30))
		repeat(w, []byte("b"), 1<<30)
		_, _ = w.Write(pk{}.op(pickle.SetItems))
		closeTrace(w)
	}},
	{name: "a 1 GiB string as a kept field", gen: func(w io.Writer) {
		openTrace(w)
		_, _ = w.Write(pk{}.op(pickle.EmptyDict, pickle.Mark).str("action").op(pickle.BinUnicode))
		_, _ = w.Write(binary.LittleEndian.AppendUint32(nil, 1<<30))
		repeat(w, []byte("c"), 1<<30)
		_, _ = w.Write(pk{}.op(pickle.SetItems))
		closeTrace(w)
	}, want: ErrTooLarge, msg: "MaxString"},
	{name: "10M nested lists", gen: func(w io.Writer) {
		_, _ = w.Write(newPK(4))
		repeat(w, []byte{pickle.EmptyList}, 10_000_000)
	}, want: ErrTooLarge, msg: "MaxStack"},
	{name: "10M nested MARKs", gen: func(w io.Writer) {
		_, _ = w.Write(newPK(4))
		repeat(w, []byte{pickle.Mark}, 10_000_000)
	}, want: ErrTooLarge, msg: "MaxStack"},
	{name: "10M tuples in a skipped list", gen: func(w io.Writer) {
		openTrace(w)
		_, _ = w.Write(pk{}.op(pickle.Appends, pickle.Append).str("junk").op(pickle.EmptyList))
		for range 10_000 {
			_, _ = w.Write([]byte{pickle.Mark})
			repeat(w, []byte{pickle.EmptyTuple}, 1000)
			_, _ = w.Write([]byte{pickle.Appends})
		}
		_, _ = w.Write(pk{}.str("segments").op(pickle.EmptyList, pickle.SetItems, pickle.Stop))
	}},
	{name: "50M MEMOIZE", gen: func(w io.Writer) {
		_, _ = w.Write(newPK(4).op(pickle.None))
		repeat(w, []byte{pickle.Memoize}, 50_000_000)
		_, _ = w.Write([]byte{pickle.Stop})
	}, opt: ReadOptions{MaxMemory: 64 << 20}, want: ErrTooLarge, msg: "MaxMemory (64 MiB)"},
	{name: "10M empty block dicts", gen: func(w io.Writer) {
		_, _ = w.Write(newPK(4).op(pickle.EmptyDict, pickle.Mark).str("segments").op(pickle.EmptyList, pickle.EmptyDict).str("blocks").op(pickle.EmptyList))
		for range 10_000 {
			_, _ = w.Write([]byte{pickle.Mark})
			repeat(w, []byte{pickle.EmptyDict}, 1000)
			_, _ = w.Write([]byte{pickle.Appends})
		}
		_, _ = w.Write(pk{}.op(pickle.SetItem, pickle.Append, pickle.SetItems, pickle.Stop))
	}, opt: ReadOptions{MaxMemory: 64 << 20}, want: ErrTooLarge, msg: "MaxMemory"},
	{name: "10M trace entries", gen: func(w io.Writer) {
		openTrace(w)
		// The first entry memoizes its keys and action; the others
		// refer to them (BINGET 0 "action", BINGET 1 "alloc").
		// Batches are full (1000 entries), as Python's pickler writes them.
		entry := []byte{pickle.EmptyDict, pickle.BinGet, 0, pickle.BinGet, 1, pickle.SetItem}
		_, _ = w.Write(pk{}.op(pickle.EmptyDict).str("action").op(pickle.Memoize).str("alloc").op(pickle.Memoize, pickle.SetItem))
		repeat(w, entry, 999)
		for range 10_000 {
			_, _ = w.Write([]byte{pickle.Appends, pickle.Mark})
			repeat(w, entry, 1000)
		}
		closeTrace(w)
	}, opt: ReadOptions{MaxMemory: 64 << 20}, want: ErrTooLarge, msg: "MaxMemory"},
	{name: "256 MiB of None POP past MaxBytes", gen: func(w io.Writer) {
		_, _ = w.Write(newPK(4))
		repeat(w, []byte{pickle.None, pickle.Pop}, 128<<20)
	}, opt: ReadOptions{MaxBytes: 64 << 20}, want: ErrTooLarge, msg: "MaxBytes (64 MiB)"},
	{name: "RMM header and 1 GiB of newlines", gen: func(w io.Writer) {
		_, _ = io.WriteString(w, "Thread,Time,Action,Pointer,Size,Stream\n")
		repeat(w, []byte("\n"), 1<<30)
		_, _ = io.WriteString(w, "1,15:47:02.841961,allocate,0x10,1048576,0x0\n")
	}},
	{name: "RMM line of 1 GiB", gen: func(w io.Writer) {
		_, _ = io.WriteString(w, "Thread,Time,Action,Pointer,Size,Stream\n")
		repeat(w, []byte("1"), 1<<30)
	}, want: ErrTooLarge, msg: "MaxRMMLine"},
	{name: "RMM log of 10M allocations", gen: func(w io.Writer) {
		_, _ = io.WriteString(w, "Action,Pointer,Size\n")
		repeat(w, []byte("allocate,1,1\n"), 10_000_000)
	}, opt: ReadOptions{MaxMemory: 64 << 20}, want: ErrTooLarge, msg: "MaxMemory"},
}

// TestBombs reads each hostile input under a heap limit: it must keep the
// Go heap's growth under heapBudget and reach its documented outcome.
func TestBombs(t *testing.T) {
	if testing.Short() {
		t.Skip("the bombs decompress several GiB")
	}
	for _, b := range bombs {
		t.Run(b.name, func(t *testing.T) {
			var raw int64
			data := gzipOf(t, func(w io.Writer) {
				b.gen(w)
				raw = w.(*countWriter).n
			})
			var err error
			start := time.Now()
			peak := peakHeap(func() { _, err = Read(bytes.NewReader(data), b.opt) })
			t.Logf("%d bytes gzip (%d uncompressed): peak heap +%.1f MiB in %v: %v",
				len(data), raw, float64(peak)/(1<<20), time.Since(start).Round(time.Millisecond), err)
			if peak > heapBudget {
				t.Errorf("peak heap growth %d MiB, over %d MiB", peak>>20, heapBudget>>20)
			}
			switch {
			case b.want == nil && err != nil:
				t.Errorf("err = %v, want success", err)
			case b.want != nil && !errors.Is(err, b.want):
				t.Errorf("err = %v, want %v", err, b.want)
			case b.want != nil && !strings.Contains(err.Error(), b.msg):
				t.Errorf("err = %v, want it to name %q", err, b.msg)
			}
			var de *DecodeError
			if err != nil && !errors.As(err, &de) {
				t.Errorf("%v is not a *DecodeError", err)
			}
		})
	}
}

// TestInputMessages checks the errors of broken gzip and unrecognised
// content, and what follows a gzip member.
func TestInputMessages(t *testing.T) {
	good := snap(4, func(p pk) pk { return p.entry("alloc", 1, 2, 3, 4) })
	gz := func(b []byte) []byte { return gzipOf(t, func(w io.Writer) { _, _ = w.Write(b) }) }
	garbage := bytes.Repeat([]byte("garbage!"), 1000)
	badSum := gz(good)
	badSum[len(badSum)-8] ^= 1 // the CRC-32 of the trailer
	cases := []struct {
		name string
		in   []byte
		want error  // nil: success
		msg  string // the whole message
	}{
		{"gzip of garbage", gz(garbage), ErrNotSnapshot,
			"trace: not a memory snapshot: offset 0: the gzip stream holds neither a pickle of protocol 2 or later nor an RMM log"},
		{"garbage after the gzip magic", append([]byte{0x1f, 0x8b}, garbage...), ErrMalformed,
			"trace: malformed input: offset 0: gzip: invalid header"},
		{"corrupt deflate data", append(gz(good)[:10:10], garbage...), ErrMalformed,
			"trace: malformed input: gzip: flate: corrupt input before offset 1"},
		{"bad checksum", badSum, ErrMalformed, "trace: malformed input: gzip: invalid checksum"},
		{"trailing garbage after the gzip member", append(gz(good), garbage...), ErrMalformed,
			"trace: malformed input: gzip: trailing data after the end of the compressed stream"},
		{"a few bytes of trailing garbage after the gzip member", append(gz(good), "garbage\n"...), ErrMalformed,
			"trace: malformed input: gzip: trailing data after the end of the compressed stream"},
		{"one byte after the gzip member", append(gz(good), 0x1f), ErrMalformed,
			"trace: malformed input: gzip: trailing data after the end of the compressed stream"},
		{"a truncated second member", append(gz(good[:20]), gz(good[20:])[:15]...), ErrTruncated, ""},
		{"trailing zeros after the gzip member", append(gz(good), make([]byte, 512)...), ErrMalformed,
			"trace: malformed input: gzip: trailing data after the end of the compressed stream"},
		{"two gzip members read as one stream", append(gz(good[:20]), gz(good[20:])...), nil, ""},
		{"an empty member after the snapshot", append(gz(good), gz(nil)...), nil, ""},
		{"truncated gzip", gz(good)[:30], ErrTruncated, ""},
		{"plain garbage", garbage, ErrNotSnapshot,
			"trace: not a memory snapshot: offset 0: neither a pickle of protocol 2 or later, nor gzip, nor an RMM log"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, err := Read(bytes.NewReader(c.in), ReadOptions{})
			if c.want == nil {
				if err != nil || len(s.DeviceTraces) != 1 || len(s.DeviceTraces[0]) != 1 {
					t.Fatalf("got %+v, %v; want one entry", s, err)
				}
				return
			}
			if !errors.Is(err, c.want) {
				t.Fatalf("err = %v, want %v", err, c.want)
			}
			if c.msg != "" && err.Error() != c.msg {
				t.Errorf("err = %q\nwant  %q", err, c.msg)
			}
			if strings.Contains(err.Error(), "gzip: gzip:") {
				t.Errorf("%q repeats its prefix", err)
			}
		})
	}
}

// TestLimitDefaults pins the documented defaults and the meaning of zero.
func TestLimitDefaults(t *testing.T) {
	l := ReadOptions{}.limits()
	if l.maxBytes != 4<<30 || l.maxMemory != 2<<30 {
		t.Errorf("defaults %+v", l)
	}
	l = ReadOptions{MaxBytes: 10, MaxMemory: 20}.limits()
	if l.maxBytes != 10 || l.maxMemory != 20 {
		t.Errorf("set limits %+v", l)
	}
	// A stream of exactly MaxBytes is read; one byte more is too large.
	good := snap(4, func(p pk) pk { return p.entry("alloc", 1, 2, 3, 4) })
	if _, err := Read(bytes.NewReader(good), ReadOptions{MaxBytes: int64(len(good))}); err != nil {
		t.Errorf("exactly MaxBytes: %v", err)
	}
	if _, err := Read(bytes.NewReader(good), ReadOptions{MaxBytes: int64(len(good) - 1)}); !errors.Is(err, ErrTooLarge) {
		t.Errorf("MaxBytes-1: %v, want ErrTooLarge", err)
	}
}
