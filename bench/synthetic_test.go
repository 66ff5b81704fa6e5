package bench

import (
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/trace"
	"github.com/allocd/allocd/workload"
)

// syntheticShape is a kind of workload the recorded traces stand for,
// generated at random sizes so that a policy is checked beyond the traces
// it was measured on.
type syntheticShape int

const (
	// shapeTraining loads weights, then runs steps whose activations are
	// freed in reverse order, with short-lived temporaries among them.
	shapeTraining syntheticShape = iota
	// shapeDecoder keeps one cache per layer and, at every token,
	// allocates each cache again larger and frees the old one (as
	// torch.cat grows a key-value cache), beside a temporary.
	shapeDecoder
	// shapeTwoStreams computes on one stream while a second prefetches
	// double-buffered batches.
	shapeTwoStreams
)

func (s syntheticShape) String() string {
	return [...]string{"training", "decoder", "two streams"}[s]
}

// syntheticOps generates a workload of shape from seed: its sizes, counts
// and footprint (about 0.3 to 9 GiB) are drawn from a SplitMix64.
func syntheticOps(shape syntheticShape, seed uint64) *trace.Ops {
	r := workload.NewSplitMix64(seed)
	rnd := func(n uint64) uint64 { return r.Next() % n }
	ops := &trace.Ops{Streams: []uint64{0}}
	var id int32
	alloc := func(size, stream uint64) int32 {
		ops.Ops = append(ops.Ops, trace.Op{Kind: trace.OpAlloc, ID: id, Size: size, Stream: stream})
		id++
		return id - 1
	}
	free := func(i int32) { ops.Ops = append(ops.Ops, trace.Op{Kind: trace.OpFree, ID: i}) }
	const mb = 1 << 20
	scale := 1 + rnd(8)
	switch shape {
	case shapeTraining:
		for range 50 + rnd(300) {
			alloc((1+rnd(16*scale))*mb/2+rnd(mb), 0)
		}
		for range 5 + rnd(10) {
			var act []int32
			for range 20 + rnd(80) {
				act = append(act, alloc((1+rnd(32*scale))*mb/4+rnd(mb), 0))
				if rnd(4) == 0 {
					free(alloc(1+rnd(8*mb), 0))
				}
			}
			for i := len(act) - 1; i >= 0; i-- {
				free(act[i])
				if rnd(3) == 0 {
					free(alloc((1+rnd(16*scale))*mb/4, 0))
				}
			}
		}
	case shapeDecoder:
		layers := 4 + rnd(24)
		for range layers * 4 {
			alloc((1+rnd(8*scale))*mb, 0)
		}
		for range 2 + rnd(6) {
			cache := make([]int32, layers)
			size := (1 + rnd(4)) * mb / 4
			for l := range cache {
				cache[l] = alloc(size, 0)
			}
			for range 20 + rnd(60) {
				size += (1 + rnd(4)) * mb / 16 * scale
				for l := range cache {
					grown, tmp := alloc(size, 0), alloc(1+rnd(2*mb), 0)
					free(cache[l])
					free(tmp)
					cache[l] = grown
				}
			}
			for _, c := range cache {
				free(c)
			}
		}
	case shapeTwoStreams:
		ops.Streams = []uint64{1, 2}
		for range 50 + rnd(200) {
			alloc((1+rnd(16*scale))*mb/2, 1)
		}
		prev := int32(-1)
		for range 10 + rnd(20) {
			batch := alloc((4+rnd(12))*mb*scale/2, 2)
			if prev >= 0 {
				free(prev)
			}
			var act []int32
			for range 10 + rnd(40) {
				act = append(act, alloc((1+rnd(32*scale))*mb/4, 1))
			}
			for i := len(act) - 1; i >= 0; i-- {
				free(act[i])
			}
			prev = batch
		}
	}
	ops.NumIDs = int(id)
	return ops
}

// TestSyntheticExpandable replays random workloads of each syntheticShape
// (forty each, twelve with -short), three passes on one allocator, with
// expandable_segments:True and with PyTorch's expandable growth
// (WithPyTorchExpandable), and checks what the default policy promises
// beyond the recorded traces: the invariants after every pass, and a peak
// reserved at most the larger of PyTorch's and allocd's own bound above
// allocated memory (the slack and the headroom, here 1/32 and 1/128 of the
// peak allocated figure; the policy counts its headroom from the larger
// peak reserved). Where PyTorch's 20 MiB pages happen to fit tighter than
// that bound, allocd may end a little above PyTorch. On the training and
// two-stream shapes reserved stays within 5% of allocated. It logs each shape's worst and mean ratios and
// both sides' modelled calls, and expandable_reclaim:coarse's worst ratio,
// peaks above PyTorch's and calls (docs/fragmentation.md has the figures): a
// decoder that grows its caches fast passes 1.05 and costs several times
// PyTorch's calls, which no assertion here hides.
func TestSyntheticExpandable(t *testing.T) {
	seeds := uint64(40)
	if testing.Short() {
		seeds = 12
	}
	for _, shape := range []syntheticShape{shapeTraining, shapeDecoder, shapeTwoStreams} {
		t.Run(shape.String(), func(t *testing.T) {
			var worst, sum, ptWorst, calls, ptCalls, coWorst, coCalls float64
			above, coAbove := 0, 0
			for seed := uint64(1); seed <= seeds; seed++ {
				ops := syntheticOps(shape, seed*7919+uint64(shape))
				ours := replayPasses(t, ops, 3, "expandable_segments:True")
				pt := replayPasses(t, ops, 3, "expandable_segments:True", allocator.WithPyTorchExpandable())
				co := replayPasses(t, ops, 3, "expandable_segments:True,expandable_reclaim:coarse")
				ratio := float64(ours.reserved) / float64(ours.allocated)
				worst, sum = max(worst, ratio), sum+ratio
				ptWorst = max(ptWorst, float64(pt.reserved)/float64(pt.allocated))
				calls, ptCalls = calls+ours.calls(), ptCalls+pt.calls()
				if ours.reserved > pt.reserved {
					above++
				}
				coWorst, coCalls = max(coWorst, float64(co.reserved)/float64(co.allocated)), coCalls+co.calls()
				if co.reserved > pt.reserved {
					coAbove++
				}
				bound := max(pt.reserved, ours.allocated+ours.allocated/32+ours.allocated/128)
				if ours.reserved > bound {
					t.Errorf("seed %d: peak reserved %d bytes, above both PyTorch's %d and allocated %d plus the slack and the headroom",
						seed, ours.reserved, pt.reserved, ours.allocated)
				}
				if shape != shapeDecoder && ratio > 1.05 {
					t.Errorf("seed %d: peak reserved %d bytes is %.3f times peak allocated, above 1.05", seed, ours.reserved, ratio)
				}
			}
			t.Logf("%-11s %d workloads: reserved/allocated worst %.3f, mean %.3f (PyTorch's worst %.3f); peak above PyTorch's on %d; modelled calls %.0f ms (PyTorch %.0f); coarse: worst %.3f, above PyTorch's on %d, calls %.0f ms",
				shape, seeds, worst, sum/float64(seeds), ptWorst, above, calls, ptCalls, coWorst, coAbove, coCalls)
		})
	}
}
