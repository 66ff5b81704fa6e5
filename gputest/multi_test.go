package gputest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/stats"
)

// openGPUs opens every CUDA device, or skips the test when there is no
// driver or fewer than min devices.
func openGPUs(t testing.TB, min int) []cudart.Device {
	t.Helper()
	n, err := cudart.DeviceCount()
	if errors.Is(err, cudart.ErrNoDriver) {
		t.Skipf("no GPU: %v", err)
	}
	if err != nil {
		t.Fatalf("counting CUDA devices: %v", err)
	}
	if n < min {
		t.Skipf("needs at least %d CUDA devices; this process sees %d (CUDA_VISIBLE_DEVICES=%q)", min, n, os.Getenv("CUDA_VISIBLE_DEVICES"))
	}
	devs := make([]cudart.Device, n)
	for i := range n {
		dev, err := cudart.Open(i)
		if err != nil {
			t.Fatalf("opening CUDA device %d of %d: %v", i, n, err)
		}
		t.Cleanup(func() { _ = dev.Close() })
		devs[i] = dev
	}
	return devs
}

// openBackedSims returns n simulated devices whose memory is real host
// memory, so that memsets and copies move bytes.
func openBackedSims(t testing.TB, n int, capacity uint64) []cudart.Device {
	t.Helper()
	devs := make([]cudart.Device, n)
	for i := range n {
		s, err := simdev.New(simdev.Config{Capacity: capacity, Index: i, Backed: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		devs[i] = s
	}
	return devs
}

// mlive is one allocation of the multi-device pattern test.
type mlive struct {
	ptr     cudart.Ptr
	size    uint64
	pattern byte
	stream  cudart.Stream
	users   []cudart.Stream
}

// multiPattern is the outcome of runMultiDevicePattern.
type multiPattern struct {
	devices, workers, ops int
	checked, corruptions  int64
	wrongRefused          int64
	mallocs               []int64 // per device, by position
}

// runMultiDevicePattern is the pattern-checking random test of
// TestGPUPatternRandom on every device of devs at once: more goroutines
// than GOMAXPROCS, each yielding between operations (so that it hops OS
// threads) and alternating devices, share ops operations. Each live block
// holds a byte written with MemsetAsync on its stream (and on a second
// stream of its device after RecordStream, one time in eight); before
// each free the streams are synchronised and the block read back with
// MemcpyDtoH, and any other byte is a corruption. Every pointer's owner is
// checked (Devices.Owner) before it is freed on its own device (through
// its allocator, FreeOn or Free, in turn), and now and then a deliberate
// free on another device must fail with ErrWrongDevice naming the owner.
func runMultiDevicePattern(t *testing.T, devs []cudart.Device, ops int, maxSize uint64) multiPattern {
	alloc, err := allocator.NewDevices(devs, allocator.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	n := len(devs)
	res := multiPattern{devices: n, ops: ops, mallocs: make([]int64, n)}
	streams := make([][]cudart.Stream, n)
	for d, dev := range devs {
		for range 3 {
			s, err := dev.StreamCreate()
			if err != nil {
				t.Fatalf("device %d: %v", d, err)
			}
			streams[d] = append(streams[d], s)
		}
	}
	defer func() {
		for d, dev := range devs {
			for _, s := range streams[d] {
				_ = dev.StreamDestroy(s)
			}
		}
	}()
	index := make([]int, n) // device index by position
	for d, dev := range devs {
		index[d] = dev.Info().Index
	}
	res.workers = max(2*runtime.GOMAXPROCS(0)+1, 2*n+1)
	const maxLive = 16 // per worker and device
	var checked, corruptions, wrongRefused atomic.Int64
	mallocs := make([]atomic.Int64, n)
	size := func(rng *rand.Rand) uint64 { return patternSize(rng, maxSize) }

	var wg sync.WaitGroup
	for w := range res.workers {
		myOps := ops / res.workers
		if w < ops%res.workers {
			myOps++
		}
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 0x6d756c7469))
			lives := make([][]mlive, n)
			buf := make([]byte, 64*kiB)
			var made, frees int
			// verify reads l back on device d after its streams finish.
			verify := func(d int, l mlive) bool {
				dev := devs[d]
				for _, s := range append([]cudart.Stream{l.stream}, l.users...) {
					if err := dev.StreamSynchronize(s); err != nil {
						t.Errorf("worker %d: device %d: %v", w, index[d], err)
						return false
					}
				}
				for _, win := range checkWindows(l.size) {
					b := buf[:win[1]]
					if err := dev.MemcpyDtoH(b, l.ptr+cudart.Ptr(win[0])); err != nil {
						t.Errorf("worker %d: device %d: reading %#x: %v", w, index[d], uint64(l.ptr), err)
						return false
					}
					for i, v := range b {
						if v != l.pattern {
							if corruptions.Add(1) <= 10 {
								t.Errorf("device %d: block %#x (+%d) byte %d is %#x, want %#x",
									index[d], uint64(l.ptr), l.size, win[0]+uint64(i), v, l.pattern)
							}
							break
						}
					}
				}
				checked.Add(1)
				return true
			}
			// free checks l's owner, refuses it on another device now and
			// then, reads it back and frees it on device d.
			free := func(d int, l mlive) bool {
				if owner, ok := alloc.Owner(l.ptr); !ok || owner != index[d] {
					t.Errorf("worker %d: pointer %#x made on device %d: Owner = %d, %v", w, uint64(l.ptr), index[d], owner, ok)
					return false
				}
				if n > 1 && frees%16 == 0 {
					wrong := index[(d+1+rng.IntN(n-1))%n]
					err := alloc.FreeOn(wrong, l.ptr)
					var wd *allocator.WrongDeviceError
					if !errors.Is(err, allocator.ErrWrongDevice) || !errors.As(err, &wd) || wd.Owner != index[d] || !wd.Live {
						t.Errorf("worker %d: FreeOn(%d) of device %d's %#x = %v; want ErrWrongDevice naming device %d",
							w, wrong, index[d], uint64(l.ptr), err, index[d])
						return false
					}
					wrongRefused.Add(1)
					runtime.Gosched()
				}
				if !verify(d, l) {
					return false
				}
				var err error
				switch frees % 3 {
				case 0:
					a, _ := alloc.ForDevice(index[d])
					err = a.Free(l.ptr)
				case 1:
					err = alloc.FreeOn(index[d], l.ptr)
				default:
					err = alloc.Free(l.ptr)
				}
				frees++
				if err != nil {
					t.Errorf("worker %d: freeing %#x on device %d: %v", w, uint64(l.ptr), index[d], err)
					return false
				}
				return true
			}
			for i := range myOps {
				runtime.Gosched()
				d := (w + i) % n // alternate devices
				if k := len(lives[d]); k > 0 && (rng.IntN(2) == 0 || k >= maxLive) {
					j := rng.IntN(k)
					if !free(d, lives[d][j]) {
						return
					}
					lives[d][j] = lives[d][k-1]
					lives[d] = lives[d][:k-1]
					continue
				}
				dev := devs[d]
				s := streams[d][rng.IntN(len(streams[d]))]
				sz := size(rng)
				p, err := alloc.MallocOn(index[d], sz, s)
				if err != nil {
					t.Errorf("worker %d: op %d: MallocOn(%d, %d): %v", w, i, index[d], sz, err)
					return
				}
				mallocs[d].Add(1)
				made++
				l := mlive{ptr: p, size: sz, pattern: byte((w*61+made)%251 + 1), stream: s}
				if err := dev.MemsetAsync(p, l.pattern, sz, s); err != nil {
					t.Errorf("worker %d: device %d: %v", w, index[d], err)
					return
				}
				if rng.IntN(8) == 0 {
					// Another stream of the device uses the block too,
					// after its owner wrote it.
					if u := streams[d][rng.IntN(len(streams[d]))]; u != s {
						if err := dev.StreamSynchronize(s); err != nil {
							t.Errorf("worker %d: device %d: %v", w, index[d], err)
							return
						}
						a, _ := alloc.ForDevice(index[d])
						if err := a.RecordStream(p, u); err != nil {
							t.Errorf("worker %d: device %d: %v", w, index[d], err)
							return
						}
						if err := dev.MemsetAsync(p, l.pattern, sz, u); err != nil {
							t.Errorf("worker %d: device %d: %v", w, index[d], err)
							return
						}
						l.users = append(l.users, u)
					}
				}
				lives[d] = append(lives[d], l)
			}
			for d := range lives {
				for _, l := range lives[d] {
					runtime.Gosched()
					if !free(d, l) {
						return
					}
				}
			}
		})
	}
	wg.Wait()
	res.checked, res.corruptions, res.wrongRefused = checked.Load(), corruptions.Load(), wrongRefused.Load()
	for d := range mallocs {
		res.mallocs[d] = mallocs[d].Load()
	}
	for d, a := range alloc.All() {
		if t.Failed() {
			break
		}
		if err := a.Check(); err != nil {
			t.Errorf("device %d: %v", index[d], err)
		}
		st := a.Stats()
		all := st.Allocation[allocator.PoolAll]
		if all.Allocated != res.mallocs[d] || all.Freed != res.mallocs[d] || all.Current != 0 {
			t.Errorf("device %d: allocation allocated %d freed %d current %d; the workers made %d",
				index[d], all.Allocated, all.Freed, all.Current, res.mallocs[d])
		}
	}
	if err := alloc.Close(); err != nil {
		t.Error(err)
	}
	return res
}

