package main

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
)

// clearAllocdEnv unsets the variables every tool reads, for the test.
func clearAllocdEnv(t *testing.T) {
	t.Helper()
	for _, v := range []string{"ALLOCD_DEVICE", "ALLOCD_SIM_CAPACITY", "ALLOCD_CONF"} {
		t.Setenv(v, "")
	}
}

// TestUsageOnWrongArguments: a run with wrong arguments says what was
// wrong and then prints the command's usage.
func TestUsageOnWrongArguments(t *testing.T) {
	clearAllocdEnv(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"replay"}, "replay needs at least one TRACE file"},
		{[]string{"replay", "--device", "sim"}, "replay needs at least one TRACE file"},
		{[]string{"bench", "--no-pair", "--no-mixed"}, "--no-pair and --no-mixed with no TRACE leave nothing to run"},
		{[]string{"serve", "extra"}, "unknown command \"extra\""},
		{[]string{"devices", "extra"}, "unknown command \"extra\""},
		{[]string{"replay", "--no-such-flag", demoTrace}, "unknown flag: --no-such-flag"},
		{[]string{"bench", "--pair-iters", "many"}, "--pair-iters"},
	} {
		_, _, err := runCLI(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Usage:\n  allocd "+tc.args[0]) {
			t.Errorf("allocd %v: %v; want %q and the usage", tc.args, err, tc.want)
		}
	}
}

// TestOutputPathsCheckedFirst: a bad output path fails before any work:
// here before the trace is even read (the trace does not exist, and the
// error is about the output path).
func TestOutputPathsCheckedFirst(t *testing.T) {
	clearAllocdEnv(t)
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"replay", "--device", "sim", "--svg", "/nonexistent/dir/x.svg", "no/such/trace"}, "--svg /nonexistent/dir/x.svg"},
		{[]string{"replay", "--device", "sim", "--svg", dir, "no/such/trace"}, "is a directory"},
		{[]string{"replay", "--device", "sim", "--snapshot-out", "/nonexistent/dir/x.pickle", "no/such/trace"}, "--snapshot-out /nonexistent/dir/x.pickle"},
		{[]string{"replay", "--device", "sim", "--svg", "/nonexistent/x.svg", "no/such/a", "no/such/b"}, "--svg /nonexistent/x-a.svg"},
		{[]string{"serve", "--device", "sim", "--listen", "127.0.0.1:0", "--ready-file", "/nonexistent/dir/ready", "--replay", "no/such/trace"}, "--ready-file /nonexistent/dir/ready"},
	} {
		_, _, err := runCLI(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("allocd %v: %v; want an error about %q", tc.args, err, tc.want)
		}
	}
	// A good path passes the check and is not left behind.
	if err := checkOutPath("--svg", dir+"/x.svg"); err != nil {
		t.Errorf("checkOutPath of a writable path: %v", err)
	}
	if err := checkOutPath("--svg", ""); err != nil {
		t.Errorf("checkOutPath of no path: %v", err)
	}
}

// TestServeListenCheckedFirst: a bad --listen fails before the trace is
// read and before any device opens.
func TestServeListenCheckedFirst(t *testing.T) {
	clearAllocdEnv(t)
	opened := fakeCUDA(t, 2, nil, -1)
	for _, args := range [][]string{
		{"serve", "--device", "cuda:all", "--listen", "nonsense"},
		{"serve", "--device", "sim", "--listen", "nonsense", "--replay", "no/such/trace"},
		{"serve", "--device", "cuda:all", "--listen", "127.0.0.1:99999"},
	} {
		_, _, err := runCLI(t, args...)
		if err == nil || !strings.Contains(err.Error(), "--listen") {
			t.Errorf("allocd %v: %v; want a --listen error", args, err)
		}
	}
	if len(*opened) != 0 {
		t.Errorf("%d devices opened before --listen was checked", len(*opened))
	}
}

