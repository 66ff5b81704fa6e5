package vmm

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// Pool is what a Space uses of one of the allocator's pools: its free
// index, the recycler its blocks come from and go back to, and whether it
// is the small pool.
type Pool struct {
	Free     *blocks.FreeIndex
	Recycler *blocks.Recycler
	Small    bool
}

// Mapping is what one MapBlock mapped, for the caller's statistics: one
// device allocation of Bytes that took Took, of which New were created
// (the rest came from the handle cache, already reserved; Crossed of them
// were counted in the other pool), and Moved of its pages from runs that
// reclaim unmapped (Across of them from another stream's range).
type Mapping struct {
	Bytes, New    uint64
	Crossed       uint64
	Took          time.Duration
	Moved, Across int64
	// Shed is the bytes of cached runs that the mapping released, in
	// the large pool and the small (ShedSmall), because they fitted
	// nowhere it had to create memory (see shedUnfit): Reserved fell by
	// them before it rose by New.
	Shed, ShedSmall uint64
}

// Config is a Space's sizes and policy.
type Config struct {
	// Total is the device's memory; a range is an eighth more.
	Total uint64
	// SmallPage is the small pool's page (2 MiB), LargePage the large
	// pool's without reclaim (PyTorch's 20 MiB), ReclaimPage the large
	// pool's with it.
	SmallPage, LargePage, ReclaimPage uint64
	// Reclaim turns on reclaim before growth (see the package doc).
	Reclaim bool
	// Coarse, with Reclaim, grows in whole LargePage steps of one run
	// each and moves only long free stretches (see "Coarse reclaim" in
	// the package doc).
	Coarse bool
	// Standby, with Reclaim, leaves the runs reclaim takes mapped where
	// they were, for a later mapping there to take back without a call
	// (see "Standby mappings" in the package doc).
	Standby bool
	// Exact, with Reclaim and without Coarse, maps what each growth
	// needs, without rounding it to the LargePage boundary (roundEnd):
	// for tests of the reclaim policy alone.
	Exact bool
}

// Space is the expandable segments of one device: their ranges, pages,
// runs and handles, the handle cache, and the bytes held.
type Space struct {
	dev cudart.Device
	vm  cudart.VirtualMemory
	cfg Config
	log *zap.Logger
	// reserved is the bytes held from the device: mapped in every range,
	// and cachedBytes in the handle cache.
	reserved    uint64
	cachedBytes uint64
	// cache holds the runs reclaim unmapped, for mappings to map again
	// before they create new ones (see "The handle cache").
	cache []cachedRun
	// segs are the live expandable segments in address order.
	segs []*expSegment
	// orphans are handles whose Release failed after their pages were
	// unmapped; Close retries them.
	orphans []cudart.Handle
	// standbys lists, for each handle with standby mappings, where they
	// are (see "Standby mappings").
	standbys map[cudart.Handle][]place
	calls    Calls
	scratch  []*blocks.Block
	cands    []reclaimCand
	chain    []*blocks.Block
	pieces   []piece         // mapPages' runs, reused
	handles  []cudart.Handle // mapPages' handles for one call, reused
	keepOut  []cudart.Handle // standby handles a mapping may revive, reused
	// parkWith is the pending the last Settle recorded, for UnmapBlock to
	// attach to the runs it parks (see pending.go). It holds a reference
	// of its own until the next Settle or Close, so that the event
	// outlives the runs that let it go before then.
	parkWith *pending
	// capturing says that a CUDA graph capture is under way: no standby
	// mapping may be unmapped (SetCapturing).
	capturing bool
	// mark is the largest reserved figure so far; allocMark the largest
	// allocated figure seen at a mapping, the request included.
	mark      uint64
	allocMark uint64
	// allocNow is the allocated figure, the request included, that the
	// last GrowthExcess was told (each MapBlock follows one); ceiling is
	// what SetCeiling set. MapBlock's rounding reads both (roundEnd).
	allocNow uint64
	ceiling  uint64
	// shed is what shedUnfit released during the MapBlock under way, in
	// the large pool and the small.
	shed [2]uint64
}

// New returns an empty Space over dev and its virtual memory vm, which
// must map in a granularity that divides the configured pages. log
// receives the device failures a Space cannot return (a handle it could
// not release, an undo that failed).
func New(dev cudart.Device, vm cudart.VirtualMemory, cfg Config, log *zap.Logger) *Space {
	return &Space{dev: dev, vm: vm, cfg: cfg, log: log}
}

