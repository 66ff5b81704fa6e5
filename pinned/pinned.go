// Package pinned is allocd's caching allocator of page-locked (pinned) host
// memory, with the semantics of PyTorch's CachingHostAllocator (behind
// tensor.pin_memory() and torch.cuda.host_memory_stats()), and the copy
// helpers that move bytes between its buffers and device memory on a
// stream.
//
//	h, err := pinned.New(dev, pinned.DefaultConfig()) // dev: *cudart.CUDA or *simdev.Sim
//	buf, err := h.Alloc(n)
//	copy(buf.Bytes(), data)                            // fill it from Go
//	err = h.CopyToDevice(p, buf, stream)               // p from allocator.Malloc
//	err = h.Free(buf)                                  // reused once the copy is done
//
// # Policy
//
// A request rounds up to its size class: the next power of two, as PyTorch
// does (Config.RoundupDivisions splits each power-of-two interval into finer
// classes). A class's free blocks are kept in a last-in first-out list; a
// request takes one when there is one, and otherwise page-locks a new block of
// exactly the class size with cudaHostAlloc (portable and mapped). Blocks are
// never split or merged.
//
// A block is reused only after the work that used it is done. RecordStream
// (which the copy helpers call themselves) adds a stream to the block's set;
// Free records an event on each stream of the set and the block waits until
// every one of those events has completed. A block no stream used is free at
// once. When a request finds its class empty, pending events are queried and
// the blocks whose events have all completed return to their free lists,
// before any new memory is asked for. PyTorch queries events at every
// allocation, stopping at the first one not ready; allocd queries them only
// on a miss, all of them, so that a cached allocation makes no device call
// and one slow stream does not hold back blocks freed on others.
//
// When the system refuses new memory, the allocator waits for nothing: it
// returns its free blocks to the system and asks once more.
//
// A stream destroyed while a block still names it can take no event, but
// the work it queued may still run: Free then synchronises the device
// instead, and the block is free at once. A pending event whose query fails
// is handled the same way. Stats counts both.
//
// # Rules for callers
//
//   - The slice of Buffer.Bytes is valid from Alloc until Free. Do not keep
//     it, or any slice of it, past Free: the memory goes to the next Alloc
//     of its class, or back to the system (EmptyCache, Close), after which
//     touching it crashes the process.
//   - A Buffer and its bytes belong to one goroutine at a time. Handing
//     them to another needs synchronisation of the caller's own (a channel
//     send, a mutex), as for any Go slice. The Allocator itself is safe for
//     concurrent use.
//   - Work the caller queues on a stream with the buffer's memory, other
//     than through the copy helpers, must be declared with RecordStream
//     before Free; otherwise the memory may be handed out again while that
//     work still reads or writes it.
//   - A copy helper returns once the copy is queued. Do not write the
//     buffer while a copy from it is queued, and do not read it after a
//     copy into it before the stream has reached the copy
//     (StreamSynchronize, or an event of the caller's own).
//
// # Cost
//
// One mutex guards everything. A cached Alloc and the Free of a block no
// stream used allocate nothing on the Go heap, make no device call, read no
// clock and log nothing (BenchmarkCachedAllocFree shows it). Each is one
// uncontended Lock and Unlock around a few loads and stores: the free list
// pop or push and the statistics, peaks included; Free knows the block is
// its own by the block's owner pointer, which the allocator clears when the
// block goes back to the system. The two lock operations, atomic
// read-modify-writes, are most of the cost. A Free of a block used by
// streams checks each stream with the device and records one event on it;
// a miss queries the pending events;
// new memory is page-locked with the mutex released.
package pinned

import (
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/eventpool"
)

