package allocator

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// liveAlloc is the model's record of one allocation.
type liveAlloc struct {
	ptr       cudart.Ptr
	size      uint64 // requested
	rounded   uint64
	stream    cudart.Stream
	usedBy    []cudart.Stream
	fillValue byte
}

// opDriver applies operations to an allocator over a Sim with manual events
// and checks, after every step, the allocator's own invariants (Check) and
// the model's: live allocations never overlap, lie inside the reserved
// bytes the device holds, and the byte statistics match the model.
type opDriver struct {
	t       testing.TB
	a       *Allocator
	sim     *simdev.Sim
	streams []cudart.Stream
	live    []liveAlloc
	steps   int
	// fill: the Sim is backed; each allocation's first and last bytes get
	// a value that check reads back, so a page unmapped or moved under a
	// live block (expandable reclaim) shows.
	fill bool
}

func newOpDriver(t testing.TB, capacity uint64, conf string) *opDriver {
	return newOpDriverOn(t, capacity, conf, 3, false)
}

// newOpDriverOn is newOpDriver with nstreams streams (the default stream
// and nstreams-1 more) and, with fill, a backed Sim whose live allocations'
// contents check verifies.
func newOpDriverOn(t testing.TB, capacity uint64, conf string, nstreams int, fill bool) *opDriver {
	a, sim := newTestAllocator(t, capacity, conf, simdev.Config{ManualEvents: true, Backed: fill})
	d := &opDriver{t: t, a: a, sim: sim, streams: []cudart.Stream{cudart.DefaultStream}, fill: fill}
	for range nstreams - 1 {
		s, err := sim.StreamCreate()
		if err != nil {
			t.Fatal(err)
		}
		d.streams = append(d.streams, s)
	}
	return d
}

// sizeFor maps a random value to a request size spread over both pools.
func sizeFor(v uint64) uint64 {
	switch v % 10 {
	case 0, 1, 2, 3:
		return 1 + (v>>8)%(64*kiB) // small
	case 4, 5:
		return 1 + (v>>8)%miB // small, up to the boundary
	case 6, 7:
		return miB + 1 + (v>>8)%(9*miB) // large, 20 MiB segments
	case 8:
		return 10*miB + (v>>8)%(54*miB) // large, own segments
	default:
		return []uint64{512, 1024, miB, miB + 1, 10 * miB, 20 * miB}[(v>>8)%6]
	}
}

// step applies one operation chosen by op with argument v and checks
// every invariant.
func (d *opDriver) step(op byte, v uint64) {
	d.stepNoCheck(op, v)
	d.check()
}

// stepNoCheck is step without the checks.
func (d *opDriver) stepNoCheck(op byte, v uint64) {
	d.steps++
	a, sim := d.a, d.sim
	switch op % 8 {
	case 0, 1, 2: // malloc
		size := sizeFor(v)
		s := d.streams[(v>>40)%uint64(len(d.streams))]
		before := a.Stats()
		p, err := a.Malloc(size, s)
		if err != nil {
			if !errors.Is(err, ErrOutOfMemory) {
				d.t.Fatalf("step %d: Malloc(%d): unexpected error %v", d.steps, size, err)
			}
			after := a.Stats()
			if after.NumOOMs != before.NumOOMs+1 && size <= a.allowed {
				d.t.Fatalf("step %d: OOM not counted", d.steps)
			}
			break
		}
		if uint64(p)%512 != 0 {
			d.t.Fatalf("step %d: %#x is not 512-byte aligned", d.steps, uint64(p))
		}
		rounded := a.roundSize(size)
		if a.async != nil {
			rounded = size // the stream-ordered pool does its own rounding
		}
		l := liveAlloc{ptr: p, size: size, rounded: rounded, stream: s, fillValue: byte(d.steps) | 1}
		if d.fill {
			for _, at := range [2]cudart.Ptr{p, p + cudart.Ptr(size-1)} {
				if err := sim.MemcpyHtoD(at, []byte{l.fillValue}); err != nil {
					d.t.Fatalf("step %d: writing to the allocation at %#x: %v", d.steps, uint64(p), err)
				}
			}
		}
		d.live = append(d.live, l)
	case 3, 4: // free
		if len(d.live) == 0 {
			return
		}
		i := int(v % uint64(len(d.live)))
		if err := a.Free(d.live[i].ptr); err != nil {
			d.t.Fatalf("step %d: Free: %v", d.steps, err)
		}
		d.live[i] = d.live[len(d.live)-1]
		d.live = d.live[:len(d.live)-1]
	case 5: // record stream
		if len(d.live) == 0 {
			return
		}
		i := int(v % uint64(len(d.live)))
		s := d.streams[(v>>32)%uint64(len(d.streams))]
		if err := a.RecordStream(d.live[i].ptr, s); err != nil {
			d.t.Fatalf("step %d: RecordStream: %v", d.steps, err)
		}
		d.live[i].usedBy = append(d.live[i].usedBy, s)
	case 6: // the GPU makes progress on one stream, or on all
		if v%4 == 0 {
			sim.CompleteAll()
		} else {
			sim.CompleteStream(d.streams[v%uint64(len(d.streams))])
		}
	case 7:
		switch v % 4 {
		case 0:
			if err := a.EmptyCache(); err != nil {
				d.t.Fatalf("step %d: EmptyCache: %v", d.steps, err)
			}
			d.checkEmptied()
		case 1:
			sim.Faults().FailMalloc(1+int(v>>8)%3, nil) // a fault in one of the next device mallocs
		case 2:
			a.ResetPeakStats()
		default:
			_ = a.Snapshot()
		}
	}
}

