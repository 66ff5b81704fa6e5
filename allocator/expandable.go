package allocator

// Expandable segments (expandable_segments:True), after PyTorch's
// ExpandableSegment (c10/cuda/CUDACachingAllocator.cpp).
//
// # Design
//
// Instead of one device allocation per segment, the allocator reserves a
// range of virtual addresses per (stream, pool), large enough to map the
// whole device (1⅛ × its total memory, rounded to pages, as PyTorch sizes
// it), and maps physical pages into it on demand: 2 MiB pages in the small
// pool, 20 MiB pages in the large one (2 MiB with allocd's reclaim, below).
// The range is one blocks.Segment with Expandable set; its blocks tile the
// whole reservation, and the blocks over unmapped pages carry Unmapped. An unmapped block is free but never in a
// free index, starts and ends on page boundaries, and merges only with
// unmapped neighbours; a mapped block never merges with an unmapped one.
// The segment's Mapped bytes are what it holds from the device.
//
// A request is first served, as always, from the pool's free index (best
// fit within the stream), with one twist (PyTorch's expandable_size): a free
// block followed by unmapped pages can grow into them, so for best fit its
// size counts as its own plus theirs, and the next larger block is taken
// while that sum is smaller. That keeps the free block at the mapped end of
// a segment, which can grow, for requests nothing else serves.
//
// A miss (PyTorch's try_allocate_expandable_block) looks, in address order,
// for the first unmapped block of the stream and pool that, together with
// a free block just before it and the free or unmapped blocks after it, has
// room for the request; normally that is the segment's unmapped tail and
// the free block at the end of the mapped part. It maps just enough whole
// pages at the start of the unmapped block, merges the new pages with the
// free neighbours and hands out the result; the segment grows at its end
// instead of a new segment being allocated. Only when no segment of the
// stream and pool has room is a new range reserved. Blocks of an expandable
// segment split whenever the remainder is at least 512 bytes, in both pools.
//
// # Beyond PyTorch: reclaim before growth
//
// PyTorch unmaps free pages only on out of memory and in empty_cache, so a
// free hole in the middle of a segment that a large request does not fit
// stays mapped while the segment grows at its end: on the gpt2_train trace
// a 785 MiB request grows the segment past a 393 MiB hole and PyTorch's
// expandable peak (7886 MiB) ends above its default one (7708 MiB). allocd
// moves the physical memory instead (docs/fragmentation.md has the
// measurements):
//
//   - A mapping may raise reserved memory above its high-water mark (mark,
//     the largest reserved figure so far) only while reserved stays within
//     1/32 of allocMark, the largest allocated figure seen at a mapping.
//     Past both, the whole runs (below) of other free blocks are unmapped
//     first (the smallest block that covers the target, else the largest
//     first), then the request is mapped. The target is the excess plus
//     a headroom of 1/128 of the mark, so that the next few mappings of a
//     workload whose requests grow a little every step (a decoder's
//     key-value cache) fit without another reclaim. Neither mark is reset
//     by ResetPeakStats.
//   - The candidates are the free blocks of every stream's pools, so a
//     stream that must grow takes the pages another stream freed:
//     unmapped from that stream's range, mapped into its own (the same
//     physical pages, Stats.NumPagesMoved); live blocks never move. A
//     block that another stream may still use (RecordStream) is not in any
//     free index until its events complete, so its pages are never handed
//     over before then.
//   - Before unmapping, a reclaim waits for the streams that own the
//     chosen blocks (syncStreams), not for the whole device.
//   - With reclaim on, the large pool maps 2 MiB pages (the small pool's)
//     instead of PyTorch's 20 MiB, so a free hole gives back all of itself
//     but the partial pages at either end (and the runs, below, that
//     reach past it).
//
// WithPyTorchExpandable turns it off, and replays then reproduce PyTorch's
// expandable_segments:True peaks exactly.
//
// # Runs
//
// On a GPU each handle costs a cuMemCreate and a cuMemMap of tens of
// microseconds whatever its size, so one handle per 2 MiB page made
// growth about ten times as costly as PyTorch's 20 MiB pages. Physical
// memory therefore comes in runs: one handle backs a run of consecutive
// pages, created, mapped, unmapped and moved whole. A growth of n pages
// maps them in runs of ⌈n/4⌉ pages (runsPerGrowth), none longer than 32
// MiB (maxRunBytes), after reusing the longest runs that reclaim kept and
// that fit; runs of one length are mapped with one grant of access. So a
// growth of up to 128 MiB makes at most four handles (a larger one, one
// per 32 MiB), while the runs of a block stay at most a quarter of it:
// when the block is freed and its hole partly reused, the runs that the
// new block only partly covers are what stays mapped, a bounded share of
// the hole. Unmapping (reclaim, EmptyCache) takes the whole runs inside a
// free block. The small pool and PyTorch's mode map one page per handle,
// as PyTorch does.
//
// A failed Create releases the handles made for the request and reports
// out of memory, which takes the usual path: release cached memory, retry
// once, then an OOMError. EmptyCache (and that release) unmaps every whole
// run inside a free block, PyTorch's release_blocks/unmap_block: their
// span becomes unmapped and merges with unmapped neighbours; the rest of
// the block at either end stays mapped as free blocks.
// A range that is wholly unmapped is released. Before the first unmap of a
// release the device is synchronised: unlike cudaFree, unmapping does not
// wait for work still using the memory. Close unmaps and releases
// everything.
//
// # Statistics, as PyTorch keeps them
//
//   - reserved_bytes is mapped bytes; it grows by each mapping and shrinks
//     by each unmapping.
//   - segment and oversize_segments count device allocations (cudaMalloc)
//     only: expandable ranges do not count, as in PyTorch.
//   - num_device_alloc counts mappings (one per map_block, however many
//     pages it maps), num_device_free unmappings; history records them as
//     segment_map and segment_unmap.
//   - inactive_split and inactive_split_bytes leave expandable segments
//     out: their free pages can always be returned.
//
// Snapshot reports each contiguous mapped range of an expandable segment as
// a segment with IsExpandable set, listing its (mapped) blocks; unmapped
// address space is not listed, as in PyTorch's snapshot.
//
// With expandable segments every block is expandable, so the paths that
// release whole cached segments do nothing here, as in PyTorch:
// release_available_cached_blocks (max_split_size) and the garbage
// collector (garbage_collection_threshold) release only ordinary segments.
// release_lock_on_cudamalloc does not apply to mapping, as in PyTorch.
//
// None of this touches the default path: with expandable segments off, no
// segment is Expandable and no block Unmapped.

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/snapshot"
)

