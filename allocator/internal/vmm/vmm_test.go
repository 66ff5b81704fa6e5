package vmm

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

const miB = 1 << 20

// space is a Space over a simulated device, with the segment table its
// caller would keep.
type space struct {
	*Space
	sim   *simdev.Sim
	table []*blocks.Segment
}

// newSpace returns a Space over a simulated device of capacity bytes,
// with the allocator's pages; at the end of the test it checks the
// Space, closes it and checks that the device holds nothing.
func newSpace(t *testing.T, capacity uint64, reclaim bool) *space {
	t.Helper()
	return newSpaceConfig(t, Config{Total: capacity, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: reclaim})
}

// newSpaceConfig is newSpace with the configuration cfg.
func newSpaceConfig(t *testing.T, cfg Config) *space {
	t.Helper()
	return newSpaceOn(t, cfg, simdev.Config{Capacity: cfg.Total})
}

// newSpaceOn is newSpaceConfig on a simulated device configured by sc.
func newSpaceOn(t *testing.T, cfg Config, sc simdev.Config) *space {
	t.Helper()
	sim, err := simdev.New(sc)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.ErrorLevel)
	s := &space{Space: New(sim, sim, cfg, zap.New(core)), sim: sim}
	t.Cleanup(func() {
		if errs := s.Check(s.table); len(errs) > 0 {
			t.Errorf("Check at end of test: %v", errors.Join(errs...))
		}
		if _, errs := s.Close(); len(errs) > 0 {
			t.Errorf("Close: %v", errors.Join(errs...))
		}
		c := sim.VMMCounters()
		if used := sim.Used(); used != 0 || c.LiveHandles != 0 || c.LiveMappings != 0 || c.LiveReservations != 0 {
			t.Errorf("after Close the device holds %d bytes, %d handles, %d mappings, %d reservations",
				used, c.LiveHandles, c.LiveMappings, c.LiveReservations)
		}
		if n := sim.Counters().LiveEvents; n != 0 {
			t.Errorf("after Close the device holds %d events", n)
		}
		for _, e := range logs.All() { // a failed device call the Space could only log
			t.Errorf("logged: %s %v", e.Message, e.ContextMap())
		}
	})
	return s
}

func newPool(small bool) Pool {
	return Pool{Free: blocks.NewStreamFreeIndex(0), Recycler: new(blocks.Recycler), Small: small}
}

// find returns the block Find finds on stream 0, or the unmapped block of
// a new range, entered in the table as the allocator does.
func (s *space) find(t *testing.T, p Pool, size uint64) *blocks.Block {
	t.Helper()
	if b := s.Find(p, 0, size); b != nil {
		return b
	}
	return s.reserveIn(t, p, 0)
}

// reserveIn reserves a range of pool p for stream, entered in the table
// as the allocator does, and returns its unmapped block.
func (s *space) reserveIn(t *testing.T, p Pool, stream uint64) *blocks.Block {
	t.Helper()
	b, err := s.Reserve(p, stream)
	if err != nil {
		t.Fatal(err)
	}
	b.Segment.Index = len(s.table)
	s.table = append(s.table, b.Segment)
	return b
}

// reserveOn reserves a large-pool range for stream, entered in the table
// as the allocator does, and returns its pool and its unmapped block.
func (s *space) reserveOn(t *testing.T, stream uint64) (Pool, *blocks.Block) {
	t.Helper()
	p := Pool{Free: blocks.NewStreamFreeIndex(stream), Recycler: new(blocks.Recycler)}
	return p, s.reserveIn(t, p, stream)
}

// freeThenAllocated maps the first 40 MiB of b, an unmapped block of pool
// p, and splits them into a free 20 MiB block, indexed and returned first,
// and an allocated one after it; the rest of b's range stays unmapped.
func (s *space) freeThenAllocated(t *testing.T, p Pool, b *blocks.Block) (free, alloc *blocks.Block) {
	t.Helper()
	if _, err := s.MapBlock(p, b, 40*miB); err != nil {
		t.Fatal(err)
	}
	p.Free.Delete(b)
	alloc = blocks.Split(b, 20*miB, p.Recycler)
	alloc.Allocated = true
	p.Free.Insert(b)
	return b, alloc
}

// runs lists the run lengths of the first range, in page order.
func (s *space) runs() []uint32 {
	var out []uint32
	for _, n := range s.segs[0].run {
		if n != 0 {
			out = append(out, n)
		}
	}
	return out
}

