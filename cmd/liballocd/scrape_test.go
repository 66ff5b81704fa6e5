package main

import (
	"flag"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/scrapefile"
)

var updateScrape = flag.Bool("update-scrape", false, "record deploy/testdata/job.prom from a real scrape")

// TestDeployJobScrape keeps deploy/testdata/job.prom, which the deploy
// module's rules and dashboard are checked against, equal in metric
// families to a real scrape of a job's ALLOCD_METRICS_LISTEN.
func TestDeployJobScrape(t *testing.T) {
	l, err := newLib(settings{level: "error", device: "sim", simCapacity: "1GiB"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.devs.Close() })
	p, err := l.malloc(4<<20, 0, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.free(p, 0); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(&devicesCollector{l: l})
	if err := scrapefile.Check(reg, "../../deploy/testdata/job.prom", *updateScrape); err != nil {
		t.Fatal(err)
	}
}
