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

	"github.com/allocd/allocd/stats"
	"github.com/allocd/allocd/trace"
)

// This file is the in-process HTTP surface: /metrics, /healthz and minimal
// debug pages, and the snapshot writer that allocd_dump_snapshot shares.

// metricsServer serves the library's registry on one listener.
type metricsServer struct {
	addr string // the address actually bound
	srv  *http.Server
}

// startMetrics listens on exactly addr and serves in the background.
func startMetrics(l *lib, addr string) (*metricsServer, error) {
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
		ErrorLog:      zap.NewStdLog(l.log.Named("metrics")),
		ErrorHandling: promhttp.ContinueOnError,
		Timeout:       10 * time.Second,
	}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { text(w, "ok\n") })
	mux.HandleFunc("GET /debug/summary", func(w http.ResponseWriter, _ *http.Request) {
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
	})
	mux.HandleFunc("GET /debug/stats", func(w http.ResponseWriter, _ *http.Request) {
		out := map[string]map[string]int64{}
		l.drain(false)
		idx, _ := l.all()
		for _, i := range idx {
			out[strconv.Itoa(i)] = l.flatStats(i)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out)
	})
	mux.HandleFunc("GET /debug/snapshot", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Disposition", `attachment; filename="allocd_snapshot.pickle"`)
		l.drain(false)
		if err := l.writeSnapshot(w); err != nil {
			l.log.Warn("writing a snapshot", zap.Error(err))
		}
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: zap.NewStdLog(l.log.Named("http"))}
	go func() {
		if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
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
func (l *lib) snapshot() *trace.Snapshot {
	_, as := l.all()
	snaps := make([]*trace.Snapshot, len(as))
	for j, a := range as {
		snaps[j] = a.Snapshot()
	}
	return trace.Merge(snaps...)
}

// writeSnapshot writes the merged snapshot as PyTorch's pickle.
func (l *lib) writeSnapshot(w io.Writer) error {
	return trace.WritePickle(w, l.snapshot())
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
