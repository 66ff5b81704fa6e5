package simdev

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
)

const vmmMiB = uint64(1) << 20

func newVMMSim(t *testing.T, capacity uint64, backed bool) *Sim {
	t.Helper()
	s, err := New(Config{Capacity: capacity, Backed: backed})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// wantErr fails unless err wraps want and mentions each of the words.
func wantErr(t *testing.T, what string, err, want error, words ...string) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Errorf("%s: %v, want an error wrapping %v", what, err, want)
		return
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: %q does not say %q", what, err, w)
		}
	}
}

func TestSimVMMLifecycle(t *testing.T) {
	s := newVMMSim(t, 100*vmmMiB, false)
	var vm cudart.VirtualMemory = s
	if g, err := vm.Granularity(); err != nil || g != 2*vmmMiB {
		t.Fatalf("Granularity = %d, %v", g, err)
	}
	m, err := s.Malloc(vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	r1, err := vm.Reserve(1000 * vmmMiB) // more than the capacity: address space is free
	if err != nil {
		t.Fatal(err)
	}
	r2, err := vm.Reserve(4 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	if uint64(r1)%(2*vmmMiB) != 0 || uint64(r2)%(2*vmmMiB) != 0 {
		t.Errorf("reservations %#x, %#x are not 2 MiB aligned", r1, r2)
	}
	overlap := func(a cudart.Ptr, an uint64, b cudart.Ptr, bn uint64) bool {
		return uint64(a) < uint64(b)+bn && uint64(b) < uint64(a)+an
	}
	if overlap(r1, 1000*vmmMiB, r2, 4*vmmMiB) || overlap(r1, 1000*vmmMiB, m, vmmMiB) || overlap(r2, 4*vmmMiB, m, vmmMiB) {
		t.Errorf("reservations %#x, %#x and allocation %#x overlap", r1, r2, m)
	}
	if m2, _ := s.Malloc(vmmMiB); overlap(r1, 1000*vmmMiB, m2, vmmMiB) || overlap(r2, 4*vmmMiB, m2, vmmMiB) {
		t.Errorf("allocation %#x overlaps a reservation", m2)
	} else {
		_ = s.Free(m2)
	}
	if s.Used() != vmmMiB {
		t.Errorf("reserving address space used %d bytes of memory", s.Used()-vmmMiB)
	}
	h1, err := vm.Create(20 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	h2, err := vm.Create(2 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	if free, _, _ := s.MemGetInfo(); s.Used() != 23*vmmMiB || free != 77*vmmMiB {
		t.Errorf("after creating 22 MiB: used %d, free %d", s.Used(), free)
	}
	if err := vm.Map(r1+cudart.Ptr(40*vmmMiB), 20*vmmMiB, h1); err != nil {
		t.Fatal(err)
	}
	if err := vm.Map(r1+cudart.Ptr(60*vmmMiB), 2*vmmMiB, h2); err != nil {
		t.Fatal(err)
	}
	if got := s.Mappings(); len(got) != 2 || got[0] != [2]uint64{uint64(r1) + 40*vmmMiB, 20 * vmmMiB} {
		t.Errorf("Mappings = %v", got)
	}
	// One unmap may cover several whole mappings side by side.
	if err := vm.Unmap(r1+cudart.Ptr(40*vmmMiB), 22*vmmMiB); err != nil {
		t.Fatal(err)
	}
	for _, h := range []cudart.Handle{h1, h2} {
		if err := vm.Release(h); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range []struct {
		p cudart.Ptr
		n uint64
	}{{r1, 1000 * vmmMiB}, {r2, 4 * vmmMiB}} {
		if err := vm.ReleaseRange(r.p, r.n); err != nil {
			t.Fatal(err)
		}
	}
	c := s.VMMCounters()
	want := VMMCounters{Reserves: 2, ReleaseRanges: 2, Creates: 2, Releases: 2, Maps: 2, Unmaps: 1, AccessCalls: 2}
	if c != want {
		t.Errorf("counters %+v, want %+v", c, want)
	}
	if s.Used() != vmmMiB {
		t.Errorf("after releasing everything the device holds %d bytes", s.Used())
	}
}

func TestSimVMMCreateOOM(t *testing.T) {
	s := newVMMSim(t, 10*vmmMiB, false)
	h, err := s.Create(8 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Create(4 * vmmMiB)
	wantErr(t, "Create past the capacity", err, cudart.ErrOutOfMemory, "cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")
	var ce *cudart.CUDAError
	if !errors.As(err, &ce) || ce.Code != 2 || ce.Op != "cuMemCreate" {
		t.Errorf("Create OOM is not the driver's error: %#v", err)
	}
	if s.Used() != 8*vmmMiB || s.VMMCounters().FailedCreates != 1 {
		t.Errorf("a failed Create changed the device: used %d, counters %+v", s.Used(), s.VMMCounters())
	}
	// A Create counts as a malloc call for FailMalloc.
	if err := s.Release(h); err != nil {
		t.Fatal(err)
	}
	s.Faults().FailMalloc(2, nil)
	p, err := s.Malloc(vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Create(2 * vmmMiB)
	wantErr(t, "Create as the 2nd malloc call after FailMalloc(2)", err, cudart.ErrOutOfMemory, "cuMemCreate")
	boom := errors.New("injected")
	s.Faults().FailMalloc(1, boom)
	if _, err := s.Create(2 * vmmMiB); !errors.Is(err, boom) {
		t.Errorf("Create with an injected fault: %v", err)
	}
	if h, err := s.Create(2 * vmmMiB); err != nil {
		t.Errorf("Create after the faults: %v", err)
	} else {
		_ = s.Release(h)
	}
	_ = s.Free(p)
	if s.Used() != 0 {
		t.Errorf("device holds %d", s.Used())
	}
}

func TestSimVMMErrors(t *testing.T) {
	s := newVMMSim(t, 100*vmmMiB, false)
	r, err := s.Reserve(40 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	h, _ := s.Create(20 * vmmMiB)
	h2, _ := s.Create(2 * vmmMiB)
	h4, _ := s.Create(4 * vmmMiB)
	if err := s.Map(r, 20*vmmMiB, h); err != nil {
		t.Fatal(err)
	}
	m, _ := s.Malloc(vmmMiB)
	for _, tc := range []struct {
		name  string
		err   error
		words []string
	}{
		{"Reserve of 0 bytes", func() error { _, err := s.Reserve(0); return err }(), []string{"granularity"}},
		{"Reserve of 1 MiB", func() error { _, err := s.Reserve(vmmMiB); return err }(), []string{"granularity"}},
		{"Create of 3 MiB", func() error { _, err := s.Create(3 * vmmMiB); return err }(), []string{"granularity"}},
		{"Map of an unknown handle", s.Map(r+cudart.Ptr(20*vmmMiB), 2*vmmMiB, 999), []string{"not live"}},
		{"Map with a size mismatch", s.Map(r+cudart.Ptr(20*vmmMiB), 4*vmmMiB, h2), []string{"holds"}},
		{"Map unaligned", s.Map(r+cudart.Ptr(21*vmmMiB), 2*vmmMiB, h2), []string{"aligned"}},
		{"Map outside any reservation", s.Map(m, 2*vmmMiB, h2), []string{"not inside one reservation"}},
		{"Map across the reservation's end", s.Map(r+cudart.Ptr(38*vmmMiB), 4*vmmMiB, h4), []string{"not inside one reservation"}},
		{"Map past the reservation's end", s.Map(r+cudart.Ptr(40*vmmMiB), 2*vmmMiB, h2), []string{"not inside one reservation"}},
		{"Map over a mapping", s.Map(r+cudart.Ptr(18*vmmMiB), 2*vmmMiB, h2), []string{"overlaps"}},
		{"Unmap of unmapped memory", s.Unmap(r+cudart.Ptr(20*vmmMiB), 2*vmmMiB), []string{"not mapped"}},
		{"Unmap of part of a mapping", s.Unmap(r, 2*vmmMiB), []string{"covers part"}},
		{"Unmap of a mapping and a gap", s.Unmap(r, 22*vmmMiB), []string{"not mapped"}},
		{"Unmap of a bad size", s.Unmap(r, vmmMiB), []string{"granularity"}},
		{"Release of an unknown handle", s.Release(999), []string{"not live"}},
		{"Release of a mapped handle", s.Release(h), []string{"still mapped"}},
		{"ReleaseRange of a non-reservation", s.ReleaseRange(m, 2*vmmMiB), []string{"not a reservation"}},
		{"ReleaseRange with the wrong size", s.ReleaseRange(r, 20*vmmMiB), []string{"not a reservation"}},
		{"ReleaseRange with a mapping inside", s.ReleaseRange(r, 40*vmmMiB), []string{"still mapped"}},
	} {
		wantErr(t, tc.name, tc.err, cudart.ErrInvalidValue, tc.words...)
	}
	// A second mapping beside the first, then unmapped with it in one call.
	if err := s.Map(r+cudart.Ptr(20*vmmMiB), 2*vmmMiB, h2); err != nil {
		t.Fatal(err)
	}
	if err := s.Unmap(r, 22*vmmMiB); err != nil {
		t.Fatal(err)
	}
	for _, x := range []cudart.Handle{h, h2, h4} {
		if err := s.Release(x); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.ReleaseRange(r, 40*vmmMiB); err != nil {
		t.Fatal(err)
	}
	_ = s.Free(m)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for name, err := range map[string]error{
		"Granularity":  func() error { _, err := s.Granularity(); return err }(),
		"Reserve":      func() error { _, err := s.Reserve(2 * vmmMiB); return err }(),
		"Create":       func() error { _, err := s.Create(2 * vmmMiB); return err }(),
		"Map":          s.Map(r, 2*vmmMiB, h),
		"Unmap":        s.Unmap(r, 2*vmmMiB),
		"Release":      s.Release(h),
		"ReleaseRange": s.ReleaseRange(r, 40*vmmMiB),
	} {
		wantErr(t, name+" after Close", err, cudart.ErrClosed)
	}
}

// TestSimPlanAvoidsReservations: a planned Malloc address inside a
// reservation is not taken.
func TestSimPlanAvoidsReservations(t *testing.T) {
	probe := newVMMSim(t, 100*vmmMiB, false)
	r, _ := probe.Reserve(20 * vmmMiB) // where the first reservation lands
	s, err := New(Config{Capacity: 100 * vmmMiB, Addresses: []Address{{Addr: r, Size: 2 * vmmMiB}}})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Reserve(20 * vmmMiB); got != r {
		t.Fatalf("reservations are not deterministic: %#x, %#x", got, r)
	}
	p, err := s.Malloc(2 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	if p >= r && uint64(p-r) < 20*vmmMiB {
		t.Errorf("Malloc took the planned address %#x inside the reservation", p)
	}
}

// TestSimVMMBacked: with Backed, memset and memcpy reach mapped memory,
// across mappings side by side, and not unmapped memory.
func TestSimVMMBacked(t *testing.T) {
	s := newVMMSim(t, 100*vmmMiB, true)
	r, _ := s.Reserve(20 * vmmMiB)
	h1, _ := s.Create(2 * vmmMiB)
	h2, _ := s.Create(2 * vmmMiB)
	if err := s.Map(r, 2*vmmMiB, h1); err != nil {
		t.Fatal(err)
	}
	if err := s.Map(r+cudart.Ptr(2*vmmMiB), 2*vmmMiB, h2); err != nil {
		t.Fatal(err)
	}
	at := r + cudart.Ptr(2*vmmMiB-3) // three bytes in the first page, five in the second
	src := []byte("abcdefgh")
	if err := s.MemcpyHtoD(at, src); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(src))
	if err := s.MemcpyDtoH(got, at); err != nil || !bytes.Equal(got, src) {
		t.Fatalf("round trip across two mappings: %q, %v", got, err)
	}
	if err := s.MemsetAsync(at+1, 'z', 4, cudart.DefaultStream); err != nil {
		t.Fatal(err)
	}
	if err := s.MemcpyDtoH(got, at); err != nil || string(got) != "azzzzfgh" {
		t.Errorf("after memset: %q, %v", got, err)
	}
	err := s.MemcpyHtoD(r+cudart.Ptr(4*vmmMiB-2), src)
	wantErr(t, "memcpy running past the mapped memory", err, cudart.ErrInvalidValue, "mapped memory")
	if err := s.Unmap(r, 2*vmmMiB); err != nil {
		t.Fatal(err)
	}
	wantErr(t, "memset of unmapped memory", s.MemsetAsync(r, 0, 16, cudart.DefaultStream), cudart.ErrInvalidValue)
	if err := s.MemcpyDtoH(got[:4], r+cudart.Ptr(2*vmmMiB)); err != nil || string(got[:4]) != "zzfg" {
		t.Errorf("the second mapping after unmapping the first: %q, %v", got[:4], err)
	}
}

// TestSimMapRange: MapRange maps each handle at its page with one access
// grant, and a bad handle in the middle leaves nothing mapped.
func TestSimMapRange(t *testing.T) {
	s := newVMMSim(t, 100*vmmMiB, true)
	var rm cudart.RangeMapper = s
	const page = 2 * vmmMiB
	r, err := s.Reserve(8 * page)
	if err != nil {
		t.Fatal(err)
	}
	var hs []cudart.Handle
	for range 3 {
		h, err := s.Create(page)
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	bad := append(append([]cudart.Handle(nil), hs[:2]...), cudart.Handle(0xdead))
	wantErr(t, "MapRange with a handle that is not live", rm.MapRange(r, page, bad), cudart.ErrInvalidValue, "not live")
	if c := s.VMMCounters(); c.LiveMappings != 0 || c.Maps != 0 || c.AccessCalls != 0 || c.MappedBytes != 0 {
		t.Fatalf("after a failed MapRange: %+v", c)
	}
	if err := rm.MapRange(r, page, hs); err != nil {
		t.Fatal(err)
	}
	if c := s.VMMCounters(); c.LiveMappings != 3 || c.Maps != 3 || c.AccessCalls != 1 || c.MappedBytes != 3*page {
		t.Fatalf("after MapRange of 3 pages: %+v", c)
	}
	// The pages are mapped side by side: one copy spans them.
	data := bytes.Repeat([]byte{7}, int(3*page))
	if err := s.MemcpyHtoD(r, data); err != nil {
		t.Fatal(err)
	}
	if err := s.Unmap(r, 3*page); err != nil {
		t.Fatal(err)
	}
	for _, h := range hs {
		if err := s.Release(h); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.ReleaseRange(r, 8*page); err != nil {
		t.Fatal(err)
	}
}

// TestSimVMMAliases: as on a GPU, one handle may be mapped at two
// addresses at once; both reach the same memory, and Release is refused
// until both mappings are gone.
func TestSimVMMAliases(t *testing.T) {
	s := newVMMSim(t, 100*vmmMiB, true)
	r, err := s.Reserve(40 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	h, err := s.Create(4 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	a, b := r, r+cudart.Ptr(20*vmmMiB)
	if err := s.Map(a, 4*vmmMiB, h); err != nil {
		t.Fatal(err)
	}
	if err := s.Map(b, 4*vmmMiB, h); err != nil {
		t.Fatalf("mapping a mapped handle at a second address: %v", err)
	}
	want := []byte("one memory, two addresses")
	if err := s.MemcpyHtoD(a+cudart.Ptr(3*vmmMiB), want); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if err := s.MemcpyDtoH(got, b+cudart.Ptr(3*vmmMiB)); err != nil || string(got) != string(want) {
		t.Errorf("read through the second mapping: %q, %v; want %q", got, err, want)
	}
	if used := s.Used(); used != 4*vmmMiB {
		t.Errorf("two mappings of one 4 MiB handle: %d bytes used", used)
	}
	if err := s.Unmap(a, 4*vmmMiB); err != nil {
		t.Fatal(err)
	}
	wantErr(t, "Release of a handle still mapped at one address", s.Release(h), cudart.ErrInvalidValue, "still mapped")
	if err := s.Unmap(b, 4*vmmMiB); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(h); err != nil {
		t.Errorf("Release once both mappings are gone: %v", err)
	}
}
