package bench

import (
	"testing"

	"github.com/allocd/allocd/allocator"
)

// TestRunSuiteMixedRows: RunSuite reports one cold and one warm mixed row
// per goroutine count, in order, and none when MixedSteps is 0.
func TestRunSuiteMixedRows(t *testing.T) {
	target, err := OpenTarget("sim", 141<<30)
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	rep, err := RunSuite(target, allocator.DefaultConfig(), Suite{MixedSteps: 500, Threads: []int{1, 2}})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Mixed) != 2 || len(rep.Warm) != 2 {
		t.Fatalf("%d mixed and %d mixed_warm rows, want 2 and 2", len(rep.Mixed), len(rep.Warm))
	}
	for i, th := range []int{1, 2} {
		if rep.Mixed[i].Threads != th || rep.Warm[i].Threads != th || rep.Warm[i].Ops == 0 {
			t.Errorf("row %d: mixed %+v, mixed_warm %+v; want threads=%d with operations", i, rep.Mixed[i], rep.Warm[i], th)
		}
	}
	if rep, err = RunSuite(target, allocator.DefaultConfig(), Suite{Threads: []int{1}}); err != nil || len(rep.Mixed)+len(rep.Warm) != 0 {
		t.Errorf("MixedSteps 0: %d rows, err %v; want none", len(rep.Mixed)+len(rep.Warm), err)
	}
}
