package allocator

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
)

// newExpOn returns an allocator with expandable_segments:True (and conf)
// over dev, which wraps sim; at the end of the test it checks invariants,
// closes the allocator and checks that the device holds nothing.
func newExpOn(t testing.TB, sim *simdev.Sim, dev cudart.Device, conf string, opts ...Option) *Allocator {
	t.Helper()
	if conf != "" {
		conf = "," + conf
	}
	cfg, err := ParseConfig("expandable_segments:True" + conf)
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(dev, cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.Check(); err != nil {
			t.Errorf("invariants at end of test: %v", err)
		}
		if err := a.Close(); err != nil && !errors.Is(err, ErrLiveBlocks) {
			t.Errorf("Close: %v", err)
		}
		c := sim.VMMCounters()
		if used := sim.Used(); used != 0 || c.LiveHandles != 0 || c.LiveMappings != 0 || c.LiveReservations != 0 {
			t.Errorf("after Close the device holds %d bytes, %d handles, %d mappings, %d reservations",
				used, c.LiveHandles, c.LiveMappings, c.LiveReservations)
		}
	})
	return a
}

func newExp(t testing.TB, capacity uint64, conf string, opts ...Option) (*Allocator, *simdev.Sim) {
	t.Helper()
	sim, err := simdev.New(simdev.Config{Capacity: capacity, ManualEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	return newExpOn(t, sim, sim, conf, opts...), sim
}

// pageOf20MiB gives the large pool PyTorch's 20 MiB page even with
// reclaim on, for the tests whose arithmetic counts whole 20 MiB pages;
// the default with reclaim is 2 MiB (TestExpandableSmallPagesReclaim).
var pageOf20MiB Option = func(o *options) { o.expLargePage = largeBuffer }

// expect compares the allocator's reserved bytes, device mappings and
// unmappings, and the device's memory with the wanted values.
func expect(t *testing.T, a *Allocator, sim *simdev.Sim, reserved uint64, maps, unmaps int64) {
	t.Helper()
	s := a.Stats()
	if got := uint64(s.ReservedBytes[PoolAll].Current); got != reserved || s.NumDeviceAlloc != maps || s.NumDeviceFree != unmaps {
		t.Errorf("reserved %d MiB, maps %d, unmaps %d; want %d MiB, %d, %d",
			got/miB, s.NumDeviceAlloc, s.NumDeviceFree, reserved/miB, maps, unmaps)
	}
	if used := sim.Used(); used != reserved {
		t.Errorf("device holds %d MiB, reserved %d MiB", used/miB, reserved/miB)
	}
	if s.Segment[PoolAll].Current != 0 || s.InactiveSplit[PoolAll].Current != 0 || s.InactiveSplitBytes[PoolAll].Current != 0 {
		t.Errorf("segment %d, inactive_split %d (%d bytes): PyTorch counts none for expandable segments",
			s.Segment[PoolAll].Current, s.InactiveSplit[PoolAll].Current, s.InactiveSplitBytes[PoolAll].Current)
	}
	mustCheck(t, a)
}

// blockStates lists a snapshot segment's blocks as "5a" (5 MiB allocated)
// and "15f" (15 MiB free).
func blockStates(s snapshot.Segment) string {
	var out []string
	for _, b := range s.Blocks {
		st := "f"
		if b.State == "active_allocated" {
			st = "a"
		}
		out = append(out, formatMiB(b.Size)+st)
	}
	return strings.Join(out, " ")
}

func formatMiB(n uint64) string {
	if n%miB == 0 {
		return itoa(n / miB)
	}
	return itoa(n) + "B"
}

func itoa(n uint64) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// TestExpandableGrowsInPlace walks the policy through one large-pool
// segment: a request maps one 20 MiB page, the next is served from it, one
// that does not fit maps pages at the segment's end, frees merge across
// page boundaries, and EmptyCache unmaps every free page.
func TestExpandableGrowsInPlace(t *testing.T) {
	a, sim := newExp(t, giB, "", pageOf20MiB)
	p1 := mustMalloc(t, a, 5*miB, 0)
	expect(t, a, sim, 20*miB, 1, 0)
	p2 := mustMalloc(t, a, 5*miB, 0)
	if p2 != p1+cudart.Ptr(5*miB) {
		t.Errorf("second 5 MiB at %#x, want %#x in the same page", p2, p1+cudart.Ptr(5*miB))
	}
	expect(t, a, sim, 20*miB, 1, 0)
	p3 := mustMalloc(t, a, 30*miB, 0) // 10 MiB left in the page: one more page at the end
	if p3 != p1+cudart.Ptr(10*miB) {
		t.Errorf("30 MiB at %#x, want %#x, extending the segment", p3, p1+cudart.Ptr(10*miB))
	}
	expect(t, a, sim, 40*miB, 2, 0)
	if c := sim.VMMCounters(); c.Reserves != 1 || c.Creates != 2 || c.Maps != 2 {
		t.Errorf("device calls %+v: want one reservation and two pages", c)
	}
	snap := a.Snapshot()
	if len(snap.Segments) != 1 || !snap.Segments[0].IsExpandable || snap.Segments[0].Address != uint64(p1) ||
		snap.Segments[0].TotalSize != 40*miB || blockStates(snap.Segments[0]) != "5a 5a 30a" || snap.Segments[0].SegmentType != "large" {
		t.Fatalf("snapshot %+v", snap.Segments)
	}
	mustFree(t, a, p2)
	mustFree(t, a, p3)
	if got := blockStates(a.Snapshot().Segments[0]); got != "5a 35f" {
		t.Errorf("after two frees: blocks %s, want the free ones merged across the page boundary", got)
	}
	expect(t, a, sim, 40*miB, 2, 0)
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	// The second page is free and unmapped; the rest of the first stays.
	expect(t, a, sim, 20*miB, 2, 1)
	snap = a.Snapshot()
	if len(snap.Segments) != 1 || snap.Segments[0].TotalSize != 20*miB || blockStates(snap.Segments[0]) != "5a 15f" {
		t.Errorf("after EmptyCache: %+v", snap.Segments)
	}
	// The next request fills the unmapped pages again, at the same place.
	p4 := mustMalloc(t, a, 30*miB, 0)
	if p4 != p2 {
		t.Errorf("30 MiB at %#x, want %#x", p4, p2)
	}
	expect(t, a, sim, 40*miB, 3, 1)
	mustFree(t, a, p4)
	mustFree(t, a, p1)
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	expect(t, a, sim, 0, 3, 2)
	if c := sim.VMMCounters(); c.LiveReservations != 0 || c.ReleaseRanges != 1 || len(a.Snapshot().Segments) != 0 {
		t.Errorf("an entirely free segment was not released: %+v", c)
	}
}

// TestExpandableSmallPool: the small pool maps 2 MiB pages, and a block
// may straddle two of them.
func TestExpandableSmallPool(t *testing.T) {
	a, sim := newExp(t, giB, "", pageOf20MiB)
	q1 := mustMalloc(t, a, 4*kiB, 0)
	expect(t, a, sim, 2*miB, 1, 0)
	q2 := mustMalloc(t, a, miB, 0)
	expect(t, a, sim, 2*miB, 1, 0)
	q3 := mustMalloc(t, a, miB, 0) // 1 MiB - 4 KiB left: one more page
	if q2 != q1+cudart.Ptr(4*kiB) || q3 != q2+cudart.Ptr(miB) {
		t.Errorf("addresses %#x %#x %#x are not packed", q1, q2, q3)
	}
	expect(t, a, sim, 4*miB, 2, 0)
	s := a.Stats()
	if s.ReservedBytes[PoolSmall].Current != int64(4*miB) || s.ReservedBytes[PoolLarge].Current != 0 {
		t.Errorf("reserved by pool: small %d large %d", s.ReservedBytes[PoolSmall].Current, s.ReservedBytes[PoolLarge].Current)
	}
	if snap := a.Snapshot(); len(snap.Segments) != 1 || snap.Segments[0].SegmentType != "small" || snap.Segments[0].TotalSize != 4*miB {
		t.Errorf("snapshot %+v", snap.Segments)
	}
	// A large request goes to its own range with 20 MiB pages.
	l := mustMalloc(t, a, 2*miB, 0)
	expect(t, a, sim, 24*miB, 3, 0)
	if c := sim.VMMCounters(); c.Reserves != 2 {
		t.Errorf("%d reservations, want one per pool", c.Reserves)
	}
	for _, p := range []cudart.Ptr{q1, q2, q3, l} {
		mustFree(t, a, p)
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	expect(t, a, sim, 0, 3, 2)
}

// TestExpandableFit: a free block at the mapped end of a segment can grow,
// so best fit passes it over for a larger block that cannot (PyTorch's
// expandable_size).
func TestExpandableFit(t *testing.T) {
	for _, opts := range [][]Option{nil, {WithPyTorchExpandable()}} {
		a, _ := newExp(t, giB, "", opts...)
		x := mustMalloc(t, a, 10*miB, 0)
		y := mustMalloc(t, a, 6*miB, 0) // leaves 4 MiB free at the end of the page
		mustFree(t, a, x)               // a 10 MiB hole
		z := mustMalloc(t, a, 3*miB, 0)
		if z != x {
			t.Errorf("3 MiB at %#x, want the hole at %#x rather than the 4 MiB that can grow", z, x)
		}
		mustFree(t, a, y)
		mustFree(t, a, z)
	}
}

// TestExpandableSplit: expandable blocks split whenever 512 bytes remain,
// in the large pool too and even past max_split_size, as in PyTorch.
func TestExpandableSplit(t *testing.T) {
	// PyTorch's policy, so that the small request maps its own range
	// (allocd's would serve it from the large pool at the limit).
	a, sim := newExp(t, giB, "max_split_size_mb:40", WithPyTorchExpandable())
	p := mustMalloc(t, a, 50*miB, 0) // three pages; 10 MiB split off
	q := mustMalloc(t, a, 9*miB+512, 0)
	if q != p+cudart.Ptr(50*miB) {
		t.Errorf("9 MiB at %#x, want the remainder at %#x", q, p+cudart.Ptr(50*miB))
	}
	r := mustMalloc(t, a, 512*kiB-512, 0) // small pool: its own range
	if got := blockStates(a.Snapshot().Segments[0]); got != "50a 9437696Ba 1048064Bf" {
		t.Errorf("blocks %s, want the 1 MiB - 512 B remainder split off", got)
	}
	expect(t, a, sim, 60*miB+2*miB, 2, 0)
	if s := a.Stats(); s.OversizeAllocations.Current != 1 || s.OversizeSegments.Current != 0 {
		t.Errorf("oversize allocations %d segments %d, want 1 0", s.OversizeAllocations.Current, s.OversizeSegments.Current)
	}
	for _, x := range []cudart.Ptr{p, q, r} {
		mustFree(t, a, x)
	}
}

// TestExpandableReclaim: a request that fits no free block would raise
// reserved memory far past its high-water mark; allocd unmaps the free
// hole's pages first, PyTorch's policy (WithPyTorchExpandable) does not.
func TestExpandableReclaim(t *testing.T) {
	for _, tc := range []struct {
		name           string
		opts           []Option
		peak           uint64
		maps, unmaps   int64
		holeRefilledAt uint64
	}{
		{"allocd", nil, 160 * miB, 3, 1, 0},
		{"pytorch", []Option{WithPyTorchExpandable()}, 260 * miB, 3, 0, 260 * miB},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, sim := newExp(t, giB, "", tc.opts...)
			x := mustMalloc(t, a, 100*miB, 0) // pages 0-4
			y := mustMalloc(t, a, 10*miB, 0)  // page 5, 10 MiB free after it
			mustFree(t, a, x)                 // a 100 MiB hole
			z := mustMalloc(t, a, 150*miB, 0) // fits no free block: grows the segment
			if z != x+cudart.Ptr(110*miB) {
				t.Errorf("150 MiB at +%d MiB, want +110", (z-x)/cudart.Ptr(miB))
			}
			s := a.Stats()
			if peak := uint64(s.ReservedBytes[PoolAll].Peak); peak != tc.peak {
				t.Errorf("peak reserved %d MiB, want %d", peak/miB, tc.peak/miB)
			}
			expect(t, a, sim, tc.peak, tc.maps, tc.unmaps)
			// The next request fills the lowest-addressed room first: the
			// unmapped hole (allocd) or the mapped one (PyTorch).
			w := mustMalloc(t, a, 50*miB, 0)
			if w != x {
				t.Errorf("50 MiB at %#x, want the hole at %#x", w, x)
			}
			for _, p := range []cudart.Ptr{y, z, w} {
				mustFree(t, a, p)
			}
			if err := a.EmptyCache(); err != nil {
				t.Fatal(err)
			}
			if a.MemoryReserved() != 0 {
				t.Errorf("reserved %d after freeing all and EmptyCache", a.MemoryReserved())
			}
		})
	}
}

// TestExpandableSnapshotAndHistory: a segment with an unmapped gap is
// reported as two mapped ranges, and history records the mappings.
func TestExpandableSnapshotAndHistory(t *testing.T) {
	sim, _ := simdev.New(simdev.Config{Capacity: giB})
	a := newExpOn(t, sim, sim, "", WithHistory(100), pageOf20MiB)
	p := mustMalloc(t, a, 5*miB, 0)  // page 0
	x := mustMalloc(t, a, 40*miB, 0) // [5, 45): pages 1 and 2
	q := mustMalloc(t, a, 5*miB, 0)  // [45, 50)
	mustFree(t, a, x)
	if err := a.EmptyCache(); err != nil { // unmaps page 1 only
		t.Fatal(err)
	}
	expect(t, a, sim, 40*miB, 2, 1)
	snap := a.Snapshot()
	if len(snap.Segments) != 2 {
		t.Fatalf("%d segments in the snapshot, want two mapped ranges", len(snap.Segments))
	}
	base := uint64(p)
	for i, want := range []struct {
		addr   uint64
		blocks string
	}{{base, "5a 15f"}, {base + 40*miB, "5f 5a 10f"}} {
		s := snap.Segments[i]
		if s.Address != want.addr || s.TotalSize != 20*miB || !s.IsExpandable || blockStates(s) != want.blocks ||
			s.AllocatedSize != 5*miB || s.ActiveSize != 5*miB {
			t.Errorf("range %d: %+v (blocks %s), want at %#x with %s", i, s, blockStates(s), want.addr, want.blocks)
		}
	}
	var got []string
	for _, e := range snap.DeviceTraces[0] {
		switch e.Action {
		case snapshot.ActionSegmentMap, snapshot.ActionSegmentUnmap:
			got = append(got, string(e.Action)+"@"+itoa((e.Addr-base)/miB)+"+"+itoa(e.Size/miB))
		}
	}
	if want := "segment_map@0+20 segment_map@20+40 segment_unmap@20+20"; strings.Join(got, " ") != want {
		t.Errorf("history %v, want %s", got, want)
	}
	mustFree(t, a, p)
	mustFree(t, a, q)
}

// TestExpandableOOM: the device runs out; PyTorch's policy releases the
// cache (unmapping free pages of another stream's segment) and retries,
// allocd's reclaim unmaps them before asking; past that, an OOMError.
func TestExpandableOOM(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    []Option
		retries int64
	}{{"pytorch", []Option{WithPyTorchExpandable()}, 1}, {"allocd", nil, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			a, sim := newExp(t, 100*miB, "", append(tc.opts, pageOf20MiB)...)
			side, _ := sim.StreamCreate()
			mustFree(t, a, mustMalloc(t, a, 50*miB, 0)) // 60 MiB cached on stream 0
			b := mustMalloc(t, a, 50*miB, side)         // needs 60 MiB; 40 MiB left
			s := a.Stats()
			if s.NumAllocRetries != tc.retries || s.NumOOMs != 0 {
				t.Errorf("retries %d, ooms %d; want %d, 0", s.NumAllocRetries, s.NumOOMs, tc.retries)
			}
			expect(t, a, sim, 60*miB, 2, 1)
			if c := sim.VMMCounters(); tc.retries == 1 && (c.Reserves != 2 || c.ReleaseRanges != 1) {
				t.Errorf("the emptied segment was not released: %+v", c)
			}
			// 80 MiB on top of the 50 live: 10 MiB free after b, 80 more to
			// map, 40 left. A real OOM.
			before := a.Stats()
			_, err := a.Malloc(80*miB, side)
			var oom *OOMError
			if !errors.As(err, &oom) || !errors.Is(err, ErrOutOfMemory) || !errors.Is(err, cudart.ErrOutOfMemory) {
				t.Fatalf("want an OOMError, got %v", err)
			}
			if oom.Requested != 80*miB || oom.Reserved != 60*miB || oom.Allocated != 50*miB || oom.DeviceFree != 40*miB {
				t.Errorf("OOM facts %+v", oom)
			}
			after := a.Stats()
			if after.NumOOMs != before.NumOOMs+1 || after.NumAllocRetries != before.NumAllocRetries+1 {
				t.Errorf("OOM not counted: %+v", after)
			}
			expect(t, a, sim, 60*miB, 2, 1)
			// An injected out-of-memory on the next page is recovered by the
			// retry; another fault is returned, wrapped, changing nothing.
			sim.Faults().FailMalloc(1, nil)
			c := mustMalloc(t, a, 30*miB, side)
			if a.Stats().NumAllocRetries != after.NumAllocRetries+1 {
				t.Errorf("retry not counted")
			}
			mustFree(t, a, c)
			boom := errors.New("injected fault")
			sim.Faults().FailMalloc(1, boom)
			// 40 MiB: 30 free after b, one more page to map.
			expectUnchanged(t, a, boom, func() error { _, err := a.Malloc(40*miB, side); return err })
			mustFree(t, a, b)
		})
	}
}