// Device is what the Allocator needs of a device: page-locked memory,
// async copies, events and a device-wide synchronisation. *cudart.CUDA and
// *simdev.Sim implement it. A Device that also implements
// cudart.StreamChecker (both do) has RecordStream's streams checked.
type Device interface {
	cudart.HostDevice
	// Info describes the device (its index labels the metrics).
	Info() cudart.Info
	// Synchronize waits for all work queued on the device, that of
	// destroyed streams included (cudaDeviceSynchronize).
	Synchronize() error
	// EventCreate creates an event with timing disabled.
	EventCreate() (cudart.Event, error)
	// EventRecord records e on s.
	EventRecord(e cudart.Event, s cudart.Stream) error
	// EventQuery reports whether e has completed, without blocking.
	EventQuery(e cudart.Event) (bool, error)
	// EventSynchronize blocks until e has completed.
	EventSynchronize(e cudart.Event) error
	// EventDestroy destroys e.
	EventDestroy(e cudart.Event) error
}

// Errors. Wrapped; test with errors.Is.
var (
	// ErrClosed: the allocator was used after Close.
	ErrClosed = errors.New("pinned allocator closed")
	// ErrInvalidBuffer: a Buffer not handed out by this allocator, or one
	// already freed (a stale copy of the Buffer value).
	ErrInvalidBuffer = errors.New("invalid pinned buffer")
	// ErrLiveBuffers: Close found buffers never freed (their memory was
	// returned to the system all the same).
	ErrLiveBuffers = errors.New("pinned buffers still allocated")
	// ErrTooLarge: a request above MaxSize. The error wraps
	// cudart.ErrOutOfMemory too: no system could page-lock it.
	ErrTooLarge = errors.New("pinned request too large")
	// ErrInvalidStream: RecordStream of a stream the device does not know
	// (never created, or destroyed). The error also wraps the device's.
	ErrInvalidStream = errors.New("invalid stream")
)

// MaxSize is the largest request Alloc accepts (4 EiB, so that every size
// class fits in 63 bits).
const MaxSize = 1 << 62

// DefaultFlags are the cudaHostAlloc flags of new blocks: portable (page-
// locked for every context) and mapped (addressable from the device).
const DefaultFlags = cudart.HostAllocPortable | cudart.HostAllocMapped

// Config is the allocator's configuration. Start from DefaultConfig or
// ParseConfig; the zero Config is DefaultConfig with no flags.
type Config struct {
	// RoundupDivisions splits each power-of-two interval [2^k, 2^(k+1))
	// into that many size classes: 1 (or 0) is PyTorch's next power of
	// two; 2, 4 or 8 round up to the next quarter, say. Must be 0 or a
	// power of two up to 64.
	RoundupDivisions int
	// Flags are passed to cudaHostAlloc (DefaultFlags in DefaultConfig).
	Flags cudart.HostAllocFlags
}

// DefaultConfig returns PyTorch's policy: power-of-two classes, blocks
// allocated portable and mapped.
func DefaultConfig() Config { return Config{RoundupDivisions: 1, Flags: DefaultFlags} }

// block is one cudaHostAlloc allocation. It is in exactly one state:
// allocated (handed out), pending (freed, events outstanding) or free (in
// its class's free list).
type block struct {
	// owner is the allocator holding the block, nil once the block went
	// back to the system (releaseFree, Close). Free and the copy helpers
	// compare it with their receiver instead of looking the block up; it
	// is atomic because a foreign Buffer's block is read under another
	// allocator's mutex than the one that writes it.
	owner     atomic.Pointer[Allocator]
	data      []byte // the whole allocation; len is the class size
	class     int
	gen       uint64 // bumped at every hand-out; Buffers carry it
	allocated bool
	requested int // bytes asked for by the current holder
	events    int // events outstanding (pending state)
	freeIdx   int // index in free[class], -1 when not free
	nstreams  int
	streams   [4]cudart.Stream // the first streams that used it; more in extra
	extra     []cudart.Stream
}

func (b *block) hasStream(s cudart.Stream) bool {
	n := min(b.nstreams, len(b.streams))
	for _, x := range b.streams[:n] {
		if x == s {
			return true
		}
	}
	for _, x := range b.extra {
		if x == s {
			return true
		}
	}
	return false
}

func (b *block) addStream(s cudart.Stream) {
	if b.hasStream(s) {
		return
	}
	if b.nstreams < len(b.streams) {
		b.streams[b.nstreams] = s
	} else {
		b.extra = append(b.extra, s)
	}
	b.nstreams++
}

