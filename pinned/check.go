package pinned

import (
	"errors"
	"fmt"
)

// Check walks every block, free list and pending event and compares what
// it finds with the statistics. It returns nil when every invariant holds
// and an error listing each broken one otherwise. It is meant for tests and
// debugging: it costs time proportional to the number of blocks and events.
func (a *Allocator) Check() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }

	events := map[*block]int{}
	seenEv := map[uint64]bool{}
	for _, p := range a.pending {
		if _, ok := a.blocks[p.blk]; !ok {
			bad("pending event %d names a block the allocator does not hold", p.ev)
		}
		events[p.blk]++
		if seenEv[uint64(p.ev)] {
			bad("event %d is pending twice", p.ev)
		}
		seenEv[uint64(p.ev)] = true
	}
	for ev := range a.idle.All() {
		if seenEv[uint64(ev)] {
			bad("event %d is both idle and pending (or idle twice)", ev)
		}
		seenEv[uint64(ev)] = true
	}
	inFree := map[*block]bool{}
	for c, l := range a.free {
		for i, b := range l {
			if b == nil {
				bad("free list %d has a nil entry at %d", c, i)
				continue
			}
			if inFree[b] {
				bad("block %p is in a free list twice", b)
			}
			inFree[b] = true
			if b.class != c || b.freeIdx != i {
				bad("block %p sits in free list %d at %d but says class %d index %d", b, c, i, b.class, b.freeIdx)
			}
			if _, ok := a.blocks[b]; !ok {
				bad("free block %p is not among the allocator's blocks", b)
			}
		}
	}
	var inUse, inUseBytes, reserved, requested int64
	for b := range a.blocks {
		size := uint64(len(b.data))
		if rs, rc := RoundSize(size, a.cfg.RoundupDivisions); rs != size || rc != b.class {
			bad("block %p of %d bytes is in class %d; its size rounds to %d, class %d", b, size, b.class, rs, rc)
		}
		reserved += int64(size)
		if o := b.owner.Load(); o != a {
			bad("block %p is held but names %p as its owner", b, o)
		}
		if b.events != events[b] {
			bad("block %p counts %d events outstanding; %d are pending for it", b, b.events, events[b])
		}
		if b.nstreams != min(b.nstreams, len(b.streams))+len(b.extra) {
			bad("block %p counts %d streams but holds %d", b, b.nstreams, min(b.nstreams, len(b.streams))+len(b.extra))
		}
		switch {
		case b.allocated:
			if inFree[b] || b.events != 0 {
				bad("allocated block %p is also free (%v) or pending (%d events)", b, inFree[b], b.events)
			}
			if b.requested <= 0 || uint64(b.requested) > size {
				bad("allocated block %p of %d bytes holds a request of %d", b, size, b.requested)
			}
			requested += int64(b.requested)
			inUse++
			inUseBytes += int64(size)
		case b.events > 0:
			if inFree[b] || b.nstreams != 0 {
				bad("pending block %p is also free (%v) or has streams (%d)", b, inFree[b], b.nstreams)
			}
			inUse++
			inUseBytes += int64(size)
		default:
			if !inFree[b] {
				bad("block %p is neither allocated, pending nor free", b)
			}
			if b.nstreams != 0 || b.requested != 0 {
				bad("free block %p has %d streams and a request of %d", b, b.nstreams, b.requested)
			}
		}
	}
	for b := range inFree {
		if b.allocated || b.events != 0 {
			bad("block %p in a free list is allocated or pending", b)
		}
	}
	st := &a.stats
	for _, c := range []struct {
		name      string
		got, want int64
	}{
		{"segment.current", st.Segment.Current, int64(len(a.blocks))},
		{"reserved_bytes.current", st.ReservedBytes.Current, reserved},
		{"allocation.current", st.Allocation.Current, inUse},
		{"allocated_bytes.current", st.AllocatedBytes.Current, inUseBytes},
		{"requested_bytes.current", st.RequestedBytes.Current, requested},
		{"num_host_alloc - num_host_free", st.NumHostAlloc - st.NumHostFree, int64(len(a.blocks))},
	} {
		if c.got != c.want && !(a.reset && c.name[0] == 'n') {
			bad("%s is %d; the blocks say %d", c.name, c.got, c.want)
		}
	}
	for _, s := range []struct {
		name string
		s    Stat
	}{{"allocation", st.Allocation}, {"segment", st.Segment}, {"allocated_bytes", st.AllocatedBytes}, {"reserved_bytes", st.ReservedBytes}, {"requested_bytes", st.RequestedBytes}} {
		if s.s.Current < 0 || s.s.Peak < s.s.Current || (!a.reset && s.s.Allocated-s.s.Freed != s.s.Current) {
			bad("%s: current %d, peak %d, allocated %d, freed %d are inconsistent", s.name, s.s.Current, s.s.Peak, s.s.Allocated, s.s.Freed)
		}
	}
	return errors.Join(errs...)
}