// SetCapturing tells the Space whether a CUDA graph capture is under way.
// While one is, it unmaps, waits for and queries nothing: a growth never
// reaches a standby mapping whose run is mapped elsewhere (Find leaves
// such pages out, and MapBlock stops before them), and maps no cached run
// whose event it has not seen complete (pending.settled). So the first
// call with on, made before the capture begins (as PyTorch's
// beginAllocateToPool is), queries the events of the cached runs first:
// those that have completed, as most have by then, serve the capture.
func (s *Space) SetCapturing(on bool) {
	if on && !s.capturing {
		s.querySettled()
	}
	s.capturing = on
}

// SetCeiling sets the reserved bytes that MapBlock's rounding of a
// growth to the next LargePage boundary never passes (0: no ceiling):
// the allocator's per-process cap. The request itself is the caller's
// to check against it.
func (s *Space) SetCeiling(bytes uint64) { s.ceiling = bytes }

// Reclaims says whether reclaim before growth is on.
func (s *Space) Reclaims() bool { return s.cfg.Reclaim }

// Reserved is the bytes held from the device: mapped in every range, and
// in the handle cache.
func (s *Space) Reserved() uint64 { return s.reserved }

// expSegment is one reserved range and the physical memory behind its
// mapped pages. Physical memory comes in runs: one handle backs a run of
// consecutive pages, mapped and unmapped whole (see "Runs" in the package
// doc).
type expSegment struct {
	seg *blocks.Segment
	// mapped[i] says whether page i is mapped. A run starting at page i
	// has its length in pages in run[i] and its handle in handles[i];
	// run and handles are 0 at the run's other pages and at unmapped
	// ones. The three grow on demand.
	mapped  []bool
	run     []uint32
	handles []cudart.Handle
	// standby[i] is the length in pages of a standby mapping that starts
	// at the unmapped page i and sbHandles[i] its handle: a run that
	// reclaim took from these pages and left mapped here, now in the
	// handle cache or mapped elsewhere (see "Standby mappings"). Both are
	// 0 at its other pages and everywhere else. They grow with mapped.
	standby   []uint32
	sbHandles []cudart.Handle
	// sbPend[i] is what must complete before the standby mapping at page
	// i is unmapped (nil: nothing; see pending.go).
	sbPend []*pending
}

// place is where a standby mapping starts: a page of a range.
type place struct {
	es   *expSegment
	page uint64
}

// grow extends the page arrays of es to n pages.
func (es *expSegment) grow(n uint64) {
	for uint64(len(es.mapped)) < n {
		es.mapped = append(es.mapped, false)
		es.run = append(es.run, 0)
		es.handles = append(es.handles, 0)
		es.standby = append(es.standby, 0)
		es.sbHandles = append(es.sbHandles, 0)
		es.sbPend = append(es.sbPend, nil)
	}
}

// standbyAt returns the length of the standby mapping that starts at page
// i, 0 when none does.
func (es *expSegment) standbyAt(i uint64) uint64 {
	if i < uint64(len(es.standby)) {
		return uint64(es.standby[i])
	}
	return 0
}

// runHead returns the first page of the run holding mapped page i.
func (es *expSegment) runHead(i uint64) uint64 {
	for es.run[i] == 0 {
		i--
	}
	return i
}

// wholeRuns narrows the pages [begin, end) of mapped pages to the runs
// that lie wholly inside it, and returns their bounds (begin >= end when
// there are none).
func (es *expSegment) wholeRuns(begin, end uint64) (uint64, uint64) {
	if begin < end && es.run[begin] == 0 { // inside a run that starts before begin
		h := es.runHead(begin)
		begin = h + uint64(es.run[h])
	}
	if end > begin && end < uint64(len(es.mapped)) && es.mapped[end] && es.run[end] == 0 {
		end = es.runHead(end) // that run goes on past end
	}
	return begin, end
}

// PageSize is the mapping unit of a pool's expandable segments: SmallPage
// in the small pool; in the large pool LargePage without reclaim and
// ReclaimPage with it (by default 2 MiB, so that any free hole of a large
// segment gives back all but at most 4 MiB of itself).
func (s *Space) PageSize(small bool) uint64 {
	switch {
	case small:
		return s.cfg.SmallPage
	case s.cfg.Reclaim:
		return s.cfg.ReclaimPage
	}
	return s.cfg.LargePage
}

// runPages is the length, in pages, of the new runs that map n pages of
// seg (see "Runs"): one page in the small pool and without reclaim
// (PyTorch's pages); in the large pool with reclaim, a quarter of n
// rounded up, but at least 1/minRunDiv of the largest allocated figure
// seen at a mapping, and at most maxRunBytes; coarsely, all n pages, at
// most maxRunBytes.
func (s *Space) runPages(seg *blocks.Segment, n uint64) uint64 {
	if s.coarse(seg) {
		return max(1, min(n, s.maxRunPages(seg)))
	}
	least := max(1, s.allocMark/minRunDiv/seg.PageSize)
	return max(1, min(max((n+runsPerGrowth-1)/runsPerGrowth, least), s.maxRunPages(seg)))
}

