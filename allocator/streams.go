package allocator

// Streams come and go: a server makes one per request, a library its own.
// Each stream the allocator sees gets a shard (shard.go), and every slow
// path (world mode, shareCaps, garbage collection, EmptyCache, Stats,
// Check) walks the shards, so a shard is kept only while its stream is
// live: while it has an allocated or parked block, a block waiting for
// events, or cached segments that it used lately. A stream is idle when
// it has none of the first three; an idle stream's shard goes, with its
// cached segments (their directory entries, and in expandable mode their
// pages and address ranges), its caps and its cumulative statistics
// (folded into the allocator's own):
//
//   - at once when the program says the stream is destroyed
//     (ReleaseStream), or, for a stream with live blocks or pending
//     events, once the last of them is gone;
//   - at once on EmptyCache, which leaves no cached segment behind;
//   - after a bounded time otherwise: a sweep runs once P new shards
//     were made since the last sweep or EmptyCache, P being idleSweepMin
//     or the number of streams that were not idle at the last sweep if
//     more, and releases every idle stream that allocated nothing since
//     the sweep before. A program with at most idleSweepMin streams
//     besides the default one is never swept (its peaks, and its device
//     mallocs and frees, stay exactly PyTorch's), nor is a stream in
//     steady use; a program that drops streams keeps at most the streams
//     of two periods besides those in use. A sweep costs O(shards), which
//     are at most about 3P, once per P new streams: O(1) per new stream.
//     When a quarter of a period's new shards are of streams that recent
//     sweeps released, the program cycles through more streams than a
//     period holds (a pool of streams used in turn): P doubles, up to
//     maxSweepPeriod, so that its streams keep their cached segments from
//     then on.
//
// The default stream's shard is never released. A Malloc on a released
// stream starts it again with a new shard. The hot path never uses a
// shard that is released or doomed (released once idle): it checks the
// doomed flag, written in world mode, under the shard's lock, and redoes
// the call in world mode, which finds the stream's current shard.
//
// At most streamLimit() shards (max_streams, WithMaxStreams,
// DefaultMaxStreams) are live at once: a new stream beyond it first
// sweeps every idle stream, and when none is idle it fails with an error
// wrapping ErrTooManyStreams.

import (
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// ErrTooManyStreams: a Malloc or RecordStream on a new stream while
// max_streams (or WithMaxStreams) streams hold live blocks, pending
// events or a call in progress. Freeing a stream's blocks, or ReleaseStream, makes room.
var ErrTooManyStreams = errors.New("too many streams")

// DefaultMaxStreams is the number of streams an allocator serves at once
// unless max_streams or WithMaxStreams says otherwise.
const DefaultMaxStreams = 65536

// idleSweepMin is the least number of new streams between two idle
// sweeps, maxSweepPeriod the most that misses make it (see above).
const (
	idleSweepMin   = 32
	maxSweepPeriod = 256
)

// WithMaxStreams sets how many streams, the default stream included, may
// have live state in the allocator at once (DefaultMaxStreams by
// default); n must be at least 1. The configuration's max_streams
// (Config.MaxStreams), when set, takes precedence.
func WithMaxStreams(n int) Option {
	return func(o *options) { o.maxStreams = n }
}

// streamLimit is the most shards live at once: max_streams when set,
// else WithMaxStreams' value (world mode).
func (a *Allocator) streamLimit() int {
	if a.cfg.MaxStreams > 0 {
		return a.cfg.MaxStreams
	}
	return a.maxStreams
}

// ReleaseStream tells the allocator that stream s is destroyed, or will
// not be used again: its cached segments go back to the device and its
// per-stream state is dropped, at once when s has nothing allocated and
// no block waiting for events, else as soon as it has none. Call it after
// the stream's destruction (cudaStreamDestroy), since a stream's handle
// may be reused by a new stream; a Malloc on s afterwards starts it
// again. ReleaseStream of the default stream, or of a stream the
// allocator does not know, does nothing.
func (a *Allocator) ReleaseStream(s cudart.Stream) error {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return fmt.Errorf("allocator: release stream %#x: %w", uint64(s), ErrClosed)
	}
	sh := a.byStream[s]
	delete(a.swept, s) // destroyed: a new stream with its handle is no miss
	if sh == nil || s == cudart.DefaultStream {
		return nil
	}
	if a.idle(sh) && a.capturing == 0 {
		return a.releaseShard(sh)
	}
	a.doom(sh)
	return nil
}

// doom marks sh to be released once idle (world mode), unless it is
// already.
func (a *Allocator) doom(sh *shard) {
	if !sh.doomed {
		sh.doomed = true
		a.doomed = append(a.doomed, sh)
	}
}

