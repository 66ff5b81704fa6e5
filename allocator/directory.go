package allocator

// The segment directory: every segment by address, for Free to find the
// shard of a block's stream without a lock.
//
// A published directory never changes: dirAdd and dirRemove (world mode)
// build a new one and swap the pointer, and a Free searches whichever one
// it loaded. Up to dirFlatMax segments the directory is one sorted array
// (one chunk), copied whole on a change, as cheap as a device malloc's
// other work at that size. Beyond, so that a change copies far less than
// the whole directory, it has two levels: the entries, sorted by address,
// in chunks of dirChunkMin to dirChunkMax entries, and a top level holding
// each chunk's last end. A new directory shares every chunk but the one or
// two a change rewrites, and copies the top level: O(dirChunkMax +
// n/dirChunkMin) per change instead of O(n), so a trace that grows to
// 40,000 segments no longer copies 40,000²/2 entries. It becomes one array
// again when it shrinks to dirFlatMax/2 entries.
//
// A lookup in a directory of one chunk reads what it read when the
// directory was always one array (the directory holds that chunk where its
// search reads it) and tests one more pointer; in a larger one it searches
// the top level, then one chunk.
//
// While one shard owns every segment (a program on one stream, the common
// case), the allocator's directory is only that shard and the count
// (lazy): a Free needs no search, since the shard's active map tells a
// foreign address apart, and a device malloc copies no entries. Kept in
// full, the directory of a one-stream trace of 205 segments made 1.8 MB
// of the 2.4 MB its cold replay allocated, garbage whose collections took
// half the replay's time on the simulated device. The first segment of a
// second shard builds the full directory from the segment table (dirAdd);
// a removal that leaves one shard owning every segment drops it again
// (dirRemove).