// TestMapBlockRuns: MapBlock maps whole pages in runs (a quarter of the
// growth, at least 1/16 of the largest allocated figure, at most 64 MiB;
// one page per handle in the small pool and without reclaim) and returns
// what it mapped; UnmapBlock and ReleaseRange give it all back.
func TestMapBlockRuns(t *testing.T) {
	for _, tc := range []struct {
		name      string
		small     bool
		reclaim   bool
		allocMark uint64
		size      uint64
		wantRuns  []uint32
	}{
		{"30 MiB in 2 MiB pages", false, true, 0, 30 * miB, []uint32{4, 4, 4, 3}},
		{"8 MiB in 2 MiB pages", false, true, 0, 8 * miB, []uint32{1, 1, 1, 1}},
		{"a partial page rounds up", false, true, 0, 5*miB + 1, []uint32{1, 1, 1}},
		{"600 MiB: runs of 64 MiB", false, true, 0, 600 * miB, []uint32{32, 32, 32, 32, 32, 32, 32, 32, 32, 12}},
		{"1/16 of 128 MiB allocated: runs of 8 MiB", false, true, 128 * miB, 30 * miB, []uint32{4, 4, 4, 3}},
		{"1/16 of 256 MiB allocated: runs of 16 MiB", false, true, 256 * miB, 30 * miB, []uint32{8, 7}},
		{"1/16 of 2 GiB allocated, capped at 64 MiB", false, true, 2 << 30, 30 * miB, []uint32{15}},
		{"PyTorch's 20 MiB pages", false, false, 0, 30 * miB, []uint32{1, 1}},
		{"small pool", true, true, 1 << 30, 6 * miB, []uint32{1, 1, 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSpace(t, 1<<30, tc.reclaim)
			s.cfg.Exact = true // the runs of what the request needs (TestRoundEnd has the rounding)
			s.allocMark = tc.allocMark
			p := newPool(tc.small)
			b := s.find(t, p, tc.size)
			m, err := s.MapBlock(p, b, tc.size)
			if err != nil {
				t.Fatal(err)
			}
			n := m.Bytes
			page := s.PageSize(tc.small)
			want := (tc.size + page - 1) / page * page
			if runs := s.runs(); n != want || !slices.Equal(runs, tc.wantRuns) {
				t.Fatalf("mapped %d bytes in runs %v; want %d in %v", n, runs, want, tc.wantRuns)
			}
			if s.Reserved() != want || m.Moved != 0 || s.sim.Used() != want || b.Segment.Mapped != want {
				t.Fatalf("reserved %d, %d pages moved, device %d, segment %d; want %d, none moved",
					s.Reserved(), m.Moved, s.sim.Used(), b.Segment.Mapped, want)
			}
			if b.Unmapped || b.Size != want || b.Next == nil || !b.Next.Unmapped || !b.Indexed() {
				t.Fatalf("mapped block %v (next %v), want %d bytes, indexed, before the unmapped rest", b, b.Next, want)
			}
			if errs := s.Check(s.table); len(errs) > 0 {
				t.Fatal(errors.Join(errs...))
			}
			if got := s.Unmappable(b); got != want {
				t.Fatalf("Unmappable = %d, want %d", got, want)
			}
			u, start, un, released, err := s.UnmapBlock(p, b, false, 0)
			if err != nil || u == nil || start != b.Segment.Ptr || un != want || released != want || u.Prev != nil || u.Next != nil {
				t.Fatalf("UnmapBlock = %v, %#x, %d, %d released, %v; want the whole range unmapped and released, %d bytes", u, start, un, released, err, want)
			}
			if s.Reserved() != 0 || s.sim.Used() != 0 {
				t.Fatalf("after unmapping: reserved %d, device %d", s.Reserved(), s.sim.Used())
			}
			seg := u.Segment
			if unused := s.Unused(nil, 0); len(unused) != 1 || unused[0] != seg {
				t.Fatalf("Unused = %v, want the one range", unused)
			}
			if err := s.ReleaseRange(seg); err != nil {
				t.Fatal(err)
			}
			s.table = nil
			p.Recycler.Put(u)
		})
	}
}

// TestRoundEnd: a large-pool growth with reclaim ends on the next 20 MiB
// boundary of its range: coarsely always, by default only while reserved
// memory stays within reclaim's limit (the high-water mark, or allocated
// memory plus the slack) plus the headroom; never past the block, the
// ceiling, or during a capture, and not at all in the small pool,
// without reclaim or with Config.Exact. Pages are 2 MiB: a mapping of
// pages [0, 3) ends at page 10 when it rounds whole.
func TestRoundEnd(t *testing.T) {
	for _, tc := range []struct {
		name                string
		cfg                 func(*Config)
		small, capturing    bool
		reserved, mark      uint64 // MiB
		allocNow, allocMark uint64 // MiB
		ceiling, limit      uint64 // MiB, pages
		want                uint64 // pages
	}{
		// allocMark 640 MiB: slack 20 MiB; mark 640: headroom 4 MiB.
		{name: "within the limit: to the boundary", reserved: 0, mark: 640, allocNow: 6, allocMark: 640, limit: 100, want: 10},
		{name: "to the mark", reserved: 600, mark: 640, allocNow: 100, allocMark: 640, limit: 100, want: 10},
		{name: "slack and headroom: partly", reserved: 640, mark: 640, allocNow: 630, allocMark: 640, limit: 100, want: 7},
		{name: "at the limit: what the request needs", reserved: 700, mark: 700, allocNow: 600, allocMark: 640, limit: 100, want: 3},
		{name: "the block ends first", reserved: 0, mark: 640, allocNow: 6, allocMark: 640, limit: 5, want: 5},
		{name: "the ceiling", reserved: 0, mark: 640, allocNow: 6, allocMark: 640, ceiling: 12, limit: 100, want: 6},
		{name: "during a capture", capturing: true, reserved: 0, mark: 640, allocNow: 6, allocMark: 640, limit: 100, want: 3},
		{name: "small pool", small: true, reserved: 0, mark: 640, allocNow: 6, allocMark: 640, limit: 100, want: 3},
		{name: "without reclaim", cfg: func(c *Config) { c.Reclaim = false }, reserved: 0, mark: 640, allocNow: 6, allocMark: 640, limit: 100, want: 3},
		{name: "exact", cfg: func(c *Config) { c.Exact = true }, reserved: 0, mark: 640, allocNow: 6, allocMark: 640, limit: 100, want: 3},
		{name: "coarse: past the limit", cfg: func(c *Config) { c.Coarse = true }, reserved: 700, mark: 700, allocNow: 600, allocMark: 640, limit: 100, want: 10},
		{name: "coarse: the ceiling", cfg: func(c *Config) { c.Coarse = true }, reserved: 700, mark: 700, allocNow: 600, allocMark: 640, ceiling: 712, limit: 100, want: 6},
		{name: "coarse exact: still coarse", cfg: func(c *Config) { c.Coarse, c.Exact = true, true }, reserved: 700, mark: 700, allocNow: 600, allocMark: 640, limit: 100, want: 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true}
			if tc.cfg != nil {
				tc.cfg(&cfg)
			}
			s := New(nil, nil, cfg, zap.NewNop())
			s.reserved, s.mark, s.allocNow, s.allocMark = tc.reserved*miB, tc.mark*miB, tc.allocNow*miB, tc.allocMark*miB
			s.ceiling, s.capturing = tc.ceiling*miB, tc.capturing
			seg := &blocks.Segment{PageSize: 2 * miB, Small: tc.small}
			if got := s.roundEnd(seg, 0, 3, tc.limit); got != tc.want {
				t.Errorf("roundEnd = page %d, want %d", got, tc.want)
			}
		})
	}
}

