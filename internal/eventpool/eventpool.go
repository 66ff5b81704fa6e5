// Package eventpool keeps a device's created CUDA events for reuse, so that
// recording an event at a free creates one only when none is idle. The
// device allocator and the pinned host allocator each hold one Pool.
package eventpool

import (
	"iter"

	"github.com/allocd/allocd/cudart"
)

// Device is what a Pool needs of a device: creating and destroying events.
// Every cudart.Device is one.
type Device interface {
	EventCreate() (cudart.Event, error)
	EventDestroy(e cudart.Event) error
}

// Pool holds events that were created and are not in use. The zero Pool
// is empty and ready. A Pool is not safe for concurrent use: its owner's
// lock guards it. Get and Put allocate nothing once the pool has held as
// many events as are idle at once.
type Pool struct {
	idle []cudart.Event
}

// Get returns the event put back last, or, when none is idle, a new one
// from dev. dev's error is returned unwrapped; the pool is then unchanged.
func (p *Pool) Get(dev Device) (cudart.Event, error) {
	if n := len(p.idle); n > 0 {
		ev := p.idle[n-1]
		p.idle = p.idle[:n-1]
		return ev, nil
	}
	return dev.EventCreate()
}

// Put makes ev idle, for a later Get. ev must be an event of the pool's
// device that is not recorded on any stream still running and is not idle
// already.
func (p *Pool) Put(ev cudart.Event) { p.idle = append(p.idle, ev) }

// PutAll makes every event of evs idle, as Put does.
func (p *Pool) PutAll(evs []cudart.Event) { p.idle = append(p.idle, evs...) }

// Len returns how many events are idle.
func (p *Pool) Len() int { return len(p.idle) }

// All yields the idle events, for checks; the pool must not change while
// they are yielded.
func (p *Pool) All() iter.Seq[cudart.Event] {
	return func(yield func(cudart.Event) bool) {
		for _, ev := range p.idle {
			if !yield(ev) {
				return
			}
		}
	}
}

// Destroy destroys every idle event with dev and empties the pool. It
// returns the errors of the destroys that failed, unwrapped, in order; an
// event whose destroy failed is dropped all the same.
func (p *Pool) Destroy(dev Device) []error {
	var errs []error
	for _, ev := range p.idle {
		if err := dev.EventDestroy(ev); err != nil {
			errs = append(errs, err)
		}
	}
	p.idle = nil
	return errs
}