// expandable is the segment source of expandable segments (segments.go):
// it owns the virtual ranges, their pages, runs and handles, and keeps the
// segment table and the statistics in step with the device. It holds no
// pointer back to the allocator; the policy around it (the cap, reclaim's
// decisions, the directory, the history) is the allocator's methods in
// this file.
type expandable struct {
	dev   cudart.Device
	vm    cudart.VirtualMemory
	table *segTable   // the allocator's, shared with its other sources
	total uint64      // the device's memory; a range is an eighth more
	stats *Stats      // the allocator's
	log   *zap.Logger // the allocator's
	gran  uint64
	// segs are the live expandable segments in address order.
	segs []*expSegment
	// orphans are handles whose Release failed after their pages were
	// unmapped; Close retries them.
	orphans []cudart.Handle
	scratch []*blocks.Block
	cands   []reclaimCand
	chain   []*blocks.Block
	handles []cudart.Handle // mapPages' runs, reused
	lens    []uint64        // their lengths in pages
	// reclaim is on unless WithPyTorchExpandable; mark is the largest
	// reserved figure so far; allocMark the largest allocated figure seen
	// at a mapping, the request included (neither is reset by
	// ResetPeakStats).
	reclaim   bool
	mark      uint64
	allocMark uint64
	// largePage is the large pool's page when reclaim is on
	// (Config.ExpandablePageSize).
	largePage uint64
	// spare holds the runs that reclaim unmapped for the mapping under
	// way (keep set, pages of keepSize bytes): mapPages maps them again
	// instead of creating new ones, and allocExpandable releases what is
	// left before it returns, so spare is empty between calls.
	spare    []spareRun
	keep     bool
	keepSize uint64
}

// reclaimCand is a free block that reclaim may unmap and the bytes of its
// whole runs.
type reclaimCand struct {
	b     *blocks.Block
	bytes uint64
}

// spareRun is a run's handle that reclaim unmapped, its length in pages
// and the stream whose range it left.
type spareRun struct {
	h      cudart.Handle
	pages  uint64
	stream uint64
}

// WithPyTorchExpandable makes expandable segments grow exactly as
// PyTorch's do: free pages are unmapped only by EmptyCache and on out of
// memory, never to keep reserved memory near its high-water mark (see
// "Beyond PyTorch" in expandable.go). It has no effect without
// expandable_segments:True.
func WithPyTorchExpandable() Option {
	return func(o *options) { o.pytorchExpandable = true }
}

// expSegment is one reserved range and the physical memory behind its
// mapped pages. Physical memory comes in runs: one handle backs a run of
// consecutive pages, mapped and unmapped whole (see "Runs" above).
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

// newExpandable checks that dev can serve expandable segments: it must
// implement cudart.VirtualMemory with a granularity that divides the page
// sizes.
func newExpandable(dev cudart.Device, cfg Config) (*expandable, error) {
	if cfg.Backend != BackendNative {
		return nil, fmt.Errorf("allocator: expandable_segments:True applies to backend:native, not backend:%s: %w", cfg.Backend, ErrNotSupported)
	}
	vm, ok := dev.(cudart.VirtualMemory)
	if !ok {
		return nil, fmt.Errorf("allocator: expandable_segments:True: device %q has no virtual memory management: %w", dev.Info().Name, ErrNotSupported)
	}
	gran, err := vm.Granularity()
	if err != nil {
		return nil, fmt.Errorf("allocator: expandable_segments:True: device %q: %w: %w", dev.Info().Name, ErrNotSupported, err)
	}
	if gran == 0 || smallBuffer%gran != 0 || largeBuffer%gran != 0 {
		return nil, fmt.Errorf("allocator: expandable_segments:True: the device's mapping granularity %d bytes does not divide the %d-byte and %d-byte pages: %w", gran, smallBuffer, largeBuffer, ErrNotSupported)
	}
	return &expandable{vm: vm, gran: gran, reclaim: true}, nil
}

