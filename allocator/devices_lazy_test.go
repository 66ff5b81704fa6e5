package allocator

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// lazySims returns an open function for NewLazyDevices over simulated
// devices of 1 GiB, counting the opens of each index, and the devices
// it opened.
func lazySims(t *testing.T) (open func(int) (cudart.Device, error), opens *[4]atomic.Int32, opened *[]cudart.Device) {
	var mu sync.Mutex
	var devs []cudart.Device
	var n [4]atomic.Int32
	return func(i int) (cudart.Device, error) {
		n[i].Add(1)
		s, err := simdev.New(simdev.Config{Capacity: 1 << 30, Index: i})
		if err != nil {
			return nil, err
		}
		mu.Lock()
		devs = append(devs, s)
		mu.Unlock()
		return s, nil
	}, &n, &devs
}

// TestLazyDevices: a lazy Devices creates a device's allocator at its
// first ForDevice, once under concurrent callers, and only then lists it;
// Created never creates; an index outside 0..n-1 wraps ErrNoSuchDevice;
// history options reach allocators created later; a free on a device not
// yet created is an unknown pointer, or another device's; Close closes
// the devices it opened and creates nothing after.
func TestLazyDevices(t *testing.T) {
	open, opens, opened := lazySims(t)
	d, err := NewLazyDevices(4, open, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if d.Len() != 0 || len(d.All()) != 0 {
		t.Fatalf("a new lazy Devices holds %d allocators, want 0", d.Len())
	}
	if _, ok := d.Created(0); ok {
		t.Fatal("Created(0) reports an allocator before any use")
	}
	for _, i := range []int{-1, 4, 127} {
		if _, err := d.ForDevice(i); !errors.Is(err, ErrNoSuchDevice) {
			t.Errorf("ForDevice(%d) = %v, want ErrNoSuchDevice", i, err)
		}
	}
	if err := d.RecordHistory(HistoryOptions{MaxEntries: 100}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	got := make([]*Allocator, 8)
	for g := range got {
		wg.Go(func() {
			a, err := d.ForDevice(2)
			if err != nil {
				t.Error(err)
			}
			got[g] = a
		})
	}
	wg.Wait()
	for _, a := range got[1:] {
		if a != got[0] {
			t.Fatal("concurrent first uses of device 2 got different allocators")
		}
	}
	if n := opens[2].Load(); n != 1 {
		t.Errorf("device 2 opened %d times, want 1", n)
	}
	a0, err := d.ForDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	if idx := d.Indexes(); len(idx) != 2 || idx[0] != 0 || idx[1] != 2 {
		t.Errorf("Indexes() = %v, want [0 2]", idx)
	}
	if a, ok := d.Created(2); !ok || a != got[0] {
		t.Errorf("Created(2) = %p, %v; want device 2's allocator", a, ok)
	}
	p, err := a0.Malloc(1<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(a0.Snapshot().DeviceTraces[0]); n == 0 {
		t.Error("device 0, created after RecordHistory, records no history")
	}
	// Device 1 has no allocator: a free there is an unknown pointer, or
	// device 0's pointer, named as such; neither creates device 1.
	if err := d.FreeOn(1, 0x1000); !errors.Is(err, ErrUnknownPointer) || errors.Is(err, ErrWrongDevice) {
		t.Errorf("FreeOn(1, unknown) = %v, want ErrUnknownPointer", err)
	}
	var wd *WrongDeviceError
	if err := d.FreeOn(1, p); !errors.As(err, &wd) || wd.Owner != 0 || !wd.Live {
		t.Errorf("FreeOn(1, device 0's pointer) = %v, want a WrongDeviceError naming device 0", err)
	}
	if _, ok := d.Created(1); ok {
		t.Error("FreeOn created device 1")
	}
	if err := d.FreeOn(0, p); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	for _, dev := range *opened {
		if _, _, err := dev.MemGetInfo(); !errors.Is(err, cudart.ErrClosed) {
			t.Errorf("device %d still open after Close: %v", dev.Info().Index, err)
		}
	}
	if _, err := d.ForDevice(3); !errors.Is(err, ErrClosed) {
		t.Errorf("ForDevice(3) after Close = %v, want ErrClosed", err)
	}
}

// TestLazyDevicesOpenErrors: a failed open, or a device with another
// index, creates nothing, and the next use tries again; bad arguments to
// NewLazyDevices are refused.
func TestLazyDevicesOpenErrors(t *testing.T) {
	boom := errors.New("boom")
	var fail atomic.Bool
	fail.Store(true)
	d, err := NewLazyDevices(2, func(i int) (cudart.Device, error) {
		if fail.Load() {
			return nil, boom
		}
		if i == 1 {
			return simdev.New(simdev.Config{Capacity: 1 << 30, Index: 0}) // the wrong index
		}
		return simdev.New(simdev.Config{Capacity: 1 << 30, Index: i})
	}, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.ForDevice(0); !errors.Is(err, boom) {
		t.Errorf("ForDevice(0) with a failing open = %v, want boom", err)
	}
	fail.Store(false)
	if _, err := d.ForDevice(0); err != nil {
		t.Errorf("ForDevice(0) after the open recovered: %v", err)
	}
	if _, err := d.ForDevice(1); !errors.Is(err, cudart.ErrInvalidValue) {
		t.Errorf("ForDevice(1) opening a device of index 0 = %v, want ErrInvalidValue", err)
	}
	if d.Len() != 1 {
		t.Errorf("Len() = %d, want 1", d.Len())
	}
	for _, c := range []struct {
		n    int
		open func(int) (cudart.Device, error)
		cfg  Config
	}{
		{0, func(int) (cudart.Device, error) { return nil, nil }, DefaultConfig()},
		{1, nil, DefaultConfig()},
		{1, func(int) (cudart.Device, error) { return nil, nil }, Config{}},
	} {
		if _, err := NewLazyDevices(c.n, c.open, c.cfg); err == nil {
			t.Errorf("NewLazyDevices(%d, open nil %v, %+v) accepted", c.n, c.open == nil, c.cfg)
		}
	}
}

// TestLazyDevicesLogConf: each created allocator is logged with its
// effective configuration: "defaults" for PyTorch's, never "".
func TestLazyDevicesLogConf(t *testing.T) {
	split, err := ParseConfig("max_split_size_mb:64")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{DefaultConfig(), "defaults"},
		{split, "max_split_size_mb:64"},
	} {
		core, logs := observer.New(zap.InfoLevel)
		open, _, _ := lazySims(t)
		d, err := NewLazyDevices(1, open, c.cfg, WithLogger(zap.New(core)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.ForDevice(0); err != nil {
			t.Fatal(err)
		}
		got := logs.FilterMessage("device allocator created").All()
		if len(got) != 1 || got[0].ContextMap()["conf"] != c.want || got[0].ContextMap()["gpu"] != int64(0) {
			t.Errorf("config %q: logged %+v; want one line with conf %q and gpu 0", c.cfg.String(), got, c.want)
		}
		_ = d.Close()
	}
}

// TestLazyDevicesHistoryRange: RecordHistory refuses options out of
// range before any device exists, so that no later creation fails on
// them.
func TestLazyDevicesHistoryRange(t *testing.T) {
	open, _, _ := lazySims(t)
	d, err := NewLazyDevices(1, open, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	for _, opt := range []HistoryOptions{{MaxEntries: MaxHistoryEntries + 1}, {MaxEntries: 10, StackDepth: -1}, {MaxEntries: -1}} {
		if err := d.RecordHistory(opt); !errors.Is(err, ErrHistory) {
			t.Errorf("RecordHistory(%+v) = %v, want ErrHistory", opt, err)
		}
	}
	if _, err := d.ForDevice(0); err != nil {
		t.Errorf("ForDevice(0) after refused history options: %v", err)
	}
}
