package main

import (
	"bufio"
	"debug/elf"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/internal/envcases"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// abi is liballocd.so's C API: exactly these allocd_* symbols are exported.
//
// allocd_torch_malloc, allocd_torch_malloc_pool, allocd_torch_free and
// allocd_last_error are C (freequeue.c); the others are C functions of
// forkguard.c that call Go exports (exports.go, torchapi.go, pools.go).
var abi = []string{
	"allocd_init", "allocd_last_error",
	"allocd_torch_malloc", "allocd_torch_free", "allocd_torch_record_stream",
	"allocd_torch_empty_cache", "allocd_torch_set_memory_fraction", "allocd_release_stream",
	"allocd_memory_stats_json", "allocd_memory_summary",
	"allocd_memory_allocated", "allocd_memory_reserved",
	"allocd_max_memory_allocated", "allocd_max_memory_reserved",
	"allocd_reset_peak_stats", "allocd_record_history", "allocd_dump_snapshot",
	"allocd_metrics_address",
	"allocd_device_stats", "allocd_reset_accumulated_stats", "allocd_memory_fraction",
	"allocd_largest_free_block", "allocd_snapshot_flat",
	"allocd_torch_malloc_pool", "allocd_torch_create_pool", "allocd_torch_release_pool",
	"allocd_torch_begin_pool", "allocd_torch_end_pool", "allocd_torch_empty_pool_cache",
	"allocd_torch_pool_use_count", "allocd_torch_checkpoint_pool", "allocd_torch_checkpoint_free",
	"allocd_torch_restore_pool",
}

// goToolchainSymbol reports the dynamic symbols every cgo c-shared library
// exports: the runtime's C half and cgo's generated stubs (the
// _cgo_<hash>_Cfunc_* call stubs name the C function they call, but are
// Go's, not that function).
func goToolchainSymbol(name string) bool {
	for _, p := range []string{"_cgo_", "_cgoexp_", "x_cgo_", "crosscall", "x_crosscall"} {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return name == "fatalf"
}

var (
	buildOnce sync.Once
	builtLib  string
	buildErr  string
)

// buildLib builds liballocd.so once per test binary, into a directory
// removed when the tests end (TestMain). In -short mode the tests that
// need it skip: a c-shared build compiles the standard library and every
// dependency a second time (position-independent), a minute of two cores
// on a fresh build cache, longer than the rest of the short run's tests
// together.
func buildLib(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: building liballocd.so compiles the standard library a second time; go test ./cmd/liballocd runs these tests")
	}
	if runtime.GOOS != "linux" {
		t.Skip("the c-shared tests run on Linux")
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("gcc is absent: cannot build the c-shared library or the C driver")
	}
	buildOnce.Do(func() {
		out := filepath.Join(libDir, "liballocd.so")
		cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-buildmode=c-shared", "-o", out, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		if b, err := cmd.CombinedOutput(); err != nil {
			buildErr = err.Error() + "\n" + string(b)
			return
		}
		builtLib = out
	})
	if buildErr != "" {
		t.Fatalf("go build -buildmode=c-shared: %s", buildErr)
	}
	return builtLib
}

var libDir string

func TestMain(m *testing.M) {
	d, err := os.MkdirTemp("", "liballocd-test-")
	if err != nil {
		panic(err)
	}
	libDir = d
	code := m.Run()
	_ = os.RemoveAll(d)
	os.Exit(code)
}

