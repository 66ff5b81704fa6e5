package allocator

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestConcurrentModelEachStep runs workers on several streams (four own
// one each, two share the default stream) against a device small enough
// that allocations fail with ErrOutOfMemory, while a controller races them
// with EmptyCache, event completion, injected device malloc faults,
// ResetPeakStats, Stats and Snapshot. After every step of every goroutine
// it checks the invariants: Check (shards, directory, front cache, caps,
// statistics against the structures), the statistics' own bounds, and the
// shared model: a live allocation lies inside the device's memory with at
// least the requested bytes, overlaps no other live allocation, still
// holds the bytes written to its ends, and is counted by the allocator.
// At the end everything is freed, the cache emptied, and the allocator
// must hold nothing and close cleanly. Run it with -race.
func TestConcurrentModelEachStep(t *testing.T) {
	steps := 600
	if testing.Short() {
		steps = 100
	}
	for _, conf := range []string{"", "expandable_segments:True", "expandable_segments:True,expandable_reclaim:coarse", "release_lock_on_cudamalloc:True"} {
		t.Run("conf="+conf, func(t *testing.T) {
			runConcurrentModel(t, conf, steps, uint64(time.Now().UnixNano()))
		})
	}
}

// liveSpan is one allocation a worker holds: [ptr, ptr+rounded), of
// which the first requested bytes were asked for.
type liveSpan struct {
	ptr                cudart.Ptr
	requested, rounded uint64
	stamp              uint64 // written to both ends of the requested bytes (stampOf)
}

// liveSet is every allocation the workers hold, by address. A worker adds
// an allocation after Malloc returned it and removes it before calling
// Free, so every entry is allocated in the allocator at every moment, and
// no two entries may overlap.
type liveSet struct {
	mu     sync.Mutex
	spans  []liveSpan // sorted by ptr
	req    uint64     // sum of requested
	rnd    uint64     // sum of rounded
	owners []int      // parallel to spans: the worker holding each
}

// add inserts l for worker w; it fails when l overlaps a live allocation.
func (s *liveSet) add(l liveSpan, w int) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := sort.Search(len(s.spans), func(i int) bool { return s.spans[i].ptr >= l.ptr })
	if i > 0 {
		if prev := s.spans[i-1]; uint64(prev.ptr)+prev.rounded > uint64(l.ptr) {
			return fmt.Errorf("[%#x,+%d) overlaps worker %d's live [%#x,+%d)", uint64(l.ptr), l.rounded, s.owners[i-1], uint64(prev.ptr), prev.rounded)
		}
	}
	if i < len(s.spans) {
		if next := s.spans[i]; uint64(l.ptr)+l.rounded > uint64(next.ptr) {
			return fmt.Errorf("[%#x,+%d) overlaps worker %d's live [%#x,+%d)", uint64(l.ptr), l.rounded, s.owners[i], uint64(next.ptr), next.rounded)
		}
	}
	s.spans = append(s.spans, liveSpan{})
	copy(s.spans[i+1:], s.spans[i:])
	s.spans[i] = l
	s.owners = append(s.owners, 0)
	copy(s.owners[i+1:], s.owners[i:])
	s.owners[i] = w
	s.req += l.requested
	s.rnd += l.rounded
	return nil
}

// remove deletes the allocation at p.
func (s *liveSet) remove(p cudart.Ptr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	i := sort.Search(len(s.spans), func(i int) bool { return s.spans[i].ptr >= p })
	if i == len(s.spans) || s.spans[i].ptr != p {
		panic(fmt.Sprintf("liveSet: %#x is not live", uint64(p)))
	}
	s.req -= s.spans[i].requested
	s.rnd -= s.spans[i].rounded
	s.spans = append(s.spans[:i], s.spans[i+1:]...)
	s.owners = append(s.owners[:i], s.owners[i+1:]...)
}

