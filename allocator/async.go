package allocator

import (
	"errors"
	"fmt"

	"github.com/allocd/allocd/cudart"
)

// asyncAllocator is backend:cudaMallocAsync, PyTorch's
// CudaMallocAsyncAllocator: its own backend (backend.go) beside the native
// policy. Every Malloc and Free goes to the device's stream-ordered pool
// (whose release threshold the device sets high, as PyTorch does), and it
// keeps only the bookkeeping for statistics, RecordStream and error
// checking. It shares the allocator's statistics, events, history and
// world mode (it has no hot path of its own).
type asyncAllocator struct {
	a    *Allocator
	dev  cudart.AsyncAllocator
	pool cudart.PoolReporter // nil when the device cannot report usage
	live map[uint64]*asyncAlloc
	// pending holds frees waiting for events on the streams that used the
	// memory; they are issued once every event has completed.
	pending []*asyncAlloc
}

type asyncAlloc struct {
	ptr, size, requested uint64
	stream               cudart.Stream
	uses                 []cudart.Stream
	events               []cudart.Event
}

func newAsyncAllocator(a *Allocator, dev cudart.Device) (*asyncAllocator, error) {
	ad, ok := dev.(cudart.AsyncAllocator)
	if !ok {
		return nil, fmt.Errorf("allocator: backend:cudaMallocAsync: device %q has no stream-ordered pool: %w", dev.Info().Name, ErrNotSupported)
	}
	pr, _ := dev.(cudart.PoolReporter)
	return &asyncAllocator{a: a, dev: ad, pool: pr, live: make(map[uint64]*asyncAlloc)}, nil
}

// asyncPoolOf attributes an async allocation to a pool by size, so that
// per-pool statistics keep their meaning.
func asyncPoolOf(size uint64) Pool {
	if size <= smallSize {
		return PoolSmall
	}
	return PoolLarge
}

// mallocStream serves a request from the device's pool, trimming it and
// retrying once on out of memory.
func (m *asyncAllocator) mallocStream(c *call, size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	a := m.a
	if err := m.process(c, false); err != nil {
		return 0, err
	}
	ptr, err := m.dev.MallocAsync(size, stream)
	if err != nil && errors.Is(err, cudart.ErrOutOfMemory) {
		// Release what the pool caches, wait for deferred frees, retry once.
		if err = m.process(c, true); err == nil {
			if err = m.dev.TrimPool(); err == nil {
				a.stats.NumAllocRetries++
				ptr, err = m.dev.MallocAsync(size, stream)
			}
		}
	}
	if err != nil {
		if errors.Is(err, cudart.ErrOutOfMemory) {
			return 0, a.outOfMemory(c, size, size, stream, err)
		}
		return 0, fmt.Errorf("allocator: device malloc async of %d bytes: %w", size, err)
	}
	p := asyncPoolOf(size)
	m.live[uint64(ptr)] = &asyncAlloc{ptr: uint64(ptr), size: size, requested: size, stream: stream}
	st := &a.stats
	st.NumDeviceAlloc++
	st.Allocation.add(p, 1)
	st.AllocatedBytes.add(p, int64(size))
	st.Active.add(p, 1)
	st.ActiveBytes.add(p, int64(size))
	st.RequestedBytes.add(p, int64(size))
	m.syncReserved()
	a.record(c, actionAlloc, uint64(ptr), size, stream)
	return ptr, nil
}

func (m *asyncAllocator) free(c *call, ptr cudart.Ptr) error {
	a := m.a
	al := m.live[uint64(ptr)]
	if al == nil {
		for _, pa := range m.pending {
			if pa.ptr == uint64(ptr) {
				return fmt.Errorf("allocator: free of %#x: %w (the block is already free)", uint64(ptr), ErrDoubleFree)
			}
		}
		return fmt.Errorf("allocator: free of %#x: %w", uint64(ptr), ErrUnknownPointer)
	}
	if len(al.uses) > 0 {
		for _, s := range al.uses {
			ev, err := a.getEvent()
			if err == nil {
				if err = a.dev.EventRecord(ev, s); err != nil {
					a.spareEvents.Put(ev)
				}
			}
			if err != nil {
				// Cannot track the use: wait for the device instead.
				if serr := a.dev.Synchronize(); serr != nil {
					return fmt.Errorf("allocator: free of %#x: recording an event failed (%v) and so did synchronising: %w", uint64(ptr), err, serr)
				}
				continue
			}
			al.events = append(al.events, ev)
		}
		al.uses = nil
		if len(al.events) > 0 {
			delete(m.live, al.ptr)
			m.freed(al)
			m.pending = append(m.pending, al)
			a.record(c, actionFreeRequested, al.ptr, al.size, al.stream)
			return nil
		}
	}
	if err := m.dev.FreeAsync(ptr, al.stream); err != nil {
		return fmt.Errorf("allocator: device free async of %#x: %w", uint64(ptr), err)
	}
	delete(m.live, al.ptr)
	m.freed(al)
	m.completed(c, al)
	return nil
}

// asyncFreed counts the end of an allocation (free requested).
func (m *asyncAllocator) freed(al *asyncAlloc) {
	a := m.a
	p := asyncPoolOf(al.size)
	a.stats.Allocation.sub(p, 1)
	a.stats.AllocatedBytes.sub(p, int64(al.size))
}

// asyncCompleted counts the memory's return to the pool (free completed).
func (m *asyncAllocator) completed(c *call, al *asyncAlloc) {
	a := m.a
	p := asyncPoolOf(al.size)
	a.stats.Active.sub(p, 1)
	a.stats.ActiveBytes.sub(p, int64(al.size))
	a.stats.RequestedBytes.sub(p, int64(al.requested))
	a.stats.NumDeviceFree++
	m.syncReserved()
	a.record(c, actionFreeCompleted, al.ptr, al.size, al.stream)
}

