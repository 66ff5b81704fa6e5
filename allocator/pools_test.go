package allocator

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// captureGuard is a Sim that counts the calls a CUDA graph capture
// forbids (anything that synchronises, queries a stream or an event,
// records an event, or
// frees memory or unmaps pages) while its capturing flag is set, as a
// driver in global capture mode would fail them. Unmapping does not
// synchronise by itself, but reclaim synchronises before it; only the
// undoing of a failed mapping may unmap during a capture, and no test
// here fails one.
type captureGuard struct {
	*simdev.Sim
	mu        sync.Mutex
	capturing bool
	forbidden []string
}

func (g *captureGuard) note(call string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.capturing {
		g.forbidden = append(g.forbidden, call)
	}
}

func (g *captureGuard) Synchronize() error { g.note("Synchronize"); return g.Sim.Synchronize() }
func (g *captureGuard) StreamSynchronize(s cudart.Stream) error {
	g.note("StreamSynchronize")
	return g.Sim.StreamSynchronize(s)
}
func (g *captureGuard) EventQuery(e cudart.Event) (bool, error) {
	g.note("EventQuery")
	return g.Sim.EventQuery(e)
}
func (g *captureGuard) EventSynchronize(e cudart.Event) error {
	g.note("EventSynchronize")
	return g.Sim.EventSynchronize(e)
}
func (g *captureGuard) EventRecord(e cudart.Event, s cudart.Stream) error {
	g.note("EventRecord")
	return g.Sim.EventRecord(e, s)
}
func (g *captureGuard) Free(p cudart.Ptr) error { g.note("Free"); return g.Sim.Free(p) }

// CheckStream is cudaStreamQuery on a GPU, which a capture forbids too.
func (g *captureGuard) CheckStream(s cudart.Stream) error {
	g.note("CheckStream")
	return g.Sim.CheckStream(s)
}
func (g *captureGuard) Unmap(p cudart.Ptr, size uint64) error {
	g.note("Unmap")
	return g.Sim.Unmap(p, size)
}

func (g *captureGuard) set(on bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.capturing = on
}

// take returns the forbidden calls seen so far and forgets them.
func (g *captureGuard) take() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	f := g.forbidden
	g.forbidden = nil
	return f
}

// newGuardedAllocator is newTestAllocator over a captureGuard.
func newGuardedAllocator(t testing.TB, capacity uint64, conf string, sc simdev.Config) (*Allocator, *captureGuard) {
	t.Helper()
	sc.Capacity = capacity
	sim, err := simdev.New(sc)
	if err != nil {
		t.Fatal(err)
	}
	g := &captureGuard{Sim: sim}
	return newTestAllocatorOn(t, g, sim, conf), g
}

// segmentPool returns the pool id of the segment that holds p.
func segmentPool(t testing.TB, a *Allocator, p cudart.Ptr) PoolID {
	t.Helper()
	for _, s := range a.Snapshot().Segments {
		if uint64(p) >= s.Address && uint64(p) < s.Address+s.TotalSize {
			return s.PoolID
		}
	}
	t.Fatalf("%#x is in no segment", uint64(p))
	return PoolID{}
}

