package allocator

import (
	"errors"
	"fmt"
	"testing"

	"github.com/allocd/allocd/cudart"
)

// rangeless is a device that does not say its address range (a real GPU:
// cudart's device is no cudart.AddressRanger), over a Sim.
type rangeless struct{ cudart.Device }

// TestDevicesFreeWithoutDevice checks Devices.Free, the free of a caller
// that keeps no map of its pointers, wherever the owner is found: by
// address range (Sims), as the one device without a range (one GPU), or
// by asking each of several devices without one. In each layout a live
// pointer is freed on its owner, a second free is a double free, a
// pointer nobody handed out is unknown, and neither refusal changes any
// allocator's statistics.
func TestDevicesFreeWithoutDevice(t *testing.T) {
	for _, tc := range []struct {
		name      string
		n         int
		rangeless bool
	}{
		{"one device with a range", 1, false},
		{"three devices with ranges", 3, false},
		{"one device without a range", 1, true},
		{"two devices without ranges", 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			indexes := make([]int, tc.n)
			for i := range indexes {
				indexes[i] = i
			}
			devs := asDevices(newTestSims(t, 4*giB, indexes...))
			if tc.rangeless {
				for i, dev := range devs {
					devs[i] = rangeless{dev}
				}
			}
			d, err := NewDevices(devs, defaultConfig(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				for _, a := range d.All() {
					mustCheck(t, a)
					a.Close()
				}
			})
			last := mustFor(t, d, tc.n-1)
			for _, size := range []uint64{512, 3 * miB, 64 * miB} {
				p := mustMalloc(t, last, size, 0)
				if err := d.Free(p); err != nil {
					t.Fatalf("Free(%#x) of a live %d-byte block: %v", uint64(p), size, err)
				}
				before := last.Stats()
				if err := d.Free(p); !errors.Is(err, ErrDoubleFree) && !errors.Is(err, ErrUnknownPointer) {
					t.Errorf("second Free(%#x) = %v; want a double free or unknown pointer", uint64(p), err)
				}
				if err := d.Free(p + 1<<40); !errors.Is(err, ErrUnknownPointer) {
					t.Errorf("Free of a pointer nobody handed out = %v; want ErrUnknownPointer", err)
				}
				if last.Stats() != before {
					t.Errorf("refused frees changed the statistics")
				}
				if a := last.Stats().AllocatedBytes[PoolAll].Current; a != 0 {
					t.Errorf("after the free, %d bytes allocated", a)
				}
			}
		})
	}
}

// BenchmarkDevicesFree is BenchmarkCachedPair with the free through
// Devices.Free, as allocd_torch frees (no device given), on one device
// without an address range (a GPU): no world lock, nothing allocated.
func BenchmarkDevicesFree(b *testing.B) {
	sim := newTestSims(b, 141*giB, 0)[0]
	d, err := NewDevices([]cudart.Device{rangeless{sim}}, defaultConfig(b))
	if err != nil {
		b.Fatal(err)
	}
	a := mustFor(b, d, 0)
	defer a.Close()
	for _, size := range []uint64{4096, 64 * miB} {
		b.Run(fmt.Sprintf("size=%d", size), func(b *testing.B) {
			if err := d.Free(mustMalloc(b, a, size, 0)); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			for b.Loop() {
				p, err := a.Malloc(size, 0)
				if err != nil {
					b.Fatal(err)
				}
				if err := d.Free(p); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// defaultConfig is the configuration an empty ALLOCD_CONF gives.
func defaultConfig(t testing.TB) Config {
	t.Helper()
	cfg, err := ParseConfig("")
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}
