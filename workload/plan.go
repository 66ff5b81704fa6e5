package workload

import (
	"errors"
	"fmt"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/google/btree"
)

// recordedSegment is a segment a trace holds: allocated by the entry at
// index entry and not yet freed.
type recordedSegment struct {
	addr, size uint64
	entry      int
}

func (s recordedSegment) end() uint64 { return s.addr + s.size }

// CheckSegments checks the segment_alloc entries of a device trace as the
// plan of a simulated device's addresses (device 0; simdev.Config.Addresses):
// each segment must pass simdev.CheckPlannedAddress (a positive size, an
// address aligned to 2 MiB, no wrap past 2^64, inside the device's range),
// and overlap no segment the trace still holds at that point (allocated
// by an earlier segment_alloc and not freed by a segment_free at its
// address). An address freed and then allocated again is fine. The error
// names the entry (its index in entries) and its address; nil when every
// segment passes. It costs O(log n) per segment.
func CheckSegments(entries []snapshot.Entry) error {
	live := btree.NewG(16, func(a, b recordedSegment) bool { return a.addr < b.addr })
	plan := 0
	for i, e := range entries {
		switch e.Action {
		case snapshot.ActionSegmentFree:
			if s, ok := live.Get(recordedSegment{addr: e.Addr}); ok && s.size == e.Size {
				live.Delete(s)
			}
		case snapshot.ActionSegmentAlloc:
			seg := recordedSegment{addr: e.Addr, size: e.Size, entry: i}
			err := simdev.CheckPlannedAddress(plan, simdev.Address{Addr: cudart.Ptr(e.Addr), Size: e.Size}, 0)
			if pe := (*simdev.PlanError)(nil); errors.As(err, &pe) {
				return fmt.Errorf("trace entry %d, segment_alloc of %d bytes at %#x: %s: %w", i, e.Size, e.Addr, pe.Reason, cudart.ErrInvalidValue)
			} else if err != nil {
				return err
			}
			plan++
			var over *recordedSegment
			// The segments held do not overlap one another, so only the
			// last one starting below seg's end can reach it.
			live.DescendLessOrEqual(recordedSegment{addr: seg.end() - 1}, func(s recordedSegment) bool {
				if s.end() > seg.addr {
					over = &s
				}
				return false
			})
			if over != nil {
				return fmt.Errorf("trace entry %d, segment_alloc of %d bytes at %#x: overlaps [%#x, +%d), the segment of entry %d, which the trace has not freed: %w",
					i, e.Size, e.Addr, over.addr, over.size, over.entry, cudart.ErrInvalidValue)
			}
			live.ReplaceOrInsert(seg)
		}
	}
	return nil
}
