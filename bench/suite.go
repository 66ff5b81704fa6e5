package bench

import (
	"fmt"
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
// ".pickle.gz") its cold replay's row with its WarmFigures. rep.Device is t.Desc; rep.Conf is left to the
// caller. The first error stops it and names the benchmark.
func RunSuite(t *Target, cfg allocator.Config, s Suite) (Report, error) {
	rep := Report{Device: t.Desc, Pair: map[string]float64{}}
	fresh := func() (*allocator.Allocator, error) {
		dev, err := t.Device(simdev.Config{})
		if err != nil {
			return nil, err
		}
		return allocator.New(dev, cfg)
	}
	for _, size := range PairSizes {
		if s.PairIters <= 0 {
			break
		}
		a, err := fresh()
		if err != nil {
			return rep, err
		}
		best := 0.0
		for range 3 {
			d, err := Pair(a, size, s.PairIters)
			if err != nil {
				_ = a.Close()
				return rep, fmt.Errorf("pair/%d: %w", size, err)
			}
			if ns := float64(d.Nanoseconds()); best == 0 || ns < best {
				best = ns
			}
		}
		_ = a.Close()
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
			r, err := m.run(a, th, s.MixedSteps)
			_ = a.Close()
			if err != nil {
				return rep, fmt.Errorf("%s/threads=%d: %w", m.name, th, err)
			}
			*m.rows = append(*m.rows, MixedRowOf(r))
		}
	}
	for _, file := range s.Traces {
		tr, err := workload.LoadTrace(file)
		if err != nil {
			return rep, err // names the file
		}
		row, err := t.Replay(tr, cfg, workload.ReplayOptions{}, nil)
		if err != nil {
			return rep, fmt.Errorf("replaying %s: %w", file, err)
		}
		warm, err := t.ReplayWarm(tr, cfg)
		if err != nil {
			return rep, fmt.Errorf("replaying %s warm: %w", file, err)
		}
		driver, err := workload.DriverCost(&tr.Ops)
		if err != nil {
			return rep, fmt.Errorf("timing the replay driver on %s: %w", file, err)
		}
		row.WarmFigures = WarmFiguresOf(warm, driver)
		row.Trace = strings.TrimSuffix(tr.Name, ".pickle.gz")
		rep.Replay = append(rep.Replay, row)
	}
	return rep, nil
}
