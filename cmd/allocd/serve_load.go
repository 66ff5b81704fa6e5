package main

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/bench"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/trace"
)

// serveWorkload drives the daemon's allocators so that their metrics move:
// a trace replayed with bench.Replay (--replay, --loop) or the mixed
// benchmark's random workload (--synthetic), paced at rate operations a
// second (0: unpaced). The daemon runs it once per device, each in its own
// goroutine (run); it is read-only once made, so the runs share it. Each
// run owns every allocation it makes and frees them when it stops.
type serveWorkload struct {
	name      string
	ops       *trace.Ops          // nil: synthetic
	addresses []cudart.SimAddress // the trace's segment addresses
	loop      bool
	rate      float64
}

// syntheticWindow is the synthetic workload's number of slots, as the
// mixed benchmark's single-thread run (DESIGN.md §7).
const syntheticWindow = bench.MixedWindow

// newServeWorkload reads the trace of --replay, or sets up --synthetic.
func newServeWorkload(f serveFlags) (*serveWorkload, error) {
	w := &serveWorkload{name: "synthetic", loop: true, rate: f.rate}
	if f.replay == "" {
		return w, nil
	}
	snap, err := trace.ReadFile(f.replay, trace.ReadOptions{})
	if err != nil {
		return nil, fmt.Errorf("--replay: %w", err)
	}
	if len(snap.DeviceTraces) == 0 || len(snap.DeviceTraces[0]) == 0 {
		return nil, fmt.Errorf("--replay %s: the snapshot has no device trace (record with torch.cuda.memory._record_memory_history() before dumping it)", f.replay)
	}
	ops := trace.BuildOps(snap.DeviceTraces[0])
	w.name, w.ops, w.loop = filepath.Base(f.replay), &ops, f.loop
	w.addresses = bench.SegmentAddresses(snap.DeviceTraces[0])
	return w, nil
}

// run drives a, the allocator of device index gpu, until ctx ends (or,
// without loop, until the trace ends and then ctx ends), then frees what
// the workload still holds. The synthetic workload's generator is seeded
// 42+gpu, as the mixed benchmark seeds its threads, so that devices differ.
func (w *serveWorkload) run(ctx context.Context, a *allocator.Allocator, gpu int, log *zap.Logger) error {
	p := newServePacer(ctx, w.rate)
	if w.ops == nil {
		seed := uint64(42 + gpu)
		log.Info("synthetic workload started", zap.Int("window", syntheticWindow), zap.Uint64("seed", seed),
			zap.Float64("ops_per_second", w.rate))
		return runSyntheticWorkload(ctx, a, p, seed)
	}
	log.Info("replay started", zap.String("trace", w.name), zap.Int("ops", len(w.ops.Ops)),
		zap.Int("streams", len(w.ops.Streams)), zap.Int("unmatched_frees", w.ops.UnmatchedFrees),
		zap.Bool("loop", w.loop), zap.Float64("ops_per_second", w.rate))
	// One set of streams serves every pass, so that the allocator sees the
	// same streams again rather than new ones each pass; they are destroyed
	// when the workload ends.
	streams := map[uint64]cudart.Stream{}
	defer func() {
		for ts, s := range streams {
			if ts != 0 {
				_ = a.Device().StreamDestroy(s)
			}
		}
	}()
	for pass := 1; ; pass++ {
		res, err := bench.Replay(w.ops, a, bench.ReplayOptions{Observe: p.observe, Ctx: ctx, Streams: streams})
		if ctx.Err() != nil {
			return freeLiveAllocations(a)
		}
		if err != nil {
			return errors.Join(fmt.Errorf("replay of %s, pass %d: %w", w.name, pass, err), freeLiveAllocations(a))
		}
		lvl := zap.DebugLevel
		if pass == 1 {
			lvl = zap.InfoLevel
		}
		log.Log(lvl, "replay pass finished", zap.String("trace", w.name), zap.Int("pass", pass),
			zap.Int("ops", res.Ops), zap.Int("failed_allocs", res.FailedAllocs), zap.Duration("took", res.Elapsed),
			zap.Int64("peak_allocated_bytes", res.PeakAllocated), zap.Int64("peak_reserved_bytes", res.PeakReserved))
		if !w.loop {
			// Keep the trace's final state on show until shutdown.
			<-ctx.Done()
		}
		if err := freeLiveAllocations(a); err != nil || ctx.Err() != nil {
			return err
		}
		// Each pass starts, as bench.Replay expects, from an allocator with
		// nothing cached, so that every pass shows the trace's own peaks.
		if err := a.EmptyCache(); err != nil {
			return err
		}
	}
}

// freeLiveAllocations frees every allocation still live in a: what a
// replay left.
func freeLiveAllocations(a *allocator.Allocator) error {
	var errs []error
	for _, seg := range a.Snapshot().Segments {
		for _, b := range seg.Blocks {
			if b.State == "active_allocated" {
				if err := a.Free(cudart.Ptr(b.Address)); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	return errors.Join(errs...)
}

// runSyntheticWorkload runs the mixed benchmark's steps (DESIGN.md §7) on the
// default stream until ctx ends, with a generator seeded seed: a random
// slot of the window is freed when live and allocated otherwise.
// Allocations the device cannot satisfy are skipped (the allocator counts
// them as OOMs).
func runSyntheticWorkload(ctx context.Context, a *allocator.Allocator, p *servePacer, seed uint64) error {
	r := bench.NewSplitMix64(seed)
	live := make([]cudart.Ptr, syntheticWindow)
	var err error
	for i := 0; ctx.Err() == nil; i++ {
		slot := r.Next() % syntheticWindow
		if live[slot] != 0 {
			if err = a.Free(live[slot]); err != nil {
				break
			}
			live[slot] = 0
		} else {
			ptr, merr := a.Malloc(bench.MixedSize(&r), cudart.DefaultStream)
			if merr != nil && !errors.Is(merr, allocator.ErrOutOfMemory) {
				err = merr
				break
			}
			live[slot] = ptr
		}
		p.observe(i)
	}
	errs := []error{err}
	for _, ptr := range live {
		if ptr != 0 {
			errs = append(errs, a.Free(ptr))
		}
	}
	return errors.Join(errs...)
}

// servePacer holds a workload to rate operations a second on average: after
// each operation it sleeps until that operation's due time when it is
// more than a millisecond ahead. Once ctx ends it no longer sleeps, so the
// workload finishes what it is doing at full speed.
type servePacer struct {
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

// newServePacer paces at rate operations a second; rate 0 (or below)
// leaves the workload unpaced. checkServeFlags keeps rate to 0 or
// [minReplayRate, maxReplayRate]; any other value still paces safely
// (pacerDue).
func newServePacer(ctx context.Context, rate float64) *servePacer {
	return &servePacer{ctx: ctx, rate: rate, start: time.Now()}
}

// observe is called after each operation (bench.ReplayOptions.Observe).
func (p *servePacer) observe(int) {
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
