package main

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/allocd/allocd/trace"
)

const demoTrace = "../../testdata/traces/resnet50_train.pickle.gz"

// runCLI runs the allocd command line in-process.
func runCLI(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	var out, errb bytes.Buffer
	root := newRootCmd()
	root.SetOut(&out)
	root.SetErr(&errb)
	root.SetArgs(args)
	err = root.Execute()
	return out.String(), errb.String(), err
}

func TestReplayJSONFields(t *testing.T) {
	out, _, err := runCLI(t, "replay", "--device", "sim", "--json", "--conf", "", "--conf", "max_split_size_mb:128", demoTrace)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 {
		t.Fatalf("want one JSON line per configuration, got %d:\n%s", len(lines), out)
	}
	want := []string{"alloc_retries", "conf", "device_frees", "device_malloc_ns_per_op", "device_mallocs", "ns_per_op", "ooms", "ops",
		"peak_allocated_bytes", "peak_requested_bytes", "peak_reserved_bytes", "trace"}
	for _, line := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatal(err)
		}
		var keys []string
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		if strings.Join(keys, ",") != strings.Join(want, ",") {
			t.Errorf("fields %v, want exactly %v", keys, want)
		}
		if m["trace"] != "resnet50_train.pickle.gz" || m["peak_reserved_bytes"].(float64) != 3622<<20 && m["conf"] == "" {
			t.Errorf("unexpected row %v", m)
		}
	}
}

func TestReplayTableMarksBest(t *testing.T) {
	out, errOut, err := runCLI(t, "replay", "--device", "sim", "--conf", "", "--conf", "max_split_size_mb:128", demoTrace)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(errOut, "simulated device") {
		t.Errorf("stderr does not say which device: %q", errOut)
	}
	if strings.Count(out, "*") != 1 || !strings.Contains(out, "peak reserved MiB") {
		t.Errorf("table without exactly one best mark:\n%s", out)
	}
}

// svgDoc is the part of the chart the test reads back.
type svgDoc struct {
	XMLName   xml.Name `xml:"svg"`
	Polylines []struct {
		Config string `xml:"data-config,attr"`
		Series string `xml:"data-series,attr"`
		Points string `xml:"points,attr"`
	} `xml:"polyline"`
}

func TestReplaySVG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "chart.svg")
	confs := []string{"", "max_split_size_mb:128", "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9"}
	args := []string{"replay", "--device", "sim", "--svg", path}
	for _, c := range confs {
		args = append(args, "--conf", c)
	}
	if _, _, err := runCLI(t, append(args, demoTrace)...); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var doc svgDoc
	dec := xml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		t.Fatalf("chart is not well-formed XML: %v", err)
	}
	perConf := map[string]map[string]int{}
	for _, p := range doc.Polylines {
		if perConf[p.Config] == nil {
			perConf[p.Config] = map[string]int{}
		}
		perConf[p.Config][p.Series] = len(strings.Fields(p.Points))
	}
	for _, c := range confs {
		for _, s := range []string{"allocated", "reserved", "requested"} {
			if n := perConf[c][s]; n < 100 {
				t.Errorf("config %q series %s has %d points", c, s, n)
			}
		}
	}
	if len(perConf) != len(confs) {
		t.Errorf("series for %d configurations, want %d", len(perConf), len(confs))
	}
}

func TestReplaySnapshotOut(t *testing.T) {
	path := filepath.Join(t.TempDir(), "peak.pickle")
	if _, _, err := runCLI(t, "replay", "--device", "sim", "--snapshot-out", path, demoTrace); err != nil {
		t.Fatal(err)
	}
	snap, err := trace.ReadFile(path, trace.ReadOptions{})
	if err != nil {
		t.Fatalf("our own reader rejects the snapshot: %v", err)
	}
	var reserved uint64
	for _, s := range snap.Segments {
		reserved += s.TotalSize
	}
	if reserved != 3622<<20 {
		t.Errorf("snapshot holds %d MiB of segments, want the peak of 3622 MiB", reserved>>20)
	}
	if len(snap.DeviceTraces) != 1 || len(snap.DeviceTraces[0]) == 0 {
		t.Fatalf("snapshot has no history")
	}
}

func TestReplayBadInput(t *testing.T) {
	notSnapshot := filepath.Join(t.TempDir(), "x.pickle")
	if err := os.WriteFile(notSnapshot, []byte("hello, not a pickle"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"missing file", []string{"replay", "--device", "sim", "no/such/file.pickle"}, "no such file"},
		{"not a snapshot", []string{"replay", "--device", "sim", notSnapshot}, "not a memory snapshot"},
		{"bad conf", []string{"replay", "--device", "sim", "--conf", "max_split_size_mb:1", demoTrace}, "max_split_size_mb"},
		{"bad device", []string{"replay", "--device", "tpu", demoTrace}, "--device"},
		{"several devices", []string{"replay", "--device", "sim:2", demoTrace}, "sim:N and cuda:all are for allocd serve"},
		{"every GPU", []string{"replay", "--device", "cuda:all", demoTrace}, "sim:N and cuda:all are for allocd serve"},
		{"bad capacity", []string{"replay", "--device", "sim", "--sim-capacity", "lots", demoTrace}, "--sim-capacity"},
		{"no trace", []string{"replay"}, "replay needs at least one TRACE file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := runCLI(t, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one mentioning %q", err, tc.want)
			}
		})
	}
}

