package allocator

import (
	"errors"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"
	"weak"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// heapInUse is the Go heap in use after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

// liveShards is the number of shards, read in world mode.
func liveShards(a *Allocator) int {
	a.lockWorld()
	defer a.unlockWorld()
	return len(a.shards)
}

// TestStreamCyclesReclaim creates a stream, allocates and frees on it and
// destroys it, 10,000 times: with ReleaseStream after each destroy (a
// program that tells the allocator), and without (liballocd, which is not
// told). Nothing is live at the end, so the Go heap and the number of
// shards stay flat, and the default stream's slow paths (EmptyCache, a
// Malloc that grows a segment) visit as few shards as before the cycles.
func TestStreamCyclesReclaim(t *testing.T) {
	const cycles = 10000
	for _, tc := range []struct {
		name, conf string
		release    bool
	}{
		{"release", "", true},
		{"idle", "", false},
		{"release-expandable", "expandable_segments:True", true},
		{"idle-expandable", "expandable_segments:True", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, sim := newTestAllocator(t, 80*giB, tc.conf)
			cycle := func() {
				s, err := sim.StreamCreate()
				if err != nil {
					t.Fatal(err)
				}
				p := mustMalloc(t, a, 3*miB, s)
				q := mustMalloc(t, a, 4*kiB, s)
				mustFree(t, a, p)
				mustFree(t, a, q)
				if err := sim.StreamDestroy(s); err != nil {
					t.Fatal(err)
				}
				if tc.release {
					if err := a.ReleaseStream(s); err != nil {
						t.Fatal(err)
					}
				}
			}
			for range 100 { // warm up the pools of the runtime
				cycle()
			}
			before := heapInUse()
			for i := range cycles {
				cycle()
				if i%1000 == 0 {
					if err := a.Check(); err != nil {
						t.Fatalf("cycle %d: %v", i, err)
					}
				}
			}
			after := heapInUse()
			if after > before+16<<20 {
				t.Errorf("Go heap in use grew from %d to %d bytes over %d cycles with nothing live", before, after, cycles)
			}
			n := liveShards(a)
			limit := 1
			if !tc.release {
				limit = 4 * idleSweepMin
			}
			if n > limit {
				t.Errorf("%d shards after %d cycles with nothing live, want at most %d", n, cycles, limit)
			}
			if err := a.EmptyCache(); err != nil {
				t.Fatal(err)
			}
			if n := liveShards(a); n != 1 {
				t.Errorf("%d shards after EmptyCache with nothing live, want 1 (the default stream's)", n)
			}
			if n := a.dir.Load().n; n != 0 {
				t.Errorf("%d directory entries after EmptyCache with nothing live", n)
			}
			// The default stream's slow paths now visit one shard; the time
			// bound is a backstop (10,000 of these took 11 s with a shard
			// per stream ever seen).
			t0 := time.Now()
			for range cycles {
				p := mustMalloc(t, a, 3*miB, cudart.DefaultStream)
				mustFree(t, a, p)
				if err := a.EmptyCache(); err != nil {
					t.Fatal(err)
				}
			}
			if d := time.Since(t0); d > raceSlowdown*5*time.Second {
				t.Errorf("%d malloc/free/empty_cache on the default stream took %v", cycles, d)
			}
			if n := liveShards(a); n != 1 {
				t.Errorf("%d shards after the default stream's work, want 1", n)
			}
		})
	}
}

