package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/server"
	"github.com/allocd/allocd/stats"
)

// newServeTestDaemon returns a ready daemon over a 4 GiB Sim holding a few
// allocations, and an HTTP server for its routes.
func newServeTestDaemon(t *testing.T, opts ...allocator.Option) (*server.Daemon, *httptest.Server) {
	t.Helper()
	return newServeTestDaemonOn(t, 1, opts...)
}

// newServeTestDaemonOn is newServeTestDaemon over n Sims (indexes 0..n-1).
// Device i holds the same allocations as the single device does, plus i
// more of 1 MiB + 1, so that the devices differ.
func newServeTestDaemonOn(t *testing.T, n int, opts ...allocator.Option) (*server.Daemon, *httptest.Server) {
	t.Helper()
	var devs []cudart.Device
	for i := range n {
		dev, err := cudart.NewSim(cudart.SimConfig{Capacity: 4 << 30, Index: i})
		if err != nil {
			t.Fatal(err)
		}
		devs = append(devs, dev)
	}
	allocs, err := allocator.NewDevices(devs, allocator.DefaultConfig(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = allocs.Close() })
	for i, a := range allocs.All() {
		for _, size := range []uint64{4096, 1 << 20, 3 << 20, 64 << 20} {
			if _, err := a.Malloc(size, cudart.DefaultStream); err != nil {
				t.Fatal(err)
			}
		}
		p, err := a.Malloc(8<<20, cudart.DefaultStream)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
		for range i {
			if _, err := a.Malloc(1<<20+1, cudart.DefaultStream); err != nil {
				t.Fatal(err)
			}
		}
	}
	d, err := server.New(zap.NewNop(), allocs, buildVersion())
	if err != nil {
		t.Fatal(err)
	}
	d.SetReady(true)
	srv := httptest.NewServer(d.Handler())
	t.Cleanup(srv.Close)
	return d, srv
}

func serveGet(t *testing.T, url string, header ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b)
}

func TestServeHealthAndReady(t *testing.T) {
	d, srv := newServeTestDaemon(t)
	if resp, body := serveGet(t, srv.URL+"/healthz"); resp.StatusCode != 200 || body != "ok\n" {
		t.Errorf("/healthz = %d %q", resp.StatusCode, body)
	}
	if resp, _ := serveGet(t, srv.URL+"/readyz"); resp.StatusCode != 200 {
		t.Errorf("/readyz = %d, want 200 when ready", resp.StatusCode)
	}
	d.SetReady(false)
	if resp, _ := serveGet(t, srv.URL+"/readyz"); resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("/readyz = %d, want 503 while shutting down", resp.StatusCode)
	}
	if resp, _ := serveGet(t, srv.URL+"/healthz"); resp.StatusCode != 200 {
		t.Errorf("/healthz = %d while shutting down, want 200", resp.StatusCode)
	}
}

func TestServeMethodsAndPaths(t *testing.T) {
	_, srv := newServeTestDaemon(t)
	for _, e := range server.Endpoints() {
		for _, method := range []string{"POST", "PUT", "DELETE", "PATCH"} {
			req, _ := http.NewRequest(method, srv.URL+e.Path, strings.NewReader("x"))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			allow := resp.Header.Get("Allow")
			if resp.StatusCode != http.StatusMethodNotAllowed || !strings.Contains(allow, "GET") || !strings.Contains(allow, "HEAD") {
				t.Errorf("%s %s = %d, Allow %q; want 405 with Allow: GET, HEAD", method, e.Path, resp.StatusCode, allow)
			}
		}
		req, _ := http.NewRequest("HEAD", srv.URL+e.Path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("HEAD %s = %d, want 200", e.Path, resp.StatusCode)
		}
	}
	for _, path := range []string{"/nope", "/metrics/x", "/debug", "/debug/", "/debug/pprof/", "/healthz/"} {
		if resp, _ := serveGet(t, srv.URL+path); resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET %s = %d, want 404", path, resp.StatusCode)
		}
	}
	resp, body := serveGet(t, srv.URL+"/")
	if resp.StatusCode != 200 || !strings.Contains(body, "/debug/snapshot") {
		t.Errorf("GET / = %d %q, want the endpoint index", resp.StatusCode, body)
	}
}

