package allocator

import (
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// expectUnchanged runs fn, which must fail with an error matching want, and
// checks that statistics and invariants are the same before and after.
func expectUnchanged(t *testing.T, a *Allocator, want error, fn func() error) error {
	t.Helper()
	before := a.Stats()
	err := fn()
	if err == nil {
		t.Fatalf("expected an error wrapping %v, got none", want)
	}
	if !errors.Is(err, want) {
		t.Fatalf("error %q does not wrap %v", err, want)
	}
	if want == ErrOutOfMemory {
		before.NumOOMs++ // every OOM counts, and nothing else changes
	}
	after := a.Stats()
	// The device calls a failed call made (and undid) are counted.
	before.VMM, after.VMM = VMMCalls{}, VMMCalls{}
	if after != before {
		t.Errorf("stats changed by a failed call:\nbefore %+v\nafter  %+v", before, after)
	}
	mustCheck(t, a)
	return err
}

// TestBadInput covers every bad input a caller can give: each is refused
// with an error, and leaves the allocator consistent (mustCheck).
func TestBadInput(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "")
	p := mustMalloc(t, a, 4096, 0)
	q := mustMalloc(t, a, 4096, 0)
	mustFree(t, a, q)

	t.Run("free of an unknown pointer", func(t *testing.T) {
		err := expectUnchanged(t, a, ErrUnknownPointer, func() error { return a.Free(0xdead000) })
		if !strings.Contains(err.Error(), "0xdead000") {
			t.Errorf("error does not name the pointer: %v", err)
		}
	})
	t.Run("free of an interior pointer", func(t *testing.T) {
		expectUnchanged(t, a, ErrUnknownPointer, func() error { return a.Free(p + 512) })
	})
	t.Run("double free", func(t *testing.T) {
		expectUnchanged(t, a, ErrDoubleFree, func() error { return a.Free(q) })
	})
	t.Run("record stream of an unknown pointer", func(t *testing.T) {
		expectUnchanged(t, a, ErrUnknownPointer, func() error { return a.RecordStream(0xbeef000, 0) })
	})
	t.Run("malloc on a bad stream", func(t *testing.T) {
		err := expectUnchanged(t, a, ErrInvalidStream, func() error { _, err := a.Malloc(512, 12345); return err })
		if !errors.Is(err, cudart.ErrInvalidValue) {
			t.Errorf("the device's reason is not wrapped: %v", err)
		}
	})
	t.Run("record stream on a bad stream", func(t *testing.T) {
		expectUnchanged(t, a, ErrInvalidStream, func() error { return a.RecordStream(p, 777) })
	})
	t.Run("size larger than the device", func(t *testing.T) {
		err := expectUnchanged(t, a, ErrOutOfMemory, func() error { _, err := a.Malloc(2*giB, 0); return err })
		var oom *OOMError
		if !errors.As(err, &oom) || oom.Requested != 2*giB || oom.DeviceTotal != giB {
			t.Errorf("OOM error lacks the facts: %#v", oom)
		}
		if !errors.Is(err, cudart.ErrOutOfMemory) {
			t.Errorf("OOM error does not match cudart.ErrOutOfMemory")
		}
	})
	t.Run("size near 2^64", func(t *testing.T) {
		expectUnchanged(t, a, ErrOutOfMemory, func() error { _, err := a.Malloc(^uint64(0), 0); return err })
	})
	t.Run("size zero", func(t *testing.T) {
		before := a.Stats()
		z, err := a.Malloc(0, 0)
		if err != nil || z != 0 {
			t.Fatalf("Malloc(0) = %#x, %v; want the zero pointer and no error", uint64(z), err)
		}
		if err := a.Free(z); err != nil {
			t.Fatalf("Free of the zero pointer: %v", err)
		}
		if a.Stats() != before {
			t.Errorf("a zero-size allocation changed the stats")
		}
	})
	t.Run("bad config", func(t *testing.T) {
		for _, conf := range []string{
			"max_split_size_mb:10", "nonsense:1", "max_split_size_mb", "expandable_segments:yes",
			"garbage_collection_threshold:1.5", "per_process_memory_fraction:2", "roundup_power2_divisions:3",
			"roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[256:1", "backend:tpu",
			"max_split_size_mb:100,max_split_size_mb:200", "max_split_size_mb:100,", ":", "a:b:c",
			"roundup_power2_divisions:[100:2]",
		} {
			_, err := ParseConfig(conf)
			var ce *ConfigError
			if !errors.Is(err, ErrConfig) || !errors.As(err, &ce) {
				t.Errorf("ParseConfig(%q) = %v, want a *ConfigError", conf, err)
				continue
			}
			if ce.Key != "" && !strings.Contains(err.Error(), ce.Key) {
				t.Errorf("ParseConfig(%q): error %q does not name the key", conf, err)
			}
		}
	})
	t.Run("unsupported config", func(t *testing.T) {
		noVMM := struct{ cudart.Device }{sim} // hides the Sim's virtual memory
		for _, tc := range []struct {
			conf string
			dev  cudart.Device
		}{
			{"expandable_segments:True", noVMM},
			{"expandable_segments:True,backend:cudaMallocAsync", sim},
		} {
			cfg, err := ParseConfig(tc.conf)
			if err != nil {
				t.Fatalf("ParseConfig(%q): %v", tc.conf, err)
			}
			if _, err := New(tc.dev, cfg); !errors.Is(err, ErrNotSupported) {
				t.Errorf("New with %q: %v, want ErrNotSupported", tc.conf, err)
			}
		}
	})
	mustFree(t, a, p)

	t.Run("calls after Close", func(t *testing.T) {
		b, _ := newTestAllocator(t, giB, "")
		live := mustMalloc(t, b, 1000, 0)
		err := b.Close()
		if !errors.Is(err, ErrLiveBlocks) || !strings.Contains(err.Error(), "1 blocks") {
			t.Fatalf("Close with a live block: %v", err)
		}
		for name, fn := range map[string]func() error{
			"Malloc":       func() error { _, err := b.Malloc(512, 0); return err },
			"Free":         func() error { return b.Free(live) },
			"RecordStream": func() error { return b.RecordStream(live, 0) },
			"EmptyCache":   b.EmptyCache,
			"Close":        b.Close,
		} {
			if err := fn(); !errors.Is(err, ErrClosed) {
				t.Errorf("%s after Close: %v, want ErrClosed", name, err)
			}
		}
	})
}

