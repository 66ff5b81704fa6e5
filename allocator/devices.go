package allocator

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/snapshot"
)

// Errors of Devices; test with errors.Is.
var (
	// ErrNoSuchDevice: a device index the Devices handle does not hold.
	ErrNoSuchDevice = errors.New("no such device")
	// ErrWrongDevice: a pointer freed through the allocator of a device
	// other than the one that handed it out. The error is a
	// *WrongDeviceError, which names the owner; errors.Is(err,
	// ErrUnknownPointer) holds too, since the device asked never handed
	// the pointer out.
	ErrWrongDevice = errors.New("pointer belongs to another device")
	// ErrDuplicateDevice: NewDevices was given two devices with the same
	// index.
	ErrDuplicateDevice = errors.New("duplicate device index")
)

// WrongDeviceError reports a pointer presented to the allocator of one
// device that another device's allocator handed out. Neither allocator is
// changed by the failed call.
type WrongDeviceError struct {
	// Op is the operation refused, e.g. "free".
	Op string
	// Ptr is the pointer.
	Ptr cudart.Ptr
	// Device is the index of the device asked.
	Device int
	// Owner is the index of the device whose allocator holds Ptr: as a
	// live allocation, or (when Live is false) inside one of its segments.
	Owner int
	// Live reports whether Ptr is a live allocation on Owner; false means
	// it lies in Owner's memory but is not allocated there now (a free of
	// it on Owner would be a double free or an unknown pointer).
	Live bool
	// Err is the asked allocator's own error; it wraps ErrUnknownPointer.
	Err error
}

// Error says which device owns the pointer and which was asked.
func (e *WrongDeviceError) Error() string {
	what := "belongs to"
	if !e.Live {
		what = "lies in memory of"
	}
	return fmt.Sprintf("allocator: %s on device %d: pointer %#x %s device %d, not device %d",
		e.Op, e.Device, uint64(e.Ptr), what, e.Owner, e.Device)
}

// Is makes errors.Is(err, ErrWrongDevice) hold.
func (e *WrongDeviceError) Is(target error) bool { return target == ErrWrongDevice }

// Unwrap returns the asked allocator's error, so that errors.Is(err,
// ErrUnknownPointer) holds.
func (e *WrongDeviceError) Unwrap() error { return e.Err }

// Devices is one Allocator per device behind one handle, for a process
// that uses several GPUs (PyTorch keeps one DeviceCachingAllocator per
// device the same way). Each allocator has its own pools, statistics and
// lock, and is labelled by its device's Info().Index; nothing is shared
// between them, so a Malloc on one device never waits for another.
//
// The set of devices is either fixed at NewDevices, or grows: a Devices
// from NewLazyDevices creates a device's allocator at its first ForDevice
// (or MallocOn), as PyTorch creates a device's pool at its first
// allocation. Len, All, Indexes and the methods over every device cover
// the allocators created so far. Devices is safe for concurrent use.
//
// The hot path is the allocator itself: take it once with ForDevice and
// call Malloc and Free on it. Devices.Free and FreeOn are for callers that
// lost track of the device, or want a foreign pointer reported as such.
type Devices struct {
	view atomic.Pointer[devView] // the allocators created so far; replaced, never changed

	// Lazy creation (NewLazyDevices); open is nil for a fixed set.
	open func(index int) (cudart.Device, error)
	n    int // device indexes 0..n-1 may be created
	cfg  Config
	opts []Option
	log  *zap.Logger

	mu      sync.Mutex     // serialises creation, RecordHistory and Close
	history HistoryOptions // applied to every allocator created; guarded by mu
	closed  bool           // guarded by mu

	broker *broker.Client // OpenDevices' connection to the broker, closed by Close
}

// devView is the allocators of a Devices at one moment, in ascending
// device index: readers load it once and see one consistent set.
type devView struct {
	allocs  []*Allocator
	indexes []int       // parallel to allocs
	ranges  []addrRange // parallel to allocs
}

// addrRange is a device's address range (cudart.AddressRanger); ok is
// false for a device that reports none (a CUDA device: its addresses are
// unique in the process, but not known in advance).
type addrRange struct {
	lo, hi cudart.Ptr
	ok     bool
}

