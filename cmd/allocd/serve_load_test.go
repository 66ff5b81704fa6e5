package main

import (
	"fmt"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/workload"
)

// serveTestTrace is the trace the serve tests replay.
const serveTestTrace = "../../testdata/traces/resnet50_train.pickle.gz"

func needServeTestTrace(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(serveTestTrace); err != nil {
		t.Fatalf("the serve tests replay %s: %v", serveTestTrace, err)
	}
}

func TestServeFlagErrors(t *testing.T) {
	for _, c := range []struct {
		f    serveFlags
		want string
	}{
		{serveFlags{device: "gpu", simCapacity: "1GiB"}, "--device"},
		{serveFlags{device: "sim", simCapacity: "lots"}, "--sim-capacity"},
		{serveFlags{device: "cuda", simCapacity: "1GiB", replay: "x"}, "simulated devices only"},
		{serveFlags{device: "cuda:1", simCapacity: "1GiB", synthetic: true}, "simulated devices only"},
		{serveFlags{device: "cuda:all", simCapacity: "1GiB", synthetic: true}, "simulated devices only"},
		{serveFlags{device: "sim:0", simCapacity: "1GiB"}, "1 to 64"},
		{serveFlags{device: "sim:65", simCapacity: "1GiB"}, "1 to 64"},
		{serveFlags{device: "cuda:some", simCapacity: "1GiB"}, "cuda:N"},
		{serveFlags{device: "sim", simCapacity: "1GiB", replay: "x", synthetic: true}, "exclusive"},
		{serveFlags{device: "sim", simCapacity: "1GiB", loop: true}, "--loop"},
		{serveFlags{device: "sim", simCapacity: "1GiB", rate: -1}, "--replay-rate"},
		{serveFlags{device: "sim", simCapacity: "1GiB", history: -1}, "--history"},
		{serveFlags{device: "sim", simCapacity: "NaN"}, "--sim-capacity"},
		{serveFlags{device: "sim", simCapacity: "1e-300GiB"}, "--sim-capacity"},
	} {
		if _, _, err := checkServeFlags(c.f); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("checkServeFlags(%+v) = %v, want an error about %s", c.f, err, c.want)
		}
	}
	if _, err := newServeWorkload(serveFlags{replay: "testdata/does-not-exist.pickle"}); err == nil || !strings.Contains(err.Error(), "--replay") {
		t.Errorf("newServeWorkload of a missing file = %v", err)
	}
	if _, err := newLoggerTo(os.Stderr, false, "verbose"); err == nil || !strings.Contains(err.Error(), "--log-level") {
		t.Errorf("newLoggerTo(verbose) = %v", err)
	}
}

