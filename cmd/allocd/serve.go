package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/server"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/workload"
)

// defaultListen is serve's address: loopback only, so that nothing is
// exposed unless asked for. Port 9612 was marked free in the Prometheus
// wiki's default port allocations when chosen (docs/operations.md).
const defaultListen = "127.0.0.1:9612"

// serveExitCode is the exit status after a second SIGINT or SIGTERM.
const serveExitCode = server.ExitCode

// serveExit ends the process on a second signal; tests replace it.
var serveExit = os.Exit

// serveFlags are the flags of `allocd serve`.
type serveFlags struct {
	device  string
	listen  string
	conf    string
	confSet bool
	// deviceFrom says where device came from: "--device",
	// "ALLOCD_DEVICE" or "" (the default).
	deviceFrom      string
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
	maxConns        int           // --max-conns
	writeTimeout    time.Duration // --write-timeout
	idleTimeout     time.Duration // --idle-timeout
	broker          brokerFlags
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
cuda:all (every CUDA device this process can see). Without --device,
ALLOCD_DEVICE (cuda, sim or sim:N) chooses, as it does for the library; and
without --sim-capacity, ALLOCD_SIM_CAPACITY. serve never falls back to a
simulated device: without a CUDA driver it says so and exits 1 (use --device
sim, or ALLOCD_DEVICE=sim).

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
		Args: withUsage(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			f.confSet = cmd.Flags().Changed("conf")
			from, err := applyDeviceEnv(cmd, &f.device, &f.simCapacity, false)
			if err != nil {
				return err
			}
			f.deviceFrom = from
			sigs := make(chan os.Signal, 2)
			signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
			defer signal.Stop(sigs)
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			if f.broker.on {
				hups := make(chan os.Signal, 1)
				signal.Notify(hups, syscall.SIGHUP)
				defer signal.Stop(hups)
				return runBroker(ctx, f, cmd.ErrOrStderr(), sigs, hups)
			}
			return runServe(ctx, f, cmd.ErrOrStderr(), sigs)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.device, "device", "cuda", "sim, sim:N (N simulated devices), cuda, cuda:N or cuda:all (every CUDA device); without it, $ALLOCD_DEVICE")
	fl.StringVar(&f.listen, "listen", defaultListen, "address to serve HTTP on (host:port; port 0 picks a free one)")
	fl.StringVar(&f.conf, "conf", "", "allocator configuration in ALLOCD_CONF grammar (default: $ALLOCD_CONF)")
	fl.StringVar(&f.simCapacity, "sim-capacity", defaultSimCapacityFlag, "memory of each simulated device (bytes, or with KiB/MiB/GiB/TiB); without it, $ALLOCD_SIM_CAPACITY")
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
	fl.IntVar(&f.maxConns, "max-conns", server.DefaultMaxConns, fmt.Sprintf("HTTP connections open at once, from 1 to %d; more wait in the listen backlog", maxServeConns))
	fl.DurationVar(&f.writeTimeout, "write-timeout", server.DefaultWriteTimeout, "how long an HTTP response may take to write before its connection is cut (1s to 1h)")
	fl.DurationVar(&f.idleTimeout, "idle-timeout", server.DefaultIdleTimeout, "how long an idle keep-alive HTTP connection stays open (1s to 1h)")
	fl.BoolVar(&f.broker.on, "broker", false, "run the node broker: lend the devices' memory to client processes (ALLOCD_BROKER) within their tenants' quotas")
	fl.StringVar(&f.broker.socket, "broker-socket", defaultBrokerSocket, "with --broker: the Unix socket clients connect to")
	fl.StringVar(&f.broker.socketMode, "broker-socket-mode", "0660", "with --broker: the socket's permission bits (octal)")
	fl.StringVar(&f.broker.socketGroup, "broker-socket-group", "", "with --broker: the socket's group (name or gid; default: the process's)")
	fl.StringVar(&f.broker.tenants, "broker-tenants", "", "with --broker: the tenants file (YAML: names, quotas, uids), reloaded on SIGHUP; without it every tenant is accepted without a quota")
	fl.DurationVar(&f.broker.tenantsPoll, "broker-tenants-poll", 10*time.Second, "with --broker-tenants: how often to look for a change of the file's content and reload it (0: on SIGHUP only)")
	fl.DurationVar(&f.broker.cacheIdle, "broker-cache-idle", 5*time.Minute, "with --broker: release cached chunks no client has taken for this long, so processes that do not use the broker can have the memory (0: keep them)")
	fl.DurationVar(&f.broker.stopTimeout, "broker-stop-timeout", 30*time.Second, "with --broker: on SIGTERM, how long to wait for clients to disconnect")
	return cmd
}

