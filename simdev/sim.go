// Package simdev is a simulated GPU: a cudart.Device in pure Go that models
// capacity, address assignment (each device in its own range, Range;
// optionally the addresses a recorded program got, Config.Addresses),
// streams, events, virtual memory (cudart.VirtualMemory; with
// Config.Shared, memory shared between processes, cudart.ShareableMemory),
// stream-ordered allocation (cudart.AsyncAllocator) and page-locked host
// memory with queued copies (cudart.HostDevice). CI, the tests and
// `allocd replay` use it on machines without a GPU; devspec opens it for
// the `sim` device specification. Tests make chosen calls fail through a
// Sim's Faults. It imports cudart and never the reverse, and uses no cgo.
package simdev

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/google/btree"
)

// Config configures a simulated device.
type Config struct {
	// Capacity is the device memory in bytes. Malloc fails with
	// cudart.ErrOutOfMemory once the live allocations would exceed it.
	Capacity uint64
	// Index is the device ordinal reported by Info.
	Index int
	// Name is reported by Info; "sim" when empty.
	Name string
	// ManualEvents makes recorded events stay pending until the test
	// completes them (CompleteEvent, CompleteStream, CompleteAll) or a
	// synchronising call waits for them. When false, an event completes as
	// soon as it is recorded, as on an idle GPU.
	ManualEvents bool
	// Backed gives every allocation real host memory, so that MemsetAsync,
	// MemcpyHtoD and MemcpyDtoH move bytes. Off by default: a simulated
	// 100 GiB replay then costs kilobytes, and those calls fail with an
	// error wrapping ErrNotBacked rather than drop or invent data.
	Backed bool
	// Shared makes the Sim's physical memory shareable between processes,
	// as cudart.ShareableMemory describes: every handle, Create's and
	// CreateShareable's alike, is a memfd (memfd_create, then ftruncate to
	// the handle's size exactly) that the Sim maps MAP_SHARED as the
	// handle's memory, so that a process that Imports a descriptor from
	// Export maps the same bytes. Shared implies Backed's behaviour for
	// mapped ranges: MemsetAsync, MemcpyHtoD and MemcpyDtoH reach memory
	// mapped from these handles (Malloc's memory stays unbacked unless
	// Backed is set too). Each live handle holds a descriptor and a host
	// mapping until Release or Close; its pages are taken from the host as
	// they are first written. Linux only: elsewhere New fails with an error
	// wrapping cudart.ErrNotSupported.
	Shared bool
	// MallocLatency and FreeLatency are spent (spinning) in every Malloc and
	// Free, to model cudaMalloc's cost in benchmarks.
	MallocLatency, FreeLatency time.Duration
	// Addresses plans the addresses of Malloc: the addresses a real device
	// gave a recorded program (a trace's segment_alloc entries, in order).
	// A Malloc takes the first unused planned address of its exact size
	// among the next few planned entries, when that range is free;
	// otherwise it takes a fresh address. Best fit breaks ties by address,
	// so replaying with the recorded addresses reproduces the recorded
	// placement exactly. Every planned range must pass
	// CheckPlannedAddress (inside Range(Index), aligned, not wrapping).
	Addresses []Address
}

// Address is one planned allocation: its address and size.
type Address struct {
	Addr cudart.Ptr
	Size uint64
}

// planLookahead is how many planned entries past the first unused one a
// Malloc may match, so that a replay whose policy differs a little from the
// recording keeps most recorded addresses.
const planLookahead = 64

// Counters counts the calls a Sim has served.
type Counters struct {
	Mallocs, Frees, FailedMallocs           int64
	StreamCreates, StreamDestroys           int64
	EventCreates, EventDestroys             int64
	EventRecords, EventQueries, EventSyncs  int64
	DeviceSyncs, StreamSyncs, MemGetInfos   int64
	StreamWaits                             int64
	LiveAllocations, LiveEvents, LiveStream int64
}