// faultyVMM fails chosen virtual memory calls of the Sim it wraps: the
// n-th call from now when the count reaches 1.
type faultyVMM struct {
	*simdev.Sim
	mapAt, unmapAt, releaseAt int
}

var errFault = errors.New("injected device fault")

func countdown(n *int) bool {
	if *n == 0 {
		return false
	}
	*n--
	return *n == 0
}

func (f *faultyVMM) Map(p cudart.Ptr, size uint64, h cudart.Handle) error {
	if countdown(&f.mapAt) {
		return errFault
	}
	return f.Sim.Map(p, size, h)
}

// MapRange fails as Map does, page by page, leaving nothing mapped.
func (f *faultyVMM) MapRange(p cudart.Ptr, page uint64, hs []cudart.Handle) error {
	for i, h := range hs {
		if err := f.Map(p+cudart.Ptr(uint64(i)*page), page, h); err != nil {
			if i > 0 {
				_ = f.Sim.Unmap(p, uint64(i)*page)
			}
			return err
		}
	}
	return nil
}

// pageByPage hides the Sim's MapRange, so that mapPages maps page by page.
type pageByPage struct{ *faultyVMM }

func (pageByPage) MapRange() {} // not cudart.RangeMapper's method

func (f *faultyVMM) Unmap(p cudart.Ptr, size uint64) error {
	if countdown(&f.unmapAt) {
		return errFault
	}
	return f.Sim.Unmap(p, size)
}

