package deploy

import (
	"os"
	"slices"
	"sort"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

// promql parses every expression the tests read: the rules', the
// dashboard's and the dashboard variables'.
var promql = parser.NewParser(parser.Options{})

// labelSet is a set of label names.
type labelSet map[string]bool

func newLabelSet(names ...string) labelSet {
	s := labelSet{}
	for _, n := range names {
		s[n] = true
	}
	return s
}

func (s labelSet) union(o labelSet) labelSet {
	u := labelSet{}
	for n := range s {
		u[n] = true
	}
	for n := range o {
		u[n] = true
	}
	return u
}

func (s labelSet) String() string {
	names := make([]string, 0, len(s))
	for n := range s {
		names = append(names, n)
	}
	sort.Strings(names)
	return "{" + strings.Join(names, ", ") + "}"
}

// scrape is what a Prometheus that scrapes one kind of target stores: the
// series names of a scrape file, each with the label names its samples
// carry, plus the target labels that the PodMonitor adds to every series.
type scrape struct {
	file   string
	series map[string]labelSet // series name (histograms: name_bucket, …) → labels
	target labelSet            // labels Prometheus adds: job, instance, the relabelings'
}

// readScrape parses a scrape file in the Prometheus text exposition format.
// Every family must have HELP and TYPE lines.
func readScrape(t *testing.T, file string) map[string]labelSet {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(f)
	if err != nil {
		t.Fatalf("%s: %v", file, err)
	}
	if len(fams) == 0 {
		t.Fatalf("%s: no metric family", file)
	}
	series := map[string]labelSet{}
	add := func(name string, ls labelSet) {
		series[name] = series[name].union(ls)
	}
	for name, fam := range fams {
		if fam.GetHelp() == "" {
			t.Errorf("%s: %s has no HELP", file, name)
		}
		if fam.GetType() == dto.MetricType_UNTYPED {
			t.Errorf("%s: %s has no TYPE", file, name)
		}
		if len(fam.GetMetric()) == 0 {
			t.Errorf("%s: %s has no sample", file, name)
		}
		ls := labelSet{}
		for _, m := range fam.GetMetric() {
			for _, lp := range m.GetLabel() {
				ls[lp.GetName()] = true
			}
		}
		switch fam.GetType() {
		case dto.MetricType_HISTOGRAM:
			add(name+"_bucket", ls.union(newLabelSet("le")))
			add(name+"_sum", ls)
			add(name+"_count", ls)
		case dto.MetricType_SUMMARY:
			add(name, ls.union(newLabelSet("quantile")))
			add(name+"_sum", ls)
			add(name+"_count", ls)
		case dto.MetricType_COUNTER:
			// The text format names a counter's family with its _total; a
			// family named without it is exposed with it added.
			if !strings.HasSuffix(name, "_total") {
				name += "_total"
			}
			add(name, ls)
		default:
			add(name, ls)
		}
	}
	return series
}

// world is every series Prometheus would hold from allocd's targets, with
// the labels each carries, and the values of the job label.
type world struct {
	scrapes []scrape
	jobs    []string // values of the job label of allocd's targets
}

// synthetic are the series Prometheus makes for every target, with the
// labels besides the target's own.
var synthetic = map[string]labelSet{"up": {}}

// labels returns the label names of series name (target labels included),
// or ok false when no scrape has it.
func (w *world) labels(name string) (labelSet, bool) {
	var out labelSet
	found := false
	for _, s := range w.scrapes {
		if ls, ok := s.series[name]; ok {
			out = out.union(ls).union(s.target)
			found = true
		}
		if ls, ok := synthetic[name]; ok {
			out = out.union(ls).union(s.target)
			found = true
		}
	}
	return out, found
}

// selectorName returns the metric name a vector selector selects: its
// name, or the value of an equality matcher on __name__.
func selectorName(vs *parser.VectorSelector) string {
	if vs.Name != "" {
		return vs.Name
	}
	for _, m := range vs.LabelMatchers {
		if m.Name == model.MetricNameLabel && m.Type == labels.MatchEqual {
			return m.Value
		}
	}
	return ""
}

// checkExpr parses expr and checks each of its selectors against w: the
// metric exists in a scrape (or is one Prometheus makes, as up), each
// matcher names a label the series carry, and a job matcher names one of
// allocd's jobs; and each aggregation groups by labels its input carries. It returns the expression and the metric names it reads.
func checkExpr(t *testing.T, w *world, where, expr string) (parser.Expr, []string) {
	t.Helper()
	e, err := promql.ParseExpr(expr)
	if err != nil {
		t.Errorf("%s: %q: %v", where, expr, err)
		return nil, nil
	}
	var names []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		if agg, ok := n.(*parser.AggregateExpr); ok {
			if in, ok := w.outLabels(agg.Expr); ok {
				for _, l := range agg.Grouping {
					if !in[l] {
						t.Errorf("%s: %s groups by %s; the series carry %s", where, agg.Op, l, in)
					}
				}
			}
		}
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := selectorName(vs)
		if name == "" {
			t.Errorf("%s: selector %s names no metric", where, vs)
			return nil
		}
		names = append(names, name)
		ls, ok := w.labels(name)
		if !ok {
			t.Errorf("%s: %s is in no scrape", where, name)
			return nil
		}
		for _, m := range vs.LabelMatchers {
			if m.Name == model.MetricNameLabel {
				continue
			}
			if !ls[m.Name] {
				t.Errorf("%s: %s has no label %q; its labels: %s", where, name, m.Name, ls)
			}
			if m.Name == model.JobLabel && m.Type == labels.MatchEqual && !slices.Contains(w.jobs, m.Value) {
				t.Errorf("%s: job=%q is none of allocd's jobs %q", where, m.Value, w.jobs)
			}
		}
		return nil
	})
	if len(names) == 0 {
		t.Errorf("%s: %q reads no metric", where, expr)
	}
	return e, names
}