// The simulated address space. Device i owns the addresses
// [i×DeviceSpan + simFloor, (i+1)×DeviceSpan) (Range), almost
// 64 PiB, so that several Sims in one process never hand out the same
// address, a pointer freed on the wrong device's allocator is recognised as
// foreign, and a device's range holds the expandable segments' reservations
// (1.125 × capacity each, per stream and pool) of many streams, even on a
// simulated device of petabytes. Every address stays below 2^63, so that
// it survives a signed 64-bit integer (a pickle, a C intptr_t). Device 0's
// range starts far from zero, so that a zero Ptr is never handed out, and
// holds the range CUDA hands out on Linux (0x7f...), where recorded
// (planned) addresses lie; fresh addresses start at its bottom, below them.
const (
	// DeviceSpan is the address space between the ranges of
	// consecutive simulated devices (2^56 bytes, 64 PiB).
	DeviceSpan uint64 = 1 << 56
	// MaxIndex is the largest simulated device index.
	MaxIndex = 126

	simFloor uint64 = 0x100000000000 // 16 TiB, the unused bottom of each span
	simAlign uint64 = 2 << 20
)

// Range returns the addresses a simulated device of the given index owns,
// [lo, hi): every address it hands out, and every planned address it
// accepts, lies inside. An index outside [0, MaxIndex] is an error
// wrapping cudart.ErrInvalidValue.
func Range(index int) (lo, hi cudart.Ptr, err error) {
	if index < 0 || index > MaxIndex {
		return 0, 0, fmt.Errorf("cudart: sim index %d is outside [0, %d]: %w", index, MaxIndex, cudart.ErrInvalidValue)
	}
	base := uint64(index) * DeviceSpan
	return cudart.Ptr(base + simFloor), cudart.Ptr(base + DeviceSpan), nil
}

var _ cudart.AddressRanger = (*Sim)(nil)

// AddressRange implements AddressRanger: Range of the Sim's index.
func (s *Sim) AddressRange() (lo, hi cudart.Ptr) { return s.lo, s.hi }

// PlanError reports a planned address (Config.Addresses) that a Sim
// cannot hand out. It wraps cudart.ErrInvalidValue.
type PlanError struct {
	// Entry is the index of the planned address in the plan.
	Entry int
	// Addr and Size are the planned range.
	Addr cudart.Ptr
	Size uint64
	// Reason says what is wrong with it.
	Reason string
}

func (e *PlanError) Error() string {
	return fmt.Sprintf("cudart: planned address entry %d, [%#x, +%d): %s", e.Entry, uint64(e.Addr), e.Size, e.Reason)
}

// Unwrap returns cudart.ErrInvalidValue.
func (e *PlanError) Unwrap() error { return cudart.ErrInvalidValue }