// TestServeNumericFlagLimits: every float and user-sized integer flag of
// serve is range-checked, with an error naming the flag, the value and
// the accepted range; the limits themselves are accepted.
func TestServeNumericFlagLimits(t *testing.T) {
	base := func() serveFlags {
		return serveFlags{device: "sim", simCapacity: "1GiB", rate: 10000, shutdownTimeout: 10 * time.Second,
			maxConns: 64, writeTimeout: time.Minute, idleTimeout: time.Minute}
	}
	const rateRange = "--replay-rate %s: expected 0 (as fast as possible) or operations per second from 0.01 to 1e+09 (not NaN, Inf or subnormal)"
	for _, tc := range []struct {
		name string
		set  func(*serveFlags)
		want string
	}{
		{"rate NaN", func(f *serveFlags) { f.rate = math.NaN() }, fmt.Sprintf(rateRange, "NaN")},
		{"rate +Inf", func(f *serveFlags) { f.rate = math.Inf(1) }, fmt.Sprintf(rateRange, "+Inf")},
		{"rate -Inf", func(f *serveFlags) { f.rate = math.Inf(-1) }, fmt.Sprintf(rateRange, "-Inf")},
		{"rate 1e-300", func(f *serveFlags) { f.rate = 1e-300 }, fmt.Sprintf(rateRange, "1e-300")},
		{"rate subnormal", func(f *serveFlags) { f.rate = 5e-324 }, fmt.Sprintf(rateRange, "5e-324")},
		{"rate below the minimum", func(f *serveFlags) { f.rate = 0.009 }, fmt.Sprintf(rateRange, "0.009")},
		{"rate above the maximum", func(f *serveFlags) { f.rate = 1.5e9 }, fmt.Sprintf(rateRange, "1.5e+09")},
		{"rate negative", func(f *serveFlags) { f.rate = -1 }, fmt.Sprintf(rateRange, "-1")},
		{"history negative", func(f *serveFlags) { f.history = -1 }, "--history -1: expected a number of events from 0 (off) to 10000000"},
		{"history over the maximum", func(f *serveFlags) { f.history = maxServeHistory + 1 }, "--history 10000001: expected a number of events from 0 (off) to 10000000"},
		{"history huge", func(f *serveFlags) { f.history = 99999999999 }, "--history 99999999999"},
		{"shutdown timeout negative", func(f *serveFlags) { f.shutdownTimeout = -time.Second }, "--shutdown-timeout -1s: expected a duration from 0 to 1h0m0s"},
		{"shutdown timeout too long", func(f *serveFlags) { f.shutdownTimeout = 2 * time.Hour }, "--shutdown-timeout 2h0m0s"},
		{"drain delay negative", func(f *serveFlags) { f.drainDelay = -time.Nanosecond }, "--drain-delay -1ns"},
		{"drain delay too long", func(f *serveFlags) { f.drainDelay = 61 * time.Minute }, "--drain-delay 1h1m0s: expected a duration from 0 to 1h0m0s"},
		{"write timeout 0", func(f *serveFlags) { f.writeTimeout = 0 }, "--write-timeout 0s: expected a duration from 1s to 1h0m0s"},
		{"write timeout too long", func(f *serveFlags) { f.writeTimeout = 2 * time.Hour }, "--write-timeout 2h0m0s"},
		{"idle timeout below 1s", func(f *serveFlags) { f.idleTimeout = 999 * time.Millisecond }, "--idle-timeout 999ms: expected a duration from 1s to 1h0m0s"},
		{"idle timeout negative", func(f *serveFlags) { f.idleTimeout = -time.Second }, "--idle-timeout -1s"},
		{"max conns 0", func(f *serveFlags) { f.maxConns = 0 }, "--max-conns 0: expected a number of connections from 1 to 65536"},
		{"max conns negative", func(f *serveFlags) { f.maxConns = -1 }, "--max-conns -1"},
		{"max conns too many", func(f *serveFlags) { f.maxConns = maxServeConns + 1 }, "--max-conns 65537"},
	} {
		f := base()
		tc.set(&f)
		if _, _, err := checkServeFlags(f); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: checkServeFlags = %v, want %q", tc.name, err, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		set  func(*serveFlags)
	}{
		{"rate 0", func(f *serveFlags) { f.rate = 0 }},
		{"rate at the minimum", func(f *serveFlags) { f.rate = minReplayRate }},
		{"rate at the maximum", func(f *serveFlags) { f.rate = maxReplayRate }},
		{"history at the maximum", func(f *serveFlags) { f.history = maxServeHistory }},
		{"waits at the maximum", func(f *serveFlags) { f.shutdownTimeout, f.drainDelay = time.Hour, time.Hour }},
		{"waits 0", func(f *serveFlags) { f.shutdownTimeout, f.drainDelay = 0, 0 }},
		{"HTTP bounds at the minimum", func(f *serveFlags) { f.maxConns, f.writeTimeout, f.idleTimeout = 1, time.Second, time.Second }},
		{"HTTP bounds at the maximum", func(f *serveFlags) { f.maxConns, f.writeTimeout, f.idleTimeout = maxServeConns, time.Hour, time.Hour }},
	} {
		f := base()
		tc.set(&f)
		if _, _, err := checkServeFlags(f); err != nil {
			t.Errorf("%s: checkServeFlags = %v", tc.name, err)
		}
	}
	// The same checks through the command line, flag parsing included.
	for _, args := range [][]string{
		{"--replay-rate", "NaN"}, {"--replay-rate", "nan"}, {"--replay-rate", "1e-300"}, {"--replay-rate", "Inf"},
		{"--history", "99999999999"},
	} {
		_, _, err := runCLI(t, append([]string{"serve", "--device", "sim", "--listen", "127.0.0.1:0"}, args...)...)
		if err == nil || !strings.Contains(err.Error(), args[0]+" ") {
			t.Errorf("serve %v: %v, want an error naming %s", args, err, args[0])
		}
	}
}

// TestServeReplayDevice: for a replay, the simulated device has manual
// events and hands out the trace's recorded segment addresses.
func TestServeReplayDevice(t *testing.T) {
	needServeTestTrace(t)
	f := serveFlags{device: "sim", simCapacity: "141GiB", replay: serveTestTrace,
		maxConns: 64, writeTimeout: time.Minute, idleTimeout: time.Minute}
	spec, capacity, err := checkServeFlags(f)
	if err != nil {
		t.Fatal(err)
	}
	w, err := newServeWorkload(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Trace.Addresses) == 0 {
		t.Fatal("no segment addresses read from the trace")
	}
	devs, err := openServeDevices(spec, "--device", capacity, w, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer devspec.CloseAll(devs)
	dev := devs[0]
	sim := dev.(*simdev.Sim)
	if len(devs) != 1 || !sim.ManualEvents() {
		t.Errorf("replay devices: %d, manual events %v; want 1 with manual events", len(devs), sim.ManualEvents())
	}
	first := w.Trace.Addresses[0]
	if p, err := dev.Malloc(first.Size); err != nil || p != first.Addr {
		t.Errorf("first Malloc = %#x, %v; want the trace's %#x", uint64(p), err, uint64(first.Addr))
	}
	syn, err := openServeDevices(spec, "--device", capacity, &workload.Load{}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer devspec.CloseAll(syn)
	if syn[0].(*simdev.Sim).ManualEvents() {
		t.Error("synthetic workload's device has manual events")
	}

	// On sim:3 every device replays with manual events, and device i gets
	// the trace's addresses moved by i × SimDeviceSpan: no two devices
	// share one.
	spec3, _, err := checkServeFlags(serveFlags{device: "sim:3", simCapacity: "141GiB", replay: serveTestTrace,
		maxConns: 64, writeTimeout: time.Minute, idleTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	devs3, err := openServeDevices(spec3, "--device", capacity, w, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer devspec.CloseAll(devs3)
	if len(devs3) != 3 {
		t.Fatalf("sim:3 opened %d devices", len(devs3))
	}
	for i, dev := range devs3 {
		sim := dev.(*simdev.Sim)
		if dev.Info().Index != i || !sim.ManualEvents() {
			t.Errorf("device %d: index %d, manual events %v", i, dev.Info().Index, sim.ManualEvents())
		}
		want := first.Addr + cudart.Ptr(uint64(i)*devspec.SimDeviceSpan)
		if p, err := dev.Malloc(first.Size); err != nil || p != want {
			t.Errorf("device %d: first Malloc = %#x, %v; want %#x", i, uint64(p), err, uint64(want))
		}
	}
}
