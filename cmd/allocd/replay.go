package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/bench"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/workload"
)

// replayFlags are the flags of `allocd replay`.
type replayFlags struct {
	confs       []string
	confFrom    string // "--conf" or "ALLOCD_CONF"
	json        bool
	simCapacity string
	device      string
	deviceFrom  string // "--device", "ALLOCD_DEVICE" or "" (the default)
	svg         string
	snapshotOut string
	progress    bool // set when stderr is a terminal
	// pytorchExpandable: allocator.WithPyTorchExpandable for every
	// configuration.
	pytorchExpandable bool
}

func newReplayCmd() *cobra.Command {
	var f replayFlags
	cmd := &cobra.Command{
		Use:   "replay [flags] TRACE...",
		Short: "Replay PyTorch memory traces through the allocator and report peak memory",
		Long: `Replay reads memory snapshots written by torch.cuda.memory._dump_snapshot()
(plain or gzip pickles), replays every allocation and free through a fresh
allocator, and reports peak allocated and reserved memory, device mallocs,
retries and OOMs.

--conf may be repeated: each trace is replayed once per configuration. Without
--conf the ALLOCD_CONF environment variable is used (empty: PyTorch's defaults).

--device auto (the default) uses CUDA device 0 when a driver is present and the
simulated device otherwise, and says which on stderr. Without --device,
ALLOCD_DEVICE chooses when it is set (cuda: the GPU, no fallback; sim or
sim:N: one simulated device), and ALLOCD_SIM_CAPACITY sizes the simulated
device when --sim-capacity is not given. Replay on the simulated device is
exact and deterministic and needs no GPU memory.

--svg FILE draws allocated, reserved and requested bytes over the trace for
every configuration in one chart. --snapshot-out FILE writes the allocator's
snapshot (segments, blocks and the history that led there) at the moment of
peak reserved memory, with the first configuration, as a pickle that PyTorch's
memory viewer (torch.cuda._memory_viz, pytorch.org/memory_viz) reads. With
several traces, the trace's name is added to each file name.

--pytorch-expandable makes expandable segments (expandable_segments:True)
grow exactly as PyTorch's do: free pages are unmapped only on out of memory
and by empty_cache, in 20 MiB large-pool pages, never reclaimed to keep
reserved memory near its high-water mark as allocd does by default. Peaks
then match PyTorch's expandable_segments:True figures. It has no effect on
configurations without expandable segments.`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usageError(cmd, "replay needs at least one TRACE file")
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			f.confFrom = "--conf"
			if !cmd.Flags().Changed("conf") {
				f.confs, f.confFrom = []string{os.Getenv(allocator.EnvConf)}, allocator.EnvConf
			}
			var err error
			if f.deviceFrom, err = applyDeviceEnv(cmd, &f.device, &f.simCapacity, true); err != nil {
				return err
			}
			f.progress = !f.json && isTerminal(cmd.ErrOrStderr())
			return runReplay(cmd.OutOrStdout(), cmd.ErrOrStderr(), f, args)
		},
	}
	fl := cmd.Flags()
	fl.StringArrayVar(&f.confs, "conf", nil, "allocator configuration in ALLOCD_CONF grammar; repeat to compare configurations")
	fl.BoolVar(&f.json, "json", false, "print one JSON object per trace and configuration")
	fl.StringVar(&f.simCapacity, "sim-capacity", defaultSimCapacityFlag, "memory of the simulated device (bytes, or with KiB/MiB/GiB/TiB); without it, $ALLOCD_SIM_CAPACITY")
	fl.StringVar(&f.device, "device", "auto", "auto, sim, cuda or cuda:N; without it, $ALLOCD_DEVICE when set")
	fl.StringVar(&f.svg, "svg", "", "write a chart of allocated/reserved/requested bytes over the trace to this SVG file")
	fl.StringVar(&f.snapshotOut, "snapshot-out", "", "write the snapshot at peak reserved memory to this pickle file (simulated device only)")
	fl.BoolVar(&f.pytorchExpandable, "pytorch-expandable", false, "expandable segments behave exactly as PyTorch's: no reclaim, 20 MiB large pages")
	return cmd
}

// historyLimit bounds the history recorded for --snapshot-out: enough for
// every shared trace, as PyTorch's max_entries does.
const historyLimit = 3_000_000