// CheckPlannedAddress checks one planned range for a Sim of the given index:
// a positive size, an address aligned to 2 MiB (as every address a Sim hands
// out), no wrap past 2^64, and inside Range(index). It returns a
// *PlanError naming entry, or nil. Planned ranges may overlap one another:
// a recorded program gets an address again once it has freed it, and a Sim
// takes a planned range only while it is free.
func CheckPlannedAddress(entry int, a Address, index int) error {
	lo, hi, err := Range(index)
	if err != nil {
		return err
	}
	bad := func(format string, args ...any) error {
		return &PlanError{Entry: entry, Addr: a.Addr, Size: a.Size, Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case a.Size == 0:
		return bad("the size is 0")
	case uint64(a.Addr)%simAlign != 0:
		return bad("the address is not aligned to %d bytes", simAlign)
	case uint64(a.Addr)+a.Size < uint64(a.Addr):
		return bad("the range wraps past 2^64")
	case a.Addr < lo || uint64(a.Addr)+a.Size > uint64(hi):
		return bad("the range is outside simulated device %d's addresses [%#x, %#x)", index, uint64(lo), uint64(hi))
	}
	return nil
}

// simSpan is a range of a Sim's address space in use: a live allocation
// or a reservation.
type simSpan struct {
	start   cudart.Ptr
	size    uint64
	reserve bool // a reservation (Reserve), not an allocation
}

func (r simSpan) end() uint64 { return uint64(r.start) + r.size }

func simSpanLess(a, b simSpan) bool { return a.start < b.start }

type simEvent struct {
	stream   cudart.Stream
	recorded bool
	done     bool
	seq      uint64 // copies queued on stream up to this one precede it (host_sim.go)
}

// Sim is a simulated cudart.Device. It is safe for concurrent use. Every address
// lies in the device's own range (Range). Addresses come from
// Config.Addresses when planned, and otherwise are fresh: aligned to
// 2 MiB, ascending, never reused until the range's end is reached. Two live
// allocations or reservations never overlap; a range that is not free is
// found in O(log n).
type Sim struct {
	cfg Config

	mu       sync.Mutex
	closed   bool
	lo, hi   cudart.Ptr             // the device's addresses (Range)
	next     cudart.Ptr             // where the search for fresh addresses starts
	spans    *btree.BTreeG[simSpan] // live allocations and reservations, by address
	used     uint64
	allocs   map[cudart.Ptr]uint64
	memory   map[cudart.Ptr][]byte
	streams  map[cudart.Stream]bool
	nextStrm cudart.Stream
	events   map[cudart.Event]*simEvent
	nextEvt  cudart.Event
	planUsed []bool // planned addresses already taken
	planNext int    // first planned address not yet taken
	faults   Faults // injected failures, for tests
	counters Counters
	vmm      simVMM  // virtual memory (sim_vmm.go)
	host     simHost // host memory and queued copies (host_sim.go)
}

var _ cudart.Device = (*Sim)(nil)

// New returns a simulated device with the given configuration.
// A zero Capacity, an Index outside [0, MaxIndex] and a planned address
// that CheckPlannedAddress refuses (a *PlanError) are errors wrapping
// cudart.ErrInvalidValue; Shared where memfds are not available (any
// system but Linux) is an error wrapping cudart.ErrNotSupported.
func New(cfg Config) (*Sim, error) {
	if cfg.Capacity == 0 {
		return nil, fmt.Errorf("cudart: sim capacity must be positive: %w", cudart.ErrInvalidValue)
	}
	if cfg.Shared && !shareSupported {
		return nil, fmt.Errorf("cudart: sim with Config.Shared: shareable memory needs memfds, which only Linux has: %w", cudart.ErrNotSupported)
	}
	lo, hi, err := Range(cfg.Index)
	if err != nil {
		return nil, err
	}
	for i, a := range cfg.Addresses {
		if err := CheckPlannedAddress(i, a, cfg.Index); err != nil {
			return nil, err
		}
	}
	if cfg.Name == "" {
		cfg.Name = "sim"
	}
	return &Sim{
		cfg:      cfg,
		lo:       lo,
		hi:       hi,
		next:     lo,
		spans:    btree.NewG(16, simSpanLess),
		allocs:   make(map[cudart.Ptr]uint64),
		memory:   make(map[cudart.Ptr][]byte),
		streams:  map[cudart.Stream]bool{cudart.DefaultStream: true},
		nextStrm: 1,
		events:   make(map[cudart.Event]*simEvent),
		nextEvt:  1,
		planUsed: make([]bool, len(cfg.Addresses)),
	}, nil
}

// Info implements cudart.Device.
func (s *Sim) Info() cudart.Info {
	return cudart.Info{Index: s.cfg.Index, Name: s.cfg.Name, UUID: fmt.Sprintf("SIM-%08x-0000-0000-0000-000000000000", s.cfg.Index), TotalMemory: s.cfg.Capacity}
}

func spin(d time.Duration) {
	if d <= 0 {
		return
	}
	for t0 := time.Now(); time.Since(t0) < d; {
	}
}

// Faults returns the Sim's fault injector: tests make chosen calls fail
// through it.
func (s *Sim) Faults() *Faults { return &s.faults }

func (s *Sim) oom(op string) error {
	return &cudart.CUDAError{Op: op, Code: 2, Name: "cudaErrorMemoryAllocation", Text: "out of memory"}
}

// Malloc implements cudart.Device.
func (s *Sim) Malloc(size uint64) (cudart.Ptr, error) {
	spin(s.cfg.MallocLatency)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("cudart: sim malloc: %w", cudart.ErrClosed)
	}
	if ok, err := s.faults.mallocFault(); ok {
		s.counters.FailedMallocs++
		if err == nil {
			err = s.oom("cudaMalloc")
		}
		return 0, err
	}
	if size == 0 {
		return 0, fmt.Errorf("cudart: sim malloc of 0 bytes: %w", cudart.ErrInvalidValue)
	}
	if size > s.cfg.Capacity-s.used {
		s.counters.FailedMallocs++
		return 0, s.oom("cudaMalloc")
	}
	p, ok := s.planned(size)
	if !ok {
		if p, ok = s.fresh(size); !ok {
			s.counters.FailedMallocs++
			return 0, s.oom("cudaMalloc")
		}
	}
	s.used += size
	s.allocs[p] = size
	s.spans.ReplaceOrInsert(simSpan{start: p, size: size})
	if s.cfg.Backed {
		s.memory[p] = make([]byte, size)
	}
	s.counters.Mallocs++
	return p, nil
}

