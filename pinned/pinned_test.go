package pinned

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

func newSim(t testing.TB, manual bool) *simdev.Sim {
	t.Helper()
	s, err := simdev.New(simdev.Config{Capacity: 1 << 30, Backed: true, ManualEvents: manual})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// newAlloc returns an allocator over dev whose Check runs at cleanup and
// whose Close must return every byte of host memory.
func newAlloc(t testing.TB, dev *simdev.Sim, cfg Config) *Allocator {
	t.Helper()
	a, err := New(dev, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.Check(); err != nil {
			t.Errorf("Check at cleanup: %v", err)
		}
		if err := a.Close(); err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrLiveBuffers) {
			t.Errorf("Close: %v", err)
		}
		if c := dev.HostCounters(); c.LiveHostAllocations != 0 || c.LiveHostBytes != 0 {
			t.Errorf("after Close the device still holds %d host allocations (%d bytes)", c.LiveHostAllocations, c.LiveHostBytes)
		}
	})
	return a
}

func mustCheck(t testing.TB, a *Allocator) {
	t.Helper()
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
}

func TestRoundSize(t *testing.T) {
	for _, c := range []struct {
		n    uint64
		d    int
		size uint64
	}{
		{1, 1, 1}, {2, 1, 2}, {3, 1, 4}, {4096, 1, 4096}, {4097, 1, 8192}, {5 << 20, 1, 8 << 20},
		{3, 4, 3}, {4097, 4, 5120}, {5 << 20, 4, 5 << 20}, {(5 << 20) + 1, 4, 6 << 20}, {(7 << 20) + 1, 4, 8 << 20},
		{(1 << 20) + 1, 2, 3 << 19}, {MaxSize, 1, MaxSize},
	} {
		size, class := RoundSize(c.n, c.d)
		if size != c.size {
			t.Errorf("RoundSize(%d, %d) = %d, want %d", c.n, c.d, size, c.size)
		}
		if s2, c2 := RoundSize(size, c.d); s2 != size || c2 != class {
			t.Errorf("RoundSize(%d, %d) = class %d; its size gives %d, class %d", c.n, c.d, class, s2, c2)
		}
	}
	// Classes are ordered with sizes.
	for _, d := range []int{1, 2, 4, 8, 64} {
		prevSize, prevClass := uint64(0), -1
		for n := uint64(1); n < 1<<16; n += 1 + n/7 {
			size, class := RoundSize(n, d)
			if size < n || (size > prevSize) != (class > prevClass) {
				t.Fatalf("d=%d n=%d: size %d class %d after size %d class %d", d, n, size, class, prevSize, prevClass)
			}
			prevSize, prevClass = size, class
		}
	}
}

func TestAllocFreeReuse(t *testing.T) {
	dev := newSim(t, false)
	a := newAlloc(t, dev, DefaultConfig())
	b, err := a.Alloc(3000)
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Bytes()) != 3000 || cap(b.Bytes()) != 3000 || b.Len() != 3000 {
		t.Fatalf("Bytes len %d cap %d", len(b.Bytes()), cap(b.Bytes()))
	}
	p0 := &b.Bytes()[0]
	mustCheck(t, a)
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); !errors.Is(err, ErrInvalidBuffer) {
		t.Fatalf("double free = %v, want ErrInvalidBuffer", err)
	}
	b2, err := a.Alloc(4096) // same class
	if err != nil {
		t.Fatal(err)
	}
	if &b2.Bytes()[0] != p0 {
		t.Error("a free block of the class was not reused")
	}
	if err := a.RecordStream(b, 0); !errors.Is(err, ErrInvalidBuffer) {
		t.Errorf("RecordStream on a stale Buffer = %v, want ErrInvalidBuffer", err)
	}
	st := a.Stats()
	if st.NumHostAlloc != 1 || st.Allocation.Current != 1 || st.AllocatedBytes.Current != 4096 || st.RequestedBytes.Current != 4096 {
		t.Errorf("stats %+v", st)
	}
	m := st.Map()
	if m["num_host_alloc"] != 1 || m["allocation.allocated"] != 2 || m["segment.current"] != 1 || m["reserved_bytes.peak"] != 4096 || m["host_alloc_time.count"] != 1 {
		t.Errorf("Map = %v", m)
	}
	if len(m) != 28 {
		t.Errorf("Map has %d keys, want 28 (host_memory_stats())", len(m))
	}
	z, err := a.Alloc(0)
	if err != nil || z.Bytes() != nil || a.Free(z) != nil {
		t.Errorf("Alloc(0) = %v, %v", z, err)
	}
	if _, err := a.Alloc(-1); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("Alloc(-1) = %v", err)
	}
	other := newAlloc(t, dev, DefaultConfig())
	if err := other.Free(b2); !errors.Is(err, ErrInvalidBuffer) {
		t.Errorf("Free on another allocator = %v, want ErrInvalidBuffer", err)
	}
	mustCheck(t, a)
	if err := a.Free(b2); err != nil {
		t.Fatal(err)
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.Segment.Current != 0 || st.NumHostFree != 1 || st.HostFreeTime.Count != 1 {
		t.Errorf("after EmptyCache %+v", st)
	}
	if c := dev.HostCounters(); c.LiveHostAllocations != 0 {
		t.Errorf("EmptyCache left %d host allocations", c.LiveHostAllocations)
	}
}