func (b *block) clearStreams() {
	b.nstreams = 0
	b.extra = b.extra[:0]
}

// streamAt returns the i-th stream that used the block.
func (b *block) streamAt(i int) cudart.Stream {
	if i < len(b.streams) {
		return b.streams[i]
	}
	return b.extra[i-len(b.streams)]
}

// pendingEvent is an event recorded at Free on a stream that used blk.
type pendingEvent struct {
	ev  cudart.Event
	blk *block
}

// Buffer is one pinned allocation: a handle to pass back to Free and the
// copy helpers, and its bytes. It is a small value; copies of it name the
// same allocation, and all of them go stale at Free. The zero Buffer is the
// empty allocation (Alloc(0)).
type Buffer struct {
	data []byte
	blk  *block
	gen  uint64
}

// Bytes returns the buffer's memory: len and cap are the size asked of
// Alloc. Valid until Free; see the package's rules.
func (b Buffer) Bytes() []byte { return b.data }

// Len returns the size asked of Alloc.
func (b Buffer) Len() int { return len(b.data) }

// Allocator is a caching allocator of pinned host memory on one device
// (whose context page-locks the memory and whose streams and events order
// its reuse). It is safe for concurrent use.
type Allocator struct {
	dev   Device
	check cudart.StreamChecker // dev's, or nil
	cfg   Config

	mu      sync.Mutex
	closed  bool
	pow2    bool       // cfg.RoundupDivisions is 1: a class is a power of two
	free    [][]*block // by class
	stats   Stats
	blocks  map[*block]struct{} // every block held; owner == the allocator
	pending []pendingEvent
	idle    eventpool.Pool // created events not in use
	reset   bool           // ResetAccumulatedStats ran: totals no longer add up
}

// New returns an allocator over dev. cfg.RoundupDivisions must be 0 or a
// power of two up to 64; cfg.Flags must be cudaHostAlloc flags.
func New(dev Device, cfg Config) (*Allocator, error) {
	if dev == nil {
		return nil, fmt.Errorf("pinned: new: nil device: %w", cudart.ErrInvalidValue)
	}
	if cfg.RoundupDivisions == 0 {
		cfg.RoundupDivisions = 1
	}
	d := cfg.RoundupDivisions
	if d < 0 || d > 64 || d&(d-1) != 0 {
		return nil, &ConfigError{Key: keyDivisions, Value: fmt.Sprint(d), Accepted: "a power of two from 1 to 64"}
	}
	if cfg.Flags&^(cudart.HostAllocPortable|cudart.HostAllocMapped|cudart.HostAllocWriteCombined) != 0 {
		return nil, fmt.Errorf("pinned: new: unknown cudaHostAlloc flags %#x: %w", uint32(cfg.Flags), cudart.ErrInvalidValue)
	}
	check, _ := dev.(cudart.StreamChecker)
	return &Allocator{
		dev:    dev,
		check:  check,
		cfg:    cfg,
		pow2:   cfg.RoundupDivisions == 1,
		blocks: map[*block]struct{}{},
		free:   make([][]*block, 64*d),
	}, nil
}

// Config returns the allocator's configuration.
func (a *Allocator) Config() Config { return a.cfg }

// Device returns the device the allocator was made with.
func (a *Allocator) Device() Device { return a.dev }

// RoundSize returns the size class of a request of n bytes with divisions
// classes per power of two (0 or 1: the next power of two), and the class's
// index. n must be in [1, MaxSize]; any other n has no class, and
// RoundSize returns 0 and -1.
func RoundSize(n uint64, divisions int) (size uint64, class int) {
	if n == 0 || n > MaxSize {
		return 0, -1
	}
	if divisions < 1 {
		divisions = 1
	}
	e := bits.Len64(n) - 1
	p := uint64(1) << e
	d := uint64(divisions)
	if n == p {
		return n, e * divisions
	}
	step := max(p/d, 1)
	k := (n - p + step - 1) / step
	if p+k*step >= 2*p {
		return 2 * p, (e + 1) * divisions
	}
	return p + k*step, e*divisions + int(k)
}

