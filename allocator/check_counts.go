package allocator

import (
	"fmt"
)

// poolTotals are the counts Check derives from the blocks of one pool's
// segments, by the rules it applies to all pools together.
type poolTotals struct {
	segments, allocations, active, inactiveSplit                         int64
	reservedBytes, allocatedBytes, activeBytes, inactiveSplitBytes, reqd int64
}

// checkPoolCounts compares the small and the large pool's statistics
// apart with the blocks of their segments (Check compares the sums over
// both), and, for every statistic and pool, Current with Allocated −
// Freed. st is the folded statistics (world mode).
func (a *Allocator) checkPoolCounts(st *Stats) []error {
	var t [numPools]poolTotals
	if a.exp != nil { // the handle cache is held, so reserved
		t[PoolLarge].reservedBytes = int64(a.exp.Cached(false))
		t[PoolSmall].reservedBytes = int64(a.exp.Cached(true))
	}
	for _, s := range a.segs.list {
		pt := &t[PoolLarge]
		if s.Small {
			pt = &t[PoolSmall]
		}
		if s.Expandable {
			pt.reservedBytes += int64(s.Mapped)
		} else {
			pt.segments++
			pt.reservedBytes += int64(s.Size)
		}
		for b := s.Head; b != nil; b = b.Next {
			size := int64(b.Size)
			switch {
			case b.Unmapped:
			case b.Allocated:
				pt.allocations++
				pt.allocatedBytes += size
				pt.active++
				pt.activeBytes += size
				pt.reqd += int64(b.Requested)
			case b.EventCount > 0:
				pt.active++
				pt.activeBytes += size
				pt.reqd += int64(b.Requested)
			case b.IsSplit() && !s.Expandable:
				pt.inactiveSplit++
				pt.inactiveSplitBytes += size
			}
		}
	}
	var errs []error
	for _, p := range []Pool{PoolSmall, PoolLarge} {
		pt := &t[p]
		for _, c := range []struct {
			name string
			got  int64
			want int64
		}{
			{"segment", st.Segment[p].Current, pt.segments},
			{"reserved_bytes", st.ReservedBytes[p].Current, pt.reservedBytes},
			{"allocation", st.Allocation[p].Current, pt.allocations},
			{"allocated_bytes", st.AllocatedBytes[p].Current, pt.allocatedBytes},
			{"active", st.Active[p].Current, pt.active},
			{"active_bytes", st.ActiveBytes[p].Current, pt.activeBytes},
			{"requested_bytes", st.RequestedBytes[p].Current, pt.reqd},
			{"inactive_split", st.InactiveSplit[p].Current, pt.inactiveSplit},
			{"inactive_split_bytes", st.InactiveSplitBytes[p].Current, pt.inactiveSplitBytes},
		} {
			if c.got != c.want {
				errs = append(errs, fmt.Errorf("stat %s.%s is %d, the pool's blocks say %d", c.name, p, c.got, c.want))
			}
		}
	}
	for _, arr := range st.namedArrays() {
		for p := PoolAll; p < numPools; p++ {
			if s := arr.a[p]; s.Current != s.Allocated-s.Freed {
				errs = append(errs, fmt.Errorf("stat %s.%s: current %d, but allocated %d − freed %d = %d", arr.name, p, s.Current, s.Allocated, s.Freed, s.Allocated-s.Freed))
			}
		}
	}
	return errs
}