func TestPoolRouting(t *testing.T) {
	for _, conf := range []string{"", "expandable_segments:True"} {
		t.Run("conf="+conf, func(t *testing.T) {
			a, sim := newTestAllocator(t, giB, conf)
			side, err := sim.StreamCreate()
			if err != nil {
				t.Fatal(err)
			}
			graph := PoolID{1, 0}
			if err := a.BeginAllocateToPool(graph, func(s cudart.Stream) bool { return s == side }); err != nil {
				t.Fatal(err)
			}
			inPool := mustMalloc(t, a, 3*miB, side)
			general := mustMalloc(t, a, 3*miB, cudart.DefaultStream)
			mustCheck(t, a)
			if got := segmentPool(t, a, inPool); got != graph {
				t.Errorf("allocation on the routed stream is in pool %v, want %v", got, graph)
			}
			if got := segmentPool(t, a, general); got != (PoolID{}) {
				t.Errorf("allocation on another stream is in pool %v, want the general cache", got)
			}
			for _, s := range a.Snapshot().Segments {
				if s.Stream != uint64(side) && s.Stream != uint64(cudart.DefaultStream) {
					t.Errorf("snapshot segment %#x names stream %#x, a pool stream", s.Address, s.Stream)
				}
			}
			// A block freed in the pool serves the pool only.
			mustFree(t, a, inPool)
			if err := a.EndAllocateToPool(graph); err != nil {
				t.Fatal(err)
			}
			again := mustMalloc(t, a, 3*miB, side)
			if again == inPool || segmentPool(t, a, again) != (PoolID{}) {
				t.Errorf("after the capture a Malloc on the routed stream got %#x in pool %v: the pool's free block or the pool", uint64(again), segmentPool(t, a, again))
			}
			p, err := a.MallocInPool(graph, 3*miB, side)
			if err != nil {
				t.Fatal(err)
			}
			if p != inPool {
				t.Errorf("MallocInPool got %#x, want the pool's free block %#x", uint64(p), uint64(inPool))
			}
			st := a.Stats()
			pools := a.Pools()
			if len(pools) != 1 || pools[0].ID != graph || pools[0].Users != 1 || pools[0].Capturing != 0 || pools[0].Segments != 1 {
				t.Fatalf("Pools() = %+v", pools)
			}
			if st.PrivateReservedBytes != pools[0].ReservedBytes || st.PrivateAllocatedBytes != pools[0].AllocatedBytes ||
				st.PrivateAllocatedBytes != int64(a.roundSize(3*miB)) {
				t.Errorf("private bytes %d reserved, %d allocated; the pool says %+v", st.PrivateReservedBytes, st.PrivateAllocatedBytes, pools[0])
			}
			if st.PrivateReservedBytes > st.ReservedBytes[PoolAll].Current {
				t.Errorf("private reserved %d above reserved %d", st.PrivateReservedBytes, st.ReservedBytes[PoolAll].Current)
			}
			mustFree(t, a, p)
			mustFree(t, a, again)
			mustFree(t, a, general)
			// The pool's cached segment survives EmptyCache while it has a user.
			if err := a.EmptyCache(); err != nil {
				t.Fatal(err)
			}
			if got := a.Stats().PrivateReservedBytes; got == 0 {
				t.Error("EmptyCache released the cache of a pool with a user")
			}
			if err := a.ReleasePool(graph); err != nil {
				t.Fatal(err)
			}
			mustCheck(t, a)
			if len(a.Pools()) != 0 || sim.Used() != 0 {
				t.Errorf("after the last user released the idle pool: pools %+v, device holds %d bytes", a.Pools(), sim.Used())
			}
		})
	}
}

// TestPoolReleasedWithLiveBlocks: a pool released while a block is live
// keeps that block's segment until it is freed, then returns it at once;
// a new user before then keeps it.
func TestPoolReleasedWithLiveBlocks(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "")
	id := PoolID{0, 7}
	if err := a.CreatePool(id); err != nil {
		t.Fatal(err)
	}
	p1, err := a.MallocInPool(id, 30*miB, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := a.MallocInPool(id, 100*kiB, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, p2) // its small segment is now whole and free
	if err := a.ReleasePool(id); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if got := sim.Used(); got != a.roundSize(30*miB) {
		t.Errorf("after release the device holds %d bytes, want only the live block's segment %d", got, a.roundSize(30*miB))
	}
	if _, err := a.MallocInPool(id, 1, cudart.DefaultStream); !errors.Is(err, ErrUnknownPool) {
		t.Errorf("MallocInPool of a released pool: %v, want ErrUnknownPool", err)
	}
	mustFree(t, a, p1)
	mustCheck(t, a)
	if sim.Used() != 0 || len(a.Pools()) != 0 {
		t.Errorf("after the last block: device holds %d bytes, pools %+v", sim.Used(), a.Pools())
	}

	// Released, then used again before its last block goes: it stays.
	if err := a.CreatePool(id); err != nil {
		t.Fatal(err)
	}
	p3, err := a.MallocInPool(id, 30*miB, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.ReleasePool(id); err != nil {
		t.Fatal(err)
	}
	if err := a.CreatePool(id); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, p3)
	mustCheck(t, a)
	if sim.Used() == 0 {
		t.Error("a pool with a user again lost its cached segment")
	}
	if err := a.ReleasePool(id); err != nil {
		t.Fatal(err)
	}
	if sim.Used() != 0 {
		t.Errorf("device holds %d bytes after the final release", sim.Used())
	}
}