// Alloc returns a buffer of n bytes. Alloc(0) returns the zero Buffer. A
// negative n is an error wrapping cudart.ErrInvalidValue. A request the
// system refuses after the cache was emptied, whatever its size, is an
// error wrapping cudart.ErrOutOfMemory; so is one above MaxSize (which
// wraps ErrTooLarge too). On error no buffer is handed out and no memory is
// held for it.
func (a *Allocator) Alloc(n int) (Buffer, error) {
	if n <= 0 || uint64(n) > MaxSize {
		return a.allocInvalid(n)
	}
	var class int
	if a.pow2 {
		class = bits.Len64(uint64(n) - 1) // RoundSize(n, 1)
	} else {
		_, class = RoundSize(uint64(n), a.cfg.RoundupDivisions)
	}
	a.mu.Lock()
	if l := a.free[class]; len(l) > 0 && !a.closed {
		// takeFree and handOut, by hand: this is the hot path.
		k := len(l) - 1
		b := l[k]
		l[k] = nil
		a.free[class] = l[:k]
		b.freeIdx = -1
		b.allocated = true
		b.requested = n
		b.gen++
		gen := b.gen
		data := b.data[:n:n]
		a.stats.Allocation.add(1)
		a.stats.AllocatedBytes.add(int64(len(b.data)))
		a.stats.RequestedBytes.add(int64(n))
		a.mu.Unlock()
		return Buffer{data: data, blk: b, gen: gen}, nil
	}
	return a.allocMiss(n, class)
}

// allocInvalid is Alloc of n <= 0 or above MaxSize.
func (a *Allocator) allocInvalid(n int) (Buffer, error) {
	switch {
	case n == 0:
		return Buffer{}, nil
	case n < 0:
		return Buffer{}, fmt.Errorf("pinned: alloc of %d bytes: %w", n, cudart.ErrInvalidValue)
	}
	return Buffer{}, fmt.Errorf("pinned: alloc of %d bytes: %w (%w)", n, ErrTooLarge, cudart.ErrOutOfMemory)
}

// allocMiss is Alloc when class's free list is empty (or the allocator
// closed); a.mu is held on entry and released on return.
func (a *Allocator) allocMiss(n, class int) (Buffer, error) {
	if a.closed {
		a.mu.Unlock()
		return Buffer{}, fmt.Errorf("pinned: alloc: %w", ErrClosed)
	}
	if len(a.pending) > 0 {
		if err := a.processEvents(); err != nil {
			a.mu.Unlock()
			return Buffer{}, err
		}
		if b := a.takeFree(class); b != nil {
			buf := a.handOut(b, n)
			a.mu.Unlock()
			return buf, nil
		}
	}
	a.mu.Unlock()
	return a.allocNew(n, class)
}

// allocNew is Alloc from a new block; a.mu is not held.
func (a *Allocator) allocNew(n, class int) (Buffer, error) {
	size, _ := RoundSize(uint64(n), a.cfg.RoundupDivisions)
	b, err := a.grow(size, class)
	a.mu.Lock()
	defer a.mu.Unlock()
	if err != nil {
		return Buffer{}, err
	}
	if a.closed { // Close ran meanwhile: give the memory back
		_ = a.dev.FreeHost(b.data)
		return Buffer{}, fmt.Errorf("pinned: alloc: %w", ErrClosed)
	}
	a.blocks[b] = struct{}{}
	b.owner.Store(a)
	a.stats.NumHostAlloc++
	a.stats.Segment.add(1)
	a.stats.ReservedBytes.add(int64(len(b.data)))
	return a.handOut(b, n), nil
}