// TestServeNoDriver: without a CUDA driver, serve fails with one short
// line that says how to get a simulated device; the driver's long story
// stays out of it.
func TestServeNoDriver(t *testing.T) {
	clearAllocdEnv(t)
	old := openCUDAIndex
	t.Cleanup(func() { openCUDAIndex = old })
	long := strings.Repeat("libcudart.so.12 (cannot open shared object file: No such file or directory), ", 20)
	openCUDAIndex = func(int) (cudart.Device, error) {
		return nil, fmt.Errorf("cudart: cannot load the CUDA runtime library; tried %s: %w", long, cudart.ErrNoDriver)
	}
	_, _, err := runCLI(t, "serve", "--listen", "127.0.0.1:0")
	if !errors.Is(err, cudart.ErrNoDriver) {
		t.Fatalf("serve without a driver: %v", err)
	}
	msg := err.Error()
	if strings.Contains(msg, "\n") || len(msg) > 300 || strings.Contains(msg, "cannot open shared object") ||
		!strings.Contains(msg, "--device sim") || !strings.Contains(msg, "ALLOCD_DEVICE=sim") {
		t.Errorf("serve without a driver says (%d characters): %s", len(msg), msg)
	}
}

// TestDeviceEnvInCLI: the allocd command reads ALLOCD_DEVICE and
// ALLOCD_SIM_CAPACITY as the library does when its flags are not given:
// serve honours ALLOCD_DEVICE=sim, replay sizes its simulated device by
// ALLOCD_SIM_CAPACITY, a bad value is an error naming the variable, and
// a flag given wins over the variable.
func TestDeviceEnvInCLI(t *testing.T) {
	clearAllocdEnv(t)
	t.Setenv("ALLOCD_DEVICE", "sim")
	t.Setenv("ALLOCD_SIM_CAPACITY", "2GiB")
	d := startServeInProcess(t)
	if m := serveFindLogWith(d.logs.String(), "device opened", "device_total_bytes", float64(2<<30)); m == nil {
		t.Errorf("ALLOCD_DEVICE=sim ALLOCD_SIM_CAPACITY=2GiB serve did not open a 2 GiB simulated device:\n%s", d.logs)
	}
	d.stop(t)

	_, stderr, err := runCLI(t, "replay", "--json=false", demoTrace)
	if err != nil || !strings.Contains(stderr, "simulated device, 2.00 GiB") {
		t.Errorf("replay under ALLOCD_DEVICE=sim ALLOCD_SIM_CAPACITY=2GiB: %v, stderr %q", err, stderr)
	}
	_, stderr, err = runCLI(t, "replay", "--sim-capacity", "3GiB", demoTrace)
	if err != nil || !strings.Contains(stderr, "simulated device, 3.00 GiB") {
		t.Errorf("--sim-capacity does not win over ALLOCD_SIM_CAPACITY: %v, stderr %q", err, stderr)
	}

	for _, tc := range []struct{ device, capacity, want string }{
		{"bogus", "", `ALLOCD_DEVICE="bogus"`},
		{"cuda:1", "", `ALLOCD_DEVICE="cuda:1"`},
		{"sim", "80 lots", `ALLOCD_SIM_CAPACITY="80 lots"`},
		{"sim", "8388608TiB", "8 EiB less one byte"},
	} {
		t.Setenv("ALLOCD_DEVICE", tc.device)
		t.Setenv("ALLOCD_SIM_CAPACITY", tc.capacity)
		for _, args := range [][]string{{"serve", "--listen", "127.0.0.1:0"}, {"replay", demoTrace}, {"bench", "--no-pair", "--threads", "1", "--mixed-steps", "1"}} {
			if _, _, err := runCLI(t, args...); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ALLOCD_DEVICE=%q ALLOCD_SIM_CAPACITY=%q allocd %v: %v; want %s", tc.device, tc.capacity, args, err, tc.want)
			}
		}
	}
	// Flags given: the variables they override are not read.
	t.Setenv("ALLOCD_DEVICE", "bogus")
	t.Setenv("ALLOCD_SIM_CAPACITY", "lots")
	if _, _, err := runCLI(t, "replay", "--device", "sim", "--sim-capacity", "1GiB", demoTrace); err != nil {
		t.Errorf("flags given, bad variables: %v", err)
	}
}

