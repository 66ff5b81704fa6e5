package bench

import (
	"strings"
	"testing"
)

// TestWriteReplayTableBest: the best column appears, with one mark per
// trace, only when a trace is replayed with several configurations; a
// table of one configuration has no blank column.
func TestWriteReplayTableBest(t *testing.T) {
	one := []ReplayRow{{Trace: "a", Ops: 10, PeakAllocatedBytes: 1 << 20, PeakReservedBytes: 2 << 20}}
	two := append(one[:1:1], ReplayRow{Trace: "a", Conf: "max_split_size_mb:64", Ops: 10, PeakAllocatedBytes: 1 << 20, PeakReservedBytes: 3 << 20})
	for _, c := range []struct {
		name  string
		rows  []ReplayRow
		best  bool
		marks int
	}{{"one configuration", one, false, 0}, {"two configurations", two, true, 1}} {
		var b strings.Builder
		if err := WriteReplayTable(&b, c.rows); err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
		if got := strings.HasSuffix(strings.TrimSpace(lines[0]), "best"); got != c.best {
			t.Errorf("%s: best column shown %v, want %v:\n%s", c.name, got, c.best, b.String())
		}
		if got := strings.Count(b.String(), "*"); got != c.marks {
			t.Errorf("%s: %d marks, want %d:\n%s", c.name, got, c.marks, b.String())
		}
		for _, l := range lines[1:] {
			if !c.best && !strings.HasSuffix(l, "0") {
				t.Errorf("%s: row ends in a blank column: %q", c.name, l)
			}
		}
	}
}