// grow page-locks a new block of size bytes, with a.mu released. When the
// system refuses, the cached free blocks are returned and it is asked once
// more.
func (a *Allocator) grow(size uint64, class int) (*block, error) {
	data, err := a.hostAlloc(size)
	if errors.Is(err, cudart.ErrOutOfMemory) {
		if rerr := a.releaseFree(); rerr != nil {
			return nil, fmt.Errorf("pinned: alloc of %d bytes: %w (releasing the cache: %w)", size, err, rerr)
		}
		data, err = a.hostAlloc(size)
	}
	if err != nil {
		return nil, fmt.Errorf("pinned: alloc of %d bytes: %w", size, err)
	}
	return &block{data: data, class: class, freeIdx: -1}, nil
}

// hostAlloc is cudaHostAlloc with its timing recorded.
func (a *Allocator) hostAlloc(size uint64) ([]byte, error) {
	t0 := time.Now()
	data, err := a.dev.HostAlloc(size, a.cfg.Flags)
	if err != nil {
		return nil, err
	}
	us := time.Since(t0).Microseconds()
	a.mu.Lock()
	a.stats.HostAllocTime.add(us)
	a.mu.Unlock()
	return data, nil
}

// hostFree is cudaFreeHost with its timing recorded; a.mu must not be held.
func (a *Allocator) hostFree(data []byte) error {
	t0 := time.Now()
	if err := a.dev.FreeHost(data); err != nil {
		return err
	}
	us := time.Since(t0).Microseconds()
	a.mu.Lock()
	a.stats.HostFreeTime.add(us)
	a.stats.NumHostFree++
	a.mu.Unlock()
	return nil
}

// takeFree pops the most recently freed block of class, or nil.
func (a *Allocator) takeFree(class int) *block {
	l := a.free[class]
	if len(l) == 0 {
		return nil
	}
	b := l[len(l)-1]
	l[len(l)-1] = nil
	a.free[class] = l[:len(l)-1]
	b.freeIdx = -1
	return b
}

func (a *Allocator) pushFree(b *block) {
	l := &a.free[b.class]
	b.freeIdx = len(*l)
	*l = append(*l, b)
}

func (a *Allocator) handOut(b *block, n int) Buffer {
	b.allocated = true
	b.requested = n
	b.gen++
	a.stats.Allocation.add(1)
	a.stats.AllocatedBytes.add(int64(len(b.data)))
	a.stats.RequestedBytes.add(int64(n))
	return Buffer{data: b.data[:n:n], blk: b, gen: b.gen}
}

// lookup checks that buf is live in a; a.mu must be held.
func (a *Allocator) lookup(op string, buf Buffer) (*block, error) {
	if a.closed {
		return nil, fmt.Errorf("pinned: %s: %w", op, ErrClosed)
	}
	b := buf.blk
	if b == nil {
		return nil, fmt.Errorf("pinned: %s of the zero Buffer: %w", op, ErrInvalidBuffer)
	}
	if b.owner.Load() != a {
		return nil, fmt.Errorf("pinned: %s: the buffer is not from this allocator: %w", op, ErrInvalidBuffer)
	}
	if !b.allocated || b.gen != buf.gen {
		return nil, fmt.Errorf("pinned: %s: the buffer was already freed: %w", op, ErrInvalidBuffer)
	}
	return b, nil
}

// Free returns buf to the allocator. When streams used it (RecordStream,
// the copy helpers), an event is recorded on each and the memory is reused
// only after all of them have completed; otherwise at once. Freeing the
// zero Buffer does nothing. A stale or foreign Buffer gives
// ErrInvalidBuffer; if recording an event fails the buffer stays allocated,
// with its streams, and the error is returned.
//
// A stream the device no longer knows (destroyed after RecordStream or a
// copy) can take no event. Free then synchronises the device instead,
// which waits for the work that stream queued, and the buffer is free at
// once (Stats.DestroyedStreamSyncs counts these); only if that fails too
// does the buffer stay allocated.
func (a *Allocator) Free(buf Buffer) error {
	b := buf.blk
	if b == nil {
		if buf.data == nil {
			return nil
		}
		a.mu.Lock()
		return a.freeSlow(buf)
	}
	a.mu.Lock()
	// The checks of lookup, inline; freeSlow says which one failed.
	if a.closed || b.owner.Load() != a || !b.allocated || b.gen != buf.gen || b.nstreams > 0 {
		return a.freeSlow(buf)
	}
	b.allocated = false
	b.gen++
	a.stats.RequestedBytes.sub(int64(b.requested))
	b.requested = 0
	a.release(b)
	a.mu.Unlock()
	return nil
}