// TestSmallAtLimit: SmallAtLimit says what SmallGrowthExcess would,
// changing nothing, and says no whenever SmallGrowthExcess would raise
// the allocated high-water mark, so that a caller with a bound of the
// allocated figure gets the exact figure's answer.
func TestSmallAtLimit(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		reserved, mark       uint64 // MiB
		allocated, allocMark uint64 // MiB
		cachedPage           bool   // a one-page small run in the handle cache
		want                 bool
	}{
		// allocMark 640 MiB: slack 20 MiB; a small page is 2 MiB.
		{name: "fragmented at the mark", reserved: 700, mark: 700, allocated: 600, allocMark: 640, want: true},
		{name: "within the slack", reserved: 700, mark: 700, allocated: 682, allocMark: 682, want: false},
		{name: "just past the slack", reserved: 700, mark: 700, allocated: 680, allocMark: 682, want: true},
		{name: "below the mark", reserved: 690, mark: 700, allocated: 600, allocMark: 640, want: false},
		{name: "a cached page serves it", reserved: 700, mark: 700, allocated: 600, allocMark: 640, cachedPage: true, want: false},
		{name: "past the allocated mark: no answer", reserved: 700, mark: 700, allocated: 650, allocMark: 640, want: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := New(nil, nil, Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true}, zap.NewNop())
			s.reserved, s.mark, s.allocMark = tc.reserved*miB, tc.mark*miB, tc.allocMark*miB
			if tc.cachedPage {
				s.cache = append(s.cache, cachedRun{page: 2 * miB, pages: 1})
			}
			if got := s.SmallAtLimit(tc.allocated * miB); got != tc.want {
				t.Errorf("SmallAtLimit = %v, want %v", got, tc.want)
			}
			if s.allocMark != tc.allocMark*miB {
				t.Errorf("SmallAtLimit moved the allocated mark to %d MiB", s.allocMark/miB)
			}
			if tc.allocated <= tc.allocMark {
				if exact := s.SmallGrowthExcess(tc.allocated*miB) > 0; exact != tc.want {
					t.Errorf("SmallGrowthExcess says %v, SmallAtLimit %v", exact, tc.want)
				}
			}
			// A bound gives the exact figure's answer: yes for a bound is yes below it.
			if tc.want {
				for below := uint64(0); below <= tc.allocated; below += 10 {
					if !s.SmallAtLimit(below * miB) {
						t.Errorf("SmallAtLimit(%d MiB) = false below a bound of %d MiB that says true", below, tc.allocated)
					}
				}
			}
		})
	}
}

// TestMapBlockRoundingRefused: a growth whose rounding the device cannot
// back maps what the request needs instead of failing.
func TestMapBlockRoundingRefused(t *testing.T) {
	s := newSpace(t, 16*miB, true) // a range of 18 MiB, 16 of them on the device
	s.allocMark, s.mark = 1<<30, 1<<30
	p := newPool(false)
	b := s.find(t, p, 6*miB)
	if got := s.roundEnd(b.Segment, 0, 3, b.Size/(2*miB)); got != 9 {
		t.Fatalf("roundEnd = page %d, want 9 (the end of the range)", got)
	}
	m, err := s.MapBlock(p, b, 6*miB)
	if err != nil {
		t.Fatal(err)
	}
	if m.Bytes != 6*miB || s.Reserved() != 6*miB || s.sim.Used() != 6*miB {
		t.Fatalf("mapped %d bytes, reserved %d, device %d; want 6 MiB each", m.Bytes, s.Reserved(), s.sim.Used())
	}
	u, _, _, _, err := s.UnmapBlock(p, b, false, 0)
	if err != nil || u == nil {
		t.Fatalf("UnmapBlock = %v, %v", u, err)
	}
	if err := s.ReleaseRange(u.Segment); err != nil {
		t.Fatal(err)
	}
	s.table = nil
	p.Recycler.Put(u)
}

// TestShedUnfit: before a mapping creates memory, the cached runs it
// cannot place (longer than the gap) are released, the longest first,
// until as much as it creates is released; runs that fit stay cached.
func TestShedUnfit(t *testing.T) {
	s := newSpace(t, 1<<30, true)
	seg := &blocks.Segment{PageSize: 2 * miB}
	for _, pages := range []uint64{8, 2, 6} {
		h, err := s.create(pages * 2 * miB)
		if err != nil {
			t.Fatal(err)
		}
		s.putCached(cachedRun{h: h, pages: pages, page: 2 * miB})
		s.reserved += pages * 2 * miB
	}
	// 10 MiB to create in a gap of 4 pages: the 8-page run (16 MiB)
	// covers it; the 6-page run, which does not fit either, stays.
	s.shedUnfit(seg, 10*miB, 4)
	if s.shed != [2]uint64{16 * miB, 0} || s.Reserved() != 16*miB || s.cachedBytes != 16*miB || len(s.cache) != 2 {
		t.Fatalf("shed %v, reserved %d, cached %d in %d runs; want 16 MiB shed, 16 MiB left in 2 runs",
			s.shed, s.Reserved(), s.cachedBytes, len(s.cache))
	}
	// 40 MiB more: the 6-page run goes; the 2-page run fits and stays.
	s.shedUnfit(seg, 40*miB, 4)
	if s.shed[0] != 28*miB || s.Reserved() != 4*miB || len(s.cache) != 1 || s.cache[0].pages != 2 {
		t.Fatalf("shed %v, reserved %d, cache %v; want 28 MiB shed, the 2-page run left", s.shed, s.Reserved(), s.cache)
	}
	if c := s.sim.VMMCounters(); c.Releases != 2 {
		t.Fatalf("%d releases, want 2", c.Releases)
	}
	s.ReleaseCache(false)
}

