package allocator

// Expandable segments (expandable_segments:True): the allocator's side.
// Package allocator/internal/vmm holds their memory (the virtual ranges,
// their pages, runs and handles, reclaim's spare runs, the bytes mapped)
// and its doc describes the design. This file holds the policy around it,
// PyTorch's malloc and release_blocks for expandable segments: the cap,
// the retry after releasing cached memory and out of memory, walking the
// pools for reclaim and release, the segment table and directory, history
// and logs.
//
// Statistics, as PyTorch keeps them:
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
// # Small requests at the limit
//
// The small pool maps one-page runs and the large pool longer ones, and
// a run maps only whole, so memory changes pools only through a release
// and a create: a small-pool growth that reclaim serves from the large
// pool's free runs releases them (the small pool cannot map them), and
// the large pool creates them again at its next growth. With the
// default reclaim policy, a small request that would grow its pool past
// what reclaim allows is therefore served from a free block of its own
// stream's large pool, when one holds it, instead: the block splits
// there as any large-pool block does, counts in the large pool's
// statistics, and returns to the large pool's free index when freed. No
// memory moves and no stream waits. Coarse reclaim, which moves no
// stretch this short, leaves the pools apart as PyTorch does.
// Stats.NumSmallFromLarge counts these requests.
//
// Whether a request is past the limit depends on the allocated bytes of
// every stream, which only world mode reads exactly, but the hot path
// decides too (smallFromLargeHot): with its shard's lock held, the
// Space and the peaks stay still, and an upper bound of the allocated
// bytes (exact for a sole shard) settles the question whenever it says
// "past the limit", since the limit never falls as allocated memory
// falls. Otherwise the request goes to world mode as before. A warm
// decoder's pass makes such a request every 40 to 50 operations
// (gpt2m_generate: 13,908 of 608,552), each a world-mode call before.
//
// # Lending across streams
//
// With reclaim (not WithPyTorchExpandable), a growth that the device or
// the per-process cap refuses even after the out-of-memory path released
// cached memory borrows a free block of another stream's range instead
// of failing: reclaim and release move only whole runs inside free
// blocks, so free memory in pieces shorter than a run, or in the same
// runs as live blocks, is otherwise out of reach of a stream that does
// not own it. Lending comes last because it leaves the free memory as
// fragmented as it found it, where releasing it lets the next growths map
// it whole (docs/fragmentation.md has the measurements). The block is the smallest that holds the request,
// mapped, in a pool of the same kind and no private pool; it stays in its
// segment (its stream's shard counts it) and is marked Lent to the
// borrowing stream. Order on the device keeps it safe without the host
// waiting (cudart.StreamWaiter: an event recorded on one stream that the
// other waits for): at the loan, the borrower's work from then on waits
// for the work its owner queued so far; at Free, which takes world mode
// for a lent block, the owner's work from then on waits for the
// borrower's, and the block returns to its owner's pool as any of its
// blocks does. A device that cannot order streams lends nothing; a
// return that cannot be ordered synchronises the borrower. During a
// capture nothing is lent, and a lent block freed then waits, as blocks
// used by other streams do, until the capture ends. Stats.NumLends counts
// the loans.
//
// None of this touches the default path: with expandable segments off, no
// segment is Expandable and no block Unmapped.

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator/internal/vmm"
	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/snapshot"
)

// WithPyTorchExpandable makes expandable segments grow exactly as
// PyTorch's do: free pages are unmapped only by EmptyCache and on out of
// memory, never to keep reserved memory near its high-water mark (see
// "Beyond PyTorch" in package allocator/internal/vmm). It has no effect
// without expandable_segments:True.
func WithPyTorchExpandable() Option {
	return func(o *options) { o.pytorchExpandable = true }
}

// checkExpandable checks that dev can serve expandable segments: it must
// implement cudart.VirtualMemory with a granularity that divides the page
// sizes. It returns the virtual memory.
func checkExpandable(dev cudart.Device, cfg Config) (cudart.VirtualMemory, error) {
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
	return vm, nil
}

// expSource is the expandable segments as the allocator's segment source.
type expSource struct {
	space *vmm.Space
	table *segTable
	stats *Stats
}

// close returns every range to the device; each contiguous mapped
// stretch counts as one device free.
func (e expSource) close() []error {
	frees, errs := e.space.Close()
	e.stats.NumDeviceFree += frees
	return errs
}

func (e expSource) check() []error { return e.space.Check(e.table.list) }