// TestBufferOwnership: Free and the copy helpers take a Buffer only from
// the allocator whose block it names, while that allocator holds the block:
// not from another allocator, not once EmptyCache returned the block to the
// system, not after Close.
func TestBufferOwnership(t *testing.T) {
	dev := newSim(t, false)
	a := newAlloc(t, dev, DefaultConfig())
	other := newAlloc(t, dev, DefaultConfig())
	b, err := a.Alloc(100)
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{other.Free(b), other.RecordStream(b, 1), other.CopyToDevice(0x1000, b, 1)} {
		if !errors.Is(err, ErrInvalidBuffer) || !strings.Contains(err.Error(), "not from this allocator") {
			t.Errorf("another allocator's Buffer: %v, want ErrInvalidBuffer (not from this allocator)", err)
		}
	}
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); !errors.Is(err, ErrInvalidBuffer) || !strings.Contains(err.Error(), "not from this allocator") {
		t.Errorf("Free of a Buffer whose block went back to the system: %v, want ErrInvalidBuffer (not from this allocator)", err)
	}
	live, err := a.Alloc(100)
	if err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if err := a.Close(); !errors.Is(err, ErrLiveBuffers) {
		t.Fatalf("Close with a live buffer = %v, want ErrLiveBuffers", err)
	}
	if err := a.Free(live); !errors.Is(err, ErrClosed) {
		t.Errorf("Free after Close = %v, want ErrClosed", err)
	}
	if live.blk.owner.Load() != nil {
		t.Error("Close left the block's owner set")
	}
	if _, err := a.Alloc(100); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Close = %v, want ErrClosed", err)
	}
}

// TestReuseWaitsForStream: a buffer freed while its copy is queued is not
// handed out again until the stream has run the copy, and the device gets
// the bytes the buffer held at Free.
func TestReuseWaitsForStream(t *testing.T) {
	dev := newSim(t, true)
	a := newAlloc(t, dev, DefaultConfig())
	s, _ := dev.StreamCreate()
	d, _ := dev.Malloc(1 << 20)
	b, _ := a.Alloc(1 << 20)
	for i := range b.Bytes() {
		b.Bytes()[i] = 0xAB
	}
	if err := a.CopyToDevice(d, b, s); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if st := a.Stats(); st.PendingEvents != 1 || st.Allocation.Current != 1 {
		t.Fatalf("after Free: %+v", st)
	}
	b2, _ := a.Alloc(1 << 20)
	if &b2.Bytes()[0] == &b.Bytes()[0] {
		t.Fatal("a buffer with a queued copy was handed out again")
	}
	for i := range b2.Bytes() {
		b2.Bytes()[i] = 0xCD
	}
	dev.CompleteStream(s)
	b3, _ := a.Alloc(1 << 20)
	if &b3.Bytes()[0] != &b.Bytes()[0] {
		t.Fatal("the block was not reused once its stream completed")
	}
	got := make([]byte, 1<<20)
	if err := dev.MemcpyDtoH(got, d); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, bytes.Repeat([]byte{0xAB}, 1<<20)) {
		t.Error("the device did not get the buffer's bytes")
	}
	mustCheck(t, a)
	// Close waits for events and frees live buffers too.
	if err := a.RecordStream(b3, s); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); !errors.Is(err, ErrLiveBuffers) {
		t.Errorf("Close with live buffers = %v, want ErrLiveBuffers", err)
	}
	if _, err := a.Alloc(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Alloc after Close = %v", err)
	}
}

