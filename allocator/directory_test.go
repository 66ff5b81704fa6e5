package allocator

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// benchDirectory is a directory of n segments of 2 to 6 MiB, with a gap
// after every other one, alternating between two shards (so that Free's
// search runs), and 4096 addresses to look up: in segments, in gaps and
// outside, in a random order.
func benchDirectory(n int) (*directory, []uint64) {
	shards := []*shard{newShard(1), newShard(2)}
	rng := rand.New(rand.NewPCG(uint64(n), 1))
	d := make([]dirEntry, 0, n)
	addr := uint64(1 << 30)
	for i := range n {
		size := uint64(2<<20) * uint64(1+rng.IntN(3))
		d = append(d, dirEntry{addr, addr + size, shards[i%2]})
		addr += size + uint64(i%2)<<20
	}
	probes := make([]uint64, 4096)
	for i := range probes {
		probes[i] = 1<<30 - 1<<20 + rng.Uint64N(addr-1<<30+2<<20)
	}
	return newDirectory(d), probes
}

// BenchmarkDirLookup is Free's search of the segment directory, for
// directories of tens to tens of thousands of segments.
func BenchmarkDirLookup(b *testing.B) {
	for _, n := range []int{16, 256, 4096, 40000} {
		b.Run(fmt.Sprintf("segments=%d", n), func(b *testing.B) {
			a := &Allocator{}
			dir, probes := benchDirectory(n)
			a.dir.Store(dir)
			var found int
			i := 0
			for b.Loop() {
				if a.dirLookup(probes[i&(len(probes)-1)]) != nil {
					found++
				}
				i++
			}
			if found == 0 {
				b.Fatal("no address found")
			}
		})
	}
}

// lookupScan is dirLookup by a scan of d: the shard of the segment that
// holds p, or the shard of every segment when one shard has them all.
func lookupScan(d []dirEntry, p uint64) *shard {
	if len(d) > 0 && !slices.ContainsFunc(d, func(e dirEntry) bool { return e.sh != d[0].sh }) {
		return d[0].sh
	}
	for _, e := range d {
		if e.start <= p && p < e.end {
			return e.sh
		}
	}
	return nil
}

// checkDirectory checks a's directory's structure and that it holds
// exactly d (in address order), and, unless every is 0, compares
// dirLookup with lookupScan outside every segment and at, around and
// between the bounds of every every-th segment and of the first and last
// of each chunk.
func checkDirectory(t *testing.T, a *Allocator, d []dirEntry, every int, what string) {
	t.Helper()
	dir := a.dir.Load()
	for _, err := range dir.check() {
		t.Fatalf("%s: %v", what, err)
	}
	if dir.lazy {
		if dir.n != len(d) || slices.ContainsFunc(d, func(e dirEntry) bool { return e.sh != dir.one }) {
			t.Fatalf("%s: a lazy directory of %d segments of shard %p, want %d segments", what, dir.n, dir.one, len(d))
		}
	} else {
		var got []dirEntry
		for e := range dir.all() {
			got = append(got, e)
		}
		if !slices.Equal(got, d) {
			t.Fatalf("%s: directory holds %d entries, want %d (or they differ)", what, len(got), len(d))
		}
	}
	if every == 0 {
		return
	}
	probes := []uint64{0, 1, 1<<21 - 1, 1 << 62, ^uint64(0)}
	around := func(e dirEntry) {
		probes = append(probes, e.start-1, e.start, e.start+1, (e.start+e.end)/2, e.end-1, e.end, e.end+1)
	}
	i := 0
	for _, c := range dir.chunks {
		for j, e := range c.entries {
			if i%every == 0 || j == 0 || j == len(c.entries)-1 {
				around(e)
			}
			i++
		}
	}
	if dir.lazy {
		for j, e := range d {
			if j%every == 0 {
				around(e)
			}
		}
	}
	for _, p := range probes {
		if got, want := a.dirLookup(p), lookupScan(d, p); got != want {
			t.Fatalf("%s: address %#x found in shard %p, want %p", what, p, got, want)
		}
	}
}

