package bench

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/allocd/allocd/workload"
)

// docTable returns the rows of the first Markdown table that starts at or
// after the first line of the file at path containing marker, keyed by
// their first cell, without the header and separator rows. Cells are
// trimmed. The test fails if there is no such table.
func docTable(t *testing.T, path, marker string) map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	found, header := false, 0
	rows := map[string][]string{}
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if !found {
			found = strings.Contains(line, marker)
			if !found {
				continue
			}
		}
		if !strings.HasPrefix(line, "|") {
			if header > 0 {
				break // the end of the table
			}
			continue
		}
		if header++; header <= 2 {
			continue // the header and the separator
		}
		var cells []string
		for _, c := range strings.Split(strings.Trim(line, "|"), "|") {
			cells = append(cells, strings.TrimSpace(c))
		}
		rows[cells[0]] = cells[1:]
	}
	if len(rows) == 0 {
		t.Fatalf("%s: no table after %q", path, marker)
	}
	return rows
}

// docRow is the row of table for trace, failing the test if there is none
// or it has fewer than n cells after the trace's.
func docRow(t *testing.T, table map[string][]string, path, trace string, n int) []string {
	t.Helper()
	row, ok := table[trace]
	if !ok || len(row) < n {
		t.Fatalf("%s: no row for %s with %d figures", path, trace, n)
	}
	return row
}

// checkCell compares one cell of a doc table with the figure a test
// produced, formatted as the doc writes it.
func checkCell(t *testing.T, path, trace, column, cell, want string) {
	t.Helper()
	if cell != want {
		t.Errorf("%s, %s, %s: the doc says %s, the replay gives %s", path, trace, column, cell, want)
	}
}

