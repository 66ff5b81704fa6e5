package simdev

import (
	"fmt"
	"unsafe"

	"github.com/allocd/allocd/cudart"
)

// The Sim's page-locked host memory and stream-ordered copies.
//
// HostAlloc hands out ordinary Go memory and remembers it as "pinned". A
// copy between device memory and pinned host memory is queued on its stream
// and moves its bytes only when the work of the stream completes: when an
// event recorded after it completes (CompleteEvent, EventSynchronize), when
// its stream does (CompleteStream, StreamSynchronize) or when the device
// does (CompleteAll, Synchronize, Free, FreeHost). Without
// Config.ManualEvents every recorded event completes at once, and so do
// copies. A copy with host memory not made by HostAlloc (pageable memory)
// completes its stream's queued work, then happens at once, as CUDA does it. So a test on a Sim with ManualEvents
// sees what a GPU would do to a buffer that is reused too early: the bytes
// a queued H2D copy reads are those in the buffer when the stream reaches
// it, and a queued D2H copy overwrites the buffer when it does.

// simHost is the Sim's host-memory state, guarded by Sim.mu.
type simHost struct {
	live     map[uintptr][]byte // HostAlloc memory by base address
	used     uint64             // bytes of live HostAlloc memory
	capacity uint64             // 0: DefaultHostCapacity
	pending  []simCopy          // queued copies, in the order they were queued
	seq      uint64             // sequence number of the last queued copy
	counters HostCounters
}

// HostCounters counts the host-memory calls a Sim has served.
type HostCounters struct {
	// HostAllocs and HostFrees count successful HostAlloc and FreeHost
	// calls; FailedHostAllocs the refused ones.
	HostAllocs, HostFrees, FailedHostAllocs int64
	// AsyncCopies counts queued copies; CopiesRun those that have moved
	// their bytes.
	AsyncCopies, CopiesRun int64
	// LiveHostAllocations and LiveHostBytes describe the HostAlloc memory
	// not yet freed; PendingCopies the copies not yet run.
	LiveHostAllocations, LiveHostBytes, PendingCopies int64
}

// simCopy is one queued copy: dst ← src when its stream reaches it.
type simCopy struct {
	seq    uint64
	stream cudart.Stream
	host   []byte     // the host side, nil for device to device
	dev    cudart.Ptr // the device side (the destination of D2D)
	src    cudart.Ptr // the source of D2D
	n      uint64
	dir    uint8 // copyHtoD, copyDtoH, copyDtoD
}

// maxHostSlice is the largest []byte this platform can hold.
const maxHostSlice = uint64(^uint(0) >> 1)

const (
	copyHtoD uint8 = iota + 1
	copyDtoH
	copyDtoD
)

// DefaultHostCapacity is the Sim's page-locked memory when
// SetHostCapacity has not set another: 64 GiB.
const DefaultHostCapacity uint64 = 64 << 30

// SetHostCapacity caps the Sim's live HostAlloc memory at n bytes (0:
// DefaultHostCapacity); a HostAlloc past it fails with cudart.ErrOutOfMemory.
// Whatever n is, the live HostAlloc memory also stays within the machine's
// physical memory where the system reports it (Linux), as page-locked
// memory must: the Sim's host memory is Go memory, and a Go allocation the
// system refuses is a fatal error of the runtime, not an error.
// Lowering the capacity below the live memory refuses every HostAlloc
// until enough is freed.
func (s *Sim) SetHostCapacity(n uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.host.capacity = n
}

// hostLimit returns the bytes of host memory the Sim may hand out in all.
func (s *Sim) hostLimit() uint64 {
	c := s.host.capacity
	if c == 0 {
		c = DefaultHostCapacity
	}
	if m := physicalMemory(); m != 0 {
		c = min(c, m)
	}
	return min(c, maxHostSlice)
}

// HostCounters returns a copy of the host-memory counters.
func (s *Sim) HostCounters() HostCounters {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.host.counters
	c.LiveHostAllocations = int64(len(s.host.live))
	c.LiveHostBytes = int64(s.host.used)
	c.PendingCopies = int64(len(s.host.pending))
	return c
}

// HostAlloc implements cudart.HostDevice with Go memory, which the Sim then treats
// as page-locked. flags are checked as CUDA checks them and otherwise
// ignored. A request past the host capacity (SetHostCapacity) fails with
// cudart.ErrOutOfMemory, whatever its size.
func (s *Sim) HostAlloc(size uint64, flags cudart.HostAllocFlags) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("cudart: sim host alloc: %w", cudart.ErrClosed)
	}
	if ok, err := s.faults.hostAllocFault(); ok {
		s.host.counters.FailedHostAllocs++
		if err != nil {
			return nil, err
		}
		return nil, s.oom("cudaHostAlloc")
	}
	if size == 0 {
		return nil, fmt.Errorf("cudart: sim host alloc of 0 bytes: %w", cudart.ErrInvalidValue)
	}
	if !flags.Valid() {
		return nil, fmt.Errorf("cudart: sim host alloc: unknown flags %#x: %w", uint32(flags), cudart.ErrInvalidValue)
	}
	// Checked before any Go memory is asked for: the runtime cannot
	// refuse a make([]byte) with an error.
	if limit := s.hostLimit(); s.host.used > limit || size > limit-s.host.used {
		s.host.counters.FailedHostAllocs++
		return nil, s.oom("cudaHostAlloc")
	}
	b := make([]byte, size)
	if s.host.live == nil {
		s.host.live = map[uintptr][]byte{}
	}
	s.host.live[uintptr(unsafe.Pointer(&b[0]))] = b
	s.host.used += size
	s.host.counters.HostAllocs++
	return b, nil
}