// TestDirLookup compares the directory's search with a linear scan, for
// every address at and around each segment's bounds, over directories
// built whole of every length up to 33 and around one, two and many
// chunks, with gaps between some segments. (A directory of one stream's
// segments answers that stream for every address.)
func TestDirLookup(t *testing.T) {
	shards := []*shard{newShard(1), newShard(2)}
	lengths := []int{dirChunkMax - 1, dirChunkMax, dirChunkMax + 1, 1000, dirFlatMax, dirFlatMax + 1, 5000}
	for n := 0; n <= 33; n++ {
		lengths = append(lengths, n)
	}
	for _, n := range lengths {
		for _, mixed := range []bool{false, true} {
			var d []dirEntry
			addr := uint64(1 << 21)
			for i := range n {
				size := uint64(2<<20) * uint64(1+i%3)
				sh := shards[0]
				if mixed && i%5 == 3 {
					sh = shards[1]
				}
				d = append(d, dirEntry{addr, addr + size, sh})
				addr += size + uint64(i%2)<<20 // a gap after every other segment
			}
			a := &Allocator{}
			a.dir.Store(newDirectory(slices.Clone(d)))
			checkDirectory(t, a, d, 1, fmt.Sprintf("%d segments (mixed %v)", n, mixed))
		}
	}
}

// TestDirAddRemove runs random sequences of dirAdd and dirRemove, growing
// the directory past several chunks and shrinking it to nothing, on one
// stream and on several, and checks its structure, its contents and every
// shard's segment count (after every change while it is small, every 5th
// beyond), and lookups against a scan (after every 50th change, and every
// change while it is smaller).
func TestDirAddRemove(t *testing.T) {
	const slots = 4 * dirFlatMax // segment i lies in [slot i, slot i+1), with room around it
	const slot = 8 << 20
	for seed := range uint64(4) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 25))
			a := &Allocator{byStream: map[cudart.Stream]*shard{}}
			a.dir.Store(&directory{})
			for s := range cudart.Stream(3) {
				a.byStream[s] = newShard(s)
			}
			streams := 1 + int(seed%3)        // 1, 2 or 3 streams
			var bySlot [slots]*blocks.Segment // the live segments, in address order
			var live []int                    // their slots
			steps := 7 * dirFlatMax           // to about 1.7 × dirFlatMax segments and back
			if testing.Short() {
				steps = dirFlatMax
			}
			maxChunks, flattened := 0, false
			for step := range steps {
				// Grow for the first 40%, then shrink, with churn both ways.
				grow := step < steps*2/5
				add := len(live) == 0 || rng.IntN(10) < map[bool]int{true: 8, false: 3}[grow]
				if add && len(live) < slots {
					i := rng.IntN(slots)
					for bySlot[i] != nil {
						i = (i + 1) % slots
					}
					seg := &blocks.Segment{Ptr: 1<<30 + uint64(i)*slot + uint64(rng.IntN(4))<<20, Size: uint64(1+rng.IntN(4)) << 20, Stream: uint64(rng.IntN(streams))}
					bySlot[i] = seg
					live = append(live, i)
					seg.Index = len(a.segs.list)
					a.segs.add(seg) // dirAdd builds a full directory from the table
					a.dirAdd(seg)
				} else {
					j := rng.IntN(len(live))
					i := live[j]
					live[j] = live[len(live)-1]
					live = live[:len(live)-1]
					a.segs.remove(bySlot[i])
					a.dirRemove(bySlot[i])
					bySlot[i] = nil
				}
				if len(live) > 2*dirChunkMax && step%5 != 0 {
					continue
				}
				var d []dirEntry
				counts := map[*shard]int{}
				for _, s := range bySlot {
					if s != nil {
						sh := a.byStream[cudart.Stream(s.Stream)]
						d = append(d, dirEntry{s.Ptr, s.Ptr + s.Size, sh})
						counts[sh]++
					}
				}
				every := 0
				if len(live) <= dirChunkMin || step%50 == 0 {
					every = 1 + len(live)/64
				}
				checkDirectory(t, a, d, every, fmt.Sprintf("step %d, %d segments", step, len(live)))
				if one := len(d) > 0 && !slices.ContainsFunc(d, func(e dirEntry) bool { return e.sh != d[0].sh }); one != a.dir.Load().lazy {
					t.Fatalf("step %d: lazy %v, and one shard owns every segment: %v", step, a.dir.Load().lazy, one)
				}
				chunks := len(a.dir.Load().chunks)
				flattened = flattened || maxChunks > 1 && chunks == 1
				maxChunks = max(maxChunks, chunks)
				for _, sh := range a.byStream {
					if sh.segments != counts[sh] {
						t.Fatalf("step %d: stream %d counts %d segments, holds %d", step, sh.stream, sh.segments, counts[sh])
					}
				}
			}
			if !testing.Short() && streams > 1 && (maxChunks < 8 || !flattened) {
				t.Errorf("the directory grew to %d chunks and became one again: %v; want 8 or more, and true", maxChunks, flattened)
			}
			if streams == 1 && maxChunks > 0 {
				t.Errorf("the directory of one stream's segments grew to %d chunks; want it lazy", maxChunks)
			}
			for _, i := range live {
				a.segs.remove(bySlot[i])
				a.dirRemove(bySlot[i])
			}
			checkDirectory(t, a, nil, 1, "emptied")
			if len(a.dir.Load().chunks) != 0 {
				t.Errorf("%d chunks left in an empty directory", len(a.dir.Load().chunks))
			}
		})
	}
}