// TestCoarse: with Config.Coarse a large-pool mapping ends on a 20 MiB
// boundary of its range and is one run (at most 64 MiB); UnmapBlock told
// the bytes still wanted unmaps only the last runs of a block that cover
// them; Choose leaves out blocks whose whole runs come to less than
// 64 MiB. The small pool maps as before.
func TestCoarse(t *testing.T) {
	s := newSpaceConfig(t, Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true, Coarse: true})
	p := newPool(false)
	// 4 MiB, then 30 and 100 MiB more: to 20, 40 and 140 MiB, in runs of
	// 10, 10, and 32 + 18 pages.
	b := s.find(t, p, 4*miB)
	mapTo := func(size uint64) {
		t.Helper()
		if _, err := s.MapBlock(p, b, size); err != nil {
			t.Fatal(err)
		}
	}
	mapTo(4 * miB)
	if b.Size != 20*miB || !slices.Equal(s.runs(), []uint32{10}) {
		t.Fatalf("4 MiB mapped %d bytes in runs %v; want 20 MiB in one run", b.Size, s.runs())
	}
	b = b.Next
	mapTo(20 * miB) // exactly to the next boundary
	b = b.Next
	mapTo(100 * miB)
	if runs := s.runs(); !slices.Equal(runs, []uint32{10, 10, 32, 18}) || s.Reserved() != 140*miB {
		t.Fatalf("runs %v, reserved %d; want [10 10 32 18], 140 MiB", runs, s.Reserved())
	}
	free := s.segs[0].seg.Head // the three growths merged into one free block
	if free.Size != 140*miB || free.Unmapped {
		t.Fatalf("the mapped part is %v, want one free block of 140 MiB", free)
	}
	// The whole block is a candidate; 30 MiB wanted takes only the last run
	// (36 MiB), 100 MiB the last two.
	if got := s.Choose([]*blocks.Block{free}, 30*miB); len(got) != 1 {
		t.Fatalf("Choose = %v, want the 140 MiB block", got)
	}
	u, _, n, released, err := s.UnmapBlock(p, free, true, 30*miB)
	if err != nil || u == nil || n != 36*miB || released != 0 || s.Reserved() != 140*miB {
		t.Fatalf("UnmapBlock(most 30 MiB) = %v, %d bytes, %d released, %v, reserved %d; want the last 36 MiB run cached", u, n, released, err, s.Reserved())
	}
	if free.Size != 104*miB || free.Unmapped || !free.Indexed() {
		t.Fatalf("the rest is %v, want 104 MiB mapped and free", free)
	}
	// 104 MiB of runs 10, 10, 32 pages: most 70 MiB takes the last two.
	_, _, n, _, err = s.UnmapBlock(p, free, true, 70*miB)
	if err != nil || n != 84*miB {
		t.Fatalf("UnmapBlock(most 70 MiB) unmapped %d bytes, %v; want the last two runs, 84 MiB", n, err)
	}
	// 20 MiB left in one run: too short for coarse reclaim to choose.
	if free.Size != 20*miB {
		t.Fatalf("the rest is %v, want 20 MiB", free)
	}
	if got := s.Choose([]*blocks.Block{free}, 2*miB); len(got) != 0 {
		t.Fatalf("Choose took %v, a block of less than 64 MiB of runs", got)
	}
	// The small pool: one page per run, no boundary.
	ps := newPool(true)
	sb := s.find(t, ps, 4*miB)
	if m, err := s.MapBlock(ps, sb, 3*miB); err != nil || m.Bytes != 4*miB {
		t.Fatalf("small pool mapped %d bytes, %v; want 4 MiB", m.Bytes, err)
	}
}

// TestMapBlockFailures: a failed Create or Map leaves nothing mapped and
// no handle made; out of memory comes back as the device's own error, any
// other failure wrapped with what was being done.
func TestMapBlockFailures(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name    string
		fail    int   // the Create that fails
		err     error // what it fails with (nil: out of memory)
		size    uint64
		wantOOM bool
		want    string
	}{
		{"first create out of memory", 1, nil, 30 * miB, true, ""},
		{"third create out of memory", 3, nil, 30 * miB, true, ""},
		{"create fails otherwise", 2, boom, 30 * miB, false, "creating a 8388608-byte run"},
		{"larger than the device", 0, nil, 80 * miB, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSpace(t, 64*miB, true)
			p := newPool(false)
			b := s.find(t, p, tc.size)
			if tc.fail > 0 {
				s.sim.Faults().FailMalloc(tc.fail, tc.err)
			}
			m, err := s.MapBlock(p, b, tc.size)
			if m != (Mapping{}) || err == nil {
				t.Fatalf("MapBlock = %+v, %v; want a failure", m, err)
			}
			if oom := errors.Is(err, cudart.ErrOutOfMemory); oom != tc.wantOOM || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("MapBlock: %v; want out of memory %v, a message containing %q", err, tc.wantOOM, tc.want)
			}
			if tc.err != nil && !errors.Is(err, boom) {
				t.Fatalf("MapBlock: %v does not wrap the device's error", err)
			}
			c := s.sim.VMMCounters()
			if s.Reserved() != 0 || c.LiveHandles != 0 || c.LiveMappings != 0 || !b.Unmapped || b.Next != nil {
				t.Fatalf("after the failure: reserved %d, %d handles and %d mappings live, block %v",
					s.Reserved(), c.LiveHandles, c.LiveMappings, b)
			}
		})
	}
}