// pageSize is the mapping unit of a pool's expandable segments: 2 MiB in
// the small pool; in the large pool PyTorch's 20 MiB without reclaim, and
// with reclaim Config.ExpandablePageSize (by default 2 MiB, so that any
// free hole of a large segment gives back all but at most 4 MiB of
// itself; see "Beyond PyTorch").
func (e *expandable) pageSize(p *pool) uint64 {
	switch {
	case p.small:
		return smallBuffer
	case e.reclaim:
		return e.largePage
	}
	return largeBuffer
}

// runPages is the length, in pages, of the new runs that map n pages of
// seg (see "Runs"): one page in the small pool and without reclaim (PyTorch's
// pages); in the large pool with reclaim, a quarter of n rounded up, at
// most maxRunBytes.
func (e *expandable) runPages(seg *blocks.Segment, n uint64) uint64 {
	return max(1, min((n+runsPerGrowth-1)/runsPerGrowth, e.maxRunPages(seg)))
}

// maxRunPages is the longest run of seg, in pages.
func (e *expandable) maxRunPages(seg *blocks.Segment) uint64 {
	if seg.Small || !e.reclaim {
		return 1
	}
	return max(1, maxRunBytes/seg.PageSize)
}

// The run policy's two limits (docs/fragmentation.md has the
// measurements that chose them): a growth maps its new pages in about
// runsPerGrowth runs, none longer than maxRunBytes.
const (
	runsPerGrowth = 4
	maxRunBytes   = 32 << 20
)

