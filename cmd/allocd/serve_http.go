package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/stats"
	"github.com/allocd/allocd/trace"
)

// serveEndpoints lists the daemon's endpoints for the index page.
var serveEndpoints = []struct{ path, what string }{
	{"/metrics", "Prometheus metrics (text format, or OpenMetrics when asked for)"},
	{"/healthz", "200 while the process runs"},
	{"/readyz", "200 once the allocators are ready, 503 while shutting down"},
	{"/debug/summary", "torch.cuda.memory_summary() table of each device; ?gpu=N for one"},
	{"/debug/stats", "torch.cuda.memory_stats() keys as JSON: one device's map, or with several devices one map per gpu; ?gpu=N for one, ?gpu=all for the per-gpu shape"},
	{"/debug/snapshot", "segments, blocks and recorded history of every device as JSON; ?gpu=N for one; ?format=pickle for PyTorch's memory_viz"},
}

// routes returns the daemon's handler. Patterns carry their method, so a
// request with another method gets 405 and an Allow header, and an unknown
// path 404 (net/http.ServeMux, Go 1.22+). GET patterns also answer HEAD.
func (d *serveDaemon) routes() http.Handler {
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
		serveText(w, http.StatusOK, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !d.ready.Load() {
			serveText(w, http.StatusServiceUnavailable, "not ready: starting or shutting down\n")
			return
		}
		serveText(w, http.StatusOK, "ready\n")
	})
	mux.HandleFunc("GET /debug/summary", d.serveSummary)
	mux.HandleFunc("GET /debug/stats", d.serveStats)
	mux.HandleFunc("GET /debug/snapshot", d.serveSnapshot)
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, _ *http.Request) {
		var b strings.Builder
		fmt.Fprintf(&b, "allocd %s\n\n", buildVersion())
		for _, e := range serveEndpoints {
			fmt.Fprintf(&b, "%-16s %s\n", e.path, e.what)
		}
		serveText(w, http.StatusOK, b.String())
	})
	return mux
}

func serveText(w http.ResponseWriter, code int, s string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = w.Write([]byte(s))
}

func serveJSON(w http.ResponseWriter, v any) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(append(b, '\n'))
}

// How a request chose its devices with ?gpu=.
const (
	gpuDefault = iota // no ?gpu: every device
	gpuAll            // ?gpu=all: every device, asked for by name
	gpuOne            // ?gpu=N: device N
)

// selectGPUs reads the request's ?gpu=: absent or "all" selects every
// device, N the device with index N. A malformed value gets 400 and an
// index not served 404; ok is false then, and the answer is written.
func (d *serveDaemon) selectGPUs(w http.ResponseWriter, r *http.Request) (gpus []serveGPU, how int, ok bool) {
	v, given := r.URL.Query()["gpu"]
	if !given {
		return d.gpus, gpuDefault, true
	}
	if len(v) != 1 {
		http.Error(w, "gpu: give it once (a device index, or all)", http.StatusBadRequest)
		return nil, 0, false
	}
	if v[0] == "all" {
		return d.gpus, gpuAll, true
	}
	i, err := strconv.Atoi(v[0])
	if err != nil || i < 0 {
		http.Error(w, fmt.Sprintf("gpu %q: expected a device index (0, 1, …) or all", v[0]), http.StatusBadRequest)
		return nil, 0, false
	}
	g, found := d.gpu(i)
	if !found {
		http.Error(w, fmt.Sprintf("gpu %d: not served here; devices: %v", i, d.devs.Indexes()), http.StatusNotFound)
		return nil, 0, false
	}
	return []serveGPU{g}, gpuOne, true
}

// serveSummary writes the torch.cuda.memory_summary() table of each
// selected device, in ascending index, separated by a blank line.
func (d *serveDaemon) serveSummary(w http.ResponseWriter, r *http.Request) {
	gpus, _, ok := d.selectGPUs(w, r)
	if !ok {
		return
	}
	var b strings.Builder
	for i, g := range gpus {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(stats.Summary(g.a.Stats(), g.index))
	}
	serveText(w, http.StatusOK, b.String())
}

// serveStats writes the flat torch.cuda.memory_stats() map of one device
// (?gpu=N, or the only device when no ?gpu is given), or else an object
// from each device index ("0", "1", …) to its map. encoding/json sorts
// the keys, as memory_stats() does.
func (d *serveDaemon) serveStats(w http.ResponseWriter, r *http.Request) {
	gpus, how, ok := d.selectGPUs(w, r)
	if !ok {
		return
	}
	if how == gpuOne || how == gpuDefault && len(gpus) == 1 {
		st := gpus[0].a.Stats()
		serveJSON(w, st.Flat())
		return
	}
	out := make(map[string]map[string]int64, len(gpus))
	for _, g := range gpus {
		st := g.a.Stats()
		out[strconv.Itoa(g.index)] = st.Flat()
	}
	serveJSON(w, out)
}

// snapshotOf merges the snapshots of gpus as torch.cuda.memory._snapshot()
// covers every device: the segments of all, each naming its device, and
// device_traces indexed by device index (empty lists for devices not
// included).
func snapshotOf(gpus []serveGPU) *trace.Snapshot {
	snaps := make([]*trace.Snapshot, len(gpus))
	for i, g := range gpus {
		snaps[i] = g.a.Snapshot()
	}
	return trace.Merge(snaps...)
}

// serveSnapshot writes the selected devices' trace.Snapshot (merged:
// snapshotOf) as JSON with PyTorch's key names, or, with ?format=pickle,
// as the pickle torch.cuda.memory._snapshot() would dump, which
// pytorch.org/memory_viz opens.
func (d *serveDaemon) serveSnapshot(w http.ResponseWriter, r *http.Request) {
	format := r.URL.Query().Get("format")
	if format != "" && format != "json" && format != "pickle" {
		http.Error(w, fmt.Sprintf("format %q: expected json or pickle", format), http.StatusBadRequest)
		return
	}
	gpus, _, ok := d.selectGPUs(w, r)
	if !ok {
		return
	}
	snap := snapshotOf(gpus)
	if format == "pickle" {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Disposition", `attachment; filename="allocd_snapshot.pickle"`)
		w.Header().Set("Cache-Control", "no-store")
		if err := trace.WritePickle(w, snap); err != nil {
			d.log.Warn("writing a snapshot pickle", zap.Error(err))
		}
		return
	}
	serveJSON(w, snap)
}
