package simdev

import (
	"fmt"
	"sort"

	"github.com/allocd/allocd/cudart"
)

// The Sim's virtual memory management, which expandable segments build on.
// It follows the driver's calls (cuMemAddressReserve, cuMemCreate, cuMemMap
// with cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree), checking
// their arguments more strictly than the driver does, so that a test finds
// an allocator's mistake where a GPU would fault later:
//
//   - Reserve hands out address space from the same bump pointer as
//     Malloc: a reservation never overlaps an allocation or another
//     reservation. Address space costs nothing against Capacity.
//   - Create allocates physical memory, counted against Capacity (Used and
//     MemGetInfo include it). It counts as a malloc call for Faults.FailMalloc.
//   - Map maps a whole handle (from its offset 0) at a granularity-aligned
//     address inside one reservation, over no existing mapping. As on a
//     GPU, a handle may be mapped at several addresses at once, which then
//     reach the same memory.
//   - Unmap takes a range covering whole mappings exactly.
//   - Release refuses a handle that is still mapped, ReleaseRange a
//     reservation with anything mapped inside.
//
// With Config.Backed, a handle gets host memory and MemsetAsync,
// MemcpyHtoD and MemcpyDtoH reach mapped ranges, across mappings that lie
// side by side. With Config.Shared the handle's memory is a memfd mapped
// MAP_SHARED instead, which another process can import (share.go).

// simGranularity is the Sim's mapping granularity, as on current GPUs.
const simGranularity uint64 = 2 << 20

// VMMCounters counts the virtual memory calls a Sim has served.
type VMMCounters struct {
	Reserves, ReleaseRanges int64
	Creates, FailedCreates  int64
	Releases                int64
	Maps, Unmaps            int64
	// AccessCalls counts grants of access (cuMemSetAccess): one per Map,
	// one per MapRange whatever its number of pages.
	AccessCalls int64
	// Exports and Imports count the descriptors Export handed out and the
	// handles Import made (cudart.ShareableMemory). Creates counts
	// CreateShareable's handles with Create's.
	Exports, Imports int64
	// Live values at the time of the call.
	LiveReservations, LiveHandles, LiveMappings int64
	// ReservedBytes is the address space reserved; MappedBytes the bytes
	// mapped into it; HandleBytes the physical memory of the live handles
	// (Create's, CreateShareable's and Import's).
	ReservedBytes, MappedBytes, HandleBytes uint64
}

// Sub returns c minus an earlier reading o: the calls made in between.
// The live figures and the bytes are c's, as they were at its reading.
func (c VMMCounters) Sub(o VMMCounters) VMMCounters {
	d := c
	d.Reserves -= o.Reserves
	d.ReleaseRanges -= o.ReleaseRanges
	d.Creates -= o.Creates
	d.FailedCreates -= o.FailedCreates
	d.Releases -= o.Releases
	d.Maps -= o.Maps
	d.Unmaps -= o.Unmaps
	d.AccessCalls -= o.AccessCalls
	d.Exports -= o.Exports
	d.Imports -= o.Imports
	return d
}

type simHandle struct {
	size      uint64
	mem       []byte     // with Backed or Shared (then the memfd's mapping)
	mappings  int        // how many addresses it is mapped at
	at        cudart.Ptr // where it was mapped last, for messages
	fd        int        // the memfd behind mem with Shared, -1 without
	shareable bool       // made by CreateShareable or Import: Export accepts it
	imported  bool       // made by Import: not counted against Capacity
}

type simMapping struct {
	addr   cudart.Ptr
	size   uint64
	handle cudart.Handle
}

// simVMM is the Sim's virtual memory state, guarded by Sim.mu.
type simVMM struct {
	reservations map[cudart.Ptr]uint64 // start → size
	handles      map[cudart.Handle]*simHandle
	mappings     map[cudart.Ptr]*simMapping // start → mapping
	granules     map[cudart.Ptr]*simMapping // every mapped granule → its mapping
	nextHandle   cudart.Handle
	mapped       uint64
	counters     VMMCounters
}

func (v *simVMM) init() {
	if v.handles == nil {
		v.reservations = make(map[cudart.Ptr]uint64)
		v.handles = make(map[cudart.Handle]*simHandle)
		v.mappings = make(map[cudart.Ptr]*simMapping)
		v.granules = make(map[cudart.Ptr]*simMapping)
		v.nextHandle = 1
	}
}

