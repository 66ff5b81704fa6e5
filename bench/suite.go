package bench

import (
	"context"
	"fmt"
	"runtime/pprof"
	"strings"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/workload"
)

// Suite says which benchmarks RunSuite runs and how long.
type Suite struct {
	// PairIters is the number of pairs of each of the 3 runs of each size
	// of PairSizes; 0 skips the pair benchmark.
	PairIters int
	// MixedSteps is each goroutine's number of steps in the mixed
	// benchmark, run once for each goroutine count of Threads; 0 skips it.
	MixedSteps int
	Threads    []int
	// Traces are trace files (workload.LoadTrace), each replayed cold (one
	// pass on a fresh allocator) and warm (workload.ReplayWarm, on another),
	// and timed without the allocator (workload.DriverCost).
	Traces []string
}

// RunSuite runs the benchmarks of s on t's devices with cfg, each on a
// fresh allocator, and returns their results: the best of 3 runs of each
// pair size (on a Sim whose events complete like a GPU's), the mixed
// benchmark for each goroutine count, and for each trace (named without
// ".pickle.gz") its cold replay's row with its WarmFigures. rep.Device is
// t.Desc; rep.Conf is left to the caller. The first error stops it and
// names the benchmark.
//
// In a CPU profile each benchmark carries the label bench (pair, mixed,
// mixed_warm, replay_load, replay_cold, replay_warm, replay_driver),
// with size, threads or trace; the warm replay's passes carry pass (first,
// second: the timed one), so that `go tool pprof -tagfocus` picks one.
func RunSuite(t *Target, cfg allocator.Config, s Suite) (Report, error) {
	rep := Report{Device: t.Desc, Pair: map[string]float64{}}
	fresh := func() (*allocator.Allocator, error) {
		dev, err := t.Device(simdev.Config{})
		if err != nil {
			return nil, err
		}
		return allocator.New(dev, cfg)
	}
	var err error
	labelled := func(run func(context.Context), kv ...string) {
		pprof.Do(context.Background(), pprof.Labels(kv...), run)
	}
	for _, size := range PairSizes {
		if s.PairIters <= 0 {
			break
		}
		var best float64
		labelled(func(context.Context) { best, err = pairBest(fresh, size, s.PairIters) }, "bench", "pair", "size", fmt.Sprint(size))
		if err != nil {
			return rep, fmt.Errorf("pair/%d: %w", size, err)
		}
		rep.Pair[fmt.Sprint(size)] = best
	}
	// The cold mixed runs, then the warm ones, each on a fresh allocator.
	for _, m := range []struct {
		name string
		run  func(*allocator.Allocator, int, int) (MixedResult, error)
		rows *[]MixedRow
	}{{"mixed", Mixed, &rep.Mixed}, {"mixed_warm", MixedWarm, &rep.Warm}} {
		for _, th := range s.Threads {
			if s.MixedSteps <= 0 {
				break
			}
			a, err := fresh()
			if err != nil {
				return rep, err
			}
			var r MixedResult
			labelled(func(context.Context) { r, err = m.run(a, th, s.MixedSteps) }, "bench", m.name, "threads", fmt.Sprint(th))
			_ = a.Close()
			if err != nil {
				return rep, fmt.Errorf("%s/threads=%d: %w", m.name, th, err)
			}
			*m.rows = append(*m.rows, MixedRowOf(r))
		}
	}
	for _, file := range s.Traces {
		var tr *workload.Trace
		labelled(func(context.Context) { tr, err = workload.LoadTrace(file) }, "bench", "replay_load", "trace", file)
		if err != nil {
			return rep, err // names the file
		}
		name := strings.TrimSuffix(tr.Name, ".pickle.gz")
		var row ReplayRow
		labelled(func(ctx context.Context) {
			row, err = t.Replay(tr, cfg, workload.ReplayOptions{Ctx: ctx}, nil)
		}, "bench", "replay_cold", "trace", name)
		if err != nil {
			return rep, fmt.Errorf("replaying %s: %w", file, err)
		}
		var warm, driver workload.ReplayResult
		labelled(func(ctx context.Context) {
			warm, err = t.ReplayWarm(tr, cfg, workload.ReplayOptions{Ctx: ctx})
		}, "bench", "replay_warm", "trace", name)
		if err != nil {
			return rep, fmt.Errorf("replaying %s warm: %w", file, err)
		}
		labelled(func(context.Context) { driver, err = workload.DriverCost(&tr.Ops) }, "bench", "replay_driver", "trace", name)
		if err != nil {
			return rep, fmt.Errorf("timing the replay driver on %s: %w", file, err)
		}
		row.WarmFigures = WarmFiguresOf(warm, driver)
		row.Trace = name
		rep.Replay = append(rep.Replay, row)
	}
	return rep, nil
}

// pairBest returns the best of 3 runs of n pairs of size, in ns per pair,
// on a fresh allocator.
func pairBest(fresh func() (*allocator.Allocator, error), size uint64, n int) (float64, error) {
	a, err := fresh()
	if err != nil {
		return 0, err
	}
	defer a.Close()
	best := 0.0
	for range 3 {
		d, err := Pair(a, size, n)
		if err != nil {
			return 0, err
		}
		if ns := float64(d.Nanoseconds()); best == 0 || ns < best {
			best = ns
		}
	}
	return best, nil
}
