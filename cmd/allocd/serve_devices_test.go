package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
)

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

// serveFindLogWith returns the first log line whose msg is msg and whose
// field key is value (JSON numbers are float64).
func serveFindLogWith(s, msg, key string, value any) map[string]any {
	for _, m := range serveLogLines(s) {
		if m["msg"] == msg && m[key] == value {
			return m
		}
	}
	return nil
}

// inProcessServe is `allocd serve` run through the root command in this
// process, stopped by cancelling its context.
type inProcessServe struct {
	url    string
	logs   *serveLogBuffer
	cancel context.CancelFunc
	exited chan struct{}
	err    error
}

// startServeInProcess runs `allocd serve args...` on a free loopback port
// and waits until it serves. It is stopped at the end of the test if the
// test has not stopped it.
func startServeInProcess(t *testing.T, args ...string) *inProcessServe {
	t.Helper()
	ready := filepath.Join(t.TempDir(), "ready")
	ctx, cancel := context.WithCancel(context.Background())
	p := &inProcessServe{logs: &serveLogBuffer{}, cancel: cancel, exited: make(chan struct{})}
	root := newRootCmd()
	root.SetArgs(append([]string{"serve", "--listen", "127.0.0.1:0", "--ready-file", ready}, args...))
	root.SetErr(p.logs)
	root.SetOut(p.logs)
	go func() {
		defer close(p.exited)
		p.err = root.ExecuteContext(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-p.exited
	})
	p.url = serveReadyAddr(t, ready, p.exited, p.logs)
	return p
}

// stop cancels the daemon's context and waits for it to return, which it
// must do without error.
func (p *inProcessServe) stop(t *testing.T) {
	t.Helper()
	p.cancel()
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("serve did not stop after its context was cancelled:\n%s", p.logs)
	}
	if p.err != nil {
		t.Fatalf("serve: %v\n%s", p.err, p.logs)
	}
}

// TestServeCommandInProcessSeveralGPUs runs `allocd serve --device sim:2
// --synthetic` in this process (under the race detector when the tests
// use it): both devices' workloads run at once, /metrics shows each under
// its own gpu label, and shutdown closes both allocators cleanly.
func TestServeCommandInProcessSeveralGPUs(t *testing.T) {
	p := startServeInProcess(t, "--device", "sim:2", "--sim-capacity", "32GiB", "--synthetic", "--replay-rate", "0")
	var body string
	serveWaitFor(t, 30*time.Second, "allocations and device mallocs on both gpus", func() bool {
		_, body = serveScrape(t, p.url+"/metrics")
		for gpu := range 2 {
			n, _ := serveSumMetricGPU(body, "allocd_allocations_total", gpu)
			m, _ := serveSumMetricGPU(body, "allocd_device_mallocs_total", gpu)
			if n < 100 || m == 0 {
				return false
			}
		}
		return true
	})
	for gpu := range 2 {
		if v, _ := serveSumMetricGPU(body, "allocd_device_total_bytes", gpu); v != 32<<30 {
			t.Errorf("gpu %d: allocd_device_total_bytes = %v, want 32 GiB", gpu, v)
		}
	}
	// The two workloads are seeded differently: their counts differ.
	n0, _ := serveSumMetricGPU(body, "allocd_allocations_total", 0)
	n1, _ := serveSumMetricGPU(body, "allocd_allocations_total", 1)
	r0, _ := serveSumMetricGPU(body, "allocd_peak_reserved_bytes", 0)
	r1, _ := serveSumMetricGPU(body, "allocd_peak_reserved_bytes", 1)
	if n0 == n1 && r0 == r1 {
		t.Errorf("both gpus show the same workload (%v allocations, %v peak reserved)", n0, r0)
	}
	p.stop(t)
	out := p.logs.String()
	if m := serveFindLog(out, "allocd serve starting"); m == nil || m["device_spec"] != "sim:2" || m["devices"] != 2.0 {
		t.Errorf("start log %v does not name the devices", m)
	}
	for gpu := range 2 {
		for _, msg := range []string{"device opened", "synthetic workload started", "allocator closed: every segment returned to the device"} {
			if serveFindLogWith(out, msg, "gpu", float64(gpu)) == nil {
				t.Errorf("no %q log for gpu %d:\n%s", msg, gpu, out)
			}
		}
		closed := serveFindLogWith(out, "allocator closed: every segment returned to the device", "gpu", float64(gpu))
		if closed != nil && (closed["segments_released"] != closed["segments_held"] || closed["device_used_bytes"] != 0.0 || closed["live_blocks"] != 0.0) {
			t.Errorf("gpu %d close log %v", gpu, closed)
		}
	}
	for _, m := range serveLogLines(out) {
		if m["level"] == "error" {
			t.Errorf("error logged: %v", m)
		}
	}
}

