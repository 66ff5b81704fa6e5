package workload

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"runtime/pprof"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// ReplayResult is what one replay of a trace measured.
type ReplayResult struct {
	// Ops is the number of allocations and frees replayed (a deferred
	// free's completion is not counted separately), as the anchor counts.
	Ops int
	// Peak figures, from the allocator's statistics.
	PeakAllocated, PeakReserved, PeakRequested int64
	// DeviceMallocs and DeviceFrees count segment allocations and releases.
	DeviceMallocs, DeviceFrees int64
	// AllocRetries and OOMs are num_alloc_retries and num_ooms.
	AllocRetries, OOMs int64
	// FailedAllocs counts allocations that failed (their frees are skipped).
	FailedAllocs int
	// UnmatchedFrees counts frees in the trace of addresses it never
	// allocated (recording began after the allocation).
	UnmatchedFrees int
	// Reclaims, PagesMoved and PagesMovedAcrossStreams are the
	// allocator's expandable-segment reclaim counters (Stats.NumReclaims,
	// NumPagesMoved, NumPagesMovedAcrossStreams); 0 without expandable
	// segments.
	Reclaims, PagesMoved, PagesMovedAcrossStreams int64
	// Lends counts free blocks of one stream's expandable segment lent
	// to another stream on the out-of-memory path (Stats.NumLends), and
	// SmallFromLarge the small requests served from the large pool
	// (Stats.NumSmallFromLarge).
	Lends, SmallFromLarge int64
	// VMM is the driver's virtual memory calls of expandable segments
	// and their time (allocator.Stats.VMM); zero without them.
	VMM allocator.VMMCalls
	// Elapsed is the time spent in the replay loop.
	Elapsed time.Duration
	// DeviceMallocTime is the part of Elapsed spent in device mallocs
	// (cudaMalloc, as the allocator's device_malloc histogram measures
	// them): a cost every caching allocator pays for the same segments.
	DeviceMallocTime time.Duration
}

// SegmentAddresses lists the segment_alloc entries of a device trace as
// planned Sim addresses. A Sim given them hands out the addresses the
// recorded program got, so best fit, which breaks ties by address, places
// blocks exactly as the recorded allocator did.
func SegmentAddresses(entries []snapshot.Entry) []simdev.Address {
	var out []simdev.Address
	for _, e := range entries {
		if e.Action == snapshot.ActionSegmentAlloc {
			out = append(out, simdev.Address{Addr: cudart.Ptr(e.Addr), Size: e.Size})
		}
	}
	return out
}

// NsPerOp is the mean time per replayed operation.
func (r ReplayResult) NsPerOp() float64 {
	if r.Ops == 0 {
		return 0
	}
	return float64(r.Elapsed.Nanoseconds()) / float64(r.Ops)
}

// ReplayOptions tunes a replay.
type ReplayOptions struct {
	// Progress, when set, is called every ProgressEvery operations with the
	// number done so far.
	Progress      func(done int)
	ProgressEvery int
	// Observe, when set, is called after every operation with its index;
	// it may read the allocator's statistics (for charts).
	Observe func(i int)
	// Stop, when positive, ends the replay after the first Stop operations
	// (of ops.Ops), leaving the allocator as it was at that moment.
	Stop int
	// Ctx, when set, is checked every few thousand operations; once it is
	// done the replay stops and returns its error.
	Ctx context.Context
	// Streams, when non-nil, maps trace streams to device streams across
	// replays: streams found there are used, streams created are added, and
	// none of them is destroyed at the end (the caller owns them). Replays
	// that loop over a trace reuse their streams this way.
	Streams map[uint64]cudart.Stream
}