// TestExportedSymbols checks liballocd.so's dynamic symbol table: the ABI's
// functions, all of them, and nothing else but the Go toolchain's own; in
// particular none of the cudart shim's C functions (allocd_malloc, ...),
// and none of the free queue's internals (freequeue.c's globals, the hidden
// Go functions it calls: liballocd_go_malloc, liballocd_go_free, ...). The
// ABI functions written in C (cFunctions) are functions too.
func TestExportedSymbols(t *testing.T) {
	f, err := elf.Open(buildLib(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	syms, err := f.DynamicSymbols()
	if err != nil {
		t.Fatal(err)
	}
	var ours []string
	for _, s := range syms {
		bind := elf.ST_BIND(s.Info)
		if s.Section == elf.SHN_UNDEF || bind != elf.STB_GLOBAL && bind != elf.STB_WEAK {
			continue
		}
		switch {
		case slices.Contains(abi, s.Name):
			ours = append(ours, s.Name)
			if elf.ST_TYPE(s.Info) != elf.STT_FUNC {
				t.Errorf("%s is exported as %v, not a function", s.Name, elf.ST_TYPE(s.Info))
			}
		case strings.HasPrefix(s.Name, "liballocd_"):
			t.Errorf("liballocd.so exports the internal %s", s.Name)
		case goToolchainSymbol(s.Name):
		default:
			t.Errorf("liballocd.so exports %s, which is neither the ABI's nor the Go toolchain's", s.Name)
		}
	}
	slices.Sort(ours)
	want := slices.Sorted(slices.Values(abi))
	if !slices.Equal(ours, want) {
		t.Errorf("exported API = %v\nwant %v", ours, want)
	}
}

// TestDriver runs testdata/driver.c, which dlopens liballocd.so and drives
// its API in its own process on two simulated devices of 1 GiB whose stream
// events stay pending until waited for. The driver checks malloc on two
// streams, free, record_stream (the freed block stays active and the next
// malloc on the allocating stream gets other memory; without record_stream
// it gets the same block), empty_cache, the stats JSON, the summary, peak
// reset, bad frees (unknown, double, another device's: counted, process
// alive, state unchanged), an OOM's NULL and message (per thread), the
// second init, and dump_snapshot; this test scrapes the metrics server (its
// debug pages in liballocd's formats: stats by device, a pickle snapshot) while
// the driver waits, then reads the snapshot back.
func TestDriver(t *testing.T) {
	lib := buildLib(t)
	dir := t.TempDir()
	driver := filepath.Join(dir, "driver")
	if b, err := exec.Command("gcc", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-o", driver, "testdata/driver.c", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("gcc driver.c: %v\n%s", err, b)
	}
	snap := filepath.Join(dir, "snapshot.pickle")
	cmd := exec.Command(driver, lib, snap)
	cmd.Env = append(os.Environ(), "ALLOCD_DEVICE=sim:2", "ALLOCD_SIM_CAPACITY=1GiB", "ALLOCD_SIM_MANUAL_EVENTS=1",
		"ALLOCD_CONF=", "ALLOCD_LOG_LEVEL=warn")
	cmd.Env = slices.DeleteFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, "ALLOCD_METRICS_LISTEN=") })
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(60*time.Second, func() { _ = cmd.Process.Kill() })
	defer timer.Stop()
	var out []string
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := sc.Text()
		out = append(out, line)
		if addr, ok := strings.CutPrefix(line, "METRICS "); ok {
			scrape(t, addr)
			_, _ = io.WriteString(stdin, "go\n")
		}
	}
	_ = stdin.Close()
	err = cmd.Wait()
	t.Logf("driver stdout:\n%s", strings.Join(out, "\n"))
	if err != nil || len(out) == 0 || out[len(out)-1] != "DONE" {
		t.Fatalf("driver: %v\nstderr:\n%s", err, stderr.String())
	}
	// The bad frees were logged, as JSON warnings.
	for _, want := range []string{`"msg":"bad free","reason":"unknown_pointer"`, `"reason":"double_free"`, `"reason":"wrong_device"`} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("stderr lacks %s:\n%s", want, stderr.String())
		}
	}
	s, err := trace.ReadFile(snap, trace.ReadOptions{})
	if err != nil {
		t.Fatalf("reading the dumped snapshot: %v", err)
	}
	devs := map[int]bool{}
	for _, seg := range s.Segments {
		devs[seg.Device] = true
	}
	if !devs[0] || !devs[1] || len(s.DeviceTraces) != 2 {
		t.Fatalf("snapshot: segments on devices %v, %d device traces; want devices 0 and 1, 2 traces", devs, len(s.DeviceTraces))
	}
	// The history switched on at run time holds device 0's alloc and free
	// of the 1 MiB block.
	var alloc, free int
	for _, e := range s.DeviceTraces[0] {
		switch e.Action {
		case snapshot.ActionAlloc:
			alloc++
		case snapshot.ActionFreeRequested:
			free++
		}
	}
	if alloc == 0 || free == 0 {
		t.Errorf("device 0's history: %d allocs, %d free_requested; want the recorded malloc and free", alloc, free)
	}
}

