package stats

import (
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/allocd/allocd/pinned"
	"github.com/allocd/allocd/simdev"
)

func newPinned(t *testing.T) (*pinned.Allocator, *simdev.Sim) {
	t.Helper()
	dev, err := simdev.New(simdev.Config{Capacity: 1 << 30, Backed: true, ManualEvents: true, Index: 3})
	if err != nil {
		t.Fatal(err)
	}
	a, err := pinned.New(dev, pinned.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	return a, dev
}

func TestPinnedCollector(t *testing.T) {
	a, dev := newPinned(t)
	s, _ := dev.StreamCreate()
	b1, _ := a.Alloc(3 << 20) // 4 MiB class
	b2, _ := a.Alloc(1000)
	_ = a.RecordStream(b2, s)
	_ = a.Free(b2) // pending
	gone, _ := dev.StreamCreate()
	b3, _ := a.Alloc(100)
	_ = a.RecordStream(b3, gone)
	_ = dev.StreamDestroy(gone)
	_ = a.Free(b3) // a device synchronisation
	c, err := NewPinnedCollector(a)
	if err != nil {
		t.Fatal(err)
	}
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	if n := testutil.CollectAndCount(c); n != len(pinnedMetrics) {
		t.Errorf("%d series, want %d", n, len(pinnedMetrics))
	}
	want := `
# HELP allocd_pinned_allocated_bytes Bytes of pinned host blocks in use: handed out, or freed and awaiting a stream's event (class sizes).
# TYPE allocd_pinned_allocated_bytes gauge
allocd_pinned_allocated_bytes{UUID="SIM-00000003-0000-0000-0000-000000000000",gpu="3"} 4.195328e+06
# HELP allocd_pinned_pending_events Events recorded at Free on streams that used a pinned block, not yet seen complete.
# TYPE allocd_pinned_pending_events gauge
allocd_pinned_pending_events{UUID="SIM-00000003-0000-0000-0000-000000000000",gpu="3"} 1
# HELP allocd_pinned_host_allocs_total cudaHostAlloc calls that returned memory: requests the cache could not serve.
# TYPE allocd_pinned_host_allocs_total counter
allocd_pinned_host_allocs_total{UUID="SIM-00000003-0000-0000-0000-000000000000",gpu="3"} 3
# HELP allocd_pinned_device_syncs_total Device synchronisations made in place of stream events: a stream destroyed before Free, or an event whose query failed.
# TYPE allocd_pinned_device_syncs_total counter
allocd_pinned_device_syncs_total{UUID="SIM-00000003-0000-0000-0000-000000000000",gpu="3"} 1
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "allocd_pinned_allocated_bytes", "allocd_pinned_pending_events", "allocd_pinned_host_allocs_total", "allocd_pinned_device_syncs_total"); err != nil {
		t.Error(err)
	}
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	if _, err := NewPinnedCollector(a, a); err == nil {
		t.Error("two sources for one device accepted")
	}
	if _, err := NewPinnedCollector(); err == nil {
		t.Error("no sources accepted")
	}
	_ = a.Free(b1)
}

func TestPinnedMetricsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range PinnedMetrics() {
		row := "| `" + m.Name + "` | " + m.Type + " | " + strings.Join(m.Labels, ", ") + " |"
		if !strings.Contains(string(doc), row) {
			t.Errorf("docs/metrics.md has no row starting %q", row)
		}
	}
}

func TestPinnedSummary(t *testing.T) {
	a, _ := newPinned(t)
	b, _ := a.Alloc(5 << 20)
	out := PinnedSummary(a.Stats(), 0)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != 15 {
		t.Errorf("%d lines, want 15:\n%s", len(lines), out)
	}
	for i, l := range lines {
		if len(l) != summaryWidth+2 || l[0] != '|' || l[len(l)-1] != '|' {
			t.Errorf("line %d is %d wide: %q", i, len(l), l)
		}
	}
	for _, want := range []string{"| Pinned allocated      |   8192 KiB |   8192 KiB |   8192 KiB |      0 B   |", "cudaHostAlloc calls: 1 ", "device ID 0"} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	_ = a.Free(b)
}