// TestCaptureSynchronisesNothing: while a capture is under way no call
// synchronises, queries or records an event, or frees device memory, as
// a driver in global capture mode forbids; a block that another stream
// used and that is freed in the capture waits until the capture ends;
// EmptyCache fails with ErrCaptureUnderway and changes nothing; an OOM
// releases nothing and fails.
func TestCaptureSynchronisesNothing(t *testing.T) {
	for _, conf := range []string{"", "expandable_segments:True", "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9"} {
		t.Run("conf="+conf, func(t *testing.T) {
			a, g := newGuardedAllocator(t, 256*miB, conf, simdev.Config{ManualEvents: true})
			side, err := g.StreamCreate()
			if err != nil {
				t.Fatal(err)
			}
			// Before: a block used by the side stream, freed, its event pending.
			pending := mustMalloc(t, a, 4*miB, cudart.DefaultStream)
			if err := a.RecordStream(pending, side); err != nil {
				t.Fatal(err)
			}
			mustFree(t, a, pending)
			cached := mustMalloc(t, a, 40*miB, cudart.DefaultStream)
			mustFree(t, a, cached) // a cached segment the OOM path would release
			shared := mustMalloc(t, a, 2*miB, cudart.DefaultStream)
			if err := a.RecordStream(shared, side); err != nil {
				t.Fatal(err)
			}
			g.CompleteAll() // the pending event has completed, but nobody may ask

			id := PoolID{3, 0}
			if err := a.BeginAllocateToPool(id, nil); err != nil {
				t.Fatal(err)
			}
			g.set(true)
			p := mustMalloc(t, a, 5*miB, cudart.DefaultStream) // routed: nil filter
			mustFree(t, a, shared)                             // deferred: events after the capture
			before := a.Stats()
			if err := a.EmptyCache(); !errors.Is(err, ErrCaptureUnderway) {
				t.Errorf("EmptyCache during a capture: %v, want ErrCaptureUnderway", err)
			}
			if _, err := a.Malloc(230*miB, cudart.DefaultStream); !errors.Is(err, ErrOutOfMemory) {
				t.Errorf("a Malloc that needs the cache released, during a capture: %v, want an OOM", err)
			}
			after := a.Stats()
			if after.ReservedBytes[PoolAll].Current != before.ReservedBytes[PoolAll].Current ||
				after.Active[PoolAll].Current != before.Active[PoolAll].Current {
				t.Errorf("during the capture reserved %d → %d, active %d → %d: something was released",
					before.ReservedBytes[PoolAll].Current, after.ReservedBytes[PoolAll].Current,
					before.Active[PoolAll].Current, after.Active[PoolAll].Current)
			}
			mustFree(t, a, p)
			mustCheck(t, a)
			g.set(false)
			if f := g.take(); len(f) > 0 {
				t.Errorf("forbidden calls during the capture: %v", f)
			}
			if err := a.EndAllocateToPool(id); err != nil {
				t.Fatal(err)
			}
			mustCheck(t, a)
			if len(a.deferred) != 0 || a.pending == 0 {
				t.Errorf("after the capture %d blocks deferred, %d events pending: the deferred events were not recorded", len(a.deferred), a.pending)
			}
			g.CompleteAll()
			if err := a.ReleasePool(id); err != nil {
				t.Fatal(err)
			}
			big := mustMalloc(t, a, 230*miB, cudart.DefaultStream) // releases the cache now
			mustFree(t, a, big)
			mustCheck(t, a)
		})
	}
}

// TestPoolBadCalls: every malformed pool call fails with its error and
// leaves the allocator as it was.
func TestPoolBadCalls(t *testing.T) {
	a, sim := newTestAllocator(t, giB, "")
	live := PoolID{5, 0}
	if err := a.CreatePool(live); err != nil {
		t.Fatal(err)
	}
	p, err := a.MallocInPool(live, miB, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	forged, _ := blocks.PoolStream(1, uint64(cudart.DefaultStream))
	for _, tc := range []struct {
		name string
		call func() error
		want error
	}{
		{"create (0, 0)", func() error { return a.CreatePool(PoolID{}) }, ErrUnknownPool},
		{"begin (0, 0)", func() error { return a.BeginAllocateToPool(PoolID{}, nil) }, ErrUnknownPool},
		{"release unknown", func() error { return a.ReleasePool(PoolID{9, 9}) }, ErrUnknownPool},
		{"end without begin", func() error { return a.EndAllocateToPool(live) }, ErrUnknownPool},
		{"end unknown", func() error { return a.EndAllocateToPool(PoolID{9, 9}) }, ErrUnknownPool},
		{"malloc in unknown", func() error { _, err := a.MallocInPool(PoolID{9, 9}, miB, cudart.DefaultStream); return err }, ErrUnknownPool},
		{"malloc on a pool stream", func() error { _, err := a.Malloc(miB, cudart.Stream(forged)); return err }, ErrInvalidStream},
		{"malloc in pool on a pool stream", func() error { _, err := a.MallocInPool(live, miB, cudart.Stream(forged)); return err }, ErrInvalidStream},
		{"malloc in pool on a huge stream", func() error { _, err := a.MallocInPool(live, miB, cudart.Stream(1<<50)); return err }, ErrInvalidStream},
		{"record a pool stream", func() error { return a.RecordStream(p, cudart.Stream(forged)) }, ErrInvalidStream},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, used := a.Stats(), sim.Used()
			pools := a.Pools()
			err := tc.call()
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			mustCheck(t, a)
			after := a.Stats()
			if after.ReservedBytes != before.ReservedBytes || after.AllocatedBytes != before.AllocatedBytes || sim.Used() != used ||
				fmt.Sprint(a.Pools()) != fmt.Sprint(pools) {
				t.Errorf("the failed call changed the allocator: %+v → %+v", pools, a.Pools())
			}
		})
	}
	mustFree(t, a, p)
	if err := a.ReleasePool(live); err != nil {
		t.Fatal(err)
	}

	async, _ := newTestAllocator(t, giB, "backend:cudaMallocAsync")
	if err := async.CreatePool(live); !errors.Is(err, ErrNotSupported) {
		t.Errorf("CreatePool with backend:cudaMallocAsync: %v, want ErrNotSupported", err)
	}
}

