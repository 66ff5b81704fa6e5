package workload

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/snapshot"
	"go.uber.org/zap"
)

// MixedStepper is one goroutine's step of the mixed benchmark, for
// callers that run the workload under their own control (paced, until a
// context ends): a random slot of a window is freed when live and
// allocated otherwise, with sizes drawn by MixedSize. The benchmark's
// goroutine t uses seed 42+t.
type MixedStepper struct {
	r    SplitMix64
	live []cudart.Ptr
}

// NewMixedStepper returns a stepper over window slots (at least 1), its
// generator seeded seed.
func NewMixedStepper(seed uint64, window int) *MixedStepper {
	return &MixedStepper{r: NewSplitMix64(seed), live: make([]cudart.Ptr, max(window, 1))}
}

// Step takes one step on stream s of a. An allocation that fails leaves
// its slot empty and returns the allocator's error (errors.Is
// allocator.ErrOutOfMemory when the device is full), so that the caller
// decides whether to go on.
func (m *MixedStepper) Step(a *allocator.Allocator, s cudart.Stream) error {
	slot := m.r.Next() % uint64(len(m.live))
	if p := m.live[slot]; p != 0 {
		m.live[slot] = 0
		return a.Free(p)
	}
	p, err := a.Malloc(MixedSize(&m.r), s)
	if err != nil {
		return err
	}
	m.live[slot] = p
	return nil
}

// FreeAll frees every live slot and returns the errors joined.
func (m *MixedStepper) FreeAll(a *allocator.Allocator) error {
	var errs []error
	for i, p := range m.live {
		if p != 0 {
			errs = append(errs, a.Free(p))
			m.live[i] = 0
		}
	}
	return errors.Join(errs...)
}

// Pacer holds a workload to a rate of operations a second on average:
// Observe, called after each operation, sleeps until that operation's due
// time when it is more than a millisecond ahead. Once its context ends it
// no longer sleeps, so the workload finishes what it is doing at full
// speed. A Pacer serves one goroutine.
type Pacer struct {
	ctx   context.Context
	rate  float64
	start time.Time
	n     float64
	timer *time.Timer
}

// maxPacerDue bounds the due time of an operation: about 146 years, far
// beyond any run, and far from time.Duration's overflow.
const maxPacerDue = time.Duration(1 << 62)

// pacerDue is when the nth operation is due at rate operations a second,
// measured from the start. It never overflows: a due time beyond
// maxPacerDue, and a NaN (rate NaN, or n and rate infinite), give
// maxPacerDue, so that a rate too small to represent holds the workload
// until its context ends rather than letting it run unpaced. (Converting
// an out-of-range float64 to time.Duration is implementation-defined in
// Go; on amd64 it gives math.MinInt64, a due time far in the past.)
func pacerDue(n, rate float64) time.Duration {
	ns := n / rate * float64(time.Second)
	if !(ns < float64(maxPacerDue)) { // also NaN
		return maxPacerDue
	}
	if ns < 0 {
		return 0
	}
	return time.Duration(ns)
}

// NewPacer paces at rate operations a second from now until ctx ends;
// rate 0 (or below) leaves the workload unpaced. Any rate paces safely: a
// rate too small to represent holds the workload until ctx ends.
func NewPacer(ctx context.Context, rate float64) *Pacer {
	return &Pacer{ctx: ctx, rate: rate, start: time.Now()}
}

// Observe is called after each operation; it fits ReplayOptions.Observe.
func (p *Pacer) Observe(int) {
	if p.rate <= 0 {
		return
	}
	p.n++
	ahead := pacerDue(p.n, p.rate) - time.Since(p.start)
	if ahead < time.Millisecond || p.ctx.Err() != nil {
		return
	}
	if p.timer == nil {
		p.timer = time.NewTimer(ahead)
	} else {
		p.timer.Reset(ahead)
	}
	select {
	case <-p.timer.C:
	case <-p.ctx.Done():
		p.timer.Stop()
	}
}