func (f *faultyVMM) Release(h cudart.Handle) error {
	if countdown(&f.releaseAt) {
		return errFault
	}
	return f.Sim.Release(h)
}

// emptyCacheFailsUnchanged makes f fail the at-th unmap from now and
// checks that EmptyCache returns the fault and leaves the allocator whole,
// with its reserved bytes and device frees as they were.
func emptyCacheFailsUnchanged(t *testing.T, a *Allocator, f *faultyVMM, at int) {
	t.Helper()
	f.unmapAt = at
	before := a.Stats()
	if err := a.EmptyCache(); !errors.Is(err, errFault) {
		t.Fatalf("EmptyCache with a failing unmap: %v", err)
	}
	mustCheck(t, a)
	if after := a.Stats(); after.ReservedBytes != before.ReservedBytes || after.NumDeviceFree != before.NumDeviceFree {
		t.Errorf("a failed unmap changed reserved bytes or device frees")
	}
}

// TestExpandableDeviceFaults: a failed map or unmap is returned wrapped and
// undone; a failed release is retried at Close.
func TestExpandableDeviceFaults(t *testing.T) {
	t.Run("range", func(t *testing.T) {
		sim, _ := simdev.New(simdev.Config{Capacity: giB})
		f := &faultyVMM{Sim: sim}
		testExpandableDeviceFaults(t, sim, f, f)
	})
	t.Run("page by page", func(t *testing.T) {
		sim, _ := simdev.New(simdev.Config{Capacity: giB})
		f := &faultyVMM{Sim: sim}
		testExpandableDeviceFaults(t, sim, f, pageByPage{f})
	})
}

