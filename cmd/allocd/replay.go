package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/bench"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/trace"
)

// replayFlags are the flags of `allocd replay`.
type replayFlags struct {
	confs       []string
	json        bool
	simCapacity string
	device      string
	svg         string
	snapshotOut string
	progress    bool // set when stderr is a terminal
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
simulated device otherwise, and says which on stderr. Replay on the simulated
device is exact and deterministic and needs no GPU memory.

--svg FILE draws allocated, reserved and requested bytes over the trace for
every configuration in one chart. --snapshot-out FILE writes the allocator's
snapshot (segments, blocks and the history that led there) at the moment of
peak reserved memory, with the first configuration, as a pickle that PyTorch's
memory viewer (torch.cuda._memory_viz, pytorch.org/memory_viz) reads. With
several traces, the trace's name is added to each file name.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !cmd.Flags().Changed("conf") {
				f.confs = []string{os.Getenv("ALLOCD_CONF")}
			}
			f.progress = !f.json && isTerminal(cmd.ErrOrStderr())
			return runReplay(cmd.OutOrStdout(), cmd.ErrOrStderr(), f, args)
		},
	}
	fl := cmd.Flags()
	fl.StringArrayVar(&f.confs, "conf", nil, "allocator configuration in ALLOCD_CONF grammar; repeat to compare configurations")
	fl.BoolVar(&f.json, "json", false, "print one JSON object per trace and configuration")
	fl.StringVar(&f.simCapacity, "sim-capacity", "141GiB", "memory of the simulated device (bytes, or with KiB/MiB/GiB/TiB)")
	fl.StringVar(&f.device, "device", "auto", "auto, sim, cuda or cuda:N")
	fl.StringVar(&f.svg, "svg", "", "write a chart of allocated/reserved/requested bytes over the trace to this SVG file")
	fl.StringVar(&f.snapshotOut, "snapshot-out", "", "write the snapshot at peak reserved memory to this pickle file (simulated device only)")
	return cmd
}

// parseBytes parses "1234", "512MiB", "141GiB", "1.5TiB" (also KB/MB/GB
// meaning the same binary units, as nvidia-smi does).
func parseBytes(s string) (uint64, error) {
	units := []struct {
		suffix string
		mult   float64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
		{"TB", 1 << 40}, {"GB", 1 << 30}, {"MB", 1 << 20}, {"KB", 1 << 10}, {"B", 1}}
	t := strings.TrimSpace(s)
	mult := 1.0
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	// !(b >= 1) also rejects NaN, and a size that truncates to 0 bytes
	// (1e-300GiB); b < 1<<63 rejects +Inf.
	if b := v * mult; err != nil || !(b >= 1 && b < 1<<63) {
		return 0, fmt.Errorf("bad size %q: expected a number of bytes from 1 to 8 EiB, optionally with KiB, MiB, GiB or TiB (not NaN or Inf)", s)
	}
	return uint64(v * mult), nil
}

// replayRow is one replay's result, in the JSON shape of `--json`.
type replayRow struct {
	Trace              string  `json:"trace"`
	Conf               string  `json:"conf"`
	Ops                int     `json:"ops"`
	PeakAllocatedBytes int64   `json:"peak_allocated_bytes"`
	PeakReservedBytes  int64   `json:"peak_reserved_bytes"`
	PeakRequestedBytes int64   `json:"peak_requested_bytes"`
	DeviceMallocs      int64   `json:"device_mallocs"`
	DeviceFrees        int64   `json:"device_frees"`
	AllocRetries       int64   `json:"alloc_retries"`
	OOMs               int64   `json:"ooms"`
	NsPerOp            float64 `json:"ns_per_op"`
}

// replayTarget opens fresh devices for replays: a new Sim each time, or the
// one CUDA device shared by all replays.
type replayTarget struct {
	sim      bool
	capacity uint64
	cuda     cudart.Device
	desc     string
}

