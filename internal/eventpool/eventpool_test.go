package eventpool

import (
	"errors"
	"slices"
	"testing"

	"github.com/allocd/allocd/cudart"
)

// fakeDevice creates events 1, 2, 3, ... and records what was destroyed.
type fakeDevice struct {
	next       cudart.Event
	createErr  error                  // EventCreate fails with it when set
	destroyErr map[cudart.Event]error // EventDestroy of these fails
	destroyed  []cudart.Event
}

func (d *fakeDevice) EventCreate() (cudart.Event, error) {
	if d.createErr != nil {
		return 0, d.createErr
	}
	d.next++
	return d.next, nil
}

func (d *fakeDevice) EventDestroy(e cudart.Event) error {
	d.destroyed = append(d.destroyed, e)
	return d.destroyErr[e]
}

func idle(p *Pool) []cudart.Event { return slices.Collect(p.All()) }

func TestGetPut(t *testing.T) {
	boom := errors.New("boom")
	tests := []struct {
		name      string
		put       []cudart.Event // Put one by one, before the Get
		putAll    []cudart.Event // then PutAll
		createErr error
		want      cudart.Event
		wantErr   error
		wantIdle  []cudart.Event // after the Get
		created   cudart.Event   // the fake device's last created event
	}{
		{name: "empty pool creates", want: 1, created: 1},
		{name: "idle event reused", put: []cudart.Event{7}, want: 7, wantIdle: []cudart.Event{}},
		{name: "last put first out", put: []cudart.Event{7, 8}, want: 8, wantIdle: []cudart.Event{7}},
		{name: "PutAll keeps the order", put: []cudart.Event{5}, putAll: []cudart.Event{6, 9}, want: 9, wantIdle: []cudart.Event{5, 6}},
		{name: "create fails, empty pool unchanged", createErr: boom, wantErr: boom},
		{name: "no create while one is idle", put: []cudart.Event{3}, createErr: boom, want: 3, wantIdle: []cudart.Event{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dev := &fakeDevice{createErr: tt.createErr}
			var p Pool
			for _, ev := range tt.put {
				p.Put(ev)
			}
			p.PutAll(tt.putAll)
			ev, err := p.Get(dev)
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Fatalf("Get error = %v, want %v", err, tt.wantErr)
			}
			if ev != tt.want {
				t.Errorf("Get = %d, want %d", ev, tt.want)
			}
			if got := idle(&p); !slices.Equal(got, tt.wantIdle) {
				t.Errorf("idle after Get = %v, want %v", got, tt.wantIdle)
			}
			if p.Len() != len(tt.wantIdle) {
				t.Errorf("Len = %d, want %d", p.Len(), len(tt.wantIdle))
			}
			if dev.next != tt.created {
				t.Errorf("device created up to event %d, want %d", dev.next, tt.created)
			}
		})
	}
}

func TestAllStopsEarly(t *testing.T) {
	var p Pool
	p.PutAll([]cudart.Event{1, 2, 3})
	var seen []cudart.Event
	for ev := range p.All() {
		seen = append(seen, ev)
		if ev == 2 {
			break
		}
	}
	if !slices.Equal(seen, []cudart.Event{1, 2}) {
		t.Errorf("All yielded %v before the break, want [1 2]", seen)
	}
}

func TestDestroy(t *testing.T) {
	errA, errB := errors.New("a"), errors.New("b")
	tests := []struct {
		name       string
		idle       []cudart.Event
		destroyErr map[cudart.Event]error
		wantErrs   []error
	}{
		{name: "empty pool"},
		{name: "every event destroyed", idle: []cudart.Event{1, 2, 3}},
		{name: "failures reported in order, the rest destroyed", idle: []cudart.Event{1, 2, 3, 4},
			destroyErr: map[cudart.Event]error{2: errA, 4: errB}, wantErrs: []error{errA, errB}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dev := &fakeDevice{destroyErr: tt.destroyErr}
			var p Pool
			p.PutAll(tt.idle)
			errs := p.Destroy(dev)
			if len(errs) != len(tt.wantErrs) {
				t.Fatalf("Destroy errors = %v, want %v", errs, tt.wantErrs)
			}
			for i := range errs {
				if errs[i] != tt.wantErrs[i] {
					t.Errorf("Destroy error %d = %v, want %v", i, errs[i], tt.wantErrs[i])
				}
			}
			if !slices.Equal(dev.destroyed, tt.idle) {
				t.Errorf("destroyed %v, want %v", dev.destroyed, tt.idle)
			}
			if p.Len() != 0 {
				t.Errorf("Len after Destroy = %d, want 0", p.Len())
			}
			// The pool is usable again: a Get creates.
			if ev, err := p.Get(dev); err != nil || ev != 1 {
				t.Errorf("Get after Destroy = %d, %v; want a new event 1", ev, err)
			}
		})
	}
}

// TestGetPutAllocateNothing: once warm, a Get and Put cycle allocates
// nothing (the allocators call them on their free paths).
func TestGetPutAllocateNothing(t *testing.T) {
	dev := &fakeDevice{}
	var p Pool
	p.PutAll([]cudart.Event{1, 2})
	allocs := testing.AllocsPerRun(100, func() {
		a, _ := p.Get(dev)
		b, _ := p.Get(dev)
		p.Put(a)
		p.PutAll([]cudart.Event{b})
	})
	if allocs != 0 {
		t.Errorf("a warm Get/Put cycle allocates %v times, want 0", allocs)
	}
	if dev.next != 0 {
		t.Errorf("a warm pool created %d events, want 0", dev.next)
	}
}