func testExpandableDeviceFaults(t *testing.T, sim *simdev.Sim, f *faultyVMM, dev cudart.Device) {
	if _, ok := dev.(cudart.RangeMapper); ok != (dev == cudart.Device(f)) {
		t.Fatalf("the device is a RangeMapper: %v", ok)
	}
	a := newExpOn(t, sim, dev, "", pageOf20MiB)
	p := mustMalloc(t, a, 5*miB, 0)
	f.mapAt = 2 // the second of the two pages 40 MiB more needs
	expectUnchanged(t, a, errFault, func() error { _, err := a.Malloc(40*miB, 0); return err })
	if sim.Used() != 20*miB || len(sim.Mappings()) != 1 {
		t.Errorf("a failed map left %d bytes and %d mappings on the device", sim.Used(), len(sim.Mappings()))
	}
	x := mustMalloc(t, a, 40*miB, 0)
	mustFree(t, a, x)
	emptyCacheFailsUnchanged(t, a, f, 1) // the two free pages, in one call
	if sim.Used() != 60*miB || len(sim.Mappings()) != 3 {
		t.Errorf("a failed unmap left %d bytes and %d mappings on the device", sim.Used(), len(sim.Mappings()))
	}
	f.releaseAt = 1
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	// The page is unmapped; its memory comes back when Close retries.
	if got := uint64(a.MemoryReserved()); got != 20*miB || sim.Used() != 40*miB {
		t.Errorf("reserved %d MiB, device holds %d MiB", got/miB, sim.Used()/miB)
	}
	mustFree(t, a, p)
}

// TestExpandableRunFaults: with 2 MiB pages a growth maps runs of several
// pages in groups of one length; a map that fails in the middle of them,
// or an unmap that fails in the middle of a free block's runs, is returned
// wrapped and leaves the allocator and the device as they were.
func TestExpandableRunFaults(t *testing.T) {
	for _, tc := range []struct {
		name string
		dev  func(*faultyVMM) cudart.Device
	}{
		{"range", func(f *faultyVMM) cudart.Device { return f }},
		{"run by run", func(f *faultyVMM) cudart.Device { return pageByPage{f} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim, _ := simdev.New(simdev.Config{Capacity: giB})
			f := &faultyVMM{Sim: sim}
			a := newExpOn(t, sim, tc.dev(f), "")
			p := mustMalloc(t, a, 2*miB, 0) // one page
			used, maps := sim.Used(), len(sim.Mappings())
			// 46 MiB: 23 pages in runs of 6, 6, 6 and 5; the fourth map (the
			// second group's) fails.
			f.mapAt = 4
			expectUnchanged(t, a, errFault, func() error { _, err := a.Malloc(46*miB, 0); return err })
			if sim.Used() != used || len(sim.Mappings()) != maps {
				t.Errorf("a failed map left %d bytes and %d mappings on the device, want %d and %d", sim.Used(), len(sim.Mappings()), used, maps)
			}
			x := mustMalloc(t, a, 46*miB, 0)
			mustFree(t, a, x)
			used, maps = sim.Used(), len(sim.Mappings())
			emptyCacheFailsUnchanged(t, a, f, 1) // the free block's four runs, in one call
			if sim.Used() != used || len(sim.Mappings()) != maps {
				t.Errorf("a failed unmap left %d bytes and %d mappings on the device, want %d and %d", sim.Used(), len(sim.Mappings()), used, maps)
			}
			if err := a.EmptyCache(); err != nil {
				t.Fatal(err)
			}
			if got := uint64(a.MemoryReserved()); got != 2*miB || sim.Used() != 2*miB {
				t.Errorf("after EmptyCache reserved %d MiB, device holds %d MiB; want 2 and 2", got/miB, sim.Used()/miB)
			}
			mustFree(t, a, p)
		})
	}
}