// planned takes the planned address for a malloc of size, if one fits.
func (s *Sim) planned(size uint64) (cudart.Ptr, bool) {
	plan := s.cfg.Addresses
	for s.planNext < len(plan) && s.planUsed[s.planNext] {
		s.planNext++
	}
	for i := s.planNext; i < len(plan) && i < s.planNext+planLookahead; i++ {
		if s.planUsed[i] || plan[i].Size != size || !s.rangeFree(plan[i].Addr, size) {
			continue
		}
		s.planUsed[i] = true
		return plan[i].Addr, true
	}
	return 0, false
}

// rangeFree reports whether [p, p+size) lies inside the Sim's range and
// overlaps no live allocation and no reservation, in O(log n): the spans do
// not overlap, so only the last one starting below p+size can reach p.
func (s *Sim) rangeFree(p cudart.Ptr, size uint64) bool {
	if size == 0 || p < s.lo || p >= s.hi || size > uint64(s.hi-p) {
		return false
	}
	free := true
	s.spans.DescendLessOrEqual(simSpan{start: p + cudart.Ptr(size-1)}, func(r simSpan) bool {
		free = r.end() <= uint64(p)
		return false
	})
	return free
}

// fresh finds free address space for size bytes, aligned to 2 MiB: the
// first free range at or past where the last one ended, then, once the
// range's end is reached, the first free range from its bottom. Until the
// end is first reached no address is handed out twice (the addresses are
// those of a bump pointer); after it, address space freed is reused.
func (s *Sim) fresh(size uint64) (cudart.Ptr, bool) {
	span := uint64(s.hi - s.lo)
	if size == 0 || size > span-simAlign {
		return 0, false
	}
	n := (size + simAlign - 1) / simAlign * simAlign
	p, ok := s.gapFrom(s.next, n)
	if !ok {
		p, ok = s.gapFrom(s.lo, n)
	}
	if ok {
		s.next = p + cudart.Ptr(n)
	}
	return p, ok
}

// gapFrom returns the lowest 2 MiB-aligned address at or past from where n
// bytes are free and inside the Sim's range.
func (s *Sim) gapFrom(from cudart.Ptr, n uint64) (cudart.Ptr, bool) {
	p := uint64(from)
	up := func(e uint64) uint64 { return (e + simAlign - 1) / simAlign * simAlign }
	s.spans.DescendLessOrEqual(simSpan{start: from}, func(r simSpan) bool {
		p = max(p, up(r.end())) // the span holding from, if any
		return false
	})
	found := false
	s.spans.AscendGreaterOrEqual(simSpan{start: cudart.Ptr(p)}, func(r simSpan) bool {
		if p > uint64(s.hi) || n > uint64(s.hi)-p {
			return false
		}
		if uint64(r.start) >= p+n {
			found = true
			return false
		}
		p = max(p, up(r.end()))
		return true
	})
	if !found && (p > uint64(s.hi) || n > uint64(s.hi)-p) {
		return 0, false
	}
	return cudart.Ptr(p), true
}

