package trace

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/allocd/allocd/internal/pickle"
)

func gzipped(t *testing.T, members ...[]byte) []byte {
	t.Helper()
	var out bytes.Buffer
	for _, m := range members {
		w := gzip.NewWriter(&out)
		if _, err := w.Write(m); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
	}
	return out.Bytes()
}

// TestTrailingDataRefused: bytes after the pickle's STOP opcode, junk or a
// second pickle, plain or inside the gzip stream, are refused with
// ErrMalformed naming the offset of the first of them. Other gzip members
// holding nothing are still fine.
func TestTrailingDataRefused(t *testing.T) {
	one := snap(4, func(p pk) pk { return p.entry("alloc", 1, 2, 3, 4) })
	small, err := os.ReadFile("testdata/small.p4.pickle")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		data []byte
		off  int // offset of the trailing data in the decompressed stream
	}{
		{"junk", append(bytes.Clone(one), "junk"...), len(one)},
		{"one byte", append(bytes.Clone(one), 0), len(one)},
		{"newline", append(bytes.Clone(one), '\n'), len(one)},
		{"second pickle", append(bytes.Clone(one), one...), len(one)},
		{"small then junk", append(bytes.Clone(small), "xyz"...), len(small)},
		{"junk past the first window", append(bytes.Clone(small), bytes.Repeat([]byte{'.'}, 3*minWindow)...), len(small)},
		{"gzip of junk", gzipped(t, append(bytes.Clone(one), "junk"...)), len(one)},
		{"gzip of two pickles", gzipped(t, append(bytes.Clone(one), one...)), len(one)},
		{"gzip member of a second pickle", gzipped(t, one, one), len(one)},
		{"gzip member of junk", gzipped(t, one, []byte("junk")), len(one)},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := Read(bytes.NewReader(c.data), ReadOptions{})
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Read = %v, %v; want ErrMalformed", s, err)
			}
			var de *DecodeError
			if !errors.As(err, &de) || de.Offset != int64(c.off) {
				t.Fatalf("error %v: offset %d, want %d", err, de.Offset, c.off)
			}
			if want := fmt.Sprint(c.off); !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "STOP") {
				t.Errorf("error %q names neither offset %s nor STOP", err, want)
			}
		})
	}
	// Nothing after STOP, with empty gzip members around it: fine.
	for name, data := range map[string][]byte{
		"plain":              one,
		"gzip":               gzipped(t, one),
		"gzip, empty member": gzipped(t, one, nil),
		"gzip, split":        gzipped(t, one[:10], one[10:]),
	} {
		if _, err := Read(bytes.NewReader(data), ReadOptions{}); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

// TestBoolForIntRefused: True or False where an integer is expected is
// refused with ErrMalformed naming the field (Python's bool is an int, but a
// snapshot never holds one there).
func TestBoolForIntRefused(t *testing.T) {
	entry := func(field string, b byte) []byte {
		return snap(4, func(p pk) pk {
			p = p.op(pickle.EmptyDict, pickle.Mark).str("action").str("alloc")
			for _, f := range []string{"addr", "size", "stream", "time_us"} {
				p = p.str(f)
				if f == field {
					p = p.op(b)
				} else {
					p = p.int(5)
				}
			}
			return p.op(pickle.SetItems)
		})
	}
	segment := func(field string, b byte, inBlock bool) []byte {
		p := newPK(4).op(pickle.EmptyDict).str("segments").op(pickle.EmptyList, pickle.EmptyDict, pickle.Mark)
		seg := map[string]bool{"device": true, "address": true, "total_size": true, "allocated_size": true, "active_size": true, "requested_size": true, "stream": true}
		for _, f := range []string{"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream"} {
			p = p.str(f)
			if !inBlock && f == field && seg[f] {
				p = p.op(b)
			} else {
				p = p.int(0)
			}
		}
		p = p.str("blocks").op(pickle.EmptyList, pickle.EmptyDict, pickle.Mark)
		for _, f := range []string{"address", "size", "requested_size"} {
			p = p.str(f)
			if inBlock && f == field {
				p = p.op(b)
			} else {
				p = p.int(0)
			}
		}
		p = p.str("state").str("active_allocated").op(pickle.SetItems, pickle.Append, pickle.SetItems, pickle.Append, pickle.SetItem, pickle.Stop)
		return p
	}
	cases := map[string][]byte{}
	for _, f := range []string{"addr", "size", "stream", "time_us"} {
		cases["entry "+f+" True"] = entry(f, pickle.NewTrue)
		cases["entry "+f+" False"] = entry(f, pickle.NewFalse)
	}
	for _, f := range []string{"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream"} {
		cases["segment "+f+" True"] = segment(f, pickle.NewTrue, false)
	}
	for _, f := range []string{"address", "size", "requested_size"} {
		cases["block "+f+" True"] = segment(f, pickle.NewTrue, true)
	}
	if _, err := decodeBytes(segment("", 0, false), ReadOptions{}); err != nil {
		t.Fatalf("the segment without bools: %v", err)
	}
	if _, err := decodeBytes(entry("", 0), ReadOptions{}); err != nil {
		t.Fatalf("the entry without bools: %v", err)
	}
	for name, data := range cases {
		field := strings.Fields(name)[1]
		_, err := decodeBytes(data, ReadOptions{})
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
			continue
		}
		if !strings.Contains(err.Error(), field+":") || !strings.Contains(err.Error(), "bool") {
			t.Errorf("%s: error %q does not name the field and the bool", name, err)
		}
	}
}
