package gputest

import (
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// TestGPUExpandableReclaimWaits checks, on a GPU, what expandable
// segments' reclaim does with memory that queued work still writes: the
// free block's runs stay mapped where they were (standby mappings) and
// are mapped again for the growth. A stream queues long work on a block
// X and frees it; a growth then reclaims X's runs.
//
//   - On another stream, the growth must wait for that work (X's runs are
//     handed over): the work has completed when Malloc returns, and the
//     new block, written after, reads back whole.
//   - On X's own stream, the growth need not wait (the new block's work
//     is queued after X's on the same stream): Malloc returns while the
//     work still runs, and the new block, written after it in stream
//     order through another address of the same physical memory, reads
//     back whole.
func TestGPUExpandableReclaimWaits(t *testing.T) {
	runReclaimWaits(t, openGPU(t), true)
}

// TestExpandableReclaimWaitsOnSim runs the same steps on a simulated device
// with backing memory, whose work completes as it is queued: the growth
// reclaims X's runs and the new block reads back whole; it says nothing
// about waiting.
func TestExpandableReclaimWaitsOnSim(t *testing.T) {
	runReclaimWaits(t, openBackedSims(t, 1, 4*giB)[0], false)
}

// runReclaimWaits is TestGPUExpandableReclaimWaits on dev; timed says
// that dev runs queued work asynchronously, as a GPU does.
func runReclaimWaits(t *testing.T, dev cudart.Device, timed bool) {
	for _, tc := range []struct {
		name        string
		otherStream bool
	}{
		{"another stream", true},
		{"the same stream", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAllocator(t, dev, "expandable_segments:True")
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
			grower := owner
			if tc.otherStream {
				if grower, err = dev.StreamCreate(); err != nil {
					t.Fatal(err)
				}
				defer dev.StreamDestroy(grower)
			}
			// X, then a live block after it, so that a larger request
			// cannot grow X in place and must grow the range past Y.
			const xSize, ySize = 256 * miB, 8 * miB
			x, err := a.Malloc(xSize, owner)
			if err != nil {
				t.Fatal(err)
			}
			y, err := a.Malloc(ySize, owner)
			if err != nil {
				t.Fatal(err)
			}
			// About a tenth of a second of writes to X on its stream on a
			// GPU; one on the simulated device, whose work runs as it is
			// queued (and which writes its backing memory, slowly).
			writes := 1
			if timed {
				writes = 2000
			}
			marker := queueWrites(t, dev, x, xSize, 0xa1, owner, writes)
			if err := a.Free(x); err != nil {
				t.Fatal(err)
			}
			before := a.Stats()
			// Larger than X, so that nothing free serves it.
			const want = xSize + 4*miB
			p, err := a.Malloc(want, grower)
			if err != nil {
				t.Fatal(err)
			}
			done, err := dev.EventQuery(marker)
			if err != nil {
				t.Fatal(err)
			}
			after := a.Stats()
			moved := after.NumReclaims > before.NumReclaims
			t.Logf("gpu-reclaim (%s): reclaims %d, creates %d, maps %d, unmaps %d, revived %d, waits %d; X's work done when Malloc returned: %v",
				tc.name, after.NumReclaims-before.NumReclaims, after.VMM.Creates-before.VMM.Creates, after.VMM.Maps-before.VMM.Maps,
				after.VMM.Unmaps-before.VMM.Unmaps, after.VMM.Revived-before.VMM.Revived, after.VMM.Waits-before.VMM.Waits, done)
			if !moved {
				t.Fatalf("the growth made no reclaim (%d reclaims before and after): the test no longer covers what it is for", after.NumReclaims)
			}
			switch {
			case !timed:
			case tc.otherStream && !done:
				t.Errorf("Malloc on another stream returned with X's pages mapped for it while X's work still ran")
			case !tc.otherStream && done:
				t.Logf("X's work had completed when Malloc returned on its own stream: the GPU was faster than the test assumes, so it shows nothing about waiting")
			}
			if err := dev.MemsetAsync(p, 0xb2, want, grower); err != nil {
				t.Fatal(err)
			}
			// A window in every 2 MiB page: the moved runs lie anywhere in p.
			corrupt := readBack(t, dev, []cudart.Stream{owner, grower}, p, want, 0xb2)
			if corrupt > 0 {
				t.Errorf("%d windows of the new block corrupted", corrupt)
			}
			for _, q := range []cudart.Ptr{p, y} {
				if err := a.Free(q); err != nil {
					t.Fatal(err)
				}
			}
			if err := a.Check(); err != nil {
				t.Fatal(err)
			}
			st := a.Stats()
			t.Logf("gpu-reclaim (%s): corrupted windows %d, peak reserved %s",
				tc.name, corrupt, allocator.FormatSize(uint64(st.ReservedBytes[allocator.PoolAll].Peak)))
		})
	}
}