// undoom takes back doom: sh's stream or pool is in use again (world
// mode).
func (a *Allocator) undoom(sh *shard) {
	if sh.doomed {
		sh.doomed = false
		a.doomed = slices.DeleteFunc(a.doomed, func(x *shard) bool { return x == sh })
	}
}

// idle reports whether sh's stream may be released (world mode): not the
// default stream, nothing allocated or parked, no block waiting for
// events, no world-mode call under way on it.
func (a *Allocator) idle(sh *shard) bool {
	return sh.stream != cudart.DefaultStream && sh.active.len() == 0 &&
		sh.parked == nil && sh.pendingEv == 0 && sh.busy == 0 && !sh.held()
}

// releaseShard returns sh's cached segments to the device and drops its
// shard (world mode; sh idle). On a device error sh stays, with what was
// not released, and the error is returned.
func (a *Allocator) releaseShard(sh *shard) error {
	if err := a.releaseShardSegments(sh); err != nil {
		return err
	}
	if sh.segments != 0 {
		return fmt.Errorf("allocator: release stream %#x: %d segments remain", uint64(sh.stream), sh.segments)
	}
	if a.exp != nil {
		a.exp.ForgetStream(uint64(sh.stream))
	}
	a.dropShard(sh)
	return nil
}

// releaseShardSegments returns every cached segment of idle sh to the
// device.
func (a *Allocator) releaseShardSegments(sh *shard) error {
	if sh.segments == 0 {
		return nil
	}
	if a.exp != nil {
		return a.releaseExpandableStream(sh)
	}
	// Idle, so each segment is one whole free block.
	return a.releaseWholeOf(sh)
}

// releaseWholeOf returns sh's whole free segments to the device (world
// mode; cudaMalloc segments), stopping at the first error.
func (a *Allocator) releaseWholeOf(sh *shard) error {
	list := a.scratch[:0]
	for _, p := range [2]*pool{&sh.large, &sh.small} {
		p.free.Ascend(func(b *blocks.Block) bool {
			if !b.IsSplit() {
				list = append(list, b)
			}
			return true
		})
	}
	a.scratch = list[:0]
	return a.releaseAll(nil, list)
}

// releaseExpandableStream unmaps every free page of idle sh's expandable
// segments and releases their address ranges. It waits for the whole
// device, not the stream, before unmapping: the stream may be destroyed.
func (a *Allocator) releaseExpandableStream(sh *shard) error {
	list := a.scratch[:0]
	for _, p := range [2]*pool{&sh.large, &sh.small} {
		p.free.Ascend(func(b *blocks.Block) bool {
			if b.Segment.Expandable && a.exp.Unmappable(b) > 0 {
				list = append(list, b)
			}
			return true
		})
	}
	a.scratch = list[:0]
	if len(list) > 0 {
		if err := a.dev.Synchronize(); err != nil {
			return fmt.Errorf("allocator: synchronising the device before unmapping stream %#x's pages: %w", uint64(sh.stream), err)
		}
	}
	for _, b := range list {
		if _, err := a.unmapBlock(nil, b, false, 0); err != nil {
			return err
		}
	}
	for _, seg := range a.exp.Unused(nil, uint64(sh.stream)) {
		if err := a.releaseExpandableSegment(seg); err != nil {
			return err
		}
	}
	return nil
}

// dropShard removes sh, idle and without segments, from every structure
// (world mode): its cumulative statistics fold into the allocator's, its
// caps go (the next shareCaps shares their slack out again), and its lock,
// held since lockWorld, is released with the doomed flag set, so that a
// hot path that found it in an old table redoes its call in world mode.
func (a *Allocator) dropShard(sh *shard) {
	g, h := a.stats.hotArrays(), sh.stats.summed()
	for k := range numHot {
		for p := range numPools {
			g[k][p].Current += h[k][p].Current
			g[k][p].Allocated += h[k][p].Allocated
			g[k][p].Freed += h[k][p].Freed
		}
	}
	a.stats.NumCapBorrows += sh.borrows
	a.stats.NumCapSteals += sh.steals
	a.stats.NumSmallFromLarge += sh.fromLarge
	o, so := &a.stats.OversizeAllocations, &sh.stats.OversizeAllocations
	o.Current += so.Current
	o.Allocated += so.Allocated
	o.Freed += so.Freed
	i := a.shardIndex(sh.stream)
	a.shards = slices.Delete(a.shards, i, i+1)
	delete(a.byStream, sh.stream)
	a.publishShards()
	if sh.doomed {
		a.doomed = slices.DeleteFunc(a.doomed, func(x *shard) bool { return x == sh })
	}
	if a.favored == sh {
		a.favored = nil
	}
	a.capsDirty = true
	if p := sh.pool; p != nil {
		p.shards--
		a.forgetPool(p)
	}
	sh.doomed, sh.released = true, true
	// Off the shard list, refreshGates no longer reaches it: close its
	// gates here, for a hot path that looked it up before the drop.
	sh.mallocMax, sh.freeOff = a.gates(sh)
	sh.mu.Unlock()
}