// TestExpandableRecordStream: a block used by another stream is neither
// reused, merged nor unmapped before its event completes.
func TestExpandableRecordStream(t *testing.T) {
	a, sim := newExp(t, giB, "")
	side, _ := sim.StreamCreate()
	x := mustMalloc(t, a, 30*miB, 0)
	if err := a.RecordStream(x, side); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, x)
	y := mustMalloc(t, a, 30*miB, 0)
	if y == x {
		t.Fatal("block reused while the side stream's event is pending")
	}
	expect(t, a, sim, 60*miB, 2, 0)
	sim.CompleteStream(side)
	mustFree(t, a, y)
	z := mustMalloc(t, a, 60*miB, 0) // polls the event: x merges with the free pages
	if z != x {
		t.Errorf("60 MiB at %#x, want the merged free space at %#x", z, x)
	}
	mustFree(t, a, z)
	w := mustMalloc(t, a, 4*kiB, 0) // at the limit: from the large pool's free pages
	if w != x {
		t.Errorf("4 KiB at %#x, want the large pool's free block at %#x", w, x)
	}
	_ = a.RecordStream(w, side)
	mustFree(t, a, w)
	if err := a.EmptyCache(); err != nil { // waits for the event, then unmaps
		t.Fatal(err)
	}
	expect(t, a, sim, 0, 2, 1)
}

// TestExpandableStreams: each stream gets its own range; blocks never
// cross streams.
func TestExpandableStreams(t *testing.T) {
	a, sim := newExp(t, giB, "", pageOf20MiB)
	s1, _ := sim.StreamCreate()
	p := mustMalloc(t, a, 5*miB, 0)
	q := mustMalloc(t, a, 5*miB, s1)
	if c := sim.VMMCounters(); c.Reserves != 2 {
		t.Errorf("%d reservations for two streams", c.Reserves)
	}
	mustFree(t, a, p)
	r := mustMalloc(t, a, 5*miB, s1)
	if r == p {
		t.Errorf("stream %d reused stream 0's block", s1)
	}
	expect(t, a, sim, 40*miB, 2, 0)
	mustFree(t, a, q)
	mustFree(t, a, r)
}

// TestExpandableClose returns every page, handle and range, live blocks
// included.
func TestExpandableClose(t *testing.T) {
	sim, _ := simdev.New(simdev.Config{Capacity: giB})
	cfg, _ := ParseConfig("expandable_segments:True")
	a, err := New(sim, cfg)
	if err != nil {
		t.Fatal(err)
	}
	mustMalloc(t, a, 50*miB, 0)
	mustMalloc(t, a, 1000, 0)
	x := mustMalloc(t, a, 30*miB, 0)
	mustFree(t, a, x)
	if err := a.Close(); !errors.Is(err, ErrLiveBlocks) {
		t.Fatalf("Close with live blocks: %v", err)
	}
	c := sim.VMMCounters()
	if sim.Used() != 0 || c.LiveHandles != 0 || c.LiveMappings != 0 || c.LiveReservations != 0 {
		t.Errorf("after Close: used %d, %+v", sim.Used(), c)
	}
	if s := a.Stats(); s.ReservedBytes[PoolAll].Current != 0 || s.NumDeviceFree != 2 {
		t.Errorf("after Close: reserved %d, device frees %d (one per mapped range)", s.ReservedBytes[PoolAll].Current, s.NumDeviceFree)
	}
}

// granularityDevice reports a chosen granularity or error.
type granularityDevice struct {
	*simdev.Sim
	gran uint64
	err  error
}

func (g granularityDevice) Granularity() (uint64, error) { return g.gran, g.err }

func TestExpandableNotSupported(t *testing.T) {
	sim, _ := simdev.New(simdev.Config{Capacity: giB})
	cfg, _ := ParseConfig("expandable_segments:True")
	for name, dev := range map[string]cudart.Device{
		"no virtual memory":   struct{ cudart.Device }{sim},
		"granularity error":   granularityDevice{sim, 0, cudart.ErrNotSupported},
		"granularity 3 MiB":   granularityDevice{sim, 3 * miB, nil},
		"granularity 0 bytes": granularityDevice{sim, 0, nil},
	} {
		if _, err := New(dev, cfg); !errors.Is(err, ErrNotSupported) || !strings.Contains(err.Error(), "expandable_segments") {
			t.Errorf("%s: %v, want ErrNotSupported naming expandable_segments", name, err)
		}
	}
}

// TestExpandableCachedPairAllocatesNothing: with expandable segments too, a
// cached malloc and free allocate nothing and make no device call.
func TestExpandableCachedPairAllocatesNothing(t *testing.T) {
	for _, size := range []uint64{512, 4096, miB, 8 * miB, 64 * miB} {
		a, sim := newExp(t, 141*giB, "")
		mustFree(t, a, mustMalloc(t, a, size, 0))
		vmm, dev := sim.VMMCounters(), sim.Counters()
		if n := testing.AllocsPerRun(1000, func() {
			p, _ := a.Malloc(size, 0)
			_ = a.Free(p)
		}); n != 0 {
			t.Errorf("size %d: %.1f heap allocations per pair", size, n)
		}
		if sim.VMMCounters() != vmm || sim.Counters() != dev {
			t.Errorf("size %d: the cached pair called the device", size)
		}
	}
}

