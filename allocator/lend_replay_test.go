package allocator_test

import (
	"fmt"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/workload"
)

// TestLendingAddsNoFailures replays multistream_prefetch, the recorded
// trace on two streams, under caps at and below its own peak, with both
// reclaim policies, with and without loans (allocator.WithoutLending):
// loans come only after releasing cached memory did not help, so a
// replay with them fails no more requests than one without, retries as
// often and peaks as high; and here they avoid failures.
func TestLendingAddsNoFailures(t *testing.T) {
	tr, err := workload.LoadTrace("../testdata/traces/multistream_prefetch.pickle.gz")
	if err != nil {
		t.Fatal(err)
	}
	replay := func(conf string, opts ...allocator.Option) workload.ReplayResult {
		t.Helper()
		a, _ := newReplayAllocator(t, conf, nil, opts...)
		r, err := workload.Replay(&tr.Ops, a, workload.ReplayOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Check(); err != nil {
			t.Fatal(err)
		}
		return r
	}
	avoided := 0
	for _, policy := range []string{"", ",expandable_reclaim:coarse"} {
		peak := replay("expandable_segments:True" + policy).PeakReserved
		for _, share := range []float64{0.95, 1} {
			conf := fmt.Sprintf("expandable_segments:True%s,per_process_memory_fraction:%.9f", policy, share*float64(peak)/replayCapacity)
			with, without := replay(conf), replay(conf, allocator.WithoutLending)
			t.Logf("%s: failed requests %d without loans, %d with (%d loans)", conf, without.OOMs, with.OOMs, with.Lends)
			if with.OOMs > without.OOMs || with.AllocRetries != without.AllocRetries || with.PeakReserved != without.PeakReserved {
				t.Errorf("%s: with loans %d failures, %d retries, peak %d; without %d, %d, %d",
					conf, with.OOMs, with.AllocRetries, with.PeakReserved, without.OOMs, without.AllocRetries, without.PeakReserved)
			}
			if without.Lends != 0 {
				t.Errorf("%s: %d loans with WithoutLending", conf, without.Lends)
			}
			avoided += int(without.OOMs - with.OOMs)
		}
	}
	if avoided == 0 {
		t.Error("no loan avoided a failure: the test covers nothing")
	}
}
