package vmm

import (
	"fmt"
	"slices"
	"time"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// Calls counts the driver's virtual memory calls a Space made and the time
// each kind took. Maps counts handles mapped (cuMemMap) and Grants the
// grants of access that went with them (cuMemSetAccess: one per range
// mapped in one call, so MapTime covers both); Unmaps counts cuMemUnmap
// calls, one per contiguous stretch of runs. Reserving and releasing
// address ranges, once per stream and pool, are not counted.
//
// Revived and Waits are not calls of virtual memory: Revived counts the
// runs mapped again through a standby mapping, which took no call (see
// "Standby mappings" in the package doc), and Waits the times the Space
// waited for a stream's queued work before unmapping or reusing memory
// (a stream synchronised by Settle, an event by a later unmapping or
// mapping; see "Reclaim without waiting"). SyncTime is the time of every
// call that reclaim makes to order memory against queued work: events
// created, recorded, queried, synchronised and destroyed, and streams
// synchronised (the waits' time included); it is not part of Total.
type Calls struct {
	Creates, Maps, Grants, Unmaps, Releases     int64
	CreateTime, MapTime, UnmapTime, ReleaseTime time.Duration
	Revived, Waits                              int64
	SyncTime                                    time.Duration
}

// Total is the time of every call counted.
func (c Calls) Total() time.Duration {
	return c.CreateTime + c.MapTime + c.UnmapTime + c.ReleaseTime
}

// Counts returns c without its times.
func (c Calls) Counts() Calls {
	return Calls{Creates: c.Creates, Maps: c.Maps, Grants: c.Grants, Unmaps: c.Unmaps, Releases: c.Releases, Revived: c.Revived, Waits: c.Waits}
}

// Sub returns c minus an earlier reading o: the calls made in between.
func (c Calls) Sub(o Calls) Calls {
	return Calls{
		Creates: c.Creates - o.Creates, Maps: c.Maps - o.Maps, Grants: c.Grants - o.Grants,
		Unmaps: c.Unmaps - o.Unmaps, Releases: c.Releases - o.Releases,
		CreateTime: c.CreateTime - o.CreateTime, MapTime: c.MapTime - o.MapTime,
		UnmapTime: c.UnmapTime - o.UnmapTime, ReleaseTime: c.ReleaseTime - o.ReleaseTime,
		Revived: c.Revived - o.Revived, Waits: c.Waits - o.Waits,
		SyncTime: c.SyncTime - o.SyncTime,
	}
}

// Calls returns the calls counted since New.
func (s *Space) Calls() Calls { return s.calls }

// cachedRun is a run that reclaim unmapped and kept: its handle, its
// length in pages of page bytes, the pool it was counted in (small), the
// stream whose range it left, and what it waits for. Its memory is still
// held from the device, so it counts as reserved (see "The handle cache"
// in the package doc).
type cachedRun struct {
	h           cudart.Handle
	pages, page uint64
	small       bool
	stream      uint64
	// pend is the work that may still use the run where it was, when
	// reclaim parked it without waiting (see pending.go).
	pend *pending
}

func (r cachedRun) bytes() uint64 { return r.pages * r.page }

// Cached returns the bytes of the handle cache in the small or the large
// pool: physical memory held but mapped nowhere, counted in Reserved.
func (s *Space) Cached(small bool) uint64 {
	var n uint64
	for _, r := range s.cache {
		if r.small == small {
			n += r.bytes()
		}
	}
	return n
}

// usable says whether a mapping into seg can map the cached run r: its
// pages are seg's and it is no longer than seg's runs may be, whichever
// pool it left (the small pool's one-page runs serve the large pool too).
func (s *Space) usable(r cachedRun, seg *blocks.Segment) bool {
	return r.page == seg.PageSize && r.pages <= s.maxRunPages(seg)
}

// cachedFor returns the cached bytes a mapping into seg can use.
func (s *Space) cachedFor(seg *blocks.Segment) uint64 {
	var n uint64
	for _, r := range s.cache {
		if s.usable(r, seg) {
			n += r.bytes()
		}
	}
	return n
}

// takeCached removes from the cache and returns the usable run that a
// mapping into seg of rem more pages should map next, with at most room
// pages available: the longest that rem covers,
// else the shortest longer one that fits in room (mapping past the
// request costs no reserved memory, the run being held already, and
// saves creating a run). It leaves out the runs in keepOut. ok is false
// when no cached run fits.
//
// Taking the shortest run that covers rem first would map fewer runs,
// but it leaves more pages mapped past requests and fewer in the cache:
// on a decoder's trace (gpt2m_generate) it raised peak reserved memory
// above PyTorch's.
func (s *Space) takeCached(seg *blocks.Segment, rem, room uint64, keepOut []cudart.Handle) (r cachedRun, ok bool) {
	best, over := -1, -1
	for i, c := range s.cache {
		if !s.usable(c, seg) || c.pages > room || slices.Contains(keepOut, c.h) ||
			s.capturing && !c.pend.settled() { // a capture may not wait (settled)
			continue
		}
		if c.pages <= rem {
			if best < 0 || c.pages > s.cache[best].pages {
				best = i
			}
		} else if over < 0 || c.pages < s.cache[over].pages {
			over = i
		}
	}
	if best < 0 {
		best = over
	}
	if best < 0 {
		return cachedRun{}, false
	}
	return s.takeAt(best), true
}

// takeAt removes the run at index i of the cache and returns it.
func (s *Space) takeAt(i int) cachedRun {
	r := s.cache[i]
	s.cache[i] = s.cache[len(s.cache)-1]
	s.cache = s.cache[:len(s.cache)-1]
	s.cachedBytes -= r.bytes()
	return r
}

// cachedIndex returns the place in the cache of the run of handle h, -1
// when h is not cached (mapped elsewhere).
func (s *Space) cachedIndex(h cudart.Handle) int {
	return slices.IndexFunc(s.cache, func(r cachedRun) bool { return r.h == h })
}

// revivable says whether the run of handle h is in the cache and, during
// a capture, settled (see pending.settled): whether a standby mapping of
// it can be taken back.
func (s *Space) revivable(h cudart.Handle) bool {
	i := s.cachedIndex(h)
	return i >= 0 && (!s.capturing || s.cache[i].pend.settled())
}

// Standby mappings (see the package doc): where each handle has them.

func (s *Space) addStandby(h cudart.Handle, p place) {
	if s.standbys == nil {
		s.standbys = make(map[cudart.Handle][]place)
	}
	s.standbys[h] = append(s.standbys[h], p)
}

func (s *Space) removeStandby(h cudart.Handle, p place) {
	ps := s.standbys[h]
	if i := slices.Index(ps, p); i >= 0 {
		ps = slices.Delete(ps, i, i+1)
	}
	if len(ps) == 0 {
		delete(s.standbys, h)
		return
	}
	s.standbys[h] = ps
}

// unmapStandby unmaps the standby mapping that starts at page i of es and
// forgets it. If the unmap fails, nothing changes.
func (s *Space) unmapStandby(es *expSegment, i uint64) error {
	return s.unmapStandbys(es, i, i+1, nil)
}

// unmapStandbys unmaps, in one call, the standby mapping that starts at
// page i of es and those that follow it back to back and start before
// page through, up to the first whose handle spare (when not nil) keeps,
// after waiting for the work each may still serve; and forgets them. If
// a wait or the unmap fails, nothing changes.
func (s *Space) unmapStandbys(es *expSegment, i, through uint64, spare func(cudart.Handle) bool) error {
	j := i
	for j < min(through, uint64(len(es.standby))) && es.standby[j] > 0 && (j == i || spare == nil || !spare(es.sbHandles[j])) {
		if err := s.wait(es.sbPend[j]); err != nil {
			return err
		}
		j += uint64(es.standby[j])
	}
	page := es.seg.PageSize
	if err := s.unmap(cudart.Ptr(es.addr(i)), (j-i)*page); err != nil {
		return fmt.Errorf("allocator: unmapping the %d bytes of standby mappings at %#x: %w", (j-i)*page, es.addr(i), err)
	}
	for k := i; k < j; {
		n, h := uint64(es.standby[k]), es.sbHandles[k]
		s.drop(es.sbPend[k])
		es.standby[k], es.sbHandles[k], es.sbPend[k] = 0, 0, nil
		s.removeStandby(h, place{es, k})
		k += n
	}
	return nil
}

// dropStandbys unmaps every standby mapping of h, so that it can be
// released; it stops at the first that fails.
func (s *Space) dropStandbys(h cudart.Handle) error {
	for ps := s.standbys[h]; len(ps) > 0; ps = s.standbys[h] {
		p := ps[len(ps)-1]
		if err := s.unmapStandby(p.es, p.page); err != nil {
			return err
		}
	}
	return nil
}

// putCached returns r to the cache.
func (s *Space) putCached(r cachedRun) {
	s.cache = append(s.cache, r)
	s.cachedBytes += r.bytes()
}

// ReleaseCache releases the cached runs of the small or the large pool
// (EmptyCache, out of memory, a cap) and returns their bytes, by which
// Reserved fell.
func (s *Space) ReleaseCache(small bool) uint64 {
	var n uint64
	kept := s.cache[:0]
	for _, r := range s.cache {
		if r.small != small {
			kept = append(kept, r)
			continue
		}
		s.releaseCached(r)
		n += r.bytes()
	}
	clear(s.cache[len(kept):])
	s.cache = kept
	s.cachedBytes -= n
	return n
}

// releaseCached releases the run r, taken or about to be taken out of the
// cache (the caller keeps cachedBytes), and its standby mappings, lets go
// of its pending and takes its bytes out of Reserved.
func (s *Space) releaseCached(r cachedRun) {
	s.releaseHandle(r.h)
	s.drop(r.pend)
	s.reserved -= r.bytes()
}

// StartOver forgets the high-water marks that the run and reclaim
// policies read (the largest reserved figure, the largest allocated figure
// seen at a mapping), setting them to what is held now: reserved memory,
// and allocated, the caller's figure. The allocator calls it after
// EmptyCache, which returned the memory those marks describe: a process
// that runs a large workload, empties the cache and runs a smaller one
// then grows and reclaims as a fresh one would, instead of mapping runs
// sized for the first workload and holding memory up to its peak.
func (s *Space) StartOver(allocated uint64) {
	s.mark = s.reserved
	s.allocMark = allocated
}

// The Space's device calls, counted and timed (all off the hot path).

func (s *Space) create(size uint64) (cudart.Handle, error) {
	t0 := time.Now()
	h, err := s.vm.Create(size)
	s.calls.CreateTime += time.Since(t0)
	if err == nil {
		s.calls.Creates++
	}
	return h, err
}

func (s *Space) release(h cudart.Handle) error {
	t0 := time.Now()
	err := s.vm.Release(h)
	s.calls.ReleaseTime += time.Since(t0)
	s.calls.Releases++
	return err
}

func (s *Space) unmap(p cudart.Ptr, size uint64) error {
	t0 := time.Now()
	err := s.vm.Unmap(p, size)
	s.calls.UnmapTime += time.Since(t0)
	s.calls.Unmaps++
	return err
}

// mapHandles maps hs[i], each a run of size bytes, at addr + i*size: in
// one call, which grants access to them all as PyTorch does, when the
// device is a cudart.RangeMapper, else one by one. It returns how many
// runs stay mapped (the first ones; none after a failed range mapping,
// which undoes itself).
func (s *Space) mapHandles(addr, size uint64, hs []cudart.Handle) (int, error) {
	t0 := time.Now()
	defer func() { s.calls.MapTime += time.Since(t0) }()
	if rm, ok := s.vm.(cudart.RangeMapper); ok {
		if err := rm.MapRange(cudart.Ptr(addr), size, hs); err != nil {
			return 0, err
		}
		s.calls.Maps += int64(len(hs))
		s.calls.Grants++
		return len(hs), nil
	}
	for k, h := range hs {
		if err := s.vm.Map(cudart.Ptr(addr+uint64(k)*size), size, h); err != nil {
			return k, err
		}
		s.calls.Maps++
		s.calls.Grants++
	}
	return len(hs), nil
}