// TestExpandableConcurrent: several goroutines, streams and EmptyCache
// calls on one allocator (run with -race).
func TestExpandableConcurrent(t *testing.T) {
	sim, _ := simdev.New(simdev.Config{Capacity: 4 * giB})
	a := newExpOn(t, sim, sim, "")
	streams := []cudart.Stream{0}
	for range 2 {
		s, _ := sim.StreamCreate()
		streams = append(streams, s)
	}
	var wg sync.WaitGroup
	errc := make(chan error, 6)
	for w := range 6 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			var live []cudart.Ptr
			for i := range 1500 {
				if len(live) > 0 && (rng.IntN(3) == 0 || len(live) > 24) {
					j := rng.IntN(len(live))
					if err := a.Free(live[j]); err != nil {
						errc <- err
						return
					}
					live[j] = live[len(live)-1]
					live = live[:len(live)-1]
					continue
				}
				p, err := a.Malloc(sizeFor(rng.Uint64()), streams[w%len(streams)])
				if err != nil {
					errc <- err
					return
				}
				live = append(live, p)
				if i%300 == 0 && w == 0 {
					if err := a.EmptyCache(); err != nil {
						errc <- err
						return
					}
					_ = a.Snapshot()
				}
			}
			for _, p := range live {
				if err := a.Free(p); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if a.MemoryReserved() != 0 || sim.Used() != 0 {
		t.Errorf("reserved %d, device %d after freeing all and EmptyCache", a.MemoryReserved(), sim.Used())
	}
}

// FuzzOpsExpandable is FuzzOps with expandable_segments:True on four
// streams and a backed Sim (live allocations' contents checked after every
// step); the first byte picks one of a few configurations.
func FuzzOpsExpandable(f *testing.F) {
	f.Add([]byte{0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte("\x01\x00\x10\x00\x00\x00\x00\x00\x00\x00\x05\x01\x00\x00\x00\x01\x00\x00\x00\x03\x00\x00\x00\x00\x00\x00\x00\x00\x06\x00\x00\x00\x00\x00\x00\x00\x00"))
	f.Add([]byte("\x02\x07\x01\x00\x00\x00\x00\x00\x00\x00\x00\x08\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x00\x00\x00"))
	for seed := range uint64(3) {
		data := []byte{byte(seed)}
		rng := rand.New(rand.NewPCG(seed, 2))
		for range 64 {
			data = append(data, byte(rng.IntN(8)))
			data = binary.LittleEndian.AppendUint64(data, rng.Uint64())
		}
		f.Add(data)
	}
	confs := []string{
		"expandable_segments:True",
		"expandable_segments:True,max_split_size_mb:64",
		"expandable_segments:True,garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
		"expandable_segments:True,expandable_reclaim:coarse",
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		conf := confs[int(data[0])%len(confs)]
		data = data[1:]
		if len(data) > 9*2000 {
			data = data[:9*2000]
		}
		// Four streams and a backed Sim: reclaim moves pages between the
		// streams' ranges, and every live allocation's contents are checked
		// after each step, besides Check.
		d := newOpDriverOn(t, 256*miB, conf, 4, true)
		for len(data) >= 9 {
			d.step(data[0], binary.LittleEndian.Uint64(data[1:9]))
			data = data[9:]
		}
		d.finish()
	})
}

// TestExpandableCheckFindsCorruption: Check compares the expandable
// segments' mapped bytes with the reserved bytes and the statistics (the
// pages and runs are vmm's TestCheckFindsCorruption).
func TestExpandableCheckFindsCorruption(t *testing.T) {
	a, _ := newExp(t, giB, "")
	p := mustMalloc(t, a, 30*miB, 0)
	seg := a.segs.list[0]
	for _, tc := range []struct {
		name    string
		corrupt func()
		want    string
	}{
		{"mapped bytes", func() { seg.Mapped += 20 * miB }, "mapped"},
		{"reserved", func() { a.segs.reserved += 20 * miB }, "reserved"},
		{"segment stat", func() { a.stats.Segment[PoolAll].Current++ }, "stat segment"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			savedMapped, savedRes, savedStats := seg.Mapped, a.segs.reserved, a.stats
			tc.corrupt()
			err := a.Check()
			seg.Mapped, a.segs.reserved, a.stats = savedMapped, savedRes, savedStats
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Check = %v, want a report containing %q", err, tc.want)
			}
		})
	}
	mustCheck(t, a)
	mustFree(t, a, p)
}

// TestExpandableSmallPagesReclaim: with reclaim on, the large pool maps 2
// MiB pages, so a hole that is not a multiple of 20 MiB gives back its
// whole 2 MiB pages before the segment grows past the high-water mark.
func TestExpandableSmallPagesReclaim(t *testing.T) {
	a, sim := newExp(t, giB, "")
	p := mustMalloc(t, a, 5*miB, 0)  // pages 0-2
	x := mustMalloc(t, a, 13*miB, 0) // [5, 18): pages 2-8
	q := mustMalloc(t, a, 5*miB, 0)  // [18, 23): pages 9-11
	expect(t, a, sim, 24*miB, 3, 0)
	mustFree(t, a, x)
	// 14 MiB more would pass the mark (24 MiB): the hole's whole pages
	// 3-8 (12 MiB) are unmapped first.
	y := mustMalloc(t, a, 14*miB, 0)
	expect(t, a, sim, 26*miB, 4, 1)
	mustFree(t, a, p)
	mustFree(t, a, q)
	mustFree(t, a, y)
}

// TestExpandableCrossStreamPages: a stream that must grow takes the whole
// free pages of another stream's range (the same physical pages, unmapped
// there and mapped into its own range), but never those of a block another
// stream may still use (its RecordStream event pending): those stay mapped
// until the event completes.
func TestExpandableCrossStreamPages(t *testing.T) {
	a, sim := newExp(t, giB, "")
	side, _ := sim.StreamCreate()
	s1, _ := sim.StreamCreate()
	s2, _ := sim.StreamCreate()
	x := mustMalloc(t, a, 40*miB, 0)
	if err := a.RecordStream(x, side); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, x) // pending on side
	y := mustMalloc(t, a, 40*miB, s1)
	// x's pages are not handed to s1: reserved grows past the mark.
	expect(t, a, sim, 80*miB, 2, 0)
	if got := a.Snapshot(); !mapped(got.Segments, x, 40*miB) {
		t.Errorf("a block with a pending event lost its pages: %+v", got)
	}
	sim.CompleteStream(side)
	creates := sim.VMMCounters().Creates
	z := mustMalloc(t, a, 40*miB, s2) // retires x's event, then takes its pages
	expect(t, a, sim, 80*miB, 3, 1)
	if c := sim.VMMCounters(); c.Creates != creates || c.HandleBytes != 80*miB {
		t.Errorf("%d runs created, %d bytes of them live, for pages moved between streams; want 0 created, %d bytes live", c.Creates-creates, c.HandleBytes, 80*miB)
	}
	if n := a.Stats().NumPagesMoved; n != 20 {
		t.Errorf("%d pages moved, want 20", n)
	}
	if got := a.Snapshot(); mapped(got.Segments, x, 1) {
		t.Errorf("stream 0's free block at %#x is still mapped after s2 took its pages", x)
	}
	mustFree(t, a, y)
	mustFree(t, a, z)
}

// mapped reports whether the snapshot lists a block of at least size bytes
// at ptr (snapshots list mapped blocks only).
func mapped(segs []snapshot.Segment, ptr cudart.Ptr, size uint64) bool {
	for _, s := range segs {
		for _, b := range s.Blocks {
			if b.Address == uint64(ptr) && b.Size >= size {
				return true
			}
		}
	}
	return false
}