// covered checks, while no worker can change the set, that the
// allocator counts at least what the workers hold.
func (s *liveSet) covered(a *Allocator) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := a.Stats()
	var errs []error
	if got := st.Allocation[PoolAll].Current; got < int64(len(s.spans)) {
		errs = append(errs, fmt.Errorf("allocation %d, the workers hold %d", got, len(s.spans)))
	}
	if got := st.AllocatedBytes[PoolAll].Current; got < int64(s.rnd) {
		errs = append(errs, fmt.Errorf("allocated_bytes %d, the workers hold %d rounded", got, s.rnd))
	}
	if got := st.RequestedBytes[PoolAll].Current; got < int64(s.req) {
		errs = append(errs, fmt.Errorf("requested_bytes %d, the workers hold %d", got, s.req))
	}
	return errors.Join(errs...)
}

// statBounds checks what holds of the statistics at any moment: no
// current value is negative or above its peak, nothing allocated lies
// outside what is reserved, and the reserved bytes fit the device.
func statBounds(st Stats, capacity uint64) error {
	var errs []error
	for _, arr := range st.namedArrays() {
		for p := range numPools {
			if s := arr.a[p]; s.Current < 0 || s.Peak < s.Current {
				errs = append(errs, fmt.Errorf("%s.%v: current %d, peak %d", arr.name, Pool(p), s.Current, s.Peak))
			}
		}
	}
	if st.AllocatedBytes[PoolAll].Current > st.ReservedBytes[PoolAll].Current {
		errs = append(errs, fmt.Errorf("allocated_bytes %d above reserved_bytes %d", st.AllocatedBytes[PoolAll].Current, st.ReservedBytes[PoolAll].Current))
	}
	if uint64(st.ReservedBytes[PoolAll].Current) > capacity {
		errs = append(errs, fmt.Errorf("reserved_bytes %d above the device's %d", st.ReservedBytes[PoolAll].Current, capacity))
	}
	return errors.Join(errs...)
}

// concurrentSize is a request size: sizeFor's mix over both pools, now
// and then one large enough that it fails unless others free.
func concurrentSize(rng *rand.Rand) uint64 {
	if rng.IntN(40) == 0 {
		return 64*miB + rng.Uint64N(64*miB)
	}
	return sizeFor(rng.Uint64())
}