// Free implements cudart.Device. Like cudaFree it synchronises the device, so
// every pending event completes.
func (s *Sim) Free(p cudart.Ptr) error {
	spin(s.cfg.FreeLatency)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("cudart: sim free: %w", cudart.ErrClosed)
	}
	size, ok := s.allocs[p]
	if !ok {
		return fmt.Errorf("cudart: sim free of %#x, which is not a live allocation: %w", uint64(p), cudart.ErrInvalidValue)
	}
	s.completeAllLocked()
	delete(s.allocs, p)
	delete(s.memory, p)
	s.spans.Delete(simSpan{start: p})
	s.used -= size
	s.counters.Frees++
	return nil
}

// MemGetInfo implements cudart.Device.
func (s *Sim) MemGetInfo() (free, total uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, 0, fmt.Errorf("cudart: sim mem get info: %w", cudart.ErrClosed)
	}
	s.counters.MemGetInfos++
	return s.cfg.Capacity - s.used, s.cfg.Capacity, nil
}

// Used returns the bytes currently allocated on the device: live Malloc
// allocations and physical memory made by Create.
func (s *Sim) Used() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used
}

// Synchronize implements cudart.Device: every pending event completes.
func (s *Sim) Synchronize() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("cudart: sim synchronize: %w", cudart.ErrClosed)
	}
	s.counters.DeviceSyncs++
	s.completeAllLocked()
	return nil
}

func (s *Sim) completeAllLocked() {
	s.runCopies(true, 0, 0)
	for _, e := range s.events {
		if e.recorded {
			e.done = true
		}
	}
}

// StreamCreate implements cudart.Device.
func (s *Sim) StreamCreate() (cudart.Stream, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("cudart: sim stream create: %w", cudart.ErrClosed)
	}
	st := s.nextStrm
	s.nextStrm++
	s.streams[st] = true
	s.counters.StreamCreates++
	return st, nil
}

func (s *Sim) checkStream(op string, st cudart.Stream) error {
	if s.closed {
		return fmt.Errorf("cudart: sim %s: %w", op, cudart.ErrClosed)
	}
	if !s.streams[st] {
		return fmt.Errorf("cudart: sim %s: unknown stream %d: %w", op, st, cudart.ErrInvalidValue)
	}
	return nil
}

// ValidStream reports whether st is the default stream or a live stream made
// by StreamCreate.
func (s *Sim) ValidStream(st cudart.Stream) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.streams[st]
}

// StreamDestroy implements cudart.Device.
func (s *Sim) StreamDestroy(st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkStream("stream destroy", st); err != nil {
		return err
	}
	if st == cudart.DefaultStream {
		return fmt.Errorf("cudart: sim stream destroy: the default stream cannot be destroyed: %w", cudart.ErrInvalidValue)
	}
	delete(s.streams, st)
	s.counters.StreamDestroys++
	return nil
}

// StreamSynchronize implements cudart.Device: every event recorded on st completes.
func (s *Sim) StreamSynchronize(st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkStream("stream synchronize", st); err != nil {
		return err
	}
	s.counters.StreamSyncs++
	s.completeStreamLocked(st)
	return nil
}

func (s *Sim) completeStreamLocked(st cudart.Stream) {
	s.runCopies(false, st, s.host.seq)
	for _, e := range s.events {
		if e.recorded && e.stream == st {
			e.done = true
		}
	}
}

// EventCreate implements cudart.Device.
func (s *Sim) EventCreate() (cudart.Event, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("cudart: sim event create: %w", cudart.ErrClosed)
	}
	e := s.nextEvt
	s.nextEvt++
	s.events[e] = &simEvent{done: true} // an unrecorded event counts as complete, as in CUDA
	s.counters.EventCreates++
	return e, nil
}

func (s *Sim) event(op string, e cudart.Event) (*simEvent, error) {
	if s.closed {
		return nil, fmt.Errorf("cudart: sim %s: %w", op, cudart.ErrClosed)
	}
	ev, ok := s.events[e]
	if !ok {
		return nil, fmt.Errorf("cudart: sim %s: unknown event %d: %w", op, e, cudart.ErrInvalidValue)
	}
	return ev, nil
}

