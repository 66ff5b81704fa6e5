package stats

import (
	"bufio"
	"encoding/json"
	"net/http/httptest"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/allocd/allocd/internal/scrapefile"
)

// TestMetricsDocumented checks that docs/metrics.md describes every metric
// the Collector exports, with its type and labels.
func TestMetricsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range Metrics() {
		row := "| `" + m.Name + "` | " + m.Type + " | " + strings.Join(m.Labels, ", ") + " |"
		if !strings.Contains(string(doc), row) {
			t.Errorf("docs/metrics.md has no row starting %q", row)
		}
	}
}

// TestDashboardUsesExportedMetrics checks that every allocd metric the
// Grafana dashboard queries is one the Collector exports.
func TestDashboardUsesExportedMetrics(t *testing.T) {
	b, err := os.ReadFile("../docs/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	type panel struct {
		Title   string
		Targets []struct{ Expr string }
	}
	var dash struct {
		Panels []struct {
			panel
			Panels []panel // a collapsed row's
		}
		Templating struct {
			List []struct{ Name string }
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, m := range Metrics() {
		known[m.Name] = true
		if m.Type == "histogram" {
			known[m.Name+"_bucket"] = true
		}
	}
	// The broker's metrics, as a real scrape records them (the broker's
	// TestDeployBrokerScrape keeps the file so).
	rec, err := os.ReadFile("../deploy/testdata/broker.prom")
	if err != nil {
		t.Fatal(err)
	}
	fams, err := scrapefile.Families(rec)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		known[f] = true
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			known[f+suffix] = true
		}
	}
	var panels []panel
	for _, p := range dash.Panels {
		panels = append(panels, p.panel)
		panels = append(panels, p.Panels...)
	}
	name := regexp.MustCompile(`allocd_[a-z_]+`)
	n := 0
	for _, p := range panels {
		for _, tg := range p.Targets {
			for _, used := range name.FindAllString(tg.Expr, -1) {
				n++
				if !known[used] {
					t.Errorf("panel %q queries %s, which is not exported", p.Title, used)
				}
			}
		}
	}
	if n == 0 {
		t.Error("the dashboard queries no allocd metric")
	}
	hasGPU := false
	for _, v := range dash.Templating.List {
		hasGPU = hasGPU || v.Name == "gpu"
	}
	if !hasGPU {
		t.Error("the dashboard has no gpu variable")
	}
}

// scrapeSamples serves c on a registry of its own through promhttp, as
// /metrics does, scrapes it once and returns the number of samples, and
// of those the ones of the histogram family hist.
func scrapeSamples(t *testing.T, c prometheus.Collector, hist string) (all, histogram int) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	w := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(w, httptest.NewRequest("GET", "/metrics", nil))
	if w.Code != 200 {
		t.Fatalf("scrape: status %d: %s", w.Code, w.Body)
	}
	sc := bufio.NewScanner(w.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		all++
		if hist != "" && strings.HasPrefix(line, hist+"_") {
			histogram++
		}
	}
	return all, histogram
}

// docNumber returns the number pattern's one group matches in
// docs/metrics.md.
func docNumber(t *testing.T, pattern string) int {
	t.Helper()
	doc, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(pattern).FindSubmatch(doc)
	if m == nil {
		t.Fatalf("docs/metrics.md has no match for %q", pattern)
	}
	n, err := strconv.Atoi(string(m[1]))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestSeriesCountDocumented scrapes one GPU's collector and one pinned
// allocator's, and checks the series counts docs/metrics.md gives.
func TestSeriesCountDocumented(t *testing.T) {
	all, hist := scrapeSamples(t, newCollector(t, scripted(t)), "allocd_device_malloc_duration_seconds")
	if want := docNumber(t, `(\d+) series per GPU, plus`); all-hist != want {
		t.Errorf("a scrape of one GPU has %d series besides the histogram's; docs/metrics.md says %d", all-hist, want)
	}
	if want := docNumber(t, `plus the histogram's (\d+) samples`); hist != want {
		t.Errorf("a scrape of one GPU has %d histogram samples; docs/metrics.md says %d", hist, want)
	}
	a, _ := newPinned(t)
	pc, err := NewPinnedCollector(a)
	if err != nil {
		t.Fatal(err)
	}
	if all, _ := scrapeSamples(t, pc, ""); all != docNumber(t, `(\d+) series per pinned\s+allocator`) {
		t.Errorf("a scrape of one pinned allocator has %d series; docs/metrics.md says %d", all, docNumber(t, `(\d+) series per pinned\s+allocator`))
	}
}