// TestReclaimMovesRuns: the runs UnmapBlock keeps (the handle cache) from
// one stream's range are mapped again into another's, reported as moved
// pages, with no handle created and reserved memory unchanged;
// GrowthExcess reports the growth past the high-water mark, less what the
// cache holds, and Choose leaves out the blocks of the request.
func TestReclaimMovesRuns(t *testing.T) {
	s := newSpace(t, 1<<30, true)
	p0 := newPool(false)
	b0 := s.find(t, p0, 40*miB)
	if _, err := s.MapBlock(p0, b0, 40*miB); err != nil {
		t.Fatal(err)
	}
	// Stream 1's range: nothing mapped yet.
	p1, b1 := s.reserveOn(t, 1)
	// 40 MiB reserved is the mark; 20 MiB allocated allows no slack.
	if got := s.GrowthExcess(b1, 20*miB, 20*miB); got != 20*miB {
		t.Fatalf("GrowthExcess = %d MiB, want 20", got/miB)
	}
	list := s.Choose([]*blocks.Block{b0, b1}, 20*miB)
	if len(list) != 1 || list[0] != b0 {
		t.Fatalf("Choose = %v, want stream 0's free block", list)
	}
	if _, err := s.Settle(list, false, 1); err != nil {
		t.Fatal(err)
	}
	if u, _, _, released, err := s.UnmapBlock(p0, b0, true, 0); err != nil || u == nil || released != 0 {
		t.Fatalf("UnmapBlock = %v, %d released, %v; want it unmapped into the cache", u, released, err)
	}
	if s.Reserved() != 40*miB || s.Cached(false) != 40*miB || s.Cached(true) != 0 {
		t.Fatalf("after unmapping into the cache: reserved %d MiB, cached %d MiB", s.Reserved()/miB, s.Cached(false)/miB)
	}
	if got := s.GrowthExcess(b1, 20*miB, 20*miB); got != 0 {
		t.Fatalf("GrowthExcess with the cache holding the pages = %d MiB, want 0", got/miB)
	}
	m, err := s.MapBlock(p1, b1, 20*miB)
	if err != nil {
		t.Fatal(err)
	}
	// The cache holds four 10 MiB runs (5 pages each): two are mapped.
	if m.Moved != 10 || m.Across != 10 || m.New != 0 || m.Bytes != 20*miB || s.Reserved() != 40*miB || s.Cached(false) != 20*miB {
		t.Fatalf("moved %d pages (%d across), %d MiB new of %d, reserved %d MiB, cached %d MiB; want 10 (10), 0 of 20, 40, 20",
			m.Moved, m.Across, m.New/miB, m.Bytes/miB, s.Reserved()/miB, s.Cached(false)/miB)
	}
	if c := s.sim.VMMCounters(); c.Creates != 4 || s.Calls().Creates != 4 || s.Calls().Maps != 6 || s.Calls().Unmaps != 1 {
		t.Fatalf("%d handles created (%+v), want the first mapping's 4 only, 6 maps and 1 unmap", c.Creates, s.Calls())
	}
	if n := s.ReleaseCache(false); n != 20*miB || s.Reserved() != 20*miB || s.sim.Used() != 20*miB {
		t.Fatalf("ReleaseCache = %d MiB, reserved %d MiB, device %d MiB after; want 20, 20, 20", n/miB, s.Reserved()/miB, s.sim.Used()/miB)
	}
}

// TestFit: among free blocks of the best fit's size and up, Fit moves to
// the next larger block while its size with the unmapped pages after it
// is smaller, which leaves a segment's growable end for what nothing else
// serves.
func TestFit(t *testing.T) {
	for _, tc := range []struct {
		name  string
		other uint64 // a whole free block of another range
		want  string
	}{
		{"the fixed block is smaller than the growable one's reach", 12 * miB, "other"},
		{"the growable block reaches less far", 130 * miB, "growable"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			free := blocks.NewStreamFreeIndex(0)
			segA := &blocks.Segment{Ptr: 1 << 32, Size: 110 * miB, Expandable: true, PageSize: 2 * miB}
			grow := &blocks.Block{Ptr: segA.Ptr, Size: 10 * miB, Segment: segA}
			tail := &blocks.Block{Ptr: segA.Ptr + 10*miB, Size: 100 * miB, Segment: segA, Unmapped: true, Prev: grow}
			grow.Next, segA.Head = tail, grow
			segB := &blocks.Segment{Ptr: 2 << 32, Size: tc.other, Expandable: true, PageSize: 2 * miB}
			other := &blocks.Block{Ptr: segB.Ptr, Size: tc.other, Segment: segB}
			segB.Head = other
			free.Insert(grow)
			free.Insert(other)
			got := Fit(free, free.LowerBound(0, 8*miB))
			if name := map[*blocks.Block]string{grow: "growable", other: "other"}[got]; name != tc.want {
				t.Fatalf("Fit = %v (%s), want the %s block", got, name, tc.want)
			}
		})
	}
}

// TestFitMatchesWalk: over random ranges of free, allocated and unmapped
// blocks, Fit returns what get_free_block's walk returns when it looks at
// the next block every time, as PyTorch's does: the shortcut that skips
// the look for a block with no unmapped pages after it changes nothing.
func TestFitMatchesWalk(t *testing.T) {
	walk := func(free *blocks.FreeIndex, b *blocks.Block) *blocks.Block {
		for b.Segment.Expandable {
			next := free.After(b)
			if next == nil || expandableSize(next) >= expandableSize(b) {
				break
			}
			b = next
		}
		return b
	}
	rng := rand.New(rand.NewPCG(7, 11))
	for trial := range 300 {
		free := blocks.NewStreamFreeIndex(0)
		for seg := range 1 + rng.IntN(6) {
			sg := &blocks.Segment{Ptr: uint64(seg+1) << 36, Expandable: true, PageSize: 2 * miB}
			var prev *blocks.Block
			at := sg.Ptr
			for range 1 + rng.IntN(8) {
				b := &blocks.Block{Ptr: at, Size: uint64(1+rng.IntN(40)) * miB, Segment: sg, Prev: prev}
				switch k := rng.IntN(3); {
				case k == 0 && (prev == nil || !prev.Unmapped):
					b.Unmapped = true
				case k == 1:
					b.Allocated = true
				}
				if prev == nil {
					sg.Head = b
				} else {
					prev.Next = b
				}
				if !b.Unmapped && !b.Allocated && (prev == nil || prev.Allocated || prev.Unmapped) {
					free.Insert(b) // free blocks are merged: never two in a row
				} else if !b.Unmapped && !b.Allocated {
					b.Allocated = true
				}
				at += b.Size
				sg.Size += b.Size
				prev = b
			}
		}
		for range 20 {
			size := uint64(1+rng.IntN(48)) * miB
			b := free.LowerBound(0, size)
			if b == nil {
				continue
			}
			if got, want := Fit(free, b), walk(free, b); got != want {
				t.Fatalf("trial %d, %d MiB: Fit = %v, the walk %v", trial, size/miB, got, want)
			}
		}
	}
}