// TestPoolNumbersGoRound: a pool number that ReleasePool frees does not
// come back to the next pool created. MallocInPool and a routed Malloc
// read a pool's number without a lock: one that read it just before the
// release would otherwise allocate into the new pool; instead it finds
// no pool. Numbers wrap after blocks.MaxPoolSeq and skip those in use.
func TestPoolNumbersGoRound(t *testing.T) {
	a, _ := newTestAllocator(t, giB, "")
	seqOf := func(id PoolID) uint64 {
		a.lockWorld()
		defer a.unlockWorld()
		return a.private[id].seq
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	old, next := PoolID{1, 1}, PoolID{2, 2}
	must(a.CreatePool(old))
	seq := seqOf(old)
	stale, _ := blocks.PoolStream(seq, uint64(cudart.DefaultStream))
	must(a.ReleasePool(old))
	must(a.CreatePool(next))
	if got := seqOf(next); got == seq {
		t.Fatalf("the pool created after a release got the released pool's number %d", got)
	}
	// The rest of a MallocInPool that read the old number before the release.
	if p, err := a.mallocStream(miB, cudart.Stream(stale)); !errors.Is(err, ErrUnknownPool) {
		t.Fatalf("malloc on the released pool's number: %#x, %v; want ErrUnknownPool", uint64(p), err)
	}
	mustCheck(t, a)

	a.lockWorld()
	a.lastPoolSeq = blocks.MaxPoolSeq - 1
	a.unlockWorld()
	var got []uint64
	for _, id := range []PoolID{{3, 3}, {4, 4}, {5, 5}} {
		must(a.CreatePool(id))
		got = append(got, seqOf(id))
	}
	// next holds 2; 1 is free again.
	if want := []uint64{blocks.MaxPoolSeq, 1, 3}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("pool numbers after %d: %v, want %v", blocks.MaxPoolSeq-1, got, want)
	}
}