func TestConfigRoundTrip(t *testing.T) {
	for _, s := range []string{
		"",
		"max_split_size_mb:128",
		"garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
		"roundup_power2_divisions:[256:1,512:2,>:8],release_lock_on_cudamalloc:True",
		" max_split_size_mb : 200 , max_non_split_rounding_mb:40",
	} {
		c, err := ParseConfig(s)
		if err != nil {
			t.Fatalf("ParseConfig(%q): %v", s, err)
		}
		c2, err := ParseConfig(c.String())
		if err != nil || c2 != c {
			t.Errorf("round trip of %q via %q: %+v, %v", s, c.String(), c2, err)
		}
	}
}

// TestOOMRecovery: the device says no, the allocator releases its cache,
// retries, and otherwise reports PyTorch's facts; it keeps working after.
func TestOOMRecovery(t *testing.T) {
	a, sim := newTestAllocator(t, 100*miB, "")
	// Fill the cache with free 20 MiB segments.
	var ps []cudart.Ptr
	for range 4 {
		ps = append(ps, mustMalloc(t, a, 15*miB, 0))
	}
	for _, p := range ps {
		mustFree(t, a, p)
	}
	// 50 MiB needs a new segment; the device has 20 MiB left: the cache is
	// released and the retry succeeds.
	big := mustMalloc(t, a, 50*miB, 0)
	s := a.Stats()
	if s.NumAllocRetries != 1 || s.NumOOMs != 0 || s.NumDeviceFree != 4 {
		t.Errorf("retries %d ooms %d device frees %d, want 1 0 4", s.NumAllocRetries, s.NumOOMs, s.NumDeviceFree)
	}
	// Now a real OOM.
	_, err := a.Malloc(60*miB, 0)
	var oom *OOMError
	if !errors.As(err, &oom) {
		t.Fatalf("want *OOMError, got %v", err)
	}
	if oom.Allocated != 50*miB || oom.Reserved != 50*miB || oom.DeviceTotal != 100*miB || oom.DeviceFree != 50*miB {
		t.Errorf("OOM facts: %+v", oom)
	}
	if !strings.Contains(err.Error(), "tried to allocate 60.00 MiB") || !strings.Contains(err.Error(), "total capacity of 100.00 MiB") {
		t.Errorf("OOM message: %v", err)
	}
	if a.Stats().NumOOMs != 1 {
		t.Errorf("num_ooms not counted")
	}
	mustCheck(t, a)
	mustFree(t, a, big)
	p := mustMalloc(t, a, 60*miB, 0)
	mustFree(t, a, p)
	_ = sim
}

// TestInjectedFault: a device error other than OOM is returned wrapped and
// leaves the allocator unchanged.
func TestInjectedFault(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "")
	boom := errors.New("injected fault")
	sim.Faults().FailMalloc(1, boom)
	expectUnchanged(t, a, boom, func() error { _, err := a.Malloc(512, 0); return err })
	// An injected OOM on the first attempt is recovered by the retry.
	sim.Faults().FailMalloc(1, nil)
	p := mustMalloc(t, a, 512, 0)
	if a.Stats().NumAllocRetries != 1 {
		t.Errorf("retry not counted")
	}
	mustFree(t, a, p)
}

