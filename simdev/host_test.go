package simdev

import (
	"bytes"
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
)

func newHostSim(t *testing.T, manual bool) *Sim {
	t.Helper()
	s, err := New(Config{Capacity: 1 << 30, Backed: true, ManualEvents: manual})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestSimHostAllocFree(t *testing.T) {
	s := newHostSim(t, false)
	if _, err := s.HostAlloc(0, 0); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("HostAlloc(0) = %v, want ErrInvalidValue", err)
	}
	if _, err := s.HostAlloc(10, 8); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("HostAlloc with flag 8 = %v, want ErrInvalidValue", err)
	}
	b, err := s.HostAlloc(4096, cudart.HostAllocPortable|cudart.HostAllocMapped)
	if err != nil || len(b) != 4096 || cap(b) != 4096 {
		t.Fatalf("HostAlloc = len %d cap %d, %v", len(b), cap(b), err)
	}
	if err := s.FreeHost(b[1:]); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("FreeHost of an interior slice = %v, want ErrInvalidValue", err)
	}
	if err := s.FreeHost(b); err != nil {
		t.Fatal(err)
	}
	if err := s.FreeHost(b); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("second FreeHost = %v, want ErrInvalidValue", err)
	}
	s.SetHostCapacity(1000)
	if _, err := s.HostAlloc(1001, 0); !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Errorf("HostAlloc past the capacity = %v, want ErrOutOfMemory", err)
	}
	s.Faults().FailHostAlloc(1, nil)
	if _, err := s.HostAlloc(10, 0); !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Errorf("injected fault = %v, want ErrOutOfMemory", err)
	}
	c := s.HostCounters()
	if c.HostAllocs != 1 || c.HostFrees != 1 || c.FailedHostAllocs != 2 || c.LiveHostAllocations != 0 {
		t.Errorf("counters = %+v", c)
	}
}

// TestSimQueuedCopies: with ManualEvents, a copy to or from pinned memory
// moves its bytes only when its stream's work completes, and in stream
// order; pageable memory is copied at once.
func TestSimQueuedCopies(t *testing.T) {
	s := newHostSim(t, true)
	st, _ := s.StreamCreate()
	d, err := s.Malloc(64)
	if err != nil {
		t.Fatal(err)
	}
	pin, _ := s.HostAlloc(64, cudart.HostAllocPortable)
	copy(pin, bytes.Repeat([]byte{1}, 64))
	if err := s.MemcpyHtoDAsync(d, pin, st); err != nil {
		t.Fatal(err)
	}
	ev, _ := s.EventCreate()
	if err := s.EventRecord(ev, st); err != nil {
		t.Fatal(err)
	}
	copy(pin, bytes.Repeat([]byte{2}, 64)) // too early: the copy has not run
	out := make([]byte, 64)
	if err := s.MemcpyDtoH(out, d); err != nil || out[0] != 0 {
		t.Fatalf("before completion the device holds %d (%v), want 0", out[0], err)
	}
	if c := s.HostCounters(); c.PendingCopies != 1 {
		t.Fatalf("pending = %d, want 1", c.PendingCopies)
	}
	if err := s.CompleteEvent(ev); err != nil {
		t.Fatal(err)
	}
	if err := s.MemcpyDtoH(out, d); err != nil || out[0] != 2 {
		t.Fatalf("after completion the device holds %d (%v), want 2 (the bytes the copy read when it ran)", out[0], err)
	}

	// D2H into pinned memory lands at completion; D2D in order with it.
	d2, _ := s.Malloc(64)
	if err := s.MemcpyDtoDAsync(d2, d, 64, st); err != nil {
		t.Fatal(err)
	}
	back, _ := s.HostAlloc(64, 0)
	if err := s.MemcpyDtoHAsync(back, d2, st); err != nil {
		t.Fatal(err)
	}
	if back[0] != 0 {
		t.Fatal("D2H landed before its stream completed")
	}
	other, _ := s.StreamCreate()
	s.CompleteStream(other)
	if back[0] != 0 {
		t.Fatal("completing another stream ran the copy")
	}
	if err := s.StreamSynchronize(st); err != nil {
		t.Fatal(err)
	}
	if back[0] != 2 || back[63] != 2 {
		t.Fatalf("after StreamSynchronize back = %d, want 2", back[0])
	}

	// Pageable memory: the stream's queued work first, then the copy, at once.
	copy(pin, bytes.Repeat([]byte{3}, 64))
	if err := s.MemcpyHtoDAsync(d, pin, st); err != nil {
		t.Fatal(err)
	}
	page := make([]byte, 64)
	if err := s.MemcpyDtoHAsync(page, d, st); err != nil || page[0] != 3 {
		t.Fatalf("pageable D2H after a queued H2D: %d, %v; want 3", page[0], err)
	}
	// FreeHost synchronises.
	if err := s.MemcpyDtoHAsync(back, d, st); err != nil {
		t.Fatal(err)
	}
	if err := s.FreeHost(back); err != nil {
		t.Fatal(err)
	}
	if c := s.HostCounters(); c.PendingCopies != 0 || c.AsyncCopies != 6 || c.CopiesRun != 6 {
		t.Errorf("counters = %+v", c)
	}
}

func TestSimCopyErrors(t *testing.T) {
	s := newHostSim(t, false)
	d, _ := s.Malloc(64)
	b, _ := s.HostAlloc(128, 0)
	if err := s.MemcpyHtoDAsync(d, b, 0); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("copy past the allocation = %v, want ErrInvalidValue", err)
	}
	if err := s.MemcpyHtoDAsync(d, b[:64], 99); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("copy on an unknown stream = %v, want ErrInvalidValue", err)
	}
	u, _ := New(Config{Capacity: 1 << 20})
	du, _ := u.Malloc(64)
	if err := u.MemcpyDtoDAsync(du, du, 64, 0); !errors.Is(err, ErrNotBacked) {
		t.Errorf("copy on an unbacked sim = %v, want ErrNotBacked", err)
	}
}

// TestSimHostAllocHuge: a HostAlloc past the Sim's host capacity, by
// default or set, is cudart.ErrOutOfMemory before any Go memory is asked for, and
// a capacity lowered below what is live refuses every HostAlloc until
// memory is freed.
func TestSimHostAllocHuge(t *testing.T) {
	s := newHostSim(t, false)
	for _, n := range []uint64{1 << 40, 1<<40 + 1, 1 << 62, 1<<63 + 5, ^uint64(0)} {
		if b, err := s.HostAlloc(n, 0); !errors.Is(err, cudart.ErrOutOfMemory) {
			t.Errorf("HostAlloc(%d) = %d bytes, %v; want ErrOutOfMemory", n, len(b), err)
		}
	}
	b, err := s.HostAlloc(1<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	s.SetHostCapacity(1 << 10) // below what is live
	if _, err := s.HostAlloc(1, 0); !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Errorf("HostAlloc with the capacity below the live bytes = %v, want ErrOutOfMemory", err)
	}
	s.SetHostCapacity(^uint64(0)) // the machine's memory still bounds it
	if _, err := s.HostAlloc(1<<62, 0); !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Errorf("HostAlloc(4 EiB) with an unbounded capacity = %v, want ErrOutOfMemory", err)
	}
	s.SetHostCapacity(0) // the default
	if err := s.FreeHost(b); err != nil {
		t.Fatal(err)
	}
	c := s.HostCounters()
	if c.HostAllocs != 1 || c.FailedHostAllocs != 7 || c.LiveHostBytes != 0 {
		t.Errorf("counters = %+v", c)
	}
}