func (r addrRange) holds(p cudart.Ptr) bool { return r.ok && p >= r.lo && p < r.hi }

func rangeOf(dev cudart.Device) addrRange {
	var r addrRange
	if ar, ok := dev.(cudart.AddressRanger); ok {
		r.lo, r.hi = ar.AddressRange()
		r.ok = r.lo < r.hi
	}
	return r
}

// NewDevices returns an allocator for each of devs, all with the same
// configuration and options. The devices must be non-nil and have
// distinct indexes (ErrDuplicateDevice); they need not be in order, and
// Devices lists them by ascending index. With WithLogger, each
// allocator's lines carry a "gpu" field with its device index.
//
// If an allocator cannot be created, those already created are closed
// and the error names the device. A Devices from NewDevices never closes
// the devices themselves.
func NewDevices(devs []cudart.Device, cfg Config, opts ...Option) (*Devices, error) {
	if len(devs) == 0 {
		return nil, fmt.Errorf("allocator: NewDevices needs at least one device: %w", cudart.ErrInvalidValue)
	}
	type entry struct {
		dev   cudart.Device
		index int
		pos   int
	}
	entries := make([]entry, len(devs))
	for i, dev := range devs {
		if dev == nil {
			return nil, fmt.Errorf("allocator: device %d of %d given to NewDevices is nil: %w", i+1, len(devs), cudart.ErrInvalidValue)
		}
		entries[i] = entry{dev: dev, index: dev.Info().Index, pos: i}
	}
	slices.SortStableFunc(entries, func(a, b entry) int { return cmp.Compare(a.index, b.index) })
	for i := 1; i < len(entries); i++ {
		if a, b := entries[i-1], entries[i]; a.index == b.index {
			return nil, fmt.Errorf("allocator: devices %d and %d given to NewDevices both have index %d: %w",
				a.pos+1, b.pos+1, a.index, ErrDuplicateDevice)
		}
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	d := &Devices{}
	v := &devView{allocs: make([]*Allocator, 0, len(entries)), indexes: make([]int, 0, len(entries))}
	d.view.Store(v)
	for _, e := range entries {
		a, err := New(e.dev, cfg, deviceOpts(opts, e.index)...)
		if err != nil {
			errs := []error{fmt.Errorf("allocator: device %d: %w", e.index, err)}
			if cerr := d.Close(); cerr != nil {
				errs = append(errs, fmt.Errorf("allocator: closing the allocators already created: %w", cerr))
			}
			return nil, errors.Join(errs...)
		}
		v.allocs = append(v.allocs, a)
		v.indexes = append(v.indexes, e.index)
		v.ranges = append(v.ranges, rangeOf(e.dev))
	}
	return d, nil
}

// deviceOpts returns opts with, when they set a logger, that logger
// labelled with the device index ("gpu").
func deviceOpts(opts []Option, index int) []Option {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.log == nil {
		return opts
	}
	return append(slices.Clip(opts), WithLogger(o.log.With(zap.Int("gpu", index))))
}

// NewLazyDevices returns a Devices over device indexes 0 to n-1 that
// creates a device's allocator at its first use (ForDevice, MallocOn),
// for a process that must not touch a device it never allocates on
// (opening a CUDA device creates its context). Creating device i calls
// open(i), once, under a lock: its device must report Info().Index i,
// and the allocator owns it (Close closes it). A failed open or New is
// returned to that caller, and the next use tries again. Each allocator
// gets cfg and opts as NewDevices gives them, the history options of
// the last RecordHistory, and is logged at Info with its configuration.
// n must be 1 or more and open non-nil.
func NewLazyDevices(n int, open func(index int) (cudart.Device, error), cfg Config, opts ...Option) (*Devices, error) {
	if n < 1 || open == nil {
		return nil, fmt.Errorf("allocator: NewLazyDevices needs 1 or more devices and an open function (got %d): %w", n, cudart.ErrInvalidValue)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	d := &Devices{open: open, n: n, cfg: cfg, opts: slices.Clone(opts), log: o.log}
	d.view.Store(&devView{})
	return d, nil
}

// create opens device i and creates its allocator (NewLazyDevices).
func (d *Devices) create(i int) (*Allocator, error) {
	if i < 0 || i >= d.n {
		return nil, fmt.Errorf("allocator: device %d: %w (device indexes 0 to %d)", i, ErrNoSuchDevice, d.n-1)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, fmt.Errorf("allocator: device %d: %w", i, ErrClosed)
	}
	if a := d.lookup(i); a != nil {
		return a, nil
	}
	dev, err := d.open(i)
	if err != nil {
		return nil, fmt.Errorf("allocator: open device %d: %w", i, err)
	}
	if got := dev.Info().Index; got != i {
		return nil, errors.Join(fmt.Errorf("allocator: device %d: opened a device with index %d: %w", i, got, cudart.ErrInvalidValue), dev.Close())
	}
	a, err := New(dev, d.cfg, deviceOpts(d.opts, i)...)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("allocator: device %d: %w", i, err), dev.Close())
	}
	a.ownsDevice = true
	if err := a.RecordHistory(d.history); err != nil {
		return nil, errors.Join(fmt.Errorf("allocator: device %d: %w", i, err), a.Close())
	}
	old := d.view.Load()
	pos, _ := slices.BinarySearch(old.indexes, i)
	d.view.Store(&devView{
		allocs:  slices.Insert(slices.Clone(old.allocs), pos, a),
		indexes: slices.Insert(slices.Clone(old.indexes), pos, i),
		ranges:  slices.Insert(slices.Clone(old.ranges), pos, rangeOf(dev)),
	})
	if d.log != nil {
		conf := d.cfg.String()
		if conf == "" {
			conf = "defaults"
		}
		d.log.Info("device allocator created", zap.Int("gpu", i), zap.String("conf", conf))
	}
	return a, nil
}

