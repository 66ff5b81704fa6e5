package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/allocd/allocd/snapshot"
)

// serveLogBuffer is a bytes buffer safe for a writer and a reader at once.
type serveLogBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *serveLogBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *serveLogBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// logLines decodes JSON log lines; other lines are skipped.
func serveLogLines(s string) []map[string]any {
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		var m map[string]any
		if json.Unmarshal(sc.Bytes(), &m) == nil {
			out = append(out, m)
		}
	}
	return out
}

// findLog returns the first log line whose msg is msg.
func serveFindLog(s, msg string) map[string]any {
	for _, m := range serveLogLines(s) {
		if m["msg"] == msg {
			return m
		}
	}
	return nil
}

// waitFor polls cond every 20ms until it holds or timeout passes.
func serveWaitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// readyAddr waits for the --ready-file and returns its address.
func serveReadyAddr(t *testing.T, path string, exited <-chan struct{}, logs *serveLogBuffer) string {
	t.Helper()
	var addr string
	deadline := time.Now().Add(60 * time.Second)
	for addr == "" {
		select {
		case <-exited:
			t.Fatalf("allocd serve exited before it was ready:\n%s", logs)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("allocd serve not ready after a minute:\n%s", logs)
		}
		if b, err := os.ReadFile(path); err == nil {
			addr = strings.TrimSpace(string(b))
		}
		time.Sleep(20 * time.Millisecond)
	}
	return "http://" + addr
}

// scrapeText GETs url with a bounded client and returns the body.
func serveScrape(t *testing.T, url string) (int, string) {
	t.Helper()
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// sumMetric adds the samples of one metric name (all label sets) in a
// text exposition.
func serveSumMetric(body, name string) (float64, bool) {
	var sum float64
	found := false
	for _, line := range strings.Split(body, "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err == nil {
			sum += v
			found = true
		}
	}
	return sum, found
}

// servedProcess is `allocd serve` running as a child process.
type servedProcess struct {
	cmd    *exec.Cmd
	logs   *serveLogBuffer
	exited chan struct{}
	err    error // Wait's, once exited is closed
	url    string
}

// buildServeBinary builds the allocd command into a test directory.
func buildServeBinary(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs the allocd binary")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("no go tool to build allocd: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "allocd")
	out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// startServe starts `allocd serve args...` with a --ready-file and waits
// until it serves. The process is killed at the end of the test if it is
// still running.
func startServe(t *testing.T, bin string, args ...string) *servedProcess {
	t.Helper()
	ready := filepath.Join(t.TempDir(), "ready")
	p := startServeProcess(t, bin, append([]string{"--ready-file", ready}, args...)...)
	p.url = serveReadyAddr(t, ready, p.exited, p.logs)
	return p
}

// startServeProcess starts `allocd serve --listen 127.0.0.1:0 args...` and
// returns at once. The process is killed at the end of the test if it is
// still running.
func startServeProcess(t *testing.T, bin string, args ...string) *servedProcess {
	t.Helper()
	p := &servedProcess{logs: &serveLogBuffer{}, exited: make(chan struct{})}
	p.cmd = exec.Command(bin, append([]string{"serve", "--listen", "127.0.0.1:0"}, args...)...)
	p.cmd.Stderr = p.logs
	p.cmd.Stdout = p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = p.cmd.Process.Kill() // only the child this test started
			<-p.exited
		}
	})
	return p
}

// signal sends sig to the child and returns.
func (p *servedProcess) signal(t *testing.T, sig os.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
}

// wait waits for the child to exit and returns its exit code.
func (p *servedProcess) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(timeout):
		t.Fatalf("allocd serve still running %v after the signal:\n%s", timeout, p.logs)
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		return ee.ExitCode()
	}
	if p.err != nil {
		t.Fatal(p.err)
	}
	return 0
}

