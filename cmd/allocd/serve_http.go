package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/bench"
	"github.com/allocd/allocd/stats"
	"github.com/allocd/allocd/trace"
)

// serveEndpoints lists the daemon's endpoints for the index page.
var serveEndpoints = []struct{ path, what string }{
	{"/metrics", "Prometheus metrics (text format, or OpenMetrics when asked for)"},
	{"/healthz", "200 while the process runs"},
	{"/readyz", "200 once the allocator is ready, 503 while shutting down"},
	{"/debug/summary", "torch.cuda.memory_summary() table"},
	{"/debug/stats", "torch.cuda.memory_stats() keys, as JSON"},
	{"/debug/snapshot", "segments, blocks and recorded history as JSON; ?format=pickle for PyTorch's memory_viz"},
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
	mux.HandleFunc("GET /debug/summary", func(w http.ResponseWriter, _ *http.Request) {
		serveText(w, http.StatusOK, stats.Summary(d.a.Stats(), d.dev.Info().Index))
	})
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

// serveStats writes the flat torch.cuda.memory_stats() map; encoding/json
// sorts its keys, as memory_stats() does.
func (d *serveDaemon) serveStats(w http.ResponseWriter, _ *http.Request) {
	st := d.a.Stats()
	serveJSON(w, st.Flat())
}

// serveSnapshot writes allocator.Snapshot as JSON with PyTorch's key
// names, or, with ?format=pickle, as the pickle torch.cuda.memory._snapshot()
// would dump, which pytorch.org/memory_viz opens.
func (d *serveDaemon) serveSnapshot(w http.ResponseWriter, r *http.Request) {
	format := r.URL.Query().Get("format")
	if format != "" && format != "json" && format != "pickle" {
		http.Error(w, fmt.Sprintf("format %q: expected json or pickle", format), http.StatusBadRequest)
		return
	}
	snap := d.a.Snapshot()
	if format == "pickle" {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Disposition", `attachment; filename="allocd_snapshot.pickle"`)
		w.Header().Set("Cache-Control", "no-store")
		if err := trace.WritePickle(w, bench.TraceSnapshot(snap)); err != nil {
			d.log.Warn("writing a snapshot pickle", zap.Error(err))
		}
		return
	}
	serveJSON(w, serveSnapshotOf(snap))
}

// The JSON shape of /debug/snapshot: torch.cuda.memory._snapshot()'s keys.
type (
	serveSnapshotDoc struct {
		Segments          []serveSegmentDoc `json:"segments"`
		DeviceTraces      [][]serveTraceDoc `json:"device_traces"`
		AllocatorSettings map[string]string `json:"allocator_settings"`
	}
	serveSegmentDoc struct {
		Device        int             `json:"device"`
		Address       uint64          `json:"address"`
		TotalSize     uint64          `json:"total_size"`
		Stream        uint64          `json:"stream"`
		SegmentType   string          `json:"segment_type"`
		AllocatedSize uint64          `json:"allocated_size"`
		ActiveSize    uint64          `json:"active_size"`
		RequestedSize uint64          `json:"requested_size"`
		IsExpandable  bool            `json:"is_expandable"`
		Blocks        []serveBlockDoc `json:"blocks"`
	}
	serveBlockDoc struct {
		Address       uint64 `json:"address"`
		Size          uint64 `json:"size"`
		RequestedSize uint64 `json:"requested_size"`
		State         string `json:"state"`
	}
	serveTraceDoc struct {
		Action string `json:"action"`
		Addr   uint64 `json:"addr"`
		Size   uint64 `json:"size"`
		Stream uint64 `json:"stream"`
		TimeUS int64  `json:"time_us"`
	}
)

func serveSnapshotOf(s allocator.Snapshot) serveSnapshotDoc {
	out := serveSnapshotDoc{
		Segments:          make([]serveSegmentDoc, len(s.Segments)),
		DeviceTraces:      make([][]serveTraceDoc, len(s.DeviceTraces)),
		AllocatorSettings: map[string]string{"PYTORCH_CUDA_ALLOC_CONF": s.Config},
	}
	for i, seg := range s.Segments {
		js := serveSegmentDoc{
			Device: seg.Device, Address: seg.Address, TotalSize: seg.TotalSize, Stream: seg.Stream,
			SegmentType: seg.SegmentType, AllocatedSize: seg.AllocatedSize, ActiveSize: seg.ActiveSize,
			RequestedSize: seg.RequestedSize, IsExpandable: seg.IsExpandable,
			Blocks: make([]serveBlockDoc, len(seg.Blocks)),
		}
		for j, b := range seg.Blocks {
			js.Blocks[j] = serveBlockDoc{Address: b.Address, Size: b.Size, RequestedSize: b.RequestedSize, State: b.State}
		}
		out.Segments[i] = js
	}
	for i, entries := range s.DeviceTraces {
		jt := make([]serveTraceDoc, len(entries))
		for j, e := range entries {
			jt[j] = serveTraceDoc{Action: e.Action, Addr: e.Addr, Size: e.Size, Stream: e.Stream, TimeUS: e.TimeUS}
		}
		out.DeviceTraces[i] = jt
	}
	return out
}
