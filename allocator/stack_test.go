package allocator_test

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

//go:noinline
func allocHere(t *testing.T, a *allocator.Allocator) cudart.Ptr {
	p, err := a.Malloc(4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestHistoryStacks: with a stack depth, each allocation's Go call site
// (outside the allocator) is in its trace entries and its block, in the
// snapshot and its pickle; identical stacks share one frames slice.
func TestHistoryStacks(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	a, err := allocator.New(sim, allocator.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.RecordHistory(allocator.HistoryOptions{MaxEntries: 1000, StackDepth: 4}); err != nil {
		t.Fatal(err)
	}
	var ps []cudart.Ptr
	for range 3 {
		ps = append(ps, allocHere(t, a))
	}
	snap := a.Snapshot()
	var allocs []snapshot.Entry
	for _, e := range snap.DeviceTraces[0] {
		if e.Action == snapshot.ActionAlloc {
			allocs = append(allocs, e)
		}
	}
	if len(allocs) != 3 {
		t.Fatalf("%d alloc entries, want 3", len(allocs))
	}
	for i, e := range allocs {
		if len(e.Frames) == 0 || len(e.Frames) > 4 {
			t.Fatalf("alloc %d has %d frames, want 1 to 4", i, len(e.Frames))
		}
		f := e.Frames[0]
		if !strings.HasSuffix(f.Name, "allocator_test.allocHere") || filepath.Base(f.Filename) != "stack_test.go" || f.Line == 0 {
			t.Errorf("alloc %d: innermost frame %+v, want allocHere in stack_test.go", i, f)
		}
		if &e.Frames[0] != &allocs[0].Frames[0] {
			t.Errorf("alloc %d: identical stacks are not shared", i)
		}
	}
	blk := snap.Segments[0].Blocks[0]
	if blk.State != snapshot.BlockActiveAllocated || len(blk.Frames) == 0 || !strings.HasSuffix(blk.Frames[0].Name, "allocHere") {
		t.Errorf("block %+v lacks its allocation's frames", blk)
	}
	var buf bytes.Buffer
	if err := a.WriteSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	back, err := trace.Read(&buf, trace.ReadOptions{Frames: true})
	if err != nil {
		t.Fatal(err)
	}
	if fs := back.Segments[0].Blocks[0].Frames; len(fs) == 0 || fs[0] != blk.Frames[0] {
		t.Errorf("pickle block frames %v, want %v", fs, blk.Frames)
	}
	for _, p := range ps {
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Check(); err != nil {
		t.Error(err)
	}
}