// reservationOf returns the reservation holding [p, p+size), if one does,
// in O(log n) (s.spans).
func (s *Sim) reservationOf(p cudart.Ptr, size uint64) (cudart.Ptr, bool) {
	var base cudart.Ptr
	found := false
	s.spans.DescendLessOrEqual(simSpan{start: p}, func(r simSpan) bool {
		base, found = r.start, r.reserve && size <= r.size && uint64(p-r.start) <= r.size-size
		return false
	})
	return base, found
}

var _ cudart.VirtualMemory = (*Sim)(nil)

func (s *Sim) vmmCheck(op string, size uint64) error {
	if s.closed {
		return fmt.Errorf("cudart: sim %s: %w", op, cudart.ErrClosed)
	}
	if size == 0 || size%simGranularity != 0 {
		return fmt.Errorf("cudart: sim %s: size %d is not a positive multiple of the granularity %d: %w", op, size, simGranularity, cudart.ErrInvalidValue)
	}
	s.vmm.init()
	return nil
}

// Granularity implements cudart.VirtualMemory: 2 MiB.
func (s *Sim) Granularity() (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("cudart: sim granularity: %w", cudart.ErrClosed)
	}
	return simGranularity, nil
}

// Reserve implements cudart.VirtualMemory. The range comes from the Sim's address
// range as Malloc's fresh addresses do, aligned to 2 MiB; it never overlaps
// an allocation or another reservation, and costs nothing against
// Capacity. With no free range of size left it fails with an error wrapping
// cudart.ErrOutOfMemory.
func (s *Sim) Reserve(size uint64) (cudart.Ptr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.vmmCheck("reserve", size); err != nil {
		return 0, err
	}
	p, ok := s.fresh(size)
	if !ok {
		return 0, fmt.Errorf("cudart: sim reserve of %d bytes: no free range of that size in the device's addresses [%#x, %#x): %w", size, uint64(s.lo), uint64(s.hi), cudart.ErrOutOfMemory)
	}
	s.vmm.reservations[p] = size
	s.spans.ReplaceOrInsert(simSpan{start: p, size: size, reserve: true})
	s.vmm.counters.Reserves++
	return p, nil
}

// ReleaseRange implements cudart.VirtualMemory. p and size must be a reservation's
// exactly, and nothing may be mapped inside it.
func (s *Sim) ReleaseRange(p cudart.Ptr, size uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.vmmCheck("release range", size); err != nil {
		return err
	}
	n, ok := s.vmm.reservations[p]
	if !ok || n != size {
		return fmt.Errorf("cudart: sim release range [%#x, +%d): not a reservation: %w", uint64(p), size, cudart.ErrInvalidValue)
	}
	for _, m := range s.vmm.mappings {
		if m.addr >= p && uint64(m.addr-p) < size {
			return fmt.Errorf("cudart: sim release range [%#x, +%d): [%#x, +%d) is still mapped: %w", uint64(p), size, uint64(m.addr), m.size, cudart.ErrInvalidValue)
		}
	}
	delete(s.vmm.reservations, p)
	s.spans.Delete(simSpan{start: p})
	s.vmm.counters.ReleaseRanges++
	return nil
}

// Create implements cudart.VirtualMemory. The memory counts against Capacity; past
// it, or when Faults.FailMalloc says so (a Create counts as a malloc call), it
// fails with an error wrapping cudart.ErrOutOfMemory. With Config.Shared the
// handle is a memfd (share.go), which Export still refuses, as the driver
// refuses to export memory not created shareable.
func (s *Sim) Create(size uint64) (cudart.Handle, error) {
	return s.create("create", size, false)
}

// create is Create and, with shareable, CreateShareable.
func (s *Sim) create(op string, size uint64, shareable bool) (cudart.Handle, error) {
	spin(s.cfg.MallocLatency)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("cudart: sim %s: %w", op, cudart.ErrClosed)
	}
	if shareable && !s.cfg.Shared {
		return 0, errNotShared(op)
	}
	if ok, err := s.faults.mallocFault(); ok {
		s.vmm.counters.FailedCreates++
		if err == nil {
			err = createOOM()
		}
		return 0, err
	}
	if err := s.vmmCheck(op, size); err != nil {
		return 0, err
	}
	if size > s.cfg.Capacity-s.used {
		s.vmm.counters.FailedCreates++
		return 0, createOOM()
	}
	sh := &simHandle{size: size, fd: -1, shareable: shareable}
	switch {
	case s.cfg.Shared:
		fd, mem, err := memfdMap(size)
		if err != nil {
			s.vmm.counters.FailedCreates++
			return 0, fmt.Errorf("cudart: sim %s of %d bytes: %w", op, size, err)
		}
		sh.fd, sh.mem = fd, mem
	case s.cfg.Backed:
		sh.mem = make([]byte, size)
	}
	h := s.vmm.nextHandle
	s.vmm.nextHandle++
	s.vmm.handles[h] = sh
	s.used += size
	s.vmm.counters.Creates++
	return h, nil
}