// TestServeBinary builds allocd once and runs it as a child process.
func TestServeBinary(t *testing.T) {
	bin := buildServeBinary(t)
	t.Run("EndToEnd", func(t *testing.T) { testServeEndToEnd(t, bin) })
	t.Run("SecondSignalExitsAtOnce", func(t *testing.T) { testServeSecondSignal(t, bin) })
	t.Run("SeveralSimulatedGPUs", func(t *testing.T) { testServeSeveralGPUs(t, bin) })
	t.Run("BadNumericFlags", func(t *testing.T) { testServeBadNumericFlags(t, bin) })
	t.Run("SignalDuringTraceLoading", func(t *testing.T) { testServeSignalDuringLoading(t, bin) })
}

// testServeBadNumericFlags: out-of-range numbers stop the binary at start
// with status 1 and one clear line, never a Go crash (the --history
// case used to reserve the ring up front and die out of memory).
func testServeBadNumericFlags(t *testing.T, bin string) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--history", "99999999999"}, "allocd: --history 99999999999: expected a number of events from 0 (off) to 10000000"},
		{[]string{"--replay-rate", "NaN", "--synthetic"}, "allocd: --replay-rate NaN: expected 0 (as fast as possible) or operations per second from 0.01 to 1e+09"},
		{[]string{"--replay-rate", "1e-300", "--synthetic"}, "allocd: --replay-rate 1e-300: expected"},
		{[]string{"--sim-capacity", "NaN"}, "allocd: --sim-capacity: bad size"},
		{[]string{"--drain-delay", "-1s"}, "allocd: --drain-delay -1s: expected a duration from 0 to 1h0m0s"},
	} {
		p := startServeProcess(t, bin, append([]string{"--device", "sim"}, tc.args...)...)
		code := p.wait(t, 30*time.Second)
		out := p.logs.String()
		if code != 1 || !strings.Contains(out, tc.want) || strings.Contains(out, "goroutine ") || strings.Contains(out, "fatal error") {
			t.Errorf("serve %v: exit %d, output:\n%s\nwant exit 1 and %q", tc.args, code, out, tc.want)
		}
	}
}

// signalTestTraceEntries and signalTestTraceDevices size the trace that
// testServeSignalDuringLoading loads: three device traces of 4M entries,
// about 440 MB of pickle, which takes over 3 s to read on an idle core.
// (One []Entry serves as every device's, so that writing it costs the
// test little memory.)
const (
	signalTestTraceEntries = 4_000_000
	signalTestTraceDevices = 3
)

// writeBigTrace writes a snapshot of devices device traces, each of n
// alloc and free_completed entries cycling over 1000 addresses, as a plain
// pickle into dir.
func writeBigTrace(t *testing.T, dir string, n, devices int) string {
	t.Helper()
	entries := make([]snapshot.Entry, 0, n)
	for i := range n / 2 {
		addr := uint64(0x7f0000000000 + (i%1000)*4096)
		entries = append(entries,
			snapshot.Entry{Action: snapshot.ActionAlloc, Addr: addr, Size: 4096, TimeUS: int64(i)},
			snapshot.Entry{Action: snapshot.ActionFreeCompleted, Addr: addr, Size: 4096, TimeUS: int64(i)})
	}
	path := filepath.Join(dir, "big.pickle")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	traces := make([][]snapshot.Entry, devices)
	for i := range traces {
		traces[i] = entries
	}
	if err := snapshot.WritePickle(w, &snapshot.Snapshot{DeviceTraces: traces}); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(w.Flush(), f.Close()); err != nil {
		t.Fatal(err)
	}
	return path
}

