package simdev

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
)

// TestSimPlanRefused: a plan with an address the Sim cannot hand out is
// refused by New with an error that names the entry and its address.
func TestSimPlanRefused(t *testing.T) {
	const mib = 1 << 20
	good := Address{Addr: 0x7f0000000000, Size: 2 * mib}
	for _, tc := range []struct {
		name string
		bad  Address
		why  string
	}{
		{"unaligned", Address{Addr: 0x7f0000000200, Size: 2 * mib}, "aligned"},
		{"wraps past 2^64", Address{Addr: cudart.Ptr(math.MaxUint64 - 2*mib + 1), Size: 20 * mib}, "wraps"},
		{"at zero", Address{Addr: 0, Size: 2 * mib}, "outside"},
		{"below the range", Address{Addr: 0x200000, Size: 2 * mib}, "outside"},
		{"above the range", Address{Addr: 1 << 63, Size: 2 * mib}, "outside"},
		{"in device 1's range", Address{Addr: cudart.Ptr(DeviceSpan + 0x7f0000000000), Size: 2 * mib}, "outside"},
		{"runs past the range", Address{Addr: cudart.Ptr(DeviceSpan - 2*mib), Size: 4 * mib}, "outside"},
		{"empty", Address{Addr: 0x7f0000200000, Size: 0}, "size"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{Capacity: 1 << 30, Addresses: []Address{good, tc.bad}})
			wantErr(t, "New", err, cudart.ErrInvalidValue, "entry 1", hex(tc.bad.Addr), tc.why)
		})
	}
	if _, err := New(Config{Capacity: 1 << 30, Addresses: []Address{good, good}}); err != nil {
		t.Errorf("a plan that reuses an address (freed, then allocated again) was refused: %v", err)
	}
}

func hex(p cudart.Ptr) string { return fmt.Sprintf("%#x", uint64(p)) }

// TestSimNeverHandsOutAnAddressTwice: a planned address where fresh
// addresses start is taken by its Malloc, and the next fresh Malloc goes
// around it instead of handing it out again.
func TestSimNeverHandsOutAnAddressTwice(t *testing.T) {
	probe, err := New(Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	first, _ := probe.Malloc(2 << 20) // where fresh addresses start
	s, err := New(Config{Capacity: 1 << 30, Addresses: []Address{{Addr: first, Size: 2 << 20}}})
	if err != nil {
		t.Fatal(err)
	}
	var live [][2]uint64
	for _, size := range []uint64{2 << 20, 2 << 20, 4 << 20, 2 << 20} {
		p, err := s.Malloc(size)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range live {
			if uint64(p) < r[0]+r[1] && r[0] < uint64(p)+size {
				t.Fatalf("Malloc(%d) = %#x overlaps the live [%#x, +%d)", size, uint64(p), r[0], r[1])
			}
		}
		live = append(live, [2]uint64{uint64(p), size})
	}
}

// TestSimRangesDistinct: each Sim hands out addresses only from its own
// range, so two devices never share an address, however much address
// space the first reserves.
func TestSimRangesDistinct(t *testing.T) {
	var sims [2]*Sim
	for i := range sims {
		s, err := New(Config{Capacity: 141 << 30, Index: i})
		if err != nil {
			t.Fatal(err)
		}
		sims[i] = s
	}
	lo0, hi0, err := Range(0)
	if err != nil {
		t.Fatal(err)
	}
	lo1, hi1, err := Range(1)
	if err != nil {
		t.Fatal(err)
	}
	if lo1 < hi0 && lo0 < hi1 {
		t.Fatalf("ranges overlap: [%#x, %#x) and [%#x, %#x)", uint64(lo0), uint64(hi0), uint64(lo1), uint64(hi1))
	}
	in := func(i int, p cudart.Ptr, size uint64) {
		t.Helper()
		lo, hi, _ := Range(i)
		if p < lo || uint64(p)+size > uint64(hi) {
			t.Errorf("device %d: [%#x, +%d) is outside its range [%#x, %#x)", i, uint64(p), size, uint64(lo), uint64(hi))
		}
	}
	// Expandable segments reserve 1.125 × capacity per stream and pool.
	const reserve = 160 << 30
	var res []cudart.Ptr
	for range 16 {
		r, err := sims[0].Reserve(reserve)
		if err != nil {
			t.Fatal(err)
		}
		in(0, r, reserve)
		res = append(res, r)
	}
	p0, err := sims[0].Malloc(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	in(0, p0, 2<<20)
	p1, err := sims[1].Malloc(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	in(1, p1, 2<<20)
	for _, r := range append(res, p0) {
		if p1 >= r && p1 < r+reserve {
			t.Errorf("device 1's Malloc returned %#x, inside device 0's [%#x, +%d)", uint64(p1), uint64(r), uint64(reserve))
		}
	}
	for _, i := range []int{-1, MaxIndex + 1} {
		if _, err := New(Config{Capacity: 1 << 30, Index: i}); err == nil {
			t.Errorf("a Sim with index %d was made", i)
		}
	}
	if _, hi, err := Range(MaxIndex); err != nil || hi > 1<<63 {
		t.Errorf("Range(MaxIndex) ends at %#x, %v; want at most 2^63", uint64(hi), err)
	}
}

// TestSimAddressSpaceReused: once the bump pointer reaches the end of the
// range, freed address space is handed out again rather than addresses
// outside the range; a range with no room left refuses with out of memory.
func TestSimAddressSpaceReused(t *testing.T) {
	s, err := New(Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	lo, hi, _ := Range(0)
	span := uint64(hi - lo)
	chunk := span / 8 &^ (simAlign - 1) // eight reservations fill the range
	var got []cudart.Ptr
	for range 8 {
		r, err := s.Reserve(chunk)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, r)
	}
	if _, err := s.Reserve(chunk); err == nil {
		t.Fatal("a reservation past the end of the range was made")
	}
	if err := s.ReleaseRange(got[1], chunk); err != nil {
		t.Fatal(err)
	}
	r, err := s.Reserve(chunk)
	if err != nil || r != got[1] {
		t.Fatalf("Reserve after a release = %#x, %v; want the released %#x", uint64(r), err, uint64(got[1]))
	}
}

// TestSimManyPlannedSegmentsFast: 40,000 planned segments, each taken by
// its Malloc while all the earlier ones stay live, take well under 5 s: a
// planned range is checked in O(log n).
func TestSimManyPlannedSegmentsFast(t *testing.T) {
	const n, size = 40000, 2 << 20
	plan := make([]Address, n)
	for i := range plan {
		plan[i] = Address{Addr: cudart.Ptr(0x7f0000000000 + uint64(i)*size), Size: size}
	}
	s, err := New(Config{Capacity: 141 << 30, Addresses: plan})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	for i := range plan {
		p, err := s.Malloc(size)
		if err != nil || p != plan[i].Addr {
			t.Fatalf("Malloc %d = %#x, %v; want the planned %#x", i, uint64(p), err, uint64(plan[i].Addr))
		}
	}
	took := time.Since(t0)
	t.Logf("%d planned mallocs in %v", n, took)
	if took > 5*time.Second {
		t.Errorf("%d planned mallocs took %v, want under 5 s", n, took)
	}
}