// Len returns the number of devices (of a lazy Devices: whose allocators
// have been created).
func (d *Devices) Len() int { return len(d.view.Load().allocs) }

// All returns the allocators in ascending device index (of a lazy
// Devices: those created so far). The slice is a copy; the allocators are
// shared.
func (d *Devices) All() []*Allocator { return slices.Clone(d.view.Load().allocs) }

// Indexes returns the device indexes, ascending (of a lazy Devices: those
// whose allocators have been created).
func (d *Devices) Indexes() []int { return slices.Clone(d.view.Load().indexes) }

// ForDevice returns the allocator of device index i (cudart.Info.Index),
// creating it first in a lazy Devices (NewLazyDevices), or an error
// wrapping ErrNoSuchDevice that lists the indexes held.
func (d *Devices) ForDevice(i int) (*Allocator, error) {
	if a := d.lookup(i); a != nil {
		return a, nil
	}
	if d.open != nil {
		return d.create(i)
	}
	return nil, fmt.Errorf("allocator: device %d: %w (devices held: %v)", i, ErrNoSuchDevice, d.view.Load().indexes)
}

// Created returns the allocator of device index i if it exists, without
// creating it: for a reader (statistics, a query) that must not open a
// device.
func (d *Devices) Created(i int) (*Allocator, bool) {
	a := d.lookup(i)
	return a, a != nil
}

// lookup returns device i's allocator, or nil: one load, and a scan only
// when the devices held are not 0, 1, … in order.
func (d *Devices) lookup(i int) *Allocator {
	v := d.view.Load()
	if i >= 0 && i < len(v.indexes) && v.indexes[i] == i {
		return v.allocs[i]
	}
	for j, idx := range v.indexes {
		if idx == i {
			return v.allocs[j]
		}
	}
	return nil
}

// MallocOn is ForDevice(i) followed by Malloc(size, stream); stream must
// be a stream of device i.
func (d *Devices) MallocOn(i int, size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	a, err := d.ForDevice(i)
	if err != nil {
		return 0, err
	}
	return a.Malloc(size, stream)
}

// Owner returns the index of the device whose allocator holds p as a live
// allocation (Malloc returned it and it has not been freed), and false
// when none does. Only the device whose address range holds p is asked
// (cudart.AddressRanger), or every device without a range.
func (d *Devices) Owner(p cudart.Ptr) (int, bool) {
	v := d.view.Load()
	if pos, live := v.owner(p, -1); live {
		return v.indexes[pos], true
	}
	return 0, false
}

