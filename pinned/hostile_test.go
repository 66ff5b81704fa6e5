package pinned

import (
	"bytes"
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestHugeAllocIsOutOfMemory: a request the system cannot page-lock is an
// error wrapping cudart.ErrOutOfMemory on the simulated device, never a
// crash of the Go runtime (1 TiB) or a makeslice panic (4 EiB), and it
// leaves the allocator as it was.
func TestHugeAllocIsOutOfMemory(t *testing.T) {
	for _, c := range []struct {
		name string
		n    int
		div  int
	}{
		{"1TiB", 1 << 40, 1},
		{"1TiB+1", 1<<40 + 1, 1},
		{"4EiB", 1 << 62, 1},
		{"MaxSize-1", MaxSize - 1, 1},
		{"1TiB+1 in quarters", 1<<40 + 1, 4},
		{"MaxSize-1 in 64ths", MaxSize - 1, 64},
	} {
		t.Run(c.name, func(t *testing.T) {
			dev := newSim(t, false)
			a := newAlloc(t, dev, Config{RoundupDivisions: c.div, Flags: DefaultFlags})
			keep, err := a.Alloc(4096)
			if err != nil {
				t.Fatal(err)
			}
			cached, _ := a.Alloc(8192)
			_ = a.Free(cached)
			before := a.Stats()
			buf, err := a.Alloc(c.n)
			if !errors.Is(err, cudart.ErrOutOfMemory) {
				t.Fatalf("Alloc(%d) = %d bytes, %v; want ErrOutOfMemory", c.n, buf.Len(), err)
			}
			if buf.Len() != 0 || buf.Bytes() != nil {
				t.Errorf("a failed Alloc handed out %d bytes", buf.Len())
			}
			mustCheck(t, a)
			st := a.Stats()
			if st.Allocation != before.Allocation || st.AllocatedBytes != before.AllocatedBytes || st.RequestedBytes != before.RequestedBytes {
				t.Errorf("a failed Alloc changed the in-use statistics: %+v, was %+v", st, before)
			}
			if hc := dev.HostCounters(); hc.LiveHostBytes != 4096 {
				t.Errorf("the device holds %d bytes of host memory after the failed Alloc, want 4096 (the live buffer; the cache was released)", hc.LiveHostBytes)
			}
			if b, err := a.Alloc(100); err != nil {
				t.Errorf("Alloc after the refusal: %v", err)
			} else {
				_ = a.Free(b)
			}
			_ = a.Free(keep)
		})
	}
}

// TestAllocAboveMaxSize: a request above MaxSize is ErrTooLarge, and out
// of memory like any request the system cannot page-lock.
func TestAllocAboveMaxSize(t *testing.T) {
	a := newAlloc(t, newSim(t, false), DefaultConfig())
	for _, n := range []int{MaxSize + 1, 1<<63 - 1} {
		if _, err := a.Alloc(n); !errors.Is(err, ErrTooLarge) || !errors.Is(err, cudart.ErrOutOfMemory) {
			t.Errorf("Alloc(%d) = %v, want ErrTooLarge and ErrOutOfMemory", n, err)
		}
	}
	mustCheck(t, a)
}

// TestRecordStreamUnknownStream: RecordStream of a stream the device does
// not know is refused with ErrInvalidStream, and the buffer is unchanged:
// its Free is immediate and makes no event.
func TestRecordStreamUnknownStream(t *testing.T) {
	dev := newSim(t, true)
	a := newAlloc(t, dev, DefaultConfig())
	live, _ := dev.StreamCreate()
	gone, _ := dev.StreamCreate()
	if err := dev.StreamDestroy(gone); err != nil {
		t.Fatal(err)
	}
	for _, s := range []cudart.Stream{999, gone, cudart.Stream(1 << 63)} {
		b, err := a.Alloc(100)
		if err != nil {
			t.Fatal(err)
		}
		err = a.RecordStream(b, s)
		if !errors.Is(err, ErrInvalidStream) || !errors.Is(err, cudart.ErrInvalidValue) {
			t.Errorf("RecordStream(stream %#x) = %v, want ErrInvalidStream wrapping the device's ErrInvalidValue", uint64(s), err)
		}
		if b.blk.nstreams != 0 {
			t.Errorf("a refused RecordStream left %d streams on the buffer", b.blk.nstreams)
		}
		if err := a.Free(b); err != nil {
			t.Errorf("Free after a refused RecordStream: %v", err)
		}
		if st := a.Stats(); st.PendingEvents != 0 || st.Allocation.Current != 0 {
			t.Errorf("after Free: %d pending events, %d blocks in use; want 0, 0", st.PendingEvents, st.Allocation.Current)
		}
		mustCheck(t, a)
	}
	// A known stream is still accepted, the default stream included.
	b, _ := a.Alloc(100)
	for _, s := range []cudart.Stream{cudart.DefaultStream, live} {
		if err := a.RecordStream(b, s); err != nil {
			t.Errorf("RecordStream(stream %d) = %v", s, err)
		}
	}
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.PendingEvents != 2 {
		t.Errorf("pending events = %d, want 2", st.PendingEvents)
	}
}

// TestDestroyedStreamDoesNotPinBuffer: a stream recorded on a buffer and
// destroyed before Free does not make the buffer impossible to free. Free
// succeeds, the work the stream had queued (a copy) has run before the block
// is handed out again, the buffer's other streams are still waited for
// through the synchronisation, and Stats counts the synchronisation.
func TestDestroyedStreamDoesNotPinBuffer(t *testing.T) {
	dev := newSim(t, true)
	a := newAlloc(t, dev, DefaultConfig())
	s1, _ := dev.StreamCreate()
	s2, _ := dev.StreamCreate()
	d, _ := dev.Malloc(4096)
	b, _ := a.Alloc(4096)
	copy(b.Bytes(), bytes.Repeat([]byte{0xAB}, 4096))
	if err := a.CopyToDevice(d, b, s2); err != nil {
		t.Fatal(err)
	}
	if err := a.RecordStream(b, s1); err != nil {
		t.Fatal(err)
	}
	if err := dev.StreamDestroy(s2); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); err != nil {
		t.Fatalf("Free of a buffer whose stream was destroyed = %v", err)
	}
	mustCheck(t, a)
	st := a.Stats()
	if st.PendingEvents != 0 || st.Allocation.Current != 0 || st.DestroyedStreamSyncs != 1 {
		t.Errorf("after Free: %d pending events, %d blocks in use, %d syncs; want 0, 0, 1",
			st.PendingEvents, st.Allocation.Current, st.DestroyedStreamSyncs)
	}
	got := make([]byte, 4096)
	if err := dev.MemcpyDtoH(got, d); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, bytes.Repeat([]byte{0xAB}, 4096)) {
		t.Error("the destroyed stream's queued copy had not run when the buffer was freed")
	}
	b2, _ := a.Alloc(4096)
	if &b2.Bytes()[0] != &b.Bytes()[0] {
		t.Error("the block was not reused")
	}
	// Later frees keep working.
	if err := a.RecordStream(b2, s1); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b2); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.PendingEvents != 1 || st.DestroyedStreamSyncs != 1 {
		t.Errorf("a live stream's Free: %d pending events, %d syncs; want 1, 1", st.PendingEvents, st.DestroyedStreamSyncs)
	}
	mustCheck(t, a)
}

