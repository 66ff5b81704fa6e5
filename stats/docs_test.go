package stats

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
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
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
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
	name := regexp.MustCompile(`allocd_[a-z_]+`)
	n := 0
	for _, p := range dash.Panels {
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
