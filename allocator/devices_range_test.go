package allocator

import (
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestDevicesFreeRoutesByRange: Devices.Free frees a pointer on the device
// whose address range holds it, so one device's pointer never frees
// another's block, even after device 0 has handed out more than 1 TiB of
// addresses; a pointer in no device's range, or in a range whose device
// does not hold it, is an unknown pointer and changes nothing.
func TestDevicesFreeRoutesByRange(t *testing.T) {
	d, _ := newTestDevices(t, 2<<40, "", 0, 1)
	a0, a1 := mustFor(t, d, 0), mustFor(t, d, 1)
	big := mustMalloc(t, a0, 1<<40, 0) // a TiB of device 0's addresses
	p0 := mustMalloc(t, a0, 2*miB, 0)
	p1 := mustMalloc(t, a1, 2*miB, 0)
	if p0 == p1 {
		t.Fatalf("devices 0 and 1 both handed out %#x", uint64(p0))
	}
	if err := d.Free(p1); err != nil {
		t.Fatalf("Free of device 1's pointer: %v", err)
	}
	if got := uint64(a0.MemoryAllocated()); got != 1<<40+2*miB {
		t.Errorf("device 0 holds %d bytes after device 1's free, want %d", got, 1<<40+2*miB)
	}
	if got := a1.MemoryAllocated(); got != 0 {
		t.Errorf("device 1 holds %d bytes after its pointer's free, want 0", got)
	}
	for _, p := range []cudart.Ptr{p0, big} {
		if err := d.Free(p); err != nil {
			t.Fatalf("Free of device 0's pointer %#x: %v", uint64(p), err)
		}
	}
	lo1, hi1, err := simdev.Range(1)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []cudart.Ptr{0x1000, hi1, lo1 + 0x1000000000, ^cudart.Ptr(0) &^ 511} {
		before0, before1 := a0.Stats(), a1.Stats()
		if err := d.Free(p); !errors.Is(err, ErrUnknownPointer) {
			t.Errorf("Free(%#x) = %v, want an error wrapping ErrUnknownPointer", uint64(p), err)
		}
		if a0.Stats() != before0 || a1.Stats() != before1 {
			t.Errorf("Free(%#x) of an unknown pointer changed the statistics", uint64(p))
		}
	}
	// FreeOn of a pointer in another device's range names the owner and
	// leaves both allocators as they were.
	q1 := mustMalloc(t, a1, 2*miB, 0)
	var wd *WrongDeviceError
	if err := d.FreeOn(0, q1); !errors.As(err, &wd) || !errors.Is(err, ErrUnknownPointer) || wd.Owner != 1 || !wd.Live {
		t.Errorf("FreeOn(0, device 1's %#x) = %v; want a WrongDeviceError naming device 1", uint64(q1), err)
	}
	if owner, ok := d.Owner(q1); !ok || owner != 1 {
		t.Errorf("Owner(%#x) = %d, %v; want 1", uint64(q1), owner, ok)
	}
	if err := d.Free(q1); err != nil {
		t.Fatal(err)
	}
}