// freeSlow is Free of an invalid Buffer or of one that streams used; a.mu
// is held on entry and released on return.
func (a *Allocator) freeSlow(buf Buffer) error {
	defer a.mu.Unlock()
	b, err := a.lookup("free", buf)
	if err != nil {
		return err
	}
	if b.nstreams > 0 {
		if err := a.recordEvents(b); err != nil {
			return err
		}
	}
	b.allocated = false
	b.gen++
	a.stats.RequestedBytes.sub(int64(b.requested))
	b.requested = 0
	if b.events == 0 {
		a.release(b)
	}
	return nil
}

// recordEvents records one event per stream of b and queues them. On
// failure the events taken go back to the idle list and b is unchanged.
//
// A stream the device no longer knows (destroyed since RecordStream) can
// take no event, yet work it queued may still be running; each stream is
// checked (cudart.StreamChecker) before its event is recorded, and a failed
// record is checked again. For such a stream no event is kept: the device is synchronised, which waits for that work and for the
// other streams' too, and b has no events outstanding when this returns
// nil. If the synchronisation fails, its error is returned and b is
// unchanged.
func (a *Allocator) recordEvents(b *block) error {
	start := len(a.pending)
	rollback := func() {
		for _, p := range a.pending[start:] {
			a.idle.Put(p.ev)
		}
		clear(a.pending[start:])
		a.pending = a.pending[:start]
	}
	for i := 0; i < b.nstreams; i++ {
		s := b.streamAt(i)
		if a.check != nil {
			// Checked before recording: CUDA does not validate the handle
			// of a destroyed stream, and may reuse it for a new one.
			if cerr := a.check.CheckStream(s); errors.Is(cerr, cudart.ErrInvalidValue) {
				rollback()
				return a.syncForGoneStream(b, s, cerr)
			}
		}
		ev, err := a.event()
		if err == nil {
			if err = a.dev.EventRecord(ev, s); err != nil {
				a.idle.Put(ev)
				if a.streamGone(s, err) {
					rollback()
					return a.syncForGoneStream(b, s, err)
				}
				err = fmt.Errorf("pinned: free: recording an event on stream %#x: %w", uint64(s), err)
			}
		}
		if err != nil {
			rollback()
			return err
		}
		a.pending = append(a.pending, pendingEvent{ev: ev, blk: b})
	}
	b.events = b.nstreams
	b.clearStreams()
	return nil
}

// streamGone reports whether s, on which recording an event failed with
// err, is a stream the device does not know (any more): so its checker
// says, or, without one, the error is ErrInvalidValue. (With a checker,
// recordEvents asks it before recording already.)
func (a *Allocator) streamGone(s cudart.Stream, err error) bool {
	if a.check != nil {
		err = a.check.CheckStream(s)
	}
	return errors.Is(err, cudart.ErrInvalidValue)
}

// syncForGoneStream is Free of b when recording an event on its stream s
// failed with rerr because s was destroyed: the device is synchronised and
// b then needs no event.
func (a *Allocator) syncForGoneStream(b *block, s cudart.Stream, rerr error) error {
	if err := a.dev.Synchronize(); err != nil {
		return fmt.Errorf("pinned: free: stream %#x is gone (%w) and synchronising the device failed: %w", uint64(s), rerr, err)
	}
	a.stats.DestroyedStreamSyncs++
	b.events = 0
	b.clearStreams()
	return nil
}

// event returns an idle event or a new one.
func (a *Allocator) event() (cudart.Event, error) {
	ev, err := a.idle.Get(a.dev)
	if err != nil {
		return 0, fmt.Errorf("pinned: creating an event: %w", err)
	}
	return ev, nil
}

