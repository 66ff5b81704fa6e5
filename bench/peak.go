package bench

import (
	"fmt"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
	"github.com/allocd/allocd/workload"
)

// Sample is the allocator's usage after one replayed operation.
type Sample struct {
	// Op is the index of the operation in ops.Ops.
	Op                             int
	Allocated, Reserved, Requested int64
}

// Sampler collects about n samples over a replay of total operations: each
// sample holds the maximum of each quantity over its window of operations,
// so that short peaks survive the thinning.
type Sampler struct {
	a       *allocator.Allocator
	every   int
	cur     Sample
	Samples []Sample
}

// NewSampler returns a sampler for a replay of total operations on a.
func NewSampler(a *allocator.Allocator, total, n int) *Sampler {
	return &Sampler{a: a, every: max(1, total/max(n, 1)), Samples: make([]Sample, 0, n+2)}
}

// Observe is a workload.ReplayOptions.Observe function.
func (s *Sampler) Observe(i int) {
	al, re, rq := s.a.Usage()
	s.cur.Allocated = max(s.cur.Allocated, al)
	s.cur.Reserved = max(s.cur.Reserved, re)
	s.cur.Requested = max(s.cur.Requested, rq)
	if (i+1)%s.every == 0 {
		s.cur.Op = i
		s.Samples = append(s.Samples, s.cur)
		s.cur = Sample{}
	}
}

// Flush records the last, partial window ending at operation i.
func (s *Sampler) Flush(i int) {
	if s.cur != (Sample{}) {
		s.cur.Op = i
		s.Samples = append(s.Samples, s.cur)
		s.cur = Sample{}
	}
}

// NewAllocatorFunc makes a fresh allocator for one replay; history asks for
// history recording (allocator.WithHistory).
type NewAllocatorFunc func(history bool) (*allocator.Allocator, error)

// SnapshotAtPeak replays ops to find the first operation at which reserved
// memory reaches its peak, then replays again with history recording up to
// that operation and returns the allocator's snapshot there, with the
// operation's index. Replay on a Sim is deterministic, so the second replay
// reaches the same state. Both allocators are closed.
func SnapshotAtPeak(ops *trace.Ops, newAlloc NewAllocatorFunc) (*snapshot.Snapshot, int, error) {
	a, err := newAlloc(false)
	if err != nil {
		return nil, 0, err
	}
	peakOp, peak := 0, int64(-1)
	_, err = workload.Replay(ops, a, workload.ReplayOptions{Observe: func(i int) {
		if _, re, _ := a.Usage(); re > peak {
			peak, peakOp = re, i
		}
	}})
	_ = a.Close()
	if err != nil {
		return nil, 0, err
	}
	b, err := newAlloc(true)
	if err != nil {
		return nil, 0, err
	}
	defer b.Close()
	if _, err := workload.Replay(ops, b, workload.ReplayOptions{Stop: peakOp + 1}); err != nil {
		return nil, 0, err
	}
	if _, re, _ := b.Usage(); re != peak {
		return nil, 0, fmt.Errorf("replay is not deterministic on this device: reserved %d at operation %d, first pass saw %d", re, peakOp, peak)
	}
	return b.Snapshot(), peakOp, nil
}