// TestCheckFindsCorruption: Check compares pages, runs, handles, blocks
// and the segment table.
func TestCheckFindsCorruption(t *testing.T) {
	s := newSpace(t, 1<<30, true)
	p := newPool(false)
	b := s.find(t, p, 30*miB)
	if _, err := s.MapBlock(p, b, 30*miB); err != nil { // runs of 4, 4, 4 and 3 pages
		t.Fatal(err)
	}
	es := s.segs[0]
	for _, tc := range []struct {
		name    string
		corrupt func()
		want    string
	}{
		{"page unmapped under a mapped block", func() { es.mapped[1] = false }, "page 1"},
		{"run cut short", func() { es.run[0] = 3 }, "page 3 starts a run of 0 pages"},
		{"run over its neighbour", func() { es.run[0] = 5 }, "broken at page 4"},
		{"run past the limit", func() { es.run[0], es.run[4], es.run[8], es.run[12] = 40, 0, 0, 0 }, "run of 40 pages"},
		{"run without a handle", func() { es.handles[4] = 0 }, "page 4 has no handle"},
		{"segment list", func() { s.segs = nil }, "0 registered"},
		{"not in the table", func() { s.table = []*blocks.Segment{{Expandable: true}} }, "not in the segment list"},
		{"mapped bytes", func() { es.seg.Mapped += 20 * miB }, "15 pages mapped"},
		{"reserved", func() { s.reserved += 20 * miB }, "reserved"},
		{"cached run also mapped", func() { s.putCached(cachedRun{h: es.handles[0], pages: 4, page: 2 * miB}); s.reserved += 8 * miB }, "mapped and in the handle cache"},
		{"cached bytes", func() { s.cachedBytes += 2 * miB }, "2097152 counted"},
		{"standby over mapped pages", func() { es.standby[0], es.sbHandles[0] = 4, es.handles[0] }, "over mapped pages"},
		{"standby not listed", func() { es.grow(20); es.standby[16], es.sbHandles[16] = 1, 999 }, "is not listed"},
		{"standby of no run", func() { es.grow(20); es.standby[16], es.sbHandles[16] = 1, 999 }, "no run of that length"},
		{"standby listed nowhere", func() { s.addStandby(es.handles[0], place{es, 3}) }, "does not hold it"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			saved, savedSegs, savedMapped, savedRes, savedTable := slices.Clone(es.mapped), s.segs, es.seg.Mapped, s.reserved, s.table
			savedRun, savedHandles, savedCache, savedCached := slices.Clone(es.run), slices.Clone(es.handles), slices.Clone(s.cache), s.cachedBytes
			savedSB, savedSBH, savedSBP := slices.Clone(es.standby), slices.Clone(es.sbHandles), slices.Clone(es.sbPend)
			tc.corrupt()
			err := errors.Join(s.Check(s.table)...)
			es.mapped, s.segs, es.seg.Mapped, s.reserved, s.table = saved, savedSegs, savedMapped, savedRes, savedTable
			es.run, es.handles, s.cache, s.cachedBytes = savedRun, savedHandles, savedCache, savedCached
			es.standby, es.sbHandles, es.sbPend, s.standbys = savedSB, savedSBH, savedSBP, nil
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Check = %v, want a report containing %q", err, tc.want)
			}
		})
	}
	if errs := s.Check(s.table); len(errs) > 0 {
		t.Fatal(errors.Join(errs...))
	}
}

// TestCloseCountsFrees: Close unmaps and releases everything and counts
// one device free per contiguous mapped stretch.
func TestCloseCountsFrees(t *testing.T) {
	s := newSpace(t, 1<<30, true)
	for stream := range uint64(3) {
		p, b := s.reserveOn(t, stream)
		if stream == 2 {
			continue // reserved, nothing mapped
		}
		if _, err := s.MapBlock(p, b, 30*miB); err != nil {
			t.Fatal(err)
		}
	}
	frees, errs := s.Close()
	if frees != 2 || len(errs) > 0 || s.Reserved() != 0 {
		t.Fatalf("Close = %d frees, %v, reserved %d after; want 2, none, 0", frees, errs, s.Reserved())
	}
	s.table = nil
}