// TestCopyFromDevice: the bytes are there once the stream has run the copy.
func TestCopyFromDevice(t *testing.T) {
	dev := newSim(t, true)
	a := newAlloc(t, dev, DefaultConfig())
	s, _ := dev.StreamCreate()
	d, _ := dev.Malloc(4096)
	_ = dev.MemsetAsync(d, 7, 4096, s)
	b, _ := a.Alloc(100)
	if err := a.CopyFromDevice(b, d, s); err != nil {
		t.Fatal(err)
	}
	if err := dev.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b.Bytes(), bytes.Repeat([]byte{7}, 100)) {
		t.Error("CopyFromDevice did not land")
	}
	if err := a.CopyFromDevice(b, 12345, s); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("copy from a bad pointer = %v", err)
	}
	_ = a.Free(b)
	mustCheck(t, a)
	if st := a.Stats(); st.PendingEvents != 1 {
		t.Errorf("pending = %d, want 1 (the stream that copied)", st.PendingEvents)
	}
}

func TestOutOfMemoryReleasesCache(t *testing.T) {
	dev := newSim(t, false)
	dev.SetHostCapacity(3 << 20)
	a := newAlloc(t, dev, DefaultConfig())
	b, _ := a.Alloc(2 << 20)
	_ = a.Free(b)
	c, err := a.Alloc(1<<20 + 1) // class 2 MiB: hits the cached block
	if err != nil {
		t.Fatal(err)
	}
	_ = a.Free(c)
	d, err := a.Alloc(3 << 20) // 4 MiB: too big
	if !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Fatalf("Alloc past the capacity = %v, %v", d, err)
	}
	mustCheck(t, a)
	if st := a.Stats(); st.Segment.Current != 0 {
		t.Errorf("the OOM path kept %d cached segments", st.Segment.Current)
	}
	e, err := a.Alloc(3 << 19) // 2 MiB class after the cache was emptied
	if err != nil {
		t.Fatal(err)
	}
	dev.Faults().FailHostAlloc(1, nil) // one refusal: the retry succeeds
	f, err := a.Alloc(1 << 20)
	if err != nil {
		t.Fatalf("one refusal then room: %v", err)
	}
	_ = a.Free(f)
	injected := errors.New("injected")
	dev.Faults().FailHostAlloc(1, injected) // not an OOM: no retry
	if _, err := a.Alloc(1 << 19); !errors.Is(err, injected) {
		t.Errorf("injected failure: %v", err)
	}
	mustCheck(t, a)
	_ = a.Free(e)
}