// FreeHost implements cudart.HostDevice. Like cudaFreeHost it synchronises the
// device first, so every queued copy runs.
func (s *Sim) FreeHost(b []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("cudart: sim free host: %w", cudart.ErrClosed)
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	live, ok := s.host.live[p]
	if p == 0 || !ok {
		return fmt.Errorf("cudart: sim free host of %#x, which is not a live host allocation: %w", p, cudart.ErrInvalidValue)
	}
	s.completeAllLocked()
	delete(s.host.live, p)
	s.host.used -= uint64(len(live))
	s.host.counters.HostFrees++
	return nil
}

// pinned reports whether b lies inside one live HostAlloc allocation.
func (s *Sim) pinned(b []byte) bool {
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for base, m := range s.host.live {
		if p >= base && p-base+uintptr(len(b)) <= uintptr(len(m)) {
			return true
		}
	}
	return false
}

// queueCopy checks a copy and runs it at once (pageable host memory, or no
// ManualEvents) or queues it on its stream.
func (s *Sim) queueCopy(op string, c simCopy) error {
	if err := s.checkStream(op, c.stream); err != nil {
		return err
	}
	if c.n == 0 {
		return nil
	}
	if _, err := s.backed(op, c.dev, c.n); err != nil {
		return err
	}
	if c.dir == copyDtoD {
		if _, err := s.backed(op, c.src, c.n); err != nil {
			return err
		}
	}
	s.host.counters.AsyncCopies++
	if !s.cfg.ManualEvents {
		return s.runCopy(op, &c)
	}
	if c.dir != copyDtoD && !s.pinned(c.host) {
		// CUDA synchronises the stream before a copy with pageable memory
		// and returns once it has read (H2D) or written (D2H) the host side.
		s.completeStreamLocked(c.stream)
		return s.runCopy(op, &c)
	}
	s.host.seq++
	c.seq = s.host.seq
	s.host.pending = append(s.host.pending, c)
	return nil
}

// runCopy moves a copy's bytes. The device ranges were live when the copy
// was queued and Free runs queued copies before it frees; a copy whose
// range was unmapped (cudart.VirtualMemory) meanwhile moves nothing.
func (s *Sim) runCopy(op string, c *simCopy) error {
	s.host.counters.CopiesRun++
	dev, err := s.backed(op, c.dev, c.n)
	if err != nil {
		return err
	}
	switch c.dir {
	case copyHtoD:
		src := c.host
		for _, b := range dev {
			src = src[copy(b, src):]
		}
	case copyDtoH:
		dst := c.host
		for _, b := range dev {
			dst = dst[copy(dst, b):]
		}
	case copyDtoD:
		srcs, err := s.backed(op, c.src, c.n)
		if err != nil {
			return err
		}
		tmp := make([]byte, 0, c.n) // source and destination may overlap
		for _, b := range srcs {
			tmp = append(tmp, b...)
		}
		for _, b := range dev {
			tmp = tmp[copy(b, tmp):]
		}
	}
	return nil
}

// runCopies runs, in queue order, the pending copies that match: all of
// them (all), or those on stream st queued before sequence number upTo.
// s.mu must be held.
func (s *Sim) runCopies(all bool, st cudart.Stream, upTo uint64) {
	if len(s.host.pending) == 0 {
		return
	}
	kept := s.host.pending[:0]
	for i := range s.host.pending {
		c := s.host.pending[i]
		if all || (c.stream == st && c.seq <= upTo) {
			_ = s.runCopy("queued copy", &c) // checked when queued
			continue
		}
		kept = append(kept, c)
	}
	clear(s.host.pending[len(kept):])
	s.host.pending = kept
}

// MemcpyHtoDAsync implements cudart.HostDevice. Without Config.Backed it fails
// with ErrNotBacked.
func (s *Sim) MemcpyHtoDAsync(dst cudart.Ptr, src []byte, st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queueCopy("memcpy async host to device", simCopy{stream: st, host: src, dev: dst, n: uint64(len(src)), dir: copyHtoD})
}

// MemcpyDtoHAsync implements cudart.HostDevice. Without Config.Backed it fails
// with ErrNotBacked.
func (s *Sim) MemcpyDtoHAsync(dst []byte, src cudart.Ptr, st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queueCopy("memcpy async device to host", simCopy{stream: st, host: dst, dev: src, n: uint64(len(dst)), dir: copyDtoH})
}

// MemcpyDtoDAsync implements cudart.HostDevice. Without Config.Backed it fails
// with ErrNotBacked.
func (s *Sim) MemcpyDtoDAsync(dst, src cudart.Ptr, size uint64, st cudart.Stream) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queueCopy("memcpy async device to device", simCopy{stream: st, dev: dst, src: src, n: size, dir: copyDtoD})
}