// rangeOwner returns the position of the device whose address range holds
// p, or -1.
func (v *devView) rangeOwner(p cudart.Ptr) int {
	for j, r := range v.ranges {
		if r.holds(p) {
			return j
		}
	}
	return -1
}

// soleCandidate returns the position of the only device that can hold p:
// the one whose address range holds p, else the one device without a
// range if there is exactly one; -1 when several could.
func (v *devView) soleCandidate(p cudart.Ptr) int {
	if j := v.rangeOwner(p); j >= 0 {
		return j
	}
	pos := -1
	for j, r := range v.ranges {
		if !r.ok {
			if pos >= 0 {
				return -1
			}
			pos = j
		}
	}
	return pos
}

// owner finds the allocator that holds p, leaving out the one at position
// skip (-1: none): one where p is live first, else one with a segment
// containing p. When a device's address range holds p, only that device
// is asked; otherwise only the devices without a range are. It returns the
// position in allocs, or -1.
func (v *devView) owner(p cudart.Ptr, skip int) (pos int, live bool) {
	if j := v.rangeOwner(p); j >= 0 {
		if j == skip {
			return -1, false
		}
		switch v.allocs[j].holds(p) {
		case holdLive:
			return j, true
		case holdSegment:
			return j, false
		}
		return -1, false
	}
	pos = -1
	for j, a := range v.allocs {
		if j == skip || v.ranges[j].ok {
			continue
		}
		switch a.holds(p) {
		case holdLive:
			return j, true
		case holdSegment:
			if pos < 0 {
				pos = j
			}
		}
	}
	return pos, false
}

// Free frees p on the device whose allocator handed it out, for a caller
// that no longer knows which one did. The device whose address range holds
// p (cudart.AddressRanger: every Sim has its own) is the only one that can
// own it, so it alone frees p, and one device's pointer never frees
// another's block; devices without a range are each asked in turn. A
// caller that knows the device should use its allocator (or FreeOn). A
// pointer no allocator holds gets an error wrapping ErrUnknownPointer (or
// ErrDoubleFree, when p lies in a device's segment and is already free
// there), and changes nothing. Free(0) is a no-op.
//
// When only one device can own p (its range holds p, or it is the one
// device without a range and no range holds p: one GPU), its Free alone
// decides, with no world lock: this is the free of a caller that keeps no
// map of its pointers (allocd_torch's), on its hot path.
func (d *Devices) Free(p cudart.Ptr) error {
	if p == 0 {
		return nil
	}
	v := d.view.Load()
	if j := v.soleCandidate(p); j >= 0 {
		err := v.allocs[j].Free(p)
		if err == nil {
			return nil
		}
		if !errors.Is(err, ErrClosed) { // a closed allocator holds nothing: below, ErrUnknownPointer
			return fmt.Errorf("allocator: device %d: %w", v.indexes[j], err)
		}
	}
	pos, _ := v.owner(p, -1)
	if pos < 0 {
		return fmt.Errorf("allocator: free of %#x: %w (no allocator of devices %v holds it)", uint64(p), ErrUnknownPointer, v.indexes)
	}
	if err := v.allocs[pos].Free(p); err != nil {
		return fmt.Errorf("allocator: device %d: %w", v.indexes[pos], err)
	}
	return nil
}

// FreeOn frees p on device i's allocator. A pointer that another device's
// allocator handed out is refused with a *WrongDeviceError (errors.Is
// ErrWrongDevice and ErrUnknownPointer) that names its owner, and neither
// allocator changes; device i's other errors are returned as they are.
// An index not held wraps ErrNoSuchDevice; in a lazy Devices, a device
// whose allocator is not created yet has handed out nothing, so a free
// there is an unknown pointer (or another device's). FreeOn(i, 0) is a
// no-op.
func (d *Devices) FreeOn(i int, p cudart.Ptr) error {
	v := d.view.Load()
	self := slices.Index(v.indexes, i)
	var err error
	switch {
	case self >= 0:
		err = v.allocs[self].Free(p)
	case d.open != nil && i >= 0 && i < d.n:
		if p == 0 {
			return nil
		}
		err = fmt.Errorf("allocator: free of %#x on device %d, which has allocated nothing: %w", uint64(p), i, ErrUnknownPointer)
	default:
		_, err := d.ForDevice(i)
		return err
	}
	if err == nil || !errors.Is(err, ErrUnknownPointer) || len(v.allocs) == 1 && self >= 0 {
		return err
	}
	if pos, live := v.owner(p, self); pos >= 0 {
		return &WrongDeviceError{Op: "free", Ptr: p, Device: i, Owner: v.indexes[pos], Live: live, Err: err}
	}
	return err
}