// vmPool is p as the Space sees it.
func (p *pool) vmPool() vmm.Pool {
	return vmm.Pool{Free: p.free, Recycler: &p.recycler, Small: p.small}
}

// growExpandable is grow for expandable segments: map pages for the
// request; if the device or the cap says no, release cached memory (unmap
// free pages) and try once more; then, with reclaim, borrow another
// stream's free block (lend); then fail with an OOMError.
func (a *Allocator) growExpandable(c *call, p *pool, stream cudart.Stream, size, rounded uint64) (*blocks.Block, error) {
	allocSize := allocationSize(rounded)
	b, err := a.allocExpandable(c, p, stream, rounded, allocSize, false)
	if b == nil && err == nil && a.capturing == 0 { // nothing is released during a capture (pools.go)
		if err = a.releaseCachedBlocks(c); err == nil {
			b, err = a.allocExpandable(c, p, stream, rounded, allocSize, true)
		}
	}
	if err != nil {
		return nil, err
	}
	if b == nil && a.capturing == 0 && a.exp.Reclaims() && !a.noLend {
		b = a.lend(c, p, stream, rounded)
	}
	if b == nil {
		return nil, a.outOfMemory(c, size, allocSize, stream, c.devErr)
	}
	return b, nil
}

// allocExpandable is alloc_block with expandable segments: the per-process
// cap is checked against the request's segment size, as PyTorch does, then
// try_allocate_expandable_block, with a reclaim first when the mapping
// would pass what reclaim allows. It returns (nil, nil) when the device is
// out of memory (c.devErr says why) or the cap is reached (c.devErr nil).
func (a *Allocator) allocExpandable(c *call, p *pool, stream cudart.Stream, rounded, allocSize uint64, isRetry bool) (*blocks.Block, error) {
	if isRetry {
		a.stats.NumAllocRetries++
	}
	c.devErr = nil
	if a.capped && a.segs.reserved+allocSize > a.allowed {
		return nil, nil
	}
	if p.small && a.exp.Reclaims() && a.capturing == 0 && a.cfg.ExpandableReclaim == ReclaimFine {
		// Small requests at the limit, before looking for room to grow.
		sums, _ := a.hotSums()
		if a.exp.SmallGrowthExcess(uint64(sums[hotAllocatedBytes][PoolAll])+rounded) > 0 {
			if lb, q := a.smallFromLarge(p, rounded); lb != nil {
				c.lender = q
				return lb, nil
			}
		}
	}
	b, err := a.findExpandableBlock(p, uint64(stream), rounded)
	if err != nil {
		return nil, err
	}
	if a.exp.Reclaims() && a.capturing == 0 { // unmapping synchronises: not during a capture
		sums, _ := a.hotSums()
		if excess := a.exp.GrowthExcess(b, rounded, uint64(sums[hotAllocatedBytes][PoolAll])+rounded); excess > 0 {
			if err := a.reclaimPages(c, excess, p.small, uint64(stream)); err != nil {
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

// findExpandableBlock is find_expandable_block: the block the Space finds,
// or else the unmapped block of a newly reserved range, entered in the
// segment table and the directory.
func (a *Allocator) findExpandableBlock(p *pool, stream, size uint64) (*blocks.Block, error) {
	if b := a.exp.Find(p.vmPool(), stream, size); b != nil {
		return b, nil
	}
	b, err := a.exp.Reserve(p.vmPool(), stream)
	if err != nil {
		return nil, err
	}
	seg := b.Segment
	seg.Index = len(a.segs.list)
	a.segs.add(seg)
	a.dirAdd(seg)
	a.log.Debug("expandable segment reserved", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", seg.Size),
		zap.Uint64("page_bytes", seg.PageSize), zap.Bool("small_pool", p.small), zap.Uint64("stream", stream))
	return b, nil
}

// mapBlock is map_block: the Space maps size bytes of the unmapped block b,
// then the reserved bytes, the statistics, the history and the log count
// the mapping. It reports false when nothing was mapped: with a nil error
// when the device is out of memory (c.devErr says why).
func (a *Allocator) mapBlock(c *call, p *pool, b *blocks.Block, size uint64) (bool, error) {
	seg, start := b.Segment, b.Ptr
	m, err := a.exp.MapBlock(p.vmPool(), b, size)
	if shed := m.Shed + m.ShedSmall; shed > 0 { // released before New was created, even on an error
		a.segs.reserved -= shed
		a.stats.ReservedBytes.sub(PoolLarge, int64(m.Shed))
		a.stats.ReservedBytes.sub(PoolSmall, int64(m.ShedSmall))
	}
	if err != nil {
		if errors.Is(err, cudart.ErrOutOfMemory) {
			c.devErr = err
			return false, nil
		}
		return false, err
	}
	a.segs.reserved += m.New
	a.stats.ReservedBytes.add(p.stat, int64(m.New))
	if m.Crossed > 0 { // cached runs the other pool had counted
		a.stats.ReservedBytes.sub(otherPool(p.stat), int64(m.Crossed))
		a.stats.ReservedBytes.add(p.stat, int64(m.Crossed))
	}
	a.stats.NumDeviceAlloc++
	a.stats.DeviceMallocLatency.observe(m.Took)
	a.stats.NumPagesMoved += m.Moved
	a.stats.NumPagesMovedAcrossStreams += m.Across
	a.record(c, actionSegmentMap, start, m.Bytes, cudart.Stream(seg.Stream))
	a.log.Debug("expandable segment mapped", zap.Uint64("segment", seg.Ptr), zap.Uint64("addr", start),
		zap.Uint64("bytes", m.Bytes), zap.Uint64("reserved_bytes", a.segs.reserved), zap.Duration("took", m.Took))
	return true, nil
}

// unmapBlock is unmap_block: the Space unmaps the whole runs inside the
// free block b (with most > 0, only the last that cover most bytes) and
// releases them, or with keep puts them in its handle cache; then the
// reserved bytes (what was released), the statistics, the
// history and the log count the unmapping. It returns the unmapped block,
// or nil when b covers no whole run or on an error.
func (a *Allocator) unmapBlock(c *call, b *blocks.Block, keep bool, most uint64) (*blocks.Block, error) {
	seg := b.Segment
	p := a.poolOf(b)
	u, start, n, released, err := a.exp.UnmapBlock(p.vmPool(), b, keep, most)
	if u == nil {
		return nil, err
	}
	a.segs.reserved -= released
	a.stats.ReservedBytes.sub(p.stat, int64(released))
	a.stats.NumDeviceFree++
	a.record(c, actionSegmentUnmap, start, n, cudart.Stream(seg.Stream))
	a.log.Debug("expandable segment unmapped", zap.Uint64("segment", seg.Ptr), zap.Uint64("addr", start),
		zap.Uint64("bytes", n), zap.Bool("cached", keep), zap.Uint64("reserved_bytes", a.segs.reserved))
	return u, nil
}

// reclaimPages unmaps, before a mapping in the small or large pool of
// stream, the whole runs of free blocks that the Space chooses
// (vmm.Space.Choose) to free at least want bytes, once the Space has
// readied them (vmm.Space.Settle: the streams that own blocks it must
// wait for): blocks of that pool kind in every stream's pools when their
// runs cover want, else blocks of both kinds. Runs that the mapping's
// pool can map go to the handle cache, for this mapping and the next ones
// to map again (the small pool's one-page runs serve the large pool too,
// when pages are of one size), staying mapped where they were as standby
// mappings; others are released.
func (a *Allocator) reclaimPages(c *call, want uint64, small bool, stream uint64) error {
	list := a.chooseReclaim(want, []bool{small})
	var got uint64
	for _, b := range list {
		got += a.exp.Unmappable(b)
	}
	if got < want {
		list = a.chooseReclaim(want, []bool{false, true})
	}
	if len(list) == 0 {
		return nil
	}
	if _, err := a.exp.Settle(list, small, stream); err != nil {
		return err
	}
	a.stats.NumReclaims++
	target, chosen := a.exp.Target(want), uint64(0)
	for _, b := range list {
		keep := a.exp.Keeps(b, small)
		var most uint64 // coarse reclaim moves no more than the target
		if a.cfg.ExpandableReclaim == ReclaimCoarse {
			if chosen >= target {
				break
			}
			most = target - chosen
		}
		chosen += a.exp.Unmappable(b)
		if _, err := a.unmapBlock(c, b, keep, most); err != nil {
			return err
		}
	}
	return nil
}

// chooseReclaim is vmm.Space.Choose over the free blocks of every
// stream's pools of the given kinds (small or not).
func (a *Allocator) chooseReclaim(want uint64, kinds []bool) []*blocks.Block {
	free := a.scratch[:0]
	for _, sm := range kinds {
		for _, p := range a.pools(sm) {
			p.free.Ascend(func(b *blocks.Block) bool {
				free = append(free, b)
				return true
			})
		}
	}
	a.scratch = free[:0]
	return a.exp.Choose(free, want)
}

// releaseCache releases the Space's handle cache in both pools and takes
// its bytes out of reserved memory.
func (a *Allocator) releaseCache() {
	for _, small := range [2]bool{false, true} {
		if n := a.exp.ReleaseCache(small); n > 0 {
			stat := PoolLarge
			if small {
				stat = PoolSmall
			}
			a.segs.reserved -= n
			a.stats.ReservedBytes.sub(stat, int64(n))
			a.log.Debug("expandable handle cache released", zap.Bool("small_pool", small), zap.Uint64("bytes", n),
				zap.Uint64("reserved_bytes", a.segs.reserved))
		}
	}
}

// releaseExpandable is release_blocks for expandable segments: release
// the handle cache, then in each pool (large, then small) unmap the whole
// runs of every free block, in the free index's order, release them, and
// release ranges left wholly unmapped.
func (a *Allocator) releaseExpandable(c *call) error {
	a.releaseCache()
	synced := false
	for _, small := range [2]bool{false, true} {
		list := a.scratch[:0]
		for _, p := range a.pools(small) {
			p.free.Ascend(func(b *blocks.Block) bool {
				if b.Segment.Expandable {
					list = append(list, b)
				}
				return true
			})
		}
		a.scratch = list[:0]
		for _, b := range list {
			if a.exp.Unmappable(b) == 0 {
				continue
			}
			if !synced {
				if err := a.dev.Synchronize(); err != nil {
					return fmt.Errorf("allocator: synchronising the device before unmapping: %w", err)
				}
				synced = true
			}
			u, err := a.unmapBlock(c, b, false, 0)
			if err != nil {
				return err
			}
			if u != nil && u.Prev == nil && u.Next == nil {
				if err := a.releaseExpandableSegment(u.Segment); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// releaseExpandableSegment returns a wholly unmapped range to the device
// and takes it out of the segment table and the directory.
func (a *Allocator) releaseExpandableSegment(seg *blocks.Segment) error {
	if err := a.exp.ReleaseRange(seg); err != nil {
		return err
	}
	a.segs.remove(seg)
	a.dirRemove(seg)
	a.log.Debug("expandable segment released", zap.Uint64("addr", seg.Ptr), zap.Uint64("bytes", seg.Size))
	a.poolOf(seg.Head).recycler.Put(seg.Head)
	return nil
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

// otherPool is the large pool for the small one and the small for the
// large.
func otherPool(p Pool) Pool {
	if p == PoolSmall {
		return PoolLarge
	}
	return PoolSmall
}

// smallFromLarge serves a small-pool request that would grow its pool
// past what reclaim allows from a free block of the same stream's large
// pool, the best fit, taken out of its free index; it returns the block
// and the large pool, or nil. Only the default reclaim policy calls it
// (see "Small requests at the limit" above).
func (a *Allocator) smallFromLarge(p *pool, size uint64) (*blocks.Block, *pool) {
	q := &p.sh.large
	b := a.findFreeBlock(q, uint64(q.sh.stream), size)
	if b == nil {
		return nil, nil
	}
	q.free.Delete(b)
	a.stats.NumSmallFromLarge++
	return b, q
}

// smallFromLargeHot is smallFromLarge on sh's hot path (its lock held),
// for a request of rounded bytes that no free block of its pool p holds:
// the free block of sh's large pool that world mode would take, still in
// its free index, when world mode would surely take one; else nil, and
// the request goes to world mode, which decides exactly. What it reads
// outside sh (the configuration, the cap, a capture under way, the
// Space, the peaks) changes only with every shard lock held, so sh's
// lock keeps it still. World mode asks the Space only with expandable
// segments under the default reclaim policy, no capture under way and
// room under the per-process cap for a small-pool page (allocExpandable
// stops at the cap before it asks), and so does this. The Space's
// decision needs the allocated bytes of every shard, which the hot path
// cannot read; allocatedBound's upper bound serves, since what reclaim
// allows never falls as allocated memory falls (vmm.Space.SmallAtLimit),
// and with it the Space changes nothing, as it would not in world mode.
// So a request gets the same block, split the same way, either way; only
// which path made the change differs (TestHotSmallFromLargeReplays).
func (a *Allocator) smallFromLargeHot(sh *shard, p *pool, rounded uint64) *blocks.Block {
	if !p.small || a.exp == nil || !a.exp.Reclaims() || a.cfg.ExpandableReclaim != ReclaimFine || a.capturing > 0 ||
		a.capped && a.segs.reserved+smallBuffer > a.allowed || a.slowFromLarge {
		return nil
	}
	if bound, ok := a.allocatedBound(sh); !ok || !a.exp.SmallAtLimit(bound+rounded) {
		return nil
	}
	return a.findFreeBlock(&sh.large, uint64(sh.stream), rounded)
}

// allocatedBound returns at least the allocator's allocated bytes (all
// pools, every shard, and the allocator's own), from sh's hot path: what
// it reads changes with every shard lock held, so sh's lock keeps it
// still. A sole shard (owner mode, "The sole shard") is the only one with
// allocated blocks, so for it the figure is exact. With no owner, every
// shard's cap, the reservoir and the allocator's own figure add up to no
// more than the peak (shareCaps), so the others hold at most the peak
// less sh's cap. While another shard is the owner its caps may stand
// above the peak, which it has not settled: then there is no bound, and
// ok is false.
func (a *Allocator) allocatedBound(sh *shard) (bound uint64, ok bool) {
	own := sh.stats.AllocatedBytes.current()
	switch a.owner {
	case sh:
		return uint64(a.stats.AllocatedBytes[PoolAll].Current + own), true
	case nil:
		return uint64(a.stats.AllocatedBytes[PoolAll].Peak - (sh.caps[hotAllocatedBytes][PoolAll] - own)), true
	}
	return 0, false
}

// lend serves a request that the device or the cap refused to map for,
// even after cached memory was released (see "Lending across streams"):
// the smallest mapped free block of another stream's pool of p's kind
// that holds size bytes, taken out of its free index for the request on
// stream, with that stream's work from now on ordered after the work its
// owner queued so far. c.lender says whose pool it came from. It
// returns nil when no block qualifies or the device cannot order the
// streams. Private pools neither lend nor borrow.
func (a *Allocator) lend(c *call, p *pool, stream cudart.Stream, size uint64) *blocks.Block {
	if p.sh.held() {
		return nil
	}
	var best *blocks.Block
	var from *pool
	for _, q := range a.pools(p.small) {
		if q == p {
			continue
		}
		b := q.free.LowerBound(uint64(q.sh.stream), size)
		if b == nil || b.Unmapped || !b.Segment.Expandable {
			continue
		}
		if best == nil || b.Size < best.Size {
			best, from = b, q
		}
	}
	if best == nil || !a.orderAfter(from.sh.stream, stream) {
		return nil
	}
	from.free.Delete(best)
	best.Lent, best.Borrower = true, uint64(stream)
	c.lender = from
	a.stats.NumLends++
	a.log.Debug("expandable block lent", zap.Uint64("addr", best.Ptr), zap.Uint64("bytes", best.Size),
		zap.Uint64("owner", uint64(from.sh.stream)), zap.Uint64("borrower", uint64(stream)))
	return best
}

// orderAfter makes the work queued on later from now on wait, on the
// device, for the work queued on first so far: an event recorded on first
// that later waits for (cudart.StreamWaiter). It reports false when it
// could not, having logged why.
func (a *Allocator) orderAfter(first, later cudart.Stream) bool {
	w, ok := a.dev.(cudart.StreamWaiter)
	if !ok {
		return false
	}
	ev, err := a.getEvent()
	if err != nil {
		a.log.Warn("ordering two streams: no event", zap.Error(err))
		return false
	}
	defer a.spareEvents.Put(ev)
	if err := a.dev.EventRecord(ev, first); err != nil {
		a.log.Warn("ordering two streams: recording an event", zap.Uint64("stream", uint64(first)), zap.Error(err))
		return false
	}
	if err := w.StreamWaitEvent(later, ev); err != nil {
		a.log.Warn("ordering two streams: waiting for an event", zap.Uint64("stream", uint64(later)), zap.Error(err))
		return false
	}
	return true
}

// returnLent ends the loan of the freed block b: the work its segment's
// stream queues from now on waits for the work the borrower queued so
// far, so that b returns to its pool as any block of that stream does.
// If the device cannot order them, the borrower is synchronised.
func (a *Allocator) returnLent(b *blocks.Block) {
	owner, borrower := cudart.Stream(blocks.DeviceStream(b.Segment.Stream)), cudart.Stream(b.Borrower)
	b.Lent, b.Borrower = false, 0
	if a.orderAfter(borrower, owner) {
		return
	}
	if err := a.dev.StreamSynchronize(borrower); err != nil {
		a.log.Error("synchronising a borrowing stream failed; synchronising the device", zap.Error(err))
		if serr := a.dev.Synchronize(); serr != nil {
			a.log.Error("device synchronize failed", zap.Error(serr))
		}
	}
}
