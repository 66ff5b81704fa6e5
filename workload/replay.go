package workload

import (
	"context"
	"errors"
	"fmt"
	"runtime"
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
	res.PagesMoved = st.NumPagesMoved
	res.PagesMovedAcrossStreams = st.NumPagesMovedAcrossStreams
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
// side[id] the side stream holding a deferred free.
func (r *replayer) run(ops *trace.Ops, opt ReplayOptions) (ReplayResult, error) {
	var res ReplayResult
	ptr := make([]cudart.Ptr, ops.NumIDs)
	failed := make([]bool, ops.NumIDs)
	var side map[int32]cudart.Stream
	useEvents := r.sim != nil && r.sim.ManualEvents()
	if useEvents {
		side = make(map[int32]cudart.Stream)
	}
	// A trace's few streams are found by a linear search, faster than the
	// map, which serves traces of many streams.
	streamOf := make([]cudart.Stream, 0, 4)
	keyOf := make([]uint64, 0, 4)
	lookup := func(s uint64) cudart.Stream {
		for i, k := range keyOf {
			if k == s {
				return streamOf[i]
			}
		}
		ds := r.streams[s]
		if len(keyOf) < 8 {
			keyOf, streamOf = append(keyOf, s), append(streamOf, ds)
		}
		return ds
	}
	n := len(ops.Ops)
	if opt.Stop > 0 && opt.Stop < n {
		n = opt.Stop
	}
	// Collect the garbage of loading the trace now, so that no collection
	// of it runs inside the timed loop (the C++ side has none to run).
	runtime.GC()
	t0 := time.Now()
	for i := range n {
		if opt.Ctx != nil && i%4096 == 0 {
			if err := opt.Ctx.Err(); err != nil {
				res.Elapsed = time.Since(t0)
				return res, fmt.Errorf("replay: stopped at operation %d: %w", i, err)
			}
		}
		op := &ops.Ops[i]
		if op.Kind != trace.OpFreeCompleted {
			res.Ops++
		}
		switch op.Kind {
		case trace.OpAlloc:
			p, err := r.a.Malloc(op.Size, lookup(op.Stream))
			if err != nil {
				if !errors.Is(err, allocator.ErrOutOfMemory) {
					return res, fmt.Errorf("replay: operation %d: %w", i, err)
				}
				failed[op.ID] = true
				res.FailedAllocs++
				break
			}
			ptr[op.ID] = p
		case trace.OpFree:
			if failed[op.ID] {
				break
			}
			if op.Deferred {
				if !useEvents {
					break // freed at its OpFreeCompleted
				}
				s, err := r.sideStream()
				if err != nil {
					return res, err
				}
				if err := r.a.RecordStream(ptr[op.ID], s); err != nil {
					return res, fmt.Errorf("replay: operation %d: %w", i, err)
				}
				side[op.ID] = s
			}
			if err := r.a.Free(ptr[op.ID]); err != nil {
				return res, fmt.Errorf("replay: operation %d: %w", i, err)
			}
		case trace.OpFreeCompleted:
			if failed[op.ID] {
				break
			}
			if !useEvents {
				if err := r.a.Free(ptr[op.ID]); err != nil {
					return res, fmt.Errorf("replay: operation %d: %w", i, err)
				}
				break
			}
			if s, ok := side[op.ID]; ok {
				r.sim.CompleteStream(s)
				delete(side, op.ID)
				r.side = append(r.side, s)
			}
		}
		if opt.Observe != nil {
			opt.Observe(i)
		}
		if opt.Progress != nil && opt.ProgressEvery > 0 && (i+1)%opt.ProgressEvery == 0 {
			opt.Progress(i + 1)
		}
	}
	res.Elapsed = time.Since(t0)
	return res, nil
}