// outLabels returns the label names the series of e's result can carry,
// or ok false where it cannot tell (a scalar has none and is ok).
func (w *world) outLabels(e parser.Expr) (labelSet, bool) {
	switch e := e.(type) {
	case *parser.VectorSelector:
		return w.labels(selectorName(e))
	case *parser.MatrixSelector:
		return w.outLabels(e.VectorSelector)
	case *parser.SubqueryExpr:
		return w.outLabels(e.Expr)
	case *parser.ParenExpr:
		return w.outLabels(e.Expr)
	case *parser.StepInvariantExpr:
		return w.outLabels(e.Expr)
	case *parser.UnaryExpr:
		return w.outLabels(e.Expr)
	case *parser.NumberLiteral, *parser.StringLiteral:
		return labelSet{}, true
	case *parser.AggregateExpr:
		in, ok := w.outLabels(e.Expr)
		switch {
		case e.Op == parser.TOPK || e.Op == parser.BOTTOMK || e.Op == parser.LIMITK || e.Op == parser.LIMIT_RATIO:
			return in, ok
		case e.Without:
			out := labelSet{}
			for n := range in {
				if !slices.Contains(e.Grouping, n) {
					out[n] = true
				}
			}
			return out, ok
		default:
			return newLabelSet(e.Grouping...), true
		}
	case *parser.Call:
		switch e.Func.Name {
		case "absent", "absent_over_time":
			// The equality matchers of its argument's selector.
			out := labelSet{}
			parser.Inspect(e.Args[0], func(n parser.Node, _ []parser.Node) error {
				if vs, ok := n.(*parser.VectorSelector); ok {
					for _, m := range vs.LabelMatchers {
						if m.Type == labels.MatchEqual && m.Name != model.MetricNameLabel {
							out[m.Name] = true
						}
					}
				}
				return nil
			})
			return out, true
		case "histogram_quantile":
			in, ok := w.outLabels(e.Args[1])
			out := labelSet{}
			for n := range in {
				if n != model.BucketLabel {
					out[n] = true
				}
			}
			return out, ok
		case "label_replace", "label_join", "vector", "scalar", "time":
			return nil, false
		}
		for _, a := range e.Args {
			if a.Type() == parser.ValueTypeVector || a.Type() == parser.ValueTypeMatrix {
				return w.outLabels(a)
			}
		}
		return labelSet{}, true
	case *parser.BinaryExpr:
		lhs, lok := w.outLabels(e.LHS)
		rhs, rok := w.outLabels(e.RHS)
		lvec := e.LHS.Type() == parser.ValueTypeVector
		rvec := e.RHS.Type() == parser.ValueTypeVector
		switch {
		case lvec && !rvec:
			return lhs, lok
		case rvec && !lvec:
			return rhs, rok
		case !lvec && !rvec:
			return labelSet{}, true
		}
		vm := e.VectorMatching
		switch {
		case e.Op == parser.LAND || e.Op == parser.LUNLESS:
			return lhs, lok
		case e.Op == parser.LOR:
			return lhs.union(rhs), lok && rok
		case vm.Card == parser.CardManyToOne:
			return lhs.union(newLabelSet(vm.Include...)), lok
		case vm.Card == parser.CardOneToMany:
			return rhs.union(newLabelSet(vm.Include...)), rok
		case vm.On:
			return newLabelSet(vm.MatchingLabels...), true
		default:
			out := labelSet{}
			for n := range lhs {
				if !slices.Contains(vm.MatchingLabels, n) {
					out[n] = true
				}
			}
			return out, lok
		}
	}
	return nil, false
}
