package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBenchCPUProfile: --cpuprofile writes a non-empty profile (gzip, as
// runtime/pprof writes it) of a run whose JSON carries the warm replay's
// figures; a file that cannot be created is an error naming the flag,
// before anything runs.
func TestBenchCPUProfile(t *testing.T) {
	prof := filepath.Join(t.TempDir(), "bench.prof")
	out, _, err := runCLI(t, "bench", "--device", "sim", "--no-pair", "--threads", "1", "--mixed-steps", "2000", "--json", "--cpuprofile", prof, demoTrace)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(prof)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b {
		t.Errorf("--cpuprofile wrote %d bytes, not a gzipped profile", len(b))
	}
	var rep struct {
		Replay []map[string]any `json:"replay"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Replay) != 1 {
		t.Fatalf("%d replay rows, want 1:\n%s", len(rep.Replay), out)
	}
	for _, k := range []string{"ns_per_op", "device_malloc_ns_per_op", "warm_ns_per_op", "warm_device_mallocs", "driver_ns_per_op"} {
		if _, ok := rep.Replay[0][k]; !ok {
			t.Errorf("replay row without %s: %v", k, rep.Replay[0])
		}
	}
	if m := rep.Replay[0]["warm_device_mallocs"]; m != 0.0 {
		t.Errorf("warm_device_mallocs %v on the simulated device, want 0", m)
	}
	_, _, err = runCLI(t, "bench", "--device", "sim", "--no-pair", "--threads", "1", "--mixed-steps", "1", "--cpuprofile", filepath.Join(t.TempDir(), "no", "such", "dir.prof"))
	if err == nil || !strings.Contains(err.Error(), "--cpuprofile") {
		t.Errorf("profile in a missing directory: %v, want an error naming --cpuprofile", err)
	}
}

// TestBenchTableWarmColumns: the table of bench's replays shows the warm
// and driver columns beside ns/op.
func TestBenchTableWarmColumns(t *testing.T) {
	out, _, err := runCLI(t, "bench", "--device", "sim", "--no-pair", "--no-mixed", demoTrace)
	if err != nil {
		t.Fatal(err)
	}
	header := strings.SplitN(out, "\n", 2)[0]
	for _, col := range []string{"ns/op", "device ns/op", "warm ns/op", "warm device mallocs", "driver ns/op"} {
		if !strings.Contains(header, col) {
			t.Errorf("no %q column in %q", col, header)
		}
	}
}