// TestPoolExpandableKeepsPages: with expandable segments a pool's pages
// stay mapped under its blocks, freed or not, while the general cache's
// churn reclaims around them.
func TestPoolExpandableKeepsPages(t *testing.T) {
	a, sim := newTestAllocator(t, 512*miB, "expandable_segments:True", simdev.Config{Backed: true})
	id := PoolID{2, 0}
	if err := a.BeginAllocateToPool(id, nil); err != nil {
		t.Fatal(err)
	}
	var pool []cudart.Ptr
	for i := range 8 {
		p := mustMalloc(t, a, uint64(i+1)*3*miB, cudart.DefaultStream)
		if err := sim.MemcpyHtoD(p, []byte{byte(i + 1)}); err != nil {
			t.Fatal(err)
		}
		pool = append(pool, p)
	}
	if err := a.EndAllocateToPool(id); err != nil {
		t.Fatal(err)
	}
	for _, p := range pool[:4] { // the graph still uses freed memory
		mustFree(t, a, p)
	}
	rng := rand.New(rand.NewPCG(4, 4))
	var live []cudart.Ptr
	for range 600 {
		if len(live) > 0 && rng.IntN(2) == 0 {
			i := rng.IntN(len(live))
			mustFree(t, a, live[i])
			live = append(live[:i], live[i+1:]...)
			continue
		}
		if p, err := a.Malloc(uint64(1+rng.IntN(40))*miB, cudart.DefaultStream); err == nil {
			live = append(live, p)
		}
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, a)
	if a.Stats().NumReclaims == 0 {
		t.Error("the churn reclaimed nothing: the test covers nothing")
	}
	var got [1]byte
	for i, p := range pool {
		if err := sim.MemcpyDtoH(got[:], p); err != nil {
			t.Fatalf("pool block %d at %#x: %v (unmapped)", i, uint64(p), err)
		}
		if got[0] != byte(i+1) {
			t.Errorf("pool block %d at %#x holds %d, not %d: its page moved", i, uint64(p), got[0], i+1)
		}
	}
	for _, p := range live {
		mustFree(t, a, p)
	}
	for _, p := range pool[4:] {
		mustFree(t, a, p)
	}
	if err := a.ReleasePool(id); err != nil {
		t.Fatal(err)
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if sim.Used() != 0 {
		t.Errorf("device holds %d bytes after the pool's release and EmptyCache", sim.Used())
	}
}

// poolDriver is the opDriver with private pools: its extra operations
// begin and end captures (routing every stream or one), create and
// release pools and allocate into them by name. After every step it
// checks, beside the opDriver's invariants, that each live allocation
// lies in a segment of the pool it was routed to, and that no call the
// capture forbids ran while one was under way.
type poolDriver struct {
	*opDriver
	g       *captureGuard
	ids     []PoolID
	users   map[PoolID]int
	begun   []PoolID // captures under way, in order
	filters map[int]cudart.Stream
	pools   map[cudart.Ptr]PoolID
	// What the run covered: allocations routed or named into pools,
	// steps with deferred events, OOMs inside a pool.
	inPool, deferred, poolOOMs int
}

func newPoolDriver(t testing.TB, capacity uint64, conf string) *poolDriver {
	a, g := newGuardedAllocator(t, capacity, conf, simdev.Config{ManualEvents: true})
	d := &poolDriver{
		opDriver: &opDriver{t: t, a: a, sim: g.Sim, streams: []cudart.Stream{cudart.DefaultStream}},
		g:        g, ids: []PoolID{{1, 0}, {2, 0}, {0, 1}},
		users: map[PoolID]int{}, filters: map[int]cudart.Stream{}, pools: map[cudart.Ptr]PoolID{},
	}
	for range 2 {
		s, err := g.StreamCreate()
		if err != nil {
			t.Fatal(err)
		}
		d.streams = append(d.streams, s)
	}
	return d
}

// route is the pool a Malloc on s goes to now.
func (d *poolDriver) route(s cudart.Stream) PoolID {
	for i, id := range d.begun {
		if f, ok := d.filters[i]; !ok || f == s {
			return id
		}
	}
	return PoolID{}
}

func (d *poolDriver) step(op byte, v uint64) {
	a := d.a
	id := d.ids[v%uint64(len(d.ids))]
	op %= 12 // 0..7 are the opDriver's
	switch op {
	case 0, 1, 2: // malloc, routed
		n := len(d.live)
		s := d.streams[(v>>40)%uint64(len(d.streams))]
		want := d.route(s)
		d.opDriver.stepNoCheck(op, v)
		if len(d.live) > n {
			d.pools[d.live[n].ptr] = want
			if want != (PoolID{}) {
				d.inPool++
			}
		} else if want != (PoolID{}) {
			d.poolOOMs++
		}
	case 7:
		if v%4 == 0 && len(d.begun) > 0 {
			d.steps++
			if err := a.EmptyCache(); !errors.Is(err, ErrCaptureUnderway) {
				d.t.Fatalf("step %d: EmptyCache during a capture: %v", d.steps, err)
			}
		} else {
			d.opDriver.stepNoCheck(op, v)
		}
	case 8: // begin a capture
		if len(d.begun) >= 2 {
			return
		}
		d.steps++
		var filter func(cudart.Stream) bool
		if v>>8%2 == 1 {
			s := d.streams[(v>>16)%uint64(len(d.streams))]
			d.filters[len(d.begun)] = s
			filter = func(x cudart.Stream) bool { return x == s }
		}
		if err := a.BeginAllocateToPool(id, filter); err != nil {
			d.t.Fatalf("step %d: BeginAllocateToPool: %v", d.steps, err)
		}
		d.begun = append(d.begun, id)
		d.users[id]++
		d.g.set(true)
	case 9: // end the earliest capture of a pool
		if len(d.begun) == 0 {
			return
		}
		d.steps++
		i := int(v % uint64(len(d.begun)))
		id := d.begun[i]
		i = indexOf(d.begun, id)
		if len(d.begun) == 1 { // the last: it records the deferred events
			d.g.set(false)
		}
		if err := a.EndAllocateToPool(id); err != nil {
			d.t.Fatalf("step %d: EndAllocateToPool: %v", d.steps, err)
		}
		d.begun = append(d.begun[:i], d.begun[i+1:]...)
		f := map[int]cudart.Stream{}
		for j, s := range d.filters {
			switch {
			case j < i:
				f[j] = s
			case j > i:
				f[j-1] = s
			}
		}
		d.filters = f
	case 10: // create or release
		d.steps++
		if v>>8%2 == 0 {
			if err := a.CreatePool(id); err != nil {
				d.t.Fatalf("step %d: CreatePool: %v", d.steps, err)
			}
			d.users[id]++
			break
		}
		err := a.ReleasePool(id)
		capturing := 0
		for _, x := range d.begun {
			if x == id {
				capturing++
			}
		}
		if d.users[id] == 0 {
			if !errors.Is(err, ErrUnknownPool) {
				d.t.Fatalf("step %d: ReleasePool without a user: %v", d.steps, err)
			}
			break
		}
		if d.users[id] <= capturing {
			if !errors.Is(err, ErrCaptureUnderway) {
				d.t.Fatalf("step %d: ReleasePool of the capture's own use: %v", d.steps, err)
			}
			break
		}
		if err != nil {
			d.t.Fatalf("step %d: ReleasePool: %v", d.steps, err)
		}
		d.users[id]--
	case 11: // malloc in a pool by name
		d.steps++
		size := sizeFor(v >> 3)
		s := d.streams[(v>>40)%uint64(len(d.streams))]
		p, err := a.MallocInPool(id, size, s)
		switch {
		case d.users[id] == 0:
			if !errors.Is(err, ErrUnknownPool) {
				d.t.Fatalf("step %d: MallocInPool of a pool without users: %v", d.steps, err)
			}
		case err != nil && !errors.Is(err, ErrOutOfMemory):
			d.t.Fatalf("step %d: MallocInPool: %v", d.steps, err)
		case err != nil:
			d.poolOOMs++
		default:
			d.inPool++
			d.live = append(d.live, liveAlloc{ptr: p, size: size, rounded: a.roundSize(size), stream: s})
			d.pools[p] = id
		}
	default: // free, record stream, progress
		if op == 3 || op == 4 {
			n := len(d.live)
			d.opDriver.stepNoCheck(op, v)
			if len(d.live) < n {
				d.forgetFreed()
			}
		} else {
			d.opDriver.stepNoCheck(op, v)
		}
	}
	d.check()
}

// forgetFreed drops the pool records of freed allocations.
func (d *poolDriver) forgetFreed() {
	live := make(map[cudart.Ptr]bool, len(d.live))
	for _, l := range d.live {
		live[l.ptr] = true
	}
	for p := range d.pools {
		if !live[p] {
			delete(d.pools, p)
		}
	}
}

func indexOf(ids []PoolID, id PoolID) int {
	for i, x := range ids {
		if x == id {
			return i
		}
	}
	return -1
}

func (d *poolDriver) check() {
	d.t.Helper()
	d.opDriver.check()
	if len(d.a.deferred) > 0 {
		d.deferred++
	}
	if f := d.g.take(); len(f) > 0 {
		d.t.Fatalf("step %d: forbidden calls during a capture: %v", d.steps, f)
	}
	segs := d.a.Snapshot().Segments
	for _, l := range d.live {
		got, found := PoolID{}, false
		for _, s := range segs {
			if uint64(l.ptr) >= s.Address && uint64(l.ptr) < s.Address+s.TotalSize {
				got, found = s.PoolID, true
				break
			}
		}
		if !found || got != d.pools[l.ptr] {
			d.t.Fatalf("step %d: allocation %#x is in pool %v (found %v), routed to %v", d.steps, uint64(l.ptr), got, found, d.pools[l.ptr])
		}
	}
	for _, u := range d.a.Pools() {
		if u.Users != d.users[u.ID] {
			d.t.Fatalf("step %d: pool %v has %d users, the model %d", d.steps, u.ID, u.Users, d.users[u.ID])
		}
	}
}

// finish ends the captures, releases every user, frees everything and
// checks that the device holds nothing.
func (d *poolDriver) finish() {
	for len(d.begun) > 0 {
		d.step(9, 0)
	}
	for id, n := range d.users {
		for range n {
			if err := d.a.ReleasePool(id); err != nil {
				d.t.Fatalf("final ReleasePool: %v", err)
			}
		}
		d.users[id] = 0
	}
	d.opDriver.finish()
	if len(d.a.Pools()) != 0 {
		d.t.Fatalf("pools remain after the end: %+v", d.a.Pools())
	}
}

// TestPoolModelRandom drives random sequences of allocations, frees,
// stream uses, event progress, EmptyCache, device faults, captures and
// pool calls, checking every invariant after each step.
func TestPoolModelRandom(t *testing.T) {
	steps := 3000
	if testing.Short() {
		steps = 1000
	}
	for _, conf := range []string{"", "max_split_size_mb:40,garbage_collection_threshold:0.5,per_process_memory_fraction:0.8", "expandable_segments:True"} {
		t.Run("conf="+conf, func(t *testing.T) {
			for seed := range uint64(2) {
				d := newPoolDriver(t, 512*miB, conf)
				rng := rand.New(rand.NewPCG(seed, 23))
				for range steps {
					op := byte(rng.IntN(12))
					if len(d.live) > 150 && (op < 3 || op == 11) {
						op = 3
					}
					d.step(op, rng.Uint64())
				}
				t.Logf("seed %d: %d allocations in pools, %d steps with deferred events, %d OOMs in pools", seed, d.inPool, d.deferred, d.poolOOMs)
				if d.inPool == 0 || d.deferred == 0 || d.poolOOMs == 0 {
					t.Errorf("the run covered too little: %d allocations in pools, %d steps with deferred events, %d OOMs in pools", d.inPool, d.deferred, d.poolOOMs)
				}
				d.finish()
			}
		})
	}
}

// FuzzPoolOps is FuzzOps with the pool operations.
func FuzzPoolOps(f *testing.F) {
	f.Add([]byte("\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00\x10\x00\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x00\x00\x00\x00\x00\x09\x00\x00\x00\x00\x00\x00\x00\x00\x0a\x00\x01\x00\x00\x00\x00\x00\x00"))
	seed := make([]byte, 0, 9*64)
	rng := rand.New(rand.NewPCG(5, 6))
	for range 64 {
		seed = append(seed, byte(rng.IntN(12)))
		seed = binary.LittleEndian.AppendUint64(seed, rng.Uint64())
	}
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 9*1000 {
			data = data[:9*1000]
		}
		d := newPoolDriver(t, 256*miB, "max_split_size_mb:64")
		for len(data) >= 9 {
			d.step(data[0], binary.LittleEndian.Uint64(data[1:9]))
			data = data[9:]
		}
		d.finish()
	})
}

