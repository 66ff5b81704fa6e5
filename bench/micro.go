package bench

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/workload"
)

// PairSizes are the sizes of the pair benchmark (Pair), in bytes.
var PairSizes = []uint64{512, 4096, 1 << 20, 8 << 20, 64 << 20}

// MixedThreads are the goroutine counts of the mixed benchmark.
var MixedThreads = []int{1, 2, 4, 8}

// MixedSteps is the mixed benchmark's steps per goroutine (Mixed).
const MixedSteps = 400_000

// Pair runs n malloc/free pairs of size on the default stream after one
// warm-up pair, and returns the time per pair.
func Pair(a *allocator.Allocator, size uint64, n int) (time.Duration, error) {
	if err := pairOnce(a, size); err != nil {
		return 0, err
	}
	runtime.GC()
	t0 := time.Now()
	for range n {
		if err := pairOnce(a, size); err != nil {
			return 0, err
		}
	}
	return time.Since(t0) / time.Duration(max(n, 1)), nil
}

func pairOnce(a *allocator.Allocator, size uint64) error {
	p, err := a.Malloc(size, cudart.DefaultStream)
	if err != nil {
		return err
	}
	return a.Free(p)
}

// MixedResult is one run of the mixed benchmark.
type MixedResult struct {
	Threads int
	// Ops is the total number of steps (mallocs and frees) of all
	// goroutines, the final frees excluded.
	Ops     int
	Elapsed time.Duration
	// PeakAllocated and PeakReserved are the allocator's peaks over the run.
	PeakAllocated, PeakReserved int64
	// Escalations is the allocator's NumEscalations over every pass: hot
	// calls that took every stream's lock to settle a peak.
	Escalations int64
	// TimedEscalations, TimedBorrows and TimedSteals are the timed pass's
	// NumEscalations, NumCapBorrows and NumCapSteals: what keeping the
	// peaks exact cost the goroutines in shared memory (allocator.Stats).
	TimedEscalations, TimedBorrows, TimedSteals int64
	// FirstDone and LastDone are when the timed pass's first and last
	// goroutines finished their steps, from its start. Elapsed ends with
	// the last (LastDone, and the final frees); on a host whose cores run
	// at different speeds the two differ even when the allocator makes no
	// goroutine wait for another.
	FirstDone, LastDone time.Duration
}

// NsPerOp is wall time per step over all goroutines.
func (m MixedResult) NsPerOp() float64 { return float64(m.Elapsed.Nanoseconds()) / float64(m.Ops) }

// MopsPerSec is the aggregate throughput in millions of steps a second.
func (m MixedResult) MopsPerSec() float64 { return float64(m.Ops) / m.Elapsed.Seconds() / 1e6 }

// Mixed runs the mixed benchmark: threads goroutines, each on its own
// stream, each taking steps steps over a window of workload.MixedWindow/threads
// slots with its own generator seeded 42+t; a live slot is freed, an empty
// one allocated. At the end every live slot is freed.
func Mixed(a *allocator.Allocator, threads, steps int) (MixedResult, error) {
	return mixedPasses(a, threads, steps, 1)
}

// MixedWarm is the warm mixed benchmark (PyTorch's anchor calls it
// mixed_warm_torch_tT): Mixed's pattern runs twice on the same streams and
// only the second pass is timed, so the allocator serves it from its cache
// instead of paying for device mallocs that both allocators pay in Mixed.
// The peaks cover both passes.
func MixedWarm(a *allocator.Allocator, threads, steps int) (MixedResult, error) {
	return mixedPasses(a, threads, steps, 2)
}

// mixedPasses runs the mixed pattern passes times on the same streams and
// times the last pass.
func mixedPasses(a *allocator.Allocator, threads, steps, passes int) (MixedResult, error) {
	return mixedPassesWith(a, threads, steps, passes, func(streams []cudart.Stream, window int) (elapsed, first, last time.Duration, err error) {
		errs := make([]error, threads)
		done := make([]time.Time, threads)
		var wg sync.WaitGroup
		var start sync.WaitGroup
		start.Add(1)
		for t := range threads {
			wg.Go(func() {
				start.Wait()
				errs[t] = mixedRun(a, streams[t], uint64(42+t), steps, window, &done[t])
			})
		}
		t0 := time.Now()
		start.Done()
		wg.Wait()
		elapsed = time.Since(t0)
		first, last = done[0].Sub(t0), done[0].Sub(t0)
		for _, d := range done[1:] {
			first, last = min(first, d.Sub(t0)), max(last, d.Sub(t0))
		}
		return elapsed, first, last, errors.Join(errs...)
	})
}