// Replay runs ops through a, which must be fresh. Each allocation becomes a
// Malloc on its stream (trace streams map to streams created on a's
// device, the default stream to the default stream) and each free a Free.
// A free whose completion the trace shows later (the block was held by
// another stream) is reproduced with RecordStream on a side stream whose
// event completes at the free_completed position when the device is a Sim
// with manual events; on other devices the Free itself is delayed to that
// position, which keeps the block out of reuse for the same span.
//
// Streams created for the replay are destroyed at the end; the caller owns
// a and closes it.
func Replay(ops *trace.Ops, a *allocator.Allocator, opt ReplayOptions) (ReplayResult, error) {
	dev := a.Device()
	sim, _ := dev.(*simdev.Sim)
	r := &replayer{a: a, dev: dev, sim: sim, streams: opt.Streams}
	if r.streams == nil {
		r.streams = map[uint64]cudart.Stream{}
		defer func() { r.destroy(r.created) }()
	}
	defer func() { r.destroy(r.sideCreated) }()
	r.streams[0] = cudart.DefaultStream
	for _, s := range ops.Streams {
		if _, err := r.stream(s); err != nil {
			return ReplayResult{}, err
		}
	}
	res, err := r.run(ops, opt)
	res.UnmatchedFrees = ops.UnmatchedFrees
	st := a.Stats()
	res.PeakAllocated = st.AllocatedBytes[allocator.PoolAll].Peak
	res.PeakReserved = st.ReservedBytes[allocator.PoolAll].Peak
	res.PeakRequested = st.RequestedBytes[allocator.PoolAll].Peak
	res.DeviceMallocs = st.NumDeviceAlloc
	res.DeviceMallocTime = time.Duration(st.DeviceMallocLatency.Sum * float64(time.Second))
	res.DeviceFrees = st.NumDeviceFree
	res.AllocRetries = st.NumAllocRetries
	res.OOMs = st.NumOOMs
	res.Reclaims = st.NumReclaims
	res.Lends = st.NumLends
	res.SmallFromLarge = st.NumSmallFromLarge
	res.PagesMoved = st.NumPagesMoved
	res.PagesMovedAcrossStreams = st.NumPagesMovedAcrossStreams
	res.VMM = st.VMM
	return res, err
}

type replayer struct {
	a           *allocator.Allocator
	dev         cudart.Device
	sim         *simdev.Sim
	streams     map[uint64]cudart.Stream
	created     []cudart.Stream // trace streams this replay created
	sideCreated []cudart.Stream // side streams this replay created
	side        []cudart.Stream // idle side streams for deferred frees
	noGC        bool            // run does not collect garbage first (DriverCost's later passes)
}

func (r *replayer) stream(s uint64) (cudart.Stream, error) {
	if ds, ok := r.streams[s]; ok {
		return ds, nil
	}
	ds, err := r.dev.StreamCreate()
	if err != nil {
		return 0, fmt.Errorf("replay: creating a stream for trace stream %#x: %w", s, err)
	}
	r.streams[s] = ds
	r.created = append(r.created, ds)
	return ds, nil
}

func (r *replayer) sideStream() (cudart.Stream, error) {
	if n := len(r.side); n > 0 {
		s := r.side[n-1]
		r.side = r.side[:n-1]
		return s, nil
	}
	s, err := r.dev.StreamCreate()
	if err != nil {
		return 0, fmt.Errorf("replay: creating a side stream: %w", err)
	}
	r.sideCreated = append(r.sideCreated, s)
	return s, nil
}

func (r *replayer) destroy(streams []cudart.Stream) {
	for _, s := range streams {
		_ = r.dev.StreamDestroy(s)
	}
}