// coarse says whether seg grows and gives back coarsely: a large-pool
// range with Config.Coarse.
func (s *Space) coarse(seg *blocks.Segment) bool {
	return s.cfg.Coarse && s.cfg.Reclaim && !seg.Small
}

// maxRunPages is the longest run of seg, in pages.
func (s *Space) maxRunPages(seg *blocks.Segment) uint64 {
	if seg.Small || !s.cfg.Reclaim {
		return 1
	}
	return max(1, maxRunBytes/seg.PageSize)
}

// The run policy's three limits (docs/fragmentation.md has the
// measurements that chose them): a growth maps its new pages in about
// runsPerGrowth runs, none longer than maxRunBytes, none shorter than
// 1/minRunDiv of the largest allocated figure (so a run that a block
// only partly covers strands at most that much, while a workload that
// grows a little at a time makes fewer, longer runs as it grows).
const (
	runsPerGrowth = 4
	maxRunBytes   = 64 << 20
	minRunDiv     = 16
)

// of returns the expSegment of seg.
func (s *Space) of(seg *blocks.Segment) *expSegment {
	for _, es := range s.segs {
		if es.seg == seg {
			return es
		}
	}
	panic(fmt.Sprintf("allocator: expandable segment %#x is not registered", seg.Ptr))
}

func (es *expSegment) addr(page uint64) uint64 { return es.seg.Ptr + page*es.seg.PageSize }

// blocker returns the first page in [begin, limit) of es where a standby
// mapping whose run is not in the handle cache (it is mapped elsewhere)
// starts, or limit: where a mapping that may not unmap must stop.
func (s *Space) blocker(es *expSegment, begin, limit uint64) uint64 {
	for i := begin; i < min(limit, uint64(len(es.standby))); i++ {
		if es.standby[i] > 0 && !s.revivable(es.sbHandles[i]) {
			return i
		}
	}
	return limit
}

// expandableSize is the size a free block can grow to: its own and the
// unmapped pages right after it.
func expandableSize(b *blocks.Block) uint64 { return GrowableSize(b.Size, b.Next) }

// GrowableSize is the size a free block of size bytes followed by next
// can grow to, the size get_free_block's walk (Fit) compares: its own and
// next's when next is unmapped. It lets a caller rank a block that is not
// (yet) one, such as a free block and the free neighbour it would merge
// with.
func GrowableSize(size uint64, next *blocks.Block) uint64 {
	if next != nil && next.Unmapped {
		return size + next.Size
	}
	return size
}

// Fit is get_free_block's walk for expandable segments: from the best fit
// b in free, move to the next block of the stream in size order while its
// expandable size (its own and the unmapped pages right after it) is
// smaller than the current one's. It changes nothing. A block with no
// unmapped pages right after it ends the walk without a look at the next:
// its expandable size is its size, which no block after it in size order
// undercuts; so the index is searched only at the edge of the mapped
// pages.
func Fit(free *blocks.FreeIndex, b *blocks.Block) *blocks.Block {
	for b.Segment.Expandable && b.Next != nil && b.Next.Unmapped {
		next := free.After(b)
		if next == nil || expandableSize(next) >= expandableSize(b) {
			break
		}
		b = next
	}
	return b
}

// Find is the search of find_expandable_block: the lowest-addressed
// unmapped block of the stream and pool which, with a free block just
// before it and the free or unmapped blocks after it, has room for size
// bytes (returning that free block when there is one); nil if none has.
// During a capture the room of an unmapped block ends at its first standby
// mapping whose run is mapped elsewhere (SetCapturing).
func (s *Space) Find(p Pool, stream, size uint64) *blocks.Block {
	for _, es := range s.segs {
		seg := es.seg
		if seg.Stream != stream || seg.Small != p.Small {
			continue
		}
		for b := seg.Head; b != nil; b = b.Next {
			if !b.Unmapped {
				continue
			}
			c := b
			if c.Prev != nil && c.Prev.Free() {
				c = c.Prev
			}
			var room uint64
			for x := c; x != nil && room < size && x.Free(); x = x.Next {
				if x.Unmapped && s.capturing {
					off := (x.Ptr - seg.Ptr) / seg.PageSize
					free := (s.blocker(es, off, off+x.Size/seg.PageSize) - off) * seg.PageSize
					room += free
					if free < x.Size {
						break
					}
					continue
				}
				room += x.Size
			}
			if room >= size {
				return c
			}
		}
	}
	return nil
}