// TestDirCheck: the directory's check finds each kind of broken structure.
func TestDirCheck(t *testing.T) {
	sh1, sh2 := newShard(1), newShard(2)
	entries := func(n int, sh *shard) []dirEntry {
		d := make([]dirEntry, n)
		for i := range d {
			d[i] = dirEntry{uint64(i+1) << 21, uint64(i+1)<<21 + 1<<20, sh}
		}
		return d
	}
	tests := []struct {
		name  string
		dir   func() *directory
		wants string
	}{
		{"overlap", func() *directory {
			d := entries(10, sh1)
			d[4].end = d[5].start + 1
			return newDirectory(d)
		}, "overlap"},
		{"out of order", func() *directory {
			d := entries(10, sh1)
			d[4], d[5] = d[5], d[4]
			return newDirectory(d)
		}, "out of order"},
		{"empty entry", func() *directory {
			d := entries(10, sh1)
			d[3].end = d[3].start
			return newDirectory(d)
		}, "ends at"},
		{"wrong top", func() *directory {
			dir := newDirectory(entries(2000, sh1))
			dir.tops[1]++
			return dir
		}, "its top says"},
		{"wrong end", func() *directory {
			dir := newDirectory(entries(2000, sh1))
			dir.chunks[2].ends[5]++
			return dir
		}, "its chunk says"},
		{"one chunk too large", func() *directory {
			d := entries(dirFlatMax+1, sh1)
			return (&directory{}).splice(0, 0, len(d), newChunk(d))
		}, "above"},
		{"chunk too large", func() *directory {
			d := entries(dirFlatMax, sh1)
			return (&directory{}).splice(0, 0, len(d), append([]*dirChunk{newChunk(d[:dirChunkMax+1])}, chunked(d[dirChunkMax+1:])...)...)
		}, "above"},
		{"chunk too small", func() *directory {
			d := entries(dirFlatMax, sh1)
			return (&directory{}).splice(0, 0, len(d), append([]*dirChunk{newChunk(d[:1])}, chunked(d[1:])...)...)
		}, "below"},
		{"chunks for few entries", func() *directory {
			d := entries(100, sh1)
			return (&directory{}).splice(0, 0, len(d), newChunk(d[:50]), newChunk(d[50:]))
		}, "which one chunk holds"},
		{"empty chunk", func() *directory {
			dir := newDirectory(entries(3, sh1))
			dir.chunks = append(dir.chunks, &dirChunk{})
			dir.tops = append(dir.tops, 0)
			return dir
		}, "is empty"},
		{"count", func() *directory {
			dir := newDirectory(entries(3, sh1))
			dir.n++
			return dir
		}, "counts 4 entries"},
		{"one shard claimed", func() *directory {
			d := entries(2000, sh1)
			d[200].sh = sh2
			dir := newDirectory(d)
			dir.one = sh1
			return dir
		}, "owns every segment"},
		{"one shard missed", func() *directory {
			dir := newDirectory(entries(2000, sh1))
			dir.one = nil
			return dir
		}, "owns every segment"},
		{"search's chunk", func() *directory {
			dir := newDirectory(entries(3, sh1))
			dir.ends = slices.Clone(dir.ends)
			return dir
		}, "not the one its search reads"},
		{"search's chunk among several", func() *directory {
			dir := newDirectory(entries(2000, sh1))
			dir.entries = dir.chunks[0].entries
			return dir
		}, "one for its search"},
		{"chunk shard", func() *directory {
			d := entries(2000, sh1)
			d[200].sh = sh2
			dir := newDirectory(d)
			dir.chunks[0].sh = nil
			return dir
		}, "says its shard"},
	}
	for _, tc := range tests {
		errs := tc.dir().check()
		if len(errs) == 0 || !strings.Contains(errors.Join(errs...).Error(), tc.wants) {
			t.Errorf("%s: check says %v, want an error with %q", tc.name, errs, tc.wants)
		}
	}
	for _, n := range []int{0, 1, dirChunkMax, dirFlatMax, dirFlatMax + 1, 5000} {
		if errs := newDirectory(entries(n, sh1)).check(); len(errs) != 0 {
			t.Errorf("directory of %d entries: %v", n, errs)
		}
	}
}

