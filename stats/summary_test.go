package stats

import (
	"errors"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// scripted runs a fixed sequence on a fresh allocator over a 1 GiB Sim
// with max_split_size_mb:200: small and large allocations, splits, frees,
// an allocation that succeeds only after the cache is released (a retry),
// one that fails (an OOM, after another retry), oversize allocations and an
// empty cache. The allocator is left open, with three live allocations.
func scripted(t testing.TB) *allocator.Allocator {
	t.Helper()
	dev, err := simdev.New(simdev.Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := allocator.ParseConfig("max_split_size_mb:200")
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(dev, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	malloc := func(size uint64) cudart.Ptr {
		t.Helper()
		p, err := a.Malloc(size, cudart.DefaultStream)
		if err != nil {
			t.Fatalf("Malloc(%d): %v", size, err)
		}
		return p
	}
	free := func(p cudart.Ptr) {
		t.Helper()
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	// Small pool: three blocks carved from one 2 MiB segment, one freed.
	malloc(1000)
	s2 := malloc(300 << 10)
	malloc(700<<10 + 1)
	free(s2)
	// Large pool: two 3 MiB blocks of one 20 MiB segment, 50 MiB and an
	// oversize 250 MiB in segments of their own.
	l1 := malloc(3 << 20)
	malloc(3 << 20)
	l3 := malloc(50 << 20)
	big := malloc(250 << 20)
	free(l1)
	free(l3)
	free(big)
	// 900 MiB fits only once the cached 50 and 250 MiB segments are
	// released: a retry.
	huge := malloc(900 << 20)
	// 200 MiB more cannot fit at all: a retry, then an OOM.
	if _, err := a.Malloc(200<<20, cudart.DefaultStream); !errors.Is(err, allocator.ErrOutOfMemory) {
		t.Fatalf("Malloc(200 MiB) = %v, want out of memory", err)
	}
	free(huge)
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	return a
}

// The golden table was checked line by line against PyTorch's own
// memory_summary() formatting code fed the same Flat() statistics (all
// lines but the title, which names allocd).
const goldenSummary = `|===========================================================================|
|                        allocd memory summary, device ID 0                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 1            |        cudaMalloc retries: 2         |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      |   3773 KiB |    903 MiB |   1206 MiB |   1203 MiB |
|       from large pool |   3072 KiB |    903 MiB |   1206 MiB |   1203 MiB |
|       from small pool |    701 KiB |      0 MiB |      0 MiB |      0 MiB |
|---------------------------------------------------------------------------|
| Active memory         |   3773 KiB |    903 MiB |   1206 MiB |   1203 MiB |
|       from large pool |   3072 KiB |    903 MiB |   1206 MiB |   1203 MiB |
|       from small pool |    701 KiB |      0 MiB |      0 MiB |      0 MiB |
|---------------------------------------------------------------------------|
| Requested memory      |   3772 KiB |    903 MiB |   1206 MiB |   1203 MiB |
|       from large pool |   3072 KiB |    903 MiB |   1206 MiB |   1203 MiB |
|       from small pool |    700 KiB |      0 MiB |      0 MiB |      0 MiB |
|---------------------------------------------------------------------------|
| GPU reserved memory   |  22528 KiB |    922 MiB |   1222 MiB |   1200 MiB |
|       from large pool |  20480 KiB |    920 MiB |   1220 MiB |   1200 MiB |
|       from small pool |   2048 KiB |      2 MiB |      2 MiB |      0 MiB |
|---------------------------------------------------------------------------|
| Non-releasable memory |  18754 KiB |  18754 KiB |  22827 KiB |   4072 KiB |
|       from large pool |  17408 KiB |  17408 KiB |  20480 KiB |   3072 KiB |
|       from small pool |   1346 KiB |   2047 KiB |   2347 KiB |   1000 KiB |
|---------------------------------------------------------------------------|
| Allocations           |       3    |       6    |       8    |       5    |
|       from large pool |       1    |       4    |       5    |       4    |
|       from small pool |       2    |       3    |       3    |       1    |
|---------------------------------------------------------------------------|
| Active allocs         |       3    |       6    |       8    |       5    |
|       from large pool |       1    |       4    |       5    |       4    |
|       from small pool |       2    |       3    |       3    |       1    |
|---------------------------------------------------------------------------|
| GPU reserved segments |       2    |       4    |       5    |       3    |
|       from large pool |       1    |       3    |       4    |       3    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       4    |       4    |       4    |       0    |
|       from large pool |       2    |       2    |       2    |       0    |
|       from small pool |       2    |       2    |       2    |       0    |
|---------------------------------------------------------------------------|
| Oversize allocations  |       0    |       1    |       2    |       2    |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       0    |       1    |       2    |       2    |
|===========================================================================|
`

func TestSummaryGolden(t *testing.T) {
	got := Summary(scripted(t).Stats(), 0)
	if got != goldenSummary {
		t.Errorf("Summary mismatch\n got:\n%s\nwant:\n%s", got, goldenSummary)
	}
}

func TestSummaryLineWidth(t *testing.T) {
	st := scripted(t).Stats()
	for _, abbreviated := range []bool{false, true} {
		var b strings.Builder
		if err := WriteSummary(&b, st, 7, abbreviated); err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
		want := 47
		if abbreviated {
			want = 29
		}
		if len(lines) != want {
			t.Errorf("abbreviated=%v: %d lines, want %d", abbreviated, len(lines), want)
		}
		for i, l := range lines {
			if len(l) != summaryWidth+2 || l[0] != '|' || l[len(l)-1] != '|' {
				t.Errorf("abbreviated=%v: line %d is %d wide, want %d between bars: %q", abbreviated, i, len(l), summaryWidth+2, l)
			}
		}
		if !strings.Contains(lines[1], "device ID 7 ") {
			t.Errorf("title %q does not name device 7", lines[1])
		}
		if abbreviated && strings.Contains(b.String(), "from large pool") {
			t.Error("abbreviated summary has per-pool lines")
		}
	}
}

func TestFormatSize(t *testing.T) {
	for _, c := range []struct {
		n, pref int64
		want    string
	}{
		{0, 0, "     0 B  "},
		{786431, 786431, "786431 B  "},       // just below 768 KiB: bytes
		{786432, 786432, "   768 KiB"},       // 768 KiB: KiB
		{1 << 20, 1 << 40, "     0 GiB"},     // the unit follows the reference
		{1 << 30, 1 << 30, "  1024 MiB"},     // 768 is the threshold, not 1024
		{5<<30 + 1, 5<<30 + 1, "  5120 MiB"}, // below 768 GiB: MiB
		{3 << 40, 3 << 40, "  3072 GiB"},
		{1 << 50, 1 << 50, "  1024 TiB"},
		{1 << 60, 1 << 60, "  1024 PiB"},
		{-1500, 1 << 30, "    -1 MiB"}, // Python's floor division
	} {
		if got := formatSize(c.n, c.pref); got != c.want {
			t.Errorf("formatSize(%d, %d) = %q, want %q", c.n, c.pref, got, c.want)
		}
	}
}

func TestFormatCount(t *testing.T) {
	for _, c := range []struct {
		n, pref int64
		want    string
	}{
		{0, 0, "      0   "},
		{749999, 749999, " 749999   "},
		{750000, 750000, "    750 K "},
		{5, 750000, "      0 K "},
		{2_000_000_000, 2_000_000_000, "   2000 M "},
	} {
		if got := formatCount(c.n, c.pref); got != c.want {
			t.Errorf("formatCount(%d, %d) = %q, want %q", c.n, c.pref, got, c.want)
		}
	}
}