// testServeSignalDuringLoading: a SIGTERM while `serve --replay` still
// reads its trace exits 0 within a second, having opened no device; two
// signals together exit 130 at once.
func testServeSignalDuringLoading(t *testing.T, bin string) {
	big := writeBigTrace(t, t.TempDir(), signalTestTraceEntries, signalTestTraceDevices)
	start := func(t *testing.T) *servedProcess {
		p := startServeProcess(t, bin, "--device", "sim", "--replay", big, "--loop")
		serveWaitFor(t, 10*time.Second, "the trace loading log", func() bool {
			return serveFindLog(p.logs.String(), "loading trace") != nil
		})
		time.Sleep(200 * time.Millisecond) // well into the read
		if serveFindLog(p.logs.String(), "trace loaded") != nil {
			t.Skip("the big trace loaded in under 200ms; it is too small to test a signal during loading")
		}
		return p
	}
	// notStarted checks that the process exited before any device or
	// allocator existed, and that loading really was interrupted.
	notStarted := func(t *testing.T, logs string) {
		for _, msg := range []string{"trace loaded", "device opened", "listening", "allocd serve starting"} {
			if serveFindLog(logs, msg) != nil {
				t.Errorf("%q logged: the signal did not interrupt loading:\n%s", msg, logs)
			}
		}
	}

	t.Run("SIGTERM", func(t *testing.T) {
		p := start(t)
		t0 := time.Now()
		p.signal(t, syscall.SIGTERM)
		code := p.wait(t, 5*time.Second)
		took := time.Since(t0)
		logs := p.logs.String()
		if code != 0 || took > time.Second {
			t.Errorf("exit %d %v after SIGTERM during loading, want 0 within 1s:\n%s", code, took, logs)
		}
		if m := serveFindLog(logs, "shutting down"); m == nil || m["signal"] != "terminated" || m["during"] != "trace loading" {
			t.Errorf("shutdown log %v, want signal terminated during trace loading", m)
		}
		if serveFindLog(logs, "shutdown complete: nothing was started") == nil {
			t.Errorf("no shutdown-complete log:\n%s", logs)
		}
		notStarted(t, logs)
	})

	t.Run("TwoSignals", func(t *testing.T) {
		p := start(t)
		// Stopped, the process receives both signals before it handles
		// either: they arrive together, as from an impatient operator
		// or a supervisor that signals twice.
		for _, sig := range []syscall.Signal{syscall.SIGSTOP, syscall.SIGTERM, syscall.SIGINT} {
			p.signal(t, sig)
		}
		t0 := time.Now()
		p.signal(t, syscall.SIGCONT)
		code := p.wait(t, 5*time.Second)
		took := time.Since(t0)
		logs := p.logs.String()
		if code != serveExitCode || took > time.Second {
			t.Errorf("exit %d %v after two signals during loading, want %d within 1s:\n%s", code, took, serveExitCode, logs)
		}
		if serveFindLog(logs, "second signal: exiting without cleanup") == nil {
			t.Errorf("no log of the second signal:\n%s", logs)
		}
		notStarted(t, logs)
	})
}

