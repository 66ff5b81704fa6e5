package bench

import (
	"fmt"
	"html"
	"io"
	"math"
	"strings"

	"github.com/allocd/allocd/allocator"
)

// ChartSeries is one configuration's samples over a replay (Sampler).
type ChartSeries struct {
	// Conf is the configuration, as the legend names it (ConfLabel).
	Conf    string
	Samples []Sample
}

// chartColors are distinguishable on white and for common colour blindness
// (Okabe–Ito).
var chartColors = []string{"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"}

// Layout of the chart, in SVG pixels.
const (
	chartW, chartH                               = 1000, 560
	chartLeft, chartRight, chartTop, chartBottom = 80, 250, 50, 60
	chartPlotW                                   = chartW - chartLeft - chartRight
	chartPlotH                                   = chartH - chartTop - chartBottom
)

// The quantities drawn for each configuration.
const (
	chartReserved  = "reserved"
	chartAllocated = "allocated"
	chartRequested = "requested"
)

// niceStep picks a round axis step (1, 2 or 5 × a power of two of MiB… or
// of ten for counts) so that max spans about n steps.
func niceStep(max float64, n int, base float64) float64 {
	raw := max / float64(n)
	if raw <= 0 {
		return 1
	}
	p := math.Pow(base, math.Floor(math.Log(raw)/math.Log(base)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

// WriteChart draws allocated, reserved and requested bytes over a trace's
// operations for each configuration, as a self-contained SVG. Each line is
// a <polyline> with data-config and data-series attributes.
func WriteChart(w io.Writer, title string, series []ChartSeries) error {
	var maxOp int
	var maxBytes int64
	for _, s := range series {
		for _, p := range s.Samples {
			maxOp = max(maxOp, p.Op)
			maxBytes = max(maxBytes, p.Reserved, p.Allocated, p.Requested)
		}
	}
	maxOp = max(maxOp, 1)
	yStep := niceStep(float64(max(maxBytes, 1<<20)), 6, 2)
	yMax := math.Ceil(float64(max(maxBytes, 1))/yStep) * yStep
	xStep := niceStep(float64(maxOp), 8, 10)
	x := func(op int) float64 { return chartLeft + float64(op)/float64(maxOp)*chartPlotW }
	y := func(b int64) float64 { return chartTop + chartPlotH - float64(b)/yMax*chartPlotH }

	var sb strings.Builder
	fmt.Fprintf(&sb, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", chartW, chartH, chartW, chartH)
	fmt.Fprintf(&sb, `<rect width="%d" height="%d" fill="white"/>`+"\n", chartW, chartH)
	fmt.Fprintf(&sb, `<text x="%d" y="24" font-size="16" font-weight="bold">%s</text>`+"\n", chartLeft, html.EscapeString(title))
	// Axes and grid.
	for v := 0.0; v <= yMax+1; v += yStep {
		yy := y(int64(v))
		fmt.Fprintf(&sb, `<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", chartLeft, chartLeft+chartPlotW, yy, yy)
		fmt.Fprintf(&sb, `<text x="%d" y="%.1f" text-anchor="end" dominant-baseline="middle">%s</text>`+"\n", chartLeft-6, yy, html.EscapeString(allocator.FormatSize(uint64(v))))
	}
	for v := 0.0; v <= float64(maxOp); v += xStep {
		xx := x(int(v))
		fmt.Fprintf(&sb, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#eee"/>`+"\n", xx, xx, chartTop, chartTop+chartPlotH)
		fmt.Fprintf(&sb, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", xx, chartTop+chartPlotH+18, formatCount(v))
	}
	fmt.Fprintf(&sb, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#444"/>`+"\n", chartLeft, chartTop, chartPlotW, chartPlotH)
	fmt.Fprintf(&sb, `<text x="%d" y="%d" text-anchor="middle">trace operation (allocations and frees, in order)</text>`+"\n", chartLeft+chartPlotW/2, chartH-16)
	// Lines: reserved solid and thick, allocated dashed, requested dotted.
	styles := map[string]string{
		chartReserved:  `stroke-width="2.2"`,
		chartAllocated: `stroke-width="1.2" stroke-dasharray="6 3"`,
		chartRequested: `stroke-width="1" stroke-dasharray="1.5 2.5"`,
	}
	for i, s := range series {
		color := chartColors[i%len(chartColors)]
		for _, name := range []string{chartRequested, chartAllocated, chartReserved} {
			fmt.Fprintf(&sb, `<polyline data-config="%s" data-series="%s" fill="none" stroke="%s" %s points="`, html.EscapeString(s.Conf), name, color, styles[name])
			for j, p := range s.Samples {
				v := p.Reserved
				switch name {
				case chartAllocated:
					v = p.Allocated
				case chartRequested:
					v = p.Requested
				}
				if j > 0 {
					sb.WriteByte(' ')
				}
				fmt.Fprintf(&sb, "%.1f,%.1f", x(p.Op), y(v))
			}
			sb.WriteString("\"/>\n")
		}
	}
	// Legend: one colour per configuration, one line style per quantity.
	lx, ly := chartLeft+chartPlotW+16, chartTop+8
	for i, s := range series {
		conf := ConfLabel(s.Conf)
		fmt.Fprintf(&sb, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="3"/>`, lx, lx+24, ly, ly, chartColors[i%len(chartColors)])
		fmt.Fprintf(&sb, `<text x="%d" y="%d" dominant-baseline="middle">%s</text>`+"\n", lx+30, ly, html.EscapeString(shorten(conf, 30)))
		ly += 20
	}
	ly += 10
	for _, name := range []string{chartReserved, chartAllocated, chartRequested} {
		fmt.Fprintf(&sb, `<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="#333" %s/>`, lx, lx+24, ly, ly, styles[name])
		fmt.Fprintf(&sb, `<text x="%d" y="%d" dominant-baseline="middle">%s bytes</text>`+"\n", lx+30, ly, name)
		ly += 20
	}
	sb.WriteString("</svg>\n")
	_, err := io.WriteString(w, sb.String())
	return err
}

func formatCount(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%gM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%gk", v/1e3)
	}
	return fmt.Sprintf("%g", v)
}

func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}