// EventRecord implements cudart.Device. With ManualEvents the event stays pending
// until completed; otherwise it completes at once.
func (s *Sim) EventRecord(e cudart.Event, st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, err := s.event("event record", e)
	if err != nil {
		return err
	}
	if err := s.checkStream("event record", st); err != nil {
		return err
	}
	ev.stream, ev.recorded, ev.done, ev.seq = st, true, !s.cfg.ManualEvents, s.host.seq
	s.counters.EventRecords++
	return nil
}

// EventQuery implements cudart.Device.
func (s *Sim) EventQuery(e cudart.Event) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, err := s.event("event query", e)
	if err != nil {
		return false, err
	}
	s.counters.EventQueries++
	return ev.done, nil
}

// EventSynchronize implements cudart.Device: the event completes.
func (s *Sim) EventSynchronize(e cudart.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, err := s.event("event synchronize", e)
	if err != nil {
		return err
	}
	s.counters.EventSyncs++
	s.completeEventLocked(ev)
	return nil
}

// StreamWaitEvent implements cudart.StreamWaiter. The simulated device
// orders the two streams by finishing, at once, the work of e's stream
// up to e (its copies run), which is one order a GPU could take.
func (s *Sim) StreamWaitEvent(st cudart.Stream, e cudart.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, err := s.event("stream wait event", e)
	if err != nil {
		return err
	}
	if err := s.checkStream("stream wait event", st); err != nil {
		return err
	}
	s.counters.StreamWaits++
	s.completeEventLocked(ev)
	return nil
}

// EventDestroy implements cudart.Device.
func (s *Sim) EventDestroy(e cudart.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.event("event destroy", e); err != nil {
		return err
	}
	delete(s.events, e)
	s.counters.EventDestroys++
	return nil
}

// CompleteEvent marks e complete, as if the GPU had reached it.
func (s *Sim) CompleteEvent(e cudart.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	ev, err := s.event("complete event", e)
	if err != nil {
		return err
	}
	s.completeEventLocked(ev)
	return nil
}

// completeEventLocked marks ev done, running the copies queued on its
// stream before it was recorded.
func (s *Sim) completeEventLocked(ev *simEvent) {
	if ev.recorded && !ev.done {
		s.runCopies(false, ev.stream, ev.seq)
	}
	ev.done = true
}

// CompleteStream marks every event recorded on st so far complete, as if the
// GPU had finished the work queued on st.
func (s *Sim) CompleteStream(st cudart.Stream) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.completeStreamLocked(st)
}

// CompleteAll marks every recorded event complete.
func (s *Sim) CompleteAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.completeAllLocked()
}

// PendingEvents returns the number of recorded events not yet complete.
func (s *Sim) PendingEvents() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, e := range s.events {
		if e.recorded && !e.done {
			n++
		}
	}
	return n
}

// region returns the backing bytes of [p, p+n), which must lie inside one
// live allocation.
func (s *Sim) region(op string, p cudart.Ptr, n uint64) ([]byte, error) {
	if s.closed {
		return nil, fmt.Errorf("cudart: sim %s: %w", op, cudart.ErrClosed)
	}
	var in simSpan
	found := false
	s.spans.DescendLessOrEqual(simSpan{start: p}, func(r simSpan) bool {
		in, found = r, !r.reserve && n <= r.size && uint64(p-r.start) <= r.size-n
		return false
	})
	if found {
		if !s.cfg.Backed {
			return nil, nil
		}
		off := uint64(p - in.start)
		return s.memory[in.start][off : off+n], nil
	}
	return nil, fmt.Errorf("cudart: sim %s: [%#x, +%d) is not inside a live allocation: %w", op, uint64(p), n, cudart.ErrInvalidValue)
}

// ErrNotBacked: a memset or memcpy on a Sim without Config.Backed,
// which has no memory to hold the bytes.
var ErrNotBacked = errors.New("simulated device has no backing memory")