// TestPerProcessFraction caps reserved memory.
func TestPerProcessFraction(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "per_process_memory_fraction:0.25")
	p := mustMalloc(t, a, 200*miB, 0)
	if _, err := a.Malloc(100*miB, 0); !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("over the cap: %v", err)
	}
	if sim.Used() != 200*miB {
		t.Errorf("device holds %d", sim.Used())
	}
	var oom *OOMError
	_, err := a.Malloc(100*miB, 0)
	if !errors.As(err, &oom) || oom.Allowed != giB/4 || !strings.Contains(err.Error(), "per_process_memory_fraction") {
		t.Errorf("OOM under a cap: %v", err)
	}
	mustFree(t, a, p)
}

// TestGarbageCollection: past threshold × allowed, aged unsplit blocks are
// released before the device is asked for more.
func TestGarbageCollection(t *testing.T) {
	a, _ := newTestAllocator(t, giB, "garbage_collection_threshold:0.5,per_process_memory_fraction:0.5")
	// 200 MiB of cached, unsplit large blocks.
	var ps []cudart.Ptr
	for _, sz := range []uint64{100 * miB, 60 * miB, 40 * miB} {
		ps = append(ps, mustMalloc(t, a, sz, 0))
	}
	for _, p := range ps {
		mustFree(t, a, p)
	}
	before := a.Stats().NumDeviceFree
	// 120 MiB fits no cached block; reserved (200 MiB) is below
	// 0.5 × 512 MiB: no collection before growing to 320 MiB.
	p := mustMalloc(t, a, 120*miB, 0)
	if a.Stats().NumDeviceFree != before {
		t.Fatalf("collected below the threshold")
	}
	// 130 MiB needs another segment; reserved is past the threshold, so
	// aged cached blocks are released first, at least the 64 MiB excess.
	q := mustMalloc(t, a, 130*miB, 0)
	s := a.Stats()
	if s.NumDeviceFree == before {
		t.Fatalf("no block was collected above the threshold")
	}
	if s.ReservedBytes[PoolAll].Current > int64(320*miB+130*miB-64*miB) {
		t.Errorf("reserved %d MiB: the collection freed less than the excess", s.ReservedBytes[PoolAll].Current>>20)
	}
	if s.NumAllocRetries != 0 {
		t.Errorf("collection should avoid the OOM retry path")
	}
	r := mustMalloc(t, a, 10*miB, 0)
	for _, x := range []cudart.Ptr{p, q, r} {
		mustFree(t, a, x)
	}
}

// TestRecordStream: a block used by another stream is not reused until the
// event recorded on that stream at Free completes.
func TestRecordStream(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "", simdev.Config{ManualEvents: true})
	side, _ := sim.StreamCreate()
	p := mustMalloc(t, a, 4096, 0)
	if err := a.RecordStream(p, side); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, p)
	s := a.Stats()
	if s.Active[PoolAll].Current != 1 || s.Allocation[PoolAll].Current != 0 {
		t.Fatalf("pending block: active %d allocation %d, want 1 0", s.Active[PoolAll].Current, s.Allocation[PoolAll].Current)
	}
	if q := mustMalloc(t, a, 4096, 0); q == p {
		t.Fatalf("block reused while the side stream's event is pending")
	} else {
		mustFree(t, a, q)
	}
	if err := a.Free(p); !errors.Is(err, ErrDoubleFree) {
		t.Errorf("free of a pending block: %v, want ErrDoubleFree", err)
	}
	sim.CompleteStream(side)
	if q := mustMalloc(t, a, 4096, 0); q != p {
		t.Errorf("block not reused after its event completed (got %#x want %#x)", uint64(q), uint64(p))
	} else {
		mustFree(t, a, q)
	}
	// EmptyCache waits for pending events and releases the segment.
	r := mustMalloc(t, a, 4096, 0)
	_ = a.RecordStream(r, side)
	mustFree(t, a, r)
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if a.MemoryReserved() != 0 || a.Stats().NumSyncAllStreams != 1 {
		t.Errorf("EmptyCache left %d reserved, %d syncs", a.MemoryReserved(), a.Stats().NumSyncAllStreams)
	}
}

// TestConcurrent hammers one allocator from many goroutines on several
// streams; run with -race.
func TestConcurrent(t *testing.T) {
	for _, conf := range []string{"", "release_lock_on_cudamalloc:True"} {
		t.Run("conf="+conf, func(t *testing.T) { testConcurrent(t, conf) })
	}
}