// TestReleaseStreamLive: a stream released with a live block or a pending
// event keeps its shard until the block is freed and the event has
// completed; then its shard and segments go at once.
func TestReleaseStreamLive(t *testing.T) {
	a, sim := newTestAllocator(t, 8*giB, "", simdev.Config{ManualEvents: true})
	s, _ := sim.StreamCreate()
	side, _ := sim.StreamCreate()
	p := mustMalloc(t, a, 3*miB, s)
	q := mustMalloc(t, a, 1*miB, s)
	if err := a.RecordStream(q, side); err != nil {
		t.Fatal(err)
	}
	if err := a.ReleaseStream(s); err != nil {
		t.Fatal(err)
	}
	if n := liveShards(a); n != 3 {
		t.Fatalf("%d shards, want 3 (default, s with live blocks, side)", n)
	}
	a.lockWorld()
	gone := weak.Make(a.byStream[s])
	a.unlockWorld()
	mustFree(t, a, p)
	mustFree(t, a, q) // pending on side's event
	if n := liveShards(a); n != 3 {
		t.Fatalf("%d shards while q waits for an event, want 3", n)
	}
	sim.CompleteStream(side)
	// Any call in world mode retires the event and releases s.
	if _, err := a.Malloc(512, cudart.DefaultStream); err != nil {
		t.Fatal(err)
	}
	if n := liveShards(a); n != 2 {
		t.Fatalf("%d shards after s's last block went back, want 2", n)
	}
	for _, seg := range a.Snapshot().Segments {
		if seg.Stream == uint64(s) {
			t.Errorf("segment %#x of released stream %#x still held", seg.Address, uint64(s))
		}
	}
	runtime.GC()
	if gone.Value() != nil {
		t.Error("the released shard is still reachable")
	}
	// A Malloc on a released stream starts it again.
	r := mustMalloc(t, a, 1*miB, s)
	mustFree(t, a, r)
	if err := a.ReleaseStream(cudart.DefaultStream); err != nil {
		t.Fatal(err) // a no-op: the default stream is never released
	}
	if err := a.ReleaseStream(0x1234); err != nil {
		t.Fatal(err) // a stream the allocator never saw: nothing to do
	}
}

// TestMaxStreams: a new stream beyond the limit fails with ErrTooManyStreams
// and changes nothing; an idle stream makes room.
func TestMaxStreams(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 8 * giB})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	a, err := New(sim, DefaultConfig(), WithMaxStreams(4))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	var live []cudart.Ptr
	for range 3 {
		s, _ := sim.StreamCreate()
		live = append(live, mustMalloc(t, a, 1*miB, s))
	}
	s, _ := sim.StreamCreate()
	before := a.Stats()
	if _, err := a.Malloc(1*miB, s); !errors.Is(err, ErrTooManyStreams) {
		t.Fatalf("Malloc on a fifth stream: %v, want ErrTooManyStreams", err)
	}
	if after := a.Stats(); liveShards(a) != 4 || after.NumDeviceAlloc != before.NumDeviceAlloc || after.NumDeviceFree != before.NumDeviceFree {
		t.Errorf("the refused Malloc changed the allocator: %d shards, device mallocs %d→%d, frees %d→%d",
			liveShards(a), before.NumDeviceAlloc, after.NumDeviceAlloc, before.NumDeviceFree, after.NumDeviceFree)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, live[0])
	p := mustMalloc(t, a, 1*miB, s) // the idle stream's shard makes room
	mustFree(t, a, p)
	for _, p := range live[1:] {
		mustFree(t, a, p)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	if _, err := New(sim, DefaultConfig(), WithMaxStreams(0)); err == nil {
		t.Error("WithMaxStreams(0) accepted")
	}
}

