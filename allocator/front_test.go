package allocator

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestFrontCacheMatchesPyTorch drives two allocators with the same calls,
// one with the front cache and one freeing straight into the index as
// PyTorch does, and requires the same address from every Malloc, the
// same statistics and the same snapshot. Sizes repeat often, so that
// parked blocks are taken back, and vary enough to be refused and
// flushed.
func TestFrontCacheMatchesPyTorch(t *testing.T) {
	for _, conf := range []string{"", "max_split_size_mb:20", "roundup_power2_divisions:4", "expandable_segments:True"} {
		t.Run("conf="+conf, func(t *testing.T) {
			front, sim1 := newTestAllocator(t, 2*giB, conf)
			plain, sim2 := newTestAllocator(t, 2*giB, conf)
			var streams [2][]cudart.Stream
			for i, sim := range []*simdev.Sim{sim1, sim2} {
				streams[i] = []cudart.Stream{cudart.DefaultStream}
				s, err := sim.StreamCreate()
				if err != nil {
					t.Fatal(err)
				}
				streams[i] = append(streams[i], s)
			}
			plain.lockWorld()
			plain.noPark = true // the shards made later too (addShard)
			for _, sh := range plain.shards {
				sh.noPark = true
			}
			plain.unlockWorld()
			sizes := []uint64{512, 4096, 4096, 1 << 20, 3 << 20, 8 << 20, 25 << 20, 700, 4096 + 512}
			var live [][2]cudart.Ptr
			x := uint64(99)
			taken := 0
			for i := range 20000 {
				x ^= x << 13
				x ^= x >> 7
				x ^= x << 17
				if len(live) > 0 && (x%2 == 0 || len(live) > 40) {
					j := int(x>>8) % len(live)
					if err := front.Free(live[j][0]); err != nil {
						t.Fatal(err)
					}
					if err := plain.Free(live[j][1]); err != nil {
						t.Fatal(err)
					}
					live[j] = live[len(live)-1]
					live = live[:len(live)-1]
				} else {
					size := sizes[(x>>16)%uint64(len(sizes))]
					si := (x >> 32) % 2
					var parked cudart.Ptr
					if sh := front.lookupShard(streams[0][si]); sh != nil && sh.parked != nil {
						parked = cudart.Ptr(sh.parked.Ptr)
					}
					p, err1 := front.Malloc(size, streams[0][si])
					if parked != 0 && p == parked {
						taken++
					}
					q, err2 := plain.Malloc(size, streams[1][si])
					if (err1 == nil) != (err2 == nil) || (err1 != nil && !errors.Is(err1, ErrOutOfMemory)) {
						t.Fatalf("step %d: errors %v and %v", i, err1, err2)
					}
					if p != q {
						t.Fatalf("step %d: Malloc(%d) on stream %d: %#x with the front cache, %#x without", i, size, si, uint64(p), uint64(q))
					}
					if err1 == nil {
						live = append(live, [2]cudart.Ptr{p, q})
					}
				}
				if i%997 == 0 {
					compareAllocators(t, i, front, plain)
				}
			}
			compareAllocators(t, -1, front, plain)
			plain.lockWorld()
			for _, sh := range plain.shards {
				if !sh.noPark {
					t.Errorf("the baseline's shard of stream %#x parks blocks", uint64(sh.stream))
				}
			}
			plain.unlockWorld()
			t.Logf("%d parked blocks taken back", taken)
			if taken == 0 {
				t.Error("no parked block was ever taken back")
			}
			for _, l := range live {
				_ = front.Free(l[0])
				_ = plain.Free(l[1])
			}
		})
	}
}

func compareAllocators(t *testing.T, step int, a, b *Allocator) {
	t.Helper()
	sa, sb := a.Stats(), b.Stats()
	sa.DeviceMallocLatency, sb.DeviceMallocLatency = Histogram{}, Histogram{}
	sa.VMM, sb.VMM = sa.VMM.Counts(), sb.VMM.Counts()
	// How the caps' slack moved between streams is no policy: a parked
	// block's free settles its statistics at another moment.
	sa.NumCapBorrows, sb.NumCapBorrows, sa.NumCapSteals, sb.NumCapSteals = 0, 0, 0, 0
	if sa != sb {
		fa, fb := sa.Flat(), sb.Flat()
		for k, v := range fa {
			if fb[k] != v {
				t.Errorf("step %d: %s is %d with the front cache, %d without", step, k, v, fb[k])
			}
		}
		t.FailNow()
	}
	ja, _ := json.Marshal(a.Snapshot().Segments)
	jb, _ := json.Marshal(b.Snapshot().Segments)
	if string(ja) != string(jb) {
		t.Fatalf("step %d: snapshots differ", step)
	}
}
