package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/stats"
)

// defaultListen is serve's address: loopback only, so that nothing is
// exposed unless asked for. Port 9612 was marked free in the Prometheus
// wiki's default port allocations when chosen (docs/operations.md).
const defaultListen = "127.0.0.1:9612"

// serveExitCode is the exit status after a second SIGINT or SIGTERM, as a
// shell reports a process killed by SIGINT.
const serveExitCode = 130

// secondSignalGrace: a signal that follows the first by less than this
// counts as a second signal even if the shutdown has finished by then.
const secondSignalGrace = 100 * time.Millisecond

// serveExit ends the process on a second signal; tests replace it.
var serveExit = os.Exit

// serveFlags are the flags of `allocd serve`.
type serveFlags struct {
	device          string
	listen          string
	conf            string
	confSet         bool
	simCapacity     string
	replay          string
	synthetic       bool
	loop            bool
	rate            float64
	history         int
	dev             bool
	logLevel        string
	readyFile       string
	shutdownTimeout time.Duration
	drainDelay      time.Duration
}

func newServeCmd() *cobra.Command {
	var f serveFlags
	cmd := &cobra.Command{
		Use:   "serve [flags]",
		Short: "Serve allocators' Prometheus metrics and debug views over HTTP",
		Long: `Serve opens one or several devices, creates an allocator on each and serves,
on --listen:

  /metrics         Prometheus metrics (text or OpenMetrics), one gpu label per device
  /healthz         200 while the process runs
  /readyz          200 once the allocators are ready, 503 while shutting down
  /debug/summary   the torch.cuda.memory_summary() table of each device (?gpu=N: one)
  /debug/stats     torch.cuda.memory_stats() keys as JSON (?gpu=N: one device's)
  /debug/snapshot  segments and blocks as JSON (?gpu=N: one device's;
                   ?format=pickle for memory_viz)

--device picks the devices: sim (one simulated device), sim:N (N of them,
indexes 0..N-1, each of --sim-capacity), cuda (CUDA device 0), cuda:N, or
cuda:all (every CUDA device this process can see).

On simulated devices, --replay TRACE drives each allocator with a PyTorch
memory snapshot (torch.cuda.memory._dump_snapshot()), once or, with --loop,
over and over; --synthetic drives each with the mixed benchmark's random
workload instead. Each device gets its own goroutine. --replay-rate paces either
(operations per second on each device, 0: as fast as possible).

SIGINT or SIGTERM shuts down gracefully: /readyz turns 503, in-flight requests
finish, the workload stops and every segment goes back to the device. A signal
while the --replay trace is still loading stops at once (status 0), as nothing
has started yet. A second signal, at any time, exits at once with status 130. Logs are JSON lines on stderr (--dev:
console lines). The configuration comes from --conf or else ALLOCD_CONF.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.confSet = cmd.Flags().Changed("conf")
			sigs := make(chan os.Signal, 2)
			signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
			defer signal.Stop(sigs)
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			return runServe(ctx, f, cmd.ErrOrStderr(), sigs)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.device, "device", "cuda", "sim, sim:N (N simulated devices), cuda, cuda:N or cuda:all (every CUDA device)")
	fl.StringVar(&f.listen, "listen", defaultListen, "address to serve HTTP on (host:port; port 0 picks a free one)")
	fl.StringVar(&f.conf, "conf", "", "allocator configuration in ALLOCD_CONF grammar (default: $ALLOCD_CONF)")
	fl.StringVar(&f.simCapacity, "sim-capacity", "141GiB", "memory of each simulated device (bytes, or with KiB/MiB/GiB/TiB)")
	fl.StringVar(&f.replay, "replay", "", "replay this PyTorch memory snapshot through each allocator (--device sim or sim:N only)")
	fl.BoolVar(&f.synthetic, "synthetic", false, "drive each allocator with the mixed benchmark workload (--device sim or sim:N only)")
	fl.BoolVar(&f.loop, "loop", false, "with --replay: start the trace over when it ends, until shutdown")
	fl.Float64Var(&f.rate, "replay-rate", 10000, fmt.Sprintf("operations per second on each device for --replay and --synthetic, from %g to %g (0: as fast as possible)", minReplayRate, maxReplayRate))
	fl.IntVar(&f.history, "history", 0, fmt.Sprintf("record the last N allocator events for /debug/snapshot (0: off; at most %d)", maxServeHistory))
	fl.BoolVar(&f.dev, "dev", false, "log human-readable console lines instead of JSON")
	fl.StringVar(&f.logLevel, "log-level", "info", "log level: "+logLevels)
	fl.StringVar(&f.readyFile, "ready-file", "", "once serving, write the listening address to this file")
	fl.DurationVar(&f.shutdownTimeout, "shutdown-timeout", 10*time.Second, "how long shutdown waits for in-flight requests and the workload")
	fl.DurationVar(&f.drainDelay, "drain-delay", 0, "on shutdown, keep serving with /readyz at 503 for this long first")
	return cmd
}

// serveDaemon is a running `allocd serve`: one allocator per device.
type serveDaemon struct {
	log   *zap.Logger
	devs  *allocator.Devices
	gpus  []serveGPU // ascending device index
	reg   *prometheus.Registry
	ready atomic.Bool
}

// serveGPU is one device the daemon serves and its allocator.
type serveGPU struct {
	index int
	dev   cudart.Device
	a     *allocator.Allocator
}

// newServeDaemon returns a daemon over devs's allocators, not yet ready,
// with an empty registry.
func newServeDaemon(log *zap.Logger, devs *allocator.Devices) *serveDaemon {
	d := &serveDaemon{log: log, devs: devs, reg: prometheus.NewRegistry()}
	for _, a := range devs.All() {
		d.gpus = append(d.gpus, serveGPU{index: a.Device().Info().Index, dev: a.Device(), a: a})
	}
	return d
}

// gpu returns the daemon's device with index i.
func (d *serveDaemon) gpu(i int) (serveGPU, bool) {
	for _, g := range d.gpus {
		if g.index == i {
			return g, true
		}
	}
	return serveGPU{}, false
}

// checkServeFlags parses the device flags and checks them against the
// workload flags: replay and the synthetic workload need simulated
// devices.
func checkServeFlags(f serveFlags) (deviceSpec, uint64, error) {
	spec, err := parseDevicesSpec(f.device)
	if err != nil {
		return spec, 0, err
	}
	capacity, err := parseBytes(f.simCapacity)
	if err != nil {
		return spec, 0, fmt.Errorf("--sim-capacity: %w", err)
	}
	switch {
	case f.replay != "" && f.synthetic:
		return spec, 0, errors.New("--replay and --synthetic are exclusive: pick one workload")
	case (f.replay != "" || f.synthetic) && !spec.sim:
		return spec, 0, errors.New("--replay and --synthetic drive simulated devices only (--device sim or sim:N)")
	case f.loop && f.replay == "":
		return spec, 0, errors.New("--loop repeats a --replay trace; it needs --replay")
	}
	if f.rate != 0 {
		if err := checkFloatFlag("--replay-rate", f.rate, minReplayRate, maxReplayRate,
			"0 (as fast as possible) or operations per second"); err != nil {
			return spec, 0, err
		}
	}
	if f.history < 0 || f.history > maxServeHistory {
		return spec, 0, fmt.Errorf("--history %d: expected a number of events from 0 (off) to %d", f.history, maxServeHistory)
	}
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"--shutdown-timeout", f.shutdownTimeout}, {"--drain-delay", f.drainDelay}} {
		if d.v < 0 || d.v > maxServeWait {
			return spec, 0, fmt.Errorf("%s %v: expected a duration from 0 to %v", d.flag, d.v, maxServeWait)
		}
	}
	return spec, capacity, nil
}

// Limits of serve's numeric flags (docs/operations.md lists them).
const (
	// minReplayRate and maxReplayRate bound --replay-rate (besides 0):
	// one operation every 100 s, and a billion a second, more than a
	// device's goroutine can do.
	minReplayRate = 0.01
	maxReplayRate = 1e9
	// maxServeHistory bounds --history: the allocator's own bound on the
	// events it keeps (tens of bytes each) for /debug/snapshot.
	maxServeHistory = allocator.MaxHistoryEntries
	// maxServeWait bounds --shutdown-timeout and --drain-delay.
	maxServeWait = time.Hour
)

// checkFloatFlag checks the value v of a float flag: a finite, normal
// float64 from lo to hi. The error names the flag, the value and the
// range, prefixed by what, the flag's meaning.
func checkFloatFlag(flag string, v, lo, hi float64, what string) error {
	if math.IsNaN(v) || math.IsInf(v, 0) || (v != 0 && math.Abs(v) < 0x1p-1022) || v < lo || v > hi {
		return fmt.Errorf("%s %g: expected %s from %g to %g (not NaN, Inf or subnormal)", flag, v, what, lo, hi)
	}
	return nil
}

// openServeDevices opens the devices. For a replay, each simulated device
// gets manual events, so that frees deferred by other streams happen at
// the trace's positions, and the trace's segment addresses (moved per
// device so that no two devices share an address), so that the first pass
// places blocks exactly as the recorded program's allocator did (as
// `allocd replay` does).
func openServeDevices(spec deviceSpec, capacity uint64, load *serveWorkload) ([]cudart.Device, error) {
	cfg := cudart.SimConfig{Capacity: capacity}
	if load != nil && load.ops != nil {
		cfg.ManualEvents, cfg.Addresses = true, load.addresses
	}
	return openDevices(spec, cfg)
}

// runServe runs the daemon until ctx ends or a signal arrives on sigs, then
// shuts down. A second signal calls serveExit.
func runServe(ctx context.Context, f serveFlags, stderr io.Writer, sigs <-chan os.Signal) error {
	log, err := newLoggerTo(stderr, f.dev, f.logLevel)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	// Signals are watched from here to the end: the first one stops
	// whatever start-up step is waiting, the second exits at once.
	sig := watchServeSignals(ctx, log, sigs)
	defer sig.stop()
	cfg, err := parseConf(resolveConf(f.conf, f.confSet))
	if err != nil {
		return err
	}
	spec, capacity, err := checkServeFlags(f)
	if err != nil {
		return err
	}
	var load *serveWorkload
	if f.replay != "" || f.synthetic {
		// Read the trace before anything starts, so that a bad file fails
		// the command rather than a background goroutine. Reading a big
		// trace takes seconds, so it runs in its own goroutine and a
		// shutdown stops waiting for it: nothing else exists yet (no
		// device is open, no allocator made), so there is nothing to undo.
		// The abandoned read ends with the process; in a test that cancels
		// ctx it runs on to the end of the file and its result is dropped.
		if load, err = loadServeWorkload(sig.ctx, f, log); err != nil || load == nil {
			return err
		}
	}
	devs, err := openServeDevices(spec, capacity, load)
	if err != nil {
		return err
	}
	defer closeDevices(devs)
	log.Info("allocd serve starting",
		zap.String("version", buildVersion()), zap.String("device_spec", spec.String()), zap.Int("devices", len(devs)),
		zap.String("conf", cfg.String()), zap.String("listen", f.listen), zap.Int("pid", os.Getpid()))
	for _, dev := range devs {
		info := dev.Info()
		log.Info("device opened", zap.Int("gpu", info.Index), zap.String("device_name", info.Name),
			zap.String("uuid", info.UUID), zap.Uint64("device_total_bytes", info.TotalMemory))
	}

	opts := []allocator.Option{allocator.WithLogger(log.Named("allocator"))}
	if f.history > 0 {
		opts = append(opts, allocator.WithHistory(f.history))
	}
	allocs, err := allocator.NewDevices(devs, cfg, opts...)
	if err != nil {
		return err
	}
	d := newServeDaemon(log, allocs)
	if err := d.register(); err != nil {
		_ = allocs.Close()
		return err
	}

	if sig.ctx.Err() != nil {
		// A signal came while the devices opened: stop before serving.
		logShutdown(log, sig.ctx, "before serving")
		return d.closeAllocators()
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		_ = allocs.Close()
		return fmt.Errorf("--listen: %w", err)
	}
	srv := &http.Server{
		Handler:           d.routes(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      time.Minute,
		IdleTimeout:       time.Minute,
		ErrorLog:          zap.NewStdLog(log.Named("http")),
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	addr := ln.Addr().String()
	d.ready.Store(true)
	log.Info("listening", zap.String("addr", addr), zap.String("metrics", "http://"+addr+"/metrics"))
	if f.readyFile != "" {
		if err := writeReadyFile(f.readyFile, addr+"\n"); err != nil {
			log.Error("writing --ready-file", zap.Error(err))
		}
	}

	loadCtx, stopLoad := context.WithCancel(context.Background())
	defer stopLoad()
	loadDone := make(chan struct{})
	var loads sync.WaitGroup
	for _, g := range d.gpus {
		if load == nil {
			break
		}
		loads.Go(func() {
			wlog := log.Named("workload").With(zap.Int("gpu", g.index))
			if err := load.run(loadCtx, g.a, g.index, wlog); err != nil {
				wlog.Error("workload stopped", zap.Error(err))
			}
		})
	}
	go func() {
		loads.Wait()
		close(loadDone)
	}()

	var exitErr error
	select {
	case <-sig.ctx.Done():
		logShutdown(log, sig.ctx, "")
	case err := <-serveErr:
		log.Error("HTTP server failed; shutting down", zap.Error(err))
		exitErr = fmt.Errorf("serving %s: %w", addr, err)
	}
	d.ready.Store(false)

	if f.drainDelay > 0 {
		log.Info("draining: /readyz answers 503", zap.Duration("for", f.drainDelay))
		select {
		case <-time.After(f.drainDelay):
		case <-sig.forced: // a second signal, in a test where serveExit returns
		}
	}
	shutCtx, cancel := context.WithTimeout(context.Background(), f.shutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(shutCtx); err != nil {
		log.Warn("in-flight requests did not finish in time; closing their connections",
			zap.Duration("shutdown_timeout", f.shutdownTimeout), zap.Error(err))
		_ = srv.Close()
	}
	log.Info("HTTP server stopped")

	stopLoad()
	select {
	case <-loadDone:
	case <-shutCtx.Done():
		log.Warn("the workload did not stop in time; closing the allocators under it")
	}
	if err := d.closeAllocators(); err != nil && exitErr == nil {
		exitErr = err
	}
	log.Info("shutdown complete")
	return exitErr
}

// shutdownSignal is the cause of serveSignals' context once a signal has
// cancelled it.
type shutdownSignal struct{ sig os.Signal }

func (s shutdownSignal) Error() string { return "signal " + s.sig.String() }

// serveSignals watches a channel of SIGINT and SIGTERM for the whole of
// runServe. The first signal cancels ctx, with a shutdownSignal as its
// cause; a second one logs, calls serveExit(130) at once, whatever
// runServe is doing, and then (serveExit returns only in tests) closes
// forced.
type serveSignals struct {
	ctx    context.Context
	forced chan struct{}
	done   chan struct{}
	exited chan struct{}
}

// watchServeSignals starts watching sigs. ctx is also cancelled when
// parent is.
func watchServeSignals(parent context.Context, log *zap.Logger, sigs <-chan os.Signal) *serveSignals {
	ctx, cancel := context.WithCancelCause(parent)
	s := &serveSignals{ctx: ctx, forced: make(chan struct{}), done: make(chan struct{}), exited: make(chan struct{})}
	second := func(sig os.Signal) {
		log.Warn("second signal: exiting without cleanup", zap.String("signal", sig.String()), zap.Int("exit_code", serveExitCode))
		_ = log.Sync()
		serveExit(serveExitCode)
		close(s.forced)
	}
	go func() {
		defer close(s.exited)
		defer cancel(nil)
		var first os.Signal
		var firstAt time.Time
		for {
			select {
			case sig := <-sigs:
				if first != nil {
					second(sig)
					return
				}
				first, firstAt = sig, time.Now()
				cancel(shutdownSignal{sig})
			case <-s.done:
				// Two signals sent together (a double Ctrl-C, a
				// supervisor that signals twice) exit 130 even when the
				// shutdown is quicker than the second one's delivery,
				// as during trace loading: the exit waits until
				// secondSignalGrace after the first signal.
				if first == nil {
					return
				}
				wait := time.NewTimer(secondSignalGrace - time.Since(firstAt))
				defer wait.Stop()
				select {
				case sig := <-sigs:
					second(sig)
				case <-wait.C:
				}
				return
			}
		}
	}()
	return s
}

// stop ends the watch; once it returns no signal calls serveExit. It
// returns at once unless a signal came less than secondSignalGrace ago.
func (s *serveSignals) stop() {
	close(s.done)
	<-s.exited
}

// logShutdown logs why ctx, serveSignals' context, ended: the signal, or
// the reason its parent was cancelled; during says which start-up step it
// interrupted, when one did.
func logShutdown(log *zap.Logger, ctx context.Context, during string) {
	fields := []zap.Field{}
	var ss shutdownSignal
	if cause := context.Cause(ctx); errors.As(cause, &ss) {
		fields = append(fields, zap.String("signal", ss.sig.String()))
	} else {
		fields = append(fields, zap.String("reason", cause.Error()))
	}
	if during != "" {
		fields = append(fields, zap.String("during", during))
	}
	log.Info("shutting down", fields...)
}

// loadServeWorkload runs newServeWorkload in a goroutine and waits for it
// or for ctx. It returns nil, nil when ctx ended first (logged as a
// shutdown during loading).
func loadServeWorkload(ctx context.Context, f serveFlags, log *zap.Logger) (*serveWorkload, error) {
	type result struct {
		w   *serveWorkload
		err error
	}
	if f.replay != "" {
		log.Info("loading trace", zap.String("trace", f.replay))
	}
	t0 := time.Now()
	done := make(chan result, 1) // never blocks the loader
	go func() {
		w, err := newServeWorkload(f)
		done <- result{w, err}
	}()
	select {
	case r := <-done:
		if r.err == nil && r.w.ops != nil {
			log.Info("trace loaded", zap.String("trace", f.replay), zap.Int("ops", len(r.w.ops.Ops)),
				zap.Duration("took", time.Since(t0)))
		}
		return r.w, r.err
	case <-ctx.Done():
		logShutdown(log, ctx, "trace loading")
		log.Info("shutdown complete: nothing was started")
		return nil, nil
	}
}

// register adds the daemon's collectors to its own registry: the
// allocators' metrics (one collector over them all, each device under its
// own gpu label), build info, and the Go runtime and process collectors
// (which a library user's registry need not carry).
func (d *serveDaemon) register() error {
	sources := make([]stats.Source, len(d.gpus))
	for i, g := range d.gpus {
		sources[i] = g.a
	}
	c, err := stats.NewCollector(sources...)
	if err != nil {
		return err
	}
	for _, col := range []prometheus.Collector{
		c,
		stats.BuildInfo(buildVersion()),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		if err := d.reg.Register(col); err != nil {
			return fmt.Errorf("registering metrics: %w", err)
		}
	}
	return nil
}

// closeAllocators closes every device's allocator (closeAllocator) and
// returns their errors joined.
func (d *serveDaemon) closeAllocators() error {
	var errs []error
	for _, g := range d.gpus {
		if err := d.closeAllocator(g); err != nil {
			errs = append(errs, fmt.Errorf("gpu %d: %w", g.index, err))
		}
	}
	return errors.Join(errs...)
}

// closeAllocator returns every segment of g's allocator to its device and
// logs what it released. Blocks still allocated are released with their
// segments and counted; they are not an error for the daemon.
func (d *serveDaemon) closeAllocator(g serveGPU) error {
	before := g.a.Stats()
	err := g.a.Close()
	after := g.a.Stats()
	held := before.Segment[allocator.PoolAll].Current
	released := after.NumDeviceFree - before.NumDeviceFree
	fields := []zap.Field{
		zap.Int("gpu", g.index),
		zap.Int64("segments_held", held), zap.Int64("segments_released", released),
		zap.Int64("bytes_released", before.ReservedBytes[allocator.PoolAll].Current),
		zap.Int64("live_blocks", before.Allocation[allocator.PoolAll].Current),
	}
	if sim, ok := g.dev.(*cudart.Sim); ok {
		fields = append(fields, zap.Uint64("device_used_bytes", sim.Used()))
	}
	if errors.Is(err, allocator.ErrLiveBlocks) {
		err = nil // reported in live_blocks; the memory went back all the same
	}
	if err != nil || released != held {
		d.log.Error("allocator closed, but not every segment went back to the device", append(fields, zap.Error(err))...)
		if err == nil {
			err = fmt.Errorf("closing the allocator: %d of %d segments released", released, held)
		}
		return err
	}
	d.log.Info("allocator closed: every segment returned to the device", fields...)
	return nil
}

// writeReadyFile writes s to path through a temporary file and a rename,
// so that a reader never sees it half written.
func writeReadyFile(path, s string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".allocd-ready-*")
	if err != nil {
		return err
	}
	if _, err := tmp.WriteString(s); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}