// scrape checks the driver's metrics server while the driver waits: one
// live 3 MiB allocation on device 1, a wrong-device free counted on 0. The
// driver freed a 1 MiB block of device 1 and an unknown pointer just before:
// queued frees, which the server applies before it reads.
func scrape(t *testing.T, addr string) {
	t.Helper()
	get := func(path string) string {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Errorf("GET %s: %v", path, err)
			return ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Errorf("GET %s: %s\n%s", path, resp.Status, b)
		}
		return string(b)
	}
	metrics := get("/metrics")
	for _, want := range []string{
		`allocd_bad_frees_total{gpu="0",reason="wrong_device"} 1`,
		`allocd_bad_frees_total{gpu="0",reason="double_free"} 1`,
		`allocd_bad_frees_total{gpu="0",reason="unknown_pointer"} 1`,
		`allocd_bad_frees_total{gpu="1",reason="wrong_device"} 0`,
		`allocd_bad_frees_total{gpu="1",reason="unknown_pointer"} 1`, // queued just before the scrape
		`allocd_allocated_bytes{UUID=`,
		`allocd_peak_allocated_bytes{UUID=`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if !strings.Contains(metrics, `gpu="1",pool="large"} 3.145728e+06`) {
		t.Errorf("/metrics does not show device 1's live 3 MiB:\n%s", grep(metrics, "allocd_allocated_bytes"))
	}
	if got := get("/healthz"); got != "ok\n" {
		t.Errorf("/healthz = %q", got)
	}
	var st map[string]map[string]int64
	if got := get("/debug/stats"); json.Unmarshal([]byte(got), &st) != nil || st["0"]["num_bad_frees"] != 3 || st["1"] == nil {
		t.Errorf("/debug/stats = %.300s; want device 0's map with num_bad_frees 3, and device 1's", got)
	}
	if got := get("/debug/summary"); strings.Count(got, "GPU reserved memory") != 2 {
		t.Errorf("/debug/summary has not two devices' tables:\n%s", got)
	}
	// The snapshot is PyTorch's pickle (protocol 2 and up start with
	// 0x80) unless ?format=json asks otherwise.
	snap := get("/debug/snapshot")
	if _, err := trace.Read(strings.NewReader(snap), trace.ReadOptions{}); err != nil || !strings.HasPrefix(snap, "\x80") {
		t.Errorf("/debug/snapshot: %v, starts %q; want a pickle", err, snap[:min(len(snap), 8)])
	}
	var js map[string]any
	if err := json.Unmarshal([]byte(get("/debug/snapshot?format=json")), &js); err != nil || js["segments"] == nil {
		t.Errorf("/debug/snapshot?format=json: %v", err)
	}
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestParseSimCapacity: ALLOCD_SIM_CAPACITY reads sizes as allocd's flags and
// allocator.Open do, fractions included.
func TestParseSimCapacity(t *testing.T) {
	for _, c := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"1GiB", 1 << 30, true},
		{"1.5GiB", 3 << 29, true},
		{"4096", 4096, true},
		{"0", 0, false},
		{"NaN", 0, false},
		{"lots", 0, false},
	} {
		s, err := parseSim(settings{device: "sim", simCapacity: c.in})
		if (err == nil) != c.ok || (c.ok && s.capacity != c.want) {
			t.Errorf("ALLOCD_SIM_CAPACITY=%q: capacity %d, err %v; want %d, ok %v", c.in, s.capacity, err, c.want, c.ok)
		}
	}
}

// TestEnvAgreesWithOpen runs the table every tool shares (package
// envcases) through liballocd's initialisation and through
// allocator.Open: both accept the same values with the same devices, and
// refuse the same ones with an error naming the variable.
func TestEnvAgreesWithOpen(t *testing.T) {
	t.Setenv("ALLOCD_CONF", "")
	for _, c := range envcases.Cases {
		t.Setenv("ALLOCD_DEVICE", c.Device)
		t.Setenv("ALLOCD_SIM_CAPACITY", c.SimCapacity)
		set := resolveSettings(nil, ptr(""), ptr("error"))
		l, libErr := newLib(set)
		a, openErr := allocator.Open(0)
		var openTotal uint64
		if a != nil {
			_, openTotal, _ = a.Device().MemGetInfo()
			a.Close()
		}
		if c.Err != "" {
			for _, err := range []error{libErr, openErr} {
				if !errors.Is(err, devspec.ErrEnv) || !strings.Contains(err.Error(), c.Err) {
					t.Errorf("%+v: liballocd %v, Open %v; want both an ErrEnv mentioning %q", c, libErr, openErr, c.Err)
				}
			}
			continue
		}
		if libErr != nil {
			t.Errorf("%+v: liballocd: %v", c, libErr)
			continue
		}
		want := c.Capacity
		if want == envcases.DefaultSimCapacity {
			want = devspec.DefaultSimCapacity
		}
		if l.sim.on != (c.Sims > 0) || (c.Sims > 0 && (l.sim.count != c.Sims || l.sim.capacity != want)) {
			t.Errorf("%+v: liballocd reads %+v", c, l.sim)
		}
		if (c.Sims > 0) != (openErr == nil) && !(c.Sims == 0 && a != nil) {
			t.Errorf("%+v: Open = %v, where liballocd reads %+v", c, openErr, l.sim)
		}
		if c.Sims > 0 && openTotal != l.sim.capacity {
			t.Errorf("%+v: Open's device has %d bytes, liballocd's %d", c, openTotal, l.sim.capacity)
		}
	}
}