// release moves a block no longer in use, with no events outstanding, to
// its free list and out of the in-use statistics.
func (a *Allocator) release(b *block) {
	a.stats.Allocation.sub(1)
	a.stats.AllocatedBytes.sub(int64(len(b.data)))
	a.pushFree(b)
}

// processEvents queries every pending event; a block whose events have
// all completed goes to its free list.
//
// When a query fails, the event's state is unknown and the work it stands
// for may still run, so the device is synchronised: then that event and all
// those after it count as complete, and the failed one is destroyed rather
// than reused. If the synchronisation fails too, the events queried so far
// are processed, the failed one and the rest stay pending, and the error is
// returned.
func (a *Allocator) processEvents() error {
	kept := a.pending[:0]
	var qerr error
	synced := false
	for i, p := range a.pending {
		if qerr != nil {
			kept = append(kept, a.pending[i:]...)
			break
		}
		done, reuse := true, true
		if !synced {
			var err error
			done, err = a.dev.EventQuery(p.ev)
			if err != nil {
				if serr := a.dev.Synchronize(); serr != nil {
					qerr = fmt.Errorf("pinned: querying a stream event: %w (synchronising the device: %w)", err, serr)
					kept = append(kept, p)
					continue
				}
				a.stats.QueryFailureSyncs++
				synced, done, reuse = true, true, false
			}
		}
		if !done {
			kept = append(kept, p)
			continue
		}
		if reuse {
			a.idle.Put(p.ev)
		} else {
			_ = a.dev.EventDestroy(p.ev) // it failed already; it is not used again either way
		}
		p.blk.events--
		if p.blk.events == 0 {
			a.release(p.blk)
		}
	}
	clear(a.pending[len(kept):])
	a.pending = kept
	return qerr
}

// RecordStream declares that work queued on s uses buf's memory: Free will
// not let the memory be reused before that work is done (PyTorch's
// record_stream on a pinned tensor). Recording the same stream twice is one
// record.
//
// A stream the device does not know, never created or destroyed, is
// refused with an error wrapping ErrInvalidStream and the device's error,
// and buf is unchanged. The device checks the stream (its
// cudart.StreamChecker): a map lookup for the default streams and those
// made through cudart, a cudaStreamQuery for other handles. A stream
// destroyed after RecordStream does not keep the buffer from being freed:
// see Free.
func (a *Allocator) RecordStream(buf Buffer, s cudart.Stream) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	b, err := a.lookup("record stream", buf)
	if err != nil {
		return err
	}
	if a.check != nil {
		if err := a.check.CheckStream(s); err != nil {
			return fmt.Errorf("pinned: record stream %#x: %w: %w", uint64(s), ErrInvalidStream, err)
		}
	}
	b.addStream(s)
	return nil
}

// CopyToDevice queues a copy of buf's bytes to device memory at dst on
// stream s (cudaMemcpyAsync host to device) and records s on buf, so that
// Free keeps the memory until the copy has read it. dst needs Len bytes
// (from allocator.Malloc, say). Nothing is recorded when queuing fails.
func (a *Allocator) CopyToDevice(dst cudart.Ptr, buf Buffer, s cudart.Stream) error {
	return a.copyHelper("copy to device", buf, s, func() error { return a.dev.MemcpyHtoDAsync(dst, buf.data, s) })
}

// CopyFromDevice queues a copy of Len bytes from device memory at src into
// buf on stream s (cudaMemcpyAsync device to host) and records s on buf.
// The bytes are there once the stream has reached the copy: synchronise
// the stream (or an event recorded after the copy) before reading them.
func (a *Allocator) CopyFromDevice(buf Buffer, src cudart.Ptr, s cudart.Stream) error {
	return a.copyHelper("copy from device", buf, s, func() error { return a.dev.MemcpyDtoHAsync(buf.data, src, s) })
}