// TestStandbyReclaim: with standby mappings, a reclaim for a growth on the
// stream that owns the free block waits for nothing and unmaps nothing
// (an event is recorded instead); the growth maps the cached runs; a
// growth back at the old place takes the runs back with no call; another
// stream's mapping of runs parked without a wait waits for that event
// first; and during a capture Find leaves out pages whose standby mapping
// holds a run mapped elsewhere.
func TestStandbyReclaim(t *testing.T) {
	s := newSpaceOn(t, Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true, Standby: true},
		simdev.Config{Capacity: 1 << 30, ManualEvents: true})
	p := newPool(false)
	// [0, 20) free, [20, 40) allocated, unmapped from 40 on.
	b, a := s.freeThenAllocated(t, p, s.find(t, p, 40*miB))
	grow := func(u *blocks.Block, free *blocks.Block, stream uint64) Mapping {
		t.Helper()
		ex := s.GrowthExcess(u, 20*miB, 20*miB)
		list := s.Choose([]*blocks.Block{free}, ex)
		if ex == 0 || len(list) != 1 || list[0] != free {
			t.Fatalf("GrowthExcess = %d, Choose = %v; want a reclaim of %v", ex, list, free)
		}
		if n, err := s.Settle(list, false, stream); err != nil || n != 0 {
			t.Fatalf("Settle waited for %d streams, %v; want none", n, err)
		}
		if _, _, _, released, err := s.UnmapBlock(p, free, true, 0); err != nil || released != 0 {
			t.Fatalf("UnmapBlock: %d released, %v", released, err)
		}
		m, err := s.MapBlock(p, u, 20*miB)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	m := grow(a.Next, b, 0)
	c, calls := s.sim.Counters(), s.Calls()
	if m.Moved != 10 || m.New != 0 || calls.Unmaps != 0 || calls.Maps != 6 || c.StreamSyncs != 0 || c.EventRecords != 1 {
		t.Fatalf("moved %d pages, %d bytes new; calls %+v, %d stream syncs, %d events recorded; want 10 pages moved, none new, 6 maps, no unmap, no sync, 1 event",
			m.Moved, m.New, calls, c.StreamSyncs, c.EventRecords)
	}
	// The runs are mapped at [40, 60) and stand by at [0, 20): a growth
	// back there takes them back.
	m = grow(s.segs[0].seg.Head, a.Next, 0)
	if after := s.Calls(); m.Moved != 10 || after.Maps != calls.Maps || after.Unmaps != 0 || after.Revived != 2 || after.Waits != 0 {
		t.Fatalf("taking back: moved %d pages, calls %+v; want 10 pages, no map, no unmap, 2 runs revived, no wait", m.Moved, after)
	}
	// A reclaim for stream 0 parks them again, without a wait, and stream 1
	// maps them: it waits for the work queued on stream 0 first.
	back := s.segs[0].seg.Head
	if n, err := s.Settle([]*blocks.Block{back}, false, 0); err != nil || n != 0 {
		t.Fatalf("Settle waited for %d streams, %v; want none", n, err)
	}
	if _, _, _, _, err := s.UnmapBlock(p, back, true, 0); err != nil {
		t.Fatal(err)
	}
	p1, b1 := s.reserveOn(t, 1)
	m, err := s.MapBlock(p1, b1, 20*miB)
	if err != nil {
		t.Fatal(err)
	}
	if c := s.sim.Counters(); m.Across != 10 || m.New != 0 || s.Calls().Waits != 1 || c.EventSyncs != 1 || c.StreamSyncs != 0 {
		t.Fatalf("stream 1: %d pages across, %d new, %d waits, %d event syncs, %d stream syncs; want 10, 0, 1, 1, 0",
			m.Across, m.New, s.Calls().Waits, c.EventSyncs, c.StreamSyncs)
	}
	if errs := s.Check(s.table); len(errs) > 0 {
		t.Fatal(errors.Join(errs...))
	}
	// [0, 20) and [40, 60) of stream 0 stand by for runs now mapped in
	// stream 1's range: a capture, which may not unmap, finds no room
	// there.
	s.SetCapturing(true)
	if got := s.Find(p, 0, 20*miB); got != nil {
		t.Errorf("during a capture Find = %v, want none (the standby pages hold runs mapped elsewhere)", got)
	}
	s.SetCapturing(false)
	if got := s.Find(p, 0, 20*miB); got == nil || got.Ptr != back.Ptr {
		t.Errorf("Find = %v, want the unmapped block at %#x", got, back.Ptr)
	}
}

// TestStandbyTakenBackThenSettle: a reclaim parks its runs with the event
// it recorded, a mapping at the same place takes them all back, and the
// next Settle forgets the event: it is destroyed once, when the last
// holder lets it go (newSpaceOn fails on a logged failure to destroy it,
// and on an event left after Close).
func TestStandbyTakenBackThenSettle(t *testing.T) {
	s := newSpaceOn(t, Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true, Standby: true},
		simdev.Config{Capacity: 1 << 30, ManualEvents: true})
	p := newPool(false)
	// [0, 20) free, [20, 40) allocated.
	b, _ := s.freeThenAllocated(t, p, s.find(t, p, 40*miB))
	if n, err := s.Settle([]*blocks.Block{b}, false, 0); err != nil || n != 0 {
		t.Fatalf("Settle waited for %d streams, %v; want none", n, err)
	}
	u, _, _, _, err := s.UnmapBlock(p, b, true, 0)
	if err != nil {
		t.Fatal(err)
	}
	if errs := s.Check(s.table); len(errs) > 0 {
		t.Fatalf("Check after the reclaim: %v", errors.Join(errs...))
	}
	before := s.sim.Counters().EventDestroys
	if _, err := s.MapBlock(p, u, 20*miB); err != nil {
		t.Fatal(err)
	}
	if c := s.Calls(); c.Revived == 0 {
		t.Fatalf("the mapping took back no standby run: %+v", c)
	}
	if errs := s.Check(s.table); len(errs) > 0 {
		t.Fatalf("Check after taking the runs back: %v", errors.Join(errs...))
	}
	if _, err := s.Settle(nil, false, 0); err != nil {
		t.Fatal(err)
	}
	if n := s.sim.Counters().EventDestroys - before; n != 1 {
		t.Errorf("the reclaim's event was destroyed %d times, want once", n)
	}
}

