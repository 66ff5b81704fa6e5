package allocator

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"slices"

	"go.uber.org/zap"

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
// The set of devices is fixed at NewDevices; Devices is safe for
// concurrent use. The hot path is the allocator itself: take it once with
// ForDevice and call Malloc and Free on it. Devices.Free and FreeOn are for
// callers that lost track of the device, or want a foreign pointer
// reported as such.
type Devices struct {
	allocs  []*Allocator // ascending device index
	indexes []int        // parallel to allocs
	ranges  []addrRange  // parallel to allocs
}

// addrRange is a device's address range (cudart.AddressRanger); ok is
// false for a device that reports none (a CUDA device: its addresses are
// unique in the process, but not known in advance).
type addrRange struct {
	lo, hi cudart.Ptr
	ok     bool
}

func (r addrRange) holds(p cudart.Ptr) bool { return r.ok && p >= r.lo && p < r.hi }

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
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	d := &Devices{allocs: make([]*Allocator, 0, len(entries)), indexes: make([]int, 0, len(entries))}
	for _, e := range entries {
		aopts := opts
		if o.log != nil {
			aopts = append(slices.Clip(opts), WithLogger(o.log.With(zap.Int("gpu", e.index))))
		}
		a, err := New(e.dev, cfg, aopts...)
		if err != nil {
			errs := []error{fmt.Errorf("allocator: device %d: %w", e.index, err)}
			if cerr := d.Close(); cerr != nil {
				errs = append(errs, fmt.Errorf("allocator: closing the allocators already created: %w", cerr))
			}
			return nil, errors.Join(errs...)
		}
		d.allocs = append(d.allocs, a)
		d.indexes = append(d.indexes, e.index)
		var r addrRange
		if ar, ok := e.dev.(cudart.AddressRanger); ok {
			r.lo, r.hi = ar.AddressRange()
			r.ok = r.lo < r.hi
		}
		d.ranges = append(d.ranges, r)
	}
	return d, nil
}

// Len returns the number of devices.
func (d *Devices) Len() int { return len(d.allocs) }

// All returns the allocators in ascending device index. The slice is a
// copy; the allocators are shared.
func (d *Devices) All() []*Allocator { return slices.Clone(d.allocs) }

// Indexes returns the device indexes, ascending.
func (d *Devices) Indexes() []int { return slices.Clone(d.indexes) }

// ForDevice returns the allocator of device index i (cudart.Info.Index),
// or an error wrapping ErrNoSuchDevice that lists the indexes held.
func (d *Devices) ForDevice(i int) (*Allocator, error) {
	if a := d.lookup(i); a != nil {
		return a, nil
	}
	return nil, fmt.Errorf("allocator: device %d: %w (devices held: %v)", i, ErrNoSuchDevice, d.indexes)
}

func (d *Devices) lookup(i int) *Allocator {
	for j, idx := range d.indexes {
		if idx == i {
			return d.allocs[j]
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
	if pos, live := d.owner(p, -1); live {
		return d.indexes[pos], true
	}
	return 0, false
}

// rangeOwner returns the position of the device whose address range holds
// p, or -1.
func (d *Devices) rangeOwner(p cudart.Ptr) int {
	for j, r := range d.ranges {
		if r.holds(p) {
			return j
		}
	}
	return -1
}

// owner finds the allocator that holds p, leaving out the one at position
// skip (-1: none): one where p is live first, else one with a segment
// containing p. When a device's address range holds p, only that device
// is asked; otherwise only the devices without a range are. It returns the
// position in allocs, or -1.
func (d *Devices) owner(p cudart.Ptr, skip int) (pos int, live bool) {
	if j := d.rangeOwner(p); j >= 0 {
		if j == skip {
			return -1, false
		}
		switch d.allocs[j].holds(p) {
		case holdLive:
			return j, true
		case holdSegment:
			return j, false
		}
		return -1, false
	}
	pos = -1
	for j, a := range d.allocs {
		if j == skip || d.ranges[j].ok {
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
func (d *Devices) Free(p cudart.Ptr) error {
	if p == 0 {
		return nil
	}
	pos, _ := d.owner(p, -1)
	if pos < 0 {
		return fmt.Errorf("allocator: free of %#x: %w (no allocator of devices %v holds it)", uint64(p), ErrUnknownPointer, d.indexes)
	}
	if err := d.allocs[pos].Free(p); err != nil {
		return fmt.Errorf("allocator: device %d: %w", d.indexes[pos], err)
	}
	return nil
}

// FreeOn frees p on device i's allocator. A pointer that another device's
// allocator handed out is refused with a *WrongDeviceError (errors.Is
// ErrWrongDevice and ErrUnknownPointer) that names its owner, and neither
// allocator changes; device i's other errors are returned as they are.
// An index not held wraps ErrNoSuchDevice. FreeOn(i, 0) is a no-op.
func (d *Devices) FreeOn(i int, p cudart.Ptr) error {
	self := slices.Index(d.indexes, i)
	if self < 0 {
		_, err := d.ForDevice(i)
		return err
	}
	err := d.allocs[self].Free(p)
	if err == nil || !errors.Is(err, ErrUnknownPointer) || len(d.allocs) == 1 {
		return err
	}
	if pos, live := d.owner(p, self); pos >= 0 {
		return &WrongDeviceError{Op: "free", Ptr: p, Device: i, Owner: d.indexes[pos], Live: live, Err: err}
	}
	return err
}

// EmptyCache empties every allocator's cache (Allocator.EmptyCache). It
// goes on past a failure and returns every error, each naming its device.
func (d *Devices) EmptyCache() error {
	var errs []error
	for j, a := range d.allocs {
		if err := a.EmptyCache(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: device %d: %w", d.indexes[j], err))
		}
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
	snaps := make([]*snapshot.Snapshot, len(d.allocs))
	for i, a := range d.allocs {
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
// them. The devices themselves are closed only when OpenDevices opened
// them.
func (d *Devices) Close() error {
	var errs []error
	for j, a := range d.allocs {
		if err := a.Close(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: device %d: %w", d.indexes[j], err))
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
	for _, s := range a.segments {
		if uint64(p) >= s.Ptr && uint64(p)-s.Ptr < s.Size {
			return holdSegment
		}
	}
	return holdNone
}