// Reserve reserves a new range for the stream and pool, of the device's
// memory and an eighth more, and returns its single unmapped block, from
// p's recycler. The caller enters the segment in its table (its Index is
// left 0).
func (s *Space) Reserve(p Pool, stream uint64) (*blocks.Block, error) {
	page := s.PageSize(p.Small)
	size := (s.cfg.Total + s.cfg.Total/8 + page - 1) / page * page
	ptr, err := s.vm.Reserve(size)
	if err != nil {
		return nil, fmt.Errorf("allocator: reserving %d bytes of address space for an expandable segment: %w", size, err)
	}
	seg := &blocks.Segment{Ptr: uint64(ptr), Size: size, Stream: stream, Small: p.Small,
		Expandable: true, PageSize: page}
	b := p.Recycler.Get()
	b.Ptr, b.Size, b.Segment, b.Unmapped = seg.Ptr, size, seg, true
	seg.Head = b
	es := &expSegment{seg: seg}
	i := sort.Search(len(s.segs), func(i int) bool { return s.segs[i].seg.Ptr > seg.Ptr })
	s.segs = slices.Insert(s.segs, i, es)
	return b, nil
}

// MapBlock is map_block: it maps the whole pages covering the first size
// bytes of the unmapped block b of pool p (more when its growth rounds to
// the page boundary, roundEnd, or when a cached run that fits in b is
// longer than what is missing: see takeCached), splits off
// the rest (still unmapped), merges b with free neighbours, indexes it and
// returns what it mapped. When the device is out of memory it returns the
// device's error as it is (errors.Is cudart.ErrOutOfMemory); on any error
// nothing changes but the cached runs it released (the Mapping returned
// with the error reports them).
func (s *Space) MapBlock(p Pool, b *blocks.Block, size uint64) (Mapping, error) {
	seg := b.Segment
	es := s.of(seg)
	page := seg.PageSize
	begin := (b.Ptr - seg.Ptr) / page
	end := (b.Ptr - seg.Ptr + size + page - 1) / page
	limit := (b.Ptr - seg.Ptr + b.Size) / page
	if s.capturing {
		limit = s.blocker(es, begin, limit)
	}
	t0 := time.Now()
	s.shed = [2]uint64{}
	wanted := end
	end = s.roundEnd(seg, begin, end, limit)
	mapped, moved, across, created, crossed, err := s.mapPages(es, begin, end, limit)
	if end > wanted && errors.Is(err, cudart.ErrOutOfMemory) {
		// The rounding asked for more than the device or the broker
		// gives: map what the request needs.
		mapped, moved, across, created, crossed, err = s.mapPages(es, begin, wanted, limit)
	}
	if err != nil {
		return Mapping{Shed: s.shed[0], ShedSmall: s.shed[1]}, err
	}
	end = mapped
	elapsed := time.Since(t0)
	n := (end - begin) * page
	b.Unmapped = false
	if n < b.Size {
		rest := blocks.Split(b, n, p.Recycler)
		rest.Unmapped = true
	}
	blocks.Merge(b, p.Free, p.Recycler)
	p.Free.Insert(b)
	seg.Mapped += n
	s.reserved += created
	s.mark = max(s.mark, s.reserved)
	return Mapping{Bytes: n, New: created, Crossed: crossed, Took: elapsed, Moved: moved, Across: across,
		Shed: s.shed[0], ShedSmall: s.shed[1]}, nil
}

// shedUnfit releases the cached runs usable in seg that are longer than
// room pages, the gap a mapping is about to create want bytes of new
// memory in, the longest first, until want bytes are released or none is
// left; first it waits for the work a reclaim left queued where each run
// was (pending.go; normally complete by then). Kept, such runs would stay
// held beside the new memory, so that reserved memory rose past what
// reclaim allows although the cache held enough (the gaps between the
// standby mappings a mapping takes back can be shorter than every cached
// run). A run that a later gap of the same mapping could have taken is
// released too: that costs a create, never memory. MapBlock reports what
// it released (Shed).
func (s *Space) shedUnfit(seg *blocks.Segment, want, room uint64) {
	var got uint64
	for got < want {
		best := -1
		for i, r := range s.cache {
			if s.usable(r, seg) && r.pages > room &&
				(best < 0 || r.pages > s.cache[best].pages) {
				best = i
			}
		}
		if best < 0 {
			return
		}
		if err := s.wait(s.cache[best].pend); err != nil {
			s.log.Warn("not releasing a cached run: its work could not be waited for", zap.Error(err))
			return
		}
		r := s.takeAt(best)
		s.releaseCached(r)
		if r.small {
			s.shed[1] += r.bytes()
		} else {
			s.shed[0] += r.bytes()
		}
		got += r.bytes()
	}
}

