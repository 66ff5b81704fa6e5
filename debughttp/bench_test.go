package debughttp

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// fullHistory returns an allocator whose history ring of n entries is
// full (Malloc/Free pairs of varied sizes).
func fullHistory(b *testing.B, n int) *allocator.Allocator {
	b.Helper()
	dev, err := simdev.New(simdev.Config{Capacity: 4 << 30})
	if err != nil {
		b.Fatal(err)
	}
	a, err := allocator.New(dev, allocator.DefaultConfig(), allocator.WithHistory(n))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = a.Close() })
	for i := range n/2 + 1 {
		p, err := a.Malloc(uint64(512+i%(4<<20)), cudart.DefaultStream)
		if err != nil {
			b.Fatal(err)
		}
		if err := a.Free(p); err != nil {
			b.Fatal(err)
		}
	}
	return a
}

// BenchmarkSnapshotFullHistory measures Allocator.Snapshot with a full
// history: all of it runs under the allocator's lock, so ns/op is how
// long a /debug/snapshot request stalls Malloc and Free.
func BenchmarkSnapshotFullHistory(b *testing.B) {
	for _, n := range []int{100_000, 1_000_000, allocator.MaxHistoryEntries} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			a := fullHistory(b, n)
			b.ReportAllocs()
			for b.Loop() {
				if s := a.Snapshot(); len(s.DeviceTraces[0]) != n {
					b.Fatalf("%d entries, want %d", len(s.DeviceTraces[0]), n)
				}
			}
		})
	}
}

// BenchmarkServeSnapshot measures a whole /debug/snapshot request with a
// full 1M-entry history: Snapshot, the cap to the default 100,000 entries
// and the streamed JSON or pickle.
func BenchmarkServeSnapshot(b *testing.B) {
	a := fullHistory(b, 1_000_000)
	h, err := ForAllocator(a, Options{})
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range []string{"json", "pickle"} {
		b.Run(f, func(b *testing.B) {
			req := httptest.NewRequest("GET", "/debug/snapshot?format="+f, nil)
			b.ReportAllocs()
			for b.Loop() {
				w := &discardWriter{header: map[string][]string{}}
				h.ServeHTTP(w, req)
				if w.code != 0 && w.code != 200 {
					b.Fatal(w.code)
				}
				b.SetBytes(w.n)
			}
		})
	}
}

// discardWriter is an http.ResponseWriter that counts and drops the body.
type discardWriter struct {
	header map[string][]string
	code   int
	n      int64
}

func (w *discardWriter) Header() http.Header { return w.header }
func (w *discardWriter) WriteHeader(c int)   { w.code = c }
func (w *discardWriter) Write(p []byte) (int, error) {
	w.n += int64(len(p))
	return io.Discard.Write(p)
}
