package allocator

import (
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestCheckCatchesCorruptCounts: Check compares every pool's counts with
// the blocks, so a statistic moved from one pool to the other, or off in
// every pool, is reported by name.
func TestCheckCatchesCorruptCounts(t *testing.T) {
	for _, tc := range []struct {
		name    string
		corrupt func(h *hotStats)
		want    string
	}{
		{"allocated bytes moved between pools", func(h *hotStats) {
			h.AllocatedBytes[PoolSmall].Current += 512
			h.AllocatedBytes[PoolLarge].Current -= 512
		}, "allocated_bytes"},
		{"allocated bytes off in every pool", func(h *hotStats) {
			h.AllocatedBytes[PoolAll].Current += 2 << 20
			h.AllocatedBytes[PoolLarge].Current += 2 << 20
		}, "allocated_bytes"},
		{"allocations moved between pools", func(h *hotStats) {
			h.Allocation[PoolSmall].Current++
			h.Allocation[PoolLarge].Current--
		}, "allocation"},
		{"requested bytes moved between pools", func(h *hotStats) {
			h.RequestedBytes[PoolSmall].Current -= 8
			h.RequestedBytes[PoolLarge].Current += 8
		}, "requested_bytes"},
		{"allocated bytes disagree with what was allocated and freed", func(h *hotStats) {
			h.AllocatedBytes[PoolAll].Freed += 512
			h.AllocatedBytes[PoolLarge].Freed += 512
		}, "allocated_bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim, err := simdev.New(simdev.Config{Capacity: 1 << 30})
			if err != nil {
				t.Fatal(err)
			}
			a, err := New(sim, DefaultConfig())
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			mustMalloc(t, a, 4096, 0)  // small pool
			mustMalloc(t, a, 3<<20, 0) // large pool
			mustFree(t, a, mustMalloc(t, a, 8<<20, 0))
			mustCheck(t, a)
			a.lockWorld()
			tc.corrupt(&a.shardOf(0).stats)
			a.unlockWorld()
			err = a.Check()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Check = %v, want an error naming %s", err, tc.want)
			}
		})
	}
}

// wrapDevice is a Sim whose first Malloc hands out the address 2^64 − 2 MiB
// instead of its own, as a broken device or plan could: the segment then
// wraps past 2^64, and a block lands at address 0.
type wrapDevice struct {
	*simdev.Sim
	mu    sync.Mutex
	alias map[cudart.Ptr]cudart.Ptr
}

const wrapAddr = cudart.Ptr(^uint64(0) - 2<<20 + 1)

func (d *wrapDevice) Malloc(size uint64) (cudart.Ptr, error) {
	p, err := d.Sim.Malloc(size)
	d.mu.Lock()
	defer d.mu.Unlock()
	if err == nil && len(d.alias) == 0 {
		d.alias = map[cudart.Ptr]cudart.Ptr{wrapAddr: p}
		return wrapAddr, nil
	}
	return p, err
}

func (d *wrapDevice) Free(p cudart.Ptr) error {
	d.mu.Lock()
	if q, ok := d.alias[p]; ok {
		p = q
	}
	d.mu.Unlock()
	return d.Sim.Free(p)
}

// TestCheckCatchesWrappedSegment: a segment that wraps past 2^64 (the
// device handed out an address near the top) is reported by Check.
func TestCheckCatchesWrappedSegment(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(&wrapDevice{Sim: sim}, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for range 3 {
		mustMalloc(t, a, 2<<20, 0)
	}
	err = a.Check()
	if err == nil || !strings.Contains(err.Error(), "wraps") {
		t.Errorf("Check = %v, want an error saying the segment wraps past 2^64", err)
	}
}

// TestCheckCatchesStaleGates: a shard whose hot-path gates disagree with
// the allocator's state (history on, yet the gate open) is reported, and
// with the gates right, recording history sends Malloc and Free to the
// slow path, which records them.
func TestCheckCatchesStaleGates(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(sim, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	mustFree(t, a, mustMalloc(t, a, 4096, 0))
	if err := a.RecordHistory(HistoryOptions{MaxEntries: 100}); err != nil {
		t.Fatal(err)
	}
	sh := a.shardOf(0)
	if sh.mallocMax != 0 || !sh.freeOff {
		t.Fatalf("history on, gates still open: %d/%v", sh.mallocMax, sh.freeOff)
	}
	mustFree(t, a, mustMalloc(t, a, 4096, 0))
	if n := len(a.Snapshot().DeviceTraces[0]); n < 2 {
		t.Fatalf("history holds %d entries after a malloc and a free, want 2", n)
	}
	a.lockAll()
	sh.mallocMax, sh.freeOff = maxRequestSize, false
	err = errors.Join(a.checkShards()...)
	a.refreshGates()
	a.unlockWorld()
	if err == nil || !strings.Contains(err.Error(), "hot-path gates") {
		t.Fatalf("Check with stale gates: %v", err)
	}
	mustCheck(t, a)
}