// testConcurrent is TestConcurrent with one configuration. With
// release_lock_on_cudamalloc the device malloc runs unlocked (the Sim
// spins 20 µs in it), so other goroutines change the cache meanwhile.
func testConcurrent(t *testing.T, conf string) {
	a, sim := newTestAllocator(t, 4*giB, conf, simdev.Config{MallocLatency: 20 * time.Microsecond})
	const workers = 8
	streams := []cudart.Stream{0}
	for range 3 {
		s, _ := sim.StreamCreate()
		streams = append(streams, s)
	}
	ops := 4000
	if testing.Short() {
		ops = 1000
	}
	var wg sync.WaitGroup
	errc := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			s := streams[w%len(streams)]
			other := streams[(w+1)%len(streams)]
			var live []cudart.Ptr
			x := uint64(w + 1)
			for i := range ops {
				x ^= x << 13
				x ^= x >> 7
				x ^= x << 17
				if len(live) > 0 && (x%3 == 0 || len(live) > 32) {
					j := int(x>>8) % len(live)
					if x%7 == 0 {
						if err := a.RecordStream(live[j], other); err != nil {
							errc <- err
							return
						}
					}
					if err := a.Free(live[j]); err != nil {
						errc <- err
						return
					}
					live[j] = live[len(live)-1]
					live = live[:len(live)-1]
					continue
				}
				p, err := a.Malloc(sizeFor(x), s)
				if err != nil {
					errc <- err
					return
				}
				live = append(live, p)
				if i%500 == 0 {
					_ = a.Stats()
					if w == 0 {
						_ = a.EmptyCache()
					}
				}
			}
			for _, p := range live {
				if err := a.Free(p); err != nil {
					errc <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if a.MemoryAllocated() != 0 {
		t.Errorf("allocated %d after every goroutine freed everything", a.MemoryAllocated())
	}
}

// TestAsyncBackend: backend:cudaMallocAsync delegates to the device's
// stream-ordered pool with the same statistics and errors.
func TestAsyncBackend(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "backend:cudaMallocAsync", simdev.Config{ManualEvents: true})
	side, _ := sim.StreamCreate()
	p := mustMalloc(t, a, 1000, 0)
	q := mustMalloc(t, a, 30*miB, side)
	s := a.Stats()
	if s.AllocatedBytes[PoolAll].Current != int64(1000+30*miB) || s.NumDeviceAlloc != 2 || s.ReservedBytes[PoolAll].Current != int64(sim.Used()) {
		t.Fatalf("stats after two mallocs: %+v", s)
	}
	if err := a.RecordStream(p, side); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, p)
	if used := sim.Used(); used != 1000+30*miB {
		t.Errorf("memory returned before the side stream's event completed (device holds %d)", used)
	}
	expectUnchanged(t, a, ErrDoubleFree, func() error { return a.Free(p) })
	expectUnchanged(t, a, ErrUnknownPointer, func() error { return a.Free(0x1234000) })
	sim.CompleteStream(side)
	r := mustMalloc(t, a, 512, 0) // polls the deferred free
	if used := sim.Used(); used != 30*miB+512 {
		t.Errorf("deferred free not issued after its event completed (device holds %d)", used)
	}
	if _, err := a.Malloc(2*giB, 0); !errors.Is(err, ErrOutOfMemory) {
		t.Errorf("oversize request: %v", err)
	}
	sim.Faults().FailMalloc(1, nil)
	x := mustMalloc(t, a, 4096, 0) // injected OOM, recovered by the retry
	if a.Stats().NumAllocRetries != 1 {
		t.Errorf("retry not counted")
	}
	for _, ptr := range []cudart.Ptr{q, r, x} {
		mustFree(t, a, ptr)
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if a.MemoryAllocated() != 0 || a.MemoryReserved() != 0 {
		t.Errorf("allocated %d reserved %d after freeing all", a.MemoryAllocated(), a.MemoryReserved())
	}
}

// TestCloseDuringUnlockedDeviceMalloc: with release_lock_on_cudamalloc, a
// Close while a Malloc waits for the device ends that Malloc with ErrClosed
// and gives its new memory back, so nothing leaks.
func TestCloseDuringUnlockedDeviceMalloc(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "release_lock_on_cudamalloc:True", simdev.Config{MallocLatency: 200 * time.Millisecond})
	errc := make(chan error, 1)
	go func() {
		_, err := a.Malloc(4096, 0)
		errc <- err
	}()
	time.Sleep(50 * time.Millisecond) // the Malloc is now inside the device call
	if err := a.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("Malloc racing Close: %v, want ErrClosed", err)
	}
	if used := sim.Used(); used != 0 {
		t.Errorf("the device still holds %d bytes", used)
	}
}
