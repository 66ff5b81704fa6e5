package allocator

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// newTestSims returns simulated devices with the given indexes, closed at
// the end of the test.
func newTestSims(t testing.TB, capacity uint64, indexes ...int) []*simdev.Sim {
	t.Helper()
	sims := make([]*simdev.Sim, len(indexes))
	for i, idx := range indexes {
		s, err := simdev.New(simdev.Config{Capacity: capacity, Index: idx})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		sims[i] = s
	}
	return sims
}

func asDevices[D cudart.Device](ds []D) []cudart.Device {
	out := make([]cudart.Device, len(ds))
	for i, d := range ds {
		out[i] = d
	}
	return out
}

// newTestDevices returns a Devices over Sims with the given indexes; it
// checks every allocator's invariants and closes them at the end.
func newTestDevices(t testing.TB, capacity uint64, conf string, indexes ...int) (*Devices, []*simdev.Sim) {
	t.Helper()
	sims := newTestSims(t, capacity, indexes...)
	cfg, err := ParseConfig(conf)
	if err != nil {
		t.Fatal(err)
	}
	d, err := NewDevices(asDevices(sims), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, a := range d.All() {
			if err := a.Check(); err != nil && !errors.Is(err, ErrClosed) {
				t.Errorf("device %d: %v", a.Device().Info().Index, err)
			}
		}
		_ = d.Close()
	})
	return d, sims
}

