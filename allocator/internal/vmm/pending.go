package vmm

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
)

// pending is the work queued on a stream when a reclaim parked its runs
// without waiting for it (see "Reclaim without waiting" in the package
// doc): an event recorded on the stream then. The standby mappings and
// cached runs that reclaim made hold it (refs): a standby mapping may not
// be unmapped, nor a cached run mapped for another stream, before it
// completes. done caches a completion seen.
type pending struct {
	ev     cudart.Event
	stream uint64
	refs   int
	done   bool
}

// hold takes a reference to p (nil: nothing to wait for).
func (p *pending) hold() *pending {
	if p != nil {
		p.refs++
	}
	return p
}

// drop gives up a reference to p and destroys its event with the last.
func (s *Space) drop(p *pending) {
	if p == nil {
		return
	}
	if p.refs--; p.refs == 0 {
		s.destroy(p)
	}
}

// timeSync adds the time since t0 to the calls' SyncTime.
func (s *Space) timeSync(t0 time.Time) { s.calls.SyncTime += time.Since(t0) }

// destroy destroys p's event.
func (s *Space) destroy(p *pending) {
	defer s.timeSync(time.Now())
	if err := s.dev.EventDestroy(p.ev); err != nil {
		s.log.Error("destroying a reclaim's event failed", zap.Error(err))
	}
}

// wait blocks until the work p stands for has completed (nothing when p
// is nil or seen done): a query first, which a completed event answers
// without blocking.
func (s *Space) wait(p *pending) error {
	if p == nil || p.done {
		return nil
	}
	defer s.timeSync(time.Now())
	done, err := s.dev.EventQuery(p.ev)
	if err == nil && !done {
		s.calls.Waits++
		err = s.dev.EventSynchronize(p.ev)
	}
	if err != nil {
		where := fmt.Sprintf("stream %#x", p.stream)
		if p.stream == goneStream {
			where = "a stream since let go"
		}
		return fmt.Errorf("allocator: waiting for the work a reclaim left queued on %s: %w", where, err)
	}
	p.done = true
	return nil
}

// ready says whether a cached run held by p may be mapped for stream
// without waiting: p is done, or the run left a range of the same device
// stream (its next user there comes after the work queued on it).
func (p *pending) ready(stream uint64) bool {
	return p == nil || p.done || p.stream == blocks.DeviceStream(stream)
}

// goneStream is the stream of a pending whose stream the allocator let
// go (ForgetStream): no stream is ever it, not even a pool stream's device
// stream.
const goneStream = ^uint64(0)

// ForgetStream marks the work that parked runs wait for on device stream
// as no stream's: the allocator lets the stream go, and a stream created
// later may get its handle, whose growths must then wait for that work
// (a query, usually) rather than take it for their own (see ready). A
// pool stream is no device stream: ForgetStream of one changes nothing.
func (s *Space) ForgetStream(stream uint64) {
	if stream&blocks.PoolStreamBit != 0 {
		return
	}
	forget := func(p *pending) {
		if p != nil && p.stream == stream {
			p.stream = goneStream
		}
	}
	for _, r := range s.cache {
		forget(r.pend)
	}
	for _, es := range s.segs {
		for _, p := range es.sbPend {
			forget(p)
		}
	}
	forget(s.parkWith)
}

// settled says whether the work p stands for is known to have completed,
// or there is none: what a capture needs before it maps a run p holds. A
// capture may not wait, and the work it records runs when the graph is
// launched, on whatever stream that is, so that even a run parked from
// the capturing stream is not ordered after the work that used it.
func (p *pending) settled() bool { return p == nil || p.done }

// querySettled asks the device, without blocking, whether the events
// that cached runs wait for have completed, and marks those that have.
func (s *Space) querySettled() {
	defer s.timeSync(time.Now())
	for _, r := range s.cache {
		if p := r.pend; p != nil && !p.done {
			if done, err := s.dev.EventQuery(p.ev); err == nil && done {
				p.done = true
			}
		}
	}
}

// forgetParkWith forgets the last Settle's pending and drops the
// reference parkWith holds: its event is destroyed now when that reclaim
// parked nothing with it, or when everything it parked has let it go
// since (a mapping took its standby runs back).
func (s *Space) forgetParkWith() {
	s.drop(s.parkWith)
	s.parkWith = nil
}

