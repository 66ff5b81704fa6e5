package allocator

import (
	"math"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

const (
	kiB = uint64(1) << 10
	miB = uint64(1) << 20
	giB = uint64(1) << 30
)

// newTestAllocator returns an allocator over a fresh Sim of the given
// capacity, and closes it (checking invariants) at the end of the test.
func newTestAllocator(t testing.TB, capacity uint64, conf string, simCfg ...simdev.Config) (*Allocator, *simdev.Sim) {
	t.Helper()
	sc := simdev.Config{}
	if len(simCfg) > 0 {
		sc = simCfg[0]
	}
	sc.Capacity = capacity
	sim, err := simdev.New(sc)
	if err != nil {
		t.Fatal(err)
	}
	return newTestAllocatorOn(t, sim, sim, conf), sim
}

// newTestAllocatorOn is newTestAllocator over dev, which is sim or wraps
// it.
func newTestAllocatorOn(t testing.TB, dev cudart.Device, sim *simdev.Sim, conf string) *Allocator {
	t.Helper()
	cfg, err := ParseConfig(conf)
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(dev, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.Check(); err != nil {
			t.Errorf("invariants at end of test: %v", err)
		}
		_ = a.Close()
		if used := sim.Used(); used != 0 {
			t.Errorf("after Close the device still holds %d bytes", used)
		}
		if n := sim.Counters().LiveEvents; n != 0 {
			t.Errorf("after Close the device still holds %d events", n)
		}
	})
	return a
}

func mustMalloc(t testing.TB, a *Allocator, size uint64, s cudart.Stream) cudart.Ptr {
	t.Helper()
	p, err := a.Malloc(size, s)
	if err != nil {
		t.Fatalf("Malloc(%d): %v", size, err)
	}
	return p
}

func mustFree(t testing.TB, a *Allocator, p cudart.Ptr) {
	t.Helper()
	if err := a.Free(p); err != nil {
		t.Fatalf("Free(%#x): %v", uint64(p), err)
	}
}

func mustCheck(t testing.TB, a *Allocator) {
	t.Helper()
	if err := a.Check(); err != nil {
		t.Fatalf("Check: %v", err)
	}
}

func TestRoundSize(t *testing.T) {
	a, _ := newTestAllocator(t, giB, "")
	r4, _ := newTestAllocator(t, giB, "roundup_power2_divisions:4")
	for _, tc := range []struct {
		a          *Allocator
		size, want uint64
	}{
		{a, 1, 512},
		{a, 512, 512},
		{a, 513, 1024},
		{a, 1000, 1024},
		{a, 5*miB + 1, 5*miB + 512},
		// 4 divisions of [4 MiB, 8 MiB): steps of 1 MiB.
		{r4, 5*miB + 1, 6 * miB},
		{r4, 4 * miB, 4 * miB},
		{r4, 1000, 1024},       // below 512·4: plain rounding
		{r4, 3 * kiB, 3 * kiB}, // [2 KiB, 4 KiB) in steps of 512: exact
		{r4, 1*miB + 1, 1*miB + 256*kiB},
	} {
		if got := tc.a.roundSize(tc.size); got != tc.want {
			t.Errorf("roundSize(%d) with %q = %d, want %d", tc.size, tc.a.cfg.String(), got, tc.want)
		}
	}
}

func TestRoundupListConfig(t *testing.T) {
	cfg, err := ParseConfig("roundup_power2_divisions:[256:1,512:2,>:8]")
	if err != nil {
		t.Fatal(err)
	}
	// Intervals below 256 MiB take the first value (1), 512 MiB takes 2,
	// everything after takes 8; 256 MiB itself is 1.
	want := [roundupIntervals]uint64{1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 8, 8, 8, 8, 8, 8}
	if cfg.RoundupPower2Divisions != want {
		t.Fatalf("divisions = %v, want %v", cfg.RoundupPower2Divisions, want)
	}
}