func TestServeMetrics(t *testing.T) {
	_, srv := newServeTestDaemon(t)
	resp, body := serveGet(t, srv.URL+"/metrics")
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") {
		t.Fatalf("/metrics = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	problems, err := promlint.New(strings.NewReader(body)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	for _, want := range []string{
		`allocd_allocated_bytes{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",pool="large"} 7.0254592e+07`,
		`allocd_reserved_bytes{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",pool="small"} 2.097152e+06`,
		`allocd_build_info{goversion="go`,
		"go_goroutines ", "process_start_time_seconds ", "promhttp_metric_handler_requests_total{",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// OpenMetrics when the scraper asks for it.
	resp, body = serveGet(t, srv.URL+"/metrics", "Accept", "application/openmetrics-text; version=1.0.0")
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/openmetrics-text") || !strings.HasSuffix(body, "# EOF\n") {
		t.Errorf("OpenMetrics scrape: %s, ends %q", resp.Header.Get("Content-Type"), body[max(0, len(body)-20):])
	}
}

func TestServeDebugSummary(t *testing.T) {
	d, srv := newServeTestDaemon(t)
	resp, body := serveGet(t, srv.URL+"/debug/summary")
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") {
		t.Fatalf("/debug/summary = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if want := stats.Summary(d.Allocators()[0].Stats(), 0); body != want {
		t.Errorf("/debug/summary:\n%s\nwant:\n%s", body, want)
	}
}

func TestServeDebugStats(t *testing.T) {
	d, srv := newServeTestDaemon(t)
	resp, body := serveGet(t, srv.URL+"/debug/stats")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("/debug/stats = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var got map[string]int64
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatal(err)
	}
	st := d.Allocators()[0].Stats()
	want := st.Flat()
	if len(got) != len(want) {
		t.Errorf("%d keys, want %d", len(got), len(want))
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %d, want %d", k, got[k], v)
		}
	}
	// The keys come in sorted order, as torch.cuda.memory_stats() gives them.
	var keys []string
	dec := json.NewDecoder(strings.NewReader(body))
	if _, err := dec.Token(); err != nil {
		t.Fatal(err)
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, tok.(string))
		if _, err := dec.Token(); err != nil {
			t.Fatal(err)
		}
	}
	if !slices.IsSorted(keys) || len(keys) == 0 {
		t.Errorf("keys not sorted: %v", keys)
	}
}

func TestServeDebugSnapshot(t *testing.T) {
	_, srv := newServeTestDaemon(t, allocator.WithHistory(100))
	resp, body := serveGet(t, srv.URL+"/debug/snapshot")
	if resp.StatusCode != 200 {
		t.Fatalf("/debug/snapshot = %d", resp.StatusCode)
	}
	var snap struct {
		Segments []struct {
			TotalSize   uint64 `json:"total_size"`
			SegmentType string `json:"segment_type"`
			Blocks      []struct {
				Size  uint64 `json:"size"`
				State string `json:"state"`
			} `json:"blocks"`
		} `json:"segments"`
		DeviceTraces [][]struct {
			Action string `json:"action"`
		} `json:"device_traces"`
	}
	if err := json.Unmarshal([]byte(body), &snap); err != nil {
		t.Fatal(err)
	}
	allocated := 0
	for _, s := range snap.Segments {
		for _, b := range s.Blocks {
			if b.State == "active_allocated" {
				allocated++
			}
		}
	}
	// One small segment (4 KiB and 1 MiB), a 20 MiB one (3 MiB; the
	// 8 MiB block came from it and went back) and one of 64 MiB.
	if len(snap.Segments) != 3 || allocated != 4 {
		t.Errorf("snapshot has %d segments and %d allocated blocks, want 3 and 4:\n%s", len(snap.Segments), allocated, body)
	}
	if len(snap.DeviceTraces) != 1 || len(snap.DeviceTraces[0]) == 0 || snap.DeviceTraces[0][0].Action != "segment_alloc" {
		t.Errorf("device_traces = %+v, want the recorded history starting with segment_alloc", snap.DeviceTraces)
	}

	resp, body = serveGet(t, srv.URL+"/debug/snapshot?format=pickle")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/octet-stream" {
		t.Fatalf("pickle: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if !bytes.HasPrefix([]byte(body), []byte{0x80}) || !strings.HasSuffix(body, ".") {
		t.Errorf("pickle does not start with PROTO and end with STOP: % x … % x", body[:min(8, len(body))], body[max(0, len(body)-4):])
	}
	if resp, _ := serveGet(t, srv.URL+"/debug/snapshot?format=xml"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("format=xml = %d, want 400", resp.StatusCode)
	}
}
