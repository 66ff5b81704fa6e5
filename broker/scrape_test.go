package broker_test

import (
	"flag"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/brokertest"
	"github.com/allocd/allocd/internal/scrapefile"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/stats"
)

var updateScrape = flag.Bool("update-scrape", false, "record deploy/testdata/broker.prom from a real scrape")

// brokerRegistry returns a registry over a broker that has granted,
// refused, returned and zeroed, as `allocd serve --broker` registers it
// (less the Go and process collectors).
func brokerRegistry(t *testing.T) *prometheus.Registry {
	t.Helper()
	sim, err := simdev.New(simdev.Config{Capacity: 64 << 20, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sim.Close() })
	srv := brokertest.Serve(t, []cudart.Device{sim}, "tenants:\n  - name: training\n    quota: 8MiB\n  - name: inference\n")
	b := srv.B
	tr, inf := srv.Dial(t, "training"), srv.Dial(t, "inference")
	ch, err := tr.Grant(0, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	if _, err := tr.Grant(0, 2<<20); err == nil {
		t.Fatal("grant over the quota")
	}
	tr.Return(ch.ID)
	ch, err = inf.Grant(0, 8<<20) // training's chunk, zeroed
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(broker.NewCollector(b), stats.BuildInfo("test"))
	return reg
}

// TestDeployBrokerScrape keeps deploy/testdata/broker.prom, which the
// deploy module's rules and dashboard are checked against, equal in
// metric families to a real scrape of the broker.
func TestDeployBrokerScrape(t *testing.T) {
	if err := scrapefile.Check(brokerRegistry(t), "../deploy/testdata/broker.prom", *updateScrape); err != nil {
		t.Fatal(err)
	}
}

// TestBrokerMetricsDocumented checks that docs/metrics.md has a row for
// every broker metric, with its type and labels.
func TestBrokerMetricsDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	mfs, err := brokerRegistry(t).Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "allocd_broker_") {
			continue
		}
		labels := map[string]bool{}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = true
			}
		}
		var names []string
		for n := range labels {
			names = append(names, n)
		}
		slices.SortFunc(names, func(a, b string) int { return labelOrder(a) - labelOrder(b) })
		typ := map[dto.MetricType]string{dto.MetricType_GAUGE: "gauge", dto.MetricType_COUNTER: "counter", dto.MetricType_HISTOGRAM: "histogram"}[mf.GetType()]
		row := "| `" + mf.GetName() + "` | " + typ + " | " + strings.Join(names, ", ") + " |"
		if !strings.Contains(string(doc), row) {
			t.Errorf("docs/metrics.md has no row starting %q", row)
		}
	}
}

// labelOrder is the order docs/metrics.md lists labels in.
func labelOrder(l string) int {
	return slices.Index([]string{"tenant", "gpu", "UUID", "reason", "result"}, l)
}
