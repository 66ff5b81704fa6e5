package allocator

import (
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// lendConf is coarse reclaim, which moves no free stretch shorter than
// 64 MiB, under a 70 MiB cap on a 4 GiB device.
const lendConf = "expandable_reclaim:coarse,per_process_memory_fraction:0.01708984375"

// ownerFreeBlock leaves the owner's range with one 60 MiB run, mapped
// whole, holding a live 4 MiB block y at its start and a 56 MiB free
// block after it, at x: neither reclaim nor releasing cached memory can
// take any of it (runs move only whole).
func ownerFreeBlock(t *testing.T, a *Allocator, owner cudart.Stream) (x, y cudart.Ptr) {
	t.Helper()
	z := mustMalloc(t, a, 60*miB, owner)
	mustFree(t, a, z)
	if y = mustMalloc(t, a, 4*miB, owner); y != z {
		t.Fatalf("owner's 4 MiB at %#x, want the start of its free 60 MiB %#x", uint64(y), uint64(z))
	}
	return y + cudart.Ptr(4*miB), y
}

// TestLendAcrossStreams follows one loan: the borrower's 30 MiB request,
// which the cap refuses to map and releasing cached memory cannot help,
// is lent the owner's free block (ownerFreeBlock) instead of failing:
// no new memory, two streams ordered on the device (one wait), and the
// invariants hold. A RecordStream on the borrower changes nothing; Free
// orders the owner after the borrower (a second wait) and returns the
// block to the owner, whose next request gets it on the hot path.
func TestLendAcrossStreams(t *testing.T) {
	a, sim := newExp(t, 4<<30, lendConf)
	owner, borrower := newStream(t, sim), newStream(t, sim)
	x, y := ownerFreeBlock(t, a, owner)
	before, waits := a.Stats(), sim.Counters().StreamWaits
	p := mustMalloc(t, a, 30*miB, borrower)
	st := a.Stats()
	if p != x || st.NumLends != 1 {
		t.Fatalf("borrower got %#x with %d lends; want the owner's free block %#x, lent", uint64(p), st.NumLends, uint64(x))
	}
	if r := st.ReservedBytes[PoolAll].Current; r != before.ReservedBytes[PoolAll].Current || st.NumDeviceAlloc != before.NumDeviceAlloc ||
		st.NumSyncAllStreams != before.NumSyncAllStreams || st.NumOOMs != 0 {
		t.Errorf("a loan changed reserved memory (%d → %d), mapped (%d → %d mappings), synchronised (%d → %d) or failed (%d)",
			before.ReservedBytes[PoolAll].Current, r, before.NumDeviceAlloc, st.NumDeviceAlloc, before.NumSyncAllStreams, st.NumSyncAllStreams, st.NumOOMs)
	}
	if got := sim.Counters().StreamWaits - waits; got != 1 {
		t.Errorf("lending made %d stream waits, want 1 (the borrower after the owner)", got)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	if err := a.RecordStream(p, borrower); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, p)
	if got := sim.Counters().StreamWaits - waits; got != 2 {
		t.Errorf("lending and returning made %d stream waits, want 2", got)
	}
	if pending := sim.PendingEvents(); pending != 0 {
		t.Errorf("%d events pending after the return; a RecordStream on the borrower should add none", pending)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	if q := mustMalloc(t, a, 56*miB, owner); q != x {
		t.Errorf("owner's next 56 MiB at %#x, want the returned block %#x", uint64(q), uint64(x))
	} else {
		mustFree(t, a, q)
	}
	mustFree(t, a, y)
}

// TestLendNeedsStreamOrder: on a device that cannot order one stream
// after another (no cudart.StreamWaiter), nothing is lent, and the
// borrower's request fails as it did before loans.
func TestLendNeedsStreamOrder(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 4 << 30, ManualEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	a := newExpOn(t, sim, noStreamWait{sim, sim}, lendConf)
	owner, borrower := newStream(t, sim), newStream(t, sim)
	x, y := ownerFreeBlock(t, a, owner)
	if p, err := a.Malloc(30*miB, borrower); !errors.Is(err, ErrOutOfMemory) || a.Stats().NumLends != 0 {
		t.Errorf("borrower's Malloc = %#x, %v with %d lends on a device without StreamWaitEvent; want out of memory", uint64(p), err, a.Stats().NumLends)
	}
	_ = x
	mustFree(t, a, y)
}

// noStreamWait is a device with virtual memory but without
// StreamWaitEvent.
type noStreamWait struct {
	cudart.Device
	cudart.VirtualMemory
}

// newStream returns a new stream of sim, destroyed at the end of the test.
func newStream(t *testing.T, sim *simdev.Sim) cudart.Stream {
	t.Helper()
	s, err := sim.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sim.StreamDestroy(s) })
	return s
}

// TestLendFreedDuringCapture: a lent block freed while a capture is under
// way orders no stream then (an event record would be captured into the
// graph); it waits, out of every free index, until the capture ends, and
// then returns to its owner as any lent block does.
func TestLendFreedDuringCapture(t *testing.T) {
	a, g := newGuardedAllocator(t, 4<<30, "expandable_segments:True,"+lendConf, simdev.Config{ManualEvents: true})
	sim := g.Sim
	owner, borrower, side := newStream(t, sim), newStream(t, sim), newStream(t, sim)
	x, y := ownerFreeBlock(t, a, owner)
	p := mustMalloc(t, a, 30*miB, borrower)
	if p != x || a.Stats().NumLends != 1 {
		t.Fatalf("borrower got %#x with %d lends; want %#x, lent", uint64(p), a.Stats().NumLends, uint64(x))
	}
	graph := PoolID{1, 0}
	if err := a.BeginAllocateToPool(graph, func(s cudart.Stream) bool { return s == side }); err != nil {
		t.Fatal(err)
	}
	g.set(true)
	mustFree(t, a, p)
	if f := g.take(); len(f) > 0 {
		t.Errorf("freeing a lent block during a capture called %v", f)
	}
	mustCheck(t, a)
	g.set(false)
	if err := a.EndAllocateToPool(graph); err != nil {
		t.Fatal(err)
	}
	if err := a.ReleasePool(graph); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if q := mustMalloc(t, a, 56*miB, owner); q != x {
		t.Errorf("owner's 56 MiB after the capture at %#x, want the returned block %#x", uint64(q), uint64(x))
	} else {
		mustFree(t, a, q)
	}
	mustFree(t, a, y)
}