// mixedPassesWith makes threads streams, runs pass on them passes times
// (each with a fresh window of workload.MixedWindow/threads slots a
// stream, after a collection of earlier garbage) and returns the last
// pass's figures, its escalations, borrows and steals among them.
func mixedPassesWith(a *allocator.Allocator, threads, steps, passes int,
	pass func(streams []cudart.Stream, window int) (elapsed, first, last time.Duration, err error)) (MixedResult, error) {
	dev := a.Device()
	streams := make([]cudart.Stream, threads)
	for t := range streams {
		s, err := dev.StreamCreate()
		if err != nil {
			return MixedResult{}, fmt.Errorf("mixed: creating stream %d: %w", t, err)
		}
		streams[t] = s
	}
	defer func() {
		for _, s := range streams {
			_ = dev.StreamDestroy(s)
		}
	}()
	var elapsed, first, last time.Duration
	var before allocator.Stats
	for p := range passes {
		runtime.GC() // no collection of earlier garbage inside the timed pass
		if p == passes-1 {
			before = a.Stats() // the timed pass's counts start here
		}
		var err error
		if elapsed, first, last, err = pass(streams, workload.MixedWindow/threads); err != nil {
			return MixedResult{}, err
		}
	}
	st := a.Stats()
	return MixedResult{
		Threads: threads, Ops: threads * steps, Elapsed: elapsed,
		PeakAllocated:    st.AllocatedBytes[allocator.PoolAll].Peak,
		PeakReserved:     st.ReservedBytes[allocator.PoolAll].Peak,
		Escalations:      st.NumEscalations,
		TimedEscalations: st.NumEscalations - before.NumEscalations,
		TimedBorrows:     st.NumCapBorrows - before.NumCapBorrows,
		TimedSteals:      st.NumCapSteals - before.NumCapSteals,
		FirstDone:        first, LastDone: last,
	}, nil
}

// mixedRun is one goroutine's steps; done is set when they end, before
// the final frees.
func mixedRun(a *allocator.Allocator, s cudart.Stream, seed uint64, steps, window int, done *time.Time) error {
	r := workload.NewSplitMix64(seed)
	live := make([]cudart.Ptr, window)
	for range steps {
		slot := r.Next() % uint64(window)
		if p := live[slot]; p != 0 {
			if err := a.Free(p); err != nil {
				return err
			}
			live[slot] = 0
			continue
		}
		p, err := a.Malloc(workload.MixedSize(&r), s)
		if err != nil {
			return err
		}
		live[slot] = p
	}
	*done = time.Now()
	for _, p := range live {
		if p != 0 {
			if err := a.Free(p); err != nil {
				return err
			}
		}
	}
	return nil
}

// MixedWarmInterleaved runs MixedWarm's pattern for threads streams on
// one goroutine, one step of each stream in turn: the order in which the
// steps would reach the allocator if every goroutine ran at the same
// pace, at once. It measures no time (Elapsed is the wall time of the
// second pass, on one goroutine); what it gives is the timed pass's
// escalations, borrows and steals of a run whose streams really
// overlap, the same on every machine. On a machine with fewer cores than
// goroutines MixedWarm's goroutines take turns by time slices, and most
// of the overlap, with the contention it causes, is gone.
func MixedWarmInterleaved(a *allocator.Allocator, threads, steps int) (MixedResult, error) {
	return mixedPassesWith(a, threads, steps, 2, func(streams []cudart.Stream, window int) (elapsed, first, last time.Duration, err error) {
		steppers := make([]*workload.MixedStepper, threads)
		for t := range steppers {
			steppers[t] = workload.NewMixedStepper(uint64(42+t), window)
		}
		t0 := time.Now()
		for range steps {
			for t, m := range steppers {
				if err := m.Step(a, streams[t]); err != nil {
					return 0, 0, 0, err
				}
			}
		}
		elapsed = time.Since(t0)
		var errs []error
		for _, m := range steppers {
			errs = append(errs, m.FreeAll(a))
		}
		return elapsed, elapsed, elapsed, errors.Join(errs...)
	})
}
