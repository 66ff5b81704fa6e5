package gputest

import (
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/pinned"
	"github.com/allocd/allocd/simdev"
)

// TestGPUPinnedHugeAlloc: cudaHostAlloc's refusal of a request larger than
// the host can page-lock is an error wrapping ErrOutOfMemory, and the
// allocator works on afterwards.
func TestGPUPinnedHugeAlloc(t *testing.T) {
	testPinnedHugeAlloc(t, openGPU(t))
}

// TestPinnedHugeAllocOnSim runs the same on the simulated device.
func TestPinnedHugeAllocOnSim(t *testing.T) {
	dev, err := simdev.New(simdev.Config{Capacity: 1 << 30, Backed: true})
	if err != nil {
		t.Fatal(err)
	}
	testPinnedHugeAlloc(t, dev)
}

func testPinnedHugeAlloc(t *testing.T, dev pinned.Device) {
	h := newPinned(t, dev)
	defer h.Close()
	for _, n := range []int{1 << 40, 1<<40 + 1, 1 << 50, 1 << 62, pinned.MaxSize - 1} {
		if b, err := h.Alloc(n); !errors.Is(err, cudart.ErrOutOfMemory) {
			t.Errorf("Alloc(%d) = %d bytes, %v; want ErrOutOfMemory", n, b.Len(), err)
		} else {
			t.Logf("Alloc(%d): %v", n, err)
		}
	}
	b, err := h.Alloc(1 << 20)
	if err != nil {
		t.Fatalf("Alloc after the refusals: %v", err)
	}
	if err := h.Free(b); err != nil {
		t.Fatal(err)
	}
	if err := h.Check(); err != nil {
		t.Fatal(err)
	}
}

// TestGPUPinnedStreams: RecordStream refuses a stream that does not exist
// or was destroyed, and a buffer whose recorded stream is destroyed before
// Free (with a copy queued on it) is freed, after that copy.
func TestGPUPinnedStreams(t *testing.T) {
	testPinnedStreams(t, openGPU(t))
}

// TestPinnedStreamsOnSim runs the same on the simulated device.
func TestPinnedStreamsOnSim(t *testing.T) {
	dev, err := simdev.New(simdev.Config{Capacity: 1 << 30, Backed: true, ManualEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	testPinnedStreams(t, dev)
}

func testPinnedStreams(t *testing.T, dev pinnedDevice) {
	h := newPinned(t, dev)
	defer h.Close()
	gone, err := dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.StreamDestroy(gone); err != nil {
		t.Fatal(err)
	}
	b, err := h.Alloc(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []cudart.Stream{999, gone} {
		if err := h.RecordStream(b, s); !errors.Is(err, pinned.ErrInvalidStream) {
			t.Errorf("RecordStream(%#x) = %v, want ErrInvalidStream", uint64(s), err)
		}
	}
	if err := h.Free(b); err != nil {
		t.Fatalf("Free after refused RecordStreams: %v", err)
	}

	s, err := dev.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	const n = 64 << 20
	d, err := dev.Malloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(d)
	b, err = h.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	for i := range b.Bytes() {
		b.Bytes()[i] = byte(i * 13)
	}
	if err := h.CopyToDevice(d, b, s); err != nil {
		t.Fatal(err)
	}
	if err := dev.StreamDestroy(s); err != nil {
		t.Fatal(err)
	}
	if err := h.Free(b); err != nil {
		t.Fatalf("Free of a buffer whose stream was destroyed: %v", err)
	}
	if st := h.Stats(); st.DestroyedStreamSyncs != 1 || st.PendingEvents != 0 || st.Allocation.Current != 0 {
		t.Errorf("after Free: %d syncs, %d pending, %d in use; want 1, 0, 0", st.DestroyedStreamSyncs, st.PendingEvents, st.Allocation.Current)
	}
	got := make([]byte, n)
	if err := dev.MemcpyDtoH(got, d); err != nil {
		t.Fatal(err)
	}
	for i, c := range got {
		if c != byte(i*13) {
			t.Fatalf("byte %d on the device is %d, want %d: the copy did not read the buffer as it was at Free", i, c, byte(i*13))
		}
	}
	b2, err := h.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	if dataPtr(b2) != dataPtr(b) {
		t.Error("the block was not reused")
	}
	if err := h.Free(b2); err != nil {
		t.Fatal(err)
	}
	if err := h.Check(); err != nil {
		t.Fatal(err)
	}
}
