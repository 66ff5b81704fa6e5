package allocator

import (
	"testing"
	"time"
)

// TestGranuleMapWideSegment maps segments that span more regions than an
// empty region table has slots (a 14 GiB segment spans 14 of 1 GiB; the
// table starts with 8). Building the table used to fill it and then search
// it for an empty slot for ever: a malloc of 14 GiB on a fresh allocator
// never returned.
func TestGranuleMapWideSegment(t *testing.T) {
	for _, size := range []uint64{9 << 30, 14 << 30, 15<<30 + 3<<20} {
		a, _ := newTestAllocator(t, 141<<30, "")
		done := make(chan error, 1)
		go func() {
			p, err := a.Malloc(size, 0)
			if err == nil {
				err = a.Free(p)
			}
			done <- err
		}()
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("%d GiB: %v", size>>30, err)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("a malloc of %d bytes did not return", size)
		}
		if err := a.Check(); err != nil {
			t.Fatalf("%d GiB: %v", size>>30, err)
		}
	}
}
