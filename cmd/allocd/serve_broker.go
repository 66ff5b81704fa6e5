package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/server"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/stats"
)

// brokerFlags are serve's flags for --broker.
type brokerFlags struct {
	on          bool          // --broker
	socket      string        // --broker-socket
	socketMode  string        // --broker-socket-mode
	socketGroup string        // --broker-socket-group
	tenants     string        // --broker-tenants
	tenantsPoll time.Duration // --broker-tenants-poll
	cacheIdle   time.Duration // --broker-cache-idle
	stopTimeout time.Duration // --broker-stop-timeout
}

const defaultBrokerSocket = "/run/allocd/allocd.sock"

// checkBrokerFlags checks the broker's flags against the rest.
func checkBrokerFlags(f serveFlags) (mode os.FileMode, gid int, err error) {
	b := f.broker
	switch {
	case f.replay != "" || f.synthetic:
		return 0, 0, errors.New("--broker serves other processes: it takes no --replay or --synthetic workload")
	case f.history > 0:
		return 0, 0, errors.New("--broker has no allocator of its own: --history does not apply")
	case !filepath.IsAbs(b.socket):
		return 0, 0, fmt.Errorf("--broker-socket %q: want an absolute path", b.socket)
	case b.stopTimeout < 0 || b.stopTimeout > maxServeWait:
		return 0, 0, fmt.Errorf("--broker-stop-timeout %v: expected a duration from 0 to %v", b.stopTimeout, maxServeWait)
	case b.cacheIdle != 0 && (b.cacheIdle < 100*time.Millisecond || b.cacheIdle > 24*time.Hour):
		return 0, 0, fmt.Errorf("--broker-cache-idle %v: expected 0 (keep the cache) or a duration from 100ms to 24h", b.cacheIdle)
	case b.tenantsPoll != 0 && (b.tenantsPoll < 100*time.Millisecond || b.tenantsPoll > maxServeWait):
		return 0, 0, fmt.Errorf("--broker-tenants-poll %v: expected 0 (reload on SIGHUP only) or a duration from 100ms to %v", b.tenantsPoll, maxServeWait)
	}
	m, err := strconv.ParseUint(b.socketMode, 8, 32)
	if err != nil || m > 0o777 {
		return 0, 0, fmt.Errorf("--broker-socket-mode %q: want octal permission bits such as 0660", b.socketMode)
	}
	gid = -1
	if b.socketGroup != "" {
		// A number is a gid as it is: container images often have no
		// /etc/group entry for the group a pod runs as.
		if n, err := strconv.ParseUint(b.socketGroup, 10, 31); err == nil {
			return os.FileMode(m), int(n), nil
		}
		g, err := user.LookupGroup(b.socketGroup)
		if err != nil {
			return 0, 0, fmt.Errorf("--broker-socket-group %q: no such group (give a name in /etc/group or a numeric gid)", b.socketGroup)
		}
		if gid, err = strconv.Atoi(g.Gid); err != nil {
			return 0, 0, fmt.Errorf("--broker-socket-group %q: gid %q: %w", b.socketGroup, g.Gid, err)
		}
	}
	return os.FileMode(m), gid, nil
}