// of returns the expSegment of seg.
func (e *expandable) of(seg *blocks.Segment) *expSegment {
	for _, es := range e.segs {
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

// expandableFit is get_free_block's walk for expandable segments: from the
// best fit b, move to the next block of the stream in size order while its
// expandable size is smaller than the current one's.
func expandableFit(p *pool, b *blocks.Block) *blocks.Block {
	for b.Segment.Expandable {
		next := p.free.After(b)
		if next == nil || expandableSize(next) >= expandableSize(b) {
			break
		}
		b = next
	}
	return b
}

// growExpandable is grow for expandable segments: map pages for the
// request; if the device says no, release cached memory (unmap free pages)
// and try once more; then fail with an OOMError.
func (a *Allocator) growExpandable(c *call, p *pool, stream cudart.Stream, size, rounded uint64) (*blocks.Block, error) {
	allocSize := allocationSize(rounded)
	b, err := a.allocExpandable(c, p, stream, rounded, allocSize, false)
	if b == nil && err == nil {
		if err = a.releaseCachedBlocks(c); err == nil {
			b, err = a.allocExpandable(c, p, stream, rounded, allocSize, true)
		}
	}
	if err != nil {
		return nil, err
	}
	if b == nil {
		return nil, a.outOfMemory(c, size, allocSize, stream, c.devErr)
	}
	return b, nil
}

// allocExpandable is alloc_block with expandable segments: the per-process
// cap is checked against the request's segment size, as PyTorch does, then
// try_allocate_expandable_block. It returns (nil, nil) when the device is
// out of memory (c.devErr says why) or the cap is reached (c.devErr nil).
func (a *Allocator) allocExpandable(c *call, p *pool, stream cudart.Stream, rounded, allocSize uint64, isRetry bool) (*blocks.Block, error) {
	if isRetry {
		a.stats.NumAllocRetries++
	}
	c.devErr = nil
	if a.capped && a.segs.reserved+allocSize > a.allowed {
		return nil, nil
	}
	b, err := a.findExpandableBlock(p, uint64(stream), rounded)
	if err != nil {
		return nil, err
	}
	if a.exp.reclaim {
		sums, _ := a.hotSums()
		a.exp.allocMark = max(a.exp.allocMark, uint64(sums[3][PoolAll])+rounded)
		if excess := a.exp.growthExcess(b, rounded); excess > 0 {
			defer a.exp.dropSpare()
			a.exp.keep, a.exp.keepSize = true, a.exp.pageSize(p)
			err := a.reclaimPages(c, excess)
			a.exp.keep = false
			if err != nil {
				return nil, err
			}
			// Unmapping moved blocks around: look again.
			if b, err = a.findExpandableBlock(p, uint64(stream), rounded); err != nil {
				return nil, err
			}
		}
	}
	if b.Unmapped {
		if ok, err := a.mapBlock(c, p, b, min(b.Size, rounded)); !ok {
			return nil, err
		}
	}
	for b.Size < rounded {
		next := b.Next
		if next == nil || !next.Unmapped {
			return nil, fmt.Errorf("allocator: expandable segment %#x: %v is followed by %v, not by unmapped pages", b.Segment.Ptr, b, next)
		}
		if ok, err := a.mapBlock(c, p, next, min(rounded-b.Size, next.Size)); !ok {
			return nil, err
		}
		b = next // it absorbed b
	}
	p.free.Delete(b)
	return b, nil
}

// findExpandableBlock is find_expandable_block: the block findBlock
// finds, or else the unmapped block of a newly reserved range, entered in
// the directory.
func (a *Allocator) findExpandableBlock(p *pool, stream, size uint64) (*blocks.Block, error) {
	if b := a.exp.findBlock(p, stream, size); b != nil {
		return b, nil
	}
	b, err := a.exp.reserve(p, stream)
	if err != nil {
		return nil, err
	}
	a.dirAdd(b.Segment)
	return b, nil
}

// findBlock is the search of find_expandable_block: the lowest-addressed
// unmapped block of the stream and pool which, with a free block just
// before it and the free or unmapped blocks after it, has room for size
// bytes (returning that free block when there is one); nil if none has.
func (e *expandable) findBlock(p *pool, stream, size uint64) *blocks.Block {
	for _, es := range e.segs {
		s := es.seg
		if s.Stream != stream || s.Small != p.small {
			continue
		}
		for b := s.Head; b != nil; b = b.Next {
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

// reserve reserves a new range for the stream and pool, of the device's
// memory and an eighth more, enters it in the segment table and returns
// its single unmapped block.
func (e *expandable) reserve(p *pool, stream uint64) (*blocks.Block, error) {
	page := e.pageSize(p)
	size := (e.total + e.total/8 + page - 1) / page * page
	ptr, err := e.vm.Reserve(size)
	if err != nil {
		return nil, fmt.Errorf("allocator: reserving %d bytes of address space for an expandable segment: %w", size, err)
	}
	seg := &blocks.Segment{Ptr: uint64(ptr), Size: size, Stream: stream, Small: p.small,
		Index: len(e.table.list), Expandable: true, PageSize: page}
	b := p.recycler.Get()
	b.Ptr, b.Size, b.Segment, b.Unmapped = seg.Ptr, size, seg, true
	seg.Head = b
	e.table.add(seg)
	es := &expSegment{seg: seg}
	i := sort.Search(len(e.segs), func(i int) bool { return e.segs[i].seg.Ptr > seg.Ptr })
	e.segs = append(e.segs, nil)
	copy(e.segs[i+1:], e.segs[i:])
	e.segs[i] = es
	e.log.Debug("expandable segment reserved", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", size),
		zap.Uint64("page_bytes", page), zap.Bool("small_pool", p.small), zap.Uint64("stream", stream))
	return b, nil
}

// mapBlock is map_block: mapBlock of the expandable state, then the
// history's and the log's record of the mapping. It reports false, with a
// nil error when the device is out of memory; nothing changes then.
func (a *Allocator) mapBlock(c *call, p *pool, b *blocks.Block, size uint64) (bool, error) {
	seg, start := b.Segment, b.Ptr
	n, elapsed, err := a.exp.mapBlock(c, p, b, size)
	if n == 0 {
		return false, err
	}
	a.record(c, actionSegmentMap, start, n, cudart.Stream(seg.Stream))
	a.log.Debug("expandable segment mapped", zap.Uint64("segment", seg.Ptr), zap.Uint64("addr", start),
		zap.Uint64("bytes", n), zap.Uint64("reserved_bytes", a.segs.reserved), zap.Duration("took", elapsed))
	return true, nil
}

// mapBlock maps the whole pages covering the first size bytes of the
// unmapped block b of pool p, splits off the rest (still unmapped), merges
// b with free neighbours, indexes it and counts the bytes mapped, which it
// returns with the time the mapping took. It returns 0 bytes, with a nil
// error when the device is out of memory (c.devErr says why); nothing
// changes then.
func (e *expandable) mapBlock(c *call, p *pool, b *blocks.Block, size uint64) (uint64, time.Duration, error) {
	seg := b.Segment
	es := e.of(seg)
	page := seg.PageSize
	begin := (b.Ptr - seg.Ptr) / page
	end := (b.Ptr - seg.Ptr + size + page - 1) / page
	t0 := time.Now()
	if ok, err := e.mapPages(c, es, begin, end); !ok {
		return 0, 0, err
	}
	elapsed := time.Since(t0)
	n := (end - begin) * page
	b.Unmapped = false
	if n < b.Size {
		rest := blocks.Split(b, n, &p.recycler)
		rest.Unmapped = true
	}
	blocks.Merge(b, p.free, &p.recycler)
	p.free.Insert(b)
	seg.Mapped += n
	e.table.reserved += n
	e.mark = max(e.mark, e.table.reserved)
	e.stats.ReservedBytes.add(p.stat, int64(n))
	e.stats.NumDeviceAlloc++
	e.stats.DeviceMallocLatency.observe(elapsed)
	return n, elapsed, nil
}

// mapPages maps pages [begin, end) of es in runs: first runs that reclaim
// kept (e.spare) that fit, then new runs of at most runPages pages,
// each one handle (Create, then Map); runs of one length are mapped in one
// call when the device is a cudart.RangeMapper, else run by run.
// On out of memory it releases what it made and returns (false, nil); on
// another failure it undoes what it did and returns the error.
func (e *expandable) mapPages(c *call, es *expSegment, begin, end uint64) (bool, error) {
	vm, page := e.vm, es.seg.PageSize
	hs, lens := e.handles[:0], e.lens[:0]
	var moved, across int64
	mapped := 0 // runs mapped so far, in order
	undo := func() {
		at := es.addr(begin)
		for k := range mapped {
			if err := vm.Unmap(cudart.Ptr(at), lens[k]*page); err != nil {
				e.log.Error("undoing a mapping failed", zap.Uint64("addr", at), zap.Error(err))
			}
			at += lens[k] * page
		}
		for _, h := range hs {
			e.releaseHandle(h)
		}
	}
	fail := func(err error, what string) (bool, error) {
		undo()
		if errors.Is(err, cudart.ErrOutOfMemory) {
			c.devErr = err
			return false, nil
		}
		return false, fmt.Errorf("allocator: %s for expandable segment %#x: %w", what, es.seg.Ptr, err)
	}
	rem := end - begin
	for page == e.keepSize && rem > 0 {
		best := -1 // the longest kept run that fits
		for i, sp := range e.spare {
			if sp.pages <= rem && (best < 0 || sp.pages > e.spare[best].pages) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		sp := e.spare[best]
		e.spare = slices.Delete(e.spare, best, best+1)
		hs, lens = append(hs, sp.h), append(lens, sp.pages)
		rem -= sp.pages
		moved += int64(sp.pages)
		if sp.stream != es.seg.Stream {
			across += int64(sp.pages)
		}
	}
	for maxRun := e.runPages(es.seg, rem); rem > 0; {
		n := min(rem, maxRun)
		h, err := vm.Create(n * page)
		if err != nil {
			return fail(err, fmt.Sprintf("creating a %d-byte run", n*page))
		}
		hs, lens = append(hs, h), append(lens, n)
		rem -= n
	}
	at := es.addr(begin)
	for k := 0; k < len(hs); {
		j := k + 1
		for j < len(hs) && lens[j] == lens[k] {
			j++
		}
		done, err := mapHandles(vm, at, lens[k]*page, hs[k:j])
		mapped += done
		if err != nil {
			return fail(err, fmt.Sprintf("mapping %d runs of %d bytes at %#x", j-k, lens[k]*page, at))
		}
		at += uint64(j-k) * lens[k] * page
		k = j
	}
	for uint64(len(es.mapped)) < end {
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
	e.stats.NumPagesMoved += moved
	e.stats.NumPagesMovedAcrossStreams += across
	e.handles, e.lens = hs[:0], lens[:0]
	return true, nil
}

// mapHandles maps hs[i], each a run of size bytes, at addr + i*size: in
// one call, which grants access to them all as PyTorch does, when vm is a
// cudart.RangeMapper, else one by one. It returns how many runs stay
// mapped (the first ones; none after a failed range mapping, which undoes
// itself).
func mapHandles(vm cudart.VirtualMemory, addr, size uint64, hs []cudart.Handle) (int, error) {
	if rm, ok := vm.(cudart.RangeMapper); ok {
		if err := rm.MapRange(cudart.Ptr(addr), size, hs); err != nil {
			return 0, err
		}
		return len(hs), nil
	}
	for k, h := range hs {
		if err := vm.Map(cudart.Ptr(addr+uint64(k)*size), size, h); err != nil {
			return k, err
		}
	}
	return len(hs), nil
}

// releaseHandle releases a handle whose page is unmapped; one the device
// refuses is kept for Close to retry.
func (e *expandable) releaseHandle(h cudart.Handle) {
	if err := e.vm.Release(h); err != nil {
		e.orphans = append(e.orphans, h)
		e.log.Error("releasing a physical page failed; retrying at Close", zap.Uint64("handle", uint64(h)), zap.Error(err))
	}
}

// unmapPages unmaps the runs that make up pages [begin, end) of es
// (whole runs: see wholeRuns) and releases their handles, or keeps them
// for the mapping under way. If an unmap fails, the runs already unmapped
// are mapped again and the error is returned.
func (e *expandable) unmapPages(es *expSegment, begin, end uint64) error {
	vm, page := e.vm, es.seg.PageSize
	for i := begin; i < end; i += uint64(es.run[i]) {
		if es.run[i] == 0 || i+uint64(es.run[i]) > end {
			return fmt.Errorf("allocator: expandable segment %#x: pages [%d, %d) are not whole runs (page %d)", es.seg.Ptr, begin, end, i)
		}
	}
	for i := begin; i < end; i += uint64(es.run[i]) {
		if err := vm.Unmap(cudart.Ptr(es.addr(i)), uint64(es.run[i])*page); err != nil {
			for j := begin; j < i; j += uint64(es.run[j]) {
				if rerr := vm.Map(cudart.Ptr(es.addr(j)), uint64(es.run[j])*page, es.handles[j]); rerr != nil {
					e.log.Error("mapping a run again after a failed unmap failed", zap.Uint64("addr", es.addr(j)), zap.Error(rerr))
				}
			}
			return fmt.Errorf("allocator: unmapping the %d-byte run at %#x: %w", uint64(es.run[i])*page, es.addr(i), err)
		}
	}
	for i := begin; i < end; {
		n := uint64(es.run[i])
		if e.keep && page == e.keepSize {
			e.spare = append(e.spare, spareRun{h: es.handles[i], pages: n, stream: es.seg.Stream})
		} else {
			e.releaseHandle(es.handles[i])
		}
		es.handles[i], es.run[i] = 0, 0
		for range n {
			es.mapped[i] = false
			i++
		}
	}
	return nil
}

// dropSpare releases the runs reclaim kept that the mapping did not use.
func (e *expandable) dropSpare() {
	for _, sp := range e.spare {
		e.releaseHandle(sp.h)
	}
	e.spare = e.spare[:0]
}

// unmapBlock is unmap_block: unmapBlock of the expandable state, then
// the history's and the log's record of the unmapping.
func (a *Allocator) unmapBlock(c *call, b *blocks.Block) (*blocks.Block, error) {
	seg := b.Segment
	u, start, n, err := a.exp.unmapBlock(a.poolOf(b), b)
	if u == nil {
		return nil, err
	}
	a.record(c, actionSegmentUnmap, start, n, cudart.Stream(seg.Stream))
	a.log.Debug("expandable segment unmapped", zap.Uint64("segment", seg.Ptr), zap.Uint64("addr", start),
		zap.Uint64("bytes", n), zap.Uint64("reserved_bytes", a.segs.reserved))
	return u, nil
}

// unmapBlock unmaps the whole runs inside the free block b of pool p.
// Their span becomes an unmapped block, merged with its unmapped
// neighbours and returned with its address and size before the merge;
// the rest of b at either end (partial pages, and pages of runs that
// reach beyond b) stays mapped as free blocks. It returns nil when b
// covers no whole run or on an error.
func (e *expandable) unmapBlock(p *pool, b *blocks.Block) (*blocks.Block, uint64, uint64, error) {
	seg := b.Segment
	es := e.of(seg)
	begin, end := es.runsInside(b)
	if begin >= end {
		return nil, 0, 0, nil
	}
	page := seg.PageSize
	if err := e.unmapPages(es, begin, end); err != nil {
		return nil, 0, 0, err
	}
	p.free.Delete(b)
	start, n := es.addr(begin), (end-begin)*page
	if before := start - b.Ptr; before > 0 {
		mid := blocks.Split(b, before, &p.recycler)
		p.free.Insert(b)
		b = mid
	}
	if b.Size > n {
		p.free.Insert(blocks.Split(b, n, &p.recycler))
	}
	b.Unmapped = true
	blocks.MergeUnmapped(b, &p.recycler)
	seg.Mapped -= n
	e.table.reserved -= n
	e.stats.ReservedBytes.sub(p.stat, int64(n))
	e.stats.NumDeviceFree++
	return b, start, n, nil
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

// unmappable returns the bytes that unmapBlock would unmap from the mapped
// block b: its whole runs.
func (e *expandable) unmappable(b *blocks.Block) uint64 {
	begin, end := e.of(b.Segment).runsInside(b)
	if begin >= end {
		return 0
	}
	return (end - begin) * b.Segment.PageSize
}

// growthExcess is how far serving size bytes from the candidate c would
// raise reserved memory above its high-water mark, 0 when not at all. It
// also leaves c and the blocks after it that the request would use in
// e.chain.
func (e *expandable) growthExcess(c *blocks.Block, size uint64) uint64 {
	chain := e.chain[:0]
	var need uint64
	rem := size
	for x := c; x != nil && rem > 0; x = x.Next {
		chain = append(chain, x)
		if !x.Unmapped {
			rem -= min(rem, x.Size)
			continue
		}
		page := x.Segment.PageSize
		m := min((min(rem, x.Size)+page-1)/page*page, x.Size)
		need += m
		if m < x.Size {
			break
		}
		rem -= min(rem, x.Size)
	}
	e.chain = chain
	limit := max(e.mark, e.allocMark+e.reclaimSlack())
	if e.table.reserved+need <= limit {
		return 0
	}
	return e.table.reserved + need - limit
}

// reclaimSlack is how far reserved memory may rise above the largest
// allocated figure seen at a mapping (allocMark) before a mapping past
// the high-water mark reclaims.
func (e *expandable) reclaimSlack() uint64 {
	return e.allocMark / reclaimSlackDiv / smallBuffer * smallBuffer
}

// The reclaim policy's two fractions (docs/fragmentation.md has the
// measurements that chose them): reserved memory may pass the high-water
// mark without a reclaim while it stays within 1/32 of the largest
// allocated figure, and a reclaim unmaps 1/128 of the mark more than it
// must.
const (
	reclaimSlackDiv    = 32
	reclaimHeadroomDiv = 128
)

// reclaimPages unmaps the whole runs of free blocks outside a.exp.chain
// so that at least want bytes, and if the free blocks allow reclaimHeadroom
// more, are unmapped: the smallest block whose pages cover that target,
// else the largest blocks first. Before the first unmap it waits for the
// streams that own the chosen blocks' segments (see syncStreams).
func (a *Allocator) reclaimPages(c *call, want uint64) error {
	cands := a.exp.cands[:0]
	for _, small := range [2]bool{false, true} {
		for _, p := range a.pools(small) {
			p.free.Ascend(func(b *blocks.Block) bool {
				if b.Segment.Expandable && !slices.Contains(a.exp.chain, b) {
					if n := a.exp.unmappable(b); n > 0 {
						cands = append(cands, reclaimCand{b, n})
					}
				}
				return true
			})
		}
	}
	a.exp.cands = cands[:0]
	if len(cands) == 0 {
		return nil
	}
	target := want + a.exp.reclaimHeadroom()
	sort.SliceStable(cands, func(i, j int) bool { return cands[i].bytes > cands[j].bytes })
	for i := len(cands) - 1; i >= 0; i-- {
		if cands[i].bytes >= target {
			cands = cands[i : i+1] // the smallest that covers the target
			break
		}
	}
	var got uint64
	list := a.exp.scratch[:0]
	for _, cand := range cands {
		if got >= target {
			break
		}
		list = append(list, cand.b)
		got += cand.bytes
	}
	a.exp.scratch = list[:0]
	if err := a.exp.syncStreams(list); err != nil {
		return err
	}
	a.stats.NumReclaims++
	for _, b := range list {
		if _, err := a.unmapBlock(c, b); err != nil {
			return err
		}
	}
	return nil
}

// reclaimHeadroom is how much more than the excess a reclaim unmaps when
// free blocks allow: 1/128 of the high-water mark, in whole 2 MiB pages.
// Peak reserved memory hardly depends on it (a reclaim never maps), but
// without it a workload whose requests grow a little every step (a decoder's
// key-value cache) reclaims, and so synchronises, on nearly every step:
// with it the following mappings fit under the mark until the headroom is
// used up.
func (e *expandable) reclaimHeadroom() uint64 {
	return e.mark / reclaimHeadroomDiv / smallBuffer * smallBuffer
}

// syncStreams waits for the work queued on each stream that owns the
// segment of a block in list, once per stream, before those blocks' pages
// are unmapped: unlike cudaFree, unmapping does not wait for queued work
// that may still read or write the pages. Waiting for the owning streams
// is enough, as in PyTorch's ExpandableSegment::unmapHandles: a free block
// in a free index was last used either on its own stream (work that
// stream synchronisation waits for) or on other streams through
// RecordStream, and then it entered the free index only after the events
// recorded on those streams completed. Other streams keep running.
func (e *expandable) syncStreams(list []*blocks.Block) error {
	var done [8]uint64
	synced := done[:0]
	for _, b := range list {
		s := b.Segment.Stream
		if slices.Contains(synced, s) {
			continue
		}
		if err := e.dev.StreamSynchronize(cudart.Stream(s)); err != nil {
			if !errors.Is(err, cudart.ErrInvalidValue) {
				return fmt.Errorf("allocator: synchronising stream %#x before unmapping: %w", s, err)
			}
			// The stream was destroyed and the allocator not told
			// (ReleaseStream): wait for the whole device instead.
			if err := e.dev.Synchronize(); err != nil {
				return fmt.Errorf("allocator: synchronising the device before unmapping (stream %#x is gone): %w", s, err)
			}
			return nil
		}
		synced = append(synced, s)
	}
	return nil
}

// releaseExpandable is release_blocks for expandable segments: in each
// pool (large, then small) unmap the whole runs of every free block, in
// the free index's order, and release ranges left wholly unmapped.
func (a *Allocator) releaseExpandable(c *call) error {
	synced := false
	for _, small := range [2]bool{false, true} {
		list := a.exp.scratch[:0]
		for _, p := range a.pools(small) {
			p.free.Ascend(func(b *blocks.Block) bool {
				if b.Segment.Expandable {
					list = append(list, b)
				}
				return true
			})
		}
		a.exp.scratch = list[:0]
		for _, b := range list {
			if a.exp.unmappable(b) == 0 {
				continue
			}
			if !synced {
				if err := a.dev.Synchronize(); err != nil {
					return fmt.Errorf("allocator: synchronising the device before unmapping: %w", err)
				}
				synced = true
			}
			u, err := a.unmapBlock(c, b)
			if err != nil {
				return err
			}
			if u != nil && u.Prev == nil && u.Next == nil {
				if err := a.releaseExpandableSegment(a.exp.of(u.Segment)); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// releaseExpandableSegment returns a wholly unmapped range to the device
// and takes it out of the directory.
func (a *Allocator) releaseExpandableSegment(es *expSegment) error {
	seg := es.seg
	if err := a.exp.releaseRange(es); err != nil {
		return err
	}
	a.dirRemove(seg)
	a.log.Debug("expandable segment released", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", seg.Size))
	a.poolOf(seg.Head).recycler.Put(seg.Head)
	return nil
}

// releaseRange returns es's wholly unmapped range to the device and takes
// it out of the segment table and the expandable segments.
func (e *expandable) releaseRange(es *expSegment) error {
	seg := es.seg
	if err := e.vm.ReleaseRange(cudart.Ptr(seg.Ptr), seg.Size); err != nil {
		return fmt.Errorf("allocator: releasing the address range of expandable segment %#x: %w", seg.Ptr, err)
	}
	e.table.remove(seg)
	for i, x := range e.segs {
		if x == es {
			e.segs = append(e.segs[:i], e.segs[i+1:]...)
			break
		}
	}
	return nil
}

// close unmaps every mapped page, releases every handle and
// every range. Each contiguous mapped run counts as one device free.
func (e *expandable) close() []error {
	var errs []error
	vm := e.vm
	if e.table.reserved > 0 {
		if err := e.dev.Synchronize(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: synchronising the device before unmapping: %w", err))
		}
	}
	for _, es := range e.segs {
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
				if err := vm.Unmap(cudart.Ptr(es.addr(i)), n*page); err != nil {
					errs = append(errs, fmt.Errorf("allocator: unmapping the %d-byte run at %#x: %w", n*page, es.addr(i), err))
				} else if err := vm.Release(es.handles[i]); err != nil {
					errs = append(errs, fmt.Errorf("allocator: releasing the run at %#x: %w", es.addr(i), err))
				}
				for range n {
					es.mapped[i] = false
					i++
				}
			}
			e.stats.NumDeviceFree++
		}
		if err := vm.ReleaseRange(cudart.Ptr(es.seg.Ptr), es.seg.Size); err != nil {
			errs = append(errs, fmt.Errorf("allocator: releasing the address range of expandable segment %#x: %w", es.seg.Ptr, err))
		}
	}
	for _, h := range e.orphans {
		if err := vm.Release(h); err != nil {
			errs = append(errs, fmt.Errorf("allocator: releasing physical page handle %#x: %w", uint64(h), err))
		}
	}
	e.segs, e.orphans = nil, nil
	return errs
}

// appendExpandableInfo adds one snapshot.Segment per contiguous mapped range
// of the expandable segment s, as PyTorch's snapshot does.
func (a *Allocator) appendExpandableInfo(out []snapshot.Segment, s *blocks.Segment) []snapshot.Segment {
	open := false
	for b := s.Head; b != nil; b = b.Next {
		if b.Unmapped {
			open = false
			continue
		}
		if !open {
			out = append(out, a.segmentInfo(s, b.Ptr))
			open = true
		}
		si := &out[len(out)-1]
		si.TotalSize += b.Size
		a.addBlock(si, b)
	}
	return out
}

// checkRuns checks that the mapped pages are tiled by runs of 1 to
// maxRun pages, each with a handle, and that nothing else carries a run
// length or a handle.
func (es *expSegment) checkRuns(maxRun uint64) []error {
	var errs []error
	if len(es.run) != len(es.mapped) || len(es.handles) != len(es.mapped) {
		return []error{fmt.Errorf("expandable segment %#x: %d pages, %d run lengths, %d handles", es.seg.Ptr, len(es.mapped), len(es.run), len(es.handles))}
	}
	for i := uint64(0); i < uint64(len(es.mapped)); {
		n := uint64(es.run[i])
		switch {
		case !es.mapped[i]:
			if n != 0 || es.handles[i] != 0 {
				errs = append(errs, fmt.Errorf("expandable segment %#x: unmapped page %d has a run of %d pages, handle %#x", es.seg.Ptr, i, n, uint64(es.handles[i])))
			}
			i++
			continue
		case n == 0 || n > maxRun:
			return append(errs, fmt.Errorf("expandable segment %#x: mapped page %d starts a run of %d pages (want 1 to %d after the previous run)", es.seg.Ptr, i, n, maxRun))
		case es.handles[i] == 0:
			errs = append(errs, fmt.Errorf("expandable segment %#x: the run at page %d has no handle", es.seg.Ptr, i))
		}
		for j := i + 1; j < i+n; j++ {
			if j >= uint64(len(es.mapped)) || !es.mapped[j] || es.run[j] != 0 || es.handles[j] != 0 {
				return append(errs, fmt.Errorf("expandable segment %#x: the %d-page run at page %d is broken at page %d", es.seg.Ptr, n, i, j))
			}
		}
		i += n
	}
	return errs
}

// check compares the expandable segments' pages with their
// blocks: a page is mapped exactly when a mapped block covers part of it.
func (e *expandable) check() []error {
	var errs []error
	n := 0
	for _, s := range e.table.list {
		if s.Expandable {
			n++
		}
	}
	if len(e.spare) > 0 {
		errs = append(errs, fmt.Errorf("%d unmapped page handles kept outside a mapping", len(e.spare)))
	}
	if n != len(e.segs) {
		errs = append(errs, fmt.Errorf("%d expandable segments in the segment list, %d registered", n, len(e.segs)))
	}
	for i, es := range e.segs {
		s := es.seg
		if i > 0 && e.segs[i-1].seg.Ptr >= s.Ptr {
			errs = append(errs, fmt.Errorf("expandable segments out of address order at %#x", s.Ptr))
		}
		if s.Index >= len(e.table.list) || e.table.list[s.Index] != s {
			errs = append(errs, fmt.Errorf("expandable segment %#x is not in the segment list", s.Ptr))
			continue
		}
		if s.PageSize == 0 || s.Size%s.PageSize != 0 {
			continue // blocks.Check reports it
		}
		mapped := func(i uint64) bool { return i < uint64(len(es.mapped)) && es.mapped[i] }
		var pages uint64
		for i := range es.mapped {
			if es.mapped[i] {
				pages++
			}
		}
		errs = append(errs, es.checkRuns(e.maxRunPages(s))...)
		if pages*s.PageSize != s.Mapped {
			errs = append(errs, fmt.Errorf("expandable segment %#x: %d pages mapped, %d bytes in mapped blocks", s.Ptr, pages, s.Mapped))
		}
		for b := s.Head; b != nil; b = b.Next {
			off := b.Ptr - s.Ptr
			first, last := off/s.PageSize, (off+b.Size+s.PageSize-1)/s.PageSize
			for i := first; i < last; i++ {
				if mapped(i) == b.Unmapped {
					errs = append(errs, fmt.Errorf("expandable segment %#x: page %d (at %#x) is mapped=%v under %v", s.Ptr, i, es.addr(i), mapped(i), b))
					break
				}
			}
		}
	}
	return errs
}