// TestGPUMultiDevicePattern runs runMultiDevicePattern on every CUDA
// device at once: ALLOCD_GPU_OPS operations in all (default 1,000,000),
// request sizes capped by ALLOCD_GPU_MAX_SIZE (default 64 MiB). It needs
// at least two GPUs and skips otherwise; ALLOCD_GPU_MIN_DEVICES=1 runs it
// on one (without the wrong-device frees, which need two).
func TestGPUMultiDevicePattern(t *testing.T) {
	devs := openGPUs(t, envInt("ALLOCD_GPU_MIN_DEVICES", 2))
	ops := envInt("ALLOCD_GPU_OPS", 1_000_000)
	maxSize := uint64(envInt("ALLOCD_GPU_MAX_SIZE", 64<<20))
	r := runMultiDevicePattern(t, devs, ops, maxSize)
	t.Logf("gpu-multi: %d workers (GOMAXPROCS %d), mallocs per device %v, %d wrong-device frees refused",
		r.workers, runtime.GOMAXPROCS(0), r.mallocs, r.wrongRefused)
	fmt.Printf("gpu-multi: devices=%d ops=%d corruptions=%d blocks_checked=%d workers=%d wrong_device_frees_refused=%d\n",
		r.devices, r.ops, r.corruptions, r.checked, r.workers, r.wrongRefused)
	if r.corruptions != 0 {
		t.Fatalf("%d corrupted blocks", r.corruptions)
	}
	if r.wrongRefused == 0 && r.devices > 1 {
		t.Error("no wrong-device free was tried")
	}
}

