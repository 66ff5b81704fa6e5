package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/pprof"

	"github.com/spf13/cobra"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/bench"
	"github.com/allocd/allocd/workload"
)

type benchFlags struct {
	device      string
	deviceFrom  string // "--device", "ALLOCD_DEVICE" or "" (the default)
	conf        string
	confFrom    string // "--conf" or "ALLOCD_CONF"
	simCapacity string
	pairIters   int
	mixedSteps  int
	threads     []int
	skipPair    bool
	skipMixed   bool
	json        bool
	copies      bool
	cpuProfile  string
}

func newBenchCmd() *cobra.Command {
	var f benchFlags
	cmd := &cobra.Command{
		Use:   "bench [flags] [TRACE...]",
		Short: "Run the pair, mixed and replay benchmarks",
		Long: `Bench runs the benchmarks that PyTorch's anchor runs on the same machine:
pair/SIZE (malloc+free of one size on the default stream, best of 3 runs),
mixed/threads=T (T goroutines, each on its own stream over its share of a
4096-slot window, freeing a random slot when it is live and allocating it
otherwise; sizes 80% up to 1 MiB, 18% up to 32 MiB, 2% up to 256 MiB),
mixed_warm/threads=T (the same pattern twice on the same streams, only the
second pass timed) and, for each TRACE, a cold replay (one pass on a fresh
allocator), a warm replay (two passes on one allocator, freeing what the
first left live, only the second timed: warm_ns_per_op) and the replay
driver's own cost with the allocator left out (driver_ns_per_op). Each
benchmark gets a fresh allocator. --cpuprofile FILE writes a CPU profile
of the benchmarks (go tool pprof reads it with the allocd binary).
--device and --sim-capacity default as replay's do (ALLOCD_DEVICE and
ALLOCD_SIM_CAPACITY when set).`,
		RunE: func(cmd *cobra.Command, args []string) error {
			f.confFrom = "--conf"
			if !cmd.Flags().Changed("conf") {
				f.conf, f.confFrom = os.Getenv(allocator.EnvConf), allocator.EnvConf
			}
			if f.skipPair && f.skipMixed && len(args) == 0 && !f.copies {
				return usageError(cmd, "--no-pair and --no-mixed with no TRACE leave nothing to run: give a TRACE, or drop one of them")
			}
			var err error
			if f.deviceFrom, err = applyDeviceEnv(cmd, &f.device, &f.simCapacity, true); err != nil {
				return err
			}
			return runBench(cmd.OutOrStdout(), cmd.ErrOrStderr(), f, args)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.device, "device", "auto", "auto, sim, cuda or cuda:N; without it, $ALLOCD_DEVICE when set")
	fl.StringVar(&f.conf, "conf", "", "allocator configuration (default: ALLOCD_CONF)")
	fl.StringVar(&f.simCapacity, "sim-capacity", defaultSimCapacityFlag, "memory of the simulated device; without it, $ALLOCD_SIM_CAPACITY")
	fl.IntVar(&f.pairIters, "pair-iters", 200_000, "pairs per pair run")
	fl.IntVar(&f.mixedSteps, "mixed-steps", bench.MixedSteps, "steps per goroutine in the mixed benchmark")
	fl.IntSliceVar(&f.threads, "threads", bench.MixedThreads, "goroutine counts of the mixed benchmark")
	fl.BoolVar(&f.skipPair, "no-pair", false, "skip the pair benchmark")
	fl.BoolVar(&f.skipMixed, "no-mixed", false, "skip the mixed benchmark")
	fl.BoolVar(&f.json, "json", false, "print one JSON object with every result")
	fl.StringVar(&f.cpuProfile, "cpuprofile", "", "write a CPU profile of the benchmarks to this file (runtime/pprof; read it with go tool pprof ALLOCD_BINARY FILE)")
	fl.BoolVar(&f.copies, "copies", false, "run only the host-device copy benchmark (bench.RunCopies): pageable vs pinned bandwidth, cached pinned alloc vs cudaHostAlloc")
	return cmd
}

// maxBenchCount bounds --pair-iters and --mixed-steps: enough for minutes
// of work, and threads × steps stays far from int overflow.
const maxBenchCount = 1_000_000_000

// checkBenchFlags checks the sizes the user gives bench: every count is
// at least 1 and at most maxBenchCount, and every goroutine count of
// --threads from 1 to workload.MixedWindow (each goroutine gets a share of
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
		if th < 1 || th > workload.MixedWindow {
			return fmt.Errorf("--threads %d: expected goroutine counts from 1 to %d", th, workload.MixedWindow)
		}
	}
	return nil
}

func runBench(stdout, stderr io.Writer, f benchFlags, traces []string) (err error) {
	if err := checkBenchFlags(f); err != nil {
		return err
	}
	cfg, err := parseConf(f.conf, f.confFrom)
	if err != nil {
		return err
	}
	target, err := openTarget(f.device, f.deviceFrom, f.simCapacity)
	if err != nil {
		return err
	}
	defer target.Close()
	if f.cpuProfile != "" {
		stop, perr := startCPUProfile(f.cpuProfile)
		if perr != nil {
			return perr
		}
		defer func() { // err is runBench's result

			if serr := stop(); err == nil && serr != nil {
				err = serr
			}
		}()
	}
	fmt.Fprintf(stderr, "allocd: benchmarking on the %s\n", target.Desc)
	if f.copies {
		return target.RunCopies(stdout, f.json)
	}
	suite := bench.Suite{PairIters: f.pairIters, MixedSteps: f.mixedSteps, Threads: f.threads, Traces: traces}
	if f.skipPair {
		suite.PairIters = 0
	}
	if f.skipMixed {
		suite.MixedSteps = 0
	}
	rep, err := bench.RunSuite(target, cfg, suite)
	if err != nil {
		return err
	}
	rep.Conf = f.conf
	for i := range rep.Replay {
		rep.Replay[i].Conf = f.conf
	}
	if f.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", " ")
		return enc.Encode(rep)
	}
	return bench.WriteReport(stdout, rep)
}

// startCPUProfile starts a CPU profile written to path (--cpuprofile) and
// returns the function that stops it and closes the file. The error of a
// file that cannot be created names the flag and the file.
func startCPUProfile(path string) (stop func() error, err error) {
	file, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(file); err != nil {
		_ = file.Close()
		return nil, fmt.Errorf("--cpuprofile %s: %w", path, err)
	}
	return func() error {
		pprof.StopCPUProfile()
		if err := file.Close(); err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		return nil
	}, nil
}