// checkServeFlags parses the device flags and checks them against the
// workload flags: replay and the synthetic workload need simulated
// devices.
func checkServeFlags(f serveFlags) (devspec.Spec, uint64, error) {
	spec, err := devspec.Parse(f.device)
	if err != nil {
		return spec, 0, fmt.Errorf("%s: %w", deviceFlagName(f.deviceFrom), err)
	}
	capacity, err := parseSize("--sim-capacity", f.simCapacity)
	if err != nil {
		return spec, 0, err
	}
	switch {
	case f.replay != "" && f.synthetic:
		return spec, 0, errors.New("--replay and --synthetic are exclusive: pick one workload")
	case (f.replay != "" || f.synthetic) && !spec.Sim:
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
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"--write-timeout", f.writeTimeout}, {"--idle-timeout", f.idleTimeout}} {
		if d.v < time.Second || d.v > maxServeWait {
			return spec, 0, fmt.Errorf("%s %v: expected a duration from 1s to %v", d.flag, d.v, maxServeWait)
		}
	}
	if f.maxConns < 1 || f.maxConns > maxServeConns {
		return spec, 0, fmt.Errorf("--max-conns %d: expected a number of connections from 1 to %d", f.maxConns, maxServeConns)
	}
	if err := checkOutPath("--ready-file", f.readyFile); err != nil {
		return spec, 0, err
	}
	return spec, capacity, nil
}

// deviceFlagName names where the device spec came from in errors.
func deviceFlagName(from string) string {
	if from == devspec.EnvDevice {
		return from
	}
	return "--device"
}