func createOOM() error {
	return &cudart.CUDAError{Op: "cuMemCreate", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY", Text: "out of memory"}
}

// Release implements cudart.VirtualMemory. A handle still mapped is refused.
// A handle of a Shared Sim has its memory unmapped from the process and its
// descriptor closed; memory imported elsewhere stays there until those
// processes release it too.
func (s *Sim) Release(h cudart.Handle) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("cudart: sim release: %w", cudart.ErrClosed)
	}
	s.vmm.init()
	sh, ok := s.vmm.handles[h]
	if !ok {
		return fmt.Errorf("cudart: sim release of handle %#x, which is not live: %w", uint64(h), cudart.ErrInvalidValue)
	}
	if sh.mappings != 0 {
		return fmt.Errorf("cudart: sim release of handle %#x, still mapped at %d addresses (%#x last): %w", uint64(h), sh.mappings, uint64(sh.at), cudart.ErrInvalidValue)
	}
	if sh.fd >= 0 {
		if err := unmapClose(sh.fd, sh.mem); err != nil {
			return fmt.Errorf("cudart: sim release of handle %#x: %w", uint64(h), err)
		}
	}
	delete(s.vmm.handles, h)
	if !sh.imported {
		s.used -= sh.size
	}
	s.vmm.counters.Releases++
	return nil
}

// Map implements cudart.VirtualMemory: the whole of h (size must be its size) is
// mapped at p, which must be granularity-aligned inside one reservation and
// overlap no mapping. A handle already mapped elsewhere may be mapped again:
// both addresses then reach its memory.
func (s *Sim) Map(p cudart.Ptr, size uint64, h cudart.Handle) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.vmmCheck("map", size); err != nil {
		return err
	}
	if err := s.mapLocked(p, size, h); err != nil {
		return err
	}
	s.vmm.counters.AccessCalls++
	return nil
}

// MapRange implements cudart.RangeMapper: it maps hs[i] at p + i*page,
// checking each as Map does, and grants access once. On error it unmaps
// what it mapped.
func (s *Sim) MapRange(p cudart.Ptr, page uint64, hs []cudart.Handle) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(hs) == 0 {
		return nil
	}
	if err := s.vmmCheck("map", page); err != nil {
		return err
	}
	for i, h := range hs {
		if err := s.mapLocked(p+cudart.Ptr(uint64(i)*page), page, h); err != nil {
			for j := range i {
				s.removeMapping(p + cudart.Ptr(uint64(j)*page))
				s.vmm.counters.Maps-- // undone: not a mapping made
			}
			return err
		}
	}
	s.vmm.counters.AccessCalls++
	return nil
}

// mapLocked is Map's checks and mapping, s.mu held.
func (s *Sim) mapLocked(p cudart.Ptr, size uint64, h cudart.Handle) error {
	v := &s.vmm
	sh, ok := v.handles[h]
	switch {
	case !ok:
		return fmt.Errorf("cudart: sim map of handle %#x, which is not live: %w", uint64(h), cudart.ErrInvalidValue)
	case sh.size != size:
		return fmt.Errorf("cudart: sim map of %d bytes of handle %#x, which holds %d: %w", size, uint64(h), sh.size, cudart.ErrInvalidValue)
	case uint64(p)%simGranularity != 0:
		return fmt.Errorf("cudart: sim map at %#x, which is not %d-byte aligned: %w", uint64(p), simGranularity, cudart.ErrInvalidValue)
	}
	if _, ok := s.reservationOf(p, size); !ok {
		return fmt.Errorf("cudart: sim map at [%#x, +%d): not inside one reservation: %w", uint64(p), size, cudart.ErrInvalidValue)
	}
	for g := p; uint64(g-p) < size; g += cudart.Ptr(simGranularity) {
		if m := v.granules[g]; m != nil {
			return fmt.Errorf("cudart: sim map at [%#x, +%d): overlaps the mapping [%#x, +%d): %w", uint64(p), size, uint64(m.addr), m.size, cudart.ErrInvalidValue)
		}
	}
	m := &simMapping{addr: p, size: size, handle: h}
	v.mappings[p] = m
	for g := p; uint64(g-p) < size; g += cudart.Ptr(simGranularity) {
		v.granules[g] = m
	}
	sh.mappings++
	sh.at = p
	v.mapped += size
	v.counters.Maps++
	return nil
}

