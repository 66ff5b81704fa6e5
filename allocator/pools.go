package allocator

// Private memory pools, for CUDA graphs and torch.cuda.MemPool.
//
// A CUDA graph replays the kernels it captured at the addresses they had
// during capture, so the memory a capture allocates must stay the
// graph's for as long as the graph lives: no other allocation may be
// given it, and it may not go back to the device, even after the
// capture freed it. PyTorch keeps such memory in private pools, and so
// does allocd, with the same calls: a pool is created or gains a user
// (CreatePool, and BeginAllocateToPool, which also starts routing
// allocations into it), allocations are routed into it while a capture
// is under way (BeginAllocateToPool's stream filter) or by name
// (MallocInPool), routing ends (EndAllocateToPool), and each user lets go
// (ReleasePool).
//
// A pool is a set of shards (shard.go) of its own: one per stream that
// allocated into it, keyed by a pool stream (blocks.PoolStream) that
// carries the pool's sequence number beside the device stream. Blocks
// never cross streams, so a segment belongs to one pool, and a pool's
// free blocks serve only allocations routed to that pool; the hot paths,
// the front cache, the directory and the statistics serve pool shards as
// they serve streams. While a pool has users its shards are held: their
// cached segments are not released by EmptyCache, the OOM path, garbage
// collection, idle sweeps or (with expandable segments) reclaim. When
// its last user releases it, its shards become ordinary released
// streams (ReleaseStream): each goes back to the device at once when
// nothing in it is allocated, else as soon as its last block is freed;
// the pool is forgotten with its last shard. PyTorch instead keeps a
// released pool's memory until the next empty_cache or OOM; allocd
// returns it sooner.
//
// While a capture is under way (BeginAllocateToPool until its
// EndAllocateToPool) nothing that would query an event or a stream, or
// synchronise a stream or the device, may run, since any of them would
// end the capture with an error: as PyTorch does, Malloc does not process
// completed events (nor does allocd check a new stream with the device),
// a Free of a block that other streams used defers recording their
// events until the last capture ends, and the OOM path, garbage
// collection, idle sweeps and expandable reclaim release nothing.
// EmptyCache during a capture fails with ErrCaptureUnderway.
//
// Expandable segments: a pool's shards grow expandable segments of their
// own, in address ranges of their own, as a stream does; held, they are
// never reclaimed, so their pages stay mapped at fixed addresses for the
// graphs that use them.