// TestDestroyedStreamSyncFails: when the stream is gone and the device
// cannot synchronise either, Free fails and leaves the buffer allocated
// with its streams, as for any event failure.
func TestDestroyedStreamSyncFails(t *testing.T) {
	sim := newSim(t, true)
	dev := &syncFailDevice{Sim: sim}
	a, err := New(dev, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	s, _ := sim.StreamCreate()
	b, _ := a.Alloc(10)
	if err := a.RecordStream(b, s); err != nil {
		t.Fatal(err)
	}
	_ = sim.StreamDestroy(s)
	if err := a.Free(b); !errors.Is(err, errSyncFails) {
		t.Fatalf("Free = %v, want the synchronisation's error", err)
	}
	mustCheck(t, a)
	if st := a.Stats(); st.Allocation.Current != 1 || b.blk.nstreams != 1 || st.DestroyedStreamSyncs != 0 {
		t.Errorf("after the failed Free: %d in use, %d streams, %d syncs; want 1, 1, 0", st.Allocation.Current, b.blk.nstreams, st.DestroyedStreamSyncs)
	}
	dev.ok = true
	if err := a.Free(b); err != nil {
		t.Fatalf("Free once the device synchronises = %v", err)
	}
	mustCheck(t, a)
}

var errSyncFails = errors.New("synchronize fails")

type syncFailDevice struct {
	*simdev.Sim
	ok bool
}

func (d *syncFailDevice) Synchronize() error {
	if !d.ok {
		return errSyncFails
	}
	return d.Sim.Synchronize()
}

// TestEventQueryFailureDoesNotPin: an event whose query fails does not hold
// its block, or every later miss, forever: the device is synchronised, the
// block is freed, the event dropped and the synchronisation counted. When
// the device cannot synchronise either, the error is returned and the event
// stays pending.
func TestEventQueryFailureDoesNotPin(t *testing.T) {
	sim := newSim(t, true)
	dev := &queryFailDevice{syncFailDevice: syncFailDevice{Sim: sim}, bad: map[cudart.Event]bool{}}
	a, err := New(dev, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	s, _ := sim.StreamCreate()
	b, _ := a.Alloc(64)
	_ = a.RecordStream(b, s)
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	dev.bad[a.pending[0].ev] = true
	if _, err := a.Alloc(64); !errors.Is(err, errQueryFails) {
		t.Fatalf("Alloc with a failing query and no synchronisation = %v, want the query's error", err)
	}
	if st := a.Stats(); st.PendingEvents != 1 || st.Allocation.Current != 1 {
		t.Fatalf("after the failed query: %+v", st)
	}
	mustCheck(t, a)
	dev.ok = true
	b2, err := a.Alloc(64)
	if err != nil {
		t.Fatalf("Alloc once the device synchronises = %v", err)
	}
	if &b2.Bytes()[0] != &b.Bytes()[0] {
		t.Error("the block of the failed event was not freed")
	}
	st := a.Stats()
	if st.PendingEvents != 0 || st.QueryFailureSyncs != 1 {
		t.Errorf("%d pending events, %d query-failure syncs; want 0, 1", st.PendingEvents, st.QueryFailureSyncs)
	}
	for ev := range a.idle.All() {
		if dev.bad[ev] {
			t.Error("the failed event went back to the idle list")
		}
	}
	mustCheck(t, a)
	_ = a.Free(b2)
}

var errQueryFails = errors.New("query fails")

type queryFailDevice struct {
	syncFailDevice
	bad map[cudart.Event]bool
}

func (d *queryFailDevice) EventQuery(e cudart.Event) (bool, error) {
	if d.bad[e] {
		return false, errQueryFails
	}
	return d.Sim.EventQuery(e)
}

// TestRoundSizeOutOfRange: RoundSize outside [1, MaxSize] neither panics
// (a negative shift at 0) nor wraps (a class size of 0 above 2^63): it says
// there is no class.
func TestRoundSizeOutOfRange(t *testing.T) {
	for _, n := range []uint64{0, MaxSize + 1, 1<<63 + 1, 1 << 63, ^uint64(0)} {
		for _, d := range []int{1, 4, 64} {
			if size, class := RoundSize(n, d); size != 0 || class != -1 {
				t.Errorf("RoundSize(%d, %d) = %d, class %d; want 0, -1", n, d, size, class)
			}
		}
	}
	for _, d := range []int{1, 4, 64} {
		if size, class := RoundSize(MaxSize-1, d); size != MaxSize || class != 62*d {
			t.Errorf("RoundSize(MaxSize-1, %d) = %d, class %d; want MaxSize, %d", d, size, class, 62*d)
		}
	}
}