// TestExpandableGrowthRounds: with the default policy a growth maps up
// to the next 20 MiB boundary of its range while reserved memory stays
// within what reclaim allows plus its headroom, so that the next requests
// fit without a mapping; under a per-process cap it stops at the cap.
func TestExpandableGrowthRounds(t *testing.T) {
	for _, tc := range []struct {
		name, conf string
		reserved   uint64
	}{
		{"uncapped", "", 660 * miB},
		{"capped at 655.36 MiB", "per_process_memory_fraction:0.64", 654 * miB},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, sim := newExp(t, giB, tc.conf)
			y := mustMalloc(t, a, 640*miB, 0) // ends on a boundary: nothing to round
			expect(t, a, sim, 640*miB, 1, 0)
			// 652 MiB allocated with the next request: the slack (1/32,
			// 20 MiB in whole pages) and the headroom (1/128 of the
			// 640 MiB mark, 4 MiB) let reserved memory reach 676 MiB, past
			// the boundary at 660.
			p := mustMalloc(t, a, 12*miB, 0)
			expect(t, a, sim, tc.reserved, 2, 0)
			// What the rounding mapped serves the next request.
			q := mustMalloc(t, a, tc.reserved-652*miB, 0)
			expect(t, a, sim, tc.reserved, 2, 0)
			for _, x := range []cudart.Ptr{y, p, q} {
				mustFree(t, a, x)
			}
		})
	}
}

// TestExpandableReclaimSlack: a mapping may pass the high-water mark
// without a reclaim while reserved memory stays within 1/32 of the
// largest allocated figure; past that, reclaim unmaps another stream's
// free pages, waiting for that stream only, and counts what it moved.
// Growth maps what each request needs here (TestExpandableGrowthRounds
// has the rounding to the page boundary), as in the two tests after it.
func TestExpandableReclaimSlack(t *testing.T) {
	a, sim := newExp(t, 4*giB, "", WithoutGrowthRounding)
	s1, _ := sim.StreamCreate()
	y := mustMalloc(t, a, 320*miB, 0)
	mustFree(t, a, mustMalloc(t, a, 8*miB, 0)) // 8 MiB free at the end of stream 0's range
	expect(t, a, sim, 328*miB, 2, 0)
	// Allocated would reach 330 MiB: reserved may reach 340 MiB.
	p := mustMalloc(t, a, 10*miB, s1)
	expect(t, a, sim, 338*miB, 3, 0)
	if n := a.Stats().NumReclaims; n != 0 {
		t.Errorf("%d reclaims within the slack, want 0", n)
	}
	mustFree(t, a, y)
	before := sim.Counters()
	// 378 MiB would pass both the mark (338) and the slack (340): the
	// only free block, y's 320 MiB merged with the 8 MiB after it, covers
	// the 38 MiB excess and the 2 MiB headroom (1/128 of the mark). Its
	// runs (y's five of 32 pages, the 8 MiB block's one of four: runs of
	// at least 1/16 of allocated) are unmapped into the handle cache; of
	// the 20 pages s1 needs, the four-page run serves four, and for the
	// other 16 one of y's runs is mapped whole into s1's range (the
	// shortest longer run); the rest stay cached, so reserved memory does
	// not change.
	q := mustMalloc(t, a, 40*miB, s1)
	expect(t, a, sim, 338*miB, 4, 1)
	if st := a.Stats(); uint64(st.HandleCacheBytes) != 256*miB || st.VMM.Creates != 7 {
		t.Errorf("handle cache %d MiB, %d handles created; want 256 MiB, 7 (none for the move)", uint64(st.HandleCacheBytes)/miB, st.VMM.Creates)
	}
	after := sim.Counters()
	if d, s := after.DeviceSyncs-before.DeviceSyncs, after.StreamSyncs-before.StreamSyncs; d != 0 || s != 1 {
		t.Errorf("reclaim synchronised the device %d times and streams %d times, want 0 and 1 (stream 0 only)", d, s)
	}
	st := a.Stats()
	if st.NumReclaims != 1 || st.NumPagesMoved != 36 || st.NumPagesMovedAcrossStreams != 36 {
		t.Errorf("reclaims %d, pages moved %d (across streams %d), want 1, 36, 36", st.NumReclaims, st.NumPagesMoved, st.NumPagesMovedAcrossStreams)
	}
	f := st.Flat()
	if f["num_reclaims"] != 1 || f["num_pages_moved"] != 36 || f["num_pages_moved_across_streams"] != 36 || uint64(f["handle_cache_bytes"]) != 256*miB {
		t.Errorf("Flat: num_reclaims %d, num_pages_moved %d, num_pages_moved_across_streams %d", f["num_reclaims"], f["num_pages_moved"], f["num_pages_moved_across_streams"])
	}
	mustFree(t, a, p)
	mustFree(t, a, q)
}

// TestExpandableReclaimHeadroom: a reclaim unmaps 1/128 of the high-water
// mark more than the excess when a free block allows, so it takes the
// 110 MiB hole rather than the 100 MiB one that covers only the excess.
func TestExpandableReclaimHeadroom(t *testing.T) {
	a, sim := newExp(t, 8*giB, "", WithoutGrowthRounding)
	s1, _ := sim.StreamCreate()
	h100 := mustMalloc(t, a, 100*miB, 0)
	sep1 := mustMalloc(t, a, 2*miB, 0)
	h110 := mustMalloc(t, a, 110*miB, 0)
	sep2 := mustMalloc(t, a, 2*miB, 0)
	big := mustMalloc(t, a, 4284*miB, 0)
	sep3 := mustMalloc(t, a, 2*miB, 0)
	mustFree(t, a, h100)
	mustFree(t, a, h110)
	expect(t, a, sim, 4500*miB, 6, 0)
	// Allocated peaked at 4500 MiB, so the slack is 140 MiB (1/32, in
	// 2 MiB pages) and the headroom 35 MiB (1/128). With the request,
	// 4404 MiB are allocated: reserved may reach 4544 MiB, and 114 MiB
	// more passes that by 70 MiB, which the 100 MiB hole covers, but not
	// with the headroom.
	p := mustMalloc(t, a, 114*miB, s1)
	expect(t, a, sim, 4504*miB, 7, 1)
	snap := a.Snapshot()
	if !mapped(snap.Segments, h100, 100*miB) || mapped(snap.Segments, h110, 1) {
		t.Errorf("reclaim took the wrong hole: 100 MiB hole mapped %v (want true), 110 MiB hole mapped %v (want false)",
			mapped(snap.Segments, h100, 100*miB), mapped(snap.Segments, h110, 1))
	}
	for _, x := range []cudart.Ptr{sep1, sep2, big, sep3, p} {
		mustFree(t, a, x)
	}
}

