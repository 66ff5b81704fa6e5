package bench

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/workload"
)

const planMiB = 1 << 20

const manySegmentsN = 40000

func segAlloc(addr, size uint64) snapshot.Entry {
	return snapshot.Entry{Action: snapshot.ActionSegmentAlloc, Addr: addr, Size: size}
}

func segFree(addr, size uint64) snapshot.Entry {
	return snapshot.Entry{Action: snapshot.ActionSegmentFree, Addr: addr, Size: size}
}

func allocEntry(addr, size uint64) snapshot.Entry {
	return snapshot.Entry{Action: snapshot.ActionAlloc, Addr: addr, Size: size}
}

func freeEntries(addr, size uint64) []snapshot.Entry {
	return []snapshot.Entry{
		{Action: snapshot.ActionFreeRequested, Addr: addr, Size: size},
		{Action: snapshot.ActionFreeCompleted, Addr: addr, Size: size},
	}
}

func simTarget(t testing.TB) *Target {
	t.Helper()
	target, err := OpenTarget("sim", 141<<30)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = target.Close() })
	return target
}

// TestReplayRefusesBadSegmentAddresses: a trace whose recorded segments
// overlap, wrap past 2^64, are unaligned or lie outside the simulated
// device's addresses is refused before the replay runs, by an error that
// names the entry and its address; reusing a freed segment's address is
// fine.
func TestReplayRefusesBadSegmentAddresses(t *testing.T) {
	const a = 0x7f0000000000
	for _, tc := range []struct {
		name    string
		entries []snapshot.Entry
		entry   int    // the entry refused; -1: accepted
		addr    uint64 // its address
		why     string
	}{
		{"duplicate address", []snapshot.Entry{segAlloc(a, 2*planMiB), allocEntry(a, 2*planMiB), segAlloc(a, 2*planMiB), allocEntry(a, 2*planMiB)}, 2, a, "overlaps"},
		{"overlapping", []snapshot.Entry{segAlloc(a, 20*planMiB), segAlloc(a+4*planMiB, 2*planMiB), allocEntry(a, 2*planMiB)}, 1, a + 4*planMiB, "overlaps"},
		{"wrapping near 2^64", []snapshot.Entry{segAlloc(math.MaxUint64-2*planMiB+1, 20*planMiB), allocEntry(math.MaxUint64-2*planMiB+1, 2*planMiB)}, 0, math.MaxUint64 - 2*planMiB + 1, "wraps"},
		{"unaligned", []snapshot.Entry{segAlloc(a, 2*planMiB), segAlloc(a+4*planMiB+512, 2*planMiB), allocEntry(a+4*planMiB+512, 512)}, 1, a + 4*planMiB + 512, "aligned"},
		{"outside the range", []snapshot.Entry{segAlloc(0x200000, 2*planMiB), allocEntry(0x200000, 2*planMiB)}, 0, 0x200000, "outside"},
		{"at zero", []snapshot.Entry{segAlloc(0, 2*planMiB), allocEntry(0, 2*planMiB)}, 0, 0, "outside"},
		{"address reused after segment_free", append(append([]snapshot.Entry{segAlloc(a, 2*planMiB), allocEntry(a, 2*planMiB)}, freeEntries(a, 2*planMiB)...),
			segFree(a, 2*planMiB), segAlloc(a, 2*planMiB), allocEntry(a, 2*planMiB)), -1, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := workload.NewTrace(tc.name, tc.entries)
			_, err := simTarget(t).Replay(tr, allocator.DefaultConfig(), workload.ReplayOptions{}, nil)
			if tc.entry < 0 {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("replayed, want an error")
			}
			for _, w := range []string{fmt.Sprintf("entry %d", tc.entry), fmt.Sprintf("%#x", tc.addr), tc.why} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%q does not say %q", err, w)
				}
			}
		})
	}
}

// manySegments is a trace of n recorded 2 MiB segments, each holding two
// live 1 MiB blocks.
func manySegments(n int) []snapshot.Entry {
	entries := make([]snapshot.Entry, 0, 3*n)
	for i := range n {
		addr := uint64(0x7f0000000000) + uint64(i)*2*planMiB
		entries = append(entries, segAlloc(addr, 2*planMiB), allocEntry(addr, planMiB), allocEntry(addr+planMiB, planMiB))
	}
	return entries
}

// TestReplayManySegmentsFast: a replay of 40,000 recorded segments takes
// well under 5 s, the simulated device's mallocs included: a planned range
// is checked in O(log n), not by a scan of every live allocation, and a new
// segment copies one chunk of the allocator's directory, not all of it.
// (Under -race it takes minutes and is skipped; cudart's
// TestSimManyPlannedSegmentsFast and allocator's TestDirAddRemove check
// the parts there.)
func TestReplayManySegmentsFast(t *testing.T) {
	if raceEnabled {
		t.Skip("-race: the replay of 40,000 segments is too slow under the race detector")
	}
	n := int64(manySegmentsN)
	tr := workload.NewTrace("many segments", manySegments(int(n)))
	t0 := time.Now()
	row, err := simTarget(t).Replay(tr, allocator.DefaultConfig(), workload.ReplayOptions{}, nil)
	took := time.Since(t0)
	if err != nil {
		t.Fatal(err)
	}
	if row.DeviceMallocs != n || row.PeakReservedBytes != n*2*planMiB {
		t.Errorf("%d device mallocs, peak reserved %d; want %d and %d", row.DeviceMallocs, row.PeakReservedBytes, n, n*2*planMiB)
	}
	inDevice := time.Duration(row.DeviceMallocNsPerOp * float64(row.Ops))
	t.Logf("%d segments replayed in %v, %v of it in the device's mallocs", n, took, inDevice)
	if took > 5*time.Second {
		t.Errorf("the replay of %d planned segments took %v (%v in the device's mallocs), want under 5 s", n, took, inDevice)
	}
}

// dupDevice is a Sim whose second Malloc returns the first one's address
// again, as a broken device (or plan) would.
type dupDevice struct {
	*simdev.Sim
	first cudart.Ptr
	n     int
}

func (d *dupDevice) Malloc(size uint64) (cudart.Ptr, error) {
	p, err := d.Sim.Malloc(size)
	if d.n++; d.n == 1 {
		d.first = p
	} else if d.n == 2 && err == nil {
		return d.first, nil
	}
	return p, err
}

func (d *dupDevice) Free(p cudart.Ptr) error { return nil }

// TestReplayFailsWhenCheckFails: a replay after which the allocator's
// Check fails (here: the device handed out one address twice) is an error.
func TestReplayFailsWhenCheckFails(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	target := &Target{cuda: &dupDevice{Sim: sim}, Desc: "a device that hands out one address twice"}
	entries := []snapshot.Entry{allocEntry(0x7f0000000000, 30*planMiB), allocEntry(0x7f0002000000, 30*planMiB)}
	_, err = target.Replay(workload.NewTrace("dup", entries), allocator.DefaultConfig(), workload.ReplayOptions{}, nil)
	if err == nil || !strings.Contains(err.Error(), "Check") {
		t.Fatalf("replay: %v, want an error saying Check failed", err)
	}
	if errors.Is(err, allocator.ErrOutOfMemory) {
		t.Errorf("%v: an out-of-memory error", err)
	}
}