func openReplayTarget(f replayFlags, stderr io.Writer) (*replayTarget, error) {
	capacity, err := parseBytes(f.simCapacity)
	if err != nil {
		return nil, fmt.Errorf("--sim-capacity: %w", err)
	}
	t := &replayTarget{sim: true, capacity: capacity, desc: fmt.Sprintf("simulated device, %s", allocator.FormatSize(capacity))}
	if f.device == "sim" {
		return t, nil
	}
	spec := deviceSpec{}
	if f.device != "auto" {
		if spec, err = parseDeviceSpec(f.device); err != nil {
			return nil, err
		}
	}
	dev, err := openCUDA(spec.index)
	if err != nil {
		if f.device == "auto" && errors.Is(err, cudart.ErrNoDriver) {
			t.desc += " (no CUDA driver found; `allocd devices` says why)"
			return t, nil
		}
		return nil, err
	}
	info := dev.Info()
	return &replayTarget{cuda: dev, desc: fmt.Sprintf("CUDA device %d (%s)", info.Index, info.Name)}, nil
}

// device returns the device for one replay: a fresh Sim that hands out the
// trace's recorded segment addresses (plan), or the CUDA device.
func (t *replayTarget) device(plan []cudart.SimAddress) (cudart.Device, error) {
	if t.sim {
		return cudart.NewSim(cudart.SimConfig{Capacity: t.capacity, ManualEvents: true, Addresses: plan})
	}
	return t.cuda, nil
}

func (t *replayTarget) close() {
	if t.cuda != nil {
		_ = t.cuda.Close()
	}
}

func runReplay(stdout, stderr io.Writer, f replayFlags, files []string) error {
	cfgs := make([]allocator.Config, len(f.confs))
	for i, c := range f.confs {
		var err error
		if cfgs[i], err = parseConf(c); err != nil {
			return err
		}
	}
	target, err := openReplayTarget(f, stderr)
	if err != nil {
		return err
	}
	defer target.close()
	if f.snapshotOut != "" && !target.sim {
		return errors.New("--snapshot-out needs the simulated device (--device sim), whose replays are deterministic")
	}
	if !f.json {
		fmt.Fprintf(stderr, "allocd: replaying on the %s\n", target.desc)
	}
	var rows []replayRow
	for _, file := range files {
		t0 := time.Now()
		snap, err := trace.ReadFile(file, trace.ReadOptions{})
		if err != nil {
			return err // names the file
		}
		if len(snap.DeviceTraces) == 0 || len(snap.DeviceTraces[0]) == 0 {
			return fmt.Errorf("%s: the snapshot has no device trace (record with torch.cuda.memory._record_memory_history() before dumping it)", file)
		}
		ops := trace.BuildOps(snap.DeviceTraces[0])
		plan := bench.SegmentAddresses(snap.DeviceTraces[0])
		if !f.json {
			fmt.Fprintf(stderr, "allocd: %s: %d operations read in %s", filepath.Base(file), len(ops.Ops), time.Since(t0).Round(time.Millisecond))
			if ops.UnmatchedFrees > 0 {
				fmt.Fprintf(stderr, "; %d frees of addresses allocated before recording began were skipped", ops.UnmatchedFrees)
			}
			fmt.Fprintln(stderr)
		}
		var series []chartSeries
		for i, cfg := range cfgs {
			var sampler *bench.Sampler
			opt := bench.ReplayOptions{}
			finish := func() {}
			if f.progress && len(ops.Ops) >= progressMinOps {
				bar := newProgressBar(stderr, len(ops.Ops), fmt.Sprintf("%s %s", filepath.Base(file), confLabel(f.confs[i])))
				opt.Progress, opt.ProgressEvery = func(done int) { _ = bar.Set(done) }, len(ops.Ops)/200+1
				finish = func() { _ = bar.Finish() }
			}
			newSampler := func(a *allocator.Allocator) {
				if f.svg != "" {
					sampler = bench.NewSampler(a, len(ops.Ops), 1500)
					opt.Observe = sampler.Observe
				}
			}
			row, err := replayOne(target, &ops, plan, cfg, &opt, newSampler)
			finish()
			if err != nil {
				return fmt.Errorf("replaying %s with %q: %w", file, f.confs[i], err)
			}
			row.Trace = filepath.Base(file)
			row.Conf = f.confs[i]
			rows = append(rows, row)
			if f.json {
				if err := json.NewEncoder(stdout).Encode(row); err != nil {
					return err
				}
			}
			if sampler != nil {
				sampler.Flush(len(ops.Ops) - 1)
				series = append(series, chartSeries{conf: f.confs[i], samples: sampler.Samples})
			}
		}
		if f.svg != "" {
			if err := writeChartFile(outName(f.svg, file, len(files)), "allocd replay of "+filepath.Base(file), series); err != nil {
				return err
			}
		}
		if f.snapshotOut != "" {
			if err := writePeakSnapshot(outName(f.snapshotOut, file, len(files)), target, &ops, plan, cfgs[0]); err != nil {
				return err
			}
		}
	}
	if !f.json {
		return printReplayTable(stdout, rows)
	}
	return nil
}