func (a *Allocator) copyHelper(op string, buf Buffer, s cudart.Stream, do func() error) error {
	if buf.blk == nil && buf.data == nil {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	b, err := a.lookup(op, buf)
	if err != nil {
		return err
	}
	if err := do(); err != nil {
		return fmt.Errorf("pinned: %s: %w", op, err)
	}
	b.addStream(s)
	return nil
}

// EmptyCache queries the pending events, then returns every free block to
// the system (cudaFreeHost), as torch._C._host_emptyCache() does. Blocks in
// use, or waiting for events, stay. On error the blocks not yet returned
// stay cached.
func (a *Allocator) EmptyCache() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return fmt.Errorf("pinned: empty cache: %w", ErrClosed)
	}
	err := a.processEvents()
	a.mu.Unlock()
	if rerr := a.releaseFree(); rerr != nil {
		return errors.Join(err, rerr)
	}
	return err
}

// releaseFree returns every free block to the system, one cudaFreeHost at
// a time with a.mu released. A block whose cudaFreeHost fails goes back to
// its free list.
func (a *Allocator) releaseFree() error {
	a.mu.Lock()
	var out []*block
	for c := range a.free {
		for _, b := range a.free[c] {
			b.freeIdx = -1
			delete(a.blocks, b)
			b.owner.Store(nil)
			a.stats.Segment.sub(1)
			a.stats.ReservedBytes.sub(int64(len(b.data)))
			out = append(out, b)
		}
		clear(a.free[c])
		a.free[c] = a.free[c][:0]
	}
	a.mu.Unlock()
	var errs []error
	for _, b := range out {
		if err := a.hostFree(b.data); err != nil {
			errs = append(errs, fmt.Errorf("pinned: free host of %d bytes: %w", len(b.data), err))
			a.mu.Lock()
			if !a.closed { // after Close the block is lost; the error says so
				a.blocks[b] = struct{}{}
				b.owner.Store(a)
				a.stats.Segment.add(1)
				a.stats.ReservedBytes.add(int64(len(b.data)))
				a.pushFree(b)
			}
			a.mu.Unlock()
		}
	}
	return errors.Join(errs...)
}

// Close waits for every pending event, returns every block to the system,
// those still handed out included, and destroys the events. Buffers still
// live are reported in an error wrapping ErrLiveBuffers: their slices now
// point to freed memory and must not be touched. The allocator is unusable
// afterwards (ErrClosed); a second Close returns ErrClosed.
func (a *Allocator) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return fmt.Errorf("pinned: close: %w", ErrClosed)
	}
	a.closed = true
	var errs []error
	for _, p := range a.pending {
		if err := a.dev.EventSynchronize(p.ev); err != nil {
			errs = append(errs, fmt.Errorf("pinned: close: waiting for an event: %w", err))
		}
		a.idle.Put(p.ev)
	}
	clear(a.pending)
	a.pending = nil
	live, liveBytes := 0, 0
	for b := range a.blocks {
		if b.allocated {
			live++
			liveBytes += b.requested
		}
		t0 := time.Now()
		if err := a.dev.FreeHost(b.data); err != nil {
			errs = append(errs, fmt.Errorf("pinned: close: free host of %d bytes: %w", len(b.data), err))
		} else {
			a.stats.HostFreeTime.add(time.Since(t0).Microseconds())
			a.stats.NumHostFree++
		}
		b.allocated, b.freeIdx, b.events = false, -1, 0
		b.gen++
		b.owner.Store(nil)
	}
	clear(a.blocks)
	for c := range a.free {
		a.free[c] = nil
	}
	for _, err := range a.idle.Destroy(a.dev) {
		errs = append(errs, fmt.Errorf("pinned: close: destroying an event: %w", err))
	}
	st := &a.stats
	st.Allocation.sub(st.Allocation.Current)
	st.AllocatedBytes.sub(st.AllocatedBytes.Current)
	st.RequestedBytes.sub(st.RequestedBytes.Current)
	st.Segment.sub(st.Segment.Current)
	st.ReservedBytes.sub(st.ReservedBytes.Current)
	if live > 0 {
		errs = append(errs, fmt.Errorf("pinned: close: %d buffers (%d bytes) were never freed: %w", live, liveBytes, ErrLiveBuffers))
	}
	return errors.Join(errs...)
}