// roundEnd is where a mapping of pages [begin, end) of seg ends, at most
// at page limit: a large-pool mapping with reclaim grows to the next
// LargePage boundary of its range, as PyTorch's 20 MiB pages end, so
// that the next requests fit in what it maps (see "Growth to the page
// boundary" in the package doc). Coarsely it always does; with the
// default policy only as far as reserved memory, counting every page
// mapped as new, stays within what reclaim allows (excessAt's limit for
// the allocated figure GrowthExcess was last told) plus reclaim's
// headroom. No rounding passes the ceiling (SetCeiling) or happens
// during a capture.
func (s *Space) roundEnd(seg *blocks.Segment, begin, end, limit uint64) uint64 {
	if !s.cfg.Reclaim || seg.Small || s.capturing || (s.cfg.Exact && !s.coarse(seg)) {
		return end
	}
	page := seg.PageSize
	step := max(1, s.cfg.LargePage/page)
	rounded := min((end+step-1)/step*step, limit)
	if rounded <= end {
		return end
	}
	allowed := uint64(math.MaxUint64)
	if !s.coarse(seg) {
		allowed = max(s.mark, s.allocNow+s.reclaimSlack()+s.reclaimHeadroom())
	}
	if s.ceiling > 0 {
		allowed = min(allowed, s.ceiling)
	}
	after := s.reserved + (rounded-begin)*page // as if every page were new
	if after > allowed {
		over := (after - allowed + page - 1) / page
		rounded -= min(over, rounded-end)
	}
	return rounded
}

// piece is one run of a mapping that mapPages is making: its first page
// and length, its handle, and where it came from: the handle cache (r is
// the cached run), which includes a standby mapping at its place taken
// back (revived: nothing to map), or else a new handle. mapped says that
// mapPages has mapped it.
type piece struct {
	at, pages       uint64
	h               cudart.Handle
	cached, revived bool
	mapped          bool
	r               cachedRun
}