// poolLayout is a pool's blocks as a checkpoint records them, from the
// allocator's segments now.
func poolLayout(a *Allocator, id PoolID) []checkpointSegment {
	a.lockWorld()
	defer a.unlockWorld()
	var out []checkpointSegment
	for _, s := range a.segs.list {
		if a.poolIDOf(s.Stream) != id {
			continue
		}
		cs := checkpointSegment{ptr: s.Ptr, size: s.Size}
		for b := s.Head; b != nil; b = b.Next {
			cs.blocks = append(cs.blocks, checkpointBlock{ptr: b.Ptr, size: b.Size, allocated: b.Allocated, unmapped: b.Unmapped})
		}
		out = append(out, cs)
	}
	return out
}

// sameLayout reports how got differs from the checkpoint's segments:
// every checkpointed segment is there with its mapped blocks as they
// were (requested sizes aside); segments made since hold nothing.
func sameLayout(ck *PoolCheckpoint, got []checkpointSegment) error {
	bySeg := map[uint64]checkpointSegment{}
	for _, s := range got {
		bySeg[s.ptr] = s
	}
	for _, cs := range ck.segs {
		s, ok := bySeg[cs.ptr]
		if !ok {
			return fmt.Errorf("segment %#x is gone", cs.ptr)
		}
		delete(bySeg, cs.ptr)
		for i, kb := range cs.blocks {
			if kb.unmapped {
				for _, b := range s.blocks[i:] {
					if b.allocated {
						return fmt.Errorf("segment %#x: %#x allocated past the checkpoint's mapped blocks", cs.ptr, b.ptr)
					}
				}
				break
			}
			if i >= len(s.blocks) {
				return fmt.Errorf("segment %#x: block %d missing", cs.ptr, i)
			}
			b := s.blocks[i]
			if !kb.allocated && i+1 < len(cs.blocks) && cs.blocks[i+1].unmapped && b.ptr == kb.ptr && !b.allocated && !b.unmapped && b.size >= kb.size {
				continue // free up to pages mapped since: it grew
			}
			if b.ptr != kb.ptr || b.size != kb.size || b.allocated != kb.allocated || b.unmapped {
				return fmt.Errorf("segment %#x: block %d is %+v, the checkpoint's %+v", cs.ptr, i, b, kb)
			}
		}
	}
	for _, s := range bySeg {
		for _, b := range s.blocks {
			if b.allocated {
				return fmt.Errorf("segment %#x, made since the checkpoint, holds %#x", s.ptr, b.ptr)
			}
		}
	}
	return nil
}

