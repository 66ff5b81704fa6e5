package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/debughttp"
	"github.com/allocd/allocd/server"
	"github.com/allocd/allocd/stats"
)

// This file is the in-process HTTP surface: /metrics, /healthz and
// debughttp's debug pages over the library's devices, on server.NewHTTP's
// bounded server, and the snapshot file of allocd_dump_snapshot.

// metricsServer serves the library's registry on one listener.
type metricsServer struct {
	addr string // the address actually bound
	srv  *server.HTTP
}

// The metrics server's bounds. It runs inside the user's program, so it
// holds few connections (file descriptors are the program's), builds and
// sends one snapshot at a time (a snapshot copies the whole history), and
// cuts off a client that does not read within the write timeout; the
// timeouts are server's defaults (those of `allocd serve`).
const (
	metricsMaxConns     = 16
	metricsMaxDebug     = 4 // debug pages in flight; a snapshot is one of them
	metricsMaxSnapshots = 1
	metricsMaxScrapes   = 4
)

// metricsHTTP are the bounds startMetrics gets from newLib.
var metricsHTTP = server.HTTPOptions{MaxConns: metricsMaxConns}

// startMetrics listens on exactly addr and serves in the background with
// the bounds of o: its timeouts and connection limit; at most
// metricsMaxScrapes scrapes and metricsMaxDebug debug pages at once, of
// which at most metricsMaxSnapshots snapshots, each of at most
// server.DefaultMaxBodyBytes (more get 503 with Retry-After, or 413).
//
// The debug pages are debughttp's over l.devs, as allocd serve serves
// them, with liballocd's formats: /debug/stats is always an object from
// device index to its memory_stats() map, num_bad_frees included, and
// /debug/snapshot is the pickle of the whole recorded history unless
// ?format=json or ?entries=N ask otherwise.
func startMetrics(l *lib, addr string, o server.HTTPOptions) (*metricsServer, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(&devicesCollector{l: l}); err != nil {
		return nil, fmt.Errorf("allocd: metrics: %w", err)
	}
	debug, err := debughttp.ForDevices(l.devs, debughttp.Options{
		MaxInFlight:    metricsMaxDebug,
		DefaultEntries: allocator.MaxHistoryEntries,
		MaxEntries:     allocator.MaxHistoryEntries,
		MaxBodyBytes:   server.DefaultMaxBodyBytes,
		ErrorLog:       zap.NewStdLog(l.log.Named("debug")),
		SnapshotFormat: "pickle",
		StatsByDevice:  true,
		StatsExtra: func(device int) map[string]int64 {
			return map[string]int64{"num_bad_frees": l.badFrees(device)}
		},
	})
	if err != nil {
		return nil, fmt.Errorf("allocd: metrics: %w", err)
	}
	// The frees queued so far count on every page.
	drained := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l.drain(false)
		debug.ServeHTTP(w, r)
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("allocd: metrics_listen %q: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:            zap.NewStdLog(l.log.Named("metrics")),
		ErrorHandling:       promhttp.ContinueOnError,
		Timeout:             10 * time.Second,
		MaxRequestsInFlight: metricsMaxScrapes,
	}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "ok\n")
	})
	for _, p := range debughttp.Pages() {
		h := http.Handler(drained)
		if p.Path == "/debug/snapshot" {
			// debughttp builds one snapshot at a time; this also
			// counts the one still being sent.
			h = server.LimitInFlight(metricsMaxSnapshots, h)
		}
		mux.Handle("GET "+p.Path, h)
	}
	o.ErrorLog = zap.NewStdLog(l.log.Named("http"))
	srv, err := server.NewHTTP(ln, mux, o)
	if err != nil {
		_ = ln.Close()
		return nil, fmt.Errorf("allocd: metrics: %w", err)
	}
	go func() {
		if err := srv.Serve(); err != nil && err != http.ErrServerClosed {
			l.log.Error("metrics server stopped", zap.Error(err))
		}
	}()
	l.log.Info("serving metrics", zap.String("address", ln.Addr().String()))
	return &metricsServer{addr: ln.Addr().String(), srv: srv}, nil
}

// devicesCollector is the metrics of the allocators created so far: a
// stats.Collector over them, rebuilt when a device has been added, plus
// allocd_bad_frees_total. It describes nothing (an unchecked collector),
// since its set of series grows with the devices.
type devicesCollector struct {
	l *lib

	mu sync.Mutex
	n  int // allocators c covers
	c  *stats.Collector
}

var badFreesDesc = prometheus.NewDesc(
	prometheus.BuildFQName(stats.Namespace, "", "bad_frees_total"),
	"Frees refused and left without effect: an unknown pointer, a double free, another device's pointer, or another error.",
	[]string{stats.LabelGPU, "reason"}, nil)

// Describe implements prometheus.Collector; it sends nothing.
func (d *devicesCollector) Describe(chan<- *prometheus.Desc) {}

// Collect implements prometheus.Collector.
func (d *devicesCollector) Collect(ch chan<- prometheus.Metric) {
	d.l.drain(false) // the frees queued so far count
	as := d.l.devs.All()
	d.mu.Lock()
	if d.n != len(as) {
		srcs := make([]stats.Source, len(as))
		for j, a := range as {
			srcs[j] = a
		}
		c, err := stats.NewCollector(srcs...)
		if err != nil {
			d.l.log.Warn("building the metrics collector", zap.Error(err))
		} else {
			d.c, d.n = c, len(as)
		}
	}
	c := d.c
	d.mu.Unlock()
	if c != nil {
		c.Collect(ch)
	}
	for _, a := range as {
		i := a.Device().Info().Index
		for r := range numReasons {
			ch <- prometheus.MustNewConstMetric(badFreesDesc, prometheus.CounterValue,
				float64(d.l.bad[i][r].Load()), strconv.Itoa(i), reasonNames[r])
		}
	}
}

// dumpSnapshot writes the snapshot of every device created so far
// (Devices.WriteSnapshot: PyTorch's pickle) to path.
func (l *lib) dumpSnapshot(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("allocd: dump snapshot: %w", err)
	}
	if err := l.devs.WriteSnapshot(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("allocd: dump snapshot to %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("allocd: dump snapshot: %w", err)
	}
	return nil
}