// TestBenchFlagErrors: bench's counts are range-checked before anything
// runs, with errors naming the flag and the range.
func TestBenchFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--pair-iters", "0"}, "--pair-iters 0: expected a count from 1 to 1000000000"},
		{[]string{"--pair-iters", "-5"}, "--pair-iters -5"},
		{[]string{"--pair-iters", "99999999999"}, "--pair-iters 99999999999"},
		{[]string{"--mixed-steps", "0"}, "--mixed-steps 0: expected a count from 1 to 1000000000"},
		{[]string{"--threads", "0"}, "--threads 0: expected goroutine counts from 1 to 4096"},
		{[]string{"--threads", "1,4097"}, "--threads 4097"},
		{[]string{"--threads", "-1"}, "--threads -1"},
		{[]string{"--sim-capacity", "NaN"}, "--sim-capacity"},
	} {
		_, _, err := runCLI(t, append([]string{"bench", "--device", "sim", "--no-pair"}, tc.args...)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("bench %v: %v, want an error saying %q", tc.args, err, tc.want)
		}
	}
	for _, f := range []benchFlags{
		{pairIters: 1, mixedSteps: 1, threads: []int{1, 4096}},
		{pairIters: maxBenchCount, mixedSteps: maxBenchCount, skipMixed: true},
	} {
		if err := checkBenchFlags(f); err != nil {
			t.Errorf("checkBenchFlags(%+v): %v", f, err)
		}
	}
	if err := checkBenchFlags(benchFlags{pairIters: 1, mixedSteps: 1}); err == nil {
		t.Error("no --threads and the mixed benchmark on: accepted")
	}
}

func TestOutName(t *testing.T) {
	if got := outName("c.svg", "x/gpt2_train.pickle.gz", 2); got != "c-gpt2_train.svg" {
		t.Errorf("outName = %q", got)
	}
	if got := outName("c.svg", "x/gpt2_train.pickle.gz", 1); got != "c.svg" {
		t.Errorf("outName = %q", got)
	}
}

// TestNoProgressBarWhenPiped: the progress bar needs a terminal; a buffer
// or a pipe is not one, so --json and piped runs print no bar.
func TestNoProgressBarWhenPiped(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if isTerminal(w) || isTerminal(&bytes.Buffer{}) {
		t.Fatal("a pipe or a buffer was taken for a terminal")
	}
	_, errOut, err := runCLI(t, "replay", "--device", "sim", demoTrace)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(errOut, "\r") || strings.Contains(errOut, "█") {
		t.Errorf("progress output on a non-terminal stderr: %q", errOut)
	}
}

// TestReplayPyTorchExpandable: with --pytorch-expandable, an expandable
// replay of vit_b16_train reproduces PyTorch's expandable_segments:True
// peaks byte for byte (testdata/traces/README.md); without it, allocd's
// reclaim reserves no more (on this trace, which hardly fragments, the
// same: its growth ends on the 20 MiB boundaries PyTorch's pages end on),
// and its rows count what it did instead of growing (reclaims, small
// requests served from the large pool).
func TestReplayPyTorchExpandable(t *testing.T) {
	const vit = "../../testdata/traces/vit_b16_train.pickle.gz"
	row := func(args ...string) map[string]any {
		t.Helper()
		out, _, err := runCLI(t, append([]string{"replay", "--device", "sim", "--json", "--conf", "expandable_segments:True"}, append(args, vit)...)...)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(out), &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	exact, ours := row("--pytorch-expandable"), row()
	if a, r := exact["peak_allocated_bytes"].(float64), exact["peak_reserved_bytes"].(float64); a != 3544567808 || r != 3659530240 {
		t.Errorf("--pytorch-expandable: peak allocated %.0f, reserved %.0f; PyTorch's: 3544567808, 3659530240", a, r)
	}
	if exact["pytorch_expandable"] != true || exact["reclaims"] != nil {
		t.Errorf("--pytorch-expandable row: pytorch_expandable %v, reclaims %v; want true, none", exact["pytorch_expandable"], exact["reclaims"])
	}
	if r := ours["peak_reserved_bytes"].(float64); r > 3659530240 {
		t.Errorf("allocd's reclaim: peak reserved %.0f, above PyTorch's 3659530240", r)
	}
	if ours["pytorch_expandable"] != nil || (ours["reclaims"] == nil && ours["small_from_large"] == nil) {
		t.Errorf("default row: pytorch_expandable %v, reclaims %v, small_from_large %v; want none, and some of either",
			ours["pytorch_expandable"], ours["reclaims"], ours["small_from_large"])
	}
}