// checkEmptied: after EmptyCache no segment is entirely free, but those
// of private pools with users (pools.go).
func (d *opDriver) checkEmptied() {
	for _, s := range d.a.Snapshot().Segments {
		if p := d.a.private[s.PoolID]; p != nil && p.uses > 0 {
			continue
		}
		if s.ActiveSize == 0 {
			d.t.Fatalf("step %d: after EmptyCache segment %#x (%d bytes) holds nothing active", d.steps, s.Address, s.TotalSize)
		}
	}
}

func (d *opDriver) check() {
	d.t.Helper()
	if err := d.a.Check(); err != nil {
		d.t.Fatalf("step %d: %v", d.steps, err)
	}
	st := d.a.Stats()
	var rounded, requested uint64
	for _, l := range d.live {
		rounded += l.rounded
		requested += l.size
	}
	// A block handed out whole (a large remainder of at most 1 MiB, or an
	// oversize block) counts in full, so allocated bytes can exceed the
	// rounded requests; Check pins the exact figure to the blocks.
	if got := uint64(st.AllocatedBytes[PoolAll].Current); got < rounded {
		d.t.Fatalf("step %d: allocated_bytes %d below the rounded live requests %d", d.steps, got, rounded)
	}
	if got := st.Allocation[PoolAll].Current; got != int64(len(d.live)) {
		d.t.Fatalf("step %d: allocation %d, model %d", d.steps, got, len(d.live))
	}
	if got := uint64(st.RequestedBytes[PoolAll].Current); got < requested {
		d.t.Fatalf("step %d: requested_bytes %d below the live requests %d", d.steps, got, requested)
	}
	if got, used := uint64(st.ReservedBytes[PoolAll].Current), d.sim.Used(); got != used {
		d.t.Fatalf("step %d: reserved_bytes %d, device holds %d", d.steps, got, used)
	}
	for _, s := range []*Stat{&st.AllocatedBytes[PoolAll], &st.ReservedBytes[PoolAll], &st.Active[PoolAll]} {
		if s.Peak < s.Current || s.Current < 0 {
			d.t.Fatalf("step %d: stat %+v has peak below current or is negative", d.steps, *s)
		}
	}
	if d.fill {
		var got [1]byte
		for _, l := range d.live {
			for _, at := range [2]cudart.Ptr{l.ptr, l.ptr + cudart.Ptr(l.size-1)} {
				if err := d.sim.MemcpyDtoH(got[:], at); err != nil {
					d.t.Fatalf("step %d: reading the live allocation at %#x: %v", d.steps, uint64(l.ptr), err)
				}
				if got[0] != l.fillValue {
					d.t.Fatalf("step %d: the live allocation at %#x (%d bytes) holds %#x at %#x, not %#x: its memory moved", d.steps, uint64(l.ptr), l.size, got[0], uint64(at), l.fillValue)
				}
			}
		}
	}
	// No two live allocations overlap.
	iv := make([]liveAlloc, len(d.live))
	copy(iv, d.live)
	sort.Slice(iv, func(i, j int) bool { return iv[i].ptr < iv[j].ptr })
	for i := 1; i < len(iv); i++ {
		if uint64(iv[i-1].ptr)+iv[i-1].rounded > uint64(iv[i].ptr) {
			d.t.Fatalf("step %d: live allocations [%#x,+%d) and [%#x,+%d) overlap", d.steps,
				uint64(iv[i-1].ptr), iv[i-1].rounded, uint64(iv[i].ptr), iv[i].rounded)
		}
	}
}

// finish frees everything, completes all events, empties the cache and
// checks that the device holds nothing.
func (d *opDriver) finish() {
	for _, l := range d.live {
		if err := d.a.Free(l.ptr); err != nil {
			d.t.Fatalf("final Free: %v", err)
		}
	}
	d.live = nil
	d.sim.Faults().FailMalloc(0, nil)
	if err := d.a.EmptyCache(); err != nil {
		d.t.Fatal(err)
	}
	d.check()
	if used := d.sim.Used(); used != 0 {
		d.t.Fatalf("after freeing everything and EmptyCache the device holds %d bytes", used)
	}
}

