package allocator

import (
	"errors"
	"testing"
)

// TestAsyncCloseWithLiveBlocks: Close of a cudaMallocAsync allocator with
// live and stream-pending blocks returns the memory, reports the live
// ones, and leaves bookkeeping that Check accepts (issue: the live map
// stayed set).
func TestAsyncCloseWithLiveBlocks(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "backend:cudaMallocAsync")
	s, err := sim.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	mustMalloc(t, a, 4096, 0)
	mustMalloc(t, a, 8*miB, 0)
	q := mustMalloc(t, a, miB, 0)
	if err := a.RecordStream(q, s); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, q)
	err = a.Close()
	if !errors.Is(err, ErrLiveBlocks) {
		t.Fatalf("Close = %v, want ErrLiveBlocks", err)
	}
	if err := a.Check(); err != nil {
		t.Errorf("Check after Close: %v", err)
	}
	if used := sim.Used(); used != 0 {
		t.Errorf("the device still holds %d bytes", used)
	}
	if h := a.holds(q); h != holdNone {
		t.Errorf("closed allocator still holds %#x", uint64(q))
	}
}
