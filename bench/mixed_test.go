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
