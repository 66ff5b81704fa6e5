// Package scrapefile keeps the recorded scrapes that the deploy module's
// tests read (deploy/testdata/*.prom) true to what allocd exports: a
// test gathers a real registry and Check compares its metric families
// with the file's, or rewrites the file when asked.
package scrapefile

import (
	"bytes"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Render gathers g and renders it in the Prometheus text format,
// leaving out the Go runtime's and the process's families (go_*,
// process_*), which depend on the machine.
func Render(g prometheus.Gatherer) ([]byte, error) {
	mfs, err := g.Gather()
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if n := mf.GetName(); strings.HasPrefix(n, "go_") || strings.HasPrefix(n, "process_") {
			continue
		}
		if err := enc.Encode(mf); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), nil
}

// Families returns the metric family names of a text-format scrape.
func Families(text []byte) ([]string, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(bytes.NewReader(text))
	if err != nil {
		return nil, err
	}
	var out []string
	for n := range mfs {
		out = append(out, n)
	}
	slices.Sort(out)
	return out, nil
}

// Check compares the families of g's scrape with those of the file at
// path. With update it writes the scrape to the file instead.
func Check(g prometheus.Gatherer, path string, update bool) error {
	got, err := Render(g)
	if err != nil {
		return err
	}
	if update {
		return os.WriteFile(path, got, 0o644)
	}
	want, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	gf, err := Families(got)
	if err != nil {
		return fmt.Errorf("the real scrape: %w", err)
	}
	wf, err := Families(want)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if !slices.Equal(gf, wf) {
		var missing, extra []string
		for _, n := range gf {
			if !slices.Contains(wf, n) {
				missing = append(missing, n)
			}
		}
		for _, n := range wf {
			if !slices.Contains(gf, n) {
				extra = append(extra, n)
			}
		}
		return fmt.Errorf("%s is not what allocd exports: missing %v, not exported %v (rerun the test with -update-scrape to record it again)", path, missing, extra)
	}
	return nil
}