// commas writes n with thousands separators, as the docs write bytes.
func commas(n int64) string {
	s := strconv.FormatInt(n, 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

func ratio(r workload.ReplayResult) string {
	return fmt.Sprintf("%.3f", float64(r.PeakReserved)/float64(r.PeakAllocated))
}

// TestDocFigures compares the figures the docs give for the recorded
// traces with fresh replays on the simulated device (shared with
// TestReplayMatchesPyTorch and TestReplayExpandable) and with PyTorch's
// figures those tests hold: the tables of testdata/traces/README.md, the
// allocd columns of docs/replay.md's comparison with PyTorch, and the
// "runs" columns of docs/fragmentation.md's expandable table and its table
// of fine and coarse reclaim beside PyTorch. In -short
// mode the long traces' rows are not compared.
func TestDocFigures(t *testing.T) {
	const readme, replayDoc, fragDoc = "../testdata/traces/README.md", "../docs/replay.md", "../docs/fragmentation.md"
	ptMiB := docTable(t, readme, "| trace | ops | peak allocated MiB | native: peak reserved MiB |")
	ptBytes := docTable(t, readme, "| trace | ops | native: peak allocated | peak reserved | expandable: peak allocated |")
	replays := docTable(t, readme, "`--pytorch-expandable` makes expandable segments behave exactly")
	ours := docTable(t, readme, "replay --device sim --json --conf expandable_segments:True testdata/traces")
	vsPyTorch := docTable(t, replayDoc, "| trace | PyTorch peak allocated MiB | allocd |")
	runs := docTable(t, fragDoc, "| trace | reserved/allocated: pages → runs (PyTorch) |")
	coarse := docTable(t, fragDoc, "| trace | peak reserved MiB: fine / coarse / PyTorch |")
	for _, name := range traceNames {
		t.Run(name, func(t *testing.T) {
			// PyTorch's figures: the doc and the tests agree.
			if n, ok := pytorchNative[name]; ok {
				row := docRow(t, ptMiB, readme, name, 6)
				checkCell(t, readme, name, "PyTorch peak allocated MiB", row[1], fmt.Sprint(n.allocatedMiB))
				checkCell(t, readme, name, "PyTorch native peak reserved MiB", row[2], fmt.Sprint(n.reservedMiB))
				checkCell(t, readme, name, "PyTorch expandable peak reserved MiB", row[4], fmt.Sprint(pytorchExpandable[name]))
				row = docRow(t, vsPyTorch, replayDoc, name, 4)
				checkCell(t, replayDoc, name, "PyTorch peak allocated MiB", row[0], fmt.Sprint(n.allocatedMiB))
				checkCell(t, replayDoc, name, "PyTorch peak reserved MiB", row[2], fmt.Sprint(n.reservedMiB))
			} else {
				rec := pytorchRecorded[name]
				row := docRow(t, ptBytes, readme, name, 5)
				for i, want := range []int64{rec.native.allocated, rec.native.reserved, rec.expandable.allocated, rec.expandable.reserved} {
					checkCell(t, readme, name, fmt.Sprintf("PyTorch's figure %d", i+1), row[1+i], commas(want))
				}
			}
			if testing.Short() && longTrace(name) {
				t.Skip("long trace in -short mode")
			}
			def, exp, pt := replayTrace(t, name, modeDefault), replayTrace(t, name, modeExpandable), replayTrace(t, name, modePyTorchExpandable)

			row := docRow(t, replays, readme, name, 7)
			for i, want := range []string{
				commas(int64(def.r.Ops)),
				commas(def.r.PeakAllocated), commas(def.r.PeakReserved), ratio(def.r),
				commas(pt.r.PeakAllocated), commas(pt.r.PeakReserved), ratio(pt.r),
			} {
				checkCell(t, readme, name, "replay column "+strconv.Itoa(i+2), row[i], want)
			}
			row = docRow(t, ours, readme, name, 4)
			for i, want := range []string{commas(exp.r.PeakAllocated), commas(exp.r.PeakReserved), ratio(exp.r), fmt.Sprint(exp.r.Reclaims)} {
				checkCell(t, readme, name, "allocd expandable column "+strconv.Itoa(i+2), row[i], want)
			}
			if _, ok := pytorchNative[name]; ok {
				row = docRow(t, vsPyTorch, replayDoc, name, 4)
				checkCell(t, replayDoc, name, "allocd peak allocated MiB", row[1], fmt.Sprint(mib(def.r.PeakAllocated)))
				checkCell(t, replayDoc, name, "allocd peak reserved MiB", row[3], fmt.Sprint(mib(def.r.PeakReserved)))
			}
			// fragmentation.md: "pages → runs (PyTorch)"; the runs and
			// PyTorch figures are today's.
			row = docRow(t, runs, fragDoc, name, 4)
			after := func(cell string) string {
				_, s, _ := strings.Cut(cell, "→ ")
				return s
			}
			checkCell(t, fragDoc, name, "reserved/allocated", after(row[0]), fmt.Sprintf("%s (%s)", ratio(exp.r), ratio(pt.r)))
			checkCell(t, fragDoc, name, "handles created", after(row[1]), fmt.Sprintf("%s (%s)", commas(exp.vmm.Creates), commas(pt.vmm.Creates)))
			checkCell(t, fragDoc, name, "mappings", after(row[2]), fmt.Sprintf("%s (%s)", commas(exp.vmm.Maps), commas(pt.vmm.Maps)))
			checkCell(t, fragDoc, name, "unmappings", after(row[3]), commas(exp.vmm.Unmaps))
			// fragmentation.md: fine, coarse and PyTorch side by side.
			co := replayTrace(t, name, modeExpandableCoarse)
			three := func(f func(replayed) string) string {
				return f(exp) + " / " + f(co) + " / " + f(pt)
			}
			row = docRow(t, coarse, fragDoc, name, 4)
			checkCell(t, fragDoc, name, "peak reserved MiB", row[0], three(func(r replayed) string { return fmt.Sprint(mib(r.r.PeakReserved)) }))
			checkCell(t, fragDoc, name, "reserved/allocated", row[1], three(func(r replayed) string { return ratio(r.r) }))
			checkCell(t, fragDoc, name, "device calls", row[2], three(func(r replayed) string {
				return fmt.Sprint(r.vmm.Creates + r.vmm.Maps + r.vmm.Unmaps + r.vmm.Releases)
			}))
			checkCell(t, fragDoc, name, "modelled ms", row[3], three(func(r replayed) string { return fmt.Sprintf("%.1f", vmmCost(r.vmm)) }))
		})
	}
}