// TestFreeEventFailureKeepsBuffer: when recording an event on a live
// stream fails, Free returns the error and the buffer stays allocated with
// its streams.
func TestFreeEventFailureKeepsBuffer(t *testing.T) {
	sim := newSim(t, true)
	dev := &recordFailDevice{Sim: sim}
	a, err := New(dev, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	s1, _ := sim.StreamCreate()
	s2, _ := sim.StreamCreate()
	b, _ := a.Alloc(10)
	_ = a.RecordStream(b, s1)
	_ = a.RecordStream(b, s2)
	_ = a.RecordStream(b, s2)
	dev.fail = s2
	if err := a.Free(b); !errors.Is(err, errRecordFails) {
		t.Fatalf("Free with a failing event record = %v", err)
	}
	mustCheck(t, a)
	if st := a.Stats(); st.PendingEvents != 0 || st.Allocation.Current != 1 || b.blk.nstreams != 2 || st.DestroyedStreamSyncs != 0 {
		t.Fatalf("after a failed Free: %d streams, %+v", b.blk.nstreams, st)
	}
	dev.fail = 0
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.PendingEvents != 2 {
		t.Errorf("%d pending events, want 2", st.PendingEvents)
	}
	mustCheck(t, a)
}

var errRecordFails = errors.New("event record fails")

// recordFailDevice fails EventRecord on one live stream.
type recordFailDevice struct {
	*simdev.Sim
	fail cudart.Stream
}

func (d *recordFailDevice) EventRecord(e cudart.Event, s cudart.Stream) error {
	if s == d.fail && s != 0 {
		return errRecordFails
	}
	return d.Sim.EventRecord(e, s)
}

func TestCachedPathMakesNoDeviceCall(t *testing.T) {
	dev := newSim(t, false)
	a := newAlloc(t, dev, DefaultConfig())
	b, _ := a.Alloc(1 << 16)
	_ = a.Free(b)
	before, hb := dev.Counters(), dev.HostCounters()
	allocs := testing.AllocsPerRun(1000, func() {
		b, err := a.Alloc(1 << 16)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Free(b); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("cached Alloc+Free allocates %.1f times", allocs)
	}
	if dev.Counters() != before || dev.HostCounters() != hb {
		t.Error("cached Alloc+Free called the device")
	}
}

func TestNewValidates(t *testing.T) {
	dev := newSim(t, false)
	if _, err := New(nil, DefaultConfig()); err == nil {
		t.Error("New(nil) succeeded")
	}
	if _, err := New(dev, Config{RoundupDivisions: 3}); !errors.Is(err, ErrConfig) {
		t.Errorf("divisions 3: %v", err)
	}
	if _, err := New(dev, Config{RoundupDivisions: 1, Flags: 16}); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("flags 16: %v", err)
	}
}

func TestParseConfig(t *testing.T) {
	cfg, err := ParseConfig("expandable_segments:True, pinned_roundup_power2_divisions:4,roundup_power2_divisions:[256:1,>:8],pinned_use_cuda_host_register:False")
	if err != nil || cfg.RoundupDivisions != 4 || cfg.Flags != DefaultFlags {
		t.Fatalf("ParseConfig = %+v, %v", cfg, err)
	}
	for _, bad := range []string{
		"pinned_roundup_power2_divisions:3", "pinned_roundup_power2_divisions:[1]", "pinned_use_cuda_host_register:True",
		"pinned_use_background_threads:True", "pinned_num_register_threads:8", "pinned_bogus:1", "pinned_roundup_power2_divisions:1,",
		"pinned_roundup_power2_divisions:1,pinned_roundup_power2_divisions:2", ":", "a:[1", "pinned_use_cuda_host_register:maybe",
	} {
		if _, err := ParseConfig(bad); !errors.Is(err, ErrConfig) {
			t.Errorf("ParseConfig(%q) = %v, want ErrConfig", bad, err)
		}
	}
	t.Setenv("ALLOCD_CONF", "pinned_roundup_power2_divisions:2")
	if cfg, err := ConfigFromEnv(); err != nil || cfg.RoundupDivisions != 2 {
		t.Errorf("ConfigFromEnv = %+v, %v", cfg, err)
	}
}

func TestResetStats(t *testing.T) {
	dev := newSim(t, false)
	a := newAlloc(t, dev, DefaultConfig())
	b, _ := a.Alloc(100)
	c, _ := a.Alloc(1000)
	_ = a.Free(c)
	a.ResetPeakStats()
	if st := a.Stats(); st.AllocatedBytes.Peak != 128 {
		t.Errorf("peak after reset = %d, want 128", st.AllocatedBytes.Peak)
	}
	a.ResetAccumulatedStats()
	if st := a.Stats(); st.NumHostAlloc != 0 || st.Allocation.Allocated != 0 || st.Allocation.Current != 1 {
		t.Errorf("after ResetAccumulatedStats %+v", st)
	}
	mustCheck(t, a)
	_ = a.Free(b)
}

// nopDevice is a device whose copies do nothing and whose events are
// complete at once, so that allocation counts are the allocator's alone.
type nopDevice struct{ events cudart.Event }

func (d *nopDevice) Info() cudart.Info { return cudart.Info{Name: "nop"} }
func (d *nopDevice) HostAlloc(n uint64, _ cudart.HostAllocFlags) ([]byte, error) {
	return make([]byte, n), nil
}
func (d *nopDevice) FreeHost([]byte) error                                            { return nil }
func (d *nopDevice) MemcpyHtoDAsync(cudart.Ptr, []byte, cudart.Stream) error          { return nil }
func (d *nopDevice) MemcpyDtoHAsync([]byte, cudart.Ptr, cudart.Stream) error          { return nil }
func (d *nopDevice) MemcpyDtoDAsync(_, _ cudart.Ptr, _ uint64, _ cudart.Stream) error { return nil }
func (d *nopDevice) EventCreate() (cudart.Event, error)                               { d.events++; return d.events, nil }
func (d *nopDevice) EventRecord(cudart.Event, cudart.Stream) error                    { return nil }
func (d *nopDevice) EventQuery(cudart.Event) (bool, error)                            { return true, nil }
func (d *nopDevice) EventSynchronize(cudart.Event) error                              { return nil }
func (d *nopDevice) EventDestroy(cudart.Event) error                                  { return nil }
func (d *nopDevice) Synchronize() error                                               { return nil }

// TestCopyPathAllocatesNothing: Alloc, a copy each way and Free, in a
// steady state where the freed block's event has completed by the next
// Alloc, allocate nothing on the Go heap in the allocator (the next Alloc
// queries the event and reuses the block).
func TestCopyPathAllocatesNothing(t *testing.T) {
	a, err := New(&nopDevice{}, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	const s, d = cudart.Stream(7), cudart.Ptr(0x1000)
	round := func() {
		b, err := a.Alloc(1 << 16)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.CopyToDevice(d, b, s); err != nil {
			t.Fatal(err)
		}
		if err := a.CopyFromDevice(b, d, s+1); err != nil {
			t.Fatal(err)
		}
		if err := a.Free(b); err != nil {
			t.Fatal(err)
		}
	}
	round()
	round()
	if n := testing.AllocsPerRun(1000, round); n != 0 {
		t.Errorf("Alloc, two copies and Free allocate %.1f times", n)
	}
	if st := a.Stats(); st.NumHostAlloc != 1 || st.PendingEvents != 2 {
		t.Errorf("%d cudaHostAlloc calls (want 1: the block is reused), %d events pending (want 2)", st.NumHostAlloc, st.PendingEvents)
	}
	if err := a.Check(); err != nil {
		t.Error(err)
	}
}

// TestConcurrentUse: goroutines on their own streams allocate, copy, free
// and empty the cache at once (run with -race); every buffer round-trips
// its bytes and the structures check out.
func TestConcurrentUse(t *testing.T) {
	dev := newSim(t, false)
	a := newAlloc(t, dev, DefaultConfig())
	const workers, ops = 4, 500
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			errs <- func() error {
				s, err := dev.StreamCreate()
				if err != nil {
					return err
				}
				d, err := dev.Malloc(64 << 10)
				if err != nil {
					return err
				}
				for i := range ops {
					n := 1 + (i*7919+w*104729)%(64<<10)
					in, err := a.Alloc(n)
					if err != nil {
						return err
					}
					for j := range in.Bytes() {
						in.Bytes()[j] = byte(i + j + w)
					}
					if err := a.CopyToDevice(d, in, s); err != nil {
						return err
					}
					out, err := a.Alloc(n)
					if err != nil {
						return err
					}
					if err := a.CopyFromDevice(out, d, s); err != nil {
						return err
					}
					if err := dev.StreamSynchronize(s); err != nil {
						return err
					}
					if !bytes.Equal(in.Bytes(), out.Bytes()) {
						return errors.New("a round trip changed the bytes")
					}
					if err := errors.Join(a.Free(in), a.Free(out)); err != nil {
						return err
					}
					if i%100 == 99 {
						if err := a.EmptyCache(); err != nil {
							return err
						}
					}
				}
				return nil
			}()
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	mustCheck(t, a)
}

// FuzzParseConfig feeds arbitrary strings to ParseConfig: it never
// panics; a refusal is a *ConfigError wrapping ErrConfig and returns the
// defaults; an accepted configuration makes an allocator that hands out
// and takes back a buffer and passes Check.
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		"", "pinned_roundup_power2_divisions:4", "pinned_use_cuda_host_register:False",
		"pinned_use_background_threads:True", "expandable_segments:True,pinned_roundup_power2_divisions:64",
		"pinned_roundup_power2_divisions:3", "pinned_x:1", "pinned_roundup_power2_divisions:[1:2]", ":,",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		cfg, err := ParseConfig(s)
		if err != nil {
			var ce *ConfigError
			if !errors.As(err, &ce) || !errors.Is(err, ErrConfig) {
				t.Fatalf("ParseConfig(%q): %v is not a *ConfigError wrapping ErrConfig", s, err)
			}
			if cfg != DefaultConfig() {
				t.Fatalf("ParseConfig(%q) refused but returned %+v, not the defaults", s, cfg)
			}
			return
		}
		a := newAlloc(t, newSim(t, false), cfg)
		buf, err := a.Alloc(5000)
		if err != nil {
			t.Fatalf("config %q: alloc: %v", s, err)
		}
		if err := a.Free(buf); err != nil {
			t.Fatalf("config %q: free: %v", s, err)
		}
	})
}