// TestModelRandom drives long random sequences against the model.
func TestModelRandom(t *testing.T) {
	steps := 6000
	if testing.Short() {
		steps = 1500
	}
	for _, conf := range []string{
		"",
		"max_split_size_mb:40",
		"roundup_power2_divisions:4",
		"garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
		"max_split_size_mb:20,max_non_split_rounding_mb:30,roundup_power2_divisions:[1:2,64:4,>:8]",
		"backend:cudaMallocAsync",
		"expandable_segments:True",
		"expandable_segments:True,max_split_size_mb:40",
		"expandable_segments:True,expandable_reclaim:coarse",
		"expandable_segments:True,roundup_power2_divisions:4,garbage_collection_threshold:0.5,per_process_memory_fraction:0.5",
	} {
		t.Run("conf="+conf, func(t *testing.T) {
			for seed := range uint64(3) {
				// 512 MiB: small enough that OOM and cache release happen.
				d := newOpDriver(t, 512*miB, conf)
				rng := rand.New(rand.NewPCG(seed, 99))
				for range steps {
					// Keep the live set bounded: free more often when large.
					op := byte(rng.IntN(8))
					if len(d.live) > 200 && op < 3 {
						op = 3
					}
					d.step(op, rng.Uint64())
				}
				d.finish()
			}
		})
	}
}

// TestModelExpandableCrossStream drives expandable segments (with
// allocd's reclaim) from four streams, with RecordStream and manually
// completed events, on a backed Sim: after every step Check holds, the
// model's invariants hold and every live allocation still holds what was
// written to it, while reclaim moves pages between the streams' ranges
// (which the run must do, or it covers nothing).
func TestModelExpandableCrossStream(t *testing.T) {
	steps := 3000
	if testing.Short() {
		steps = 800
	}
	var reclaims, across int64
	for seed := range uint64(3) {
		d := newOpDriverOn(t, 512*miB, "expandable_segments:True", 4, true)
		rng := rand.New(rand.NewPCG(seed, 7))
		for range steps {
			op := byte(rng.IntN(7)) // no EmptyCache, faults or resets: keep the cache to move
			if len(d.live) > 120 && op < 3 {
				op = 3
			}
			d.step(op, rng.Uint64())
		}
		st := d.a.Stats()
		reclaims += st.NumReclaims
		across += st.NumPagesMovedAcrossStreams
		d.finish()
	}
	t.Logf("%d reclaims, %d pages moved across streams", reclaims, across)
	if reclaims == 0 || across == 0 {
		t.Errorf("%d reclaims, %d pages moved across streams: the test exercised no cross-stream page reuse", reclaims, across)
	}
}

// TestModelExpandableLend drives expandable segments from four streams
// on a backed Sim too small for what they ask (192 MiB), with both
// reclaim policies, so that requests reach the out-of-memory path and
// borrow other streams' free blocks (which the run must do, or it covers
// nothing): after every step Check holds, no two live allocations
// overlap and each still holds what was written to it.
func TestModelExpandableLend(t *testing.T) {
	steps := 3000
	if testing.Short() {
		steps = 800
	}
	for _, conf := range []string{"expandable_segments:True", "expandable_segments:True,expandable_reclaim:coarse"} {
		t.Run("conf="+conf, func(t *testing.T) {
			var lends int64
			for seed := range uint64(3) {
				d := newOpDriverOn(t, 192*miB, conf, 4, true)
				rng := rand.New(rand.NewPCG(seed, 11))
				for range steps {
					op := byte(rng.IntN(8))
					if len(d.live) > 120 && op < 3 {
						op = 3
					}
					d.step(op, rng.Uint64())
				}
				lends += d.a.Stats().NumLends
				d.finish()
			}
			t.Logf("%d lends", lends)
			if lends == 0 {
				t.Error("no block was lent: the test covers nothing")
			}
		})
	}
}

// FuzzOps decodes the input as a sequence of 9-byte operations (an op byte
// and a 64-bit argument) and runs them, checking every invariant after each.
func FuzzOps(f *testing.F) {
	f.Add([]byte{0, 1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte("\x00\x10\x00\x00\x00\x00\x00\x00\x00\x05\x01\x00\x00\x00\x01\x00\x00\x00\x03\x00\x00\x00\x00\x00\x00\x00\x00\x06\x00\x00\x00\x00\x00\x00\x00\x00"))
	f.Add([]byte("\x07\x01\x00\x00\x00\x00\x00\x00\x00\x00\x08\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x00\x00\x00"))
	seed := make([]byte, 0, 9*64)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 64 {
		seed = append(seed, byte(rng.IntN(8)))
		seed = binary.LittleEndian.AppendUint64(seed, rng.Uint64())
	}
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 9*2000 {
			data = data[:9*2000]
		}
		d := newOpDriver(t, 256*miB, "max_split_size_mb:64")
		for len(data) >= 9 {
			d.step(data[0], binary.LittleEndian.Uint64(data[1:9]))
			data = data[9:]
		}
		d.finish()
	})
}