// TestCheckCatchesDirectoryFaults: Check finds a segment missing from the
// directory, one there twice, one under the wrong shard and a chunk whose
// top is wrong, in a directory of several chunks.
func TestCheckCatchesDirectoryFaults(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 32 * giB})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	a, err := New(sim, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	s, _ := sim.StreamCreate()
	for i := range dirFlatMax + 3*dirChunkMax {
		mustMalloc(t, a, 12*miB, cudart.Stream(i%2)*s) // a 12 MiB segment each, on two streams
	}
	mustCheck(t, a)
	orig := a.dir.Load()
	if len(orig.chunks) < 3 {
		t.Fatalf("%d chunks for %d segments", len(orig.chunks), orig.n)
	}
	var entries []dirEntry
	for e := range orig.all() {
		entries = append(entries, e)
	}
	e := entries[dirChunkMax+5]
	other := entries[dirChunkMax+6].sh
	if other == e.sh {
		t.Fatal("neighbouring segments of one stream")
	}
	for _, tc := range []struct {
		name string
		dir  func() *directory
		want string
	}{
		{"missing", func() *directory { d, _, _ := orig.remove(e.start); return d }, "not in the directory"},
		{"twice", func() *directory { return orig.add(e) }, "two entries"},
		{"wrong shard", func() *directory {
			d := slices.Clone(entries)
			d[dirChunkMax+5].sh = other
			return newDirectory(d)
		}, "not in the directory under its shard"},
		{"granule of another shard", func() *directory {
			return withGranule(orig, e.start>>granuleShift, other)
		}, "its segments say"},
		{"granule of no segment", func() *directory {
			g := (entries[len(entries)-1].end + 1<<regionShift) >> granuleShift
			return withGranule(withGranule(orig, g, other), g+1, nil)
		}, "touched by segments"},
		{"wrong top", func() *directory {
			d := *orig
			d.tops = slices.Clone(d.tops)
			d.tops[1] += miB
			return &d
		}, "its top says"},
	} {
		a.lockWorld()
		a.dir.Store(tc.dir())
		a.unlockWorld()
		if err := a.Check(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Check = %v, want an error with %q", tc.name, err, tc.want)
		}
		a.lockWorld()
		a.dir.Store(orig)
		a.unlockWorld()
	}
	mustCheck(t, a)
}

