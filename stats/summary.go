// Package stats reports an allocator's statistics: the text table that
// torch.cuda.memory_summary() prints (Summary) and a Prometheus collector
// that turns one allocator.Stats copy into metrics at each scrape
// (Collector).
//
// Nothing here touches the allocator's lock beyond one Stats() call per
// report: the rendering and encoding work on a value copy.
package stats

import (
	"fmt"
	"io"
	"strings"

	"github.com/allocd/allocd/allocator"
)

// summaryWidth is the width of every line of the table between its
// outer bars, as in PyTorch.
const summaryWidth = 75

// summaryRow is one metric of the table: a statistic and its title.
type summaryRow struct {
	title  string
	bytes  bool
	values func(*allocator.Stats) *allocator.StatArray
}

// summaryRows are the metrics torch.cuda.memory_summary() shows, in its
// order and with its titles.
var summaryRows = [...]summaryRow{
	{"Allocated memory", true, func(s *allocator.Stats) *allocator.StatArray { return &s.AllocatedBytes }},
	{"Active memory", true, func(s *allocator.Stats) *allocator.StatArray { return &s.ActiveBytes }},
	{"Requested memory", true, func(s *allocator.Stats) *allocator.StatArray { return &s.RequestedBytes }},
	{"GPU reserved memory", true, func(s *allocator.Stats) *allocator.StatArray { return &s.ReservedBytes }},
	{"Non-releasable memory", true, func(s *allocator.Stats) *allocator.StatArray { return &s.InactiveSplitBytes }},
	{"Allocations", false, func(s *allocator.Stats) *allocator.StatArray { return &s.Allocation }},
	{"Active allocs", false, func(s *allocator.Stats) *allocator.StatArray { return &s.Active }},
	{"GPU reserved segments", false, func(s *allocator.Stats) *allocator.StatArray { return &s.Segment }},
	{"Non-releasable allocs", false, func(s *allocator.Stats) *allocator.StatArray { return &s.InactiveSplit }},
}

// Summary renders s as the table torch.cuda.memory_summary() prints for
// device, with allocd named in the title instead of PyTorch:
//
//	|===========================================================================|
//	|                        allocd memory summary, device ID 0                 |
//	|---------------------------------------------------------------------------|
//	|            CUDA OOMs: 1            |        cudaMalloc retries: 2         |
//	|===========================================================================|
//	|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
//	|---------------------------------------------------------------------------|
//	| Allocated memory      |   3773 KiB |    903 MiB |   1206 MiB |   1203 MiB |
//	|       from large pool |   3072 KiB |    903 MiB |   1206 MiB |   1203 MiB |
//	|       from small pool |    701 KiB |      0 MiB |      0 MiB |      0 MiB |
//	|---------------------------------------------------------------------------|
//	…
//
// Every line but the title is byte for byte what PyTorch prints for the same
// statistics: the same rows and columns (current, peak, total allocated,
// total freed), the "from large pool" / "from small pool" breakdown, and the
// same units: a column's unit is chosen from its all-pools value, so the
// rows of one metric share it, and values are truncated to whole units.
func Summary(s allocator.Stats, device int) string {
	var b strings.Builder
	b.Grow(47 * (summaryWidth + 3)) // 47 lines of 77 bytes and a newline
	writeSummary(&b, &s, device, false)
	return b.String()
}

// WriteSummary writes Summary's table to w. With abbreviated set it leaves
// out the per-pool lines, as memory_summary(abbreviated=True) does.
func WriteSummary(w io.Writer, s allocator.Stats, device int, abbreviated bool) error {
	var b strings.Builder
	writeSummary(&b, &s, device, abbreviated)
	_, err := io.WriteString(w, b.String())
	return err
}

func writeSummary(b *strings.Builder, s *allocator.Stats, device int, abbreviated bool) {
	line := func(format string, args ...any) {
		b.WriteByte('|')
		fmt.Fprintf(b, format, args...)
		b.WriteString("|\n")
	}
	rule := func(c string) { line("%s", strings.Repeat(c, summaryWidth)) }

	rule("=")
	// PyTorch's title is six characters longer: the padding keeps the
	// line 75 characters wide and the device index where PyTorch puts it.
	line(" %22s allocd memory summary, device ID %-17d ", "", device)
	rule("-")
	line("  %9s CUDA OOMs: %-12d | %6s cudaMalloc retries: %-8d  ", "", s.NumOOMs, "", s.NumAllocRetries)
	rule("=")
	line("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")

	pools := []struct {
		p    allocator.Pool
		name string
	}{
		{allocator.PoolAll, ""},
		{allocator.PoolLarge, "      from large pool"},
		{allocator.PoolSmall, "      from small pool"},
	}
	if abbreviated {
		pools = pools[:1]
	}
	for _, row := range summaryRows {
		rule("-")
		arr := row.values(s)
		all := arr[allocator.PoolAll]
		for _, p := range pools {
			name := p.name
			if p.p == allocator.PoolAll {
				name = row.title
			}
			st := arr[p.p]
			fmtv := formatCount
			if row.bytes {
				fmtv = formatSize
			}
			line(" %-21s | %s | %s | %s | %s ", name,
				fmtv(st.Current, all.Current), fmtv(st.Peak, all.Peak),
				fmtv(st.Allocated, all.Allocated), fmtv(st.Freed, all.Freed))
		}
	}
	for _, o := range []struct {
		title string
		st    allocator.Stat
	}{
		{"Oversize allocations", s.OversizeAllocations},
		{"Oversize GPU segments", s.OversizeSegments},
	} {
		rule("-")
		st := o.st
		line(" %-21s | %s | %s | %s | %s ", o.title,
			formatCount(st.Current, st.Current), formatCount(st.Peak, st.Peak),
			formatCount(st.Allocated, st.Allocated), formatCount(st.Freed, st.Freed))
	}
	rule("=")
}

// floorDiv is Python's // on integers: it rounds toward negative infinity.
func floorDiv(a, b int64) int64 {
	q := a / b
	if (a%b != 0) && ((a < 0) != (b < 0)) {
		q--
	}
	return q
}

// formatSize is memory_summary's _format_size: the unit is the largest
// for which the reference value pref (the all-pools figure) stays at
// least 768 of it, and the value is truncated to whole units.
func formatSize(n, pref int64) string {
	units := [...]string{"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"}
	unit := units[0]
	p := float64(pref)
	for _, u := range units[1:] {
		if p < 768*1024 {
			break
		}
		unit = u
		n = floorDiv(n, 1024)
		p /= 1024
	}
	return fmt.Sprintf("%6d %s", n, unit)
}

// formatCount is memory_summary's _format_count: counts from 750,000 of
// the reference on are shown in thousands (K), then millions (M).
func formatCount(n, pref int64) string {
	units := [...]string{" ", "K", "M"}
	unit := units[0]
	p := float64(pref)
	for _, u := range units[1:] {
		if p < 750*1000 {
			break
		}
		unit = u
		n = floorDiv(n, 1000)
		p /= 1000
	}
	return fmt.Sprintf("%7d %s ", n, unit)
}