// testServeEndToEnd runs the binary on the simulated device driven by the
// test trace (or the synthetic workload when the trace is absent), checks
// its metrics and summary, then stops it with SIGTERM: it exits 0 and logs
// that every segment went back to the device.
func testServeEndToEnd(t *testing.T, bin string) {
	args := []string{"--device", "sim", "--sim-capacity", "141GiB", "--history", "1000"}
	if _, err := os.Stat(serveTestTrace); err == nil {
		args = append(args, "--replay", serveTestTrace, "--loop", "--replay-rate", "50000")
	} else {
		t.Logf("no %s; using the synthetic workload", serveTestTrace)
		args = append(args, "--synthetic", "--replay-rate", "50000")
	}
	p := startServe(t, bin, args...)

	var body string
	serveWaitFor(t, 30*time.Second, "allocations in /metrics", func() bool {
		_, body = serveScrape(t, p.url+"/metrics")
		n, _ := serveSumMetric(body, "allocd_allocations_total")
		return n > 1000
	})
	problems, err := promlint.New(strings.NewReader(body)).Lint()
	if err != nil {
		t.Fatal(err)
	}
	for _, pr := range problems {
		t.Errorf("lint: %s: %s", pr.Metric, pr.Text)
	}
	for _, name := range []string{"allocd_reserved_bytes", "allocd_segments", "allocd_device_mallocs_total",
		"allocd_peak_allocated_bytes", "allocd_peak_reserved_bytes", "allocd_device_malloc_duration_seconds_count",
		"allocd_build_info", "go_goroutines", "process_resident_memory_bytes"} {
		if v, ok := serveSumMetric(body, name); !ok || v <= 0 {
			t.Errorf("%s = %v (present %v), want > 0", name, v, ok)
		}
	}
	if v, _ := serveSumMetric(body, "allocd_device_total_bytes"); v != 141<<30 {
		t.Errorf("allocd_device_total_bytes = %v, want 141 GiB", v)
	}
	allocated, _ := serveSumMetric(body, "allocd_allocated_bytes")
	reserved, _ := serveSumMetric(body, "allocd_reserved_bytes")
	if reserved < allocated {
		t.Errorf("reserved %v < allocated %v", reserved, allocated)
	}

	code, summary := serveScrape(t, p.url+"/debug/summary")
	if code != 200 || !strings.Contains(summary, "allocd memory summary, device ID 0") || !strings.Contains(summary, "GPU reserved memory") {
		t.Errorf("/debug/summary = %d:\n%s", code, summary)
	}
	if code, _ := serveScrape(t, p.url+"/readyz"); code != 200 {
		t.Errorf("/readyz = %d, want 200", code)
	}
	if code, js := serveScrape(t, p.url+"/debug/stats"); code != 200 || !strings.Contains(js, `"num_device_alloc"`) {
		t.Errorf("/debug/stats = %d %.200s", code, js)
	}

	p.signal(t, syscall.SIGTERM)
	// A scrape racing the shutdown answers or is refused; it never hangs.
	client := &http.Client{Timeout: 2 * time.Second}
	t0 := time.Now()
	if resp, err := client.Get(p.url + "/metrics"); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if d := time.Since(t0); d > 3*time.Second {
		t.Errorf("a scrape during shutdown took %v", d)
	}
	if code := p.wait(t, 30*time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0:\n%s", code, p.logs)
	}
	logs := p.logs.String()
	if m := serveFindLog(logs, "shutting down"); m == nil || m["signal"] != "terminated" {
		t.Errorf("no shutdown log for SIGTERM:\n%s", logs)
	}
	closed := serveFindLog(logs, "allocator closed: every segment returned to the device")
	if closed == nil {
		t.Fatalf("the log does not say every segment was released:\n%s", logs)
	}
	if closed["segments_released"] != closed["segments_held"] || closed["segments_held"].(float64) <= 0 ||
		closed["device_used_bytes"] != 0.0 || closed["live_blocks"] != 0.0 {
		t.Errorf("close log %v: want every held segment released, 0 device bytes used, 0 live blocks", closed)
	}
	if serveFindLog(logs, "shutdown complete") == nil {
		t.Errorf("no 'shutdown complete' log:\n%s", logs)
	}
	for _, m := range serveLogLines(logs) {
		if m["level"] == "error" {
			t.Errorf("error logged: %v", m)
		}
	}
}

// testServeSecondSignal: a second signal during a slow shutdown (a long
// drain delay) exits at once with status 130.
func testServeSecondSignal(t *testing.T, bin string) {
	p := startServe(t, bin, "--device", "sim", "--drain-delay", "1m")
	p.signal(t, syscall.SIGTERM)
	serveWaitFor(t, 10*time.Second, "the drain log", func() bool {
		return serveFindLog(p.logs.String(), "draining: /readyz answers 503") != nil
	})
	if code, _ := serveScrape(t, p.url+"/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz while draining = %d, want 503", code)
	}
	p.signal(t, syscall.SIGINT)
	if code := p.wait(t, 10*time.Second); code != serveExitCode {
		t.Errorf("exit code %d after a second signal, want %d:\n%s", code, serveExitCode, p.logs)
	}
	if serveFindLog(p.logs.String(), "second signal: exiting without cleanup") == nil {
		t.Errorf("no log of the second signal:\n%s", p.logs)
	}
}