// run is the replay loop. ptr[id] is the live address of allocation id;
// side[id] the side stream holding a deferred free. Without an allocator
// (r.a nil: DriverCost) every allocation takes a made-up address and every
// free only checks that its address is set, so that the loop's own cost can
// be timed apart from the allocator's.
//
// The loop does per operation what the anchor's C++ loop does (index the
// operation, branch on its kind, store or load ptr[id], skip the free of
// an allocation that has no address: one that failed, or of size 0) plus
// one predictable branch each for the stream of an allocation (the last
// one seen is kept) and the hooks (Observe, Progress); Ctx is checked
// between chunks of operations.
func (r *replayer) run(ops *trace.Ops, opt ReplayOptions) (ReplayResult, error) {
	var res ReplayResult
	ptr := make([]cudart.Ptr, ops.NumIDs) // 0: not allocated, failed, or of size 0
	var side map[int32]cudart.Stream
	useEvents := r.sim != nil && r.sim.ManualEvents()
	if useEvents {
		side = make(map[int32]cudart.Stream)
	}
	dry := r.a == nil
	sc := newStreamCache(r.streams)
	n := len(ops.Ops)
	if opt.Stop > 0 && opt.Stop < n {
		n = opt.Stop
	}
	hooks := opt.Observe != nil || (opt.Progress != nil && opt.ProgressEvery > 0)
	completed := 0 // OpFreeCompleted operations, which Ops does not count
	// Collect the garbage of loading the trace now, so that no collection
	// of it runs inside the timed loop (the C++ side has none to run).
	if !r.noGC {
		runtime.GC()
	}
	t0 := time.Now()
	// Ctx is checked before every replayChunk operations, outside the inner loop.
	for start := 0; start < n; start += replayChunk {
		if opt.Ctx != nil {
			if err := opt.Ctx.Err(); err != nil {
				res.Elapsed = time.Since(t0)
				res.Ops = start - completed
				return res, fmt.Errorf("replay: stopped at operation %d: %w", start, err)
			}
		}
		end := min(start+replayChunk, n)
		if !useEvents && !hooks {
			if i, err := r.plainChunk(ops.Ops[:end], start, ptr, &sc, &res, &completed); err != nil {
				res.Elapsed = time.Since(t0)
				res.Ops = i + 1 - completed
				return res, fmt.Errorf("replay: operation %d: %w", i, err)
			}
			continue
		}
		for i := start; i < end; i++ {
			op := &ops.Ops[i]
			var err error
			switch op.Kind {
			case trace.OpAlloc:
				s := sc.get(op.Stream)
				var p cudart.Ptr
				if dry {
					p = cudart.Ptr(uint64(i+1)<<9 | uint64(s)&0x1ff)
				} else if p, err = r.a.Malloc(op.Size, s); err != nil {
					if !errors.Is(err, allocator.ErrOutOfMemory) {
						break
					}
					err = nil
					res.FailedAllocs++
					break // ptr[op.ID] stays 0
				}
				ptr[op.ID] = p
			case trace.OpFree:
				if ptr[op.ID] == 0 || (op.Deferred && !useEvents) {
					break // failed or of size 0, or freed at its OpFreeCompleted
				}
				if op.Deferred {
					var s cudart.Stream
					if s, err = r.sideStream(); err != nil {
						res.Elapsed = time.Since(t0)
						res.Ops = i + 1 - completed
						return res, err
					}
					if err = r.a.RecordStream(ptr[op.ID], s); err != nil {
						break
					}
					side[op.ID] = s
				}
				err = r.free(ptr[op.ID], dry)
			case trace.OpFreeCompleted:
				completed++
				if ptr[op.ID] == 0 {
					break
				}
				if !useEvents {
					err = r.free(ptr[op.ID], dry)
					break
				}
				if s, ok := side[op.ID]; ok {
					r.sim.CompleteStream(s)
					delete(side, op.ID)
					r.side = append(r.side, s)
				}
			}
			if err != nil {
				res.Elapsed = time.Since(t0)
				res.Ops = i + 1 - completed
				return res, fmt.Errorf("replay: operation %d: %w", i, err)
			}
			if hooks {
				if opt.Observe != nil {
					opt.Observe(i)
				}
				if opt.Progress != nil && opt.ProgressEvery > 0 && (i+1)%opt.ProgressEvery == 0 {
					opt.Progress(i + 1)
				}
			}
		}
	}
	res.Elapsed = time.Since(t0)
	res.Ops = n - completed
	return res, nil
}

// plainChunk runs ops[start:] for a replay whose deferred frees wait for
// their completion and which has no hooks (every replay that Bench and
// ReplayWarm time): run's loop with nothing else in it, so that the loop's
// own cost stays near the anchor's. It returns the position of the
// operation that failed, with its error.
func (r *replayer) plainChunk(ops []trace.Op, start int, ptr []cudart.Ptr, sc *streamCache, res *ReplayResult, completed *int) (int, error) {
	a := r.a
	for i := start; i < len(ops); i++ {
		op := &ops[i]
		switch op.Kind {
		case trace.OpAlloc:
			s := sc.get(op.Stream)
			if a == nil {
				ptr[op.ID] = cudart.Ptr(uint64(i+1)<<9 | uint64(s)&0x1ff)
				break
			}
			p, err := a.Malloc(op.Size, s)
			if err != nil {
				if !errors.Is(err, allocator.ErrOutOfMemory) {
					return i, err
				}
				res.FailedAllocs++ // ptr[op.ID] stays 0
			}
			ptr[op.ID] = p
		case trace.OpFree:
			if op.Deferred {
				break // freed at its OpFreeCompleted
			}
			if p := ptr[op.ID]; p != 0 && a != nil {
				if err := a.Free(p); err != nil {
					return i, err
				}
			}
		case trace.OpFreeCompleted:
			*completed++
			if p := ptr[op.ID]; p != 0 && a != nil {
				if err := a.Free(p); err != nil {
					return i, err
				}
			}
		}
	}
	return len(ops), nil
}

// streamCache maps a trace's streams to the replay's: the stream of the
// last allocation is kept, and the first few others seen are found by a
// linear search, faster than the map, which serves traces of many
// streams.
type streamCache struct {
	lastKey uint64
	last    cudart.Stream
	n       int
	keys    [8]uint64
	streams [8]cudart.Stream
	all     map[uint64]cudart.Stream
}

func newStreamCache(all map[uint64]cudart.Stream) streamCache {
	return streamCache{last: all[0], all: all}
}

