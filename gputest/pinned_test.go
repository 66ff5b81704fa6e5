package gputest

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/pinned"
	"github.com/allocd/allocd/simdev"
)

// pinnedDevice is what the pinned tests need: a device for the device
// allocator and for the host one.
type pinnedDevice interface {
	cudart.Device
	cudart.HostDevice
}

func newPinned(t testing.TB, dev pinned.Device) *pinned.Allocator {
	t.Helper()
	h, err := pinned.New(dev, pinned.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func dataPtr(b pinned.Buffer) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b.Bytes()))) }

// TestGPUPinnedReuseWaitsForCopy: a pinned buffer freed while its async
// copy is still queued behind a slow stream is not handed out again before
// the copy completes, and the copy reads the bytes the buffer held at Free
// (H2D) or lands in a block nobody else holds (D2H).
func TestGPUPinnedReuseWaitsForCopy(t *testing.T) {
	runPinnedReuse(t, openGPU(t), 256<<20, 64<<20, 2000)
}

// TestPinnedReuseWaitsForCopyOnSim runs the same on a backed Sim whose
// events and copies wait until the test synchronises the stream.
func TestPinnedReuseWaitsForCopyOnSim(t *testing.T) {
	dev, err := simdev.New(simdev.Config{Capacity: 1 << 30, Backed: true, ManualEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	runPinnedReuse(t, dev, 1<<20, 64<<10, 1)
}

// runPinnedReuse keeps a stream busy with memsets of big bytes, queues a
// copy of n bytes behind them and frees its pinned buffer at once.
func runPinnedReuse(t *testing.T, dev pinnedDevice, big, n uint64, memsets int) {
	h := newPinned(t, dev)
	defer h.Close()
	slow, _ := dev.StreamCreate()
	defer dev.StreamDestroy(slow)
	busy, err := dev.Malloc(big)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(busy)
	d, err := dev.Malloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(d)

	// Two cached blocks of the class, so that the Alloc under test takes
	// one from the free list instead of calling cudaHostAlloc while the
	// slow stream runs.
	var warm [2]pinned.Buffer
	for i := range warm {
		if warm[i], err = h.Alloc(int(n)); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range warm {
		if err := h.Free(b); err != nil {
			t.Fatal(err)
		}
	}

	for _, dir := range []string{"H2D", "D2H"} {
		// Keep the stream busy: on the GPU 2000 memsets of 256 MiB queued
		// before the copy.
		for range memsets {
			if err := dev.MemsetAsync(busy, 0x5a, big, slow); err != nil {
				t.Fatal(err)
			}
		}
		buf, err := h.Alloc(int(n))
		if err != nil {
			t.Fatal(err)
		}
		for i := range buf.Bytes() {
			buf.Bytes()[i] = byte(i*13 + 1)
		}
		want := bytes.Clone(buf.Bytes())
		if dir == "H2D" {
			err = h.CopyToDevice(d, buf, slow)
		} else {
			if err := dev.MemsetAsync(d, 0xEE, n, slow); err != nil {
				t.Fatal(err)
			}
			err = h.CopyFromDevice(buf, d, slow)
		}
		if err != nil {
			t.Fatal(err)
		}
		marker, _ := dev.EventCreate()
		if err := dev.EventRecord(marker, slow); err != nil {
			t.Fatal(err)
		}
		old := dataPtr(buf)
		if err := h.Free(buf); err != nil {
			t.Fatal(err)
		}
		again, err := h.Alloc(int(n))
		if err != nil {
			t.Fatal(err)
		}
		if done, err := dev.EventQuery(marker); err != nil || done {
			t.Fatalf("%s: the slow stream finished before the test could check reuse (done %v, err %v)", dir, done, err)
		}
		if dataPtr(again) == old {
			t.Fatalf("%s: a pinned block was handed out again while its copy was still queued", dir)
		}
		for i := range again.Bytes() {
			again.Bytes()[i] = 0xCC // what a wrongly reused block would carry
		}
		if err := dev.StreamSynchronize(slow); err != nil {
			t.Fatal(err)
		}
		if dir == "H2D" {
			got := make([]byte, n)
			if err := dev.MemcpyDtoH(got, d); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("H2D: the device did not get the bytes the buffer held when it was freed")
			}
		}
		third, err := h.Alloc(int(n))
		if err != nil {
			t.Fatal(err)
		}
		if dataPtr(third) != old {
			t.Errorf("%s: after the stream finished the block was not reused", dir)
		}
		if dir == "D2H" && !bytes.Equal(third.Bytes(), bytes.Repeat([]byte{0xEE}, int(n))) {
			t.Errorf("D2H: the copy did not land in the freed block")
		}
		_ = dev.EventDestroy(marker)
		for _, b := range []pinned.Buffer{again, third} {
			if err := h.Free(b); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("gpu-pinned %s: block %#x kept while the slow stream ran, reused after", dir, old)
	}
	if st := h.Stats(); st.NumHostAlloc != 2 {
		t.Errorf("%d cudaHostAlloc calls, want 2 (the two warm blocks serve every Alloc)", st.NumHostAlloc)
	}
	if err := h.Check(); err != nil {
		t.Fatal(err)
	}
}

// TestGPUPinnedRoundTrip: 100,000 random operations on four streams
// (ALLOCD_PINNED_OPS to change) move data host → device → host through
// pooled pinned buffers that are freed as soon as their copy is queued;
// every byte comes back intact.
func TestGPUPinnedRoundTrip(t *testing.T) {
	dev := openGPU(t)
	runPinnedRoundTrip(t, dev, envInt("ALLOCD_PINNED_OPS", 100_000), 4<<20)
}

// TestPinnedRoundTripOnSim runs the same on a backed Sim whose events and
// copies wait for the test to complete their streams.
func TestPinnedRoundTripOnSim(t *testing.T) {
	dev, err := simdev.New(simdev.Config{Capacity: 4 << 30, Backed: true, ManualEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	ops := 5000
	if testing.Short() {
		ops = 1000
	}
	runPinnedRoundTrip(t, dev, ops, 256<<10)
}

type roundTrip struct {
	back pinned.Buffer
	seed uint64
}

// fill writes the pattern of seed into b: 8 bytes per word, different for
// every seed and offset, cheap enough for 100,000 buffers of up to 4 MiB.
func fill(b []byte, seed uint64) {
	v := seed*0x9E3779B97F4A7C15 + 1
	i := 0
	for ; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], v^uint64(i)*0xBF58476D1CE4E5B9)
	}
	for ; i < len(b); i++ {
		b[i] = byte(v >> (i % 8 * 8))
	}
}

// filled reports whether b holds fill's pattern of seed.
func filled(b []byte, seed uint64) bool {
	v := seed*0x9E3779B97F4A7C15 + 1
	i := 0
	for ; i+8 <= len(b); i += 8 {
		if binary.LittleEndian.Uint64(b[i:]) != v^uint64(i)*0xBF58476D1CE4E5B9 {
			return false
		}
	}
	for ; i < len(b); i++ {
		if b[i] != byte(v>>(i%8*8)) {
			return false
		}
	}
	return true
}

func runPinnedRoundTrip(t *testing.T, dev pinnedDevice, ops int, maxSize int) {
	a := newAllocator(t, dev, "")
	defer a.Close()
	h := newPinned(t, dev)
	var streams [4]cudart.Stream
	for i := range streams {
		s, err := dev.StreamCreate()
		if err != nil {
			t.Fatal(err)
		}
		defer dev.StreamDestroy(s)
		streams[i] = s
	}
	rng := rand.New(rand.NewPCG(14, 100))
	pending := make([][]roundTrip, len(streams))
	verify := func(si int) {
		if err := dev.StreamSynchronize(streams[si]); err != nil {
			t.Fatal(err)
		}
		for _, rt := range pending[si] {
			if !filled(rt.back.Bytes(), rt.seed) {
				t.Fatalf("stream %d: %d bytes (seed %d) did not come back intact", si, rt.back.Len(), rt.seed)
			}
			if err := h.Free(rt.back); err != nil {
				t.Fatal(err)
			}
		}
		pending[si] = pending[si][:0]
	}
	var moved int64
	for op := range ops {
		si := rng.IntN(len(streams))
		s := streams[si]
		n := int(math.Exp(math.Log(512) + rng.Float64()*(math.Log(float64(maxSize))-math.Log(512))))
		seed := uint64(op)
		src, err := h.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		fill(src.Bytes(), seed)
		d, err := a.Malloc(uint64(n), s)
		if err != nil {
			t.Fatal(err)
		}
		if err := h.CopyToDevice(d, src, s); err != nil {
			t.Fatal(err)
		}
		if err := h.Free(src); err != nil { // at once: the copy may not have run
			t.Fatal(err)
		}
		// A buffer of the same class, scribbled on and freed: had the
		// allocator handed src's block out again, the copy above would
		// read this.
		scribble, err := h.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		clear(scribble.Bytes())
		if err := h.Free(scribble); err != nil {
			t.Fatal(err)
		}
		back, err := h.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		if err := h.CopyFromDevice(back, d, s); err != nil {
			t.Fatal(err)
		}
		if err := a.Free(d); err != nil { // stream-ordered on s
			t.Fatal(err)
		}
		pending[si] = append(pending[si], roundTrip{back: back, seed: seed})
		moved += 2 * int64(n)
		if len(pending[si]) >= 16 || rng.IntN(64) == 0 {
			verify(si)
		}
	}
	for si := range streams {
		verify(si)
	}
	if err := h.Check(); err != nil {
		t.Fatal(err)
	}
	st := h.Stats()
	t.Logf("pinned round trip: %d ops, %.1f GiB moved, %d cudaHostAlloc calls for %d buffers, reserved peak %d MiB",
		ops, float64(moved)/(1<<30), st.NumHostAlloc, st.Allocation.Allocated, st.ReservedBytes.Peak>>20)
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if sim, ok := dev.(*simdev.Sim); ok {
		if c := sim.HostCounters(); c.LiveHostAllocations != 0 {
			t.Errorf("Close left %d host allocations", c.LiveHostAllocations)
		}
	}
}