import (
	"cmp"
	"errors"
	"fmt"
	"iter"
	"math/bits"
	"slices"
	"sort"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// dirChunkMax and dirChunkMin bound a chunk's entries. A change copies a
// chunk of up to dirChunkMax entries (32 bytes each, with its end) and the
// top level (16 bytes a chunk, of some 100 entries on average); 128
// balances the two at some 25,000 segments and keeps a chunk's ends (the
// search's) in 1 KiB.
// dirFlatMax is the most entries of a directory of one chunk: up to
// there a lookup costs what it did in one array.
const (
	dirChunkMax = 128
	dirChunkMin = dirChunkMax / 4
	dirFlatMax  = 1024
)

// dirEntry is one segment of the directory.
type dirEntry struct {
	start, end uint64
	sh         *shard
}

// dirChunk is a run of the directory's entries in address order, never
// empty. sh is the shard of all of them when one shard has them all.
type dirChunk struct {
	ends    []uint64 // entries' ends, which Free searches: 8 bytes each against a dirEntry's 24
	entries []dirEntry
	sh      *shard
}

// directory is the segments by address, in chunks; tops[k] is the last
// end of chunks[k]. one is the shard that owns every segment when a
// single one does (a program on one stream): Free then skips the search,
// and the shard's active map tells a foreign address apart. ends and
// entries are the chunk's when there is one chunk, nil otherwise. The
// zero directory is the empty one.
type directory struct {
	one     *shard
	ends    []uint64
	entries []dirEntry
	tops    []uint64
	chunks  []*dirChunk
	n       int         // entries in all
	fast    *granuleMap // the shard of each 2 MiB granule (dirfast.go)
	// lazy: one owns all n segments and the directory holds nothing else
	// (see above).
	lazy bool
}

// newChunk returns the chunk of entries d (not empty; it keeps d).
func newChunk(d []dirEntry) *dirChunk {
	c := &dirChunk{ends: make([]uint64, len(d)), entries: d, sh: d[0].sh}
	for i, e := range d {
		c.ends[i] = e.end
		if e.sh != c.sh {
			c.sh = nil
		}
	}
	return c
}

// chunked returns chunks of d's entries in order, all of the same length
// give or take one and none over dirChunkMax: one when d has at most
// dirChunkMax, otherwise each at least dirChunkMax/2.
func chunked(d []dirEntry) []*dirChunk {
	k := (len(d) + dirChunkMax - 1) / dirChunkMax
	cs := make([]*dirChunk, k)
	for i := range k {
		lo, hi := i*len(d)/k, (i+1)*len(d)/k
		cs[i] = newChunk(d[lo:hi:hi])
	}
	return cs
}

// chunksOf returns the chunks of a directory of entries d (in address
// order; it keeps d): one chunk up to dirFlatMax entries, chunked beyond.
func chunksOf(d []dirEntry) []*dirChunk {
	switch {
	case len(d) == 0:
		return nil
	case len(d) <= dirFlatMax:
		return []*dirChunk{newChunk(d)}
	}
	return chunked(d)
}

// newDirectory returns the directory of entries d, which are in address
// order; it keeps d.
func newDirectory(d []dirEntry) *directory {
	dir := (&directory{}).splice(0, 0, len(d), chunksOf(d)...)
	dir.fast = granuleMapOf(dir)
	return dir
}

// splice returns a directory with dir's chunks but chunks[i:j] replaced by
// cs, holding n entries in all.
func (dir *directory) splice(i, j, n int, cs ...*dirChunk) *directory {
	chunks := make([]*dirChunk, 0, len(dir.chunks)-(j-i)+len(cs))
	chunks = append(chunks, dir.chunks[:i]...)
	chunks = append(chunks, cs...)
	chunks = append(chunks, dir.chunks[j:]...)
	nd := &directory{tops: make([]uint64, len(chunks)), chunks: chunks, n: n}
	if len(chunks) > 0 {
		nd.one = chunks[0].sh
	}
	if len(chunks) == 1 {
		nd.ends, nd.entries = chunks[0].ends, chunks[0].entries
	}
	for k, c := range chunks {
		nd.tops[k] = c.ends[len(c.ends)-1]
		if c.sh != nd.one {
			nd.one = nil
		}
	}
	return nd
}

// chunkOf returns the index of the chunk where an entry starting at start
// is or belongs: the first whose last entry starts at or above start, or
// the last chunk. dir must not be empty.
func (dir *directory) chunkOf(start uint64) int {
	return sort.Search(len(dir.chunks)-1, func(k int) bool {
		d := dir.chunks[k].entries
		return d[len(d)-1].start >= start
	})
}

// add returns dir with e added, before any entry that starts at or above
// e.start. A directory of one chunk that grows past dirFlatMax is
// chunked; one chunk of several that grows past dirChunkMax is split in
// two halves.
func (dir *directory) add(e dirEntry) *directory {
	nd := dir.addEntry(e)
	nd.fast = dir.fast.withSpan(nd, e.start, e.end, e.sh, true)
	return nd
}

// addEntry is add but for the granule map, which add then updates.
func (dir *directory) addEntry(e dirEntry) *directory {
	if len(dir.chunks) == 0 {
		return dir.splice(0, 0, 1, newChunk([]dirEntry{e}))
	}
	k := dir.chunkOf(e.start)
	old := dir.chunks[k].entries
	i := sort.Search(len(old), func(i int) bool { return old[i].start >= e.start })
	d := make([]dirEntry, 0, len(old)+1)
	d = append(d, old[:i]...)
	d = append(d, e)
	d = append(d, old[i:]...)
	if len(dir.chunks) == 1 {
		return dir.splice(0, 1, dir.n+1, chunksOf(d)...)
	}
	return dir.splice(k, k+1, dir.n+1, chunked(d)...)
}

// remove returns dir without its first entry that starts at start, and
// that entry; dir itself and false when there is none. A directory of
// several chunks left with dirFlatMax/2 entries becomes one chunk; else a
// chunk left with fewer than dirChunkMin entries is merged with a
// neighbour (and the two split again in halves when they hold more than
// dirChunkMax).
func (dir *directory) remove(start uint64) (*directory, dirEntry, bool) {
	nd, e, ok := dir.removeEntry(start)
	if ok {
		nd.fast = dir.fast.withSpan(nd, e.start, e.end, e.sh, false)
	}
	return nd, e, ok
}

// removeEntry is remove but for the granule map, which remove then updates.
func (dir *directory) removeEntry(start uint64) (*directory, dirEntry, bool) {
	if len(dir.chunks) == 0 {
		return dir, dirEntry{}, false
	}
	k := dir.chunkOf(start)
	old := dir.chunks[k].entries
	i := sort.Search(len(old), func(i int) bool { return old[i].start >= start })
	if i == len(old) || old[i].start != start {
		return dir, dirEntry{}, false
	}
	e := old[i]
	if len(dir.chunks) > 1 && dir.n-1 <= dirFlatMax/2 {
		d := make([]dirEntry, 0, dir.n-1)
		for j, c := range dir.chunks {
			if j == k {
				d = append(d, old[:i]...)
				d = append(d, old[i+1:]...)
			} else {
				d = append(d, c.entries...)
			}
		}
		return dir.splice(0, len(dir.chunks), dir.n-1, newChunk(d)), e, true
	}
	switch {
	case len(old) == 1:
		return dir.splice(k, k+1, dir.n-1), e, true
	case len(old) > dirChunkMin || len(dir.chunks) == 1:
		d := make([]dirEntry, 0, len(old)-1)
		d = append(d, old[:i]...)
		d = append(d, old[i+1:]...)
		return dir.splice(k, k+1, dir.n-1, newChunk(d)), e, true
	}
	lo := k
	if k+1 == len(dir.chunks) {
		lo = k - 1
	}
	d := make([]dirEntry, 0, len(dir.chunks[lo].entries)+len(dir.chunks[lo+1].entries)-1)
	for j := lo; j <= lo+1; j++ {
		if x := dir.chunks[j].entries; j == k {
			d = append(d, x[:i]...)
			d = append(d, x[i+1:]...)
		} else {
			d = append(d, x...)
		}
	}
	return dir.splice(lo, lo+2, dir.n-1, chunked(d)...), e, true
}

// all yields the directory's entries in address order.
func (dir *directory) all() iter.Seq[dirEntry] {
	return func(yield func(dirEntry) bool) {
		for _, c := range dir.chunks {
			for _, e := range c.entries {
				if !yield(e) {
					return
				}
			}
		}
	}
}

// firstAbove returns the index of the first of ends (ascending) above p,
// or len(ends), by a search whose only branch is the loop's: each step
// adds half or nothing by a mask from the comparison's borrow, so the
// search pays no mispredicted branches (the compiler keeps a branch for
// an if in this loop).
func firstAbove(ends []uint64, p uint64) int {
	i, n := 0, len(ends)
	for n > 1 {
		half := n / 2
		_, above := bits.Sub64(p, ends[i+half-1], 0) // 1 when that end is above p
		i += half & int(above-1)
		n -= half
	}
	if n == 1 && ends[i] <= p {
		i++
	}
	return i
}

// dirLookup returns the shard whose segment holds address p, without
// locking, or nil.
func (a *Allocator) dirLookup(p uint64) *shard {
	dir := a.dir.Load()
	if dir.one != nil {
		return dir.one
	}
	if sh, ok := dir.fast.lookup(p); ok {
		return sh
	}
	ends, entries := dir.ends, dir.entries
	if ends == nil { // not one chunk: find p's
		k := firstAbove(dir.tops, p)
		if k >= len(dir.chunks) {
			return nil
		}
		c := dir.chunks[k]
		ends, entries = c.ends, c.entries
	}
	if i := firstAbove(ends, p); i < len(entries) && entries[i].start <= p {
		return entries[i].sh
	}
	return nil
}

// dirAdd and dirRemove publish a new directory with seg added or removed,
// and count the segments of seg's shard (world mode). seg is already in
// the segment table when dirAdd is called, and no longer in it when
// dirRemove is. A directory whose segments are all one shard's is lazy
// (see the top of this file).
func (a *Allocator) dirAdd(seg *blocks.Segment) {
	sh := a.shardOf(cudart.Stream(seg.Stream))
	sh.segments++
	switch dir := a.dir.Load(); {
	case dir.n == 0 || dir.lazy && dir.one == sh:
		a.dir.Store(&directory{one: sh, n: dir.n + 1, lazy: true})
	case dir.lazy:
		a.dir.Store(a.fullDirectory())
	default:
		a.dir.Store(dir.add(dirEntry{seg.Ptr, seg.Ptr + seg.Size, sh}))
	}
}

func (a *Allocator) dirRemove(seg *blocks.Segment) {
	dir := a.dir.Load()
	if dir.lazy {
		if cudart.Stream(seg.Stream) != dir.one.stream {
			return // not in the directory
		}
		dir.one.segments--
		nd := &directory{}
		if dir.n > 1 {
			nd = &directory{one: dir.one, n: dir.n - 1, lazy: true}
		}
		a.dir.Store(nd)
		return
	}
	if nd, e, ok := dir.remove(seg.Ptr); ok {
		e.sh.segments--
		if nd.one != nil {
			nd = &directory{one: nd.one, n: nd.n, lazy: true}
		}
		a.dir.Store(nd)
	}
}

// fullDirectory returns the full directory of the segment table's
// segments (world mode).
func (a *Allocator) fullDirectory() *directory {
	d := make([]dirEntry, 0, len(a.segs.list))
	for _, s := range a.segs.list {
		d = append(d, dirEntry{s.Ptr, s.Ptr + s.Size, a.shardOf(cudart.Stream(s.Stream))})
	}
	slices.SortFunc(d, func(x, y dirEntry) int { return cmp.Compare(x.start, y.start) })
	return newDirectory(d)
}

// check reports broken invariants of the directory's structure: chunks
// within their bounds, ends and tops that are the entries', entries in
// address order without overlap, the shards of chunks and directory, and
// the count.
func (dir *directory) check() []error {
	var errs []error
	if dir.lazy {
		if dir.one == nil || dir.n < 1 || dir.chunks != nil || dir.tops != nil || dir.ends != nil || dir.entries != nil || dir.fast != nil {
			errs = append(errs, fmt.Errorf("directory: lazy, with shard %p, %d segments and entries", dir.one, dir.n))
		}
		return errs
	}
	if len(dir.tops) != len(dir.chunks) {
		errs = append(errs, fmt.Errorf("directory: %d chunks, %d tops", len(dir.chunks), len(dir.tops)))
	}
	if len(dir.chunks) == 1 {
		if c := dir.chunks[0]; len(dir.ends) != len(c.ends) || len(dir.entries) != len(c.entries) ||
			len(c.ends) > 0 && &dir.ends[0] != &c.ends[0] || len(c.entries) > 0 && &dir.entries[0] != &c.entries[0] {
			errs = append(errs, errors.New("directory: its one chunk is not the one its search reads"))
		}
	} else if dir.ends != nil || dir.entries != nil {
		errs = append(errs, fmt.Errorf("directory: %d chunks, and one for its search", len(dir.chunks)))
	}
	var n int
	var prev *dirEntry
	var one *shard
	for k, c := range dir.chunks {
		d := c.entries
		switch {
		case len(d) == 0:
			errs = append(errs, fmt.Errorf("directory: chunk %d is empty", k))
			continue
		case len(dir.chunks) == 1 && len(d) > dirFlatMax:
			errs = append(errs, fmt.Errorf("directory: its one chunk holds %d entries, above %d", len(d), dirFlatMax))
		case len(dir.chunks) > 1 && len(d) > dirChunkMax:
			errs = append(errs, fmt.Errorf("directory: chunk %d holds %d entries, above %d", k, len(d), dirChunkMax))
		case len(d) < dirChunkMin && len(dir.chunks) > 1:
			errs = append(errs, fmt.Errorf("directory: chunk %d holds %d entries, below %d", k, len(d), dirChunkMin))
		}
		if len(c.ends) != len(d) {
			errs = append(errs, fmt.Errorf("directory: chunk %d has %d ends for %d entries", k, len(c.ends), len(d)))
		}
		if k < len(dir.tops) && dir.tops[k] != d[len(d)-1].end {
			errs = append(errs, fmt.Errorf("directory: chunk %d ends at %#x, its top says %#x", k, d[len(d)-1].end, dir.tops[k]))
		}
		sh := d[0].sh
		if k == 0 {
			one = sh
		}
		for i := range d {
			e := &d[i]
			n++
			if i < len(c.ends) && c.ends[i] != e.end {
				errs = append(errs, fmt.Errorf("directory: entry %#x ends at %#x, its chunk says %#x", e.start, e.end, c.ends[i]))
			}
			if e.start >= e.end {
				errs = append(errs, fmt.Errorf("directory: entry %#x ends at %#x", e.start, e.end))
			}
			if prev != nil && prev.end > e.start {
				errs = append(errs, fmt.Errorf("directory entries overlap or are out of order at %#x", e.start))
			}
			if e.sh != sh {
				sh = nil
			}
			if e.sh != one {
				one = nil
			}
			prev = e
		}
		if c.sh != sh {
			errs = append(errs, fmt.Errorf("directory: chunk %d says its shard is %p, its entries' is %p", k, c.sh, sh))
		}
	}
	if n != dir.n {
		errs = append(errs, fmt.Errorf("directory: counts %d entries, holds %d", dir.n, n))
	}
	if len(dir.chunks) > 1 && n <= dirFlatMax/2 {
		errs = append(errs, fmt.Errorf("directory: %d chunks for %d entries, at most %d, which one chunk holds", len(dir.chunks), n, dirFlatMax/2))
	}
	if dir.one != one {
		errs = append(errs, fmt.Errorf("directory: says %p owns every segment, the entries say %p", dir.one, one))
	}
	return append(errs, dir.checkGranules()...)
}
