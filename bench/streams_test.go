package bench

import (
	"testing"
	"time"

	"github.com/allocd/allocd/trace"
	"github.com/allocd/allocd/workload"
)

// manyStreamOps is a trace over n streams, each used for a moment as a
// server's per-request stream is: two allocations (one small-pool, one
// large-pool), freed while the next stream starts, and a default-stream
// allocation kept live across the whole trace.
func manyStreamOps(n int) *trace.Ops {
	ops := &trace.Ops{}
	id := int32(0)
	alloc := func(size, stream uint64) int32 {
		ops.Ops = append(ops.Ops, trace.Op{Kind: trace.OpAlloc, ID: id, Size: size, Stream: stream})
		id++
		return id - 1
	}
	free := func(i int32, stream uint64) {
		ops.Ops = append(ops.Ops, trace.Op{Kind: trace.OpFree, ID: i, Stream: stream})
	}
	keep := alloc(64<<20, 0)
	ops.Streams = append(ops.Streams, 0)
	var prev [2]int32
	var prevStream uint64
	for i := range n {
		s := uint64(0x7f0000001000 + 0x100*i)
		ops.Streams = append(ops.Streams, s)
		a := alloc(uint64(4096*(1+i%7)), s)
		b := alloc(uint64(3<<20+512*(i%5)), s)
		if i > 0 {
			free(prev[0], prevStream)
			free(prev[1], prevStream)
		}
		prev, prevStream = [2]int32{a, b}, s
	}
	free(prev[0], prevStream)
	free(prev[1], prevStream)
	free(keep, 0)
	ops.NumIDs = int(id)
	return ops
}

// TestReplayManyStreams replays a trace of 20,000 streams, each used
// briefly, in under 5 s (it took 135 s when every stream ever seen kept
// its shard and every slow path walked them all), in both segment
// sources, and checks the allocator's invariants after. Under the race
// detector the bound is raceSlowdown times longer.
func TestReplayManyStreams(t *testing.T) {
	ops := manyStreamOps(20000)
	for _, conf := range []string{"", "expandable_segments:True"} {
		t.Run(conf, func(t *testing.T) {
			a := newSimAllocator(t, conf, false)
			t0 := time.Now()
			r, err := workload.Replay(ops, a, workload.ReplayOptions{})
			d := time.Since(t0)
			if err != nil {
				t.Fatal(err)
			}
			if limit := raceSlowdown * 5 * time.Second; d > limit {
				t.Errorf("replay of %d streams took %v, want under %v", len(ops.Streams), d, limit)
			}
			if r.FailedAllocs != 0 || r.OOMs != 0 {
				t.Errorf("%d failed allocations, %d OOMs", r.FailedAllocs, r.OOMs)
			}
			if err := a.Check(); err != nil {
				t.Error(err)
			}
			if got := a.MemoryAllocated(); got != 0 {
				t.Errorf("%d bytes allocated after the replay", got)
			}
		})
	}
}
