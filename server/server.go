// Package server is allocd's daemon over a set of allocators, the one
// `allocd serve` runs: their Prometheus metrics (its own registry, with
// build info and the Go runtime and process collectors), health and
// readiness, debughttp's debug pages, a logged close that checks every
// segment went back to its device, and the signal handling of a graceful
// shutdown (Signals). A Go program that embeds allocators mounts
// promhttp and debughttp itself instead; this package is for a process
// whose only job is serving them.
//
// NewHTTP is the bounded HTTP server setup (timeouts, a connection limit)
// that `allocd serve` and liballocd's in-process metrics server share, and
// LimitInFlight and LimitBody bound their expensive pages.
package server

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/debughttp"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/stats"
)

// Daemon serves a Devices' allocators: one per device.
type Daemon struct {
	log     *zap.Logger
	devs    *allocator.Devices
	gpus    []gpu // ascending device index
	reg     *prometheus.Registry
	ready   atomic.Bool
	version string
}

// gpu is one device the daemon serves and its allocator.
type gpu struct {
	index int
	dev   cudart.Device
	a     *allocator.Allocator
}

// New returns a daemon over devs's allocators, not yet ready, its
// registry holding the allocators' collector (every device under its own
// gpu label), build info for version, and the Go runtime and process
// collectors. log receives the daemon's lines; the daemon does not own
// devs until Close.
func New(log *zap.Logger, devs *allocator.Devices, version string) (*Daemon, error) {
	d := &Daemon{log: log, devs: devs, reg: prometheus.NewRegistry(), version: version}
	for _, a := range devs.All() {
		d.gpus = append(d.gpus, gpu{index: a.Device().Info().Index, dev: a.Device(), a: a})
	}
	if err := d.register(); err != nil {
		return nil, err
	}
	return d, nil
}

// Registry is the daemon's registry, which /metrics serves.
func (d *Daemon) Registry() *prometheus.Registry { return d.reg }

// Allocators returns the served allocators in ascending device index.
func (d *Daemon) Allocators() []*allocator.Allocator { return d.devs.All() }

// SetReady sets what /readyz answers: 200 when ready, 503 otherwise.
func (d *Daemon) SetReady(ready bool) { d.ready.Store(ready) }

// register adds the daemon's collectors to its own registry: the
// allocators' metrics (one collector over them all, each device under its
// own gpu label), build info, and the Go runtime and process collectors
// (which a library user's registry need not carry).
func (d *Daemon) register() error {
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
		stats.BuildInfo(d.version),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		if err := d.reg.Register(col); err != nil {
			return fmt.Errorf("registering metrics: %w", err)
		}
	}
	return nil
}

// Close closes every device's allocator, returning each segment to its
// device, and logs per device what it released (segments, bytes, live
// blocks). Blocks still allocated are released with their segments and
// counted in the log; they are not an error. The error joins those of
// the allocators, each naming its gpu, and a count of segments that did
// not go back.
func (d *Daemon) Close() error {
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
func (d *Daemon) closeAllocator(g gpu) error {
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
	if sim, ok := g.dev.(*simdev.Sim); ok {
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

// WriteFileAtomic writes s to path through a temporary file in the same
// directory and a rename, so that a reader never sees it half written
// (a ready file that a supervisor polls).
func WriteFileAtomic(path, s string) error {
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

// Endpoint is one path the daemon serves, as its index page lists it.
type Endpoint = debughttp.Endpoint

// Endpoints lists the paths Handler serves besides the index: the
// daemon's own, then the debug pages of package debughttp. Each answers
// GET and HEAD, and 405 to other methods.
func Endpoints() []Endpoint {
	eps := []Endpoint{
		{Path: "/metrics", Doc: "Prometheus metrics (text format, or OpenMetrics when asked for)"},
		{Path: "/healthz", Doc: "200 while the process runs"},
		{Path: "/readyz", Doc: "200 once the allocators are ready, 503 while shutting down"},
	}
	return append(eps, debughttp.PageEndpoints()...)
}

// Handler returns the daemon's handler: /metrics (promhttp over
// Registry, text or OpenMetrics, at most 8 scrapes in flight), /healthz
// (200 while the process runs), /readyz (200 while SetReady(true), 503
// otherwise), debughttp's pages over the allocators, and an index (debughttp.Index)
// at /. Patterns carry their method, so a
// request with another method gets 405 and an Allow header, and an unknown
// path 404 (net/http.ServeMux, Go 1.22+). GET patterns also answer HEAD.
// The debug pages are debughttp's over the daemon's devices, with its
// default bounds (4 in flight, 100,000 history entries a device) and
// responses of at most DefaultMaxBodyBytes. Serve it with NewHTTP.
func (d *Daemon) Handler() http.Handler {
	mux := http.NewServeMux()
	metrics := promhttp.HandlerFor(d.reg, promhttp.HandlerOpts{
		ErrorLog:            zap.NewStdLog(d.log.Named("metrics")),
		ErrorHandling:       promhttp.ContinueOnError,
		Registry:            d.reg,
		MaxRequestsInFlight: 8,
		Timeout:             10 * time.Second,
		EnableOpenMetrics:   true,
	})
	mux.Handle("GET /metrics", promhttp.InstrumentMetricHandler(d.reg, metrics))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeText(w, http.StatusOK, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !d.ready.Load() {
			writeText(w, http.StatusServiceUnavailable, "not ready: starting or shutting down\n")
			return
		}
		writeText(w, http.StatusOK, "ready\n")
	})
	var debug http.Handler
	debug, err := debughttp.ForDevices(d.devs, debughttp.Options{MaxBodyBytes: DefaultMaxBodyBytes, ErrorLog: zap.NewStdLog(d.log.Named("debug"))})
	if err != nil {
		// Not expected: the daemon serves at least one device, with the
		// default options. Say so on the pages rather than crash.
		msg := "debug pages unavailable: " + err.Error()
		debug = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { http.Error(w, msg, http.StatusInternalServerError) })
	}
	for _, p := range debughttp.Pages() {
		mux.Handle("GET "+p.Path, debug)
	}
	index := debughttp.Index("allocd "+d.version, Endpoints())
	mux.Handle("GET /{$}", index)
	return mux
}

func writeText(w http.ResponseWriter, code int, s string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(s))
}