// reapDoomed releases the doomed shards that have become idle (world
// mode, at the end of a call).
func (a *Allocator) reapDoomed() {
	if a.capturing > 0 { // releasing would synchronise
		return
	}
	for i := 0; i < len(a.doomed); {
		sh := a.doomed[i]
		if !a.idle(sh) {
			i++
			continue
		}
		if err := a.releaseShard(sh); err != nil {
			a.log.Warn("releasing a destroyed stream's segments failed", zap.Uint64("stream", uint64(sh.stream)), zap.Error(err))
			i++
		}
	}
}

// dropIdle releases every idle stream (world mode; EmptyCache). Errors
// are logged: the stream stays and its segments are released later.
func (a *Allocator) dropIdle() {
	a.sweep(true)
}

// sweep releases idle streams (world mode): every one when all is set,
// else those that allocated nothing since the last sweep; it stamps the
// others. No call may hold a pointer to an idle shard (see busy).
func (a *Allocator) sweep(all bool) {
	if a.capturing > 0 { // releasing would synchronise
		return
	}
	for i := 0; i < len(a.shards); {
		sh := a.shards[i]
		n := sh.stats.Allocation[PoolSmall].Allocated + sh.stats.Allocation[PoolLarge].Allocated
		if a.idle(sh) && (all || n == sh.stamp) {
			s := sh.stream
			if err := a.releaseShard(sh); err == nil {
				if !all {
					a.noteSwept(s)
				}
				continue
			} else {
				a.log.Warn("releasing an idle stream's segments failed", zap.Uint64("stream", uint64(s)), zap.Error(err))
			}
		}
		sh.stamp = n
		i++
	}
	if all { // EmptyCache: what comes back now is no miss
		a.newShards, a.swept, a.misses = 0, nil, 0
		return
	}
	busy := 0
	for _, sh := range a.shards {
		if !a.idle(sh) {
			busy++
		}
	}
	next := max(idleSweepMin, busy)
	if a.misses > 0 && 4*a.misses >= a.newShards {
		next = max(next, min(2*a.sweepEvery, maxSweepPeriod))
	}
	a.sweepEvery, a.newShards, a.misses = next, 0, 0
}

// noteSwept remembers that a sweep released stream s, so that a new
// shard for s counts as a miss. It remembers at most 4·maxSweepPeriod
// streams, forgetting them all when full.
func (a *Allocator) noteSwept(s cudart.Stream) {
	if a.swept == nil || len(a.swept) >= 4*maxSweepPeriod {
		a.swept = make(map[cudart.Stream]struct{})
	}
	a.swept[s] = struct{}{}
}

// makeRoom runs the idle sweep before a new shard is added when it is
// due, and fails when streamLimit() shards are live and none is idle (world
// mode).
// It changes nothing when it fails.
func (a *Allocator) makeRoom(s cudart.Stream) error {
	limit := a.streamLimit()
	if len(a.shards) >= limit && !slices.ContainsFunc(a.shards, a.idle) {
		return fmt.Errorf("allocator: stream %#x: %d streams have live blocks, pending events or calls under way (the limit; max_streams, WithMaxStreams): %w",
			uint64(s), len(a.shards), ErrTooManyStreams)
	}
	if a.newShards >= a.sweepEvery {
		a.sweep(false)
	}
	if len(a.shards) >= limit {
		a.sweep(true)
	}
	if len(a.shards) >= limit { // an idle stream's device free failed
		return fmt.Errorf("allocator: stream %#x: %d streams live, and releasing the idle ones failed (the limit; max_streams, WithMaxStreams): %w",
			uint64(s), len(a.shards), ErrTooManyStreams)
	}
	return nil
}

// shardIndex returns the index in a.shards of stream s's shard, or where
// it would go (world mode).
func (a *Allocator) shardIndex(s cudart.Stream) int {
	lo, hi := 0, len(a.shards)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if a.shards[m].stream < s {
			lo = m + 1
		} else {
			hi = m
		}
	}
	return lo
}

// shardSearchMin is the number of shards from which the hot path finds a
// stream's shard by a binary search: below it, a linear search is faster.
const shardSearchMin = 16

// publishShards publishes a new table of a.shards for the hot path
// (world mode).
func (a *Allocator) publishShards() {
	t := &shardTable{list: append([]*shard(nil), a.shards...), streams: make([]cudart.Stream, len(a.shards))}
	for i, x := range t.list {
		t.streams[i] = x.stream
	}
	a.shardTab.Store(t)
}

