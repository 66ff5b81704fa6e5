package server_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/server"
	"github.com/allocd/allocd/simdev"
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
		dev, err := simdev.New(simdev.Config{Capacity: 4 << 30, Index: i})
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
	d, err := server.New(zap.NewNop(), allocs, "test")
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

// gpuSamples indexes gathered metrics by gpu label: name (with
// "/small" or "/large" for pool metrics) to value.
func gpuSamples(t *testing.T, mfs []*dto.MetricFamily) map[string]map[string]float64 {
	t.Helper()
	out := map[string]map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var gpu, pool string
			for _, lp := range m.GetLabel() {
				switch lp.GetName() {
				case stats.LabelGPU:
					gpu = lp.GetValue()
				case stats.LabelPool:
					pool = lp.GetValue()
				}
			}
			if gpu == "" {
				continue
			}
			name := mf.GetName()
			if pool != "" {
				name += "/" + pool
			}
			if out[gpu] == nil {
				out[gpu] = map[string]float64{}
			}
			switch {
			case m.Gauge != nil:
				out[gpu][name] = m.GetGauge().GetValue()
			case m.Counter != nil:
				out[gpu][name] = m.GetCounter().GetValue()
			case m.Histogram != nil:
				out[gpu][name+"_count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

// TestServeMetricsSeveralGPUs: the daemon's /metrics, built by one
// stats.NewCollector over every allocator, shows each device under its
// own gpu label with that allocator's own numbers.
func TestServeMetricsSeveralGPUs(t *testing.T) {
	d, srv := newServeTestDaemonOn(t, 3)
	mfs, err := d.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := gpuSamples(t, mfs)
	if len(got) != 3 {
		t.Fatalf("series for %d gpus, want 3: %v", len(got), got)
	}
	for _, a := range d.Allocators() {
		st := a.Stats()
		m := got[strconv.Itoa(a.Device().Info().Index)]
		want := map[string]int64{
			"allocd_allocated_bytes/small":                st.AllocatedBytes[allocator.PoolSmall].Current,
			"allocd_allocated_bytes/large":                st.AllocatedBytes[allocator.PoolLarge].Current,
			"allocd_reserved_bytes/small":                 st.ReservedBytes[allocator.PoolSmall].Current,
			"allocd_reserved_bytes/large":                 st.ReservedBytes[allocator.PoolLarge].Current,
			"allocd_segments/large":                       st.Segment[allocator.PoolLarge].Current,
			"allocd_live_allocations/large":               st.Allocation[allocator.PoolLarge].Current,
			"allocd_allocations_total/large":              st.Allocation[allocator.PoolLarge].Allocated,
			"allocd_frees_total/large":                    st.Allocation[allocator.PoolLarge].Freed,
			"allocd_peak_reserved_bytes":                  st.ReservedBytes[allocator.PoolAll].Peak,
			"allocd_device_mallocs_total":                 st.NumDeviceAlloc,
			"allocd_device_total_bytes":                   4 << 30,
			"allocd_device_malloc_duration_seconds_count": st.NumDeviceAlloc,
		}
		for name, w := range want {
			if v, ok := m[name]; !ok || v != float64(w) {
				t.Errorf("gpu %d: %s = %v (present %v), the allocator says %d", a.Device().Info().Index, name, v, ok, w)
			}
		}
	}
	// Device i holds i more large allocations than device 0.
	if got["2"]["allocd_live_allocations/large"]-got["0"]["allocd_live_allocations/large"] != 2 {
		t.Errorf("live large allocations: gpu 0 %v, gpu 2 %v; want 2 apart", got["0"]["allocd_live_allocations/large"], got["2"]["allocd_live_allocations/large"])
	}
	// And the HTTP exposition carries all three, lint-clean.
	_, body := serveGet(t, srv.URL+"/metrics")
	for gpu := range 3 {
		if v, ok := serveSumMetricGPU(body, "allocd_allocations_total", gpu); !ok || v == 0 {
			t.Errorf(`/metrics: allocd_allocations_total{gpu="%d"} = %v, %v`, gpu, v, ok)
		}
	}
	problems, err := promlint.New(strings.NewReader(body)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, pr := range problems {
		t.Errorf("lint: %s: %s", pr.Metric, pr.Text)
	}
}

func TestServeDebugSeveralGPUs(t *testing.T) {
	d, srv := newServeTestDaemonOn(t, 2, allocator.WithHistory(100))
	st0, st1 := d.Allocators()[0].Stats(), d.Allocators()[1].Stats()

	t.Run("summary", func(t *testing.T) {
		_, body := serveGet(t, srv.URL+"/debug/summary")
		if want := stats.Summary(st0, 0) + "\n" + stats.Summary(st1, 1); body != want {
			t.Errorf("/debug/summary:\n%s\nwant both devices':\n%s", body, want)
		}
		for _, q := range []string{"?gpu=1", "?gpu=all"} {
			_, body := serveGet(t, srv.URL+"/debug/summary"+q)
			want := stats.Summary(st1, 1)
			if q == "?gpu=all" {
				want = stats.Summary(st0, 0) + "\n" + want
			}
			if body != want {
				t.Errorf("/debug/summary%s:\n%s\nwant:\n%s", q, body, want)
			}
		}
	})

	t.Run("stats", func(t *testing.T) {
		_, body := serveGet(t, srv.URL+"/debug/stats")
		var per map[string]map[string]int64
		if err := json.Unmarshal([]byte(body), &per); err != nil {
			t.Fatal(err)
		}
		if len(per) != 2 || per["0"]["allocation.all.current"] != st0.Allocation[allocator.PoolAll].Current ||
			per["1"]["allocation.all.current"] != st1.Allocation[allocator.PoolAll].Current {
			t.Errorf("/debug/stats on two devices: %.400s", body)
		}
		_, body = serveGet(t, srv.URL+"/debug/stats?gpu=1")
		var flat map[string]int64
		if err := json.Unmarshal([]byte(body), &flat); err != nil {
			t.Fatal(err)
		}
		for k, v := range st1.Flat() {
			if flat[k] != v {
				t.Errorf("?gpu=1: %s = %d, want %d", k, flat[k], v)
			}
		}
	})

	t.Run("snapshot", func(t *testing.T) {
		type doc struct {
			Segments []struct {
				Device  int    `json:"device"`
				Address uint64 `json:"address"`
			} `json:"segments"`
			DeviceTraces [][]struct {
				Action string `json:"action"`
			} `json:"device_traces"`
		}
		get := func(q string) doc {
			resp, body := serveGet(t, srv.URL+"/debug/snapshot"+q)
			if resp.StatusCode != 200 {
				t.Fatalf("/debug/snapshot%s = %d", q, resp.StatusCode)
			}
			var d doc
			if err := json.Unmarshal([]byte(body), &d); err != nil {
				t.Fatal(err)
			}
			return d
		}
		count := func(d doc) map[int]int {
			n := map[int]int{}
			for _, s := range d.Segments {
				n[s.Device]++
			}
			return n
		}
		all := get("")
		if n := count(all); n[0] != 3 || n[1] != 3 || len(all.DeviceTraces) != 2 || len(all.DeviceTraces[0]) == 0 || len(all.DeviceTraces[1]) == 0 {
			t.Errorf("snapshot of both: segments per device %v, %d device traces", n, len(all.DeviceTraces))
		}
		one := get("?gpu=1")
		if n := count(one); n[0] != 0 || n[1] != 3 || len(one.DeviceTraces) != 2 || len(one.DeviceTraces[0]) != 0 || len(one.DeviceTraces[1]) == 0 {
			t.Errorf("snapshot of gpu 1: segments per device %v, device traces %d (first %d entries)", n, len(one.DeviceTraces), len(one.DeviceTraces[0]))
		}
		if resp, body := serveGet(t, srv.URL+"/debug/snapshot?gpu=1&format=pickle"); resp.StatusCode != 200 || !strings.HasSuffix(body, ".") {
			t.Errorf("pickle of gpu 1: %d", resp.StatusCode)
		}
	})

	t.Run("bad gpu", func(t *testing.T) {
		for _, path := range []string{"/debug/summary", "/debug/stats", "/debug/snapshot"} {
			for q, code := range map[string]int{
				"?gpu=2": http.StatusNotFound, "?gpu=-1": http.StatusBadRequest, "?gpu=x": http.StatusBadRequest,
				"?gpu=": http.StatusBadRequest, "?gpu=0&gpu=1": http.StatusBadRequest,
			} {
				resp, body := serveGet(t, srv.URL+path+q)
				if resp.StatusCode != code || !strings.Contains(body, "gpu") {
					t.Errorf("GET %s%s = %d %q, want %d", path, q, resp.StatusCode, body, code)
				}
			}
		}
	})
}

// TestServeDebugOneGPUShapes: on one device the endpoints answer as they
// did before there could be several; ?gpu=N and ?gpu=all still work.
func TestServeDebugOneGPUShapes(t *testing.T) {
	d, srv := newServeTestDaemon(t)
	st := d.Allocators()[0].Stats()
	for _, q := range []string{"", "?gpu=0"} {
		_, body := serveGet(t, srv.URL+"/debug/stats"+q)
		var flat map[string]int64
		if err := json.Unmarshal([]byte(body), &flat); err != nil || flat["num_device_alloc"] != st.NumDeviceAlloc {
			t.Errorf("/debug/stats%s is not the flat map: %v %.200s", q, err, body)
		}
		if _, body := serveGet(t, srv.URL+"/debug/summary"+q); body != stats.Summary(st, 0) {
			t.Errorf("/debug/summary%s is not device 0's summary", q)
		}
	}
	_, body := serveGet(t, srv.URL+"/debug/stats?gpu=all")
	var per map[string]map[string]int64
	if err := json.Unmarshal([]byte(body), &per); err != nil || len(per) != 1 || per["0"]["num_device_alloc"] != st.NumDeviceAlloc {
		t.Errorf("/debug/stats?gpu=all on one device: %v %.200s", err, body)
	}
	if resp, _ := serveGet(t, srv.URL+"/debug/stats?gpu=1"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("/debug/stats?gpu=1 on one device = %d, want 404", resp.StatusCode)
	}
}

// serveSumMetricGPU adds the samples of one metric name whose gpu label is
// gpu, in a text exposition.
func serveSumMetricGPU(body, name string, gpu int) (float64, bool) {
	label := fmt.Sprintf(`gpu="%d"`, gpu)
	var sum float64
	found := false
	for _, line := range strings.Split(body, "\n") {
		if !strings.HasPrefix(line, name+"{") || !strings.Contains(line, label) {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			sum += v
			found = true
		}
	}
	return sum, found
}