func TestPoolCheckpointRestore(t *testing.T) {
	for _, conf := range []string{"", "max_split_size_mb:20", "expandable_segments:True"} {
		t.Run("conf="+conf, func(t *testing.T) {
			a, sim := newTestAllocator(t, giB, conf, simdev.Config{ManualEvents: true})
			id := PoolID{4, 0}
			if err := a.CreatePool(id); err != nil {
				t.Fatal(err)
			}
			in := func(size uint64) cudart.Ptr {
				t.Helper()
				p, err := a.MallocInPool(id, size, cudart.DefaultStream)
				if err != nil {
					t.Fatal(err)
				}
				return p
			}
			pa, pb, pc := in(3*miB), in(5*miB), in(100*kiB)
			mustFree(t, a, pb)
			ck, err := a.CheckpointPool(id)
			if err != nil {
				t.Fatal(err)
			}
			mustFree(t, a, pa)
			pd, pe, pf := in(7*miB), in(miB), in(40*miB)
			freed, allocated, err := a.RestorePool(ck)
			if err != nil {
				t.Fatal(err)
			}
			mustCheck(t, a)
			if fmt.Sprint(sortPtrs(freed)) != fmt.Sprint(sortPtrs([]cudart.Ptr{pc, pd, pe, pf})) {
				t.Errorf("freed %#x, want the blocks allocated before the restore", freed)
			}
			if fmt.Sprint(sortPtrs(allocated)) != fmt.Sprint(sortPtrs([]cudart.Ptr{pa, pc})) || fmt.Sprint(allocated) != fmt.Sprint(ck.Allocated()) {
				t.Errorf("allocated %#x, want the checkpoint's %#x", allocated, ck.Allocated())
			}
			if err := sameLayout(ck, poolLayout(a, id)); err != nil {
				t.Error(err)
			}
			// The restored blocks are ordinary allocations.
			mustFree(t, a, pa)
			mustFree(t, a, pc)

			// Calls that must fail and change nothing.
			if err := a.BeginAllocateToPool(id, nil); err != nil {
				t.Fatal(err)
			}
			if _, _, err := a.RestorePool(ck); !errors.Is(err, ErrCaptureUnderway) {
				t.Errorf("restore during a capture: %v", err)
			}
			if err := a.EndAllocateToPool(id); err != nil {
				t.Fatal(err)
			}
			if err := a.ReleasePool(id); err != nil { // the capture's use
				t.Fatal(err)
			}
			side, _ := sim.StreamCreate()
			pg := in(2 * miB)
			if err := a.RecordStream(pg, side); err != nil {
				t.Fatal(err)
			}
			before := poolLayout(a, id)
			if _, _, err := a.RestorePool(ck); !errors.Is(err, ErrCheckpointMismatch) {
				t.Errorf("restore with a block another stream used: %v", err)
			}
			if fmt.Sprint(poolLayout(a, id)) != fmt.Sprint(before) {
				t.Error("a refused restore changed the pool")
			}
			mustFree(t, a, pg)
			sim.CompleteAll()
			if err := a.ReleasePool(id); err != nil {
				t.Fatal(err)
			}
			if _, _, err := a.RestorePool(ck); !errors.Is(err, ErrUnknownPool) {
				t.Errorf("restore of a released pool: %v", err)
			}
			if _, err := a.CheckpointPool(id); !errors.Is(err, ErrUnknownPool) {
				t.Errorf("checkpoint of a released pool: %v", err)
			}
			if err := a.EmptyCache(); err != nil {
				t.Fatal(err)
			}
			if sim.Used() != 0 {
				t.Errorf("device holds %d bytes at the end", sim.Used())
			}
		})
	}
}