// replayOne replays ops on a fresh allocator; prepare, when set, is called
// with the allocator before the replay (to attach a sampler to *opt).
func replayOne(target *replayTarget, ops *trace.Ops, plan []cudart.SimAddress, cfg allocator.Config, opt *bench.ReplayOptions, prepare func(*allocator.Allocator)) (replayRow, error) {
	dev, err := target.device(plan)
	if err != nil {
		return replayRow{}, err
	}
	a, err := allocator.New(dev, cfg)
	if err != nil {
		return replayRow{}, err
	}
	if prepare != nil {
		prepare(a)
	}
	r, err := bench.Replay(ops, a, *opt)
	if cerr := a.Close(); err == nil && cerr != nil && !errors.Is(cerr, allocator.ErrLiveBlocks) {
		err = cerr
	}
	if err != nil {
		return replayRow{}, err
	}
	return replayRow{
		Ops:                r.Ops,
		PeakAllocatedBytes: r.PeakAllocated,
		PeakReservedBytes:  r.PeakReserved,
		PeakRequestedBytes: r.PeakRequested,
		DeviceMallocs:      r.DeviceMallocs,
		DeviceFrees:        r.DeviceFrees,
		AllocRetries:       r.AllocRetries,
		OOMs:               r.OOMs,
		NsPerOp:            r.NsPerOp(),
	}, nil
}

func mib(n int64) string { return strconv.FormatFloat(float64(n)/(1<<20), 'f', 0, 64) }

func confLabel(conf string) string {
	if conf == "" {
		return "(default)"
	}
	return conf
}

// bestRows marks, per trace, the row with the lowest peak reserved among
// those without OOMs (fewer device mallocs breaks a tie); nothing is
// marked for a trace replayed with one configuration.
func bestRows(rows []replayRow) map[int]bool {
	best := map[string]int{}
	count := map[string]int{}
	for i, r := range rows {
		count[r.Trace]++
		if r.OOMs > 0 {
			continue
		}
		j, ok := best[r.Trace]
		if !ok || r.PeakReservedBytes < rows[j].PeakReservedBytes ||
			(r.PeakReservedBytes == rows[j].PeakReservedBytes && r.DeviceMallocs < rows[j].DeviceMallocs) {
			best[r.Trace] = i
		}
	}
	marked := map[int]bool{}
	for t, i := range best {
		if count[t] > 1 {
			marked[i] = true
		}
	}
	return marked
}

func printReplayTable(w io.Writer, rows []replayRow) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "trace\tconf\tops\tpeak allocated MiB\tpeak reserved MiB\treserved/allocated\tdevice mallocs\tretries\tOOMs\tns/op\tbest\t")
	best := bestRows(rows)
	for i, r := range rows {
		conf := confLabel(r.Conf)
		mark := ""
		if best[i] {
			mark = "*"
		}
		ratio := 0.0
		if r.PeakAllocatedBytes > 0 {
			ratio = float64(r.PeakReservedBytes) / float64(r.PeakAllocatedBytes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%.3f\t%d\t%d\t%d\t%.0f\t%s\t\n", r.Trace, conf, r.Ops,
			mib(r.PeakAllocatedBytes), mib(r.PeakReservedBytes), ratio, r.DeviceMallocs, r.AllocRetries, r.OOMs, r.NsPerOp, mark)
	}
	return tw.Flush()
}