// TestSegmentSizes pins the device allocations PyTorch's policy makes.
func TestSegmentSizes(t *testing.T) {
	for _, tc := range []struct {
		name    string
		request uint64
		segment uint64
		small   bool
	}{
		{"1 KiB → 2 MiB small segment", kiB, 2 * miB, true},
		{"1 MiB is still small", miB, 2 * miB, true},
		{"1 MiB + 1 → 20 MiB large", miB + 1, 20 * miB, false},
		{"5 MiB → 20 MiB", 5 * miB, 20 * miB, false},
		{"just below 10 MiB → 20 MiB", 10*miB - 512, 20 * miB, false},
		{"10 MiB → 10 MiB", 10 * miB, 10 * miB, false},
		{"11 MiB → 12 MiB", 11 * miB, 12 * miB, false},
		{"100 MiB + 1 → 102 MiB", 100*miB + 1, 102 * miB, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, sim := newTestAllocator(t, giB, "")
			p := mustMalloc(t, a, tc.request, 0)
			if got := sim.Used(); got != tc.segment {
				t.Errorf("device holds %d bytes, want %d", got, tc.segment)
			}
			s := a.Stats()
			pool := PoolLarge
			if tc.small {
				pool = PoolSmall
			}
			if s.Segment[pool].Current != 1 || s.ReservedBytes[pool].Current != int64(tc.segment) {
				t.Errorf("pool %v: segments %d reserved %d", pool, s.Segment[pool].Current, s.ReservedBytes[pool].Current)
			}
			mustFree(t, a, p)
			mustCheck(t, a)
		})
	}
}

// TestSplitDecisions pins when a block is split and when it is handed out
// whole.
func TestSplitDecisions(t *testing.T) {
	for _, tc := range []struct {
		name      string
		conf      string
		first     uint64 // allocated first, to create the segment
		blocks    int    // blocks in the segment after the first malloc
		remainder uint64 // size of the free remainder (0: none)
	}{
		{"small: a 1 MiB request splits its 2 MiB segment", "", miB, 2, miB},
		{"small: exact fit does not split", "", 2 * miB, 0, 0}, // 2 MiB is large pool
		{"large: remainder > 1 MiB splits", "", 18*miB + 512, 2, 2*miB - 512},
		{"large: remainder of exactly 1 MiB does not split", "", 19 * miB, 1, 0},
		{"large: remainder below 1 MiB does not split", "", 19*miB + 512, 1, 0},
		{"large below max_split_size splits", "max_split_size_mb:40", 5 * miB, 2, 15 * miB},
		{"large: a request rounded to 2 MiB fills its segment", "", 16 * miB, 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, _ := newTestAllocator(t, giB, tc.conf)
			p := mustMalloc(t, a, tc.first, 0)
			snap := a.Snapshot()
			if tc.blocks == 0 {
				// 2 MiB goes to the large pool: a 20 MiB segment, split.
				if len(snap.Segments) != 1 || snap.Segments[0].TotalSize != 20*miB || len(snap.Segments[0].Blocks) != 2 {
					t.Fatalf("segments: %+v", snap.Segments)
				}
				mustFree(t, a, p)
				return
			}
			seg := snap.Segments[0]
			if len(seg.Blocks) != tc.blocks {
				t.Fatalf("segment has %d blocks, want %d: %+v", len(seg.Blocks), tc.blocks, seg.Blocks)
			}
			if tc.remainder != 0 && seg.Blocks[1].Size != tc.remainder {
				t.Errorf("remainder %d, want %d", seg.Blocks[1].Size, tc.remainder)
			}
			mustFree(t, a, p)
			mustCheck(t, a)
		})
	}
}