// backed returns the regions of [p, p+n) for op, or an error: the address
// range is checked first, then that the Sim holds bytes for all of it
// (Backed, or mappings of a Shared Sim's handles).
func (s *Sim) backed(op string, p cudart.Ptr, n uint64) ([][]byte, error) {
	bs, err := s.regions(op, p, n)
	if err != nil {
		return nil, err
	}
	if !s.cfg.Backed && slices.ContainsFunc(bs, func(b []byte) bool { return b == nil }) {
		return nil, fmt.Errorf("cudart: sim %s of %d bytes at %#x: %w (create it with Config.Backed)", op, n, uint64(p), ErrNotBacked)
	}
	return bs, nil
}

// MemsetAsync implements cudart.Device. It takes effect at once. Without
// Config.Backed it fails with ErrNotBacked.
func (s *Sim) MemsetAsync(p cudart.Ptr, value byte, size uint64, st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkStream("memset", st); err != nil {
		return err
	}
	bs, err := s.backed("memset", p, size)
	if err != nil {
		return err
	}
	for _, b := range bs {
		for i := range b {
			b[i] = value
		}
	}
	return nil
}

// MemcpyHtoD implements cudart.Device. Without Config.Backed it fails with
// ErrNotBacked.
func (s *Sim) MemcpyHtoD(dst cudart.Ptr, src []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	bs, err := s.backed("memcpy host to device", dst, uint64(len(src)))
	if err != nil {
		return err
	}
	for _, b := range bs {
		src = src[copy(b, src):]
	}
	return nil
}

// MemcpyDtoH implements cudart.Device. Without Config.Backed it fails with
// ErrNotBacked.
func (s *Sim) MemcpyDtoH(dst []byte, src cudart.Ptr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	bs, err := s.backed("memcpy device to host", src, uint64(len(dst)))
	if err != nil {
		return err
	}
	for _, b := range bs {
		dst = dst[copy(dst, b):]
	}
	return nil
}

// Counters returns a copy of the call counters.
func (s *Sim) Counters() Counters {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.counters
	c.LiveAllocations = int64(len(s.allocs))
	c.LiveEvents = int64(len(s.events))
	c.LiveStream = int64(len(s.streams) - 1)
	return c
}

// Close implements cudart.Device. Later calls return cudart.ErrClosed. A
// Shared Sim unmaps and closes the memfds of the handles it still holds,
// mapped or not (other processes keep what they imported); an error doing
// so is returned, and the Sim is closed all the same.
func (s *Sim) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("cudart: sim close: %w", cudart.ErrClosed)
	}
	s.closed = true
	return s.releaseSharedLocked()
}

var _ cudart.StreamChecker = (*Sim)(nil)

// CheckStream implements cudart.StreamChecker.
func (s *Sim) CheckStream(st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.checkStream("check stream", st)
}

// ManualEvents reports whether recorded events wait for the test to
// complete them (Config.ManualEvents).
func (s *Sim) ManualEvents() bool { return s.cfg.ManualEvents }

var (
	_ cudart.AsyncAllocator = (*Sim)(nil)
	_ cudart.PoolReporter   = (*Sim)(nil)
)

// MallocAsync implements cudart.AsyncAllocator: the simulated pool is the device
// itself, so it behaves as Malloc after checking the stream.
func (s *Sim) MallocAsync(size uint64, st cudart.Stream) (cudart.Ptr, error) {
	if !s.ValidStream(st) {
		return 0, fmt.Errorf("cudart: sim malloc async: unknown stream %d: %w", st, cudart.ErrInvalidValue)
	}
	return s.Malloc(size)
}

// FreeAsync implements cudart.AsyncAllocator.
func (s *Sim) FreeAsync(p cudart.Ptr, st cudart.Stream) error {
	if !s.ValidStream(st) {
		return fmt.Errorf("cudart: sim free async: unknown stream %d: %w", st, cudart.ErrInvalidValue)
	}
	return s.Free(p)
}

// TrimPool implements cudart.AsyncAllocator; the simulated pool holds nothing
// beyond live allocations.
func (s *Sim) TrimPool() error { return nil }

// PoolUsage implements PoolReporter: reserved and used are both the live
// allocations.
func (s *Sim) PoolUsage() (reserved, used uint64, err error) {
	u := s.Used()
	return u, u, nil
}
