package trace

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/allocd/allocd/internal/pickle"
	"github.com/allocd/allocd/snapshot"
)

// FuzzRead feeds arbitrary input to Read: it must return a snapshot or a
// *DecodeError, never panic or hang; a snapshot it returns must survive
// BuildOps, and WritePickle must write it so that it reads back to the same
// snapshot (compared as the bytes written again, so that NaNs compare).
func FuzzRead(f *testing.F) {
	paths, _ := filepath.Glob("testdata/*.pickle*")
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		if len(data) > 8<<10 {
			continue
		}
		f.Add(data)
	}
	f.Add([]byte(snap(2, func(p pk) pk { return p.entry("alloc", 1, 2, 3, 4) })))
	f.Add([]byte(rmmSample))
	f.Add(framesPickle())
	f.Add(nestedPickle())
	f.Add(settingsPickle())
	one := snap(2, func(p pk) pk { return p.entry("alloc", 1, 2, 3, 4) })
	f.Add(append(append([]byte(nil), one...), one...)) // trailing data: refused
	f.Add(snap(2, func(p pk) pk {
		return p.entry("alloc", 1, 2, 3, 4).op(pickle.EmptyDict).str("size").op(pickle.NewTrue, pickle.SetItem)
	}))
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, frames := range []bool{false, true} {
			s, err := Read(bytes.NewReader(data), ReadOptions{Frames: frames})
			if err != nil {
				var de *DecodeError
				if !errors.As(err, &de) {
					t.Fatalf("%v is not a *DecodeError", err)
				}
				continue
			}
			for _, tr := range s.DeviceTraces {
				BuildOps(tr)
			}
			var w1, w2 bytes.Buffer
			if err := snapshot.WritePickle(&w1, s); err != nil {
				t.Fatalf("WritePickle: %v", err)
			}
			back, err := Read(bytes.NewReader(w1.Bytes()), ReadOptions{Frames: frames})
			if err != nil {
				t.Fatalf("reading back: %v", err)
			}
			if err := snapshot.WritePickle(&w2, back); err != nil {
				t.Fatalf("WritePickle again: %v", err)
			}
			if !bytes.Equal(w1.Bytes(), w2.Bytes()) {
				t.Fatalf("round trip changed the snapshot:\n%+v\n%+v", s, back)
			}
		}
	})
}

// FuzzReadRMM feeds arbitrary RMM log lines to Read, after an RMM header so
// that the log reader sees them: it must return a snapshot or a
// *DecodeError, never panic; a snapshot has one device trace of at most
// two entries per line, which BuildOps accepts.
func FuzzReadRMM(f *testing.F) {
	_, body, _ := strings.Cut(rmmSample, "\n")
	f.Add("Thread,Time,Action,Pointer,Size,Stream", body)
	f.Add("Action,Pointer,Size", "allocate,1,1\n\n\r\nfree,1,1\n")
	f.Add("Action,Pointer,Size,Time", "allocate failure,0x0,5,23:59:59.9\nallocate,16,5,00:00:00:1\n")
	f.Add("\xef\xbb\xbfaction,pointer,size,stream", "deallocate,0x10,5,-1\n")
	f.Fuzz(func(t *testing.T, header, body string) {
		if !isRMMLog([]byte(header)) {
			header = "Thread,Time,Action,Pointer,Size,Stream"
		}
		log := header + "\n" + body
		s, err := Read(strings.NewReader(log), ReadOptions{MaxMemory: 1 << 20})
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("%v is not a *DecodeError", err)
			}
			return
		}
		if len(s.DeviceTraces) != 1 || len(s.Segments) != 0 {
			t.Fatalf("%d device traces, %d segments", len(s.DeviceTraces), len(s.Segments))
		}
		if n, lines := len(s.DeviceTraces[0]), strings.Count(log, "\n")+1; n > 2*lines {
			t.Fatalf("%d entries from %d lines", n, lines)
		}
		BuildOps(s.DeviceTraces[0])
	})
}
