package main

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/allocd/allocd/debughttp"
)

// serveEndpoint is one line of the index page.
type serveEndpoint struct{ path, what string }

// serveEndpoints lists the daemon's endpoints for the index page: its own,
// then the debug pages of package debughttp.
var serveEndpoints = func() []serveEndpoint {
	eps := []serveEndpoint{
		{"/metrics", "Prometheus metrics (text format, or OpenMetrics when asked for)"},
		{"/healthz", "200 while the process runs"},
		{"/readyz", "200 once the allocators are ready, 503 while shutting down"},
	}
	for _, p := range debughttp.Pages() {
		eps = append(eps, serveEndpoint{p.Path, p.Doc})
	}
	return eps
}()

// routes returns the daemon's handler. Patterns carry their method, so a
// request with another method gets 405 and an Allow header, and an unknown
// path 404 (net/http.ServeMux, Go 1.22+). GET patterns also answer HEAD.
// The debug pages are debughttp's over the daemon's devices, with its
// default bounds (4 in flight, 100,000 history entries a device).
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
	var debug http.Handler
	debug, err := debughttp.ForDevices(d.devs, debughttp.Options{ErrorLog: zap.NewStdLog(d.log.Named("debug"))})
	if err != nil {
		// Not expected: the daemon serves at least one device, with the
		// default options. Say so on the pages rather than crash.
		msg := "debug pages unavailable: " + err.Error()
		debug = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { http.Error(w, msg, http.StatusInternalServerError) })
	}
	for _, p := range debughttp.Pages() {
		mux.Handle("GET "+p.Path, debug)
	}
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