// TestBestFit: the smallest fitting block of the stream wins, the lowest
// address among equals; blocks never cross streams.
func TestBestFit(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "")
	s1, _ := sim.StreamCreate()
	// Three small segments' worth of holes: allocate 3 × 2 MiB segments
	// fully, then free blocks of 64 KiB, 32 KiB, 32 KiB.
	var ps [3][]cudart.Ptr
	for i := range ps {
		for range 2 * miB / (32 * kiB) {
			ps[i] = append(ps[i], mustMalloc(t, a, 32*kiB, 0))
		}
	}
	if got := a.Stats().Segment[PoolAll].Current; got != 3 {
		t.Fatalf("%d segments, want 3", got)
	}
	// hole A: 64 KiB in segment 0 (two neighbours); hole B, C: 32 KiB in
	// segments 2 and 1.
	mustFree(t, a, ps[0][4])
	mustFree(t, a, ps[0][5])
	mustFree(t, a, ps[2][7])
	mustFree(t, a, ps[1][9])
	// 20 KiB fits all three; best fit is a 32 KiB hole, lowest address:
	// segment 1's (addresses grow with segment order in Sim).
	p := mustMalloc(t, a, 20*kiB, 0)
	if p != ps[1][9] {
		t.Errorf("best fit took %#x, want the lower 32 KiB hole %#x", uint64(p), uint64(ps[1][9]))
	}
	// A request on another stream never takes stream 0's blocks.
	before := a.Stats().Segment[PoolAll].Current
	q := mustMalloc(t, a, 20*kiB, s1)
	if a.Stats().Segment[PoolAll].Current != before+1 {
		t.Errorf("a request on stream %d reused another stream's block", s1)
	}
	mustFree(t, a, q)
	mustFree(t, a, p)
	for i := range ps {
		for j, x := range ps[i] {
			if (i == 0 && (j == 4 || j == 5)) || (i == 2 && j == 7) || (i == 1 && j == 9) {
				continue
			}
			mustFree(t, a, x)
		}
	}
	mustCheck(t, a)
	if s := a.Stats(); s.InactiveSplit[PoolAll].Current != 0 || s.Allocation[PoolAll].Current != 0 {
		t.Errorf("after freeing everything: %d inactive split blocks, %d allocations", s.InactiveSplit[PoolAll].Current, s.Allocation[PoolAll].Current)
	}
}

// TestMaxSplitSize: with max_split_size set, an oversize cached block never
// serves a smaller request, and an oversize request takes a block at most
// max_non_split_rounding larger.
func TestMaxSplitSize(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "max_split_size_mb:64")
	big := mustMalloc(t, a, 100*miB, 0)
	mustFree(t, a, big)
	used := sim.Used()
	// 30 MiB is below max_split_size: the cached 100 MiB block is refused.
	p := mustMalloc(t, a, 30*miB, 0)
	if sim.Used() == used {
		t.Errorf("a 30 MiB request reused the oversize 100 MiB block")
	}
	// 90 MiB ≥ max_split_size, and 100 < 90 + 20: reuse.
	used = sim.Used()
	q := mustMalloc(t, a, 90*miB, 0)
	if sim.Used() != used || q != big {
		t.Errorf("a 90 MiB request did not reuse the 100 MiB block")
	}
	mustFree(t, a, q)
	// 70 MiB: 100 ≥ 70 + 20, too wasteful: a new segment.
	used = sim.Used()
	r := mustMalloc(t, a, 70*miB, 0)
	if sim.Used() == used {
		t.Errorf("a 70 MiB request reused the 100 MiB block despite max_non_split_rounding")
	}
	s := a.Stats()
	if s.OversizeAllocations.Current != 1 || s.OversizeSegments.Current != 2 {
		t.Errorf("oversize allocations %d segments %d, want 1 and 2", s.OversizeAllocations.Current, s.OversizeSegments.Current)
	}
	if s.MaxSplitSize != int64(64*miB) {
		t.Errorf("max_split_size stat %d", s.MaxSplitSize)
	}
	mustFree(t, a, r)
	mustFree(t, a, p)
}

func TestCoalesce(t *testing.T) {
	a, _ := newTestAllocator(t, giB, "")
	var ps []cudart.Ptr
	for range 4 {
		ps = append(ps, mustMalloc(t, a, 100*kiB, 0))
	}
	// Free in an order that exercises merge with prev, next and both.
	for _, i := range []int{1, 3, 2, 0} {
		mustFree(t, a, ps[i])
		mustCheck(t, a)
	}
	snap := a.Snapshot()
	if len(snap.Segments) != 1 || len(snap.Segments[0].Blocks) != 1 || snap.Segments[0].Blocks[0].Size != 2*miB {
		t.Fatalf("after freeing all, the segment is not one free block: %+v", snap.Segments)
	}
}

func TestDefaultConfigUnlimitedSplit(t *testing.T) {
	if DefaultConfig().MaxSplitSize != math.MaxUint64 {
		t.Fatal("default max_split_size must be unlimited")
	}
}
