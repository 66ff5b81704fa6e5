package allocator

// The directory's granule map: a Free's shard by the address's 2 MiB
// granule, in a few loads instead of a search.
//
// A directory of several shards' segments answered a Free with a binary
// search over every segment's end (firstAbove), ten or more dependent
// loads at a thousand segments, and the number of segments grows with the
// number of streams in use: on a 16-core host that search took 5% of the
// CPU of the mixed benchmark at 8 goroutines. Device memory comes in 2 MiB granules
// (cudaMalloc sizes are multiples of 2 MiB and its addresses aligned to
// them, as are the expandable ranges' and the simulated device's), so a
// granule is almost always wholly inside one segment. The map keeps, for
// each granule that some segment touches, the one shard whose segments
// cover all of it, or dirSearch when the segments touching it leave part
// of it uncovered or belong to several shards. dirLookup falls back to
// the search for those, for granules no segment in the map touches (a
// foreign address) and for segments too large to map (inMap), so its
// answers are exactly the search's.
//
// Granules are grouped in 1 GiB regions of 512, each a page of shard
// pointers; a small open-addressing table finds a region's page. Like the
// rest of the directory it never changes once published: a change copies
// the region table (up to two slots per GiB of segments) and the pages it
// rewrites, at most two beyond those its segment fills whole, which share
// one page per shard (shard.dirFull).

import (
	"fmt"
	"slices"
)

const (
	granuleShift      = 21 // 2 MiB
	regionShift       = 30 // 1 GiB
	granulesPerRegion = 1 << (regionShift - granuleShift)
)

// dirSearch marks a granule whose shard the map cannot tell: dirLookup
// searches the directory.
var dirSearch = &shard{}

// dirPage is one region's granules: nil where no segment touches the
// granule, the shard whose segments cover it whole, or dirSearch.
type dirPage [granulesPerRegion]*shard

// granuleMap is the map. The zero map is empty; a nil one has nothing.
type granuleMap struct {
	keys  []uint64   // region number + 1; 0 marks an empty slot
	pages []*dirPage // the region's page
	mask  uint64
}

func regionSlot(r, mask uint64) uint64 { return (r * 0x9E3779B97F4A7C15 >> 32) & mask }

// lookup returns the shard that owns address p and true, or false when
// the directory must be searched: p is in a granule that no mapped segment
// touches (a foreign address, or one of a segment too large to map), or
// in a dirSearch granule.
func (m *granuleMap) lookup(p uint64) (*shard, bool) {
	pg := m.page(p >> regionShift)
	if pg == nil {
		return nil, false
	}
	sh := pg[p>>granuleShift&(granulesPerRegion-1)]
	return sh, sh != nil && sh != dirSearch
}

// page returns region r's page, or nil.
func (m *granuleMap) page(r uint64) *dirPage {
	if m == nil || len(m.keys) == 0 {
		return nil
	}
	if i := m.slot(r + 1); m.keys[i] == r+1 {
		return m.pages[i]
	}
	return nil
}

// slot returns the index of key's slot, or of the empty slot where it
// would go.
func (m *granuleMap) slot(key uint64) uint64 {
	i := regionSlot(key, m.mask)
	for m.keys[i] != 0 && m.keys[i] != key {
		i = (i + 1) & m.mask
	}
	return i
}

// mapMaxRegions is the most regions a segment may span and be in the
// map. The expandable backend reserves one address range per stream, of
// the device's size; mapping those would make every change copy a region
// table of thousands of slots, so their addresses are searched instead.
const mapMaxRegions = 16

// inMap reports whether the map holds segment [start, end).
func inMap(start, end uint64) bool {
	return (end-1)>>regionShift-start>>regionShift < mapMaxRegions
}

// at returns what m holds for granule g.
func (m *granuleMap) at(g uint64) *shard {
	if pg := m.page(g >> (regionShift - granuleShift)); pg != nil {
		return pg[g&(granulesPerRegion-1)]
	}
	return nil
}

// each calls fn for every region and its page.
func (m *granuleMap) each(fn func(r uint64, pg *dirPage)) {
	if m == nil {
		return
	}
	for i, k := range m.keys {
		if k != 0 {
			fn(k-1, m.pages[i])
		}
	}
}

// regions returns how many regions m holds.
func (m *granuleMap) regions() int {
	n := 0
	m.each(func(uint64, *dirPage) { n++ })
	return n
}