// TestServeCommandInProcess runs `allocd serve` through the root command
// with a context, under the race detector when the tests use it, and stops
// it by cancelling the context.
func TestServeCommandInProcess(t *testing.T) {
	ready := filepath.Join(t.TempDir(), "ready")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	logs := &serveLogBuffer{}
	root := newRootCmd()
	root.SetArgs([]string{"serve", "--device", "sim", "--sim-capacity", "64GiB", "--listen", "127.0.0.1:0",
		"--ready-file", ready, "--synthetic", "--replay-rate", "0", "--log-level", "debug", "--conf", "max_split_size_mb:256"})
	root.SetErr(logs)
	root.SetOut(logs)
	exited := make(chan struct{})
	var runErr error
	go func() {
		defer close(exited)
		runErr = root.ExecuteContext(ctx)
	}()
	url := serveReadyAddr(t, ready, exited, logs)
	serveWaitFor(t, 30*time.Second, "device mallocs", func() bool {
		_, body := serveScrape(t, url+"/metrics")
		n, _ := serveSumMetric(body, "allocd_device_mallocs_total")
		return n > 0
	})
	cancel()
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("serve did not stop after its context was cancelled:\n%s", logs)
	}
	if runErr != nil {
		t.Fatalf("serve: %v\n%s", runErr, logs)
	}
	out := logs.String()
	if m := serveFindLog(out, "allocd serve starting"); m == nil || m["conf"] != "max_split_size_mb:256" {
		t.Errorf("start log %v does not carry the configuration", m)
	}
	if serveFindLog(out, "segment allocated") == nil {
		t.Error("no debug log of segment growth at --log-level debug")
	}
	if serveFindLog(out, "allocator closed: every segment returned to the device") == nil {
		t.Errorf("no clean close:\n%s", out)
	}
}

// TestRunServeSecondSignal drives runServe's signal channel directly: the
// second signal calls serveExit with 130.
func TestRunServeSecondSignal(t *testing.T) {
	codes := make(chan int, 1)
	old := serveExit
	serveExit = func(code int) { codes <- code }
	defer func() { serveExit = old }()
	ready := filepath.Join(t.TempDir(), "ready")
	sigs := make(chan os.Signal, 2)
	logs := &serveLogBuffer{}
	f := serveFlags{device: "sim", listen: "127.0.0.1:0", simCapacity: "1GiB", readyFile: ready, rate: 0,
		shutdownTimeout: 5 * time.Second, drainDelay: time.Minute, dev: true,
		maxConns: 64, writeTimeout: time.Minute, idleTimeout: time.Minute}
	exited := make(chan struct{})
	var runErr error
	go func() {
		defer close(exited)
		runErr = runServe(context.Background(), f, logs, sigs)
	}()
	serveReadyAddr(t, ready, exited, logs)
	sigs <- syscall.SIGTERM
	serveWaitFor(t, 10*time.Second, "the drain", func() bool { return strings.Contains(logs.String(), "draining") })
	sigs <- syscall.SIGINT
	select {
	case code := <-codes:
		if code != serveExitCode {
			t.Errorf("exit code %d, want %d", code, serveExitCode)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the second signal did not exit")
	}
	<-exited
	if runErr != nil {
		t.Error(runErr)
	}
	// --dev logs console lines, not JSON.
	if out := logs.String(); len(serveLogLines(out)) != 0 || !strings.Contains(out, "INFO") {
		t.Errorf("--dev output is not console lines:\n%s", out)
	}
}
