package gputest

import (
	"fmt"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// TestGPUExpandableLend checks, on a GPU, the order that lending a free
// block across streams keeps (expandable segments with coarse reclaim,
// under a 70 MiB cap). A stream (the owner) queues long work on a block,
// frees it and takes a small block at its start, which keeps the rest of
// the block's run mapped and free (X) out of reach of reclaim and of
// releasing cached memory; another stream (the borrower) then asks for
// less than X, more than the cap leaves room for, and is lent X's memory
// instead of failing. The borrower writes the block after the owner's
// queued work (its stream waits for it on the device), then queues long
// work of its own and frees it; the owner, asking again, gets the block
// back and writes it after the borrower's work. Each block reads back
// whole.
func TestGPUExpandableLend(t *testing.T) {
	if corrupt := runLend(t, openGPU(t), 4000); corrupt > 0 {
		t.Errorf("%d windows corrupted", corrupt)
	}
}

// TestGPUExpandableLendControl runs the same steps on a GPU whose
// StreamWaitEvent does nothing: the borrower's writes then run beside the
// owner's queued ones, and the blocks should read back corrupted. It
// fails nothing (a GPU may finish the owner's work first); it shows
// whether TestGPUExpandableLend can tell an order kept from one missed.
func TestGPUExpandableLendControl(t *testing.T) {
	dev := openGPU(t)
	corrupt := runLend(t, noWait{dev, dev}, 4000)
	t.Logf("gpu-lend control (no wait on the device): corrupted windows %d", corrupt)
}

// noWait is a device whose StreamWaitEvent orders nothing.
type noWait struct {
	cudart.Device
	cudart.VirtualMemory
}

func (noWait) StreamWaitEvent(cudart.Stream, cudart.Event) error { return nil }

// TestExpandableLendOnSim runs the same steps on a simulated device with
// backing memory, whose work completes as it is queued: it checks the
// loan and the return, not the device's order.
func TestExpandableLendOnSim(t *testing.T) {
	if corrupt := runLend(t, openBackedSims(t, 1, 4*giB)[0], 1); corrupt > 0 {
		t.Errorf("%d windows corrupted", corrupt)
	}
}

// runLend is TestGPUExpandableLend on dev with writes memsets in each
// long piece of work; it returns how many windows read back corrupted
// (readBack reports the first few).
func runLend(t *testing.T, dev cudart.Device, writes int) int {
	_, total, err := dev.MemGetInfo()
	if err != nil {
		t.Fatal(err)
	}
	a := newAllocator(t, dev, fmt.Sprintf("expandable_segments:True,expandable_reclaim:coarse,per_process_memory_fraction:%.12f",
		float64(70*miB)/float64(total)))
	defer func() {
		if err := a.Close(); err != nil {
			t.Error(err)
		}
	}()
	owner, err := dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer dev.StreamDestroy(owner)
	borrower, err := dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer dev.StreamDestroy(borrower)
	// One 60 MiB run, mapped whole, written at length on the owner and
	// freed; a live 4 MiB block Y at its start keeps the run, so the free
	// 56 MiB after it (X) can be neither reclaimed nor released.
	const zSize, ySize, want = 60 * miB, 4 * miB, 30 * miB
	z, err := a.Malloc(zSize, owner)
	if err != nil {
		t.Fatal(err)
	}
	queueWrites(t, dev, z, zSize, 0xa1, owner, writes)
	if err := a.Free(z); err != nil {
		t.Fatal(err)
	}
	y, err := a.Malloc(ySize, owner)
	if err != nil {
		t.Fatal(err)
	}
	x := y + cudart.Ptr(ySize)
	before := a.Stats()
	p, err := a.Malloc(want, borrower)
	if err != nil {
		t.Fatal(err)
	}
	if lends := a.Stats().NumLends - before.NumLends; lends != 1 || p != x {
		t.Fatalf("the borrower got %#x with %d lends; want X (%#x), lent: the test no longer covers what it is for", uint64(p), lends, uint64(x))
	}
	if st := a.Stats(); st.ReservedBytes[allocator.PoolAll].Current != before.ReservedBytes[allocator.PoolAll].Current || st.NumSyncAllStreams != before.NumSyncAllStreams || st.NumOOMs != 0 {
		t.Errorf("the loan changed reserved memory (%d → %d bytes), synchronised (%d times) or failed (%d)",
			before.ReservedBytes[allocator.PoolAll].Current, st.ReservedBytes[allocator.PoolAll].Current, st.NumSyncAllStreams-before.NumSyncAllStreams, st.NumOOMs)
	}
	if st := a.Stats(); st.VMM.Waits != before.VMM.Waits {
		t.Errorf("the out-of-memory path waited for a stream (%d waits) before the loan: the test no longer covers the order", st.VMM.Waits-before.VMM.Waits)
	}
	if err := dev.MemsetAsync(p, 0xb2, want, borrower); err != nil {
		t.Fatal(err)
	}
	corrupt := readBack(t, dev, []cudart.Stream{owner, borrower}, p, want, 0xb2)
	// The way back: long work on the borrower, then the owner reuses it.
	queueWrites(t, dev, p, want, 0xb3, borrower, writes)
	if err := a.Free(p); err != nil {
		t.Fatal(err)
	}
	q, err := a.Malloc(want, owner)
	if err != nil {
		t.Fatal(err)
	}
	if q != p {
		t.Fatalf("the owner got %#x back, not the returned block %#x: the test no longer covers what it is for", uint64(q), uint64(p))
	}
	if err := dev.MemsetAsync(q, 0xc4, want, owner); err != nil {
		t.Fatal(err)
	}
	corrupt += readBack(t, dev, []cudart.Stream{owner, borrower}, q, want, 0xc4)
	for _, r := range []cudart.Ptr{q, y} {
		if err := a.Free(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	st := a.Stats()
	t.Logf("gpu-lend: lends %d, corrupted windows %d, reclaims %d", st.NumLends, corrupt, st.NumReclaims)
	return corrupt
}
