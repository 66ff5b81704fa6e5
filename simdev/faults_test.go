package simdev

import (
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
)

// TestFaultsFailMalloc: FailMalloc(n, err) fails exactly the n-th
// malloc-like call from now, with err or the device's out-of-memory error;
// n <= 0 clears a pending fault; a fault fires once.
func TestFaultsFailMalloc(t *testing.T) {
	boom := errors.New("injected")
	tests := []struct {
		name     string
		n        int
		err      error
		clear    bool  // FailMalloc(0, nil) after setting the fault
		failAt   int   // the 1-based call that fails; 0: none
		wantErr  error // what the failing call's error wraps
		calls    int
		wantFail int64
	}{
		{name: "next call, OOM", n: 1, failAt: 1, wantErr: cudart.ErrOutOfMemory, calls: 3, wantFail: 1},
		{name: "third call, injected error", n: 3, err: boom, failAt: 3, wantErr: boom, calls: 4, wantFail: 1},
		{name: "cleared", n: 2, clear: true, calls: 3},
		{name: "n of 0 sets nothing", n: 0, calls: 2},
		{name: "negative n sets nothing", n: -1, calls: 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := New(Config{Capacity: 1 << 30})
			if err != nil {
				t.Fatal(err)
			}
			s.Faults().FailMalloc(tt.n, tt.err)
			if tt.clear {
				s.Faults().FailMalloc(0, nil)
			}
			for i := 1; i <= tt.calls; i++ {
				p, err := s.Malloc(2 << 20)
				if i == tt.failAt {
					if !errors.Is(err, tt.wantErr) {
						t.Errorf("call %d = %v, want an error wrapping %v", i, err, tt.wantErr)
					}
					continue
				}
				if err != nil {
					t.Errorf("call %d failed: %v", i, err)
					continue
				}
				_ = s.Free(p)
			}
			if c := s.Counters(); c.FailedMallocs != tt.wantFail {
				t.Errorf("FailedMallocs = %d, want %d", c.FailedMallocs, tt.wantFail)
			}
		})
	}
}

// TestFaultsKindsApart: a HostAlloc fault leaves mallocs alone and the
// other way round.
func TestFaultsKindsApart(t *testing.T) {
	s, err := New(Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	s.Faults().FailHostAlloc(1, nil)
	p, err := s.Malloc(2 << 20)
	if err != nil {
		t.Fatalf("Malloc with a HostAlloc fault pending: %v", err)
	}
	_ = s.Free(p)
	if _, err := s.HostAlloc(64, 0); !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Errorf("HostAlloc with its fault pending = %v, want ErrOutOfMemory", err)
	}
	s.Faults().FailMalloc(1, nil)
	b, err := s.HostAlloc(64, 0)
	if err != nil {
		t.Fatalf("HostAlloc with a malloc fault pending: %v", err)
	}
	_ = s.FreeHost(b)
	if _, err := s.Malloc(2 << 20); !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Errorf("Malloc with its fault pending = %v, want ErrOutOfMemory", err)
	}
}
