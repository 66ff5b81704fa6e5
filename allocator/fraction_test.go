package allocator

import (
	"errors"
	"math"
	"testing"
)

// TestSetMemoryFraction: the cap moves at run time, bad fractions are
// refused without a change, 0 lifts the cap.
func TestSetMemoryFraction(t *testing.T) {
	a, _ := newTestAllocator(t, giB, "")
	for _, f := range []float64{math.NaN(), math.Inf(1), math.Inf(-1), -0.1, 1.5} {
		if err := a.SetMemoryFraction(f); !errors.Is(err, ErrConfig) {
			t.Errorf("SetMemoryFraction(%v) = %v, want ErrConfig", f, err)
		}
	}
	if got := a.Config().PerProcessMemoryFraction; got != 0 {
		t.Fatalf("a refused fraction changed the configuration to %v", got)
	}
	if err := a.SetMemoryFraction(0.25); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Malloc(300*miB, 0); !errors.Is(err, ErrOutOfMemory) {
		t.Errorf("300 MiB under a 256 MiB cap: %v, want OOM", err)
	} else {
		var oom *OOMError
		if errors.As(err, &oom); oom.Allowed != giB/4 {
			t.Errorf("OOM names a cap of %d, want %d", oom.Allowed, giB/4)
		}
	}
	p := mustMalloc(t, a, 200*miB, 0)
	if _, err := a.Malloc(100*miB, 0); !errors.Is(err, ErrOutOfMemory) {
		t.Errorf("200+100 MiB under a 256 MiB cap: %v, want OOM", err)
	}
	if err := a.SetMemoryFraction(0); err != nil {
		t.Fatal(err)
	}
	q := mustMalloc(t, a, 300*miB, 0)
	if got := a.Config().String(); got != "" {
		t.Errorf("config after lifting the cap: %q", got)
	}
	mustFree(t, a, p)
	mustFree(t, a, q)
	if got := a.Stats().NumOOMs; got != 2 {
		t.Errorf("num_ooms = %d, want 2", got)
	}
}
