package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/bench"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/trace"
)

type benchFlags struct {
	device      string
	conf        string
	simCapacity string
	pairIters   int
	mixedSteps  int
	threads     []int
	skipPair    bool
	skipMixed   bool
	json        bool
}

func newBenchCmd() *cobra.Command {
	var f benchFlags
	cmd := &cobra.Command{
		Use:   "bench [flags] [TRACE...]",
		Short: "Run the pair, mixed and replay benchmarks of DESIGN.md §7",
		Long: `Bench runs the benchmarks that PyTorch's anchor runs on the same machine:
pair/SIZE (malloc+free of one size, best of 3 runs), mixed/threads=T (T
goroutines on their own streams over a random window), mixed_warm/threads=T
(the same pattern twice on the same streams, the second pass timed) and, for
each TRACE, a replay. Each benchmark gets a fresh allocator.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("conf") {
				f.conf = os.Getenv("ALLOCD_CONF")
			}
			return runBench(cmd.OutOrStdout(), cmd.ErrOrStderr(), f, args)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.device, "device", "auto", "auto, sim, cuda or cuda:N")
	fl.StringVar(&f.conf, "conf", "", "allocator configuration (default: ALLOCD_CONF)")
	fl.StringVar(&f.simCapacity, "sim-capacity", "141GiB", "memory of the simulated device")
	fl.IntVar(&f.pairIters, "pair-iters", 200_000, "pairs per pair run")
	fl.IntVar(&f.mixedSteps, "mixed-steps", bench.MixedSteps, "steps per goroutine in the mixed benchmark")
	fl.IntSliceVar(&f.threads, "threads", bench.MixedThreads, "goroutine counts of the mixed benchmark")
	fl.BoolVar(&f.skipPair, "no-pair", false, "skip the pair benchmark")
	fl.BoolVar(&f.skipMixed, "no-mixed", false, "skip the mixed benchmark")
	fl.BoolVar(&f.json, "json", false, "print one JSON object with every result")
	return cmd
}

// benchReport is the JSON shape of `allocd bench --json`.
type benchReport struct {
	Device string             `json:"device"`
	Conf   string             `json:"conf"`
	Pair   map[string]float64 `json:"pair_ns"`
	Mixed  []mixedRow         `json:"mixed"`
	Warm   []mixedRow         `json:"mixed_warm"`
	Replay []replayRow        `json:"replay"`
}

type mixedRow struct {
	Threads            int     `json:"threads"`
	Ops                int     `json:"ops"`
	NsPerOp            float64 `json:"ns_per_op"`
	MopsPerSec         float64 `json:"mops_per_s"`
	PeakAllocatedBytes int64   `json:"peak_allocated_bytes"`
	PeakReservedBytes  int64   `json:"peak_reserved_bytes"`
}

// maxBenchCount bounds --pair-iters and --mixed-steps: enough for minutes
// of work, and threads × steps stays far from int overflow.
const maxBenchCount = 1_000_000_000

// checkBenchFlags checks the sizes the user gives bench: every count is
// at least 1 and at most maxBenchCount, and every goroutine count of
// --threads from 1 to bench.MixedWindow (each goroutine gets a share of
// the window, at least one slot).
func checkBenchFlags(f benchFlags) error {
	for _, c := range []struct {
		flag string
		n    int
	}{{"--pair-iters", f.pairIters}, {"--mixed-steps", f.mixedSteps}} {
		if c.n < 1 || c.n > maxBenchCount {
			return fmt.Errorf("%s %d: expected a count from 1 to %d", c.flag, c.n, maxBenchCount)
		}
	}
	if !f.skipMixed && len(f.threads) == 0 {
		return errors.New("--threads: expected at least one goroutine count (or --no-mixed)")
	}
	for _, th := range f.threads {
		if th < 1 || th > bench.MixedWindow {
			return fmt.Errorf("--threads %d: expected goroutine counts from 1 to %d", th, bench.MixedWindow)
		}
	}
	return nil
}

func runBench(stdout, stderr io.Writer, f benchFlags, traces []string) error {
	if err := checkBenchFlags(f); err != nil {
		return err
	}
	cfg, err := parseConf(f.conf)
	if err != nil {
		return err
	}
	target, err := openReplayTarget(replayFlags{device: f.device, simCapacity: f.simCapacity}, stderr)
	if err != nil {
		return err
	}
	defer target.close()
	fmt.Fprintf(stderr, "allocd: benchmarking on the %s\n", target.desc)
	rep := benchReport{Device: target.desc, Conf: f.conf, Pair: map[string]float64{}}
	fresh := func() (*allocator.Allocator, error) {
		dev, err := target.device(nil)
		if err != nil {
			return nil, err
		}
		if sim, ok := dev.(*cudart.Sim); ok {
			// The micro benchmarks want events that complete like a GPU's.
			dev, err = cudart.NewSim(cudart.SimConfig{Capacity: sim.Info().TotalMemory})
			if err != nil {
				return nil, err
			}
		}
		return allocator.New(dev, cfg)
	}
	if !f.skipPair {
		for _, size := range bench.PairSizes {
			a, err := fresh()
			if err != nil {
				return err
			}
			best := 0.0
			for range 3 {
				d, err := bench.Pair(a, size, f.pairIters)
				if err != nil {
					return err
				}
				if ns := float64(d.Nanoseconds()); best == 0 || ns < best {
					best = ns
				}
			}
			_ = a.Close()
			rep.Pair[fmt.Sprint(size)] = best
		}
	}
	if !f.skipMixed {
		for _, th := range f.threads {
			a, err := fresh()
			if err != nil {
				return err
			}
			r, err := bench.Mixed(a, th, f.mixedSteps)
			_ = a.Close()
			if err != nil {
				return fmt.Errorf("mixed/threads=%d: %w", th, err)
			}
			rep.Mixed = append(rep.Mixed, mixedRow{th, r.Ops, r.NsPerOp(), r.MopsPerSec(), r.PeakAllocated, r.PeakReserved})
		}
		for _, th := range f.threads {
			a, err := fresh()
			if err != nil {
				return err
			}
			r, err := bench.MixedWarm(a, th, f.mixedSteps)
			_ = a.Close()
			if err != nil {
				return fmt.Errorf("mixed_warm/threads=%d: %w", th, err)
			}
			rep.Warm = append(rep.Warm, mixedRow{th, r.Ops, r.NsPerOp(), r.MopsPerSec(), r.PeakAllocated, r.PeakReserved})
		}
	}
	for _, file := range traces {
		snap, err := trace.ReadFile(file, trace.ReadOptions{})
		if err != nil {
			return err // names the file
		}
		if len(snap.DeviceTraces) == 0 {
			return fmt.Errorf("%s: no device trace", file)
		}
		ops := trace.BuildOps(snap.DeviceTraces[0])
		row, err := replayOne(target, &ops, bench.SegmentAddresses(snap.DeviceTraces[0]), cfg, &bench.ReplayOptions{}, nil)
		if err != nil {
			return fmt.Errorf("replaying %s: %w", file, err)
		}
		row.Trace, row.Conf = strings.TrimSuffix(filepath.Base(file), ".pickle.gz"), f.conf
		rep.Replay = append(rep.Replay, row)
	}
	if f.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", " ")
		return enc.Encode(rep)
	}
	return printBench(stdout, rep)
}

func printBench(w io.Writer, rep benchReport) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	if len(rep.Pair) > 0 {
		fmt.Fprintln(tw, "benchmark\tns/pair\t")
		for _, size := range bench.PairSizes {
			fmt.Fprintf(tw, "pair/%d\t%.0f\t\n", size, rep.Pair[fmt.Sprint(size)])
		}
		fmt.Fprintln(tw, "\t\t")
	}
	if len(rep.Mixed) > 0 {
		fmt.Fprintln(tw, "benchmark\tns/op\tMops/s\tpeak allocated MiB\tpeak reserved MiB\t")
		for _, m := range rep.Mixed {
			fmt.Fprintf(tw, "mixed/threads=%d\t%.0f\t%.2f\t%s\t%s\t\n", m.Threads, m.NsPerOp, m.MopsPerSec, mib(m.PeakAllocatedBytes), mib(m.PeakReservedBytes))
		}
		for _, m := range rep.Warm {
			fmt.Fprintf(tw, "mixed_warm/threads=%d\t%.0f\t%.2f\t%s\t%s\t\n", m.Threads, m.NsPerOp, m.MopsPerSec, mib(m.PeakAllocatedBytes), mib(m.PeakReservedBytes))
		}
		fmt.Fprintln(tw, "\t\t\t\t\t")
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(rep.Replay) > 0 {
		return printReplayTable(w, rep.Replay)
	}
	return nil
}