// get returns the replay's stream for trace stream s.
func (c *streamCache) get(s uint64) cudart.Stream {
	if s == c.lastKey {
		return c.last
	}
	var ds cudart.Stream
	found := false
	for i := range c.n {
		if c.keys[i] == s {
			ds, found = c.streams[i], true
			break
		}
	}
	if !found {
		ds = c.all[s]
		if c.n < len(c.keys) {
			c.keys[c.n], c.streams[c.n] = s, ds
			c.n++
		}
	}
	c.lastKey, c.last = s, ds
	return ds
}

// replayChunk is how many operations run between two checks of
// ReplayOptions.Ctx.
const replayChunk = 4096

// free frees p, not 0, on the allocator, or nothing in a dry run.
func (r *replayer) free(p cudart.Ptr, dry bool) error {
	if dry {
		return nil
	}
	return r.a.Free(p)
}

// DriverCost times Replay's loop over ops with the allocator left out:
// each allocation takes a made-up address and each free only checks that
// its address is set (the loop's own test); deferred frees wait for their completion, as they
// do on a GPU. It runs the loop once untimed, then again until about a
// million operations have run (at most 100 times), and returns the
// fastest pass: Ops and Elapsed (the other fields zero). That is the driver's own share of a
// replay's NsPerOp, the part that is not the allocator's.
func DriverCost(ops *trace.Ops) (ReplayResult, error) {
	r := &replayer{streams: map[uint64]cudart.Stream{0: cudart.DefaultStream}}
	for i, s := range ops.Streams {
		if _, ok := r.streams[s]; !ok {
			r.streams[s] = cudart.Stream(i + 1)
		}
	}
	passes := 1 + min(max(1, driverCostOps/max(len(ops.Ops), 1)), driverCostPasses)
	var best ReplayResult
	for pass := range passes {
		r.noGC = pass > 0
		res, err := r.run(ops, ReplayOptions{})
		if err != nil {
			return res, fmt.Errorf("replay driver: %w", err)
		}
		if pass == 1 || (pass > 1 && res.Elapsed < best.Elapsed) {
			best = res
		}
	}
	return best, nil
}

// DriverCost times about driverCostOps operations, in at most
// driverCostPasses passes after the untimed one.
const (
	driverCostOps    = 1_000_000
	driverCostPasses = 100
)

// ReplayWarm replays ops twice on a, on the same streams, and returns the
// second pass, as PyTorch's anchor measures replay_warm: after the first
// pass, whatever it left live is freed (FreeLive), so that the second
// pass starts with the cache the first one filled, and only the second
// pass is timed. opt applies to both passes; streams that ReplayWarm
// creates (opt.Streams nil) are destroyed at the end. The result's
// counters (DeviceMallocs, DeviceMallocTime, DeviceFrees, AllocRetries,
// OOMs, the reclaims) are the second pass's alone: a cache that the first
// pass filled makes no device malloc in the second. Its peaks are the
// allocator's over both passes. In a CPU profile the passes carry the
// label pass=first or pass=second, beside opt.Ctx's labels.
func ReplayWarm(ops *trace.Ops, a *allocator.Allocator, opt ReplayOptions) (ReplayResult, error) {
	if opt.Streams == nil {
		opt.Streams = map[uint64]cudart.Stream{}
		defer func() {
			for ts, s := range opt.Streams {
				if ts != 0 {
					_ = a.Device().StreamDestroy(s)
				}
			}
		}()
	}
	ctx := opt.Ctx
	if ctx == nil {
		ctx = context.Background()
	}
	var err error
	pprof.Do(ctx, pprof.Labels("pass", "first"), func(context.Context) { _, err = Replay(ops, a, opt) })
	if err != nil {
		return ReplayResult{}, fmt.Errorf("warm replay, first pass: %w", err)
	}
	if err := FreeLive(a); err != nil {
		return ReplayResult{}, fmt.Errorf("warm replay, freeing what the first pass left: %w", err)
	}
	before := a.Stats()
	var res ReplayResult
	pprof.Do(ctx, pprof.Labels("pass", "second"), func(context.Context) { res, err = Replay(ops, a, opt) })
	if err != nil {
		return res, fmt.Errorf("warm replay, second pass: %w", err)
	}
	res.DeviceMallocs -= before.NumDeviceAlloc
	res.DeviceMallocTime -= time.Duration(before.DeviceMallocLatency.Sum * float64(time.Second))
	res.DeviceFrees -= before.NumDeviceFree
	res.AllocRetries -= before.NumAllocRetries
	res.OOMs -= before.NumOOMs
	res.Reclaims -= before.NumReclaims
	res.Lends -= before.NumLends
	res.SmallFromLarge -= before.NumSmallFromLarge
	res.PagesMoved -= before.NumPagesMoved
	res.PagesMovedAcrossStreams -= before.NumPagesMovedAcrossStreams
	res.VMM = res.VMM.Sub(before.VMM)
	return res, nil
}