// TestExpandableSlackFromAllocatedNow: the slack that lets reserved memory
// pass its high-water mark counts from what is allocated at the mapping,
// not from the largest allocated figure. After a 200 MiB hole is freed, a
// growth of 30 MiB on another stream would stay within the slack of the
// old peak (1,204 + 36 MiB) but passes the mark while 1,034 MiB are
// allocated: fragmentation, so it reclaims the hole's pages instead of
// raising reserved memory.
func TestExpandableSlackFromAllocatedNow(t *testing.T) {
	a, sim := newExp(t, 4*giB, "", WithoutGrowthRounding)
	s1, _ := sim.StreamCreate()
	big := mustMalloc(t, a, 1000*miB, 0)
	sep1 := mustMalloc(t, a, 2*miB, 0)
	hole := mustMalloc(t, a, 200*miB, 0)
	sep2 := mustMalloc(t, a, 2*miB, 0)
	mustFree(t, a, hole)
	expect(t, a, sim, 1204*miB, 4, 0)
	p := mustMalloc(t, a, 30*miB, s1)
	st := a.Stats()
	if st.NumReclaims != 1 {
		t.Errorf("%d reclaims, want 1: the growth passed the high-water mark 1/32 above the 1,034 MiB allocated", st.NumReclaims)
	}
	if r := uint64(st.ReservedBytes[PoolAll].Peak); r != 1204*miB {
		t.Errorf("peak reserved %d MiB, want 1204 (the hole's pages moved to the new stream)", r/miB)
	}
	mustCheck(t, a)
	for _, x := range []cudart.Ptr{big, sep1, sep2, p} {
		mustFree(t, a, x)
	}
	mustCheck(t, a)
}

// TestExpandableMapsARangeAtOnce: a growth of many pages maps them in about
// four runs, one handle each and at most 64 MiB, with one grant of access
// (cudart.RangeMapper) for the runs of one length, as PyTorch grants it for
// a growth.
func TestExpandableMapsARangeAtOnce(t *testing.T) {
	a, sim := newExp(t, giB, "expandable_page_mb:2")
	for _, tc := range []struct {
		size                  uint64
		creates, maps, access int64
	}{
		{40 * miB, 4, 4, 1},  // four runs of five pages
		{46 * miB, 4, 4, 2},  // three of six, one of five
		{2 * miB, 1, 1, 1},   // one page
		{6 * miB, 3, 3, 1},   // three runs of one page
		{400 * miB, 7, 7, 2}, // six of 32 pages (the 64 MiB limit), one of eight
	} {
		before := sim.VMMCounters()
		p := mustMalloc(t, a, tc.size, 0)
		c := sim.VMMCounters()
		if cr, maps, access := c.Creates-before.Creates, c.Maps-before.Maps, c.AccessCalls-before.AccessCalls; cr != tc.creates || maps != tc.maps || access != tc.access {
			t.Errorf("a %d MiB growth in 2 MiB pages made %d handles, %d mappings and %d access grants, want %d, %d and %d",
				tc.size/miB, cr, maps, access, tc.creates, tc.maps, tc.access)
		}
		if err := a.EmptyCache(); err != nil { // the next growth starts afresh
			t.Fatal(err)
		}
		mustFree(t, a, p)
		if err := a.EmptyCache(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestExpandableSmallFromLarge: with the default reclaim policy, a small
// request that would grow the small pool past what reclaim allows takes
// a piece of its stream's free large-pool block instead, which returns
// to the large pool when freed; no page moves. Coarse reclaim and
// PyTorch's policy map the small pool's own page, and a request that no
// large free block holds grows the small pool as before.
func TestExpandableSmallFromLarge(t *testing.T) {
	for _, tc := range []struct {
		name      string
		conf      string
		opts      []Option
		fromLarge bool
	}{
		{"default", "", nil, true},
		{"coarse", "expandable_reclaim:coarse", nil, false},
		{"pytorch", "", []Option{WithPyTorchExpandable()}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, _ := newExp(t, giB, tc.conf, tc.opts...)
			x := mustMalloc(t, a, 40*miB, 0)
			mustFree(t, a, x) // reserved at its mark, all of it free in the large pool
			before := a.Stats()
			w := mustMalloc(t, a, 4*kiB, 0)
			st := a.Stats()
			if got := w == x; got != tc.fromLarge || (st.NumSmallFromLarge == 1) != tc.fromLarge {
				t.Fatalf("4 KiB at %#x (the large pool's free block is at %#x), %d from the large pool; want from the large pool: %v",
					uint64(w), uint64(x), st.NumSmallFromLarge, tc.fromLarge)
			}
			if tc.fromLarge {
				if st.NumDeviceAlloc != before.NumDeviceAlloc || st.ReservedBytes[PoolAll].Current != before.ReservedBytes[PoolAll].Current {
					t.Errorf("serving it from the large pool mapped (%d → %d) or reserved (%d → %d)",
						before.NumDeviceAlloc, st.NumDeviceAlloc, before.ReservedBytes[PoolAll].Current, st.ReservedBytes[PoolAll].Current)
				}
				if st.AllocatedBytes[PoolLarge].Current != int64(4*kiB) || st.AllocatedBytes[PoolSmall].Current != 0 {
					t.Errorf("allocated bytes large %d, small %d; want the 4 KiB in the large pool",
						st.AllocatedBytes[PoolLarge].Current, st.AllocatedBytes[PoolSmall].Current)
				}
			}
			mustCheck(t, a)
			mustFree(t, a, w)
			if q := mustMalloc(t, a, 40*miB, 0); q != x {
				t.Errorf("40 MiB after the small block's free at %#x, want the merged block at %#x", uint64(q), uint64(x))
			} else {
				mustFree(t, a, q)
			}
		})
	}
}