// deviceSetting names the device setting in errors, with its value as the
// user gave it: --device cuda:1, ALLOCD_DEVICE=cuda, or --device cuda (the
// default).
func deviceSetting(from, value string) string {
	switch from {
	case devspec.EnvDevice:
		return from + "=" + value
	case "":
		return "--device " + value + " (the default)"
	}
	return "--device " + value
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
	// maxServeWait bounds --shutdown-timeout, --drain-delay,
	// --write-timeout and --idle-timeout.
	maxServeWait = time.Hour
	// maxServeConns bounds --max-conns: each connection is a file
	// descriptor and a goroutine.
	maxServeConns = 65536
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
//
// setting names the device setting in errors (deviceSetting). Without a
// CUDA driver the error is one line with the way to a simulated device;
// the driver's full story (every library tried) is logged at debug level.
func openServeDevices(spec devspec.Spec, setting string, capacity uint64, load *workload.Load, log *zap.Logger) ([]cudart.Device, error) {
	o := devspec.Opener{Sim: simdev.Config{Capacity: capacity}, DeviceCount: cudaDeviceCount, OpenCUDA: openCUDAIndex}
	if load != nil && load.Trace != nil {
		if err := load.Trace.CheckPlan(); spec.Sim && err != nil {
			return nil, fmt.Errorf("--replay: %w", err)
		}
		o.Sim.ManualEvents, o.Sim.Addresses = true, load.Trace.Addresses
	}
	devs, err := o.Open(spec)
	if errors.Is(err, cudart.ErrNoDriver) {
		log.Debug("no CUDA driver", zap.String("device_spec", spec.String()), zap.Error(err))
		return nil, fmt.Errorf("%s: %w (`allocd devices` lists the libraries tried; --log-level debug logs them); "+
			"for a simulated device use --device sim or ALLOCD_DEVICE=sim", setting, cudart.ErrNoDriver)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", setting, err)
	}
	return devs, nil
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
	sig := server.WatchSignals(ctx, log, sigs, serveExit)
	defer sig.Stop()
	conf, confFrom := resolveConf(f.conf, f.confSet)
	cfg, err := parseConf(conf, confFrom)
	if err != nil {
		return err
	}
	spec, capacity, err := checkServeFlags(f)
	if err != nil {
		return err
	}
	// The listening address is taken before any work (reading a trace,
	// opening devices), so that a bad or busy address fails at once.
	// Connections wait in the backlog until serving starts.
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	defer ln.Close()
	var load *workload.Load
	if f.replay != "" || f.synthetic {
		// Read the trace before anything starts, so that a bad file fails
		// the command rather than a background goroutine. Reading a big
		// trace takes seconds, so it runs in its own goroutine and a
		// shutdown stops waiting for it: nothing else exists yet (no
		// device is open, no allocator made), so there is nothing to undo.
		// The abandoned read ends with the process; in a test that cancels
		// ctx it runs on to the end of the file and its result is dropped.
		if load, err = loadServeWorkload(sig.Context(), f, log); err != nil || load == nil {
			return err
		}
	}
	devs, err := openServeDevices(spec, deviceSetting(f.deviceFrom, f.device), capacity, load, log)
	if err != nil {
		return err
	}
	defer devspec.CloseAll(devs)
	log.Info("allocd serve starting",
		zap.String("version", buildVersion()), zap.String("device_spec", spec.String()), zap.Int("devices", len(devs)),
		zap.String("conf", effectiveConf(cfg)), zap.String("conf_from", confSource(conf, confFrom)),
		zap.String("listen", f.listen), zap.Int("pid", os.Getpid()))
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
	d, err := server.New(log, allocs, buildVersion())
	if err != nil {
		_ = allocs.Close()
		return err
	}

	if sig.Context().Err() != nil {
		// A signal came while the devices opened: stop before serving.
		server.LogShutdown(sig.Context(), log, "before serving")
		return d.Close()
	}
	srv, err := server.NewHTTP(ln, d.Handler(), server.HTTPOptions{
		MaxConns:     f.maxConns,
		WriteTimeout: f.writeTimeout,
		IdleTimeout:  f.idleTimeout,
		ErrorLog:     zap.NewStdLog(log.Named("http")),
	})
	if err != nil {
		_ = d.Close()
		return err
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve() }()
	addr := ln.Addr().String()
	d.SetReady(true)
	log.Info("listening", zap.String("addr", addr), zap.String("metrics", "http://"+addr+"/metrics"))
	if f.readyFile != "" {
		if err := server.WriteFileAtomic(f.readyFile, addr+"\n"); err != nil {
			log.Error("writing --ready-file", zap.Error(err))
		}
	}

	loadCtx, stopLoad := context.WithCancel(context.Background())
	defer stopLoad()
	loadDone := make(chan struct{})
	var loads sync.WaitGroup
	for _, a := range d.Allocators() {
		if load == nil {
			break
		}
		loads.Go(func() {
			gpu := a.Device().Info().Index
			wlog := log.Named("workload").With(zap.Int("gpu", gpu))
			if err := load.Run(loadCtx, a, gpu, wlog); err != nil {
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
	case <-sig.Context().Done():
		server.LogShutdown(sig.Context(), log, "")
	case err := <-serveErr:
		log.Error("HTTP server failed; shutting down", zap.Error(err))
		exitErr = fmt.Errorf("serving %s: %w", addr, err)
	}
	d.SetReady(false)

	if f.drainDelay > 0 {
		log.Info("draining: /readyz answers 503", zap.Duration("for", f.drainDelay))
		select {
		case <-time.After(f.drainDelay):
		case <-sig.Forced(): // a second signal, in a test where serveExit returns
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
	if err := d.Close(); err != nil && exitErr == nil {
		exitErr = err
	}
	log.Info("shutdown complete")
	return exitErr
}

// effectiveConf is the configuration in force, as ALLOCD_CONF would say
// it: the keys that differ from PyTorch's defaults, or "defaults".
func effectiveConf(cfg allocator.Config) string {
	if c := cfg.String(); c != "" {
		return c
	}
	return "defaults"
}

// confSource says where the configuration came from: --conf, ALLOCD_CONF,
// or nowhere (an empty ALLOCD_CONF, or none).
func confSource(conf, from string) string {
	if from == allocator.EnvConf && conf == "" {
		return "defaults (ALLOCD_CONF unset or empty)"
	}
	return from
}