// mapPages maps pages [begin, end) of es, and at most up to page limit,
// in runs, page by page from begin: a standby mapping there whose run is
// in the handle cache is taken back whole, with no call (one whose run is
// mapped elsewhere is unmapped first); elsewhere come runs from the
// handle cache (takeCached; never one with a standby mapping among the
// pages this mapping may reach, which it can take back instead), then new
// runs of at most runPages pages, each one handle (Create), up to the
// next standby mapping. Runs side by side of one length are mapped in one
// call when the device is a cudart.RangeMapper, else run by run. It
// returns the end of what it mapped (past end when a run was longer than
// what was missing), how many pages came from the cache and how many of
// those from another stream's range, the bytes it created, and the bytes
// of cached runs that the other pool had counted. On a failure it undoes
// what it did (cached runs go back to the cache, taken-back standby
// mappings stay standby; standby mappings it unmapped stay unmapped,
// which changes nothing but the cost of a later mapping there) and
// returns the error: the device's own when it is out of memory, else
// wrapped.
func (s *Space) mapPages(es *expSegment, begin, end, limit uint64) (mappedEnd uint64, moved, across int64, created, crossed uint64, err error) {
	page, small := es.seg.PageSize, es.seg.Small
	ps := s.pieces[:0]
	defer func() {
		clear(ps)
		s.pieces = ps[:0]
	}()
	undo := func() {
		for _, pc := range ps {
			if pc.mapped {
				if err := s.unmap(cudart.Ptr(es.addr(pc.at)), pc.pages*page); err != nil {
					s.log.Error("undoing a mapping failed", zap.Uint64("addr", es.addr(pc.at)), zap.Error(err))
				}
			}
			if pc.cached {
				s.putCached(pc.r)
			} else {
				s.releaseHandle(pc.h)
			}
		}
	}
	fail := func(err error, what string) (uint64, int64, int64, uint64, uint64, error) {
		undo()
		if errors.Is(err, cudart.ErrOutOfMemory) {
			return 0, 0, 0, 0, 0, err
		}
		return 0, 0, 0, 0, 0, fmt.Errorf("allocator: %s for expandable segment %#x: %w", what, es.seg.Ptr, err)
	}
	keepOut := s.keepOut[:0]
	for i, stop := begin, min(end, uint64(len(es.standby))); i < stop; i++ {
		if es.standby[i] > 0 && s.revivable(es.sbHandles[i]) {
			keepOut = append(keepOut, es.sbHandles[i])
		}
	}
	s.keepOut = keepOut[:0]
	var maxRun uint64 // new runs' length, set at the first
	for i, fromCache := begin, true; i < end; {
		if n := es.standbyAt(i); n > 0 {
			h := es.sbHandles[i]
			if s.revivable(h) {
				r := s.takeAt(s.cachedIndex(h))
				ps = append(ps, piece{at: i, pages: n, h: h, cached: true, revived: true, r: r})
				if err := s.waitFor(r, es.seg.Stream); err != nil {
					return fail(err, "taking back a standby mapping")
				}
				i += n
				continue
			}
			if s.capturing { // MapBlock's limit stops before it
				return fail(fmt.Errorf("pages %d to %d hold a run mapped elsewhere, which a capture may not unmap: %w", i, i+n, cudart.ErrInvalidValue), "mapping")
			}
			if err := s.unmapStandbys(es, i, limit, s.revivable); err != nil {
				return fail(err, "freeing pages of a standby mapping")
			}
			continue
		}
		// The gap ends at the next standby mapping this mapping may take
		// back (during a capture, which may not unmap, at the next one),
		// or at limit.
		gapEnd := limit
		for j := i + 1; j < min(limit, uint64(len(es.standby))); j++ {
			if es.standby[j] > 0 && (s.capturing || slices.Contains(keepOut, es.sbHandles[j])) {
				gapEnd = j
				break
			}
		}
		need, room := min(end, gapEnd)-i, gapEnd-i
		var pc piece
		if s.cfg.Reclaim && fromCache {
			r, ok := s.takeCached(es.seg, need, room, keepOut)
			if !ok && len(keepOut) > 0 && !s.capturing { // one to take back later, rather than new memory
				r, ok = s.takeCached(es.seg, need, room, nil)
			}
			if ok {
				pc = piece{at: i, pages: r.pages, h: r.h, cached: true, r: r}
			} else {
				fromCache = false // nothing cached fits the rest of this gap
			}
		}
		if pc.pages == 0 {
			if maxRun == 0 {
				maxRun = s.runPages(es.seg, end-i)
			}
			pc.at, pc.pages = i, min(need, maxRun)
		}
		// Standby mappings of runs mapped elsewhere in the way go first.
		for j := i + 1; j < min(i+pc.pages, uint64(len(es.standby))); j++ {
			if es.standby[j] > 0 {
				if err := s.unmapStandbys(es, j, i+pc.pages, nil); err != nil {
					if pc.cached {
						s.putCached(pc.r)
					}
					return fail(err, "freeing pages of a standby mapping")
				}
			}
		}
		if !pc.cached {
			if s.cfg.Reclaim && !s.capturing {
				s.shedUnfit(es.seg, pc.pages*page, room)
			}
			h, err := s.create(pc.pages * page)
			if err != nil {
				return fail(err, fmt.Sprintf("creating a %d-byte run", pc.pages*page))
			}
			pc.h = h
		}
		ps = append(ps, pc)
		if err := s.waitFor(pc.r, es.seg.Stream); err != nil {
			return fail(err, "mapping a cached run")
		}
		i += pc.pages
		if i == gapEnd {
			fromCache = s.cfg.Reclaim // a new gap after the next standby mapping
		}
	}
	hs := s.handles[:0]
	for k := 0; k < len(ps); {
		if ps[k].revived {
			k++
			continue
		}
		j := k + 1
		for j < len(ps) && !ps[j].revived && ps[j].pages == ps[k].pages {
			j++
		}
		hs = hs[:0]
		for _, pc := range ps[k:j] {
			hs = append(hs, pc.h)
		}
		done, err := s.mapHandles(es.addr(ps[k].at), ps[k].pages*page, hs)
		for x := k; x < k+done; x++ {
			ps[x].mapped = true
		}
		if err != nil {
			s.handles = hs[:0]
			return fail(err, fmt.Sprintf("mapping %d runs of %d bytes at %#x", j-k, ps[k].pages*page, es.addr(ps[k].at)))
		}
		k = j
	}
	s.handles = hs[:0]
	last := ps[len(ps)-1]
	mappedEnd = last.at + last.pages
	es.grow(mappedEnd)
	for _, pc := range ps {
		if pc.revived {
			s.drop(es.sbPend[pc.at])
			es.standby[pc.at], es.sbHandles[pc.at], es.sbPend[pc.at] = 0, 0, nil
			s.removeStandby(pc.h, place{es, pc.at})
			s.calls.Revived++
		}
		if pc.cached {
			s.drop(pc.r.pend)
			moved += int64(pc.pages)
			if pc.r.stream != es.seg.Stream {
				across += int64(pc.pages)
			}
			if pc.r.small != small {
				crossed += pc.r.bytes()
			}
		} else {
			created += pc.pages * page
		}
		es.handles[pc.at], es.run[pc.at] = pc.h, uint32(pc.pages)
		for i := pc.at; i < pc.at+pc.pages; i++ {
			es.mapped[i] = true
		}
	}
	return mappedEnd, moved, across, created, crossed, nil
}

