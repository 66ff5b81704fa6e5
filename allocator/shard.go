package allocator

// Per-stream shards and the two lock modes.
//
// Blocks never cross streams, so each stream's share of the cache is a
// shard with its own mutex: its two pools (free indexes and Block
// recyclers), its allocated blocks by address, and its share of the
// statistics that a cached Malloc or Free changes ("hot" statistics).
// A cached Malloc on stream s locks only s's shard; a Free finds the
// shard through the segment directory (an immutable, address-sorted index
// of the segments, republished when one comes or goes; directory.go)
// and locks only that shard. Goroutines on different streams therefore
// share no lock and write no common cache line on the hot path.
//
// Everything else runs in world mode: the allocator's mutex a.mu, then
// every shard's mutex in stream order (lockWorld). Device calls, the OOM
// path, EmptyCache, garbage collection, event queues, history, new
// streams, RecordStream, statistics reads, snapshots and Check all see one
// consistent whole there, as if one mutex guarded the allocator. A hot
// path that cannot finish (a miss, pending events, history on, a new
// stream) changes nothing (but may flush its front cache, front.go),
// unlocks its shard and redoes the call in world mode. The state that
// sends a call there (closed, pending, history, async, the cap) is written
// only in world mode, when every shard lock is held, and world mode
// summarises it in each shard's gates before it unlocks (refreshGates), so
// the hot path tests one field of its own shard; the configuration it
// reads is likewise written only in world mode.
//
// # Exact statistics
//
// Each shard counts its own Current, Allocated and Freed; a read folds
// them (Stats, MemoryAllocated, …), so they are exact. A peak needs the
// sum of every shard at the moment it is reached. Instead of a shared
// counter, each shard holds, for each hot statistic and pool, a cap:
// the caps add up to no more than the peak, and a hot path whose increase
// stays within its cap cannot make a new peak. One that would pass its
// cap first borrows from the reservoir (the slack no shard holds, taken
// with atomics; a shard whose frees leave it far more cap than it uses
// gives the excess back). When the reservoir is short, it takes into the
// reservoir what other shards hold as cap above their values, from each
// whose lock it gets without waiting (steal): a stream that grows back
// toward a peak while another stream holds the slack need not stop
// every stream. Only when that too falls short does it escalate: it
// takes the allocator's mutex without waiting (world mode when another
// holds it) and every other shard's lock, waiting for each (escalate
// says why that cannot deadlock), and with every shard held it makes its
// change, raises the peaks from the exact sums and shares the slack
// (peak − sum) out again as caps. In world mode the sums are taken and
// the peaks raised after every change of a hot statistic. Hot paths spin
// briefly for their shard's lock before they sleep, since escalations
// hold it for a moment only.
//
// # The sole shard
//
// While one shard alone is in use, every change that makes a new peak is
// its own: a program's first pass over its working set raises the peaks
// at every few calls (resnet50_train's first replay: 1,037 times in
// 13,237 calls), and each rise would escalate, settle and share out the
// caps again. So when shareCaps finds one shard in use, it makes that
// shard the owner of the peaks: the owner's hot path raises its own caps
// to its new values instead of borrowing (borrow), so that its caps stand
// at its running maxima, and nothing else may change meanwhile. The other
// shards hold no active block, so no Free reaches them, and their caps
// equal their values, so any change of theirs that grows a statistic
// needs to borrow; the reservoir is empty and steal passes the owner by,
// so it escalates. Owner mode ends when every shard lock is taken
// (lockAll, escalate): settleOwner raises each peak to the allocator's
// sum with the owner's caps in place of its values, which is the largest
// sum reached since owner mode began, exactly.

