package simdev

import (
	"errors"
	"testing"

	"github.com/allocd/allocd/cudart"
)

// TestStreamWaitEvent: a stream that waits for an event finds it
// complete (the simulated device finishes the event's stream up to it);
// an unknown event or stream is refused, and each call is counted.
func TestStreamWaitEvent(t *testing.T) {
	s, err := New(Config{Capacity: 1 << 30, ManualEvents: true})
	if err != nil {
		t.Fatal(err)
	}
	first, _ := s.StreamCreate()
	later, _ := s.StreamCreate()
	ev, _ := s.EventCreate()
	if err := s.EventRecord(ev, first); err != nil {
		t.Fatal(err)
	}
	if done, _ := s.EventQuery(ev); done {
		t.Fatal("a recorded event is complete before anything waits for it (ManualEvents)")
	}
	if err := s.StreamWaitEvent(later, ev); err != nil {
		t.Fatal(err)
	}
	if done, _ := s.EventQuery(ev); !done {
		t.Error("the event is not complete after a stream waited for it")
	}
	if err := s.StreamWaitEvent(later, ev+100); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("StreamWaitEvent(unknown event) = %v, want ErrInvalidValue", err)
	}
	if err := s.StreamWaitEvent(cudart.Stream(0xdead), ev); err == nil {
		t.Error("StreamWaitEvent(unknown stream) = nil, want an error")
	}
	if n := s.Counters().StreamWaits; n != 1 {
		t.Errorf("StreamWaits = %d, want 1", n)
	}
	var _ cudart.StreamWaiter = s
}