// asyncProcess issues the deferred frees whose events have completed; with
// wait it first waits for all of them.
func (m *asyncAllocator) process(c *call, wait bool) error {
	a := m.a
	if len(m.pending) == 0 {
		return nil
	}
	if wait {
		a.stats.NumSyncAllStreams++
	}
	keep := m.pending[:0]
	var firstErr error
	for _, al := range m.pending {
		done := true
		for _, ev := range al.events {
			var ok bool
			var err error
			if wait {
				err = a.dev.EventSynchronize(ev)
				ok = err == nil
			} else {
				ok, err = a.dev.EventQuery(ev)
			}
			if err != nil && firstErr == nil {
				firstErr = fmt.Errorf("allocator: waiting for a stream event: %w", err)
			}
			done = done && ok
		}
		if !done {
			keep = append(keep, al)
			continue
		}
		if err := m.dev.FreeAsync(cudart.Ptr(al.ptr), al.stream); err != nil && firstErr == nil {
			firstErr = fmt.Errorf("allocator: device free async of %#x: %w", al.ptr, err)
		}
		a.spareEvents.PutAll(al.events)
		m.completed(c, al)
	}
	for i := len(keep); i < len(m.pending); i++ {
		m.pending[i] = nil
	}
	m.pending = keep
	return firstErr
}

// asyncSyncReserved refreshes reserved bytes from the pool (slow path: one
// device query) or, when the device cannot tell, from active bytes.
func (m *asyncAllocator) syncReserved() {
	a := m.a
	var reserved uint64
	if pr := m.pool; pr != nil {
		r, _, err := pr.PoolUsage()
		if err != nil {
			return
		}
		reserved = r
	} else {
		reserved = uint64(a.stats.ActiveBytes[PoolAll].Current)
	}
	delta := int64(reserved) - int64(a.segs.reserved)
	a.segs.reserved = reserved
	// The pool does not say which size class holds its memory; count it in
	// the large pool, where nearly all of it is.
	a.stats.ReservedBytes.adjust(PoolLarge, delta)
	a.stats.ReservedBytes.raisePeak(PoolLarge)
	segs := int64(0)
	if reserved > 0 {
		segs = 1
	}
	a.stats.Segment.adjust(PoolLarge, segs-a.stats.Segment[PoolLarge].Current)
	a.stats.Segment.raisePeak(PoolLarge)
}

func (m *asyncAllocator) recordStream(ptr cudart.Ptr, s cudart.Stream) error {
	a := m.a
	al := m.live[uint64(ptr)]
	if al == nil {
		return fmt.Errorf("allocator: record stream of %#x: %w", uint64(ptr), ErrUnknownPointer)
	}
	if _, err := a.checkStream(s); err != nil {
		return err
	}
	if s == al.stream {
		return nil
	}
	for _, u := range al.uses {
		if u == s {
			return nil
		}
	}
	al.uses = append(al.uses, s)
	return nil
}

func (m *asyncAllocator) emptyCache() error {
	a := m.a
	if err := m.process(nil, true); err != nil {
		return err
	}
	if err := a.dev.Synchronize(); err != nil {
		return fmt.Errorf("allocator: empty cache: %w", err)
	}
	if err := m.dev.TrimPool(); err != nil {
		return fmt.Errorf("allocator: empty cache: trimming the pool: %w", err)
	}
	m.syncReserved()
	return nil
}

// asyncClose frees everything still live or pending and trims the pool.
func (m *asyncAllocator) closeAll() []error {
	a := m.a
	var errs []error
	if err := m.process(nil, true); err != nil {
		errs = append(errs, err)
	}
	for _, al := range m.live {
		if err := m.dev.FreeAsync(cudart.Ptr(al.ptr), al.stream); err != nil {
			errs = append(errs, err)
		}
	}
	// Frees still deferred (their events failed): issue them after the
	// device has finished everything.
	for _, al := range m.pending {
		if err := m.dev.FreeAsync(cudart.Ptr(al.ptr), al.stream); err != nil {
			errs = append(errs, err)
		}
		a.spareEvents.PutAll(al.events)
	}
	// Nothing is live or pending any more: the bookkeeping says so, so
	// that Check agrees with the zeroed statistics.
	m.live = make(map[uint64]*asyncAlloc)
	m.pending = nil
	if err := a.dev.Synchronize(); err != nil {
		errs = append(errs, err)
	}
	if err := m.dev.TrimPool(); err != nil {
		errs = append(errs, err)
	}
	return errs
}

func (m *asyncAllocator) check() error {
	a := m.a
	var errs []error
	var bytes, requested int64
	for _, al := range m.live {
		bytes += int64(al.size)
		requested += int64(al.requested)
	}
	if got := a.stats.AllocatedBytes[PoolAll].Current; got != bytes {
		errs = append(errs, fmt.Errorf("stat allocated_bytes is %d, live allocations add up to %d", got, bytes))
	}
	if got := a.stats.Allocation[PoolAll].Current; got != int64(len(m.live)) {
		errs = append(errs, fmt.Errorf("stat allocation is %d, %d live allocations", got, len(m.live)))
	}
	for _, al := range m.pending {
		bytes += int64(al.size)
		requested += int64(al.requested)
	}
	if got := a.stats.ActiveBytes[PoolAll].Current; got != bytes {
		errs = append(errs, fmt.Errorf("stat active_bytes is %d, live and pending allocations add up to %d", got, bytes))
	}
	if got := a.stats.RequestedBytes[PoolAll].Current; got != requested {
		errs = append(errs, fmt.Errorf("stat requested_bytes is %d, live and pending requests add up to %d", got, requested))
	}
	return errors.Join(errs...)
}