import (
	"fmt"
	"math/bits"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// hotStats are the statistics a cached Malloc or Free changes, with the
// field names of Stats.
//
// The hot path changes only the entries of the pool it touches (apply,
// release): an array's PoolAll entry is the sum of its PoolSmall and
// PoolLarge entries, and summed writes it before anything reads the
// arrays whole. Keeping it on every change doubled the hot path's stores,
// which cost a real mix more than its lock does.
type hotStats struct {
	Allocation, Active, InactiveSplit                               StatArray
	AllocatedBytes, ActiveBytes, InactiveSplitBytes, RequestedBytes StatArray
	OversizeAllocations                                             Stat
}

const numHot = 7 // StatArrays in hotStats

// hotNames are PyTorch's names of hotStats' arrays, in arrays() order.
var hotNames = [numHot]string{"allocation", "active", "inactive_split",
	"allocated_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"}

// hotAllocatedBytes is allocated_bytes' position in that order: what
// hotSums gives for memory allocated now.
const hotAllocatedBytes = 3

// arrays lists hotStats' arrays in a fixed order, their PoolAll entries
// as they are (see summed).
func (h *hotStats) arrays() [numHot]*StatArray {
	return [numHot]*StatArray{&h.Allocation, &h.Active, &h.InactiveSplit,
		&h.AllocatedBytes, &h.ActiveBytes, &h.InactiveSplitBytes, &h.RequestedBytes}
}

// summed is arrays with the PoolAll entries (Current, Allocated, Freed)
// first set to the two pools' sum.
func (h *hotStats) summed() [numHot]*StatArray {
	arrays := h.arrays()
	for _, a := range arrays {
		a[PoolAll].Current = a[PoolSmall].Current + a[PoolLarge].Current
		a[PoolAll].Allocated = a[PoolSmall].Allocated + a[PoolLarge].Allocated
		a[PoolAll].Freed = a[PoolSmall].Freed + a[PoolLarge].Freed
	}
	return arrays
}

// current returns a shard's Current of a in all pools, without summed.
func (a *StatArray) current() int64 { return a[PoolSmall].Current + a[PoolLarge].Current }

// currentIn returns a shard's Current of a in pool q (PoolAll included),
// without summed.
func (a *StatArray) currentIn(q Pool) int64 {
	if q == PoolAll {
		return a.current()
	}
	return a[q].Current
}

// hotArrays lists the same arrays of a Stats, in the same order.
func (s *Stats) hotArrays() [numHot]*StatArray {
	return [numHot]*StatArray{&s.Allocation, &s.Active, &s.InactiveSplit,
		&s.AllocatedBytes, &s.ActiveBytes, &s.InactiveSplitBytes, &s.RequestedBytes}
}

// shard is one stream's share of the cache (see above).
type shard struct {
	mu     sync.Mutex
	stream cudart.Stream
	// doomed: the hot path must not use the shard (streams.go): it is
	// released, or will be once idle. Written in world mode only.
	doomed bool
	// The hot path's gates (refreshGates): a Malloc above mallocMax bytes
	// and any Free while freeOff is set take the slow path.
	mallocMax uint64
	freeOff   bool
	small     pool
	large     pool
	active    ptrMap        // allocated blocks of this stream by address
	parked    *blocks.Block // the front cache (front.go)
	noPark    bool          // tests: free as PyTorch does, straight into the index
	stats     hotStats
	// caps bound each hot statistic's Current (per hotStats.arrays order,
	// then OversizeAllocations) while the hot path runs.
	caps    [numHot][numPools]int64
	capOver int64
	// share is what shareCaps last gave each cap above its value; repay
	// keeps that much.
	share [numHot][numPools]int64
	// lend: other shards are in use, so repay gives excess caps back (with
	// one shard in use, what it gave back it would only borrow again).
	lend bool
	// capsZero: shareCaps left every cap 0 and borrow has not raised one
	// since.
	capsZero bool
	// owner: the shard keeps the peaks itself (see "The sole shard"): its
	// caps are its running maxima. Written with every shard lock held;
	// read under the shard's own.
	owner    bool
	repays   uint8 // frees since repay last looked, up to repayEvery
	released bool  // dropped from the allocator (streams.go)
	// borrows counts this shard's borrows, steals the times another
	// shard's steal or gatherSlack took this shard's lock, fromLarge its
	// hot path's small requests served from the large pool
	// (Stats.NumCapBorrows, NumCapSteals, NumSmallFromLarge: the
	// allocator adds them up).
	borrows, steals, fromLarge int64
	// World-mode state of the stream's life (streams.go): its segments,
	// the events its blocks wait for, the world-mode calls under way on
	// it, and its allocation count at the last idle sweep.
	segments  int
	pendingEv int
	busy      int
	stamp     int64
	dirFull   *dirPage     // the directory's page of a region all this shard's (dirfast.go)
	pool      *privatePool // the private pool of a pool stream's shard, else nil (pools.go)
	_padding  [64]byte     // keep shards on their own cache lines
}

// reservoir is slack that no shard holds as cap: a hot path whose change
// would pass its caps takes what it needs from here with atomic
// operations, without the other shards' locks, and one whose caps stand far
// above its values gives the excess back. Only holders of a shard lock
// touch it (shareCaps and Check hold them all). Invariant: for each
// statistic, the caps plus the reservoir add up to no more than the peak.
type reservoir struct {
	_    [64]byte // its own cache lines, away from the allocator's fields
	r    [numHot][numPools]atomic.Int64
	over atomic.Int64
	_    [64]byte // short on a line of its own: borrows write the ones above
	// short is set when a borrow found the reservoir short: only then do
	// shards repay (repay), so that while it has plenty, caps are not
	// moved back and forth through these shared lines at every few frees.
	short atomic.Bool
	_     [64]byte
}

// markShort sets short unless it is set already: an atomic store is a
// locked write of a line that every shard's repay reads, and borrows find
// the reservoir short many times over before a repay clears it.
func (res *reservoir) markShort() {
	if !res.short.Load() {
		res.short.Store(true)
	}
}

// take moves need from r to the caller, and a quarter of what r would
// hold after that, so that the caller's next change need not come back at
// once; or nothing when r holds less than need. It returns what it moved.
func take(r *atomic.Int64, need int64) int64 {
	for {
		v := r.Load()
		if v < need {
			return 0
		}
		t := need + (v-need)/4 // a little more, so that the next change need not come back at once
		if r.CompareAndSwap(v, v-t) {
			return t
		}
	}
}

// borrow raises sh's caps from the reservoir so that the change d of its
// hot statistics in pool p stays within them, and reports whether it
// could; when it cannot, it changes nothing. sh's lock is held.
func (a *Allocator) borrow(sh *shard, p Pool, d *delta) bool {
	if sh.owner {
		sh.raiseCaps(p, d)
		return true
	}
	sh.borrows++
	st, c, res := &sh.stats, &sh.caps, a.res
	deltas := d.hot()
	arrays := st.summed()
	type loan struct {
		k, q int
		n    int64
	}
	var loans [2 * numHot]loan
	n := 0
	giveBack := func() {
		for _, l := range loans[:n] {
			c[l.k][l.q] -= l.n
			res.r[l.k][l.q].Add(l.n)
		}
	}
	for k, d := range deltas {
		if d <= 0 {
			continue
		}
		for _, q := range [2]Pool{PoolAll, p} {
			need := arrays[k][q].Current + d - c[k][q]
			if need <= 0 {
				continue
			}
			t := take(&res.r[k][q], need)
			if t == 0 && a.steal(sh, k, q, need) {
				t = take(&res.r[k][q], need)
			}
			if t == 0 {
				res.markShort()
				giveBack()
				return false
			}
			c[k][q] += t
			loans[n] = loan{k, int(q), t}
			n++
			sh.capsZero = false
		}
	}
	if d.over > 0 {
		if need := st.OversizeAllocations.Current + d.over - sh.capOver; need > 0 {
			t := take(&res.over, need)
			if t == 0 {
				res.markShort()
				giveBack()
				return false
			}
			sh.capOver += t
			sh.capsZero = false
		}
	}
	return true
}

// raiseCaps raises the owner's caps in pool p (and all pools) to its
// values after the change d, where d would pass them: caps that stand at
// the shard's running maxima (see "The sole shard"). The caller makes
// the change d right after, as every caller of borrow that gets true
// does: a cap raised for a change not made would overstate the peak that
// settleOwner settles. sh's lock is held.
func (sh *shard) raiseCaps(p Pool, d *delta) {
	st, c := &sh.stats, &sh.caps
	deltas := d.hot()
	arrays := st.arrays() // unsummed: currentIn adds the pools for PoolAll
	for k, d := range deltas {
		if d <= 0 {
			continue
		}
		for _, q := range [2]Pool{PoolAll, p} {
			c[k][q] = max(c[k][q], arrays[k].currentIn(q)+d)
		}
	}
	if d.over > 0 {
		sh.capOver = max(sh.capOver, st.OversizeAllocations.Current+d.over)
	}
	sh.capsZero = false
}

// settleOwner ends owner mode, if on (every shard lock held): it raises
// each peak to the sum of the allocator's and the shards' values with the
// owner's caps, its running maxima, in place of the owner's values. The
// other shards have not changed since owner mode began (see "The sole
// shard"), so that sum is the largest one reached meanwhile. The caps
// then add up to no more than the peaks, as everywhere else; the next
// shareCaps shares them out again.
func (a *Allocator) settleOwner() {
	o := a.owner
	if o == nil {
		return
	}
	a.owner, o.owner = nil, false
	sums, over := a.hotSums()
	h := o.stats.summed()
	for k := range numHot {
		for p := range numPools {
			sums[k][p] += o.caps[k][p] - h[k][p].Current
		}
	}
	over += o.capOver - o.stats.OversizeAllocations.Current
	a.settleSums(sums, over)
}

// steal moves into the reservoir what other shards hold as cap above
// their values, from each shard whose lock it takes without waiting,
// until the reservoir holds need of hot statistic k in pool q, and
// reports whether it does. Caps plus reservoir keep their sum, so no peak
// can be passed; what an escalation would do (take every lock, settle,
// share out again) is left for a change that needs more than the shards
// hold: a new peak. A shard's slack stays in its caps until it frees
// enough to repay (repay): with two streams in use, one stream's growth
// would otherwise escalate while the other holds the slack. sh's lock is
// held, so world mode, which alone changes a.shards, is not running.
//
// Each shard it locks gives up its excess in every statistic at once,
// not only in k: near a peak every statistic is short together, and
// another shard's lock, its caps and its statistics are lines of memory
// that its own goroutine writes, so each steal costs that goroutine and
// this one a transfer of them. A first sweep leaves each shard the share
// of slack shareCaps last gave it above its values, so that it does not
// come back for it at its next Malloc; only when that falls short does a
// second sweep take everything. With eight streams whose steps overlap
// one by one (bench.MixedWarmInterleaved, the warm pass), this took the
// locks of other shards 0.026 times a step instead of 0.265, and borrows
// fell from 0.135 to 0.069 a step, with no escalation either way. A third
// sweep polls a moment longer the shards whose lock the second found
// taken (see below).
func (a *Allocator) steal(sh *shard, k int, q Pool, need int64) bool {
	r := &a.res.r[k][q]
	var busy uint64 // shards (by index, the first 64) whose lock the second sweep did not get
	for _, keep := range [2]bool{true, false} {
		for i, o := range a.shards {
			if o == sh {
				continue
			}
			if !o.mu.TryLock() {
				if !keep && i < 64 {
					busy |= 1 << i
				}
				continue
			}
			if a.stealLocked(o, keep) && r.Load() >= need {
				return true
			}
		}
	}
	// A third sweep waits a moment for the shards that were busy: their
	// holders are hot paths, which end within a poll or two, where an
	// escalation would wait for every shard, and stop all of them.
	for ; busy != 0; busy &= busy - 1 {
		o := a.shards[bits.TrailingZeros64(busy)]
		got := false
		for range stealPolls {
			if got = o.mu.TryLock(); got {
				break
			}
		}
		if got && a.stealLocked(o, false) && r.Load() >= need {
			return true
		}
	}
	return false
}

// gatherSlack moves into the reservoir what every shard but stream's
// holds as cap above its values, taking each one's lock in turn and
// waiting for it, while the caller holds no lock. It serves a hot path
// whose change did not fit its caps and could not borrow (retryMalloc,
// retryFree): before it may escalate, which stops every stream, it runs
// again with the reservoir stocked.
//
// steal, which runs under the caller's own shard lock, may only try the
// others' locks: waiting could deadlock with a shard stealing back. On a
// many-core host with a goroutine on each stream, each shard's lock is
// taken most of the time, by a goroutine that takes it again at once, and
// steals that hold their own shard's lock make each other busy; so steal
// fell short where the slack was there: of the 1,136 to 1,150 escalations
// of a warm mixed pass at eight goroutines on a 16-core host, 1,072 to
// 1,084 raised no peak. Holding no lock, gatherSlack can wait for each
// shard without deadlock: it holds one shard lock at a time and waits for
// nothing while it does, and a holder of the lock it waits for is a hot
// path, which waits for no other lock, or an escalation or world mode,
// which waits only for shard locks, each released by its holder in
// turn.
//
// It takes a shard's whole excess (stealFrom without keep): the caller
// needs it now, and a shard left short borrows it back from the reservoir
// with one atomic operation. It passes by released shards (their caps are
// folded away) and the owner of the peaks (see "The sole shard").
func (a *Allocator) gatherSlack(stream cudart.Stream) {
	for _, o := range a.shardTab.Load().list {
		if o.stream == stream {
			continue
		}
		o.lock()
		if o.released {
			o.mu.Unlock()
			continue
		}
		a.stealLocked(o, false)
	}
}

// stealPolls is how many times steal's third sweep polls a busy shard's
// lock before it passes it by: a few hot calls' time.
const stealPolls = 64

// stealLocked is the work of steal and gatherSlack on o, whose lock the
// caller took and which it releases: it moves o's excess caps into the
// reservoir (stealFrom), unless o owns the peaks (its caps hold peaks not
// yet settled: the caller escalates instead), and reports whether it
// looked at o. The lock taken is counted on o (shard.steals): the
// caller may hold no lock of its own to count it on.
func (a *Allocator) stealLocked(o *shard, keep bool) bool {
	if o.owner {
		o.mu.Unlock()
		return false
	}
	o.steals++
	if !o.capsZero {
		a.stealFrom(o, keep)
	}
	o.mu.Unlock()
	return true
}

// stealFrom moves o's caps above its values into the reservoir, in
// every hot statistic and pool, leaving o its share (shard.share) when
// keep is set. o's lock is held.
func (a *Allocator) stealFrom(o *shard, keep bool) {
	arrays := o.stats.arrays() // unsummed: currentIn adds the pools for PoolAll
	for k := range numHot {
		for q := range numPools {
			x := o.caps[k][q] - arrays[k].currentIn(Pool(q))
			if keep {
				x -= o.share[k][q]
			}
			if x > 0 {
				o.caps[k][q] -= x
				a.res.r[k][q].Add(x)
			}
		}
	}
}

// freeFitsOrBorrow is fitsOrBorrow for a free's change d: of the hot
// statistics a free changes, only the inactive-split ones can grow (the
// others fall, and a fall always fits: see fits), so only their rooms are
// tested.
func (a *Allocator) freeFitsOrBorrow(sh *shard, p Pool, d *delta) bool {
	st, c := &sh.stats, &sh.caps
	if room(&st.InactiveSplit, &c[2], p, d.split)|room(&st.InactiveSplitBytes, &c[5], p, d.splitBytes) >= 0 {
		return true
	}
	return a.borrow(sh, p, d)
}

// fitsOrBorrow is fits, borrowing from the reservoir when the caps are
// short.
func (a *Allocator) fitsOrBorrow(sh *shard, p Pool, d *delta) bool {
	return sh.fits(p, d) || a.borrow(sh, p, d)
}

// repayEvery is how many frees a shard makes between two looks at its
// excess caps: the look walks every hot statistic, and the excess of a
// few frees can wait for the next one.
const repayEvery = 4

// repay gives back to the reservoir the part of sh's caps on pool p's
// statistics (and all pools') that stands more than twice its share above
// their values, keeping one share: slack that a shard's frees left it
// would otherwise wait for the next escalation, while other shards
// escalate for want of it. It looks at every repayEvery-th free of the
// shard only, and only after a borrow found the reservoir short (the
// look clears that): while the reservoir has plenty, repaying would only
// move caps that the shard borrows again, through lines every shard
// shares. sh's lock is held.
func (a *Allocator) repay(sh *shard, p Pool) {
	if !sh.lend {
		return
	}
	if sh.repays++; sh.repays < repayEvery {
		return
	}
	sh.repays = 0
	if !a.res.short.Load() {
		return
	}
	a.res.short.Store(false)
	h := sh.stats.summed()
	for k := range numHot {
		for _, q := range [2]Pool{PoolAll, p} {
			keep := sh.share[k][q]
			if x := sh.caps[k][q] - h[k][q].Current - keep; x > keep {
				sh.caps[k][q] -= x
				a.res.r[k][q].Add(x)
			}
		}
	}
}

func newShard(s cudart.Stream) *shard {
	n := 1024
	if s != cudart.DefaultStream {
		n = 32 // most streams besides the default are short-lived (streams.go); the map grows
	}
	sh := &shard{stream: s, active: newPtrMap(n)}
	sh.small = pool{free: blocks.NewStreamFreeIndex(uint64(s)), small: true, stat: PoolSmall, sh: sh}
	sh.large = pool{free: blocks.NewStreamFreeIndex(uint64(s)), stat: PoolLarge, sh: sh}
	return sh
}

// poolFor returns the pool serving a rounded size.
func (sh *shard) poolFor(size uint64) *pool {
	if size <= smallSize {
		return &sh.small
	}
	return &sh.large
}

// lock takes the shard's lock for a hot path. The lock is held briefly
// (a hot path, or another shard's escalation), so it spins, yielding the
// processor, before it sleeps: waking a sleeping goroutine costs far more
// than the wait.
func (sh *shard) lock() { spinLock(&sh.mu) }

// delta is a change of a shard's hot statistics in one pool (and in all
// pools), one field per statistic.
type delta struct {
	allocs, allocBytes  int64 // Allocation, AllocatedBytes
	active, activeBytes int64 // Active, ActiveBytes
	requested           int64 // RequestedBytes
	split, splitBytes   int64 // InactiveSplit, InactiveSplitBytes
	over                int64 // OversizeAllocations
}

// hot returns d's changes of the hot statistics' arrays, in
// hotStats.arrays order (OversizeAllocations, d.over, apart).
func (d *delta) hot() [numHot]int64 {
	return [numHot]int64{d.allocs, d.active, d.split, d.allocBytes, d.activeBytes, d.splitBytes, d.requested}
}

// mallocDelta sets d to the change of handing out a free block of size bytes
// for a request of requested bytes, rounded to rounded (PyTorch's
// alloc_found_block): the block is split, and only rounded bytes handed
// out, when split is set. It counts one allocation, active block and
// oversize allocation (oversize from maxSplit bytes up), the bytes handed
// out and requested, and the inactive split blocks: the block, when it
// was part of a larger segment, stops counting; its remainder, when split
// off, counts (PyTorch leaves blocks of expandable segments out).
//
// It and freeDelta fill in the caller's delta, field by field, rather
// than return one: a returned struct is copied in 16-byte moves that
// cannot take the 8-byte values just stored, which cost the hot path
// more than the rest of its statistics.
//
// The caller decides the split: splits(…) for a malloc, as PyTorch's
// alloc_found_block; RestorePool as a checkpoint says.
func mallocDelta(d *delta, expandable, wasSplit, split bool, size, rounded, requested, maxSplit uint64) {
	got := size
	if split {
		got = rounded
	}
	d.allocs, d.allocBytes = 1, int64(got)
	d.active, d.activeBytes = 1, int64(got)
	d.requested = int64(requested)
	d.split, d.splitBytes, d.over = 0, 0, 0
	if !expandable {
		switch {
		case split && wasSplit: // the remainder takes the block's place
			d.splitBytes = -int64(rounded)
		case split:
			d.split, d.splitBytes = 1, int64(size-rounded)
		case wasSplit:
			d.split, d.splitBytes = -1, -int64(size)
		}
	}
	if got >= maxSplit {
		d.over = 1
	}
}

// freeDelta sets d to the change of returning the allocated block b, already
// released, to its pool (PyTorch's free_block), merging it with its free
// neighbours: one active block and its active and requested bytes less;
// the neighbours stop counting as inactive split blocks, and the merged
// block counts when it is still part of a larger segment (blocks of
// expandable segments are left out).
func freeDelta(d *delta, b *blocks.Block) {
	d.allocs, d.allocBytes = 0, 0
	d.active, d.activeBytes = -1, -int64(b.Size)
	d.requested = -int64(b.Requested)
	d.split, d.splitBytes, d.over = 0, 0, 0
	if b.Segment.Expandable {
		return
	}
	var n, merged int64 // free neighbours, and their bytes
	left, right := b.Prev, b.Next
	if left != nil && left.Indexed() {
		n, merged, left = n+1, merged+int64(left.Size), left.Prev
	}
	if right != nil && right.Indexed() {
		n, merged, right = n+1, merged+int64(right.Size), right.Next
	}
	d.split, d.splitBytes = -n, -merged
	if left != nil || right != nil { // the merged block has neighbours
		d.split, d.splitBytes = d.split+1, d.splitBytes+int64(b.Size)+merged
	}
}

// apply makes the change d to the statistics of pool p (and so of all
// pools: see hotStats). It skips the statistics that a malloc or a free
// leaves alone (a free's allocation count, changed on release; most
// changes' inactive split and oversize counts).
func (h *hotStats) apply(p Pool, d *delta) {
	if d.allocs != 0 || d.allocBytes != 0 {
		h.Allocation[p].adjust(d.allocs)
		h.AllocatedBytes[p].adjust(d.allocBytes)
	}
	h.Active[p].adjust(d.active)
	h.ActiveBytes[p].adjust(d.activeBytes)
	h.RequestedBytes[p].adjust(d.requested)
	if d.split != 0 || d.splitBytes != 0 {
		h.InactiveSplit[p].adjust(d.split)
		h.InactiveSplitBytes[p].adjust(d.splitBytes)
	}
	if d.over != 0 {
		h.OversizeAllocations.adjust(d.over)
	}
}

// adjust changes s by n, up or down, and keeps no peak: the peak of a
// hot statistic is the global one, settled from the shards' sums; a
// statistic of the allocator's own raises its peak after (raisePeak).
func (s *Stat) adjust(n int64) {
	s.Current += n
	if n >= 0 {
		s.Allocated += n
	} else {
		s.Freed -= n
	}
}

// adjust is Stat.adjust in all pools and in p.
func (a *StatArray) adjust(p Pool, n int64) {
	a[PoolAll].adjust(n)
	a[p].adjust(n)
}

// raisePeak raises the peaks in all pools and in p to the current values.
func (a *StatArray) raisePeak(p Pool) {
	a[PoolAll].Peak = max(a[PoolAll].Peak, a[PoolAll].Current)
	a[p].Peak = max(a[p].Peak, a[p].Current)
}

// room returns what is left of cap, in all pools and in p, after adding
// d to a's Current: negative in at least one of the two when either
// passes its cap.
func room(a *StatArray, cap *[numPools]int64, p Pool, d int64) int64 {
	return (cap[PoolAll] - a.current() - d) | (cap[p] - a[p].Current - d)
}

// fits reports whether the hot path may make the change d to the shard's
// statistics in pool p: whether every increase stays within its cap.
//
// It tests every statistic, decreases too, with no branch: a Current is
// within its cap whenever a hot path runs (shareCaps, steal and repay
// leave caps at or above the values), so a decrease always has room, and
// ORing the rooms' signs costs less than a branch per statistic that a
// mix of mallocs and frees mispredicts. Were a Current above its cap,
// fits would only send the change to borrow, which lets decreases pass.
func (sh *shard) fits(p Pool, d *delta) bool {
	st, c := &sh.stats, &sh.caps
	left := room(&st.Allocation, &c[0], p, d.allocs) |
		room(&st.Active, &c[1], p, d.active) |
		room(&st.InactiveSplit, &c[2], p, d.split) |
		room(&st.AllocatedBytes, &c[3], p, d.allocBytes) |
		room(&st.ActiveBytes, &c[4], p, d.activeBytes) |
		room(&st.InactiveSplitBytes, &c[5], p, d.splitBytes) |
		room(&st.RequestedBytes, &c[6], p, d.requested) |
		(sh.capOver - st.OversizeAllocations.Current - d.over)
	return left >= 0
}

// shardTable is the published list of shards, for the hot path, with
// their streams beside them, in stream order: looking a stream up reads
// no shard, whose cache lines its own goroutine keeps writing. From
// shardSearchMin shards on, the lookup is a binary search.
type shardTable struct {
	streams []cudart.Stream
	list    []*shard
}

// lookupShard returns the shard of stream s without locking, or nil when
// s has none. The shard may have been released since (doomed says so
// under its lock).
func (a *Allocator) lookupShard(s cudart.Stream) *shard {
	t := a.shardTab.Load()
	if len(t.streams) >= shardSearchMin {
		if i, ok := slices.BinarySearch(t.streams, s); ok {
			return t.list[i]
		}
		return nil
	}
	for i, st := range t.streams {
		if st == s {
			return t.list[i]
		}
	}
	return nil
}

// shardOf returns the shard of stream s (world mode; s must have one).
func (a *Allocator) shardOf(s cudart.Stream) *shard {
	if sh := a.byStream[s]; sh != nil {
		return sh
	}
	panic("allocator: no shard for a segment's stream")
}

// addShard creates the shard of stream s in world mode: it is created
// locked, so that unlockWorld unlocks it with the others, and kept in
// stream order: the order in which world mode walks the pools (pools,
// freeIndexes), which PyTorch's one free index over all streams has.
func (a *Allocator) addShard(s cudart.Stream) *shard {
	sh := newShard(s)
	sh.mu.Lock()
	a.capsDirty = true
	a.shards = slices.Insert(a.shards, a.shardIndex(s), sh)
	if a.byStream == nil {
		a.byStream = make(map[cudart.Stream]*shard)
	}
	a.byStream[s] = sh
	sh.noPark = a.noPark
	a.newShards++
	if _, ok := a.swept[s]; ok {
		a.misses++
	}
	a.publishShards()
	return sh
}

// lockWorld takes the allocator's mutex and then every shard's, in stream
// order, and flushes the parked blocks (front.go).
func (a *Allocator) lockWorld() {
	a.lockAll()
	a.flushAll()
}

// lockAll is lockWorld without the flush.
func (a *Allocator) lockAll() {
	spinLock(&a.mu)
	for _, sh := range a.shards {
		sh.lock()
	}
	a.settleOwner()
	a.world = true
}

// unlockWorld shares out the caps again when a statistic changed,
// refreshes the hot path's gates, and unlocks.
func (a *Allocator) unlockWorld() {
	if len(a.doomed) > 0 {
		a.reapDoomed()
	}
	if a.capsDirty {
		a.shareCaps(a.hotSums())
	}
	a.refreshGates()
	a.world = false
	for i := len(a.shards) - 1; i >= 0; i-- {
		a.shards[i].mu.Unlock()
	}
	a.mu.Unlock()
}

// gates returns what refreshGates sets on sh.
func (a *Allocator) gates(sh *shard) (mallocMax uint64, freeOff bool) {
	freeOff = a.closed || a.history != nil || a.async != nil || sh.doomed
	if freeOff || a.pending > 0 || a.gcEnabled() {
		return 0, freeOff
	}
	return min(a.allowed, maxRequestSize), false
}

// refreshGates sets each shard's hot-path gates from the world-mode state
// that sends a call to the slow path: a closed allocator, history being
// recorded, the cudaMallocAsync backend or a doomed shard send every call
// there; blocks waiting for events (processed before a search) and
// garbage collection (which counts searches) every Malloc; a request above
// the memory cap or the largest request, that Malloc. The hot path then
// tests one field of its own shard instead of reading the allocator's
// state. Those fields change only in world mode, which refreshes the gates
// before it unlocks (unlockWorld), and New sets them first.
func (a *Allocator) refreshGates() {
	for _, sh := range a.shards {
		sh.mallocMax, sh.freeOff = a.gates(sh)
	}
}

// hotSums returns, for each hot statistic and pool, the global Current:
// the allocator's own (the async backend counts there) plus every
// shard's; and the same for oversize_allocations.
func (a *Allocator) hotSums() (sums [numHot][numPools]int64, over int64) {
	g := a.stats.hotArrays()
	for k := range numHot {
		for p := range numPools {
			sums[k][p] = g[k][p].Current
		}
	}
	over = a.stats.OversizeAllocations.Current
	for _, sh := range a.shards {
		if sh.zeroHot() {
			continue
		}
		// Read, not summed: writing the PoolAll entries would take
		// every shard's statistics lines from the goroutines that use
		// them, at every escalation.
		h := sh.stats.arrays()
		for k := range numHot {
			for p := range numPools {
				sums[k][p] += h[k].currentIn(Pool(p))
			}
		}
		over += sh.stats.OversizeAllocations.Current
	}
	return sums, over
}

// zeroHot reports whether every hot statistic's Current of sh is 0:
// these two are 0 only when every other one is (the allocated and
// requested figures are within the active ones, every pool's within all
// pools', the oversize count within the allocation count, and a count and
// its bytes are 0 together). hotSums and shareCaps skip such shards, so
// that streams with nothing live cost them little.
func (sh *shard) zeroHot() bool {
	return sh.stats.Active.current() == 0 && sh.stats.InactiveSplit.current() == 0
}

// settleShard is settle after a change of sh's hot statistics: while
// every shard stays within its caps, the caps add up to no more than the
// peaks and no sum can have passed its peak, so there is nothing to do.
func (a *Allocator) settleShard(sh *shard) {
	if !a.capsDirty && sh.withinCaps() {
		return
	}
	a.settle()
	a.favored = sh
}

// withinCaps reports whether every hot Current of sh is within its cap.
func (sh *shard) withinCaps() bool {
	h := sh.stats.summed()
	for k := range numHot {
		for p := range numPools {
			if h[k][p].Current > sh.caps[k][p] {
				return false
			}
		}
	}
	return sh.stats.OversizeAllocations.Current <= sh.capOver
}

// escalate lets a hot path pass its shard's caps: it takes the
// allocator's mutex without waiting, then every other shard's lock,
// waiting for each, and reports whether it got them (it holds none of
// them otherwise). Holding every shard lock excludes world mode and every
// other hot path, so the caller may change the statistics beyond its caps
// and then settle the peaks itself (deescalate).
//
// Waiting cannot deadlock. A goroutine that holds a.mu holds it from the
// start of world mode or of an escalation, so when the TryLock succeeds
// no one else is taking the shard locks in bulk, and the other holders of
// shard locks are hot paths, which never wait while they hold their
// shard's lock: they take a.mu only by TryLock, and give their shard up
// before they fall back to world mode. The wait is one hot call per
// shard. Taking the other shards with TryLock alone, all or nothing,
// almost never succeeds while several goroutines run hot paths, since
// each holds its own lock most of the time.
func (a *Allocator) escalate(sh *shard) bool {
	if !a.mu.TryLock() {
		return false // world mode, or another escalation: redo there
	}
	for _, o := range a.shards {
		if o != sh {
			o.lock()
		}
	}
	a.settleOwner()
	a.stats.NumEscalations++
	return true
}

// deescalate settles the peaks, shares out the caps and releases the
// locks escalate took.
func (a *Allocator) deescalate(sh *shard) {
	sums, over := a.hotSums() // both settle and shareCaps' (nothing changes between them)
	a.settleSums(sums, over)
	a.favored = sh
	a.shareCaps(sums, over)
	for _, o := range a.shards {
		if o != sh {
			o.mu.Unlock()
		}
	}
	a.mu.Unlock()
}

// settle raises the global peaks of the hot statistics to the current
// sums (world mode, after every change of a hot statistic) and marks the
// caps for sharing out again.
func (a *Allocator) settle() { a.settleSums(a.hotSums()) }

// settleSums is settle with the sums already taken (hotSums).
func (a *Allocator) settleSums(sums [numHot][numPools]int64, over int64) {
	g := a.stats.hotArrays()
	for k := range numHot {
		for p := range numPools {
			g[k][p].Peak = max(g[k][p].Peak, sums[k][p])
		}
	}
	a.stats.OversizeAllocations.Peak = max(a.stats.OversizeAllocations.Peak, over)
	a.capsDirty = true
}

// shareCaps shares out each statistic's slack (peak − sum) again (world
// mode, after settle). With several shards in use (with an active block),
// half of it goes into the reservoir, from which any shard may borrow, and
// half becomes caps above the shards' current values: of that half, half
// to the shard whose change made the caps be shared out (it is likely to
// grow again: a replay, one goroutine's burst), the other half equally to
// the shards in use; an idle shard gets none until it borrows or asks.
// With one shard in use, all of it goes to that shard. sums and over are
// hotSums' now.
func (a *Allocator) shareCaps(sums [numHot][numPools]int64, over int64) {
	a.capsDirty = false
	favored := a.favored
	a.favored = nil
	if favored == nil {
		favored = a.shards[0]
	}
	var n int64
	for _, sh := range a.shards {
		if sh == favored || sh.stats.Active.current() > 0 {
			n++
		}
	}
	g := a.stats.hotArrays()
	var slack, given [numHot][numPools]int64
	for k := range numHot {
		for p := range numPools {
			slack[k][p] = g[k][p].Peak - sums[k][p]
		}
	}
	overSlack := a.stats.OversizeAllocations.Peak - over
	var overGiven int64
	for _, sh := range a.shards {
		var part, whole int64 = 0, 1 // this shard's share: part/whole of the slack
		switch {
		case n == 1 && sh == favored:
			part = 1
		case sh == favored:
			part, whole = n+1, 4*n
		case sh.stats.Active.current() > 0:
			part, whole = 1, 4*n
		}
		if part == 0 && sh.capsZero && sh.zeroHot() {
			continue // its caps stay 0, as the code below would set them
		}
		sh.lend = n > 1
		sh.capsZero = part == 0 && sh.zeroHot()
		h := sh.stats.arrays() // read, not summed (hotSums)
		for k := range numHot {
			for p := range numPools {
				x := slack[k][p] // part/whole of it; no division for a whole share
				if part != whole {
					x = x / whole * part
				}
				sh.caps[k][p] = h[k].currentIn(Pool(p)) + x
				sh.share[k][p] = x
				given[k][p] += x
			}
		}
		x := overSlack / whole * part
		sh.capOver = sh.stats.OversizeAllocations.Current + x
		overGiven += x
	}
	for k := range numHot {
		for p := range numPools {
			// An atomic store is a locked instruction; the reservoir is
			// often left as it was (0, with one shard in use).
			if r := &a.res.r[k][p]; r.Load() != slack[k][p]-given[k][p] {
				r.Store(slack[k][p] - given[k][p])
			}
		}
	}
	if a.res.over.Load() != overSlack-overGiven {
		a.res.over.Store(overSlack - overGiven)
	}
	if n == 1 { // favored holds all the slack, the reservoir none
		a.owner, favored.owner = favored, true
	}
}

// folded returns the statistics with every shard's hot counts added in
// (world mode). Peaks are the global ones.
func (a *Allocator) folded() Stats {
	s := a.stats
	g := s.hotArrays()
	for _, sh := range a.shards {
		h := sh.stats.summed()
		for k := range numHot {
			for p := range numPools {
				g[k][p].Current += h[k][p].Current
				g[k][p].Allocated += h[k][p].Allocated
				g[k][p].Freed += h[k][p].Freed
			}
		}
		s.NumCapBorrows += sh.borrows
		s.NumCapSteals += sh.steals
		s.NumSmallFromLarge += sh.fromLarge
		o := &sh.stats.OversizeAllocations
		s.OversizeAllocations.Current += o.Current
		s.OversizeAllocations.Allocated += o.Allocated
		s.OversizeAllocations.Freed += o.Freed
	}
	return s
}

// freeIndexes lists every pool's free index (world mode).
func (a *Allocator) freeIndexes() []*blocks.FreeIndex {
	out := make([]*blocks.FreeIndex, 0, 2*len(a.shards))
	for _, sh := range a.shards {
		out = append(out, sh.small.free, sh.large.free)
	}
	return out
}

// pools lists every shard's pool of one kind, in stream order (world
// mode): the order of PyTorch's one free index over all streams. It
// leaves out the held shards of private pools with users (pools.go),
// whose cached memory nothing may release: pools is what the release
// paths (EmptyCache, the OOM path, garbage collection, reclaim) walk.
func (a *Allocator) pools(small bool) []*pool {
	out := make([]*pool, 0, len(a.shards))
	for _, sh := range a.shards {
		if sh.held() {
			continue
		}
		if small {
			out = append(out, &sh.small)
		} else {
			out = append(out, &sh.large)
		}
	}
	return out
}

// checkShards reports broken invariants of the shards and the directory
// (world mode): shards in stream order and published, every segment in
// the directory under its stream's shard and nothing else there, every
// active block in its stream's shard, every Current within its cap and
// the caps of each statistic adding up to no more than its peak.
func (a *Allocator) checkShards() []error {
	var errs []error
	t := a.shardTab.Load().list
	if len(t) != len(a.shards) {
		errs = append(errs, fmt.Errorf("%d shards, %d published", len(a.shards), len(t)))
	}
	for i, sh := range a.shards {
		if m, f := a.gates(sh); m != sh.mallocMax || f != sh.freeOff {
			errs = append(errs, fmt.Errorf("stream %#x: hot-path gates %d/%v, the allocator's state says %d/%v", uint64(sh.stream), sh.mallocMax, sh.freeOff, m, f))
		}
		if i < len(t) && (t[i] != sh || a.shardTab.Load().streams[i] != sh.stream) {
			errs = append(errs, fmt.Errorf("shard %d (stream %#x) is not the one published", i, uint64(sh.stream)))
		}
		if i > 0 && a.shards[i-1].stream >= sh.stream {
			errs = append(errs, fmt.Errorf("shards out of stream order at stream %#x", uint64(sh.stream)))
		}
		sh.active.each(func(b *blocks.Block) {
			if b.Segment.Stream != uint64(sh.stream) || !b.Allocated {
				errs = append(errs, fmt.Errorf("%v of stream %#x is in the active map of stream %#x", b, b.Segment.Stream, uint64(sh.stream)))
			}
		})
	}
	dir := a.dir.Load()
	errs = append(errs, dir.check()...)
	if dir.n != len(a.segs.list) {
		errs = append(errs, fmt.Errorf("%d segments, %d in the directory", len(a.segs.list), dir.n))
	}
	if !dir.lazy && dir.one != nil {
		errs = append(errs, fmt.Errorf("the directory holds every entry of one shard (stream %#x) in full, not lazily", uint64(dir.one.stream)))
	}
	byStart := make(map[uint64]dirEntry, dir.n)
	if dir.lazy {
		for _, s := range a.segs.list {
			byStart[s.Ptr] = dirEntry{s.Ptr, s.Ptr + s.Size, dir.one}
		}
	}
	for e := range dir.all() {
		if _, ok := byStart[e.start]; ok {
			errs = append(errs, fmt.Errorf("directory holds two entries at %#x", e.start))
		}
		byStart[e.start] = e
	}
	for _, s := range a.segs.list {
		if e, ok := byStart[s.Ptr]; !ok || e.end != s.Ptr+s.Size || e.sh.stream != cudart.Stream(s.Stream) {
			errs = append(errs, fmt.Errorf("segment %#x of stream %#x is not in the directory under its shard", s.Ptr, s.Stream))
		}
	}
	g := a.stats.hotArrays()
	for k := range numHot {
		for p := range numPools {
			var caps int64
			for _, sh := range a.shards {
				cur := sh.stats.summed()[k][p].Current
				caps += sh.caps[k][p]
				if cur > sh.caps[k][p] {
					errs = append(errs, fmt.Errorf("%s.%v of stream %#x: current %d above its cap %d", hotNames[k], Pool(p), uint64(sh.stream), cur, sh.caps[k][p]))
				}
			}
			r := a.res.r[k][p].Load()
			if r < 0 {
				errs = append(errs, fmt.Errorf("%s.%v: reservoir %d below zero", hotNames[k], Pool(p), r))
			}
			if caps+r > g[k][p].Peak-g[k][p].Current {
				errs = append(errs, fmt.Errorf("%s.%v: caps add up to %d and the reservoir holds %d, above the peak %d", hotNames[k], Pool(p), caps, r, g[k][p].Peak))
			}
		}
	}
	if a.owner == nil { // lockAll ended owner mode
		sums, _ := a.hotSums()
		for _, sh := range a.shards {
			if b, ok := a.allocatedBound(sh); !ok || b < uint64(sums[hotAllocatedBytes][PoolAll]) {
				errs = append(errs, fmt.Errorf("stream %#x: the hot path's bound of the allocated bytes is %d (%v), below their sum %d",
					uint64(sh.stream), b, ok, sums[hotAllocatedBytes][PoolAll]))
			}
		}
	}
	var capOver int64
	for _, sh := range a.shards {
		capOver += sh.capOver
		if cur := sh.stats.OversizeAllocations.Current; cur > sh.capOver {
			errs = append(errs, fmt.Errorf("oversize_allocations of stream %#x: current %d above its cap %d", uint64(sh.stream), cur, sh.capOver))
		}
	}
	if o, r := a.stats.OversizeAllocations, a.res.over.Load(); r < 0 || capOver+r > o.Peak-o.Current {
		errs = append(errs, fmt.Errorf("oversize_allocations: caps add up to %d and the reservoir holds %d, above the peak %d", capOver, r, o.Peak))
	}
	return errs
}

// spinLock takes mu, polling it before it yields the processor or sleeps.
// Shard locks and the allocator's mutex are mostly held for a moment (a
// hot path, an escalation), so a waiter first polls: TryLock reads the
// lock's word, which stays in the waiter's cache until the holder's
// release, and takes it the moment it is free. Only a wait longer than
// that (world mode around a device call) yields and then sleeps.
//
// It polls instead of calling runtime.Gosched in a loop: every Gosched
// takes the scheduler's global lock, and with eight or more goroutines
// waiting on an escalation that lock, not the allocator's, was the
// bottleneck (Gosched and the scheduler's lock took 58% of the CPU of a
// warm mixed run at 8 and 16 goroutines on a 16-core host). Nor does it
// sleep at once: a goroutine woken from Lock waits in its waker's run
// queue, behind the waker, microseconds after the lock was free.
func spinLock(mu *sync.Mutex) {
	if !mu.TryLock() {
		spinLockSlow(mu)
	}
}

const (
	lockPolls  = 1 << 13 // TryLocks before yielding: some microseconds, an escalation's length
	lockYields = 4       // Gosched calls after them before Lock sleeps
)

// spinLockSlow is spinLock once a TryLock failed.
func spinLockSlow(mu *sync.Mutex) {
	for range lockPolls {
		if mu.TryLock() {
			return
		}
	}
	for range lockYields {
		runtime.Gosched() // the holder may be waiting for a processor
		if mu.TryLock() {
			return
		}
	}
	mu.Lock()
}