// Load drives an allocator so that its metrics move, as `allocd serve`
// does on simulated devices: a trace replayed with Replay, once or over
// and over, or the mixed benchmark's steps on the default stream over a
// window of MixedWindow slots (Trace nil), paced at Rate operations a
// second (0: unpaced). A Load is read-only once made, so one Load can
// drive several allocators, each from its own goroutine (Run).
type Load struct {
	// Trace is the trace to replay; nil runs the mixed steps.
	Trace *Trace
	// Loop starts the trace over when it ends; without it the final state
	// stays on show until the context ends. The mixed steps always loop.
	Loop bool
	// Rate is the pace in operations a second on each allocator (0:
	// unpaced).
	Rate float64
}

// Run drives a, the allocator of device index gpu, until ctx ends (or,
// without Loop, until the trace ends and then ctx ends), then frees what
// the workload still holds and returns nil; an error of the allocator
// other than an OOM stops it early. The mixed steps are seeded 42+gpu,
// as the mixed benchmark seeds its goroutines, so that devices differ;
// an allocation the device cannot satisfy is skipped (the allocator
// counts it as an OOM). Each trace pass after the first starts from an
// emptied cache, so that every pass shows the trace's own peaks. log
// receives a line when the workload starts and after each pass.
func (l *Load) Run(ctx context.Context, a *allocator.Allocator, gpu int, log *zap.Logger) error {
	p := NewPacer(ctx, l.Rate)
	if l.Trace == nil {
		seed := uint64(42 + gpu)
		log.Info("synthetic workload started", zap.Int("window", MixedWindow), zap.Uint64("seed", seed),
			zap.Float64("ops_per_second", l.Rate))
		m := NewMixedStepper(seed, MixedWindow)
		var err error
		for i := 0; ctx.Err() == nil; i++ {
			if err = m.Step(a, cudart.DefaultStream); err != nil && !errors.Is(err, allocator.ErrOutOfMemory) {
				break
			}
			err = nil
			p.Observe(i)
		}
		return errors.Join(err, m.FreeAll(a))
	}
	ops := &l.Trace.Ops
	log.Info("replay started", zap.String("trace", l.Trace.Name), zap.Int("ops", len(ops.Ops)),
		zap.Int("streams", len(ops.Streams)), zap.Int("unmatched_frees", ops.UnmatchedFrees),
		zap.Bool("loop", l.Loop), zap.Float64("ops_per_second", l.Rate))
	// One set of streams serves every pass, so that the allocator sees the
	// same streams again rather than new ones each pass; they are destroyed,
	// and released from the allocator, when the workload ends.
	streams := map[uint64]cudart.Stream{}
	defer func() {
		for ts, s := range streams {
			if ts != 0 {
				_ = a.Device().StreamDestroy(s)
				_ = a.ReleaseStream(s)
			}
		}
	}()
	for pass := 1; ; pass++ {
		res, err := Replay(ops, a, ReplayOptions{Observe: p.Observe, Ctx: ctx, Streams: streams})
		if ctx.Err() != nil {
			return FreeLive(a)
		}
		if err != nil {
			return errors.Join(fmt.Errorf("replay of %s, pass %d: %w", l.Trace.Name, pass, err), FreeLive(a))
		}
		lvl := zap.DebugLevel
		if pass == 1 {
			lvl = zap.InfoLevel
		}
		log.Log(lvl, "replay pass finished", zap.String("trace", l.Trace.Name), zap.Int("pass", pass),
			zap.Int("ops", res.Ops), zap.Int("failed_allocs", res.FailedAllocs), zap.Duration("took", res.Elapsed),
			zap.Int64("peak_allocated_bytes", res.PeakAllocated), zap.Int64("peak_reserved_bytes", res.PeakReserved))
		if !l.Loop {
			<-ctx.Done() // keep the trace's final state on show
		}
		if err := FreeLive(a); err != nil || ctx.Err() != nil {
			return err
		}
		if err := a.EmptyCache(); err != nil {
			return err
		}
	}
}

// FreeLive frees every allocation still live in a, as its snapshot lists
// them (what a replay left), and returns the errors joined.
func FreeLive(a *allocator.Allocator) error {
	var errs []error
	for _, seg := range a.Snapshot().Segments {
		for _, b := range seg.Blocks {
			if b.State == snapshot.BlockActiveAllocated {
				if err := a.Free(cudart.Ptr(b.Address)); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	return errors.Join(errs...)
}