// withGranule returns a copy of dir whose granule map holds sh for granule
// g (its region added when missing).
func withGranule(dir *directory, g uint64, sh *shard) *directory {
	d := *dir
	m := &granuleMap{keys: slices.Clone(dir.fast.keys), pages: slices.Clone(dir.fast.pages), mask: dir.fast.mask}
	key := g>>(regionShift-granuleShift) + 1
	i := m.slot(key)
	pg := new(dirPage)
	if m.keys[i] == key {
		*pg = *m.pages[i]
	}
	m.keys[i], m.pages[i] = key, pg
	pg[g&(granulesPerRegion-1)] = sh
	d.fast = m
	return &d
}

// TestGranuleMapAnswers: with segments in whole 2 MiB granules (as the
// device's are) on two streams, every Free's shard comes from the granule
// map, with no search, and is the segment's; a segment over several GiB
// fills whole regions with its shard's one page, and its removal drops
// them; one over mapMaxRegions is left to the search; and the map of
// every step passes the directory's check.
func TestGranuleMapAnswers(t *testing.T) {
	s1, s2 := newShard(1), newShard(2)
	a := &Allocator{}
	a.dir.Store(&directory{})
	var d []dirEntry
	addr := uint64(7) << 40
	for i := range 40 {
		size := uint64(2<<20) * uint64(1+i%5)
		switch i {
		case 17:
			size = 5<<30 + 6<<20 // past four whole regions
		case 30:
			size = 20 << 30 // beyond what the map holds: searched
		}
		sh := s1
		if i%3 == 1 {
			sh = s2
		}
		d = append(d, dirEntry{addr, addr + size, sh})
		addr += size + uint64(i%2)<<21 // a free granule after every other segment
	}
	for _, e := range d {
		a.dir.Store(a.dir.Load().add(e))
	}
	checkDirectory(t, a, d, 1, "built")
	dir := a.dir.Load()
	for i, e := range d {
		for _, p := range []uint64{e.start, e.start + 4096, (e.start + e.end) / 2, e.end - 512} {
			sh, ok := dir.fast.lookup(p)
			if i == 30 && ok {
				t.Fatalf("granule map at %#x in a 20 GiB segment: %p, true; want the search", p, sh)
			}
			if i != 30 && (!ok || sh != e.sh) {
				t.Fatalf("granule map at %#x: %p, %v; want %p, true", p, sh, ok, e.sh)
			}
			if got := a.dirLookup(p); got != e.sh {
				t.Fatalf("dirLookup(%#x) = %p, want %p", p, got, e.sh)
			}
		}
	}
	full := 0
	dir.fast.each(func(_ uint64, pg *dirPage) {
		if pg == s1.dirFull || pg == s2.dirFull {
			full++
		}
	})
	if full < 4 {
		t.Errorf("%d regions on a shard's full page, want 4 or more", full)
	}
	regions := dir.fast.regions()
	big := d[17]
	nd, _, _ := a.dir.Load().remove(big.start)
	a.dir.Store(nd)
	d = slices.Delete(d, 17, 18)
	checkDirectory(t, a, d, 1, "the big segment removed")
	if n := a.dir.Load().fast.regions(); n > regions-4 {
		t.Errorf("%d regions after removing a segment of five GiB, %d before", n, regions)
	}
	for len(d) > 0 {
		nd, _, _ := a.dir.Load().remove(d[len(d)/2].start)
		a.dir.Store(nd)
		d = slices.Delete(d, len(d)/2, len(d)/2+1)
		checkDirectory(t, a, d, 1, fmt.Sprintf("%d left", len(d)))
	}
	if n := a.dir.Load().fast.regions(); n != 0 {
		t.Errorf("%d regions in the map of an empty directory", n)
	}
}