// runBroker runs `allocd serve --broker` until a signal: the broker on
// its socket, and /metrics, /healthz and /readyz on --listen. A signal
// on hups (SIGHUP) reloads the tenants file, and so does a change of its
// content found every --broker-tenants-poll; cached chunks idle for
// --broker-cache-idle go back to the driver; the first SIGINT or SIGTERM
// on sigs stops granting and waits up to --broker-stop-timeout for the
// clients to go.
func runBroker(ctx context.Context, f serveFlags, stderr io.Writer, sigs, hups <-chan os.Signal) error {
	log, err := newLoggerTo(stderr, f.dev, f.logLevel)
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	sig := server.WatchSignals(ctx, log, sigs, serveExit)
	defer sig.Stop()
	if f.confSet {
		return errors.New("--broker has no allocator of its own: --conf does not apply (clients read ALLOCD_CONF)")
	}
	spec, capacity, err := checkServeFlags(f)
	if err != nil {
		return err
	}
	mode, gid, err := checkBrokerFlags(f)
	if err != nil {
		return err
	}
	tenants := broker.OpenTenants()
	var tf *broker.TenantsFile
	var poll <-chan time.Time
	if f.broker.tenants != "" {
		tf = broker.NewTenantsFile(f.broker.tenants)
		if tenants, _, err = tf.Load(); err != nil {
			return err
		}
		if f.broker.tenantsPoll > 0 {
			tick := time.NewTicker(f.broker.tenantsPoll)
			defer tick.Stop()
			poll = tick.C
		}
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	defer ln.Close()
	o := devspec.Opener{Sim: simdev.Config{Capacity: capacity, Shared: true}, DeviceCount: cudaDeviceCount, OpenCUDA: openCUDAIndex}
	devs, err := o.Open(spec)
	if errors.Is(err, cudart.ErrNoDriver) {
		return fmt.Errorf("%s: %w; for a simulated device use --device sim or ALLOCD_DEVICE=sim", deviceSetting(f.deviceFrom, f.device), cudart.ErrNoDriver)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", deviceSetting(f.deviceFrom, f.device), err)
	}
	defer devspec.CloseAll(devs)
	b, err := broker.New(broker.Config{Devices: devs, Tenants: tenants, Log: log.Named("broker")})
	if err != nil {
		return err
	}
	sock, err := broker.Listen(f.broker.socket, mode, gid)
	if err != nil {
		_ = b.Close()
		return err
	}
	reg := prometheus.NewRegistry()
	for _, c := range []prometheus.Collector{
		broker.NewCollector(b), stats.BuildInfo(buildVersion()),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		if err := reg.Register(c); err != nil {
			_ = sock.Close()
			_ = b.Close()
			return fmt.Errorf("registering metrics: %w", err)
		}
	}
	var ready atomic.Bool
	srv, err := server.NewHTTP(ln, brokerHandler(b, reg, log, ready.Load), server.HTTPOptions{MaxConns: f.maxConns, WriteTimeout: f.writeTimeout, IdleTimeout: f.idleTimeout, ErrorLog: zap.NewStdLog(log.Named("http"))})
	if err != nil {
		_ = sock.Close()
		_ = b.Close()
		return err
	}
	serveErr := make(chan error, 2)
	go func() { serveErr <- srv.Serve() }()
	go func() { serveErr <- b.Serve(sock) }()
	ready.Store(true)
	log.Info("allocd broker serving", zap.String("version", buildVersion()), zap.String("socket", f.broker.socket),
		zap.String("socket_mode", fmt.Sprintf("%#o", mode)), zap.Int("devices", len(devs)), zap.String("listen", ln.Addr().String()),
		zap.Bool("tenants_file", f.broker.tenants != ""), zap.Strings("tenants", tenants.Names()), zap.Int("pid", os.Getpid()))
	if f.readyFile != "" {
		if err := server.WriteFileAtomic(f.readyFile, ln.Addr().String()+"\n"); err != nil {
			log.Error("writing --ready-file", zap.Error(err))
		}
	}
	var trim <-chan time.Time
	if f.broker.cacheIdle > 0 {
		tick := time.NewTicker(min(max(f.broker.cacheIdle/2, 10*time.Millisecond), 30*time.Second))
		defer tick.Stop()
		trim = tick.C
	}
	var exitErr error
loop:
	for {
		select {
		case <-trim:
			if n := b.Trim(f.broker.cacheIdle); n > 0 {
				log.Info("released chunks idle in the cache", zap.Uint64("bytes", n), zap.Duration("idle_for", f.broker.cacheIdle))
			}
		case <-hups:
			if tf == nil {
				log.Info("SIGHUP: no tenants file to reload (every tenant is accepted)")
				continue
			}
			t, _, err := tf.Load()
			if err != nil {
				b.ReloadFailed()
				log.Error("SIGHUP: tenants file not reloaded; the previous policy stays", zap.Error(err))
				continue
			}
			b.SetTenants(t)
			log.Info("SIGHUP: tenants file reloaded", zap.Strings("tenants", t.Names()))
		case <-poll:
			t, changed, err := tf.Load()
			switch {
			case !changed:
			case err != nil:
				b.ReloadFailed()
				log.Error("the tenants file changed and is not valid; the previous policy stays", zap.Error(err))
			default:
				b.SetTenants(t)
				log.Info("the tenants file changed: reloaded", zap.Strings("tenants", t.Names()))
			}
		case <-sig.Context().Done():
			server.LogShutdown(sig.Context(), log, "")
			break loop
		case err := <-serveErr:
			log.Error("serving failed; shutting down", zap.Error(err))
			exitErr = err
			break loop
		}
	}
	ready.Store(false)
	log.Info("stopping: no new grants; waiting for clients to disconnect", zap.Duration("timeout", f.broker.stopTimeout))
	stopCtx, cancel := context.WithTimeout(context.Background(), f.broker.stopTimeout)
	defer cancel()
	go func() {
		select {
		case <-sig.Forced():
			cancel()
		case <-stopCtx.Done():
		}
	}()
	for _, h := range b.Stop(stopCtx) {
		log.Warn("still holding memory at exit", zap.Uint64("client", h.Client), zap.String("tenant", h.Tenant),
			zap.Int32("pid", h.PID), zap.Bool("connected", h.Connected), zap.Any("bytes_by_gpu", h.Bytes))
	}
	shutCtx, cancel2 := context.WithTimeout(context.Background(), f.shutdownTimeout)
	defer cancel2()
	if err := srv.Shutdown(shutCtx); err != nil {
		_ = srv.Close()
	}
	if err := b.Close(); err != nil && exitErr == nil {
		exitErr = err
	}
	log.Info("allocd broker stopped")
	return exitErr
}

// brokerHandler serves /metrics, /healthz, /readyz and /debug/broker
// (the broker's figures and every client with what it holds, as JSON).
func brokerHandler(b *broker.Broker, reg *prometheus.Registry, log *zap.Logger, ready func() bool) http.Handler {
	mux := http.NewServeMux()
	metrics := promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog: zap.NewStdLog(log.Named("metrics")), ErrorHandling: promhttp.ContinueOnError,
		Registry: reg, MaxRequestsInFlight: 8, Timeout: 10 * time.Second, EnableOpenMetrics: true,
	})
	mux.Handle("GET /metrics", promhttp.InstrumentMetricHandler(reg, metrics))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("GET /debug/broker", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(struct {
			Stats   broker.Stats    `json:"stats"`
			Holders []broker.Holder `json:"holders"`
		}{b.Stats(), b.Holders()})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !ready() {
			http.Error(w, "not ready: starting or stopping", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
	return mux
}
