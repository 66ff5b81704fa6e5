package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/server"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/stats"
)

// This file is the in-process HTTP surface: /metrics, /healthz and minimal
// debug pages, and the snapshot writer that allocd_dump_snapshot shares.

// metricsServer serves the library's registry on one listener.
type metricsServer struct {
	addr string // the address actually bound
	srv  *server.HTTP
}

// The metrics server's bounds. It runs inside the user's program, so it
// holds few connections (file descriptors are the program's), builds one
// snapshot at a time (a snapshot copies the whole history), and cuts off
// a client that does not read within the write timeout; the timeouts are
// server's defaults (those of `allocd serve`).
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
func startMetrics(l *lib, addr string, o server.HTTPOptions) (*metricsServer, error) {
	reg := prometheus.NewRegistry()
	if err := reg.Register(&devicesCollector{l: l}); err != nil {
		return nil, fmt.Errorf("allocd: metrics: %w", err)
	}
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
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { text(w, "ok\n") })
	debug := func(h http.Handler) http.Handler { return server.LimitInFlight(metricsMaxDebug, h) }
	mux.Handle("GET /debug/summary", debug(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		var b strings.Builder
		l.drain(false)
		idx, as := l.all()
		for j, a := range as {
			if j > 0 {
				b.WriteByte('\n')
			}
			b.WriteString(stats.Summary(a.Stats(), idx[j]))
		}
		text(w, b.String())
	})))
	mux.Handle("GET /debug/stats", debug(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		out := map[string]map[string]int64{}
		l.drain(false)
		idx, _ := l.all()
		for _, i := range idx {
			out[strconv.Itoa(i)] = l.flatStats(i)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out)
	})))
	snapshot := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Disposition", `attachment; filename="allocd_snapshot.pickle"`)
		l.drain(false)
		if err := l.writeSnapshot(w); err != nil {
			l.log.Warn("writing a snapshot", zap.Error(err))
		}
	})
	mux.Handle("GET /debug/snapshot", debug(server.LimitInFlight(metricsMaxSnapshots, server.LimitBody(server.DefaultMaxBodyBytes, snapshot))))
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

func text(w http.ResponseWriter, s string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, s)
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
	idx, as := d.l.all()
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
	for _, i := range idx {
		for r := range numReasons {
			ch <- prometheus.MustNewConstMetric(badFreesDesc, prometheus.CounterValue,
				float64(d.l.bad[i][r].Load()), strconv.Itoa(i), reasonNames[r])
		}
	}
}

// snapshot merges the snapshots of every device created so far, as
// torch.cuda.memory._snapshot() covers every device: the segments of all,
// each naming its device, and device_traces with one list per device index.
func (l *lib) snapshot() *snapshot.Snapshot {
	_, as := l.all()
	snaps := make([]*snapshot.Snapshot, len(as))
	for j, a := range as {
		snaps[j] = a.Snapshot()
	}
	return snapshot.Merge(snaps...)
}

// writeSnapshot writes the merged snapshot as PyTorch's pickle.
func (l *lib) writeSnapshot(w io.Writer) error {
	return snapshot.WritePickle(w, l.snapshot())
}

// dumpSnapshot writes the snapshot pickle to path.
func (l *lib) dumpSnapshot(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("allocd: dump snapshot: %w", err)
	}
	if err := l.writeSnapshot(f); err != nil {
		_ = f.Close()
		return fmt.Errorf("allocd: dump snapshot to %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("allocd: dump snapshot: %w", err)
	}
	return nil
}