// TestCaptureMapsNoUnsettledRun: during a capture, a growth on the very
// stream that parked cached runs without waiting neither maps them
// elsewhere nor takes their standby mappings back until their event is
// seen done: the captured work runs when the graph is launched, on any
// stream, unordered with the work that used them.
func TestCaptureMapsNoUnsettledRun(t *testing.T) {
	s := newSpaceOn(t, Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true, Standby: true},
		simdev.Config{Capacity: 1 << 30, ManualEvents: true})
	p := newPool(false)
	// [0, 20) free, [20, 40) allocated, unmapped from 40 on.
	b, a := s.freeThenAllocated(t, p, s.find(t, p, 40*miB))
	if n, err := s.Settle([]*blocks.Block{b}, false, 0); err != nil || n != 0 {
		t.Fatalf("Settle waited for %d streams, %v; want none", n, err)
	}
	u, _, _, _, err := s.UnmapBlock(p, b, true, 0)
	if err != nil {
		t.Fatal(err)
	}
	s.SetCapturing(true) // queries the events, which have not completed
	queries := s.sim.Counters().EventQueries
	if got := s.Find(p, 0, 20*miB); got != nil && got.Ptr == u.Ptr {
		t.Errorf("during a capture Find = %v, the pages whose standby runs are not settled", got)
	}
	m, err := s.MapBlock(p, a.Next, 20*miB)
	if err != nil {
		t.Fatal(err)
	}
	if c, q := s.Calls(), s.sim.Counters().EventQueries-queries; m.Moved != 0 || m.New != 20*miB || c.Revived != 0 || c.Waits != 0 || q != 0 {
		t.Errorf("capture: %d pages moved, %d bytes new, calls %+v, %d event queries; want the runs left, 20 MiB new, no wait or query",
			m.Moved, m.New, c, q)
	}
	s.SetCapturing(false)
	if errs := s.Check(s.table); len(errs) > 0 {
		t.Fatal(errors.Join(errs...))
	}
	// Once the stream's work has completed, the next capture, which
	// queries the events before it starts, takes the runs back.
	s.sim.CompleteAll()
	s.SetCapturing(true)
	before := s.Calls()
	if got := s.Find(p, 0, 20*miB); got == nil || got.Ptr != u.Ptr {
		t.Errorf("capture after completion: Find = %v, want the standby pages at %#x", got, u.Ptr)
	}
	m, err = s.MapBlock(p, u, 20*miB)
	if err != nil {
		t.Fatal(err)
	}
	if c := s.Calls(); m.Moved != 10 || c.Revived != before.Revived+2 || c.Maps != before.Maps || c.Waits != 0 {
		t.Errorf("capture after completion: %d pages moved, calls %+v; want the 2 standby runs taken back, no map, no wait", m.Moved, c)
	}
	s.SetCapturing(false)
}

// TestForgetStream: runs a reclaim parked from a stream without waiting
// are the stream's own work only while the allocator keeps the stream;
// once it lets it go (ForgetStream), a stream that gets the same handle
// waits for that work before it maps them.
func TestForgetStream(t *testing.T) {
	for _, forget := range []bool{false, true} {
		t.Run(fmt.Sprintf("forget=%v", forget), func(t *testing.T) {
			s := newSpaceOn(t, Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true, Standby: true},
				simdev.Config{Capacity: 1 << 30, ManualEvents: true})
			st, err := s.sim.StreamCreate()
			if err != nil {
				t.Fatal(err)
			}
			stream := uint64(st)
			p, r := s.reserveOn(t, stream)
			// [0, 20) free, [20, 40) allocated, unmapped from 40 on.
			b, _ := s.freeThenAllocated(t, p, r)
			if n, err := s.Settle([]*blocks.Block{b}, false, stream); err != nil || n != 0 {
				t.Fatalf("Settle waited for %d streams, %v; want none", n, err)
			}
			if _, _, _, _, err := s.UnmapBlock(p, b, true, 0); err != nil {
				t.Fatal(err)
			}
			if forget {
				s.ForgetStream(stream)
			}
			p2, b2 := s.reserveOn(t, stream) // a new range of the stream
			m, err := s.MapBlock(p2, b2, 20*miB)
			if err != nil {
				t.Fatal(err)
			}
			want := int64(0)
			if forget {
				want = 1
			}
			if c := s.Calls(); m.Moved+m.Across != 10 || c.Waits != want {
				t.Errorf("%d pages moved, %d across, %d waits; want the 10 cached pages mapped after %d waits", m.Moved, m.Across, c.Waits, want)
			}
		})
	}
}

// noEvents is a simulated device whose events cannot be recorded.
type noEvents struct{ *simdev.Sim }

func (noEvents) EventRecord(cudart.Event, cudart.Stream) error {
	return fmt.Errorf("sim: no events today: %w", cudart.ErrInvalidValue)
}

// TestSettleWithoutEvents: a reclaim on its own stream that cannot record
// its event waits for the stream instead, as without standby mappings,
// and what it parks then waits for nothing; the growth goes on.
func TestSettleWithoutEvents(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30, ManualEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	s := &space{Space: New(noEvents{sim}, sim, Config{Total: 1 << 30, SmallPage: 2 * miB, LargePage: 20 * miB, ReclaimPage: 2 * miB, Reclaim: true, Standby: true}, zap.New(core)), sim: sim}
	defer func() {
		if _, errs := s.Close(); len(errs) > 0 {
			t.Errorf("Close: %v", errors.Join(errs...))
		}
		if c := sim.Counters(); c.LiveEvents != 0 {
			t.Errorf("after Close the device holds %d events", c.LiveEvents)
		}
	}()
	p := newPool(false)
	b, _ := s.freeThenAllocated(t, p, s.find(t, p, 40*miB))
	if n, err := s.Settle([]*blocks.Block{b, b}, false, 0); err != nil || n != 1 {
		t.Fatalf("Settle waited for %d streams, %v; want 1 and no error", n, err)
	}
	if c := sim.Counters(); c.StreamSyncs != 1 || s.Calls().Waits != 1 || logs.Len() != 1 {
		t.Errorf("%d stream syncs, %d waits, %d warnings; want one each", c.StreamSyncs, s.Calls().Waits, logs.Len())
	}
	if _, _, _, _, err := s.UnmapBlock(p, b, true, 0); err != nil {
		t.Fatal(err)
	}
	// Another stream maps the runs with no wait: nothing holds them.
	p1, b1 := s.reserveOn(t, 1)
	if m, err := s.MapBlock(p1, b1, 20*miB); err != nil || m.Across != 10 || s.Calls().Waits != 1 {
		t.Errorf("stream 1: %+v, %v, %d waits; want the 10 parked pages across and no further wait", m, err, s.Calls().Waits)
	}
	if errs := s.Check(s.table); len(errs) > 0 {
		t.Fatal(errors.Join(errs...))
	}
}