// checkStreams reports broken invariants of the per-stream state (world
// mode, after flushAll): the stream map, the published table and the
// shard list agree; no structure refers to a released shard; the default
// stream's shard is there; the doomed list holds exactly the doomed
// shards; each shard's segment and pending-event counts match the
// segments; the event queues hold no empty queue; at most streamLimit()
// shards live.
func (a *Allocator) checkStreams() []error {
	var errs []error
	if len(a.byStream) != len(a.shards) {
		errs = append(errs, fmt.Errorf("%d shards, %d in the stream map", len(a.shards), len(a.byStream)))
	}
	if len(a.shards) > a.streamLimit() {
		errs = append(errs, fmt.Errorf("%d shards, above the limit of %d streams", len(a.shards), a.streamLimit()))
	}
	if sh := a.byStream[cudart.DefaultStream]; sh == nil {
		errs = append(errs, errors.New("the default stream has no shard"))
	}
	for _, sh := range a.shards {
		if a.lookupShard(sh.stream) != sh {
			errs = append(errs, fmt.Errorf("the hot path's lookup does not find stream %#x's shard", uint64(sh.stream)))
		}
		if sh.capsZero && (sh.capOver != 0 || sh.caps != [numHot][numPools]int64{}) {
			errs = append(errs, fmt.Errorf("stream %#x: caps marked zero are not", uint64(sh.stream)))
		}
	}
	doomed := 0
	segs := make(map[*shard]int, len(a.shards))
	events := make(map[*shard]int, len(a.shards))
	busy := 0
	for _, sh := range a.shards {
		if a.byStream[sh.stream] != sh {
			errs = append(errs, fmt.Errorf("the stream map does not lead to stream %#x's shard", uint64(sh.stream)))
		}
		if sh.released {
			errs = append(errs, fmt.Errorf("released shard of stream %#x is still listed", uint64(sh.stream)))
		}
		if sh.doomed {
			doomed++
		}
		if sh.busy < 0 {
			errs = append(errs, fmt.Errorf("stream %#x: %d calls under way", uint64(sh.stream), sh.busy))
		}
		busy += sh.busy
	}
	// Between calls only a Malloc waiting for the device outside world
	// mode (release_lock_on_cudamalloc) is under way.
	if busy != a.unlockedMallocs {
		errs = append(errs, fmt.Errorf("%d calls under way on the streams, %d device mallocs running unlocked", busy, a.unlockedMallocs))
	}
	if doomed != len(a.doomed) {
		errs = append(errs, fmt.Errorf("%d doomed shards, %d in the doomed list", doomed, len(a.doomed)))
	}
	for _, sh := range a.doomed {
		if !sh.doomed || a.byStream[sh.stream] != sh {
			errs = append(errs, fmt.Errorf("doomed list holds stream %#x, which is not a doomed live shard", uint64(sh.stream)))
		}
	}
	for _, s := range a.segs.list {
		sh := a.byStream[cudart.Stream(s.Stream)]
		if sh == nil {
			errs = append(errs, fmt.Errorf("segment %#x of stream %#x, which has no shard", s.Ptr, s.Stream))
			continue
		}
		segs[sh]++
		for b := s.Head; b != nil; b = b.Next {
			events[sh] += b.EventCount
		}
	}
	if dir := a.dir.Load(); dir.lazy && dir.one.released {
		errs = append(errs, fmt.Errorf("the directory leads to the released shard of stream %#x", uint64(dir.one.stream)))
	}
	for e := range a.dir.Load().all() {
		if e.sh.released {
			errs = append(errs, fmt.Errorf("directory entry %#x leads to the released shard of stream %#x", e.start, uint64(e.sh.stream)))
		}
	}
	for _, sh := range a.shards {
		if sh.segments != segs[sh] {
			errs = append(errs, fmt.Errorf("stream %#x counts %d segments, holds %d", uint64(sh.stream), sh.segments, segs[sh]))
		}
		if sh.pendingEv != events[sh] {
			errs = append(errs, fmt.Errorf("stream %#x counts %d pending events, its blocks %d", uint64(sh.stream), sh.pendingEv, events[sh]))
		}
	}
	if a.favored != nil && a.favored.released {
		errs = append(errs, fmt.Errorf("the favoured shard (stream %#x) is released", uint64(a.favored.stream)))
	}
	for _, q := range a.queues {
		if len(q.items) == 0 {
			errs = append(errs, fmt.Errorf("empty event queue of stream %#x kept", uint64(q.stream)))
		}
	}
	return errs
}
