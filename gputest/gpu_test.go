// Package gputest holds the tests that need a real GPU. Every test skips
// when no CUDA driver is present, so `go test ./...` stays green on machines
// without one; on a GPU machine, build the binary here with
// `go test -c ./gputest/` and run it there.
package gputest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/trace"
	"github.com/allocd/allocd/workload"
)

const (
	kiB = uint64(1) << 10
	miB = uint64(1) << 20
	giB = uint64(1) << 30
)

// openGPU opens CUDA device 0 or skips the test when there is none.
func openGPU(t testing.TB) *cudart.CUDA {
	t.Helper()
	dev, err := cudart.Open(0)
	if errors.Is(err, cudart.ErrNoDriver) {
		t.Skipf("no GPU: %v", err)
	}
	if err != nil {
		t.Fatalf("opening CUDA device 0: %v", err)
	}
	t.Cleanup(func() { _ = dev.Close() })
	return dev
}

func newAllocator(t testing.TB, dev cudart.Device, conf string) *allocator.Allocator {
	t.Helper()
	cfg, err := allocator.ParseConfig(conf)
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(dev, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// live is one allocation of the pattern test.
type live struct {
	ptr     cudart.Ptr
	size    uint64
	pattern byte
	stream  cudart.Stream
	users   []cudart.Stream
}

// checkWindows are the parts of a block read back: all of a small block,
// head, middle and tail of a large one.
func checkWindows(size uint64) [][2]uint64 {
	const w = 4 * kiB
	if size <= 64*kiB {
		return [][2]uint64{{0, size}}
	}
	mid := (size / 2) &^ 511
	return [][2]uint64{{0, w}, {mid, w}, {size - w, w}}
}

// patternSize draws a request size for the pattern tests: 70% up to
// 64 KiB, 25% up to 4 MiB, 5% up to 64 MiB, capped at maxSize.
func patternSize(rng *rand.Rand, maxSize uint64) uint64 {
	var n uint64
	switch c := rng.IntN(100); {
	case c < 70:
		n = 1 + rng.Uint64N(64*kiB)
	case c < 95:
		n = 64*kiB + rng.Uint64N(4*miB)
	default:
		n = 4*miB + rng.Uint64N(60*miB)
	}
	return min(n, maxSize)
}

// TestGPUPatternRandom runs random malloc/free/record-stream on several
// streams, writes a distinct byte into each live block on its stream (and
// on the streams that use it), and reads every block back before freeing
// it: a byte of another block's pattern means two live blocks shared memory.
func TestGPUPatternRandom(t *testing.T) {
	runPattern(t, "", envInt("ALLOCD_GPU_OPS", 1_000_000))
}

// TestGPUPatternExpandable runs the pattern test with expandable segments,
// whose blocks span pages mapped one by one into a virtual range.
func TestGPUPatternExpandable(t *testing.T) {
	runPattern(t, "expandable_segments:True", envInt("ALLOCD_GPU_OPS", 1_000_000)/4)
}

func runPattern(t *testing.T, conf string, ops int) {
	dev := openGPU(t)
	a := newAllocator(t, dev, conf)
	defer func() {
		if err := a.Close(); err != nil {
			t.Error(err)
		}
	}()
	streams := make([]cudart.Stream, 3)
	for i := range streams {
		s, err := dev.StreamCreate()
		if err != nil {
			t.Fatal(err)
		}
		streams[i] = s
		defer dev.StreamDestroy(s)
	}
	rng := rand.New(rand.NewPCG(7, 11))
	var lives []live
	buf := make([]byte, 64*kiB)
	var checked, corruptions, nextPattern int
	verify := func(l live) {
		for _, s := range append([]cudart.Stream{l.stream}, l.users...) {
			if err := dev.StreamSynchronize(s); err != nil {
				t.Fatal(err)
			}
		}
		for _, win := range checkWindows(l.size) {
			b := buf[:win[1]]
			if err := dev.MemcpyDtoH(b, l.ptr+cudart.Ptr(win[0])); err != nil {
				t.Fatal(err)
			}
			for i, v := range b {
				if v != l.pattern {
					corruptions++
					if corruptions <= 10 {
						t.Errorf("block %#x (+%d) byte %d is %#x, want %#x", uint64(l.ptr), l.size, win[0]+uint64(i), v, l.pattern)
					}
					break
				}
			}
		}
		checked++
	}
	// ALLOCD_GPU_MAX_SIZE caps request sizes (the mock CUDA of cudart's
	// tests ignores memsets above 16 MiB).
	maxSize := uint64(envInt("ALLOCD_GPU_MAX_SIZE", 64<<20))
	size := func() uint64 { return patternSize(rng, maxSize) }
	for i := range ops {
		if len(lives) > 0 && (rng.IntN(2) == 0 || len(lives) > 1500) {
			j := rng.IntN(len(lives))
			l := lives[j]
			verify(l)
			if err := a.Free(l.ptr); err != nil {
				t.Fatal(err)
			}
			lives[j] = lives[len(lives)-1]
			lives = lives[:len(lives)-1]
			continue
		}
		s := streams[rng.IntN(len(streams))]
		sz := size()
		p, err := a.Malloc(sz, s)
		if err != nil {
			t.Fatalf("op %d: Malloc(%d): %v", i, sz, err)
		}
		nextPattern++
		l := live{ptr: p, size: sz, pattern: byte(nextPattern%251 + 1), stream: s}
		if err := dev.MemsetAsync(p, l.pattern, sz, s); err != nil {
			t.Fatal(err)
		}
		if rng.IntN(8) == 0 {
			// Another stream uses the block too, after its owner wrote it.
			u := streams[rng.IntN(len(streams))]
			if u != s {
				if err := dev.StreamSynchronize(s); err != nil {
					t.Fatal(err)
				}
				if err := a.RecordStream(p, u); err != nil {
					t.Fatal(err)
				}
				if err := dev.MemsetAsync(p, l.pattern, sz, u); err != nil {
					t.Fatal(err)
				}
				l.users = append(l.users, u)
			}
		}
		lives = append(lives, l)
	}
	for _, l := range lives {
		verify(l)
		if err := a.Free(l.ptr); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	st := a.Stats()
	t.Logf("gpu-pattern: conf=%q ops=%d blocks_checked=%d corruptions=%d peak_reserved=%s device_mallocs=%d",
		conf, ops, checked, corruptions, allocator.FormatSize(uint64(st.ReservedBytes[allocator.PoolAll].Peak)), st.NumDeviceAlloc)
	if v := st.VMM; v.Maps > 0 {
		// Revived runs and waits show that reclaim's standby mappings were exercised.
		t.Logf("gpu-pattern: vmm creates=%d maps=%d unmaps=%d releases=%d revived=%d waits=%d",
			v.Creates, v.Maps, v.Unmaps, v.Releases, v.Revived, v.Waits)
	}
	fmt.Printf("gpu-pattern: conf=%q ops=%d blocks_checked=%d corruptions=%d\n", conf, ops, checked, corruptions)
	if corruptions != 0 {
		t.Fatalf("%d corrupted blocks", corruptions)
	}
}

// queueWrites queues n memsets of the size bytes at p, of value v, on
// stream s, and returns an event recorded after them, destroyed at the
// end of the test.
func queueWrites(t testing.TB, dev cudart.Device, p cudart.Ptr, size uint64, v byte, s cudart.Stream, n int) cudart.Event {
	t.Helper()
	for range n {
		if err := dev.MemsetAsync(p, v, size, s); err != nil {
			t.Fatal(err)
		}
	}
	marker, err := dev.EventCreate()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.EventDestroy(marker) })
	if err := dev.EventRecord(marker, s); err != nil {
		t.Fatal(err)
	}
	return marker
}

// TestGPUStreamDeferral: a block freed while a memset on another stream
// still uses it is not handed out until that stream's event completes.
func TestGPUStreamDeferral(t *testing.T) {
	dev := openGPU(t)
	a := newAllocator(t, dev, "")
	defer a.Close()
	s1, _ := dev.StreamCreate()
	s2, _ := dev.StreamCreate()
	defer dev.StreamDestroy(s1)
	defer dev.StreamDestroy(s2)
	const size = 256 << 20
	p, err := a.Malloc(size, s1)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.RecordStream(p, s2); err != nil {
		t.Fatal(err)
	}
	// Keep s2 busy for a while on p: ~2000 memsets of 256 MiB.
	marker := queueWrites(t, dev, p, size, 0x5a, s2, 2000)
	if err := a.Free(p); err != nil {
		t.Fatal(err)
	}
	q, err := a.Malloc(size, s1)
	if err != nil {
		t.Fatal(err)
	}
	if done, err := dev.EventQuery(marker); err != nil || done {
		t.Fatalf("stream %d finished its work before the test could check reuse (done %v, err %v)", s2, done, err)
	}
	if q == p {
		t.Fatalf("block %#x handed out again while stream %d still used it", uint64(p), s2)
	}
	if err := dev.StreamSynchronize(s2); err != nil {
		t.Fatal(err)
	}
	r, err := a.Malloc(size, s1)
	if err != nil {
		t.Fatal(err)
	}
	if r != p {
		t.Errorf("after the stream finished, the block was not reused (got %#x, want %#x)", uint64(r), uint64(p))
	}
	st := a.Stats()
	t.Logf("gpu-stream: deferred block %#x not reused while busy (got %#x), reused after: %v; device mallocs %d",
		uint64(p), uint64(q), r == p, st.NumDeviceAlloc)
	for _, x := range []cudart.Ptr{q, r} {
		if err := a.Free(x); err != nil {
			t.Fatal(err)
		}
	}
}

// TestGPUOutOfMemory: a cap and a real over-ask give the documented error,
// and the allocator keeps working after frees.
func TestGPUOutOfMemory(t *testing.T) {
	dev := openGPU(t)
	t.Run("fraction cap", func(t *testing.T) {
		a := newAllocator(t, dev, "per_process_memory_fraction:0.05")
		defer a.Close()
		var ps []cudart.Ptr
		var err error
		for {
			var p cudart.Ptr
			if p, err = a.Malloc(1*giB, 0); err != nil {
				break
			}
			ps = append(ps, p)
		}
		var oom *allocator.OOMError
		if !errors.As(err, &oom) || oom.Allowed == 0 || !errors.Is(err, cudart.ErrOutOfMemory) {
			t.Fatalf("over the cap: %v", err)
		}
		t.Logf("gpu-oom (cap): after %d GiB: %v", len(ps), err)
		for _, p := range ps {
			if err := a.Free(p); err != nil {
				t.Fatal(err)
			}
		}
		p, err := a.Malloc(1*giB, 0)
		if err != nil {
			t.Fatalf("after frees: %v", err)
		}
		_ = a.Free(p)
	})
	t.Run("device over-ask", func(t *testing.T) {
		a := newAllocator(t, dev, "")
		defer a.Close()
		free, total, err := dev.MemGetInfo()
		if err != nil {
			t.Fatal(err)
		}
		ask := min(free+4*giB, total-512*miB)
		_, err = a.Malloc(ask, 0)
		var oom *allocator.OOMError
		if !errors.As(err, &oom) || !strings.Contains(err.Error(), "cudaErrorMemoryAllocation") {
			t.Fatalf("Malloc(%d) with %d free: %v", ask, free, err)
		}
		if st := a.Stats(); st.NumOOMs != 1 || st.NumAllocRetries != 1 {
			t.Errorf("ooms %d retries %d, want 1 1", st.NumOOMs, st.NumAllocRetries)
		}
		t.Logf("gpu-oom (device): %v", err)
		p, err := a.Malloc(64*miB, 0)
		if err != nil {
			t.Fatalf("after the OOM: %v", err)
		}
		_ = a.Free(p)
	})
}

// TestGPUCloseReturnsMemory: Close gives the device back its free memory.
func TestGPUCloseReturnsMemory(t *testing.T) {
	dev := openGPU(t)
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	before, _, err := dev.MemGetInfo()
	if err != nil {
		t.Fatal(err)
	}
	a := newAllocator(t, dev, "")
	rng := rand.New(rand.NewPCG(3, 4))
	var keep []cudart.Ptr
	for i := range 5000 {
		p, err := a.Malloc(1+rng.Uint64N(32*miB), 0)
		if err != nil {
			t.Fatal(err)
		}
		if i%3 == 0 {
			keep = append(keep, p) // left live: Close must return these too
		} else if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	err = a.Close()
	if !errors.Is(err, allocator.ErrLiveBlocks) {
		t.Fatalf("Close with %d live blocks: %v", len(keep), err)
	}
	after, _, err := dev.MemGetInfo()
	if err != nil {
		t.Fatal(err)
	}
	diff := int64(before) - int64(after)
	t.Logf("gpu-close: free before %d, after Close %d, difference %d bytes", before, after, diff)
	if diff > int64(2*miB) || diff < -int64(2*miB) {
		t.Errorf("after Close the device has %d bytes less free than before", diff)
	}
}

// tracesDir is where the recorded traces are: ALLOCD_TRACES, or the
// repository's testdata/traces.
func tracesDir() string {
	if d := os.Getenv("ALLOCD_TRACES"); d != "" {
		return d
	}
	return "../testdata/traces"
}

// TestGPUReplayMatchesSim: every recorded trace replayed on the GPU reaches
// the same peak reserved as on the simulated device given the addresses
// the GPU handed out (the policy is deterministic given addresses), and is
// compared with the Sim replay at the trace's recorded addresses (which
// equals PyTorch's figure).
func TestGPUReplayMatchesSim(t *testing.T) {
	dev := openGPU(t)
	files, _ := filepath.Glob(filepath.Join(tracesDir(), "*.pickle.gz"))
	if len(files) == 0 {
		t.Fatalf("no traces in %s", tracesDir())
	}
	simReplay := func(t *testing.T, conf string, ops *trace.Ops, plan []simdev.Address) workload.ReplayResult {
		// At least the GPU's capacity: expandable ranges are sized from it,
		// and a range smaller than a trace's needs changes the placement.
		sim, err := simdev.New(simdev.Config{Capacity: max(dev.Info().TotalMemory, 141<<30), ManualEvents: true, Addresses: plan})
		if err != nil {
			t.Fatal(err)
		}
		a := newAllocator(t, sim, conf)
		defer a.Close()
		r, err := workload.Replay(ops, a, workload.ReplayOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	var cases []struct{ f, conf string }
	for _, conf := range []string{"", "expandable_segments:True"} {
		for _, f := range files {
			cases = append(cases, struct{ f, conf string }{f, conf})
		}
	}
	for _, tc := range cases {
		f, conf := tc.f, tc.conf
		name := strings.TrimSuffix(filepath.Base(f), ".pickle.gz")
		if conf != "" {
			name += "/" + conf
		}
		t.Run(name, func(t *testing.T) {
			snap, err := trace.ReadFile(f, trace.ReadOptions{})
			if err != nil {
				t.Fatal(err)
			}
			ops := trace.BuildOps(snap.DeviceTraces[0])
			recorded := simReplay(t, conf, &ops, workload.SegmentAddresses(snap.DeviceTraces[0]))

			cfg, _ := allocator.ParseConfig(conf)
			ag, err := allocator.New(dev, cfg, allocator.WithHistory(4_000_000))
			if err != nil {
				t.Fatal(err)
			}
			rg, err := workload.Replay(&ops, ag, workload.ReplayOptions{})
			if err != nil {
				t.Fatal(err)
			}
			gpuSnap := ag.Snapshot()
			if err := ag.Close(); err != nil && !errors.Is(err, allocator.ErrLiveBlocks) {
				t.Fatal(err)
			}
			same := simReplay(t, conf, &ops, workload.SegmentAddresses(gpuSnap.DeviceTraces[0]))
			t.Logf("gpu-replay %s: ops %d; peak reserved: cuda %d MiB, sim at the GPU's addresses %d MiB, sim at the recorded addresses %d MiB; peak allocated cuda %d MiB; device mallocs cuda %d sim %d; cuda %.0f ns/op",
				name, rg.Ops, rg.PeakReserved>>20, same.PeakReserved>>20, recorded.PeakReserved>>20, rg.PeakAllocated>>20, rg.DeviceMallocs, same.DeviceMallocs, rg.NsPerOp())
			fmt.Printf("gpu-replay %s: peak_reserved_cuda=%d peak_reserved_sim_same_addresses=%d peak_reserved_sim_recorded_addresses=%d\n",
				name, rg.PeakReserved, same.PeakReserved, recorded.PeakReserved)
			if rg.PeakReserved != same.PeakReserved || rg.PeakAllocated != same.PeakAllocated {
				t.Errorf("the GPU replay (peaks %d/%d) differs from the simulated device's at the same addresses (%d/%d)",
					rg.PeakAllocated, rg.PeakReserved, same.PeakAllocated, same.PeakReserved)
			}
		})
	}
}

// TestGPUAsyncBackend exercises backend:cudaMallocAsync on the device.
func TestGPUAsyncBackend(t *testing.T) {
	dev := openGPU(t)
	a := newAllocator(t, dev, "backend:cudaMallocAsync")
	s, _ := dev.StreamCreate()
	defer dev.StreamDestroy(s)
	var ps []cudart.Ptr
	for i := range 1000 {
		p, err := a.Malloc(uint64(1+i*4096), s)
		if err != nil {
			t.Fatal(err)
		}
		if err := dev.MemsetAsync(p, 1, uint64(1+i*4096), s); err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	for _, p := range ps {
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	st := a.Stats()
	t.Logf("gpu-async: device mallocs %d, peak allocated %d, reserved now %d", st.NumDeviceAlloc, st.AllocatedBytes[0].Peak, st.ReservedBytes[0].Current)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}

// readBack waits for streams, then reads a window of every 2 MiB of the
// size bytes at p and reports how many hold anything but v.
func readBack(t *testing.T, dev cudart.Device, streams []cudart.Stream, p cudart.Ptr, size uint64, v byte) int {
	t.Helper()
	for _, s := range streams {
		if err := dev.StreamSynchronize(s); err != nil {
			t.Fatal(err)
		}
	}
	buf := make([]byte, 4*kiB)
	corrupt := 0
	for off := uint64(0); off < size; off += 2 * miB {
		b := buf[:min(uint64(len(buf)), size-off)]
		if err := dev.MemcpyDtoH(b, p+cudart.Ptr(off)); err != nil {
			t.Fatal(err)
		}
		for i, got := range b {
			if got != v {
				if corrupt++; corrupt <= 5 {
					t.Logf("block %#x byte %d is %#x, want %#x", uint64(p), off+uint64(i), got, v)
				}
				break
			}
		}
	}
	return corrupt
}