// testServeSeveralGPUs runs the binary on two simulated devices under the
// synthetic workload (loopback, a free port), scrapes /metrics until both
// gpu="0" and gpu="1" series show allocations, checks the per-device debug
// views, then stops it with SIGTERM: it exits 0 and both allocators
// return every segment.
func testServeSeveralGPUs(t *testing.T, bin string) {
	p := startServe(t, bin, "--device", "sim:2", "--sim-capacity", "64GiB", "--synthetic", "--replay-rate", "50000")
	var body string
	serveWaitFor(t, 30*time.Second, `allocations on gpu="0" and gpu="1" in /metrics`, func() bool {
		_, body = serveScrape(t, p.url+"/metrics")
		for gpu := range 2 {
			if n, _ := serveSumMetricGPU(body, "allocd_allocations_total", gpu); n < 1000 {
				return false
			}
		}
		return true
	})
	problems, err := promlint.New(strings.NewReader(body)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, pr := range problems {
		t.Errorf("lint: %s: %s", pr.Metric, pr.Text)
	}
	for gpu := range 2 {
		for _, name := range []string{"allocd_allocations_total", "allocd_reserved_bytes", "allocd_device_mallocs_total", "allocd_peak_allocated_bytes", "allocd_device_info"} {
			if v, ok := serveSumMetricGPU(body, name, gpu); !ok || v <= 0 {
				t.Errorf(`%s{gpu="%d"} = %v (present %v), want > 0`, name, gpu, v, ok)
			}
		}
	}
	if _, ok := serveSumMetricGPU(body, "allocd_allocations_total", 2); ok {
		t.Error(`a gpu="2" series on two devices`)
	}
	code, summary := serveScrape(t, p.url+"/debug/summary")
	if code != 200 || !strings.Contains(summary, "device ID 0") || !strings.Contains(summary, "device ID 1") {
		t.Errorf("/debug/summary = %d:\n%s", code, summary)
	}
	code, js := serveScrape(t, p.url+"/debug/stats")
	var perGPU map[string]map[string]int64
	if err := json.Unmarshal([]byte(js), &perGPU); code != 200 || err != nil || len(perGPU) != 2 || perGPU["1"]["allocation.all.allocated"] == 0 {
		t.Errorf("/debug/stats = %d, %v: %.300s", code, err, js)
	}
	code, js = serveScrape(t, p.url+"/debug/stats?gpu=1")
	var flat map[string]int64
	if err := json.Unmarshal([]byte(js), &flat); code != 200 || err != nil || flat["allocation.all.allocated"] == 0 {
		t.Errorf("/debug/stats?gpu=1 = %d, %v: %.300s", code, err, js)
	}
	if code, _ := serveScrape(t, p.url+"/debug/snapshot?gpu=2"); code != http.StatusNotFound {
		t.Errorf("/debug/snapshot?gpu=2 = %d, want 404", code)
	}

	p.signal(t, syscall.SIGTERM)
	if code := p.wait(t, 30*time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0:\n%s", code, p.logs)
	}
	logs := p.logs.String()
	for gpu := range 2 {
		closed := serveFindLogWith(logs, "allocator closed: every segment returned to the device", "gpu", float64(gpu))
		if closed == nil || closed["segments_released"] != closed["segments_held"] || closed["device_used_bytes"] != 0.0 || closed["live_blocks"] != 0.0 {
			t.Errorf("gpu %d: close log %v:\n%s", gpu, closed, logs)
		}
	}
	for _, m := range serveLogLines(logs) {
		if m["level"] == "error" {
			t.Errorf("error logged: %v", m)
		}
	}
}