func sortPtrs(p []cudart.Ptr) []cudart.Ptr {
	out := append([]cudart.Ptr(nil), p...)
	slices.Sort(out)
	return out
}

// TestPoolCheckpointRandom takes checkpoints of a pool at random moments
// of random allocation and restores them later, as CUDA graph trees do:
// after each restore the pool's layout is the checkpoint's and the live
// set is its allocations; Check holds after every step.
func TestPoolCheckpointRandom(t *testing.T) {
	steps := 3000
	if testing.Short() {
		steps = 1000
	}
	for _, conf := range []string{"", "expandable_segments:True", "max_split_size_mb:20,roundup_power2_divisions:4"} {
		t.Run("conf="+conf, func(t *testing.T) {
			a, _ := newTestAllocator(t, giB, conf)
			id := PoolID{9, 0}
			if err := a.CreatePool(id); err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(11, 12))
			live := map[cudart.Ptr]bool{}
			var cks []*PoolCheckpoint
			restores := 0
			for step := range steps {
				switch r := rng.IntN(20); {
				case r < 9:
					if p, err := a.MallocInPool(id, sizeFor(rng.Uint64()), cudart.DefaultStream); err == nil {
						live[p] = true
					} else if !errors.Is(err, ErrOutOfMemory) {
						t.Fatalf("step %d: %v", step, err)
					}
				case r < 17:
					for p := range live {
						mustFree(t, a, p)
						delete(live, p)
						break
					}
				case r < 18:
					ck, err := a.CheckpointPool(id)
					if err != nil {
						t.Fatal(err)
					}
					cks = append(cks, ck)
				default:
					if len(cks) == 0 {
						continue
					}
					ck := cks[rng.IntN(len(cks))]
					freed, allocated, err := a.RestorePool(ck)
					if err != nil {
						t.Fatalf("step %d: restore: %v", step, err)
					}
					if len(freed) != len(live) {
						t.Fatalf("step %d: freed %d blocks, %d were live", step, len(freed), len(live))
					}
					live = map[cudart.Ptr]bool{}
					for _, p := range allocated {
						live[p] = true
					}
					if err := sameLayout(ck, poolLayout(a, id)); err != nil {
						t.Fatalf("step %d: after restore: %v", step, err)
					}
					restores++
				}
				mustCheck(t, a)
				if got := a.Stats().Allocation[PoolAll].Current; got != int64(len(live)) {
					t.Fatalf("step %d: %d allocations, %d live", step, got, len(live))
				}
			}
			if restores == 0 {
				t.Error("no restore ran")
			}
			for p := range live {
				mustFree(t, a, p)
			}
			if err := a.ReleasePool(id); err != nil {
				t.Fatal(err)
			}
		})
	}
}