// releaseHandle releases a handle whose run is mapped nowhere live, after
// unmapping its standby mappings; one the device refuses, or whose standby
// mappings cannot all be unmapped, is kept for Close to retry.
func (s *Space) releaseHandle(h cudart.Handle) {
	if err := s.dropStandbys(h); err != nil {
		s.orphans = append(s.orphans, h)
		s.log.Error("unmapping a standby mapping failed; releasing its run at Close", zap.Uint64("handle", uint64(h)), zap.Error(err))
		return
	}
	if err := s.release(h); err != nil {
		s.orphans = append(s.orphans, h)
		s.log.Error("releasing a physical page failed; retrying at Close", zap.Uint64("handle", uint64(h)), zap.Error(err))
	}
}

// unmapPages unmaps the runs that make up pages [begin, end) of es
// (whole runs: see wholeRuns), in one call, and releases their handles
// (and their standby mappings elsewhere), or with keep puts them in the
// handle cache; with keep and Config.Standby it makes no call, the runs
// staying mapped there as standby mappings. It returns the bytes it
// released. If the unmap fails, nothing changes and the error is
// returned.
func (s *Space) unmapPages(es *expSegment, begin, end uint64, keep bool) (uint64, error) {
	page := es.seg.PageSize
	for i := begin; i < end; i += uint64(es.run[i]) {
		if es.run[i] == 0 || i+uint64(es.run[i]) > end {
			return 0, fmt.Errorf("allocator: expandable segment %#x: pages [%d, %d) are not whole runs (page %d)", es.seg.Ptr, begin, end, i)
		}
	}
	if keep && s.cfg.Standby { // the runs stay mapped here, standby
		for i := begin; i < end; {
			n, h := uint64(es.run[i]), es.handles[i]
			s.putCached(cachedRun{h: h, pages: n, page: page, small: es.seg.Small, stream: es.seg.Stream,
				pend: s.parkedWith(es.seg.Stream)})
			es.standby[i], es.sbHandles[i], es.sbPend[i] = uint32(n), h, s.parkedWith(es.seg.Stream)
			s.addStandby(h, place{es, i})
			es.handles[i], es.run[i] = 0, 0
			for range n {
				es.mapped[i] = false
				i++
			}
		}
		return 0, nil
	}
	if err := s.unmap(cudart.Ptr(es.addr(begin)), (end-begin)*page); err != nil {
		return 0, fmt.Errorf("allocator: unmapping the %d bytes of runs at %#x: %w", (end-begin)*page, es.addr(begin), err)
	}
	var released uint64
	for i := begin; i < end; {
		n := uint64(es.run[i])
		if keep {
			s.putCached(cachedRun{h: es.handles[i], pages: n, page: page, small: es.seg.Small, stream: es.seg.Stream})
		} else {
			s.releaseHandle(es.handles[i])
			released += n * page
		}
		es.handles[i], es.run[i] = 0, 0
		for range n {
			es.mapped[i] = false
			i++
		}
	}
	s.reserved -= released
	return released, nil
}

// UnmapBlock is unmap_block: it unmaps the whole runs inside the free
// block b of pool p (with most > 0, only as many of the last of them as
// cover most bytes), and releases them or, with keep (reclaim), puts them
// in the handle cache. Their span becomes an unmapped block, merged with
// its unmapped neighbours and returned with its address and size before
// the merge, and the bytes released; the rest of b at either end (partial
// pages, and pages of runs that reach beyond b) stays mapped as free
// blocks; each call that unmaps is one device free. It returns nil when b
// covers no whole run or on an error; the caller has synchronised the
// work that may use b.
func (s *Space) UnmapBlock(p Pool, b *blocks.Block, keep bool, most uint64) (u *blocks.Block, start, n, released uint64, err error) {
	seg := b.Segment
	es := s.of(seg)
	begin, end := es.runsInside(b)
	if begin >= end {
		return nil, 0, 0, 0, nil
	}
	page := seg.PageSize
	for most > 0 && (end-begin-uint64(es.run[begin]))*page >= most {
		begin += uint64(es.run[begin]) // the runs after it cover most
	}
	if released, err = s.unmapPages(es, begin, end, keep); err != nil {
		return nil, 0, 0, 0, err
	}
	p.Free.Delete(b)
	start, n = es.addr(begin), (end-begin)*page
	if before := start - b.Ptr; before > 0 {
		mid := blocks.Split(b, before, p.Recycler)
		p.Free.Insert(b)
		b = mid
	}
	if b.Size > n {
		p.Free.Insert(blocks.Split(b, n, p.Recycler))
	}
	b.Unmapped = true
	blocks.MergeUnmapped(b, p.Recycler)
	seg.Mapped -= n
	return b, start, n, released, nil
}