// TestMultiDevicePatternOnSims runs the same test on three simulated
// devices backed by host memory, with fewer and smaller operations, so
// that the test itself runs wherever the tests do.
func TestMultiDevicePatternOnSims(t *testing.T) {
	ops := 6000
	if testing.Short() {
		ops = 1500
	}
	r := runMultiDevicePattern(t, openBackedSims(t, 3, 16*giB), ops, 256*kiB)
	t.Logf("gpu-multi (sim): devices=%d ops=%d corruptions=%d blocks_checked=%d workers=%d mallocs=%v wrong_device_frees_refused=%d",
		r.devices, r.ops, r.corruptions, r.checked, r.workers, r.mallocs, r.wrongRefused)
	if r.corruptions != 0 || r.checked == 0 || r.wrongRefused == 0 {
		t.Errorf("corruptions %d, blocks checked %d, wrong-device frees refused %d", r.corruptions, r.checked, r.wrongRefused)
	}
}

// checkMultiDeviceMetrics gives each device's allocator a different load,
// gathers one stats.NewCollector over them all, and checks that each
// device's series, under its own gpu label, carry its allocator's own
// numbers.
func checkMultiDeviceMetrics(t *testing.T, devs []cudart.Device) {
	alloc, err := allocator.NewDevices(devs, allocator.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := alloc.Close(); err != nil {
			t.Error(err)
		}
	}()
	var live []cudart.Ptr
	for d, a := range alloc.All() {
		for k := range d + 1 {
			for _, size := range []uint64{3 * miB, 1000, 30 * miB} {
				p, err := a.Malloc(size+uint64(k)*512, cudart.DefaultStream)
				if err != nil {
					t.Fatal(err)
				}
				live = append(live, p)
			}
		}
		p, err := a.Malloc(5*miB, cudart.DefaultStream)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	sources := make([]stats.Source, alloc.Len())
	for i, a := range alloc.All() {
		sources[i] = a
	}
	c, err := stats.NewCollector(sources...)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	// value[name][gpu][pool]
	value := map[string]map[string]map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var gpu, pool string
			for _, lp := range m.GetLabel() {
				switch lp.GetName() {
				case stats.LabelGPU:
					gpu = lp.GetValue()
				case stats.LabelPool:
					pool = lp.GetValue()
				}
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			if m.Histogram != nil {
				v = float64(m.GetHistogram().GetSampleCount())
			}
			if value[mf.GetName()] == nil {
				value[mf.GetName()] = map[string]map[string]float64{}
			}
			if value[mf.GetName()][gpu] == nil {
				value[mf.GetName()][gpu] = map[string]float64{}
			}
			value[mf.GetName()][gpu][pool] = v
		}
	}
	for _, a := range alloc.All() {
		st := a.Stats()
		_, total, err := a.Device().MemGetInfo()
		if err != nil {
			t.Fatal(err)
		}
		gpu := strconv.Itoa(a.Device().Info().Index)
		for _, c := range []struct {
			name, pool string
			want       int64
		}{
			{"allocd_allocated_bytes", "small", st.AllocatedBytes[allocator.PoolSmall].Current},
			{"allocd_allocated_bytes", "large", st.AllocatedBytes[allocator.PoolLarge].Current},
			{"allocd_reserved_bytes", "large", st.ReservedBytes[allocator.PoolLarge].Current},
			{"allocd_segments", "large", st.Segment[allocator.PoolLarge].Current},
			{"allocd_allocations_total", "large", st.Allocation[allocator.PoolLarge].Allocated},
			{"allocd_frees_total", "large", st.Allocation[allocator.PoolLarge].Freed},
			{"allocd_peak_allocated_bytes", "", st.AllocatedBytes[allocator.PoolAll].Peak},
			{"allocd_device_mallocs_total", "", st.NumDeviceAlloc},
			{"allocd_device_malloc_duration_seconds", "", st.NumDeviceAlloc},
			{"allocd_device_total_bytes", "", int64(total)},
			{"allocd_device_info", "", 1},
		} {
			got, ok := value[c.name][gpu][c.pool]
			if !ok || got != float64(c.want) {
				t.Errorf(`%s{gpu=%q,pool=%q} = %v (present %v); the allocator says %d`, c.name, gpu, c.pool, got, ok, c.want)
			}
		}
	}
	if got := len(value["allocd_device_info"]); got != len(devs) {
		t.Errorf("allocd_device_info for %d gpus, want %d", got, len(devs))
	}
	for _, p := range live {
		if err := alloc.Free(p); err != nil {
			t.Fatal(err)
		}
	}
}

// TestGPUMultiDeviceMetrics checks the metrics of every CUDA device at
// once (at least two).
func TestGPUMultiDeviceMetrics(t *testing.T) {
	checkMultiDeviceMetrics(t, openGPUs(t, 2))
}

// TestMultiDeviceMetricsOnSims checks them on two simulated devices.
func TestMultiDeviceMetricsOnSims(t *testing.T) {
	devs := make([]cudart.Device, 2)
	for i := range devs {
		s, err := simdev.New(simdev.Config{Capacity: 8 * giB, Index: i})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		devs[i] = s
	}
	checkMultiDeviceMetrics(t, devs)
}