// removeMapping removes the mapping that starts at p and returns its size
// (s.mu held; the mapping must exist). It counts nothing.
func (s *Sim) removeMapping(p cudart.Ptr) uint64 {
	v := &s.vmm
	m := v.mappings[p]
	for x := m.addr; uint64(x-m.addr) < m.size; x += cudart.Ptr(simGranularity) {
		delete(v.granules, x)
	}
	delete(v.mappings, m.addr)
	v.handles[m.handle].mappings--
	v.mapped -= m.size
	return m.size
}

// Unmap implements cudart.VirtualMemory: [p, p+size) must cover one or more whole
// mappings exactly, with no gap.
func (s *Sim) Unmap(p cudart.Ptr, size uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.vmmCheck("unmap", size); err != nil {
		return err
	}
	v := &s.vmm
	for g := p; uint64(g-p) < size; {
		m := v.granules[g]
		switch {
		case m == nil:
			return fmt.Errorf("cudart: sim unmap of [%#x, +%d): %#x is not mapped: %w", uint64(p), size, uint64(g), cudart.ErrInvalidValue)
		case m.addr != g || uint64(m.addr-p)+m.size > size:
			return fmt.Errorf("cudart: sim unmap of [%#x, +%d): covers part of the mapping [%#x, +%d): %w", uint64(p), size, uint64(m.addr), m.size, cudart.ErrInvalidValue)
		}
		g += cudart.Ptr(m.size)
	}
	for g := p; uint64(g-p) < size; {
		g += cudart.Ptr(s.removeMapping(g))
	}
	v.counters.Unmaps++
	return nil
}

// VMMCounters returns a copy of the virtual memory call counters.
func (s *Sim) VMMCounters() VMMCounters {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.vmm.counters
	c.LiveReservations = int64(len(s.vmm.reservations))
	c.LiveHandles = int64(len(s.vmm.handles))
	c.LiveMappings = int64(len(s.vmm.mappings))
	for _, n := range s.vmm.reservations {
		c.ReservedBytes += n
	}
	for _, h := range s.vmm.handles {
		c.HandleBytes += h.size
	}
	c.MappedBytes = s.vmm.mapped
	return c
}

// Mappings returns the mapped ranges, [address, size] pairs in address
// order: what a test compares with an allocator's expandable segments.
func (s *Sim) Mappings() [][2]uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([][2]uint64, 0, len(s.vmm.mappings))
	for _, m := range s.vmm.mappings {
		out = append(out, [2]uint64{uint64(m.addr), m.size})
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out
}

// mappedRegions returns the backing bytes of [p, p+n) when the range lies
// in mappings side by side (one slice per mapping; nil slices without
// Backed), and false when it does not.
func (s *Sim) mappedRegions(p cudart.Ptr, n uint64) ([][]byte, bool) {
	v := &s.vmm
	if len(v.granules) == 0 {
		return nil, false
	}
	var out [][]byte
	for cur, end := uint64(p), uint64(p)+n; cur < end || n == 0; {
		m := v.granules[cudart.Ptr(cur/simGranularity*simGranularity)]
		if m == nil {
			return nil, false
		}
		off := cur - uint64(m.addr)
		take := min(end-cur, m.size-off)
		if mem := v.handles[m.handle].mem; mem != nil {
			out = append(out, mem[off:off+take])
		} else {
			out = append(out, nil)
		}
		if n == 0 {
			break
		}
		cur += take
	}
	return out, true
}

// regions returns the backing bytes of [p, p+n), which must lie inside one
// live allocation or in mappings side by side: one slice per allocation or
// mapping touched, nil slices without Backed.
func (s *Sim) regions(op string, p cudart.Ptr, n uint64) ([][]byte, error) {
	b, err := s.region(op, p, n)
	if err == nil {
		return [][]byte{b}, nil
	}
	if s.closed {
		return nil, err
	}
	if bs, ok := s.mappedRegions(p, n); ok {
		return bs, nil
	}
	return nil, fmt.Errorf("cudart: sim %s: [%#x, +%d) is not inside a live allocation or mapped memory: %w", op, uint64(p), n, cudart.ErrInvalidValue)
}
