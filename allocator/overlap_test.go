package allocator_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// gatedDevice is a Sim whose device mallocs announce their size on
// entered and, for the sizes in gate, wait until that channel is closed;
// sizes in fail then fail with that error instead of allocating.
type gatedDevice struct {
	*simdev.Sim
	entered chan uint64
	gate    map[uint64]chan struct{}
	fail    map[uint64]error
}

func (d *gatedDevice) Malloc(size uint64) (cudart.Ptr, error) {
	d.entered <- size
	if g := d.gate[size]; g != nil {
		<-g
	}
	if err := d.fail[size]; err != nil {
		return 0, err
	}
	return d.Sim.Malloc(size)
}

//go:noinline
func mallocFirst(a *allocator.Allocator, size uint64) (cudart.Ptr, error) {
	return a.Malloc(size, 0)
}

//go:noinline
func mallocSecond(a *allocator.Allocator, size uint64) (cudart.Ptr, error) {
	return a.Malloc(size, 0)
}

// TestOverlappingSlowMallocs: with release_lock_on_cudamalloc, two slow
// mallocs whose device calls overlap each record their own call site in the
// history and each fail with their own device error.
func TestOverlappingSlowMallocs(t *testing.T) {
	const mib = 1 << 20
	errFirst := fmt.Errorf("first device says: %w", cudart.ErrOutOfMemory)
	errSecond := fmt.Errorf("second device says: %w", cudart.ErrOutOfMemory)
	for _, tc := range []struct {
		name         string
		first, other uint64 // request sizes (each its own segment size)
		fail         bool   // the device fails both
	}{
		{"succeed", 30 * mib, 40 * mib, false},
		{"out of memory", 50 * mib, 60 * mib, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sim, err := simdev.New(simdev.Config{Capacity: 1 << 30})
			if err != nil {
				t.Fatal(err)
			}
			defer sim.Close()
			dev := &gatedDevice{Sim: sim, entered: make(chan uint64, 8),
				gate: map[uint64]chan struct{}{tc.first: make(chan struct{}), tc.other: make(chan struct{})}}
			if tc.fail {
				dev.fail = map[uint64]error{tc.first: errFirst, tc.other: errSecond}
			}
			cfg, err := allocator.ParseConfig("release_lock_on_cudamalloc:True")
			if err != nil {
				t.Fatal(err)
			}
			a, err := allocator.New(dev, cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			if err := a.RecordHistory(allocator.HistoryOptions{MaxEntries: 1000, StackDepth: 4}); err != nil {
				t.Fatal(err)
			}
			type result struct {
				p   cudart.Ptr
				err error
			}
			first, second := make(chan result, 1), make(chan result, 1)
			go func() { p, err := mallocFirst(a, tc.first); first <- result{p, err} }()
			if s := <-dev.entered; s != tc.first {
				t.Fatalf("device malloc of %d, want %d", s, tc.first)
			}
			go func() { p, err := mallocSecond(a, tc.other); second <- result{p, err} }()
			if s := <-dev.entered; s != tc.other {
				t.Fatalf("device malloc of %d, want %d", s, tc.other)
			}
			// Both device mallocs are under way; the first ends first.
			close(dev.gate[tc.first])
			r1 := <-first
			close(dev.gate[tc.other])
			r2 := <-second
			for len(dev.entered) > 0 { // the retries'
				<-dev.entered
			}

			if tc.fail {
				for _, c := range []struct {
					r    result
					want error
				}{{r1, errFirst}, {r2, errSecond}} {
					var oom *allocator.OOMError
					if !errors.As(c.r.err, &oom) || oom.Cause != c.want {
						t.Errorf("error %v, want an OOMError caused by %v", c.r.err, c.want)
					}
				}
			} else {
				if r1.err != nil || r2.err != nil {
					t.Fatalf("mallocs: %v, %v", r1.err, r2.err)
				}
			}
			// Every entry recorded for a size carries that call's site.
			site := map[uint64]string{tc.first: "mallocFirst", tc.other: "mallocSecond"}
			n := 0
			for _, e := range a.Snapshot().DeviceTraces[0] {
				want, ok := site[e.Size]
				if !ok {
					continue
				}
				n++
				if len(e.Frames) == 0 || !strings.HasSuffix(e.Frames[0].Name, "allocator_test."+want) {
					var got []string
					for _, f := range e.Frames {
						got = append(got, f.Name)
					}
					t.Errorf("%s of %d bytes at %#x: frames %v, want %s innermost", e.Action, e.Size, e.Addr, got, want)
				}
			}
			wantEntries := 4 // segment_alloc and alloc of each
			if tc.fail {
				wantEntries = 2 // the oom of each
			}
			if n != wantEntries {
				t.Errorf("%d history entries of the two sizes, want %d", n, wantEntries)
			}
			for _, r := range []result{r1, r2} {
				if r.err == nil {
					if err := a.Free(r.p); err != nil {
						t.Error(err)
					}
				}
			}
			if err := a.Check(); err != nil {
				t.Error(err)
			}
		})
	}
}