// TestStreamsConcurrent creates, uses, destroys and releases streams on
// some goroutines while others allocate on their own streams and on the
// default stream, with Check and EmptyCache between (run with -race).
func TestStreamsConcurrent(t *testing.T) {
	for _, conf := range []string{"", "expandable_segments:True"} {
		t.Run(conf, func(t *testing.T) {
			a, sim := newTestAllocator(t, 80*giB, conf)
			var wg sync.WaitGroup
			errc := make(chan error, 16)
			for g := range 6 {
				wg.Go(func() {
					var s cudart.Stream
					if g%2 == 1 {
						var err error
						if s, err = sim.StreamCreate(); err != nil {
							errc <- err
							return
						}
					}
					for i := range 300 {
						churn := g < 3
						if churn {
							var err error
							if s, err = sim.StreamCreate(); err != nil {
								errc <- err
								return
							}
						}
						var ps []cudart.Ptr
						for k := range 4 {
							p, err := a.Malloc(uint64(512<<(2*k+i%3)), s)
							if err != nil {
								errc <- err
								return
							}
							ps = append(ps, p)
						}
						for _, p := range ps {
							if err := a.Free(p); err != nil {
								errc <- err
								return
							}
						}
						if churn {
							_ = sim.StreamDestroy(s)
							if i%2 == 0 {
								if err := a.ReleaseStream(s); err != nil {
									errc <- err
									return
								}
							}
						}
						if g == 5 && i%50 == 0 {
							if err := a.EmptyCache(); err != nil {
								errc <- err
								return
							}
							if err := a.Check(); err != nil {
								errc <- err
								return
							}
						}
					}
				})
			}
			wg.Wait()
			close(errc)
			for err := range errc {
				t.Error(err)
			}
			if err := a.EmptyCache(); err != nil {
				t.Fatal(err)
			}
			if n := liveShards(a); n > 4 {
				t.Errorf("%d shards after EmptyCache with nothing live, want at most 4", n)
			}
		})
	}
}

// TestStreamPoolsKeepSegments: a program with idleSweepMin streams
// besides the default one keeps PyTorch's device mallocs and frees: no
// sweep ever releases a cached segment, across EmptyCache calls too, even
// of a stream left unused for many rounds. A program that uses a larger
// pool of streams in turn loses cached segments to sweeps only in its
// first rounds: the sweep period grows to hold its pool.
func TestStreamPoolsKeepSegments(t *testing.T) {
	for _, tc := range []struct {
		streams, settled int // no device frees from round settled on
	}{
		{idleSweepMin, 0},
		{2*idleSweepMin + 8, 3},
		{200, 4},
	} {
		t.Run(strconv.Itoa(tc.streams), func(t *testing.T) {
			a, sim := newTestAllocator(t, 80*giB, "")
			var streams []cudart.Stream
			for range tc.streams {
				s, err := sim.StreamCreate()
				if err != nil {
					t.Fatal(err)
				}
				streams = append(streams, s)
			}
			for round := range 16 {
				before := a.Stats()
				for i, s := range streams {
					if i == 0 && tc.streams == idleSweepMin && round%4 != 0 {
						continue // left unused most rounds, its segment cached
					}
					mustFree(t, a, mustMalloc(t, a, 3*miB, s))
				}
				if n := a.Stats().NumDeviceFree - before.NumDeviceFree; round >= tc.settled && n != 0 {
					t.Fatalf("round %d: %d device frees without EmptyCache or OOM", round, n)
				}
				if tc.streams == idleSweepMin && round%3 == 2 {
					if err := a.EmptyCache(); err != nil {
						t.Fatal(err)
					}
				}
			}
		})
	}
}

// TestReleasedShardGatesClosed: a shard that ReleaseStream drops has its
// hot-path gates closed, so that a Malloc or Free that looked it up just
// before the drop goes to world mode instead of using it.
func TestReleasedShardGatesClosed(t *testing.T) {
	a, sim := newTestAllocator(t, 1<<30, "")
	s, err := sim.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, mustMalloc(t, a, 4096, s))
	sh := a.lookupShard(s)
	if sh == nil || sh.mallocMax == 0 || sh.freeOff {
		t.Fatalf("live shard's gates closed or shard missing: %v", sh)
	}
	if err := a.ReleaseStream(s); err != nil {
		t.Fatal(err)
	}
	if !sh.released {
		t.Fatal("an idle stream's shard was not dropped")
	}
	if sh.mallocMax != 0 || !sh.freeOff {
		t.Errorf("dropped shard's gates open: mallocMax %d, freeOff %v", sh.mallocMax, sh.freeOff)
	}
	mustCheck(t, a)
}