// runsInside returns the pages [begin, end) of the whole runs inside the
// mapped block b (begin >= end when there are none).
func (es *expSegment) runsInside(b *blocks.Block) (uint64, uint64) {
	page, off := es.seg.PageSize, b.Ptr-es.seg.Ptr
	begin, end := (off+page-1)/page, (off+b.Size)/page
	if begin >= end {
		return begin, end
	}
	return es.wholeRuns(begin, end)
}

// Unmappable returns the bytes that UnmapBlock would unmap from the
// mapped block b: its whole runs.
func (s *Space) Unmappable(b *blocks.Block) uint64 {
	begin, end := s.of(b.Segment).runsInside(b)
	if begin >= end {
		return 0
	}
	return (end - begin) * b.Segment.PageSize
}

// Unused appends to out the ranges of stream that are wholly unmapped,
// in address order.
func (s *Space) Unused(out []*blocks.Segment, stream uint64) []*blocks.Segment {
	for _, es := range s.segs {
		h := es.seg.Head
		if es.seg.Stream == stream && h.Prev == nil && h.Next == nil && h.Unmapped {
			out = append(out, es.seg)
		}
	}
	return out
}

// ReleaseRange returns the wholly unmapped range of seg to the device,
// after unmapping the standby mappings it holds, and forgets it; the caller takes seg out of its table and recycles its one
// block.
func (s *Space) ReleaseRange(seg *blocks.Segment) error {
	es := s.of(seg)
	for i := range es.standby {
		if es.standby[i] > 0 {
			if err := s.unmapStandbys(es, uint64(i), uint64(len(es.standby)), nil); err != nil {
				return fmt.Errorf("allocator: releasing the address range of expandable segment %#x: %w", seg.Ptr, err)
			}
		}
	}
	if err := s.vm.ReleaseRange(cudart.Ptr(seg.Ptr), seg.Size); err != nil {
		return fmt.Errorf("allocator: releasing the address range of expandable segment %#x: %w", seg.Ptr, err)
	}
	for i, x := range s.segs {
		if x == es {
			s.segs = append(s.segs[:i], s.segs[i+1:]...)
			break
		}
	}
	return nil
}

// Close unmaps every mapped page and standby mapping, releases every
// handle and every range,
// and leaves the Space empty. It returns how many device frees that made,
// one per contiguous mapped stretch, and every failure.
func (s *Space) Close() (frees int64, errs []error) {
	vm := s.vm
	if s.reserved > 0 {
		if err := s.dev.Synchronize(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: synchronising the device before unmapping: %w", err))
		}
	}
	for _, es := range s.segs { // standby mappings first: their runs are released below
		for i := range es.standby {
			if es.standby[i] > 0 {
				if err := s.unmapStandbys(es, uint64(i), uint64(len(es.standby)), nil); err != nil {
					errs = append(errs, err)
				}
			}
		}
		for i, p := range es.sbPend { // those that failed still hold their events
			if p != nil {
				s.drop(p)
				es.sbPend[i] = nil
			}
		}
	}
	for _, es := range s.segs {
		page := es.seg.PageSize
		for i := uint64(0); i < uint64(len(es.mapped)); {
			if !es.mapped[i] {
				i++
				continue
			}
			for i < uint64(len(es.mapped)) && es.mapped[i] {
				n := uint64(es.run[i])
				if n == 0 { // Check reports it; go on with the next page
					errs = append(errs, fmt.Errorf("allocator: expandable segment %#x: mapped page %d starts no run", es.seg.Ptr, i))
					es.mapped[i] = false
					i++
					continue
				}
				if err := s.unmap(cudart.Ptr(es.addr(i)), n*page); err != nil {
					errs = append(errs, fmt.Errorf("allocator: unmapping the %d-byte run at %#x: %w", n*page, es.addr(i), err))
				} else if err := s.release(es.handles[i]); err != nil {
					errs = append(errs, fmt.Errorf("allocator: releasing the run at %#x: %w", es.addr(i), err))
				}
				for range n {
					es.mapped[i] = false
					i++
				}
			}
			frees++
		}
		if err := vm.ReleaseRange(cudart.Ptr(es.seg.Ptr), es.seg.Size); err != nil {
			errs = append(errs, fmt.Errorf("allocator: releasing the address range of expandable segment %#x: %w", es.seg.Ptr, err))
		}
	}
	for _, r := range s.cache {
		s.orphans = append(s.orphans, r.h)
		s.drop(r.pend)
	}
	s.forgetParkWith()
	for _, h := range s.orphans {
		if err := s.release(h); err != nil {
			errs = append(errs, fmt.Errorf("allocator: releasing physical page handle %#x: %w", uint64(h), err))
		}
	}
	s.segs, s.orphans, s.cache, s.standbys, s.reserved, s.cachedBytes = nil, nil, nil, nil, 0, 0
	return frees, errs
}