// TestConfErrorNamesVariable: a bad ALLOCD_CONF, an unknown pinned_ key
// included (as pinned.ParseConfig and allocd serve refuse it), is an error
// naming the variable; a bad allocd_init conf names the argument.
func TestConfErrorNamesVariable(t *testing.T) {
	t.Setenv("ALLOCD_DEVICE", "sim")
	t.Setenv("ALLOCD_SIM_CAPACITY", "")
	for _, conf := range []string{"nonsense:1", "pinned_bogus:1", "max_split_size_mb:64,pinned_use_background_threads:True"} {
		t.Setenv("ALLOCD_CONF", conf)
		_, err := newLib(resolveSettings(nil, ptr(""), ptr("error")))
		if err == nil || !strings.Contains(err.Error(), "ALLOCD_CONF=") || !errors.Is(err, allocator.ErrConfig) {
			t.Errorf("ALLOCD_CONF=%q: %v; want an ErrConfig naming ALLOCD_CONF", conf, err)
		}
		_, err = newLib(resolveSettings(ptr(conf), ptr(""), ptr("error")))
		if err == nil || !strings.Contains(err.Error(), "allocd_init's conf") {
			t.Errorf("allocd_init conf %q: %v; want an error naming the argument", conf, err)
		}
	}
	// The same arguments from the environment and from allocd_init agree.
	t.Setenv("ALLOCD_CONF", "max_split_size_mb:64")
	if !sameArgs(resolveSettings(nil, nil, nil), resolveSettings(ptr("max_split_size_mb:64"), nil, nil)) {
		t.Errorf("the same conf from ALLOCD_CONF and allocd_init disagree")
	}
}

func ptr(s string) *string { return &s }

// TestBench builds testdata/bench.c and runs it briefly on the simulated
// device: a smoke test of the benchmark (its numbers are not checked), which
// also checks that every pair's free has been applied by the end.
func TestBench(t *testing.T) {
	lib := buildLib(t)
	bench := filepath.Join(t.TempDir(), "bench")
	if b, err := exec.Command("gcc", "-Wall", "-Wextra", "-Werror", "-O2", "-pthread", "-o", bench, "testdata/bench.c", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("gcc bench.c: %v\n%s", err, b)
	}
	cmd := exec.Command(bench, lib, "2000")
	cmd.Env = append(os.Environ(), "ALLOCD_DEVICE=sim", "ALLOCD_CONF=", "ALLOCD_SIM_CAPACITY=", "ALLOCD_SIM_MANUAL_EVENTS=")
	cmd.Env = slices.DeleteFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, "ALLOCD_METRICS_LISTEN=") })
	out, err := cmd.CombinedOutput()
	t.Logf("bench:\n%s", out)
	if err != nil || !strings.HasSuffix(string(out), "OK\n") {
		t.Fatalf("bench: %v", err)
	}
}

// TestFreeQueue runs testdata/queue.c, which checks the free queue through
// the C API: frees queued and then the stats read (exact at once); more
// frees in a row than the queue holds; bad frees through the queue (counted,
// logged, the freeing thread's last error); a malloc that reuses a block
// freed just before and a record_stream on it; 8 threads freeing 2400
// blocks at once and then a malloc that fits only if all of them have been
// applied; and fork while two threads malloc and free, the children's frees
// returning at once.
func TestFreeQueue(t *testing.T) {
	stderr := runCTest(t, "queue", "ALLOCD_DEVICE=sim", "ALLOCD_SIM_CAPACITY=1GiB", "ALLOCD_SIM_MANUAL_EVENTS=1",
		"ALLOCD_CONF=", "ALLOCD_LOG_LEVEL=warn")
	for _, want := range []string{`"reason":"unknown_pointer"`, `"reason":"double_free"`, `"ptr":"0xbad0080"`, `"ptr":"0xbad0103"`} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr lacks %s", want)
		}
	}
}

// TestReleaseStream runs testdata/stream.c, which checks
// allocd_release_stream: a released stream's cached segments go back to the
// device at once (the frees queued before applied first), or at the free of
// its last live block; its handle works again; the default stream and a
// device not created are no-ops, and device indexes outside 0..127 fail.
// It also checks the log line of the device's creation.
func TestReleaseStream(t *testing.T) {
	stderr := runCTest(t, "stream", "ALLOCD_DEVICE=sim:2", "ALLOCD_SIM_CAPACITY=1GiB", "ALLOCD_SIM_MANUAL_EVENTS=",
		"ALLOCD_CONF=", "ALLOCD_LOG_LEVEL=info")
	// The device's creation is logged with the configuration in force.
	if want := `"msg":"device allocator created","gpu":0,"conf":"defaults"`; !strings.Contains(stderr, want) {
		t.Errorf("stderr lacks %s:\n%s", want, stderr)
	}
}

