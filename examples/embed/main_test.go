package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// TestEmbedRuns builds the example and runs it as a user would, on a
// simulated device asked for with ALLOCD_DEVICE=sim: it says which device
// it used, meets its OOM, serves and scrapes its own /metrics (the OOM
// counted there), writes a snapshot that trace.ReadFile reads back with
// the history of its allocations and their Go call sites, and closes.
func TestEmbedRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the example")
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("no go tool to build the example: %v", err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "embed")
	if out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	snapPath := filepath.Join(dir, "embed.pickle")
	cmd := exec.Command(bin, "-listen", "127.0.0.1:0", "-snapshot", snapPath, "-seconds", "0")
	cmd.Env = append(os.Environ(), "ALLOCD_DEVICE=sim", "ALLOCD_SIM_CAPACITY=4GiB", "ALLOCD_CONF=max_split_size_mb:256")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	done := make(chan struct{})
	var out []byte
	go func() {
		out, err = cmd.Output()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("the example did not end by itself within 2 minutes:\n%s", out)
	}
	if err != nil {
		t.Fatalf("the example failed: %v\nstdout:\n%s\nstderr:\n%s", err, out, stderr.String())
	}
	got := string(out)
	for _, want := range []*regexp.Regexp{
		regexp.MustCompile(`(?m)^device: simulated device 0 \(sim, 4\.00 GiB, asked for by ALLOCD_DEVICE=sim\)$`),
		regexp.MustCompile(`(?m)^config: max_split_size_mb:256$`),
		regexp.MustCompile(`(?m)^out of memory, as expected: requested 8\.00 GiB of 4\.00 GiB \(num_ooms 1\)$`),
		regexp.MustCompile(`(?m)^serving: http://127\.0\.0\.1:\d+/metrics `),
		regexp.MustCompile(`(?m)^metric: allocd_ooms_total\{[^}]*gpu="0"[^}]*\} 1$`),
		regexp.MustCompile(`(?m)^metric: allocd_reserved_bytes\{[^}]*pool="large"[^}]*\} 6\.7108864e\+07$`),
		regexp.MustCompile(`(?m)^closed: 2 segments returned to the device, 0 B still reserved$`),
	} {
		if !want.MatchString(got) {
			t.Errorf("output lacks %s:\n%s", want, got)
		}
	}
	snap, err := trace.ReadFile(snapPath, trace.ReadOptions{Frames: true})
	if err != nil {
		t.Fatalf("reading the snapshot back: %v", err)
	}
	if len(snap.Segments) != 2 || len(snap.DeviceTraces) != 1 {
		t.Fatalf("snapshot: %d segments, %d device traces; want 2 and 1", len(snap.Segments), len(snap.DeviceTraces))
	}
	actions := map[snapshot.Action]int{}
	withMain := 0
	for _, e := range snap.DeviceTraces[0] {
		actions[e.Action]++
		for _, f := range e.Frames {
			if strings.HasSuffix(f.Filename, "embed/main.go") {
				withMain++
				break
			}
		}
	}
	if actions[snapshot.ActionAlloc] < 2 || actions[snapshot.ActionOOM] != 1 || actions[snapshot.ActionFreeRequested] < 1 {
		t.Errorf("snapshot history %v; want both allocations, the free and the OOM", actions)
	}
	if withMain == 0 {
		t.Error("no history entry names a call site in examples/embed/main.go")
	}
}

// TestDocMatchesExample: every line of Go code in docs/embedding.md, which
// walks through this program, is a line of it (comments aside), so that
// the page shows the code CI runs.
func TestDocMatchesExample(t *testing.T) {
	doc, err := os.ReadFile("../../docs/embedding.md")
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, l := range strings.Split(string(src), "\n") {
		lines = append(lines, strings.TrimSpace(l))
	}
	inProgram := func(l string) bool {
		for _, m := range lines {
			if m == l || strings.HasPrefix(m, l+" //") {
				return true
			}
		}
		return false
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(doc), -1)
	if len(blocks) < 7 {
		t.Fatalf("%d Go blocks in docs/embedding.md, want one per step (7)", len(blocks))
	}
	for _, b := range blocks {
		for _, l := range strings.Split(b[1], "\n") {
			l = strings.TrimSpace(l)
			if l == "" || strings.HasPrefix(l, "//") {
				continue
			}
			if !inProgram(l) {
				t.Errorf("docs/embedding.md shows a line examples/embed/main.go lacks: %s", l)
			}
		}
	}
}
