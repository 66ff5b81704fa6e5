package vmm

import (
	"errors"
	"fmt"
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
	calls   Calls
	scratch []*blocks.Block
	cands   []reclaimCand
	chain   []*blocks.Block
	handles []cudart.Handle // mapPages' runs, reused
	lens    []uint64        // their lengths in pages
	taken   []cachedRun     // mapPages' runs from the cache, reused
	// mark is the largest reserved figure so far; allocMark the largest
	// allocated figure seen at a mapping, the request included.
	mark      uint64
	allocMark uint64
}

// New returns an empty Space over dev and its virtual memory vm, which
// must map in a granularity that divides the configured pages. log
// receives the device failures a Space cannot return (a handle it could
// not release, an undo that failed).
func New(dev cudart.Device, vm cudart.VirtualMemory, cfg Config, log *zap.Logger) *Space {
	return &Space{dev: dev, vm: vm, cfg: cfg, log: log}
}

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

// expandableSize is the size a free block can grow to: its own and the
// unmapped pages right after it.
func expandableSize(b *blocks.Block) uint64 {
	if b.Next != nil && b.Next.Unmapped {
		return b.Size + b.Next.Size
	}
	return b.Size
}

// Fit is get_free_block's walk for expandable segments: from the best fit
// b in free, move to the next block of the stream in size order while its
// expandable size (its own and the unmapped pages right after it) is
// smaller than the current one's. It changes nothing.
func Fit(free *blocks.FreeIndex, b *blocks.Block) *blocks.Block {
	for b.Segment.Expandable {
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
// bytes of the unmapped block b of pool p (more when a cached run that
// fits in b is longer than what is missing: see takeCached), splits off
// the rest (still unmapped), merges b with free neighbours, indexes it and
// returns what it mapped. When the device is out of memory it returns the
// device's error as it is (errors.Is cudart.ErrOutOfMemory); on any error
// nothing changes.
func (s *Space) MapBlock(p Pool, b *blocks.Block, size uint64) (Mapping, error) {
	seg := b.Segment
	es := s.of(seg)
	page := seg.PageSize
	begin := (b.Ptr - seg.Ptr) / page
	end := (b.Ptr - seg.Ptr + size + page - 1) / page
	limit := (b.Ptr - seg.Ptr + b.Size) / page
	if s.coarse(seg) { // to the next LargePage boundary, as PyTorch's pages end
		step := max(1, s.cfg.LargePage/page)
		end = min((end+step-1)/step*step, limit)
	}
	t0 := time.Now()
	end, moved, across, created, crossed, err := s.mapPages(es, begin, end, limit)
	if err != nil {
		return Mapping{}, err
	}
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
	return Mapping{Bytes: n, New: created, Crossed: crossed, Took: elapsed, Moved: moved, Across: across}, nil
}

// mapPages maps pages [begin, end) of es, and at most up to page limit,
// in runs: first runs from the handle cache (takeCached), then new runs
// of at most runPages pages, each one handle (Create, then Map); runs of
// one length are mapped in one call when the device is a
// cudart.RangeMapper, else run by run. It returns the end of what it
// mapped (past end when a cached run was longer than what was missing),
// how many pages came from the cache and how many of those from another
// stream's range, the bytes it created, and the bytes of cached runs that
// the other pool had counted. On a failure it undoes what
// it did (cached runs go back to the cache) and returns the error: the
// device's own when it is out of memory, else wrapped.
func (s *Space) mapPages(es *expSegment, begin, end, limit uint64) (mappedEnd uint64, moved, across int64, created, crossed uint64, err error) {
	page, small := es.seg.PageSize, es.seg.Small
	hs, lens := s.handles[:0], s.lens[:0]
	taken := s.taken[:0] // hs[:len(taken)] came from the cache
	mapped := 0          // runs mapped so far, in order
	undo := func() {
		at := es.addr(begin)
		for k := range mapped {
			if err := s.unmap(cudart.Ptr(at), lens[k]*page); err != nil {
				s.log.Error("undoing a mapping failed", zap.Uint64("addr", at), zap.Error(err))
			}
			at += lens[k] * page
		}
		for k, h := range hs {
			if k < len(taken) {
				s.putCached(taken[k])
			} else {
				s.releaseHandle(h)
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
	rem, room := end-begin, limit-begin
	for s.cfg.Reclaim && rem > 0 {
		r, ok := s.takeCached(es.seg, rem, room)
		if !ok {
			break
		}
		hs, lens, taken = append(hs, r.h), append(lens, r.pages), append(taken, r)
		if r.small != small {
			crossed += r.bytes()
		}
		rem -= min(rem, r.pages)
		room -= r.pages
		moved += int64(r.pages)
		if r.stream != es.seg.Stream {
			across += int64(r.pages)
		}
	}
	for maxRun := s.runPages(es.seg, rem); rem > 0; {
		n := min(rem, maxRun)
		h, err := s.create(n * page)
		if err != nil {
			return fail(err, fmt.Sprintf("creating a %d-byte run", n*page))
		}
		hs, lens = append(hs, h), append(lens, n)
		rem -= n
		created += n * page
	}
	at := es.addr(begin)
	for k := 0; k < len(hs); {
		j := k + 1
		for j < len(hs) && lens[j] == lens[k] {
			j++
		}
		done, err := s.mapHandles(at, lens[k]*page, hs[k:j])
		mapped += done
		if err != nil {
			return fail(err, fmt.Sprintf("mapping %d runs of %d bytes at %#x", j-k, lens[k]*page, at))
		}
		at += uint64(j-k) * lens[k] * page
		k = j
	}
	mappedEnd = (at - es.seg.Ptr) / page
	for uint64(len(es.mapped)) < mappedEnd {
		es.mapped = append(es.mapped, false)
		es.run = append(es.run, 0)
		es.handles = append(es.handles, 0)
	}
	i := begin
	for k, h := range hs {
		es.handles[i], es.run[i] = h, uint32(lens[k])
		for range lens[k] {
			es.mapped[i] = true
			i++
		}
	}
	s.handles, s.lens, s.taken = hs[:0], lens[:0], taken[:0]
	return mappedEnd, moved, across, created, crossed, nil
}

// releaseHandle releases a handle whose page is unmapped; one the device
// refuses is kept for Close to retry.
func (s *Space) releaseHandle(h cudart.Handle) {
	if err := s.release(h); err != nil {
		s.orphans = append(s.orphans, h)
		s.log.Error("releasing a physical page failed; retrying at Close", zap.Uint64("handle", uint64(h)), zap.Error(err))
	}
}

// unmapPages unmaps the runs that make up pages [begin, end) of es
// (whole runs: see wholeRuns), in one call, and releases their handles,
// or with keep puts them in the handle cache. It returns the bytes it
// released. If the unmap fails, nothing changes and the error is
// returned.
func (s *Space) unmapPages(es *expSegment, begin, end uint64, keep bool) (uint64, error) {
	page := es.seg.PageSize
	for i := begin; i < end; i += uint64(es.run[i]) {
		if es.run[i] == 0 || i+uint64(es.run[i]) > end {
			return 0, fmt.Errorf("allocator: expandable segment %#x: pages [%d, %d) are not whole runs (page %d)", es.seg.Ptr, begin, end, i)
		}
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

// ReleaseRange returns the wholly unmapped range of seg to the device and
// forgets it; the caller takes seg out of its table and recycles its one
// block.
func (s *Space) ReleaseRange(seg *blocks.Segment) error {
	es := s.of(seg)
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

// Close unmaps every mapped page, releases every handle and every range,
// and leaves the Space empty. It returns how many device frees that made,
// one per contiguous mapped stretch, and every failure.
func (s *Space) Close() (frees int64, errs []error) {
	vm := s.vm
	if s.reserved > 0 {
		if err := s.dev.Synchronize(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: synchronising the device before unmapping: %w", err))
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
	}
	for _, h := range s.orphans {
		if err := s.release(h); err != nil {
			errs = append(errs, fmt.Errorf("allocator: releasing physical page handle %#x: %w", uint64(h), err))
		}
	}
	s.segs, s.orphans, s.cache, s.reserved, s.cachedBytes = nil, nil, nil, 0, 0
	return frees, errs
}