// withSpan returns m after segment [start, end) was added to or removed
// from dir, which is the directory after the change.
func (m *granuleMap) withSpan(dir *directory, start, end uint64, sh *shard, adding bool) *granuleMap {
	if !inMap(start, end) {
		return m
	}
	// The regions rewritten (a segment touches few), their new pages, nil
	// for a region left without a segment.
	type change struct {
		r  uint64
		pg *dirPage
	}
	var changed []change
	pageFor := func(r uint64) *dirPage {
		for _, c := range changed {
			if c.r == r && c.pg != nil {
				return c.pg
			}
		}
		pg := new(dirPage)
		if old := m.page(r); old != nil {
			*pg = *old
		}
		changed = append(changed, change{r, pg})
		return pg
	}
	first, last := start>>granuleShift, (end-1)>>granuleShift
	for g := first; g <= last; {
		r := g >> (regionShift - granuleShift)
		rFirst := r << (regionShift - granuleShift)
		rLast := rFirst + granulesPerRegion - 1
		if g == rFirst && inside(rFirst, rLast, start, end) {
			var pg *dirPage
			if adding {
				pg = sh.fullPage()
			}
			changed = append(changed, change{r, pg})
			g = rLast + 1
			continue
		}
		pg := pageFor(r)
		for ; g <= min(last, rLast); g++ {
			switch {
			case !inside(g, g, start, end):
				// Other segments may touch the rest of it.
				pg[g&(granulesPerRegion-1)] = dir.granuleOwner(g)
			case adding:
				pg[g&(granulesPerRegion-1)] = sh
			default:
				pg[g&(granulesPerRegion-1)] = nil
			}
		}
	}
	// The new region table: a copy of m's with the changed regions'
	// pages, rebuilt when a region is left empty (an open-addressing table
	// drops a key by rebuilding) or the table would pass half full.
	// The copy has room for every changed region at most half full, so
	// that the loop below always finds an empty slot: a segment may span
	// up to mapMaxRegions regions, more than a small table's slots.
	count, rebuild := m.regions(), false
	size := 8
	for size < 2*(count+len(changed)) {
		size <<= 1
	}
	var nm *granuleMap
	if m != nil && len(m.keys) >= size {
		nm = &granuleMap{keys: slices.Clone(m.keys), pages: slices.Clone(m.pages), mask: m.mask}
	} else {
		nm = &granuleMap{keys: make([]uint64, size), pages: make([]*dirPage, size), mask: uint64(size - 1)}
		m.each(func(r uint64, pg *dirPage) {
			if pg != nil {
				i := nm.slot(r + 1)
				nm.keys[i], nm.pages[i] = r+1, pg
			}
		})
	}
	for _, c := range changed {
		if c.pg != nil && !adding && c.pg.empty() {
			c.pg = nil
		}
		key := c.r + 1
		i := nm.slot(key)
		switch {
		case nm.keys[i] == key:
			nm.pages[i] = c.pg
			rebuild = rebuild || c.pg == nil
		case c.pg != nil:
			nm.keys[i], nm.pages[i] = key, c.pg
			count++
			rebuild = rebuild || 2*count > len(nm.keys)
		}
	}
	if !rebuild {
		return nm
	}
	n := 8
	for n < 2*count {
		n <<= 1
	}
	rm := &granuleMap{keys: make([]uint64, n), pages: make([]*dirPage, n), mask: uint64(n - 1)}
	nm.each(func(r uint64, pg *dirPage) {
		if pg == nil {
			return
		}
		i := rm.slot(r + 1)
		rm.keys[i], rm.pages[i] = r+1, pg
	})
	return rm
}

// granuleMapOf returns the map of dir's segments, built in one pass: what
// adding them one by one (withSpan) would leave, without a copy of the
// table and of the pages each addition changes.
func granuleMapOf(dir *directory) *granuleMap {
	pages := map[uint64]*dirPage{}
	for e := range dir.all() {
		if !inMap(e.start, e.end) {
			continue
		}
		first, last := e.start>>granuleShift, (e.end-1)>>granuleShift
		for g := first; g <= last; {
			r := g >> (regionShift - granuleShift)
			rFirst := r << (regionShift - granuleShift)
			rLast := rFirst + granulesPerRegion - 1
			if g == rFirst && inside(rFirst, rLast, e.start, e.end) {
				pages[r] = e.sh.fullPage() // no other segment touches the region
				g = rLast + 1
				continue
			}
			pg := pages[r]
			if pg == nil {
				pg = new(dirPage)
				pages[r] = pg
			}
			for ; g <= min(last, rLast); g++ {
				if inside(g, g, e.start, e.end) {
					pg[g&(granulesPerRegion-1)] = e.sh
				} else {
					pg[g&(granulesPerRegion-1)] = dir.granuleOwner(g) // other segments may touch it
				}
			}
		}
	}
	if len(pages) == 0 {
		return nil
	}
	n := 8
	for n < 2*len(pages) {
		n <<= 1
	}
	m := &granuleMap{keys: make([]uint64, n), pages: make([]*dirPage, n), mask: uint64(n - 1)}
	for r, pg := range pages {
		i := m.slot(r + 1)
		m.keys[i], m.pages[i] = r+1, pg
	}
	return m
}

