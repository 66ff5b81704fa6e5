package allocator_test

import (
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/trace"
	"github.com/allocd/allocd/workload"
)

// TestFrontCacheReplays replays every recorded trace twice on one
// allocator (a cold pass and a warm one, on the same streams), with and
// without the front cache (allocator.WithoutParking), in lockstep, in the default
// configuration and with expandable segments as allocd reclaims them
// (fine and coarse) and as PyTorch grows them: the two allocators must
// give the same address to every allocation, make the same device calls
// and end with the same statistics and segments. The front cache changes
// how fast a free reaches the free index, never where anything goes.
func TestFrontCacheReplays(t *testing.T) {
	lockstepReplays(t, "the front cache", allocator.WithoutParking, []replayConf{
		{"default", "", nil},
		{"expandable", "expandable_segments:True", nil},
		{"coarse", "expandable_segments:True,expandable_reclaim:coarse", nil},
		{"pytorch-expandable", "expandable_segments:True", []allocator.Option{allocator.WithPyTorchExpandable()}},
	}, nil)
}

// TestHotSmallFromLargeReplays replays every recorded trace as
// TestFrontCacheReplays does, with expandable segments as allocd reclaims
// them, with small requests at the limit served from the large pool on the
// hot path and in world mode only (allocator.WithoutHotSmallFromLarge):
// the same address for every allocation, the same device calls, the same
// statistics (but the counts of how the hot path kept its caps, which
// depend on which calls took world mode) and the same segments. Where the
// hot path cannot be sure of the decision it leaves it to world mode, so
// it changes which path serves a request, never what the request gets.
func TestHotSmallFromLargeReplays(t *testing.T) {
	lockstepReplays(t, "small requests at the limit on the hot path", allocator.WithoutHotSmallFromLarge, []replayConf{
		{"expandable", "expandable_segments:True", nil},
	}, ignoreCapCounts)
}

// replayConf is a configuration lockstepReplays replays in.
type replayConf struct {
	name, conf string
	opts       []allocator.Option
}

// lockstepReplays replays every recorded trace twice on one allocator (a
// cold pass and a warm one, on the same streams) in each configuration,
// on two allocators in lockstep, the second with without added: both
// must give the same address to every allocation, make the same device
// calls and end with the same statistics (after ignore, when not nil,
// clears what may differ) and segments. with names what without takes
// away, for the messages.
func lockstepReplays(t *testing.T, with string, without allocator.Option, confs []replayConf, ignore func(*allocator.Stats)) {
	paths, err := filepath.Glob("../testdata/traces/*.pickle.gz")
	if err != nil || len(paths) == 0 {
		t.Fatalf("no traces in testdata/traces: %v", err)
	}
	for _, path := range paths {
		tr, err := workload.LoadTrace(path)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range confs {
			t.Run(strings.TrimSuffix(tr.Name, ".pickle.gz")+"/"+c.name, func(t *testing.T) {
				var as [2]*allocator.Allocator
				var streams [2]map[uint64]cudart.Stream
				for i, opts := range [][]allocator.Option{c.opts, append(c.opts[:len(c.opts):len(c.opts)], without)} {
					var sim *simdev.Sim
					as[i], sim = newReplayAllocator(t, c.conf, tr.Addresses, opts...)
					streams[i] = map[uint64]cudart.Stream{0: cudart.DefaultStream}
					for _, s := range tr.Ops.Streams {
						if _, ok := streams[i][s]; !ok {
							var err error
							if streams[i][s], err = sim.StreamCreate(); err != nil {
								t.Fatal(err)
							}
						}
					}
				}
				// Both allocators in lockstep, as Replay drives one on a GPU
				// (deferred frees at their completion), twice: a cold pass
				// and, after freeing what it left live, a warm one.
				ptrs := make([][2]cudart.Ptr, tr.Ops.NumIDs)
				for pass := range 2 {
					for i, op := range tr.Ops.Ops {
						switch {
						case op.Kind == trace.OpAlloc:
							for k, a := range as {
								p, err := a.Malloc(op.Size, streams[k][op.Stream])
								if err != nil && !errors.Is(err, allocator.ErrOutOfMemory) {
									t.Fatalf("pass %d, operation %d: %v", pass, i, err)
								}
								ptrs[op.ID][k] = p
							}
							if ptrs[op.ID][0] != ptrs[op.ID][1] {
								t.Fatalf("pass %d, operation %d: Malloc(%d) gave %#x with %s, %#x without",
									pass, i, op.Size, uint64(ptrs[op.ID][0]), with, uint64(ptrs[op.ID][1]))
							}
						case op.Kind == trace.OpFree && !op.Deferred, op.Kind == trace.OpFreeCompleted:
							for k, a := range as {
								if err := a.Free(ptrs[op.ID][k]); err != nil {
									t.Fatalf("pass %d, operation %d: %v", pass, i, err)
								}
								ptrs[op.ID][k] = 0
							}
						}
					}
					for k, a := range as {
						if err := a.Check(); err != nil {
							t.Fatalf("pass %d, allocator %d: %v", pass, k, err)
						}
						if err := workload.FreeLive(a); err != nil {
							t.Fatal(err)
						}
					}
					clear(ptrs)
				}
				sameStats(t, as[0].Stats(), as[1].Stats(), ignore, "with "+with, "without")
				ja, _ := json.Marshal(as[0].Snapshot().Segments)
				jb, _ := json.Marshal(as[1].Snapshot().Segments)
				if string(ja) != string(jb) {
					t.Error("the segments differ")
				}
			})
		}
	}
}

// sameStats reports whether a and b, the statistics of two allocators
// run in lockstep, agree, and fails t naming each flat key that differs
// (aName's figure, then bName's). Latencies and call times never agree
// and are left out; so is what ignore, when not nil, clears.
func sameStats(t *testing.T, a, b allocator.Stats, ignore func(*allocator.Stats), aName, bName string) bool {
	t.Helper()
	for _, s := range []*allocator.Stats{&a, &b} {
		s.DeviceMallocLatency, s.VMM = allocator.Histogram{}, s.VMM.Counts()
		if ignore != nil {
			ignore(s)
		}
	}
	if a == b {
		return true
	}
	fa, fb := a.Flat(), b.Flat()
	for k, v := range fa {
		if fb[k] != v {
			t.Errorf("%s is %d %s, %d %s", k, v, aName, fb[k], bName)
		}
	}
	return false
}

// ignoreCapCounts clears the counts of how the hot path kept its caps
// (escalations, borrows, steals), which depend on which calls took world
// mode, for sameStats.
func ignoreCapCounts(s *allocator.Stats) { s.NumEscalations, s.NumCapBorrows, s.NumCapSteals = 0, 0, 0 }

// replayCapacity is the memory of newReplayAllocator's simulated device.
const replayCapacity = 141 << 30

// newReplayAllocator returns an allocator with configuration conf (ALLOCD_CONF
// grammar) and opts on a simulated device of replayCapacity bytes that hands out the
// segment addresses addrs (a trace's recorded ones, or none), and the
// device; the test's cleanup closes it.
func newReplayAllocator(t *testing.T, conf string, addrs []simdev.Address, opts ...allocator.Option) (*allocator.Allocator, *simdev.Sim) {
	t.Helper()
	sim, err := simdev.New(simdev.Config{Capacity: replayCapacity, Addresses: addrs})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := allocator.ParseConfig(conf)
	if err != nil {
		t.Fatal(err)
	}
	a, err := allocator.New(sim, cfg, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a, sim
}