func mustFor(t testing.TB, d *Devices, i int) *Allocator {
	t.Helper()
	a, err := d.ForDevice(i)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestNewDevices(t *testing.T) {
	d, sims := newTestDevices(t, giB, "", 2, 0, 1)
	if d.Len() != 3 || !slices.Equal(d.Indexes(), []int{0, 1, 2}) {
		t.Fatalf("Len %d, Indexes %v; want 3 and [0 1 2]", d.Len(), d.Indexes())
	}
	for i, a := range d.All() {
		if got := a.Device().Info().Index; got != i {
			t.Errorf("All()[%d] is device %d", i, got)
		}
		if mustFor(t, d, i) != a {
			t.Errorf("ForDevice(%d) is not All()[%d]", i, i)
		}
	}
	// sims were given as 2, 0, 1.
	if mustFor(t, d, 2).Device() != cudart.Device(sims[0]) {
		t.Error("ForDevice(2) is not the Sim with index 2")
	}
	for _, i := range []int{3, -1, 100} {
		if a, err := d.ForDevice(i); !errors.Is(err, ErrNoSuchDevice) || a != nil || !strings.Contains(err.Error(), fmt.Sprintf("device %d", i)) {
			t.Errorf("ForDevice(%d) = %v, %v; want an error wrapping ErrNoSuchDevice naming it", i, a, err)
		}
	}
	if _, err := d.MallocOn(9, 512, 0); !errors.Is(err, ErrNoSuchDevice) {
		t.Errorf("MallocOn(9) = %v", err)
	}

	// Each allocator has its own pools and statistics.
	p := mustMalloc(t, mustFor(t, d, 1), 3*miB, 0)
	q, err := d.MallocOn(2, 1000, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []int64{0, 1, 1} {
		st := mustFor(t, d, i).Stats()
		if st.Allocation[PoolAll].Current != want || st.Segment[PoolAll].Current != want {
			t.Errorf("device %d: %d allocations in %d segments, want %d in %d",
				i, st.Allocation[PoolAll].Current, st.Segment[PoolAll].Current, want, want)
		}
	}
	if got := mustFor(t, d, 1).Stats().ReservedBytes[PoolLarge].Current; got != int64(20*miB) {
		t.Errorf("device 1 reserved %d large bytes, want 20 MiB", got)
	}
	if got := mustFor(t, d, 2).Stats().ReservedBytes[PoolSmall].Current; got != int64(2*miB) {
		t.Errorf("device 2 reserved %d small bytes, want 2 MiB", got)
	}
	if owner, ok := d.Owner(p); !ok || owner != 1 {
		t.Errorf("Owner(p) = %d, %v; want 1", owner, ok)
	}
	if owner, ok := d.Owner(q); !ok || owner != 2 {
		t.Errorf("Owner(q) = %d, %v; want 2", owner, ok)
	}
	if _, ok := d.Owner(p + 512); ok {
		t.Error("Owner of an address inside a block, not its start, is found")
	}
	mustFree(t, mustFor(t, d, 1), p)
	if err := d.Free(q); err != nil {
		t.Fatal(err)
	}
	if _, ok := d.Owner(p); ok {
		t.Error("Owner of a freed pointer is found")
	}

	// All returns a copy.
	all := d.All()
	all[0] = nil
	if d.All()[0] == nil {
		t.Error("All returned the handle's own slice")
	}
}

// failingInfoDevice is a Sim whose MemGetInfo fails, so that New fails on
// it.
type failingInfoDevice struct{ *simdev.Sim }

func (failingInfoDevice) MemGetInfo() (uint64, uint64, error) {
	return 0, 0, fmt.Errorf("sim: memory info unavailable: %w", cudart.ErrInvalidValue)
}

func TestNewDevicesErrors(t *testing.T) {
	sims := newTestSims(t, giB, 0, 1, 1)
	cfg := DefaultConfig()
	for name, c := range map[string]struct {
		devs []cudart.Device
		want error
		text string
	}{
		"none":       {nil, cudart.ErrInvalidValue, "at least one device"},
		"nil":        {[]cudart.Device{sims[0], nil}, cudart.ErrInvalidValue, "device 2 of 2"},
		"duplicate":  {[]cudart.Device{sims[1], sims[0], sims[2]}, ErrDuplicateDevice, "devices 1 and 3 given to NewDevices both have index 1"},
		"same twice": {[]cudart.Device{sims[0], sims[0]}, ErrDuplicateDevice, "index 0"},
	} {
		d, err := NewDevices(c.devs, cfg)
		if d != nil || !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.text) {
			t.Errorf("%s: NewDevices = %v, %v; want an error wrapping %v saying %q", name, d, err, c.want, c.text)
		}
	}
	bad := cfg
	bad.GarbageCollectionThreshold = 2
	if _, err := NewDevices([]cudart.Device{sims[0]}, bad); err == nil {
		t.Error("NewDevices accepted an invalid configuration")
	}

	// One device failing closes the allocators already made.
	core, logs := observer.New(zapcore.InfoLevel)
	broken := failingInfoDevice{newTestSims(t, giB, 5)[0]}
	d, err := NewDevices([]cudart.Device{broken, sims[0], sims[1]}, cfg, WithLogger(zap.New(core)))
	if d != nil || err == nil || !strings.Contains(err.Error(), "device 5") || !errors.Is(err, cudart.ErrInvalidValue) {
		t.Fatalf("NewDevices with a broken device 5 = %v, %v; want an error naming device 5", d, err)
	}
	started := logs.FilterMessage("allocator started").Len()
	closed := logs.FilterMessage("allocator closed").Len()
	if started != 2 || closed != 2 {
		t.Errorf("%d allocators started and %d closed; want 2 and 2 (devices 0 and 1, before 5 failed)", started, closed)
	}
	for _, e := range logs.FilterMessage("allocator started").All() {
		if _, ok := e.ContextMap()["gpu"]; !ok {
			t.Errorf("allocator log line without a gpu field: %v", e.ContextMap())
		}
	}
}

// TestDevicesWrongDeviceFree: a pointer from device 0 freed on device 1 is
// an error naming the owner, and neither allocator changes.
func TestDevicesWrongDeviceFree(t *testing.T) {
	for _, conf := range []string{"", "backend:cudaMallocAsync", "expandable_segments:True"} {
		t.Run("conf="+conf, func(t *testing.T) {
			async := strings.Contains(conf, "cudaMallocAsync")
			d, _ := newTestDevices(t, 4*giB, conf, 0, 1, 2)
			a0, a1 := mustFor(t, d, 0), mustFor(t, d, 1)
			var ps []cudart.Ptr
			for _, size := range []uint64{512, 300 * kiB, 3 * miB, 40 * miB} {
				ps = append(ps, mustMalloc(t, a0, size, 0))
			}
			keep1 := mustMalloc(t, a1, 5*miB, 0)
			for _, p := range ps {
				before0, before1 := a0.Stats(), a1.Stats()
				err := d.FreeOn(1, p)
				var wd *WrongDeviceError
				if !errors.Is(err, ErrWrongDevice) || !errors.Is(err, ErrUnknownPointer) || !errors.As(err, &wd) {
					t.Fatalf("FreeOn(1, %#x) of device 0's pointer = %v; want ErrWrongDevice and ErrUnknownPointer", uint64(p), err)
				}
				if want := fmt.Sprintf("pointer %#x belongs to device 0, not device 1", uint64(p)); !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
				if wd.Owner != 0 || wd.Device != 1 || !wd.Live || wd.Ptr != p || wd.Op != "free" {
					t.Errorf("WrongDeviceError %+v", wd)
				}
				// The allocator of device 1 alone says unknown pointer.
				if err := a1.Free(p); !errors.Is(err, ErrUnknownPointer) {
					t.Errorf("device 1's Free of device 0's pointer = %v", err)
				}
				if a0.Stats() != before0 || a1.Stats() != before1 {
					t.Errorf("a wrong-device free changed the statistics")
				}
				mustCheck(t, a0)
				mustCheck(t, a1)
				if owner, ok := d.Owner(p); !ok || owner != 0 {
					t.Errorf("after the refused free, Owner = %d, %v; want 0", owner, ok)
				}
			}
			// The right device frees them.
			if err := d.FreeOn(0, ps[0]); err != nil {
				t.Fatal(err)
			}
			if err := a0.Free(ps[1]); err != nil {
				t.Fatal(err)
			}
			for _, p := range ps[2:] {
				if err := d.Free(p); err != nil {
					t.Fatal(err)
				}
			}
			if n := a0.Stats().Allocation[PoolAll].Current; n != 0 {
				t.Errorf("%d allocations live on device 0 after freeing all", n)
			}
			mustCheck(t, a0)

			// Freed on 0: on 0 a double free; on 1 still device 0's memory.
			// (The async backend forgets a pointer once its free has
			// completed: then it is unknown everywhere.)
			before0, before1 := a0.Stats(), a1.Stats()
			if err := d.FreeOn(0, ps[2]); !async && !errors.Is(err, ErrDoubleFree) || !errors.Is(err, ErrUnknownPointer) && !errors.Is(err, ErrDoubleFree) {
				t.Errorf("FreeOn(0) of a freed pointer = %v, want ErrDoubleFree", err)
			}
			err := d.Free(ps[2])
			if !async && (!errors.Is(err, ErrDoubleFree) || !strings.Contains(err.Error(), "device 0")) || !errors.Is(err, ErrUnknownPointer) && !errors.Is(err, ErrDoubleFree) {
				t.Errorf("Free of a freed pointer = %v, want ErrDoubleFree on device 0", err)
			}
			err = d.FreeOn(1, ps[2])
			var wd *WrongDeviceError
			if !async {
				if !errors.As(err, &wd) || wd.Live || wd.Owner != 0 || !strings.Contains(err.Error(), "lies in memory of device 0, not device 1") {
					t.Errorf("FreeOn(1) of device 0's freed pointer = %v", err)
				}
			} else if !errors.Is(err, ErrUnknownPointer) {
				// The async backend forgets a pointer once its free completes.
				t.Errorf("FreeOn(1) of device 0's freed pointer = %v", err)
			}
			if a0.Stats() != before0 || a1.Stats() != before1 {
				t.Errorf("failed frees changed the statistics")
			}

			// Unknown everywhere.
			if err := d.Free(0xdead000); !errors.Is(err, ErrUnknownPointer) || errors.Is(err, ErrWrongDevice) ||
				!strings.Contains(err.Error(), "[0 1 2]") {
				t.Errorf("Free of an unknown address = %v", err)
			}
			if err := d.FreeOn(2, 0xdead000); !errors.Is(err, ErrUnknownPointer) || errors.Is(err, ErrWrongDevice) {
				t.Errorf("FreeOn of an unknown address = %v", err)
			}
			if err := d.FreeOn(7, keep1); !errors.Is(err, ErrNoSuchDevice) {
				t.Errorf("FreeOn(7) = %v, want ErrNoSuchDevice", err)
			}
			if err := d.Free(0); err != nil {
				t.Errorf("Free(0) = %v", err)
			}
			if err := d.FreeOn(1, 0); err != nil {
				t.Errorf("FreeOn(1, 0) = %v", err)
			}
			if err := d.Free(keep1); err != nil {
				t.Fatal(err)
			}
			mustCheck(t, a0)
			mustCheck(t, a1)
		})
	}
}

func TestDevicesEmptyCacheAndClose(t *testing.T) {
	sims := newTestSims(t, giB, 0, 1)
	d, err := NewDevices(asDevices(sims), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	a0, a1 := mustFor(t, d, 0), mustFor(t, d, 1)
	mustFree(t, a0, mustMalloc(t, a0, 3*miB, 0))
	mustFree(t, a1, mustMalloc(t, a1, 1000, 0))
	live := mustMalloc(t, a1, 30*miB, 0)
	if err := d.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if sims[0].Used() != 0 || uint64(a1.MemoryReserved()) != sims[1].Used() || sims[1].Used() != 30*miB {
		t.Errorf("after EmptyCache the devices hold %d and %d bytes; want 0 and 30 MiB", sims[0].Used(), sims[1].Used())
	}
	err = d.Close()
	if !errors.Is(err, ErrLiveBlocks) || !strings.Contains(err.Error(), "device 1") || strings.Contains(err.Error(), "device 0") {
		t.Errorf("Close with a live block on device 1 = %v", err)
	}
	if sims[0].Used() != 0 || sims[1].Used() != 0 {
		t.Errorf("after Close the devices hold %d and %d bytes", sims[0].Used(), sims[1].Used())
	}
	if err := d.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("second Close = %v, want ErrClosed", err)
	}
	if err := d.EmptyCache(); !errors.Is(err, ErrClosed) {
		t.Errorf("EmptyCache after Close = %v, want ErrClosed", err)
	}
	if err := d.FreeOn(0, live); !errors.Is(err, ErrClosed) {
		t.Errorf("FreeOn after Close = %v, want ErrClosed", err)
	}
	if err := d.Free(live); !errors.Is(err, ErrUnknownPointer) {
		t.Errorf("Free after Close = %v, want ErrUnknownPointer", err)
	}
}

// TestDevicesConcurrent: many more goroutines than GOMAXPROCS, each
// yielding between operations so that it hops OS threads, allocate on
// several Sims at once through one Devices, alternating devices. Every
// pointer is checked to belong to the device that made it and freed there
// (through the allocator, FreeOn or Free); a deliberate wrong-device free
// is refused. At the end each device's statistics count exactly its own
// allocations. Run with -race.
func TestDevicesConcurrent(t *testing.T) {
	indexes := []int{0, 1, 2}
	d, sims := newTestDevices(t, 16*giB, "", indexes...)
	workers := 4*runtime.GOMAXPROCS(0) + 3
	ops := 1500
	if testing.Short() {
		ops = 300
	}
	streams := make([][]cudart.Stream, len(indexes))
	for i, s := range sims {
		streams[i] = []cudart.Stream{cudart.DefaultStream}
		for range 2 {
			st, err := s.StreamCreate()
			if err != nil {
				t.Fatal(err)
			}
			streams[i] = append(streams[i], st)
		}
	}
	mallocs := make([]atomic.Int64, len(indexes))
	wrongRefused := atomic.Int64{}
	type held struct {
		p   cudart.Ptr
		dev int
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			var live []held
			x := uint64(w)*0x9E3779B97F4A7C15 + 1
			free := func(h held, how uint64) bool {
				if owner, ok := d.Owner(h.p); !ok || owner != h.dev {
					t.Errorf("worker %d: Owner(%#x) = %d, %v; it was allocated on device %d", w, uint64(h.p), owner, ok, h.dev)
					return false
				}
				var err error
				switch how % 3 {
				case 0:
					a, _ := d.ForDevice(h.dev)
					err = a.Free(h.p)
				case 1:
					err = d.FreeOn(h.dev, h.p)
				default:
					err = d.Free(h.p)
				}
				if err != nil {
					t.Errorf("worker %d: free of %#x on device %d: %v", w, uint64(h.p), h.dev, err)
					return false
				}
				return true
			}
			for i := range ops {
				runtime.Gosched()
				x ^= x << 13
				x ^= x >> 7
				x ^= x << 17
				dev := (w + i) % len(indexes) // alternate devices
				if len(live) > 0 && (x%3 == 0 || len(live) > 24) {
					j := int(x>>8) % len(live)
					h := live[j]
					if x%17 == 0 {
						wrong := (h.dev + 1) % len(indexes)
						err := d.FreeOn(wrong, h.p)
						var wd *WrongDeviceError
						if !errors.As(err, &wd) || wd.Owner != h.dev || !wd.Live {
							t.Errorf("worker %d: FreeOn(%d) of device %d's %#x = %v, want a WrongDeviceError", w, wrong, h.dev, uint64(h.p), err)
							return
						}
						wrongRefused.Add(1)
						runtime.Gosched()
					}
					if !free(h, x>>20) {
						return
					}
					live[j] = live[len(live)-1]
					live = live[:len(live)-1]
					continue
				}
				s := streams[dev][int(x>>12)%len(streams[dev])]
				p, err := d.MallocOn(dev, sizeFor(x), s)
				if err != nil {
					t.Errorf("worker %d: MallocOn(%d): %v", w, dev, err)
					return
				}
				mallocs[dev].Add(1)
				live = append(live, held{p, dev})
				if i%200 == 0 {
					_ = mustFor(t, d, dev).Stats()
					if w == 0 {
						if err := d.EmptyCache(); err != nil {
							t.Errorf("EmptyCache: %v", err)
						}
					}
				}
			}
			for _, h := range live {
				runtime.Gosched()
				if !free(h, 0) {
					return
				}
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		return
	}
	if wrongRefused.Load() == 0 {
		t.Error("no wrong-device free was tried")
	}
	for i, a := range d.All() {
		mustCheck(t, a)
		st := a.Stats()
		n := mallocs[i].Load()
		if st.Allocation[PoolAll].Allocated != n || st.Allocation[PoolAll].Freed != n || st.Allocation[PoolAll].Current != 0 {
			t.Errorf("device %d: allocation allocated %d freed %d current %d; the workers made %d",
				i, st.Allocation[PoolAll].Allocated, st.Allocation[PoolAll].Freed, st.Allocation[PoolAll].Current, n)
		}
		if uint64(st.ReservedBytes[PoolAll].Current) != sims[i].Used() {
			t.Errorf("device %d: reserved %d but the device holds %d", i, st.ReservedBytes[PoolAll].Current, sims[i].Used())
		}
		if st.AllocatedBytes[PoolAll].Current != 0 {
			t.Errorf("device %d: %d bytes still allocated", i, st.AllocatedBytes[PoolAll].Current)
		}
	}
	t.Logf("%d workers (GOMAXPROCS %d), %d ops each, mallocs per device %d/%d/%d, %d wrong-device frees refused",
		workers, runtime.GOMAXPROCS(0), ops, mallocs[0].Load(), mallocs[1].Load(), mallocs[2].Load(), wrongRefused.Load())
}