// TestSimCapacityLimit: --sim-capacity's stated range and its check agree:
// the largest int64 is accepted, 2^63 (8388608TiB) refused with the real
// limit.
func TestSimCapacityLimit(t *testing.T) {
	f := serveFlags{device: "sim", simCapacity: "9223372036854775807", shutdownTimeout: 1,
		maxConns: 64, writeTimeout: time.Minute, idleTimeout: time.Minute}
	if _, c, err := checkServeFlags(f); err != nil || c != 1<<63-1 {
		t.Errorf("--sim-capacity 9223372036854775807: %d, %v", c, err)
	}
	f.simCapacity = "8388608TiB"
	if _, _, err := checkServeFlags(f); err == nil || !strings.Contains(err.Error(), "9223372036854775807 (8 EiB less one byte)") {
		t.Errorf("--sim-capacity 8388608TiB: %v", err)
	}
}

// TestConfErrorsNameTheSource: a bad configuration names where it came
// from, --conf or ALLOCD_CONF, in every command; an unknown pinned_ key
// is refused as pinned.ParseConfig refuses it.
func TestConfErrorsNameTheSource(t *testing.T) {
	clearAllocdEnv(t)
	cmds := [][]string{
		{"serve", "--device", "sim", "--listen", "127.0.0.1:0"},
		{"replay", "--device", "sim", demoTrace},
		{"bench", "--device", "sim", "--no-pair", "--threads", "1", "--mixed-steps", "1"},
	}
	for _, conf := range []string{"nonsense:1", "pinned_bogus:1"} {
		for _, args := range cmds {
			t.Setenv("ALLOCD_CONF", conf)
			want := fmt.Sprintf("ALLOCD_CONF=%q", conf)
			if _, _, err := runCLI(t, args...); err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("ALLOCD_CONF=%s allocd %v: %v; want %s", conf, args, err, want)
			}
			t.Setenv("ALLOCD_CONF", "")
			want = fmt.Sprintf("--conf %q", conf)
			if _, _, err := runCLI(t, append(args, "--conf", conf)...); err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("allocd %v --conf %s: %v; want %s", args, conf, err, want)
			}
		}
	}
}

// TestServeLogsEffectiveConf: serve's start line gives the configuration
// in force and where it came from, "defaults" when none is set.
func TestServeLogsEffectiveConf(t *testing.T) {
	clearAllocdEnv(t)
	d := startServeInProcess(t, "--device", "sim", "--sim-capacity", "1GiB")
	if serveFindLogWith(d.logs.String(), "allocd serve starting", "conf", "defaults") == nil {
		t.Errorf("no start line with conf defaults:\n%s", d.logs)
	}
	d.stop(t)
	t.Setenv("ALLOCD_CONF", "max_split_size_mb:64")
	d = startServeInProcess(t, "--device", "sim", "--sim-capacity", "1GiB")
	if serveFindLogWith(d.logs.String(), "allocd serve starting", "conf", "max_split_size_mb:64") == nil ||
		serveFindLogWith(d.logs.String(), "allocd serve starting", "conf_from", "ALLOCD_CONF") == nil {
		t.Errorf("no start line with the ALLOCD_CONF configuration:\n%s", d.logs)
	}
	d.stop(t)
}

// TestReplayNoDriver: replay and bench on --device cuda without a driver
// fail with one short line that says how to use the simulated device.
// (On a machine with a driver they run, and there is nothing to check.)
func TestReplayNoDriver(t *testing.T) {
	clearAllocdEnv(t)
	for _, args := range [][]string{
		{"replay", "--device", "cuda", demoTrace},
		{"bench", "--device", "cuda", "--no-pair", "--threads", "1", "--mixed-steps", "1"},
	} {
		_, _, err := runCLI(t, args...)
		if err == nil {
			t.Skip("a CUDA driver is present")
		}
		msg := err.Error()
		if !errors.Is(err, cudart.ErrNoDriver) || strings.Contains(msg, "\n") || len(msg) > 300 || !strings.Contains(msg, "--device sim") {
			t.Errorf("allocd %v without a driver says (%d characters): %s", args, len(msg), msg)
		}
	}
}