// TestTorchAPI runs testdata/torchapi.c, which checks the exports
// allocd_torch's CUDAAllocator answers torch's own APIs with: the device
// statistics in c10's DeviceStats layout, the reset of accumulated totals,
// the memory fraction, the largest free block, the flat snapshot, and a
// free whose device the caller does not know.
func TestTorchAPI(t *testing.T) {
	runCTest(t, "torchapi", "ALLOCD_DEVICE=sim:2", "ALLOCD_SIM_CAPACITY=1GiB", "ALLOCD_SIM_MANUAL_EVENTS=",
		"ALLOCD_CONF=", "ALLOCD_LOG_LEVEL=warn")
}

// TestPools runs testdata/pools.c, which checks the private pool exports
// that allocd_torch's CUDAAllocator answers torch's CUDA graph and MemPool
// calls with: use counts (create, begin, release), refusals (no pool, a
// device not created or out of range, the general cache's (0, 0), a
// second end, a release of a capture's own use), malloc into a pool (its
// segments private and named by the flat snapshot, its freed blocks
// reused by it alone), a plain malloc during a capture staying in the
// general cache, empty_cache failing during a capture and keeping a
// pool's memory, a pool shared by two captures, a released pool's
// memory going back at the release and at the free of its last block, and
// a checkpoint restored (twice; refused on another device and during a
// capture).
func TestPools(t *testing.T) {
	runCTest(t, "pools", "ALLOCD_DEVICE=sim:2", "ALLOCD_SIM_CAPACITY=1GiB", "ALLOCD_SIM_MANUAL_EVENTS=",
		"ALLOCD_CONF=", "ALLOCD_LOG_LEVEL=error")
}

// TestFork runs testdata/fork.c: 20 forks while 4 threads are inside the
// library; in each child every export must return at once with an error
// naming the fork (a child has one thread of the Go runtime, which does not
// survive fork, so a call into Go there could wait for ever), and the
// parent's library works on.
func TestFork(t *testing.T) {
	lib := buildLib(t)
	prog := filepath.Join(t.TempDir(), "fork")
	if b, err := exec.Command("gcc", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-o", prog, "testdata/fork.c", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("gcc fork.c: %v\n%s", err, b)
	}
	cmd := exec.Command(prog, lib)
	cmd.Env = append(os.Environ(), "ALLOCD_DEVICE=sim", "ALLOCD_SIM_CAPACITY=1GiB", "ALLOCD_SIM_MANUAL_EVENTS=",
		"ALLOCD_CONF=", "ALLOCD_LOG_LEVEL=error")
	cmd.Env = slices.DeleteFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, "ALLOCD_METRICS_LISTEN=") })
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(90*time.Second, func() { _ = cmd.Process.Kill() })
	defer timer.Stop()
	err := cmd.Wait()
	t.Logf("fork stdout:\n%s", stdout.String())
	if err != nil || !strings.HasSuffix(stdout.String(), "DONE\n") {
		t.Fatalf("fork: %v\nstderr:\n%s", err, stderr.String())
	}
}

// runCTest builds testdata/NAME.c against liballocd, runs it with env added
// to the test's environment (ALLOCD_METRICS_LISTEN removed) for at most a
// minute, fails the test unless it exits 0 with "DONE" as its last line,
// and returns its stderr (liballocd's log lines).
func runCTest(t *testing.T, name string, env ...string) string {
	t.Helper()
	lib := buildLib(t)
	prog := filepath.Join(t.TempDir(), name)
	if b, err := exec.Command("gcc", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread", "-o", prog, "testdata/"+name+".c", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("gcc %s.c: %v\n%s", name, err, b)
	}
	cmd := exec.Command(prog, lib)
	cmd.Env = append(os.Environ(), env...)
	cmd.Env = slices.DeleteFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, "ALLOCD_METRICS_LISTEN=") })
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(60*time.Second, func() { _ = cmd.Process.Kill() })
	defer timer.Stop()
	err := cmd.Wait()
	t.Logf("%s stdout:\n%s", name, stdout.String())
	if err != nil || !strings.HasSuffix(stdout.String(), "DONE\n") {
		t.Fatalf("%s: %v\nstderr:\n%s", name, err, stderr.String())
	}
	return stderr.String()
}