// openTarget opens the device of --device (or ALLOCD_DEVICE, as from
// says) and --sim-capacity.
func openTarget(device, from, simCapacity string) (*bench.Target, error) {
	capacity, err := parseSize("--sim-capacity", simCapacity)
	if err != nil {
		return nil, err
	}
	t, err := bench.OpenTarget(device, capacity)
	if errors.Is(err, cudart.ErrNoDriver) {
		// One line: `allocd devices` tells the libraries tried.
		return nil, fmt.Errorf("%s: %w (`allocd devices` lists the libraries tried); "+
			"for the simulated device use --device sim, or --device auto to fall back to it", deviceSetting(from, device), cudart.ErrNoDriver)
	}
	if err != nil {
		if spec, perr := devspec.Parse(device); (perr == nil && spec.Multi()) || strings.HasPrefix(device, "sim:") {
			err = fmt.Errorf("%w; sim:N and cuda:all are for allocd serve", err)
		}
		return nil, fmt.Errorf("%s: %w", deviceFlagName(from), err)
	}
	return t, nil
}

func runReplay(stdout, stderr io.Writer, f replayFlags, files []string) error {
	cfgs := make([]allocator.Config, len(f.confs))
	for i, c := range f.confs {
		var err error
		if cfgs[i], err = parseConf(c, f.confFrom); err != nil {
			return err
		}
	}
	// The output files are checked before any work: a bad path fails at
	// once, not after the replays.
	for _, file := range files {
		if err := checkOutPath("--svg", outName(f.svg, file, len(files))); err != nil {
			return err
		}
		if err := checkOutPath("--snapshot-out", outName(f.snapshotOut, file, len(files))); err != nil {
			return err
		}
	}
	target, err := openTarget(f.device, f.deviceFrom, f.simCapacity)
	if err != nil {
		return err
	}
	defer target.Close()
	if f.snapshotOut != "" && !target.Sim() {
		return errors.New("--snapshot-out needs the simulated device (--device sim), whose replays are deterministic")
	}
	if !f.json {
		fmt.Fprintf(stderr, "allocd: replaying on the %s\n", target.Desc)
	}
	var aopts []allocator.Option
	if f.pytorchExpandable {
		aopts = append(aopts, allocator.WithPyTorchExpandable())
	}
	var rows []bench.ReplayRow
	for _, file := range files {
		t0 := time.Now()
		tr, err := workload.LoadTrace(file)
		if err != nil {
			return err // names the file
		}
		if !f.json {
			fmt.Fprintf(stderr, "allocd: %s: %d operations read in %s", tr.Name, len(tr.Ops.Ops), time.Since(t0).Round(time.Millisecond))
			if n := tr.Ops.UnmatchedFrees; n > 0 {
				fmt.Fprintf(stderr, "; %d frees of addresses allocated before recording began were skipped", n)
			}
			fmt.Fprintln(stderr)
		}
		var series []bench.ChartSeries
		for i, cfg := range cfgs {
			var sampler *bench.Sampler
			var opt workload.ReplayOptions
			finish := func() {}
			if f.progress && len(tr.Ops.Ops) >= progressMinOps {
				bar := newProgressBar(stderr, len(tr.Ops.Ops), fmt.Sprintf("%s %s", tr.Name, bench.ConfLabel(f.confs[i])))
				opt.Progress, opt.ProgressEvery = func(done int) { _ = bar.Set(done) }, len(tr.Ops.Ops)/200+1
				finish = func() { _ = bar.Finish() }
			}
			prepare := func(a *allocator.Allocator, opt *workload.ReplayOptions) {
				if f.svg != "" {
					sampler = bench.NewSampler(a, len(tr.Ops.Ops), 1500)
					opt.Observe = sampler.Observe
				}
			}
			row, err := target.Replay(tr, cfg, opt, prepare, aopts...)
			finish()
			if err != nil {
				return fmt.Errorf("replaying %s with %q: %w", file, f.confs[i], err)
			}
			row.Trace, row.Conf = tr.Name, f.confs[i]
			row.PyTorchExpandable = f.pytorchExpandable && cfg.ExpandableSegments
			rows = append(rows, row)
			if f.json {
				if err := json.NewEncoder(stdout).Encode(row); err != nil {
					return err
				}
			}
			if sampler != nil {
				sampler.Flush(len(tr.Ops.Ops) - 1)
				series = append(series, bench.ChartSeries{Conf: f.confs[i], Samples: sampler.Samples})
			}
		}
		if f.svg != "" {
			err := writeFile("--svg", outName(f.svg, file, len(files)), func(w io.Writer) error {
				return bench.WriteChart(w, "allocd replay of "+tr.Name, series)
			})
			if err != nil {
				return err
			}
		}
		if f.snapshotOut != "" {
			snap, err := target.SnapshotAtPeak(tr, cfgs[0], historyLimit, aopts...)
			if err != nil {
				return fmt.Errorf("--snapshot-out: %w", err)
			}
			err = writeFile("--snapshot-out", outName(f.snapshotOut, file, len(files)), func(w io.Writer) error {
				return snapshot.WritePickle(w, snap)
			})
			if err != nil {
				return err
			}
		}
	}
	if !f.json {
		return bench.WriteReplayTable(stdout, rows)
	}
	return nil
}
