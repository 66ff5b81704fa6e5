package bench

import (
	"testing"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/workload"
)

// TestMixedStepperIsTheBenchmarkLoop: the stepper takes the mixed
// benchmark's steps: the same seed and window give the same allocations
// and the same peaks as one goroutine of Mixed.
func TestMixedStepperIsTheBenchmarkLoop(t *testing.T) {
	const steps, window = 20_000, 512
	a := newSimAllocator(t, "", false)
	if err := mixedRun(a, cudart.DefaultStream, 42, steps, window, new(time.Time)); err != nil {
		t.Fatal(err)
	}
	b := newSimAllocator(t, "", false)
	m := workload.NewMixedStepper(42, window)
	for range steps {
		if err := m.Step(b, cudart.DefaultStream); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.FreeAll(b); err != nil {
		t.Fatal(err)
	}
	sa, sb := a.Stats(), b.Stats()
	if sa.Allocation[allocator.PoolAll] != sb.Allocation[allocator.PoolAll] ||
		sa.AllocatedBytes[allocator.PoolAll] != sb.AllocatedBytes[allocator.PoolAll] ||
		sa.ReservedBytes[allocator.PoolAll] != sb.ReservedBytes[allocator.PoolAll] {
		t.Errorf("stepper: allocations %+v, bytes %+v; benchmark loop: %+v, %+v",
			sb.Allocation[allocator.PoolAll], sb.AllocatedBytes[allocator.PoolAll],
			sa.Allocation[allocator.PoolAll], sa.AllocatedBytes[allocator.PoolAll])
	}
}

// TestMixedWarmInterleaved: eight streams whose steps overlap one by one
// (MixedWarmInterleaved) keep every invariant, and the allocator counts
// the borrows and steals that move the peaks' slack between them, logged
// per step with the warm pass's escalations. Steps, window and seeds are
// those of the benchmark, fewer steps under -short.
func TestMixedWarmInterleaved(t *testing.T) {
	steps := mixedBenchSteps()
	a := newSimAllocator(t, "", false)
	r, err := MixedWarmInterleaved(a, 8, steps)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	t.Logf("8 streams, %d steps each, warm pass: %d escalations, %d borrows (%.3f a step), %d steals (%.3f a step)",
		steps, r.TimedEscalations, r.TimedBorrows, float64(r.TimedBorrows)/float64(r.Ops), r.TimedSteals, float64(r.TimedSteals)/float64(r.Ops))
	if r.TimedBorrows == 0 || r.TimedSteals == 0 {
		t.Errorf("no borrows (%d) or steals (%d) counted: eight streams near their peaks borrow", r.TimedBorrows, r.TimedSteals)
	}
	if st := a.Stats(); st.NumCapBorrows < r.TimedBorrows || st.NumCapSteals < r.TimedSteals || st.NumEscalations < r.TimedEscalations {
		t.Errorf("Stats counts %d borrows, %d steals and %d escalations, fewer than the warm pass alone", st.NumCapBorrows, st.NumCapSteals, st.NumEscalations)
	}
}