// inside reports whether granules first to last lie wholly in [start, end).
func inside(first, last, start, end uint64) bool {
	return first<<granuleShift >= start && (last+1)<<granuleShift <= end
}

func (pg *dirPage) empty() bool {
	for _, sh := range pg {
		if sh != nil {
			return false
		}
	}
	return true
}

// fullPage returns the page of a region whose granules are all sh's,
// shared by every such region (world mode: the directory changes there).
func (sh *shard) fullPage() *dirPage {
	if sh.dirFull == nil {
		sh.dirFull = new(dirPage)
		for i := range sh.dirFull {
			sh.dirFull[i] = sh
		}
	}
	return sh.dirFull
}

// granuleOwner returns what the granule map holds for granule g of dir:
// nil when no mapped segment touches it, the shard whose mapped segments
// cover it whole, dirSearch otherwise.
func (dir *directory) granuleOwner(g uint64) *shard {
	lo, hi := g<<granuleShift, (g+1)<<granuleShift
	var owner *shard
	var covered uint64
	k := firstAbove(dir.tops, lo)
	for ; k < len(dir.chunks); k++ {
		c := dir.chunks[k]
		i := 0
		if covered == 0 && owner == nil {
			i = firstAbove(c.ends, lo)
		}
		for ; i < len(c.entries); i++ {
			e := &c.entries[i]
			if e.start >= hi {
				return ownerOf(owner, covered)
			}
			if !inMap(e.start, e.end) {
				if owner != nil {
					return dirSearch
				}
				continue
			}
			if owner == nil {
				owner = e.sh
			} else if e.sh != owner {
				return dirSearch
			}
			covered += min(e.end, hi) - max(e.start, lo)
		}
	}
	return ownerOf(owner, covered)
}

func ownerOf(owner *shard, covered uint64) *shard {
	if owner == nil || covered == 1<<granuleShift {
		return owner
	}
	return dirSearch
}

// checkGranules reports where dir's granule map differs from its entries:
// every granule a mapped entry touches holds granuleOwner, and no other
// granule holds anything.
func (dir *directory) checkGranules() []error {
	var errs []error
	touched := 0
	lastG := ^uint64(0)
	for e := range dir.all() {
		if !inMap(e.start, e.end) {
			continue
		}
		first, last := e.start>>granuleShift, (e.end-1)>>granuleShift
		for g := first; g <= last; g++ {
			r := g >> (regionShift - granuleShift)
			rFirst := r << (regionShift - granuleShift)
			rLast := rFirst + granulesPerRegion - 1
			if g == rFirst && inside(rFirst, rLast, e.start, e.end) && dir.fast.page(r) == e.sh.dirFull {
				touched += granulesPerRegion
				g, lastG = rLast, rLast
				continue
			}
			if g != lastG {
				touched++
			}
			lastG = g
			want := e.sh
			if !inside(g, g, e.start, e.end) {
				want = dir.granuleOwner(g)
			}
			got := dir.fast.at(g)
			if got != want && len(errs) < 10 {
				errs = append(errs, fmt.Errorf("directory: granule %#x holds %p, its segments say %p", g<<granuleShift, got, want))
			}
		}
	}
	held := 0
	dir.fast.each(func(r uint64, pg *dirPage) {
		for _, sh := range pg {
			if sh != nil {
				held++
			}
		}
		if pg.empty() {
			errs = append(errs, fmt.Errorf("directory: region %#x has an empty page", r<<regionShift))
		}
	})
	if held != touched {
		errs = append(errs, fmt.Errorf("directory: %d granules in the map, %d touched by segments", held, touched))
	}
	return errs
}
