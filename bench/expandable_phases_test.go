package bench

import (
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/workload"
)

// TestExpandableEmptyCacheStartsOver replays two traces in one allocator
// with expandable_segments:True, as one process runs two workloads: the
// first trace, its leftovers freed, EmptyCache and ResetPeakStats, then the
// second. After EmptyCache the second trace's peak reserved is what it is
// in a fresh allocator: the first trace's larger footprint must not
// lengthen the second's runs or loosen its reclaim, since EmptyCache
// returned that memory and the workload starts over.
func TestExpandableEmptyCacheStartsOver(t *testing.T) {
	for _, tc := range []struct{ first, second string }{
		{"gpt2_train", "resnet50_train"},
		{"gpt2_train", "multistream_prefetch"},
	} {
		t.Run(tc.first+"_then_"+tc.second, func(t *testing.T) {
			fresh := replayTrace(t, tc.second, modeExpandable).r
			first, _ := loadOps(t, traceFile(t, tc.first))
			second, _ := loadOps(t, traceFile(t, tc.second))
			_, a := newExpandable(t)
			defer a.Close()
			replayChecked(t, first, a)
			if err := workload.FreeLive(a); err != nil {
				t.Fatal(err)
			}
			if err := a.EmptyCache(); err != nil {
				t.Fatal(err)
			}
			if st := a.Stats(); st.ReservedBytes[allocator.PoolAll].Current != 0 {
				t.Fatalf("after FreeLive and EmptyCache, %d bytes reserved", st.ReservedBytes[allocator.PoolAll].Current)
			}
			a.ResetPeakStats()
			r := replayChecked(t, second, a)
			t.Logf("%s after %s: peak reserved %.0f MiB, in a fresh allocator %.0f MiB", tc.second, tc.first,
				mib(r.PeakReserved), mib(fresh.PeakReserved))
			if r.PeakReserved > fresh.PeakReserved {
				t.Errorf("%s after %s and EmptyCache: peak reserved %d bytes, %d in a fresh allocator",
					tc.second, tc.first, r.PeakReserved, fresh.PeakReserved)
			}
		})
	}
}
