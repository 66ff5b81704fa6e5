// Package vmm is the memory of expandable segments
// (expandable_segments:True), after PyTorch's ExpandableSegment
// (c10/cuda/CUDACachingAllocator.cpp): virtual address ranges, the
// physical pages mapped into them, the runs and handles behind those
// pages, and the bytes they hold. The allocator keeps the policy around
// it: the pools and their streams, the cap, retries and out of memory, the
// segment table and directory, history and logs. A Space imports only
// blocks and cudart of allocd's packages; it never calls back into the
// allocator.
//
// # Design
//
// Instead of one device allocation per segment, the allocator reserves a
// range of virtual addresses per (stream, pool), large enough to map the
// whole device (1⅛ × its total memory, rounded to pages, as PyTorch sizes
// it), and maps physical pages into it on demand: 2 MiB pages in the small
// pool, 20 MiB pages in the large one (2 MiB by default with allocd's
// reclaim, below). The range is one blocks.Segment with Expandable set;
// its blocks tile the whole reservation, and the blocks over unmapped
// pages carry Unmapped. An unmapped block is free but never in a free
// index, starts and ends on page boundaries, and merges only with unmapped
// neighbours; a mapped block never merges with an unmapped one. The
// segment's Mapped bytes are what it holds from the device.
//
// A request is first served, as always, from the pool's free index (best
// fit within the stream), with one twist (PyTorch's expandable_size, Fit):
// a free block followed by unmapped pages can grow into them, so for best
// fit its size counts as its own plus theirs, and the next larger block is
// taken while that sum is smaller. That keeps the free block at the mapped
// end of a segment, which can grow, for requests nothing else serves.
//
// A miss (PyTorch's try_allocate_expandable_block; Find, Reserve,
// MapBlock) looks, in address order, for the first unmapped block of the
// stream and pool that, together with a free block just before it and the
// free or unmapped blocks after it, has room for the request; normally
// that is the segment's unmapped tail and the free block at the end of the
// mapped part. It maps just enough whole pages at the start of the
// unmapped block (with reclaim, up to the next 20 MiB boundary: see
// "Growth to the page boundary"), merges the new pages with the free
// neighbours and hands out the result; the segment grows at its end instead of a new segment
// being allocated. Only when no segment of the stream and pool has room is
// a new range reserved. Blocks of an expandable segment split whenever the
// remainder is at least 512 bytes, in both pools.
//
// # Beyond PyTorch: reclaim before growth
//
// PyTorch unmaps free pages only on out of memory and in empty_cache, so a
// free hole in the middle of a segment that a large request does not fit
// stays mapped while the segment grows at its end: on the gpt2_train trace
// a 785 MiB request grows the segment past a 393 MiB hole and PyTorch's
// expandable peak (7886 MiB) ends above its default one (7708 MiB). With
// Config.Reclaim a Space moves the physical memory instead
// (docs/fragmentation.md has the measurements):
//
//   - A mapping may raise reserved memory above its high-water mark (the
//     largest reserved figure so far) only while reserved stays within a
//     slack above what is allocated at that moment (GrowthExcess is told
//     it); the slack is 1/32 of the largest allocated figure seen at a
//     mapping. Past both, the whole runs (below) of other free blocks
//     are unmapped first (Choose: the smallest block that covers the
//     target, else the largest first), then the request is mapped. The
//     target is the excess plus a headroom of 1/128 of the mark, so that
//     the next few mappings of a workload whose requests grow a little
//     every step (a decoder's key-value cache) fit without another
//     reclaim. Neither mark is ever reset.
//   - The candidates are the free blocks of every stream's pools, so a
//     stream that must grow takes the pages another stream freed:
//     unmapped from that stream's range into the handle cache, mapped
//     into its own (the same physical pages, reported in MapBlock's
//     Mapping); live blocks never move. A block that another stream may still use (RecordStream) is
//     not in any free index until its events complete, so its pages are
//     never handed over before then.
//   - A reclaim waits only for what it must (Settle): for the streams
//     that own blocks it releases or hands to another stream, not for the
//     whole device, and not at all for a block of the growing stream
//     itself (see "Reclaim without waiting").
//   - With reclaim on, the large pool maps Config.ReclaimPage pages (2 MiB
//     by default) instead of PyTorch's 20 MiB, so a free hole gives back
//     all of itself but the partial pages at either end (and the runs,
//     below, that reach past it).
//
// # Growth to the page boundary
//
// A range that grows by what each request needs, in 2 MiB pages, maps
// often where PyTorch's 20 MiB page would have served the next requests
// too: a model's weights loaded tensor by tensor, a decoder's cache grown
// a step at a time. So with reclaim a large-pool mapping continues to the
// next LargePage boundary of its range (roundEnd), when the unmapped
// block reaches that far, as long as reserved memory, counting every page
// it maps as new, stays within what reclaim allows (excessAt's limit, for
// the allocated figure GrowthExcess was last told) plus reclaim's
// headroom; else as far as that allows, which may be nothing. The
// headroom is the room a reclaim clears beyond its excess for the next
// growths; rounding into it serves the same purpose without moving
// memory. Up to the high-water mark rounding raises no peak; past it, it
// stays within the slack and the headroom above allocated memory, so the
// bound on peak reserved memory grows by the headroom (1/128 of the mark)
// and no more, besides what no reclaim can give back. Rounding never
// passes the ceiling (SetCeiling: the allocator's per-process cap) and
// never happens during a capture; when the device refuses the rounded
// mapping for lack of memory, MapBlock maps what the request needs
// instead. Config.Exact turns it off, for tests of reclaim alone.
//
// Without Config.Reclaim (the allocator's WithPyTorchExpandable) a Space
// grows exactly as PyTorch's segments do, and replays reproduce PyTorch's
// expandable_segments:True peaks.
//
// # Runs
//
// On a GPU each handle costs a cuMemCreate, a cuMemMap and a cuMemUnmap
// of 6 to 35 microseconds each, the same whatever its size from 2 to
// 64 MiB, and a cuMemRelease that grows with it (TestGPUVirtualMemoryCost
// on an H200), so one handle per 2 MiB page made
// growth about ten times as costly as PyTorch's 20 MiB pages. Physical
// memory therefore comes in runs: one handle backs a run of consecutive
// pages, created, mapped, unmapped and moved whole. A growth of n pages
// maps them in runs of ⌈n/4⌉ pages (runsPerGrowth), but none shorter than
// 1/16 of the largest allocated figure seen at a mapping (minRunDiv) and
// none longer than 64 MiB (maxRunBytes), after mapping the runs the handle
// cache (below) holds; runs of one length are mapped with one grant of
// access. So a growth of up to 256 MiB makes at most four handles, a
// workload that grows a little at a time makes runs that lengthen with
// its footprint, and the part of a run that a partly reused free block
// strands (runs move only whole) is bounded by a quarter of the block or
// a sixteenth of the footprint. Unmapping (reclaim, the allocator's
// EmptyCache) takes the whole runs inside a free block, in one cuMemUnmap
// per contiguous stretch. The small pool and PyTorch's mode map one page
// per handle, as PyTorch does.
//
// # Coarse reclaim
//
// Each run that reclaim moves costs an unmap and a map that PyTorch never
// makes, and growth in small pages maps often where PyTorch's 20 MiB
// page would have served the next requests. With Config.Coarse
// (expandable_reclaim:coarse) a large-pool range grows as PyTorch's do
// and moves only what pays for itself:
//
//   - a mapping ends on the next LargePage (20 MiB) boundary of its
//     range, when the unmapped block reaches that far, whatever reserved
//     memory that takes (roundEnd; the ceiling still applies);
//   - a growth is one run, of at most maxRunBytes (runPages);
//   - Choose takes only free blocks whose whole runs come to at least
//     coarseMinMove (64 MiB), and UnmapBlock, told the bytes still
//     wanted, unmaps only the last runs of a block that cover them.
//
// Reserved memory then stays at or below PyTorch's expandable segments'
// on the traces measured, with fewer device calls than PyTorch makes, and
// gives up the lead the default gets from moving small free stretches
// (docs/fragmentation.md has the figures).
//
// # The handle cache
//
// The runs that reclaim unmaps are not released: they go to the handle
// cache, and a mapping of the same pool and page size maps them before it
// creates new ones (the longest that what is missing covers, else the
// shortest longer one that fits in the unmapped block: mapping past the
// request costs no reserved memory, the run being held already). Moving
// memory then costs an unmap and a map, not also a release and a create
// (with standby mappings, below, a map).
// A mapping that must create a run while the cache holds runs too long
// for the gap it fills (between the standby mappings it takes back)
// first releases those, the longest first, as many bytes as it creates
// (shedUnfit), so that memory held in the wrong shape does not stay
// reserved beside the new. The cache is held from the device, so
// Reserved counts it, and GrowthExcess counts only the pages it cannot
// serve; reclaim therefore
// never lets reserved memory pass what it did when it released. The cache
// is released by ReleaseCache (the allocator's EmptyCache, its
// out-of-memory path and a cap) and by Close.
//
// # Standby mappings
//
// A GPU may map one physical handle at several addresses at once. With
// Config.Standby (on with reclaim), the runs that reclaim keeps are not
// unmapped at all: they go to the handle cache and also stay mapped
// where they were, as standby mappings, over pages that are unmapped as
// far as the blocks go (an Unmapped block covers them, so nothing hands
// them out). Moving memory then costs one map, and moving it back costs
// nothing: a mapping that reaches a standby mapping whose run is still in
// the cache takes it back as it stands (Calls.Revived), and one whose run
// is mapped elsewhere by then first unmaps the standby mapping (the unmap
// reclaim used to make, made later, and in one call for a stretch of
// them). Standby mappings cost address space, which is plentiful, and no
// physical memory: Reserved counts every run once. A cached run that a
// mapping could take back a few pages on is left for it, unless nothing
// else in the cache fits (new memory would cost more than the unmap).
// Releasing a run (ReleaseCache, the release path of UnmapBlock, Close)
// unmaps its standby mappings first, and ReleaseRange those of the range.
// During a CUDA graph capture, which may not unmap or wait (SetCapturing),
// Find gives no room over a standby mapping that would have to be
// unmapped, and MapBlock stops before one.
//
// # Reclaim without waiting
//
// Unmapping, unlike cudaFree, does not wait for queued work that may still
// use the pages, so PyTorch's unmapping, and allocd's before standby
// mappings, synchronised the owning stream first: a host-side stall until
// the stream drained, at every reclaim. With standby mappings, a reclaim
// for a growth on the stream that owns the chosen block unmaps nothing:
// the work queued before it keeps its addresses, and the growth's blocks
// are used by work queued after it on the same stream. Settle therefore
// waits only for the streams whose blocks are released (they are
// unmapped now) or handed to another stream (whose work could otherwise
// run beside the old), and for the growing stream it records an event
// instead (pending.go). That event guards what the reclaim parked: a
// standby mapping is unmapped, and a cached run mapped for another
// stream, only once it has completed; by then it usually has, and a query
// says so without blocking (Calls.Waits counts the waits that block or
// synchronise). During a capture, cached runs whose event is not known to
// have completed are left alone, even on the stream that parked them: the
// captured work runs when the graph is launched, on whatever stream that
// is, and would not be ordered after the work that used them. A capture
// may not query events either, so SetCapturing queries them just before
// the first capture begins.
//
// The pending that Settle records is held by parkWith as well as by what
// UnmapBlock parks with it, until the next Settle or Close: a mapping may
// take every parked run back before then, and the event must be
// destroyed exactly once, when its last holder lets it go.
//
// The marks that the run and reclaim policies read (the largest reserved
// figure, the largest allocated figure seen at a mapping) describe the
// workload since the last StartOver, which the allocator calls after
// EmptyCache: memory given back is history the next workload does not
// inherit.
//
// A failed Create releases the handles made for the request and returns
// cached runs to the cache, and MapBlock returns the device's
// out-of-memory error; the allocator then takes its usual path (release
// cached memory, retry once, then an OOMError). UnmapBlock is PyTorch's
// unmap_block: the span of the whole runs inside a free block becomes
// unmapped and merges with unmapped neighbours; the rest of the block at
// either end stays mapped as free blocks. A range that is wholly unmapped
// can be released (ReleaseRange). Unlike cudaFree, unmapping does not wait
// for work still using the memory: the caller readies a reclaim's blocks
// first (Settle), or synchronises the whole device. Close unmaps and
// releases everything.
//
// A Space counts and times every create, map, grant of access, unmap and
// release it makes (Calls).
//
// # What a Space reports
//
// A Space keeps its segments' Mapped bytes, the handle cache's bytes and
// their sum (Reserved), and returns every change for the caller's
// statistics: the bytes of each mapping (one per MapBlock, however many
// pages it maps: PyTorch's num_device_alloc), those of them it created,
// its time and the pages that came from the cache (Mapping), the bytes of
// each unmapping and those it released, and the device frees of Close.
// The caller enters the segments Reserve returns in its own segment table
// and takes out those ReleaseRange releases; it holds no pointer of the
// caller's but the pools' free indexes and recyclers it is handed.
//
// A Space is not safe for concurrent use: the allocator calls it in world
// mode only. Its errors read "allocator: …", the package its callers see.
package vmm
