package allocator

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// TestConcurrentModel runs goroutines on several streams (two share one)
// in rounds, with OOM, EmptyCache, RecordStream, ResetPeakStats and
// SetMemoryFraction racing with allocation, and at each quiescent point
// between rounds checks the invariants (Check walks shards, directory and
// caps) and the model: live allocations never overlap, allocated bytes are
// what the goroutines hold, the peak is at least that, and reserved bytes
// are what the device holds. Run it with -race.
func TestConcurrentModel(t *testing.T) {
	for _, conf := range []string{"", "expandable_segments:True", "max_split_size_mb:40",
		"garbage_collection_threshold:0.5,per_process_memory_fraction:0.8"} {
		t.Run("conf="+conf, func(t *testing.T) { testConcurrentModel(t, conf) })
	}
}

type modelAlloc struct {
	ptr  cudart.Ptr
	size uint64
}

func testConcurrentModel(t *testing.T, conf string) {
	a, sim := newTestAllocator(t, 512*miB, conf)
	const workers = 5
	streams := []cudart.Stream{cudart.DefaultStream}
	for range 3 {
		s, err := sim.StreamCreate()
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	rounds, ops := 12, 600
	if testing.Short() {
		rounds = 4
	}
	live := make([][]modelAlloc, workers)
	seeds := make([]uint64, workers)
	for w := range seeds {
		seeds[w] = uint64(w)*0x9E3779B97F4A7C15 + 1
	}
	var ooms int64
	for round := range rounds {
		var wg sync.WaitGroup
		errs := make([]error, workers)
		oom := make([]int64, workers)
		for w := range workers {
			wg.Go(func() {
				s := streams[w%len(streams)]
				x := seeds[w]
				for range ops {
					x ^= x << 13
					x ^= x >> 7
					x ^= x << 17
					mine := &live[w]
					switch op := x % 16; {
					case op < 7:
						size := sizeFor(x >> 4)
						if op == 0 && w == 1 {
							size = 300*miB + x%(200*miB) // beyond what the others leave: OOM likely
						}
						p, err := a.Malloc(size, s)
						if errors.Is(err, ErrOutOfMemory) {
							oom[w]++
							continue
						}
						if err != nil {
							errs[w] = fmt.Errorf("malloc %d: %w", size, err)
							return
						}
						*mine = append(*mine, modelAlloc{p, size})
					case op < 13:
						if len(*mine) == 0 {
							continue
						}
						j := int(x>>20) % len(*mine)
						if op == 12 {
							if err := a.RecordStream((*mine)[j].ptr, streams[(w+1)%len(streams)]); err != nil {
								errs[w] = err
								return
							}
						}
						if err := a.Free((*mine)[j].ptr); err != nil {
							errs[w] = fmt.Errorf("free: %w", err)
							return
						}
						(*mine)[j] = (*mine)[len(*mine)-1]
						*mine = (*mine)[:len(*mine)-1]
					case op == 13 && w == 0:
						if err := a.EmptyCache(); err != nil {
							errs[w] = err
							return
						}
					case op == 14 && w == 2:
						a.ResetPeakStats()
					case op == 15 && w == 3:
						_ = a.Stats()
						_ = a.Snapshot()
					}
				}
				seeds[w] = x
			})
		}
		wg.Wait()
		for w, err := range errs {
			if err != nil {
				t.Fatalf("round %d, goroutine %d: %v", round, w, err)
			}
			ooms += oom[w]
		}
		// Quiescent: every structure and every count must agree.
		if err := a.Check(); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		var all []modelAlloc
		for _, l := range live {
			all = append(all, l...)
		}
		sort.Slice(all, func(i, j int) bool { return all[i].ptr < all[j].ptr })
		var requested int64
		for i, m := range all {
			requested += int64(m.size)
			if i > 0 && uint64(all[i-1].ptr)+all[i-1].size > uint64(m.ptr) {
				t.Fatalf("round %d: allocations at %#x (+%d) and %#x overlap", round, uint64(all[i-1].ptr), all[i-1].size, uint64(m.ptr))
			}
		}
		// Blocks freed after RecordStream stay active until their events
		// are waited for; EmptyCache does that.
		if err := a.EmptyCache(); err != nil {
			t.Fatal(err)
		}
		st := a.Stats()
		if got := st.RequestedBytes[PoolAll].Current; got != requested {
			t.Fatalf("round %d: requested_bytes %d, the goroutines hold %d", round, got, requested)
		}
		if got := st.Allocation[PoolAll].Current; got != int64(len(all)) {
			t.Fatalf("round %d: allocation %d, the goroutines hold %d", round, got, len(all))
		}
		for _, arr := range st.namedArrays() {
			for p := range numPools {
				if arr.a[p].Peak < arr.a[p].Current {
					t.Fatalf("round %d: %s.%v peak %d below current %d", round, arr.name, Pool(p), arr.a[p].Peak, arr.a[p].Current)
				}
			}
		}
		if got := uint64(st.ReservedBytes[PoolAll].Current); got != sim.Used() {
			t.Fatalf("round %d: reserved %d, the device holds %d", round, got, sim.Used())
		}
		if round == rounds/2 {
			if err := a.SetMemoryFraction(0.6); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, l := range live {
		for _, m := range l {
			if err := a.Free(m.ptr); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	if ooms == 0 {
		t.Log("no OOM happened")
	}
	if n := a.Stats().NumOOMs; n != ooms {
		t.Errorf("num_ooms %d, the goroutines saw %d", n, ooms)
	}
}

// TestPeaksExactAcrossShards: one goroutine interleaving three streams
// (so every call but the growth runs on a shard's hot path) finds every
// peak equal to the largest current value observed after each call.
func TestPeaksExactAcrossShards(t *testing.T) {
	a, sim := newTestAllocator(t, 4*giB, "")
	streams := defaultAndNewStreams(sim, 2)
	var live []cudart.Ptr
	var want Stats
	observe := func() {
		s := a.Stats()
		for i, arr := range s.namedArrays() {
			w := want.namedArrays()[i]
			for p := range numPools {
				w.a[p].Peak = max(w.a[p].Peak, arr.a[p].Current)
			}
		}
		want.OversizeAllocations.Peak = max(want.OversizeAllocations.Peak, s.OversizeAllocations.Current)
	}
	x := uint64(12345)
	for i := range 3000 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		if len(live) > 0 && x%5 < 2 {
			j := int(x>>8) % len(live)
			if err := a.Free(live[j]); err != nil {
				t.Fatal(err)
			}
			live[j] = live[len(live)-1]
			live = live[:len(live)-1]
		} else {
			live = append(live, mustMalloc(t, a, sizeFor(x>>3), streams[i%len(streams)]))
		}
		observe()
		if i == 1500 {
			a.ResetPeakStats()
			want = a.Stats()
		}
	}
	got := a.Stats()
	if got.NumEscalations == 0 {
		t.Error("no escalation counted: the peaks rose on three streams without one")
	}
	for i, arr := range got.namedArrays() {
		w := want.namedArrays()[i]
		for p := range numPools {
			if arr.a[p].Peak != w.a[p].Peak {
				t.Errorf("%s.%v peak %d, the largest value seen %d", arr.name, Pool(p), arr.a[p].Peak, w.a[p].Peak)
			}
		}
	}
	for _, p := range live {
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
}

// TestReservoirSparesEscalations: slack that one stream's frees leave goes
// back to the reservoir, and another stream grows into it by borrowing,
// without taking every shard's lock, while the peaks stay exact.
func TestReservoirSparesEscalations(t *testing.T) {
	a, sim := newTestAllocator(t, 4*giB, "")
	s1, _ := sim.StreamCreate()
	s2, _ := sim.StreamCreate()
	var ps []cudart.Ptr
	const size = 1<<20 + 512 // large pool: all of s2's requests fit in one segment
	for range 20 {           // the peaks: 21 blocks, 29 MiB
		ps = append(ps, mustMalloc(t, a, size, s1))
	}
	// Room on s2 for what follows (its own segment), then both streams are in use.
	warm := mustMalloc(t, a, 9<<20, s2)
	mustFree(t, a, warm)
	keep := mustMalloc(t, a, 512, s2)
	for _, p := range ps {
		mustFree(t, a, p)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	before := a.Stats()
	var qs []cudart.Ptr
	for range 10 { // past s2's own caps, within what s1 gave back
		qs = append(qs, mustMalloc(t, a, size, s2))
	}
	after := a.Stats()
	if after.NumEscalations != before.NumEscalations {
		t.Errorf("%d escalations for growth within the slack s1 left", after.NumEscalations-before.NumEscalations)
	}
	if after.AllocatedBytes[PoolAll].Peak != before.AllocatedBytes[PoolAll].Peak {
		t.Errorf("peak moved from %d to %d below the old peak", before.AllocatedBytes[PoolAll].Peak, after.AllocatedBytes[PoolAll].Peak)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	for _, q := range append(qs, keep) {
		mustFree(t, a, q)
	}
}

// TestSoleShardOwnsPeaks: while one stream alone is in use, its growth to
// new peaks stays on the hot path (no borrow, no escalation), and the
// peaks come out exact when another stream starts: its first Malloc
// escalates, which settles what the owner reached.
func TestSoleShardOwnsPeaks(t *testing.T) {
	a, sim := newTestAllocator(t, 4*giB, "")
	s := cudart.DefaultStream
	const size = 1<<20 + 512 // large pool: 15 of them fit in the first 20 MiB segment
	// The first comes in world mode, with the segment.
	ps := []cudart.Ptr{mustMalloc(t, a, size, s)}
	before := a.Stats()
	for range 14 { // a new peak at every call
		ps = append(ps, mustMalloc(t, a, size, s))
	}
	mustFree(t, a, ps[14]) // a fall, then a rise to the same peak
	ps[14] = mustMalloc(t, a, size, s)
	after := a.Stats()
	if n := after.NumDeviceAlloc - before.NumDeviceAlloc; n != 0 {
		t.Fatalf("%d device mallocs: the test needs one segment", n)
	}
	if n, b := after.NumEscalations-before.NumEscalations, after.NumCapBorrows-before.NumCapBorrows; n != 0 || b != 0 {
		t.Errorf("%d escalations and %d borrows for one stream's growth", n, b)
	}
	const peak = 15 * size
	if got := after.AllocatedBytes[PoolAll].Peak; got != peak {
		t.Errorf("peak allocated %d, want %d", got, peak)
	}
	if got := after.Allocation[PoolLarge].Peak; got != 15 {
		t.Errorf("peak large allocations %d, want 15", got)
	}
	// Stats took every lock and settled; the owner keeps raising its caps.
	mustFree(t, a, ps[14])
	mustFree(t, a, ps[13])
	ps[13] = mustMalloc(t, a, size, s)
	// A second stream: its first Malloc cannot take the owner's caps; the
	// peak it makes counts what the owner holds.
	s2, _ := sim.StreamCreate()
	before = a.Stats()
	q := mustMalloc(t, a, 512, s2)
	after = a.Stats()
	if got, want := after.AllocatedBytes[PoolAll].Peak, int64(peak); got != want {
		t.Errorf("peak allocated %d after the second stream's first block, want %d", got, want)
	}
	ps[14] = mustMalloc(t, a, size, s) // now past the old peak by 512 B
	after = a.Stats()
	if got, want := after.AllocatedBytes[PoolAll].Peak, int64(peak+512); got != want {
		t.Errorf("peak allocated %d with both streams, want %d", got, want)
	}
	if after.NumEscalations == before.NumEscalations {
		t.Error("no escalation for growth past the peaks with two streams in use")
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	for _, p := range append(ps, q) {
		mustFree(t, a, p)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
}

// defaultAndNewStreams returns the default stream and n streams made on
// sim.
func defaultAndNewStreams(sim *simdev.Sim, n int) []cudart.Stream {
	streams := []cudart.Stream{cudart.DefaultStream}
	for range n {
		s, _ := sim.StreamCreate()
		streams = append(streams, s)
	}
	return streams
}

// TestPeaksExactAcrossOwners: the peaks come out exact when nothing reads
// the statistics between calls, so that a shard that owns the peaks keeps
// them through its growth, across phases in which one stream alone is in
// use (one shard owns the peaks) and phases in which three are. The
// model knows the allocation count and the requested bytes exactly.
func TestPeaksExactAcrossOwners(t *testing.T) {
	a, sim := newTestAllocator(t, 8*giB, "")
	streams := defaultAndNewStreams(sim, 2)
	type alloc struct {
		p    cudart.Ptr
		size uint64
	}
	live := make([][]alloc, len(streams))
	// Cached small segments on every stream, so that the phases make no
	// device call (world mode would settle the peaks) and the owner's
	// peaks are settled by the escalations alone.
	for _, s := range streams {
		var ps []cudart.Ptr
		for range 64 {
			ps = append(ps, mustMalloc(t, a, miB, s))
		}
		for _, p := range ps {
			mustFree(t, a, p)
		}
	}
	a.ResetPeakStats() // nothing live: the peaks start at 0, as the model's
	before := a.Stats()
	var n, requested, peakN, peakRequested int64
	free := func(k, j int) {
		if err := a.Free(live[k][j].p); err != nil {
			t.Fatal(err)
		}
		n--
		requested -= int64(live[k][j].size)
		live[k][j] = live[k][len(live[k])-1]
		live[k] = live[k][:len(live[k])-1]
	}
	x := uint64(88172645463325252)
	next := func() uint64 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		return x
	}
	step := func(k int, frees uint64) { // frees in 6: how often a step frees
		v := next()
		if len(live[k]) > 0 && v%6 < frees {
			free(k, int(v>>8)%len(live[k]))
			return
		}
		size := 1 + (v>>8)%(64*kiB)
		live[k] = append(live[k], alloc{mustMalloc(t, a, size, streams[k]), size})
		n++
		requested += int64(size)
		peakN, peakRequested = max(peakN, n), max(peakRequested, requested)
	}
	for phase := range 6 {
		// Every stream in use, little live: borrows, steals, escalations.
		for range 300 {
			step(int(next()>>40)%len(streams), 3)
		}
		// One stream alone, growing to a new peak and then shrinking, so
		// that its maxima stand above its values when the next phase's
		// first escalation settles them.
		for k := 1; k < len(streams); k++ {
			for len(live[k]) > 0 {
				free(k, len(live[k])-1)
			}
		}
		for range 150 + 60*phase {
			step(0, 1)
		}
		for range 100 {
			step(0, 5)
		}
		if phase == 3 { // a read in between: settles, and the owner starts again
			if err := a.Check(); err != nil {
				t.Fatalf("phase %d: %v", phase, err)
			}
		}
	}
	st := a.Stats()
	if d := st.NumDeviceAlloc - before.NumDeviceAlloc; d != 0 {
		t.Fatalf("%d device mallocs in the phases: the cache was meant to serve them all", d)
	}
	if st.NumEscalations == before.NumEscalations {
		t.Error("no escalation in the phases: nothing settled an owner's peaks")
	}
	if got := st.Allocation[PoolAll].Peak; got != peakN {
		t.Errorf("peak allocation count %d, want %d", got, peakN)
	}
	if got := st.RequestedBytes[PoolAll].Peak; got != peakRequested {
		t.Errorf("peak requested bytes %d, want %d", got, peakRequested)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	for k := range live {
		for len(live[k]) > 0 {
			free(k, len(live[k])-1)
		}
	}
}

// slackInOtherCaps sets up two streams of a where the first, s1, keeps
// the slack under the peaks as its caps (too few frees to repay it) and
// the second, s2, can grow back to the peaks, not past them, by two
// large-pool blocks: grow makes them. done frees everything the setup and
// grow left live.
func slackInOtherCaps(t *testing.T) (a *Allocator, s1 cudart.Stream, grow func() []cudart.Ptr, done func(extra []cudart.Ptr)) {
	t.Helper()
	a, sim := newTestAllocator(t, 4*giB, "")
	s1, _ = sim.StreamCreate()
	s2, _ := sim.StreamCreate()
	const size = 1<<20 + 512 // large pool
	// s2 in use, with a cached 20 MiB segment for what follows.
	mustFree(t, a, mustMalloc(t, a, 9<<20, s2))
	keep := mustMalloc(t, a, 512, s2)
	// The peaks: 20 blocks on s1 and 2 on s2 at once.
	growOn := func(s cudart.Stream, n int) []cudart.Ptr {
		var ps []cudart.Ptr
		for range n {
			ps = append(ps, mustMalloc(t, a, size, s))
		}
		return ps
	}
	for _, p := range append(growOn(s1, 20), growOn(s2, 2)...) {
		mustFree(t, a, p)
	}
	// The same 20 on s1, then its last two freed (merged into the free
	// tail of their segment): s1 keeps their slack as caps.
	ps := growOn(s1, 20)
	mustFree(t, a, ps[19])
	mustFree(t, a, ps[18])
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	grow = func() []cudart.Ptr { return growOn(s2, 2) }
	done = func(extra []cudart.Ptr) {
		for _, q := range append(append(extra, keep), ps[:18]...) {
			mustFree(t, a, q)
		}
	}
	return a, s1, grow, done
}

// peaksUnmoved reports every peak that differs between before and after.
func peaksUnmoved(t *testing.T, before, after Stats) {
	t.Helper()
	for i, arr := range after.namedArrays() {
		b := before.namedArrays()[i]
		for p := range numPools {
			if arr.a[p].Peak != b.a[p].Peak {
				t.Errorf("%s.%v peak moved from %d to %d", arr.name, Pool(p), b.a[p].Peak, arr.a[p].Peak)
			}
		}
	}
}

// TestStealSparesEscalations: slack that stays in one stream's caps is
// taken by another stream that grows within the peaks: it locks the
// holder's shard alone, and takes no other lock.
func TestStealSparesEscalations(t *testing.T) {
	a, _, grow, done := slackInOtherCaps(t)
	before := a.Stats()
	qs := grow() // back to the peaks, not past them
	after := a.Stats()
	if n := after.NumEscalations - before.NumEscalations; n != 0 {
		t.Errorf("%d escalations for growth within the slack s1 holds", n)
	}
	// Counted: s2 borrowed, and took s1's lock (the only other shard) to
	// move s1's slack, every statistic's at once, in one or two sweeps.
	if n := after.NumCapBorrows - before.NumCapBorrows; n == 0 {
		t.Error("no borrow counted for growth past s2's caps")
	}
	if n := after.NumCapSteals - before.NumCapSteals; n < 1 || n > 2*(after.NumCapBorrows-before.NumCapBorrows) {
		t.Errorf("%d steals counted for %d borrows from one other shard", n, after.NumCapBorrows-before.NumCapBorrows)
	}
	peaksUnmoved(t, before, after)
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	done(qs)
}

// TestGatherWaitsForBusyShard: when the stream holding the slack keeps
// its shard's lock (its goroutine in a hot path, call after call), steal,
// which may only try that lock, falls short; the growing stream then
// waits for the lock holding no lock of its own (gatherSlack) and takes
// the slack, instead of escalating.
func TestGatherWaitsForBusyShard(t *testing.T) {
	a, s1, grow, done := slackInOtherCaps(t)
	before := a.Stats()
	// s1's shard held, as s1's goroutine in its hot path would hold it.
	qs := whileHeld(t, &a.lookupShard(s1).mu, "the growth", grow)
	after := a.Stats()
	if n := after.NumEscalations - before.NumEscalations; n != 0 {
		t.Errorf("%d escalations for growth within the slack s1 holds", n)
	}
	if n := after.NumCapSteals - before.NumCapSteals; n < 1 {
		t.Errorf("%d steals counted: the slack was not gathered", n)
	}
	peaksUnmoved(t, before, after)
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	done(qs)
}

// whileHeld locks mu, runs call in another goroutine, checks that call
// has not returned 20 ms later, then unlocks mu and returns call's result
// (its zero value when call ended the goroutine, as a t.Fatal in it does:
// the test is then failed, and does not hang).
func whileHeld[T any](t *testing.T, mu *sync.Mutex, what string, call func() T) T {
	t.Helper()
	mu.Lock()
	got := make(chan T, 1)
	go func() {
		var r T
		defer func() { got <- r }()
		r = call()
	}()
	select {
	case r := <-got:
		mu.Unlock()
		t.Fatalf("%s finished while the lock was held", what)
		return r
	case <-time.After(20 * time.Millisecond):
	}
	mu.Unlock()
	return <-got
}

// TestBusyAllocatorRetries: a hot-path Malloc that must escalate while
// another escalation or world-mode call holds the allocator waits for it
// and escalates itself, instead of taking the slow path's world mode.
func TestBusyAllocatorRetries(t *testing.T) {
	a, sim := newTestAllocator(t, 4*giB, "")
	s := cudart.DefaultStream
	// A block live on a second stream: two shards in use, so that no
	// shard owns the peaks and the growth below must escalate.
	s2, _ := sim.StreamCreate()
	other := mustMalloc(t, a, 512, s2)
	defer mustFree(t, a, other)
	mustFree(t, a, mustMalloc(t, a, 8*miB, s)) // a 20 MiB segment, cached; peak 8 MiB (+512 B)
	before := a.Stats()
	// The allocator held, as an escalation in another goroutine would.
	p := whileHeld(t, &a.mu, "Malloc", func() cudart.Ptr {
		p, err := a.Malloc(16*miB, s) // cached, but above the peak: it must escalate
		if err != nil {
			t.Error(err)
		}
		return p
	})
	after := a.Stats()
	if n := after.NumEscalations - before.NumEscalations; n != 1 {
		t.Errorf("%d escalations, want 1: the Malloc took the slow path", n)
	}
	if after.NumDeviceAlloc != before.NumDeviceAlloc {
		t.Errorf("%d device mallocs for a cached block", after.NumDeviceAlloc-before.NumDeviceAlloc)
	}
	if got := after.AllocatedBytes[PoolAll].Peak; got != int64(16*miB+512) {
		t.Errorf("peak allocated %d, want %d", got, 16*miB+512)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, p)
}

// TestHotAllocatedBytes: hotAllocatedBytes is where hotSums puts
// allocated_bytes.
func TestHotAllocatedBytes(t *testing.T) {
	var s Stats
	if hotNames[hotAllocatedBytes] != "allocated_bytes" || s.hotArrays()[hotAllocatedBytes] != &s.AllocatedBytes {
		t.Fatalf("hotAllocatedBytes %d names %q", hotAllocatedBytes, hotNames[hotAllocatedBytes])
	}
}

// TestAllocatedBound follows the hot path's bound of the allocated bytes
// (allocatedBound, for small requests at the limit of expandable
// segments) through owner mode: exact for the owner, none for another
// stream's shard while the owner's caps stand above the unsettled peak,
// and at least the sum for every shard once a second stream ends owner
// mode (Check holds that after every world-mode call too).
func TestAllocatedBound(t *testing.T) {
	a, sim := newTestAllocator(t, 4*giB, "expandable_segments:True")
	s, s2 := cudart.DefaultStream, newStream(t, sim)
	mustFree(t, a, mustMalloc(t, a, 512, s2))    // s2's shard, idle
	mustFree(t, a, mustMalloc(t, a, 120<<20, s)) // cached memory to grow into without a device call
	a.ResetPeakStats()
	var ps []cudart.Ptr
	for range 30 { // one stream alone, new peaks on its hot path
		ps = append(ps, mustMalloc(t, a, 3<<20, s))
	}
	sums, _ := a.hotSums()
	allocated := uint64(sums[hotAllocatedBytes][PoolAll])
	sh, sh2 := a.lookupShard(s), a.lookupShard(s2)
	if a.owner != sh || sh2 == nil {
		t.Fatalf("owner %p, the default stream's shard %p, the second stream's %p: the test needs the first to own the peaks and the second to exist", a.owner, sh, sh2)
	}
	if peak := uint64(a.stats.AllocatedBytes[PoolAll].Peak); peak >= allocated {
		t.Fatalf("settled peak %d, allocated %d: the test needs the owner past the settled peak", peak, allocated)
	}
	if b, ok := a.allocatedBound(sh); !ok || b != allocated {
		t.Errorf("the owner's bound %d (%v), want %d exactly", b, ok, allocated)
	}
	if b, ok := a.allocatedBound(sh2); ok {
		t.Errorf("another stream's bound %d while the owner's peaks are unsettled; want none", b)
	}
	q := mustMalloc(t, a, 512, s2) // escalates: owner mode ends
	if a.owner != nil {
		t.Fatal("owner mode did not end with a second stream in use")
	}
	sums, _ = a.hotSums()
	for _, x := range []*shard{sh, sh2} {
		if b, ok := a.allocatedBound(x); !ok || b < uint64(sums[hotAllocatedBytes][PoolAll]) {
			t.Errorf("stream %#x: bound %d (%v), below the allocated bytes %d", uint64(x.stream), b, ok, sums[hotAllocatedBytes][PoolAll])
		}
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	for _, p := range append(ps, q) {
		mustFree(t, a, p)
	}
}