import (
	"errors"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// PoolID names a private pool, as torch's MempoolId_t: a pair, never
// {0, 0}, which is the general cache. torch.cuda.graph's pools are
// {n, 0} and torch.cuda.MemPool's {0, n}.
type PoolID [2]uint64

// String returns the pair as torch prints it, "(a, b)".
func (id PoolID) String() string { return fmt.Sprintf("(%d, %d)", id[0], id[1]) }

var (
	// ErrUnknownPool: a pool call or MallocInPool names a pool that has no
	// user.
	ErrUnknownPool = errors.New("unknown memory pool")
	// ErrCaptureUnderway: a call that must synchronise (EmptyCache) while
	// an allocation to a pool (a CUDA graph capture) is under way.
	ErrCaptureUnderway = errors.New("allocation to a private pool (CUDA graph capture) under way")
)

// privatePool is one private pool's state (world mode).
type privatePool struct {
	id  PoolID
	seq uint64 // its number in pool streams (blocks.PoolStream)
	// uses counts CreatePool and BeginAllocateToPool calls not yet matched
	// by ReleasePool; captures the BeginAllocateToPool calls not yet
	// matched by EndAllocateToPool; shards its live shards.
	uses, captures, shards int
}

// capture is one BeginAllocateToPool under way: its pool's number and the
// filter of the streams it routes (nil: every stream).
type capture struct {
	seq    uint64
	filter func(cudart.Stream) bool
}

// poolRef is a pool with users, as the hot path's table lists it.
type poolRef struct {
	id  PoolID
	seq uint64
}

// held reports whether sh is a shard of a pool with users, whose cached
// segments must stay (world mode).
func (sh *shard) held() bool { return sh.pool != nil && sh.pool.uses > 0 }

// CreatePool creates private pool id with one user, or adds a user to it
// (PyTorch's createOrIncrefPool). Allocations reach it through
// BeginAllocateToPool's routing or MallocInPool.
func (a *Allocator) CreatePool(id PoolID) error {
	a.lockWorld()
	defer a.unlockWorld()
	_, err := a.usePool("create pool", id)
	return err
}

// usePool adds a user to pool id, creating it when it has none (world
// mode).
func (a *Allocator) usePool(op string, id PoolID) (*privatePool, error) {
	if err := a.poolCallOK(op, id); err != nil {
		return nil, err
	}
	p := a.private[id]
	if p == nil {
		seq, err := a.newPoolSeq()
		if err != nil {
			return nil, fmt.Errorf("allocator: %s %v: %w", op, id, err)
		}
		p = &privatePool{id: id, seq: seq}
		if a.private == nil {
			a.private = make(map[PoolID]*privatePool)
			a.privateSeq = make(map[uint64]*privatePool)
		}
		a.private[id], a.privateSeq[seq] = p, p
	}
	p.uses++
	if p.uses == 1 {
		// Released before and back in use: its shards are held again.
		for _, sh := range a.shards {
			if sh.pool == p {
				a.undoom(sh)
			}
		}
	}
	a.publishPools()
	return p, nil
}

// poolCallOK checks what every pool call needs (world mode).
func (a *Allocator) poolCallOK(op string, id PoolID) error {
	switch {
	case a.closed:
		return fmt.Errorf("allocator: %s %v: %w", op, id, ErrClosed)
	case a.async != nil:
		return fmt.Errorf("allocator: %s %v: private pools with backend:cudaMallocAsync: %w", op, id, ErrNotSupported)
	case id == PoolID{}:
		return fmt.Errorf("allocator: %s %v: (0, 0) is the general cache, not a private pool: %w", op, id, ErrUnknownPool)
	}
	return nil
}

// newPoolSeq returns the next pool number after the last one given that
// no pool uses, wrapping after blocks.MaxPoolSeq (world mode). Numbers go
// round: MallocInPool and a routed Malloc read a pool's number without a
// lock, so a number freed by ReleasePool while such a call runs must not
// come back at once to a new pool, which would take that call's
// allocation. Given round, it comes back only after every other number
// has been handed out, and the call meanwhile finds no pool behind it
// (ErrUnknownPool).
func (a *Allocator) newPoolSeq() (uint64, error) {
	for range blocks.MaxPoolSeq {
		a.lastPoolSeq = a.lastPoolSeq%blocks.MaxPoolSeq + 1
		if a.privateSeq[a.lastPoolSeq] == nil {
			return a.lastPoolSeq, nil
		}
	}
	return 0, fmt.Errorf("%d private pools exist, the most at once: %w", blocks.MaxPoolSeq, ErrNotSupported)
}

// ReleasePool takes one user from pool id (PyTorch's releasePool). When
// the last goes, the pool's memory goes back to the device: at once for
// the segments that hold no allocation, the rest as their blocks are
// freed (with expandable segments, a shard's free pages while others are
// allocated go at the next EmptyCache, OOM or reclaim). The use that a
// BeginAllocateToPool under way holds cannot be released before its
// EndAllocateToPool: that fails with ErrCaptureUnderway.
func (a *Allocator) ReleasePool(id PoolID) error {
	a.lockWorld()
	defer a.unlockWorld()
	if err := a.poolCallOK("release pool", id); err != nil {
		return err
	}
	p := a.private[id]
	if p == nil || p.uses == 0 {
		return fmt.Errorf("allocator: release pool %v: it has no user: %w", id, ErrUnknownPool)
	}
	if p.uses <= p.captures {
		return fmt.Errorf("allocator: release pool %v: %d allocations to it are under way (EndAllocateToPool first): %w", id, p.captures, ErrCaptureUnderway)
	}
	p.uses--
	if p.uses > 0 {
		return nil
	}
	a.publishPools()
	for i := 0; i < len(a.shards); {
		sh := a.shards[i]
		if sh.pool != p {
			i++
			continue
		}
		if a.capturing == 0 && a.idle(sh) {
			if err := a.releaseShard(sh); err == nil {
				continue // dropped: the next shard moved to i
			}
		} else if a.capturing == 0 && a.exp == nil {
			// Its free segments go now, the rest with the shard. A
			// failure is logged: they go with the shard too.
			if err := a.releaseWholeOf(sh); err != nil {
				a.log.Warn("releasing a released pool's free segments failed",
					zap.Uint64("stream", blocks.DeviceStream(uint64(sh.stream))), zap.Error(err))
			}
		}
		a.doom(sh)
		i++
	}
	a.forgetPool(p)
	return nil
}

// forgetPool drops p once it has neither users nor shards (world mode).
func (a *Allocator) forgetPool(p *privatePool) {
	if p.uses == 0 && p.shards == 0 && a.private[p.id] == p {
		delete(a.private, p.id)
		delete(a.privateSeq, p.seq)
	}
}

// BeginAllocateToPool adds a user to pool id, creating it when needed, and
// routes into it every later Malloc on a stream that filter accepts (nil
// accepts every stream) until EndAllocateToPool(id) (PyTorch's
// beginAllocateToPool). Allocations already under way to other pools
// keep their routes and are tried first, in the order they began. Until
// the last such call ends, a capture is under way (see the package doc
// of pools.go: nothing synchronises).
//
// filter runs on the Malloc's goroutine, without the allocator's locks,
// and must not call the allocator.
func (a *Allocator) BeginAllocateToPool(id PoolID, filter func(cudart.Stream) bool) error {
	a.lockWorld()
	defer a.unlockWorld()
	p, err := a.usePool("begin allocate to pool", id)
	if err != nil {
		return err
	}
	p.captures++
	a.capturing++
	if a.exp != nil {
		a.exp.SetCapturing(true)
	}
	a.captures = append(a.captures, capture{seq: p.seq, filter: filter})
	a.publishRoutes()
	return nil
}

// EndAllocateToPool ends the earliest BeginAllocateToPool(id) still under
// way. When it was the last capture under way, the events that Frees
// deferred are recorded now.
func (a *Allocator) EndAllocateToPool(id PoolID) error {
	a.lockWorld()
	defer a.unlockWorld()
	if err := a.poolCallOK("end allocate to pool", id); err != nil {
		return err
	}
	p := a.private[id]
	if p == nil || p.captures == 0 {
		return fmt.Errorf("allocator: end allocate to pool %v: no allocation to it is under way: %w", id, ErrUnknownPool)
	}
	i := slices.IndexFunc(a.captures, func(c capture) bool { return c.seq == p.seq })
	a.captures = slices.Delete(a.captures, i, i+1)
	p.captures--
	a.capturing--
	if a.exp != nil {
		a.exp.SetCapturing(a.capturing > 0)
	}
	a.publishRoutes()
	if a.capturing == 0 {
		a.recordDeferred()
	}
	return nil
}

// publishRoutes publishes the captures under way for Malloc's routing, or
// nil when none is (world mode).
func (a *Allocator) publishRoutes() {
	if len(a.captures) == 0 {
		a.routes.Store(nil)
		return
	}
	r := slices.Clone(a.captures)
	a.routes.Store(&r)
}

// publishPools publishes the pools with users for MallocInPool (world
// mode).
func (a *Allocator) publishPools() {
	live := make([]poolRef, 0, len(a.private))
	for _, p := range a.private {
		if p.uses > 0 {
			live = append(live, poolRef{id: p.id, seq: p.seq})
		}
	}
	a.livePools.Store(&live)
}

// routedMalloc is Malloc while a capture is under way, or for a stream
// with the pool bit: the stream goes to the first capture whose filter
// accepts it, else to the general cache.
func (a *Allocator) routedMalloc(size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	if uint64(stream)&blocks.PoolStreamBit != 0 {
		return 0, fmt.Errorf("allocator: malloc on stream %#x: %w (not a CUDA stream)", uint64(stream), ErrInvalidStream)
	}
	if r := a.routes.Load(); r != nil {
		for _, c := range *r {
			if c.filter == nil || c.filter(stream) {
				ps, ok := blocks.PoolStream(c.seq, uint64(stream))
				if !ok {
					return 0, fmt.Errorf("allocator: malloc on stream %#x routed to a private pool: %w (too large for a pool stream)", uint64(stream), ErrInvalidStream)
				}
				return a.mallocStream(size, cudart.Stream(ps))
			}
		}
	}
	return a.mallocStream(size, stream)
}

// MallocInPool is Malloc into private pool id, which must have a user.
// Memory freed from it stays the pool's (see the package doc of
// pools.go).
func (a *Allocator) MallocInPool(id PoolID, size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	if size == 0 {
		return 0, nil
	}
	if uint64(stream)&blocks.PoolStreamBit != 0 {
		return 0, fmt.Errorf("allocator: malloc in pool %v on stream %#x: %w (not a CUDA stream)", id, uint64(stream), ErrInvalidStream)
	}
	var seq uint64
	if t := a.livePools.Load(); t != nil {
		for _, r := range *t {
			if r.id == id {
				seq = r.seq
				break
			}
		}
	}
	if seq == 0 {
		return 0, fmt.Errorf("allocator: malloc in pool %v: %w", id, ErrUnknownPool)
	}
	ps, ok := blocks.PoolStream(seq, uint64(stream))
	if !ok {
		return 0, fmt.Errorf("allocator: malloc in pool %v on stream %#x: %w (too large for a pool stream)", id, uint64(stream), ErrInvalidStream)
	}
	return a.mallocStream(size, cudart.Stream(ps))
}

// checkPoolStream admits pool stream s for a new shard: its pool must
// have a user (world mode). It returns the pool.
func (a *Allocator) checkPoolStream(s cudart.Stream) (*privatePool, error) {
	p := a.privateSeq[blocks.PoolSeq(uint64(s))]
	if p == nil || p.uses == 0 {
		return nil, fmt.Errorf("allocator: malloc on stream %#x: its private pool has no user (released while the call ran): %w",
			blocks.DeviceStream(uint64(s)), ErrUnknownPool)
	}
	return p, nil
}

// deferEvents holds a freed block that other streams used, or a lent one
// (expandable.go), until the last capture under way ends (world mode):
// recording their events now would capture the records into the graph.
// It counts as one pending event meanwhile.
func (a *Allocator) deferEvents(b *blocks.Block) {
	b.EventCount++
	a.poolOf(b).sh.pendingEv++
	a.deferred = append(a.deferred, b)
}

// recordDeferred records the deferred blocks' events (world mode, no
// capture under way), as a Free would have.
func (a *Allocator) recordDeferred() {
	for i, b := range a.deferred {
		a.deferred[i] = nil
		pl := a.poolOf(b)
		b.EventCount--
		pl.sh.pendingEv--
		if b.Lent {
			a.returnLent(b)
		}
		a.eventsOrSync(nil, pl, b)
	}
	a.deferred = a.deferred[:0]
}

// PoolUsage is one private pool's state, as Pools reports it.
type PoolUsage struct {
	ID PoolID
	// Users counts CreatePool and BeginAllocateToPool calls not yet
	// matched by ReleasePool; Capturing the BeginAllocateToPool calls not
	// yet matched by EndAllocateToPool. A pool with no user is on its
	// way back to the device.
	Users, Capturing int
	// Segments, ReservedBytes and AllocatedBytes are the pool's share of
	// Stats' segment, reserved_bytes and allocated_bytes (all pools).
	Segments       int
	ReservedBytes  int64
	AllocatedBytes int64
}

// Pools reports every private pool, in PoolID order.
func (a *Allocator) Pools() []PoolUsage {
	a.lockWorld()
	defer a.unlockWorld()
	byID := make(map[*privatePool]*PoolUsage, len(a.private))
	out := make([]PoolUsage, 0, len(a.private))
	for _, p := range a.private {
		out = append(out, PoolUsage{ID: p.id, Users: p.uses, Capturing: p.captures})
	}
	slices.SortFunc(out, func(x, y PoolUsage) int {
		if x.ID[0] != y.ID[0] {
			return cmpU64(x.ID[0], y.ID[0])
		}
		return cmpU64(x.ID[1], y.ID[1])
	})
	for i := range out {
		byID[a.private[out[i].ID]] = &out[i]
	}
	for _, s := range a.segs.list {
		p := a.privateSeq[blocks.PoolSeq(s.Stream)]
		if p == nil {
			continue
		}
		u := byID[p]
		u.Segments++
		r, al := segmentBytes(s)
		u.ReservedBytes += r
		u.AllocatedBytes += al
	}
	return out
}

// segmentBytes returns the bytes segment s holds (its mapped blocks) and
// has allocated.
func segmentBytes(s *blocks.Segment) (reserved, allocated int64) {
	for b := s.Head; b != nil; b = b.Next {
		if !b.Unmapped {
			reserved += int64(b.Size)
		}
		if b.Allocated {
			allocated += int64(b.Size)
		}
	}
	return reserved, allocated
}

func cmpU64(x, y uint64) int {
	switch {
	case x < y:
		return -1
	case x > y:
		return 1
	}
	return 0
}

// privateBytes returns the bytes that private pools hold and have
// allocated (world mode).
func (a *Allocator) privateBytes() (reserved, allocated int64) {
	if len(a.private) == 0 {
		return 0, 0
	}
	for _, s := range a.segs.list {
		if s.Stream&blocks.PoolStreamBit == 0 {
			continue
		}
		r, al := segmentBytes(s)
		reserved += r
		allocated += al
	}
	return reserved, allocated
}

// poolIDOf returns the pool id of a segment's stream, {0, 0} for the
// general cache (world mode).
func (a *Allocator) poolIDOf(stream uint64) PoolID {
	if p := a.privateSeq[blocks.PoolSeq(stream)]; p != nil {
		return p.id
	}
	return PoolID{}
}

// checkPools reports broken invariants of the private pools (world mode):
// the maps agree; each pool's shard and capture counts match the shards
// and captures; a pool with neither users nor shards is gone; only pool
// streams have a pool and each its own; held shards are not doomed; the
// published tables match; deferred blocks are free, pending, and only
// kept while a capture is under way.
func (a *Allocator) checkPools() []error {
	var errs []error
	if len(a.private) != len(a.privateSeq) {
		errs = append(errs, fmt.Errorf("%d pools by id, %d by number", len(a.private), len(a.privateSeq)))
	}
	shards := make(map[*privatePool]int, len(a.private))
	for _, sh := range a.shards {
		seq := blocks.PoolSeq(uint64(sh.stream))
		switch {
		case seq == 0 && sh.pool != nil:
			errs = append(errs, fmt.Errorf("stream %#x belongs to pool %v without a pool stream", uint64(sh.stream), sh.pool.id))
		case seq != 0 && (sh.pool == nil || a.privateSeq[seq] != sh.pool):
			errs = append(errs, fmt.Errorf("pool stream %#x: its shard's pool is not pool number %d", uint64(sh.stream), seq))
		case sh.held() && sh.doomed:
			errs = append(errs, fmt.Errorf("pool %v: shard of stream %#x is doomed while the pool has users", sh.pool.id, blocks.DeviceStream(uint64(sh.stream))))
		}
		if sh.pool != nil {
			shards[sh.pool]++
		}
	}
	captures := make(map[uint64]int, len(a.captures))
	for _, c := range a.captures {
		captures[c.seq]++
	}
	total := 0
	for id, p := range a.private {
		if p.id != id || a.privateSeq[p.seq] != p {
			errs = append(errs, fmt.Errorf("pool %v: its maps disagree", id))
		}
		if p.shards != shards[p] {
			errs = append(errs, fmt.Errorf("pool %v counts %d shards, has %d", id, p.shards, shards[p]))
		}
		if p.captures != captures[p.seq] {
			errs = append(errs, fmt.Errorf("pool %v counts %d captures, %d under way", id, p.captures, captures[p.seq]))
		}
		if p.uses < p.captures || p.captures < 0 {
			errs = append(errs, fmt.Errorf("pool %v: %d users, %d captures", id, p.uses, p.captures))
		}
		if p.uses == 0 && p.shards == 0 {
			errs = append(errs, fmt.Errorf("pool %v has neither users nor memory but is kept", id))
		}
		total += p.captures
	}
	if total != a.capturing || len(a.captures) != a.capturing {
		errs = append(errs, fmt.Errorf("%d captures under way, pools count %d, the list %d", a.capturing, total, len(a.captures)))
	}
	if r := a.routes.Load(); (r == nil) != (len(a.captures) == 0) || (r != nil && len(*r) != len(a.captures)) {
		errs = append(errs, errors.New("published routes do not match the captures under way"))
	}
	live := 0
	for _, p := range a.private {
		if p.uses > 0 {
			live++
		}
	}
	if t := a.livePools.Load(); (t == nil && live > 0) || (t != nil && len(*t) != live) {
		errs = append(errs, fmt.Errorf("%d pools with users, a different number published", live))
	} else if t != nil {
		for _, r := range *t {
			if p := a.private[r.id]; p == nil || p.seq != r.seq || p.uses == 0 {
				errs = append(errs, fmt.Errorf("published pool %v is not a pool with users", r.id))
			}
		}
	}
	if a.capturing == 0 && len(a.deferred) > 0 {
		errs = append(errs, fmt.Errorf("%d blocks' events deferred with no capture under way", len(a.deferred)))
	}
	for _, b := range a.deferred {
		if b.Allocated || b.EventCount < 1 {
			errs = append(errs, fmt.Errorf("deferred %v is allocated or not pending", b))
		}
	}
	return errs
}