// waitFor waits, before the cached run r is mapped in a range of stream,
// for the work that may still use it elsewhere, unless r is ready there.
// A capture never gets here with a run that is not settled (takeCached
// and revivable leave such runs out).
func (s *Space) waitFor(r cachedRun, stream uint64) error {
	if r.pend.ready(stream) {
		return nil
	}
	return s.wait(r.pend)
}

// parkedWith returns, with a reference taken, the pending that UnmapBlock
// attaches to what it parks from a segment of stream: the last Settle's,
// when that Settle recorded one for this stream, else nil (the stream was
// waited for).
func (s *Space) parkedWith(stream uint64) *pending {
	if p := s.parkWith; p != nil && p.stream == blocks.DeviceStream(stream) {
		return p.hold()
	}
	return nil
}

// Keeps says whether a reclaim for a mapping in the small or the large
// pool keeps the runs of the free block b in the handle cache, to map
// again, rather than release them: when that mapping can map them (pages
// of its size; the small pool maps the small pool's one-page runs only).
func (s *Space) Keeps(b *blocks.Block, small bool) bool {
	return b.Segment.PageSize == s.PageSize(small) && (!small || b.Segment.Small)
}

// Settle readies the free blocks in list, which a reclaim for a mapping
// in the small or the large pool of stream is about to unmap, and returns
// how many streams it waited for. Unmapping does not wait for queued work
// that may still read or write the pages, as cudaFree would. A block
// whose runs are released (Keeps false), or whose segment another stream
// owns, first has its stream's work waited for, once per stream, as in
// PyTorch's ExpandableSegment::unmapHandles: a free block in a free index
// was last used either on its own stream or on other streams through
// RecordStream, and then it entered the free index only after the events
// recorded on those streams completed. Other streams keep running. A
// stream the device no longer knows (destroyed, the allocator not told)
// makes it wait for the whole device instead.
//
// With standby mappings (Config.Standby), a block of the mapping's own
// stream whose runs are kept needs no wait: they stay mapped at their
// old addresses, which the work queued before may still use, and their
// next user on that stream is queued after it. Settle records an event on
// the stream instead, which UnmapBlock attaches to what it parks: a
// standby mapping is unmapped, and a cached run mapped for another
// stream, only once that work has completed (see "Reclaim without
// waiting" in the package doc). When the event cannot be created or
// recorded, Settle waits for the stream instead.
func (s *Space) Settle(list []*blocks.Block, small bool, stream uint64) (int, error) {
	s.forgetParkWith()
	var done [8]uint64
	synced := done[:0]
	for _, b := range list {
		st := blocks.DeviceStream(b.Segment.Stream)
		if slices.Contains(synced, st) {
			continue // waited for: what is parked from it waits for nothing
		}
		if s.cfg.Standby && s.Keeps(b, small) && st == blocks.DeviceStream(stream) {
			if s.parkWith != nil {
				continue
			}
			p, err := s.record(st)
			if err == nil {
				s.parkWith = p.hold()
				continue
			}
			// Without an event, wait for the stream, as without standby
			// mappings: what UnmapBlock parks then waits for nothing.
			s.log.Warn("a reclaim waits for its stream instead", zap.Error(err))
		}
		s.calls.Waits++
		t0 := time.Now()
		err := s.dev.StreamSynchronize(cudart.Stream(st))
		s.timeSync(t0)
		if err != nil {
			if !errors.Is(err, cudart.ErrInvalidValue) {
				return len(synced), fmt.Errorf("allocator: synchronising stream %#x before unmapping: %w", st, err)
			}
			if err := s.dev.Synchronize(); err != nil {
				return len(synced), fmt.Errorf("allocator: synchronising the device before unmapping (stream %#x is gone): %w", st, err)
			}
			return len(synced) + 1, nil
		}
		synced = append(synced, st)
	}
	return len(synced), nil
}

// record returns a pending for the work queued on the device stream now,
// with no reference yet: an event recorded there. Settle takes the first
// for parkWith.
func (s *Space) record(stream uint64) (*pending, error) {
	defer s.timeSync(time.Now())
	ev, err := s.dev.EventCreate()
	if err != nil {
		return nil, fmt.Errorf("allocator: creating an event for a reclaim: %w", err)
	}
	if err := s.dev.EventRecord(ev, cudart.Stream(stream)); err != nil {
		if derr := s.dev.EventDestroy(ev); derr != nil {
			s.log.Error("destroying an event failed", zap.Error(derr))
		}
		return nil, fmt.Errorf("allocator: recording an event on stream %#x for a reclaim: %w", stream, err)
	}
	return &pending{ev: ev, stream: stream}, nil
}