// EmptyCache empties every allocator's cache (Allocator.EmptyCache). It
// goes on past a failure and returns every error, each naming its device.
func (d *Devices) EmptyCache() error {
	v := d.view.Load()
	var errs []error
	for j, a := range v.allocs {
		if err := a.EmptyCache(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: device %d: %w", v.indexes[j], err))
		}
	}
	return errors.Join(errs...)
}

// RecordHistory sets every allocator's history recording
// (Allocator.RecordHistory): those created so far and, in a lazy
// Devices, those created later, as PyTorch's _record_memory_history
// covers every device. Each allocator starts an empty history. Options
// out of range are refused with an error wrapping ErrHistory and change
// nothing; an allocator's other error (a closed one) names its device,
// and a lazy Devices keeps opt for later devices only when every
// allocator took it.
func (d *Devices) RecordHistory(opt HistoryOptions) error {
	if err := opt.validate(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	v := d.view.Load()
	var errs []error
	for j, a := range v.allocs {
		if err := a.RecordHistory(opt); err != nil {
			errs = append(errs, fmt.Errorf("allocator: device %d: %w", v.indexes[j], err))
		}
	}
	if len(errs) == 0 {
		d.history = opt
	}
	return errors.Join(errs...)
}

// Snapshot returns one snapshot of every device, as
// torch.cuda.memory._snapshot() covers them all: the segments of each
// device in ascending index (each segment names its device), and
// DeviceTraces indexed by device index, each device's history at its
// index (snapshot.Merge of each allocator's Snapshot). Each device's part is
// consistent as of one moment; the devices are not stopped together.
func (d *Devices) Snapshot() *snapshot.Snapshot {
	v := d.view.Load()
	snaps := make([]*snapshot.Snapshot, len(v.allocs))
	for i, a := range v.allocs {
		snaps[i] = a.Snapshot()
	}
	return snapshot.Merge(snaps...)
}

// WriteSnapshot writes Snapshot() to w as PyTorch's snapshot pickle
// (snapshot.WritePickle), which memory_viz opens.
func (d *Devices) WriteSnapshot(w io.Writer) error {
	if err := snapshot.WritePickle(w, d.Snapshot()); err != nil {
		return fmt.Errorf("allocator: writing a snapshot: %w", err)
	}
	return nil
}

// Close closes every allocator (Allocator.Close: every segment goes back
// to its device) and returns their errors joined, each naming its device;
// errors.Is(err, ErrLiveBlocks) reports blocks never freed on any of
// them. The devices themselves are closed only when OpenDevices or a lazy
// Devices opened them. A lazy Devices creates no allocator after Close.
func (d *Devices) Close() error {
	d.mu.Lock()
	d.closed = true
	d.mu.Unlock()
	v := d.view.Load()
	var errs []error
	for j, a := range v.allocs {
		if err := a.Close(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: device %d: %w", v.indexes[j], err))
		}
	}
	if d.broker != nil {
		if err := d.broker.Close(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: closing the broker connection: %w", err))
		}
	}
	return errors.Join(errs...)
}

// holding is how an allocator relates to an address.
type holding uint8

const (
	holdNone    holding = iota // not in its memory
	holdSegment                // inside one of its segments, not a live allocation
	holdLive                   // a live allocation it handed out
)

// holds reports how a relates to p, under its lock. A closed allocator
// holds nothing.
func (a *Allocator) holds(p cudart.Ptr) holding {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return holdNone
	}
	return a.be.holds(p)
}

// holds is the native policy's part of Allocator.holds.
func (n native) holds(p cudart.Ptr) holding {
	a := n.a
	if a.activeBlock(uint64(p)) != nil {
		return holdLive
	}
	for _, s := range a.segs.list {
		if uint64(p) >= s.Ptr && uint64(p)-s.Ptr < s.Size {
			return holdSegment
		}
	}
	return holdNone
}
