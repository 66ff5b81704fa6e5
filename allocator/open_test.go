package allocator_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/envcases"
	"github.com/allocd/allocd/simdev"
)

// TestOpenSim: ALLOCD_DEVICE=sim gives a simulated device of the default
// or ALLOCD_SIM_CAPACITY size, configured by ALLOCD_CONF, closed by Close.
func TestOpenSim(t *testing.T) {
	t.Setenv("ALLOCD_DEVICE", "sim")
	t.Setenv("ALLOCD_CONF", "max_split_size_mb:64")
	t.Setenv("ALLOCD_SIM_CAPACITY", "")
	a, err := allocator.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	dev := a.Device()
	if _, ok := dev.(*simdev.Sim); !ok {
		t.Fatalf("device is a %T, want *simdev.Sim", dev)
	}
	if _, total, _ := dev.MemGetInfo(); total != allocator.DefaultSimCapacity {
		t.Errorf("capacity %d, want DefaultSimCapacity", total)
	}
	if got := a.Config().MaxSplitSize; got != 64<<20 {
		t.Errorf("max_split_size %d: ALLOCD_CONF not read", got)
	}
	p, err := a.Malloc(1<<20, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Free(p); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := dev.Malloc(512); !errors.Is(err, cudart.ErrClosed) {
		t.Errorf("device still open after Close: %v", err)
	}

	t.Setenv("ALLOCD_SIM_CAPACITY", "2GiB")
	a, err = allocator.Open(0, allocator.WithConfig(allocator.DefaultConfig()))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if _, total, _ := a.Device().MemGetInfo(); total != 2<<30 {
		t.Errorf("ALLOCD_SIM_CAPACITY=2GiB gave %d bytes", total)
	}
	if a.Config().MaxSplitSize == 64<<20 {
		t.Errorf("WithConfig did not override ALLOCD_CONF")
	}
}

// TestOpenErrors: bad variables are errors naming the variable; never a
// silent fallback.
func TestOpenErrors(t *testing.T) {
	for _, tc := range []struct {
		device, capacity, conf string
		want                   error
		mention                []string
	}{
		{"tpu", "", "", allocator.ErrEnv, []string{"ALLOCD_DEVICE", "cuda", "sim", "sim:N"}},
		{"sim:0", "", "", allocator.ErrEnv, []string{"ALLOCD_DEVICE"}},
		{"sim:x", "", "", allocator.ErrEnv, []string{"ALLOCD_DEVICE"}},
		{"sim", "lots", "", allocator.ErrEnv, []string{"ALLOCD_SIM_CAPACITY"}},
		{"sim", "0", "", allocator.ErrEnv, []string{"ALLOCD_SIM_CAPACITY"}},
		{"sim", "NaN", "", allocator.ErrEnv, []string{"ALLOCD_SIM_CAPACITY"}},
		{"sim", "-1GiB", "", allocator.ErrEnv, []string{"ALLOCD_SIM_CAPACITY"}},
		{"sim", "", "no_such_key:1", allocator.ErrConfig, []string{"ALLOCD_CONF", "no_such_key"}},
	} {
		t.Setenv("ALLOCD_DEVICE", tc.device)
		t.Setenv("ALLOCD_SIM_CAPACITY", tc.capacity)
		t.Setenv("ALLOCD_CONF", tc.conf)
		a, err := allocator.Open(0)
		if err == nil {
			a.Close()
			t.Errorf("%+v: Open succeeded", tc)
			continue
		}
		if !errors.Is(err, tc.want) {
			t.Errorf("%+v: %v, want %v", tc, err, tc.want)
		}
		for _, m := range tc.mention {
			if !strings.Contains(err.Error(), m) {
				t.Errorf("%+v: error %q does not mention %q", tc, err, m)
			}
		}
	}
}

// TestOpenCUDA: without ALLOCD_DEVICE, Open means CUDA: on a machine
// without a driver it fails, and never hands out a simulated device.
func TestOpenCUDA(t *testing.T) {
	for _, v := range []string{"", "cuda"} {
		t.Setenv("ALLOCD_DEVICE", v)
		t.Setenv("ALLOCD_CONF", "")
		a, err := allocator.Open(0)
		if err != nil {
			if !strings.Contains(err.Error(), "ALLOCD_DEVICE=sim") {
				t.Errorf("the CUDA error does not say how to ask for a simulated device: %v", err)
			}
			continue
		}
		if _, ok := a.Device().(*cudart.CUDA); !ok {
			t.Errorf("ALLOCD_DEVICE=%q gave a %T", v, a.Device())
		}
		a.Close()
	}
}

// TestOpenDevicesSim: ALLOCD_DEVICE=sim:N gives N simulated devices, owned
// by the Devices.
func TestOpenDevicesSim(t *testing.T) {
	t.Setenv("ALLOCD_DEVICE", "sim:3")
	t.Setenv("ALLOCD_SIM_CAPACITY", "1GiB")
	t.Setenv("ALLOCD_CONF", "")
	d, err := allocator.OpenDevices()
	if err != nil {
		t.Fatal(err)
	}
	if got := d.Indexes(); len(got) != 3 || got[2] != 2 {
		t.Errorf("indexes %v, want 0 1 2", got)
	}
	p, err := d.MallocOn(2, 4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Free(p); err != nil {
		t.Fatal(err)
	}
	devs := d.All()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	for _, a := range devs {
		if _, err := a.Device().Malloc(512); !errors.Is(err, cudart.ErrClosed) {
			t.Errorf("device %d still open after Close: %v", a.Device().Info().Index, err)
		}
	}
	if a, err := allocator.Open(3); !errors.Is(err, allocator.ErrNoSuchDevice) {
		if a != nil {
			a.Close()
		}
		t.Errorf("Open(3) with sim:3: %v, want ErrNoSuchDevice", err)
	}
}

// TestOpenEnvCases runs the table every tool shares (package envcases)
// through Open: each bad value is an ErrEnv naming the variable, and each
// good one gives the devices devspec.ParseEnv says, of its capacity.
func TestOpenEnvCases(t *testing.T) {
	t.Setenv("ALLOCD_CONF", "")
	for _, c := range envcases.Cases {
		t.Setenv("ALLOCD_DEVICE", c.Device)
		t.Setenv("ALLOCD_SIM_CAPACITY", c.SimCapacity)
		a, err := allocator.Open(0)
		switch {
		case c.Err != "":
			if err == nil {
				a.Close()
			}
			if !errors.Is(err, allocator.ErrEnv) || !strings.Contains(err.Error(), c.Err) {
				t.Errorf("%+v: Open = %v; want an ErrEnv mentioning %q", c, err, c.Err)
			}
		case c.Sims == 0:
			// CUDA: without a driver an error that is not ErrEnv.
			if err == nil {
				a.Close()
			} else if errors.Is(err, allocator.ErrEnv) {
				t.Errorf("%+v: Open = %v; want CUDA", c, err)
			}
		default:
			if err != nil {
				t.Errorf("%+v: Open = %v", c, err)
				continue
			}
			want := c.Capacity
			if want == envcases.DefaultSimCapacity {
				want = allocator.DefaultSimCapacity
			}
			if _, total, _ := a.Device().MemGetInfo(); total != want {
				t.Errorf("%+v: capacity %d, want %d", c, total, want)
			}
			a.Close()
			b, err := allocator.Open(c.Sims)
			if !errors.Is(err, allocator.ErrNoSuchDevice) {
				t.Errorf("%+v: Open(%d) = %v; want ErrNoSuchDevice", c, c.Sims, err)
			}
			if err == nil {
				b.Close()
			}
		}
	}
}