func runConcurrentModel(t *testing.T, conf string, steps int, seed uint64) {
	t.Logf("seed %d", seed)
	const (
		capacity = 256 * miB
		owners   = 4 // workers with a stream each
		sharers  = 2 // workers on the default stream
		workers  = owners + sharers
		maxLive  = 16 // per worker
	)
	sc := simdev.Config{Capacity: capacity, ManualEvents: true, Backed: true}
	cfg, err := ParseConfig(conf)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.ReleaseLockOnDeviceMalloc {
		sc.MallocLatency = 20 * time.Microsecond // others run while a device malloc waits
	}
	sim, err := simdev.New(sc)
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	a, err := New(sim, cfg)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			_ = a.Close()
		}
	}()
	streams := make([]cudart.Stream, workers)
	for w := range owners {
		if streams[w], err = sim.StreamCreate(); err != nil {
			t.Fatal(err)
		}
	}
	lo, hi := sim.AddressRange()

	var (
		live    liveSet
		stop    atomic.Bool // set at the first failure: everyone ends
		failMu  sync.Mutex
		failure error
	)
	fail := func(who string, step int, err error) {
		failMu.Lock()
		defer failMu.Unlock()
		if failure == nil {
			failure = fmt.Errorf("%s, step %d: %w", who, step, err)
		}
		stop.Store(true)
	}
	// checkStep is what every goroutine checks after each of its steps.
	checkStep := func() error {
		if err := a.Check(); err != nil {
			return err
		}
		if err := statBounds(a.Stats(), capacity); err != nil {
			return err
		}
		return live.covered(a)
	}

	var ooms [workers]int64
	var retaken atomic.Int64 // same-size pairs that got the freed block back
	var wg sync.WaitGroup
	mine := make([][]liveSpan, workers)
	for w := range workers {
		wg.Go(func() {
			who := fmt.Sprintf("worker %d (stream %#x)", w, uint64(streams[w]))
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			s := streams[w]
			held := &mine[w]
			seq := uint64(0)
			// stampOf says where l's stamp goes: its first and its last
			// eight bytes, or its first bytes alone when those would overlap.
			stampOf := func(l liveSpan) (n uint64, ends []cudart.Ptr) {
				if l.requested < 16 {
					return min(8, l.requested), []cudart.Ptr{l.ptr}
				}
				return 8, []cudart.Ptr{l.ptr, l.ptr + cudart.Ptr(l.requested-8)}
			}
			verify := func(l liveSpan) error {
				n, ends := stampOf(l)
				var want, got [8]byte
				binary.LittleEndian.PutUint64(want[:], l.stamp)
				for _, at := range ends {
					if err := sim.MemcpyDtoH(got[:n], at); err != nil {
						return fmt.Errorf("reading live [%#x,+%d) at %#x: %w", uint64(l.ptr), l.requested, uint64(at), err)
					}
					if !bytes.Equal(got[:n], want[:n]) {
						return fmt.Errorf("live [%#x,+%d) holds %x at %#x, not %x: its memory moved or was handed out twice",
							uint64(l.ptr), l.requested, got[:n], uint64(at), want[:n])
					}
				}
				return nil
			}
			malloc := func(size uint64) error {
				p, err := a.Malloc(size, s)
				if err != nil {
					var oom *OOMError
					if !errors.Is(err, ErrOutOfMemory) || !errors.As(err, &oom) {
						return fmt.Errorf("Malloc(%d): %w, not an out-of-memory error", size, err)
					}
					if oom.Requested != size {
						return fmt.Errorf("Malloc(%d): the OOM error names a request of %d bytes", size, oom.Requested)
					}
					ooms[w]++
					return nil
				}
				if uint64(p)%512 != 0 || p < lo || uint64(p)+size > uint64(hi) || uint64(p)+size < uint64(p) {
					return fmt.Errorf("Malloc(%d) = %#x: misaligned or outside the device's [%#x, %#x)", size, uint64(p), uint64(lo), uint64(hi))
				}
				seq++
				l := liveSpan{ptr: p, requested: size, rounded: a.roundSize(size), stamp: uint64(w)<<56 | seq}
				if err := live.add(l, w); err != nil {
					return fmt.Errorf("Malloc(%d) on stream %#x: %w", size, uint64(s), err)
				}
				n, ends := stampOf(l)
				var b [8]byte
				binary.LittleEndian.PutUint64(b[:], l.stamp)
				for _, at := range ends {
					if err := sim.MemcpyHtoD(at, b[:n]); err != nil {
						return fmt.Errorf("Malloc(%d) = %#x: the bytes are not device memory: %w", size, uint64(p), err)
					}
				}
				*held = append(*held, l)
				return nil
			}
			free := func(i int) error {
				l := (*held)[i]
				if err := verify(l); err != nil {
					return err
				}
				live.remove(l.ptr)
				(*held)[i] = (*held)[len(*held)-1]
				*held = (*held)[:len(*held)-1]
				if err := a.Free(l.ptr); err != nil {
					return fmt.Errorf("Free(%#x): %w", uint64(l.ptr), err)
				}
				return nil
			}
			for step := range steps {
				if stop.Load() {
					return
				}
				var err error
				switch op := rng.IntN(20); {
				case len(*held) >= maxLive || (op < 6 && len(*held) > 0):
					err = free(rng.IntN(len(*held)))
				case op < 14:
					err = malloc(concurrentSize(rng))
				case op < 17 && len(*held) > 0:
					// A same-size pair on one stream: the front cache's case.
					i := rng.IntN(len(*held))
					size := (*held)[i].requested
					was := (*held)[i].ptr
					if err = free(i); err == nil {
						err = malloc(size)
					}
					if err == nil && len(*held) > 0 && (*held)[len(*held)-1].ptr == was {
						retaken.Add(1)
					}
				case op < 19 && len(*held) > 0:
					// Another goroutine's stream uses the block.
					l := (*held)[rng.IntN(len(*held))]
					if err = a.RecordStream(l.ptr, streams[rng.IntN(workers)]); err != nil {
						err = fmt.Errorf("RecordStream(%#x): %w", uint64(l.ptr), err)
					}
				case len(*held) > 0:
					err = verify((*held)[rng.IntN(len(*held))])
				}
				if err == nil {
					err = checkStep()
				}
				if err != nil {
					fail(who, step, err)
					return
				}
			}
		})
	}

	// The controller races the workers until they are done.
	var done atomic.Bool
	var ctlSteps int
	ctl := make(chan struct{})
	go func() {
		defer close(ctl)
		rng := rand.New(rand.NewPCG(seed, workers))
		for step := 0; !done.Load() && !stop.Load(); step++ {
			ctlSteps++
			var err error
			switch rng.IntN(8) {
			case 0, 1:
				err = a.EmptyCache()
			case 2:
				sim.CompleteStream(streams[rng.IntN(workers)])
			case 3:
				sim.CompleteAll()
			case 4:
				sim.Faults().FailMalloc(1+rng.IntN(4), nil)
			case 5:
				a.ResetPeakStats()
			case 6:
				_ = a.Snapshot()
			default:
				_ = a.Stats()
			}
			if err == nil {
				err = checkStep()
			}
			if err != nil {
				fail("controller", step, err)
				return
			}
			runtime.Gosched()
		}
	}()
	wg.Wait()
	done.Store(true)
	<-ctl
	if failure != nil {
		t.Fatal(failure)
	}

	// Quiescent: free everything; then the allocator must hold nothing.
	sim.Faults().FailMalloc(0, nil)
	var totalOOMs int64
	for w := range workers {
		totalOOMs += ooms[w]
		for _, l := range mine[w] {
			live.remove(l.ptr)
			if err := a.Free(l.ptr); err != nil {
				t.Fatalf("final Free(%#x): %v", uint64(l.ptr), err)
			}
		}
	}
	st := a.Stats()
	if st.NumOOMs != totalOOMs {
		t.Errorf("num_ooms %d, the workers saw %d", st.NumOOMs, totalOOMs)
	}
	t.Logf("%d worker steps, %d controller steps; %d OOMs, %d device mallocs, %d device frees, %d EmptyCache, %d reclaims, %d lends, %d escalations, %d pairs took their block back",
		workers*steps, ctlSteps, totalOOMs, st.NumDeviceAlloc, st.NumDeviceFree, st.NumEmptyCache, st.NumReclaims, st.NumLends, st.NumEscalations, retaken.Load())
	if totalOOMs == 0 {
		t.Error("no Malloc failed: the run did not exercise out-of-memory")
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	st = a.Stats()
	for _, s := range []struct {
		name string
		v    int64
	}{
		{"allocation", st.Allocation[PoolAll].Current},
		{"allocated_bytes", st.AllocatedBytes[PoolAll].Current},
		{"requested_bytes", st.RequestedBytes[PoolAll].Current},
		{"active_bytes", st.ActiveBytes[PoolAll].Current},
		{"reserved_bytes", st.ReservedBytes[PoolAll].Current},
		{"segment", st.Segment[PoolAll].Current},
	} {
		if s.v != 0 {
			t.Errorf("%s %d with nothing live after EmptyCache", s.name, s.v)
		}
	}
	if used := sim.Used(); used != 0 {
		t.Errorf("the device holds %d bytes with nothing live after EmptyCache", used)
	}
	closed = true
	if err := a.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if used := sim.Used(); used != 0 {
		t.Errorf("after Close the device still holds %d bytes", used)
	}
}
