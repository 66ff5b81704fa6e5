package allocator_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestHotSmallFromLargeRandom drives two allocators with expandable
// segments in lockstep through random mallocs and frees on three streams,
// one taking small requests at the limit from the large pool on the hot
// path and one in world mode only (allocator.WithoutHotSmallFromLarge),
// with streams taking turns at being the only one in use (the sole shard
// that keeps the peaks itself) and being used together: every Malloc must
// get the same address from both, and after each phase both must pass
// Check and agree on the statistics but the counts of how the hot path
// kept its caps. The recorded traces (TestHotSmallFromLargeReplays) run
// one or two streams; this reaches the hot path's other bound of the
// allocated bytes, and a stream that asks while another keeps the peaks.
func TestHotSmallFromLargeRandom(t *testing.T) {
	seeds := uint64(12)
	if testing.Short() {
		seeds = 4
	}
	hot := 0
	for seed := range seeds {
		rng := rand.New(rand.NewPCG(seed, 0x5eed))
		var as [2]*allocator.Allocator
		var streams [2][3]cudart.Stream
		for i, opts := range [][]allocator.Option{nil, {allocator.WithoutHotSmallFromLarge}} {
			var sim *simdev.Sim
			as[i], sim = newReplayAllocator(t, "expandable_segments:True", nil, opts...)
			streams[i][0] = cudart.DefaultStream
			for s := 1; s < 3; s++ {
				var err error
				if streams[i][s], err = sim.StreamCreate(); err != nil {
					t.Fatal(err)
				}
			}
		}
		type live struct {
			p      [2]cudart.Ptr
			stream int
		}
		var lives []live
		for phase := range 40 {
			// Even phases use one stream, odd ones all three.
			active := []int{rng.IntN(3)}
			if phase%2 == 1 {
				active = []int{0, 1, 2}
			}
			for range 200 + rng.IntN(400) {
				if len(lives) > 0 && (rng.IntN(100) < 45 || len(lives) > 300) {
					k := rng.IntN(len(lives))
					for i, a := range as {
						if err := a.Free(lives[k].p[i]); err != nil {
							t.Fatalf("seed %d: %v", seed, err)
						}
					}
					lives[k] = lives[len(lives)-1]
					lives = lives[:len(lives)-1]
					continue
				}
				size := uint64(1+rng.IntN(1<<20)) &^ 511
				if rng.IntN(100) < 35 {
					size = uint64(1+rng.IntN(48)) << 20 / uint64(1+rng.IntN(4))
				}
				s := active[rng.IntN(len(active))]
				var l live
				l.stream = s
				for i, a := range as {
					p, err := a.Malloc(size, streams[i][s])
					if err != nil && !errors.Is(err, allocator.ErrOutOfMemory) {
						t.Fatalf("seed %d: %v", seed, err)
					}
					l.p[i] = p
				}
				if l.p[0] != l.p[1] {
					t.Fatalf("seed %d, phase %d: Malloc(%d) on stream %d gave %#x on the hot path, %#x in world mode",
						seed, phase, size, s, uint64(l.p[0]), uint64(l.p[1]))
				}
				if l.p[0] != 0 {
					lives = append(lives, l)
				}
			}
			if phase%2 == 0 { // free the other streams' blocks, so that one stream alone is in use
				kept := lives[:0]
				for _, l := range lives {
					if l.stream == active[0] {
						kept = append(kept, l)
						continue
					}
					for i, a := range as {
						if err := a.Free(l.p[i]); err != nil {
							t.Fatal(err)
						}
					}
				}
				lives = kept
			}
			for i, a := range as {
				if err := a.Check(); err != nil {
					t.Fatalf("seed %d, phase %d, allocator %d: %v", seed, phase, i, err)
				}
			}
			if !sameStats(t, as[0].Stats(), as[1].Stats(), ignoreCapCounts, "on the hot path", "in world mode") {
				t.Fatalf("seed %d, phase %d: the statistics differ", seed, phase)
			}
		}
		hot += int(as[0].Stats().NumSmallFromLarge)
	}
	if hot == 0 {
		t.Error("no small request was served from the large pool: the test reached nothing it is for")
	}
	t.Logf("%d small requests served from the large pool", hot)
}
