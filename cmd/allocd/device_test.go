package main

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
)

func TestParseDevicesSpec(t *testing.T) {
	for _, c := range []struct {
		in   string
		want deviceSpec
	}{
		{"sim", deviceSpec{sim: true, count: 1}},
		{"sim:1", deviceSpec{sim: true, count: 1}},
		{"sim:4", deviceSpec{sim: true, count: 4}},
		{"sim:64", deviceSpec{sim: true, count: 64}},
		{"cuda", deviceSpec{count: 1}},
		{"cuda:0", deviceSpec{count: 1}},
		{"cuda:3", deviceSpec{index: 3, count: 1}},
		{"cuda:all", deviceSpec{all: true}},
	} {
		got, err := parseDevicesSpec(c.in)
		if err != nil || got != c.want {
			t.Errorf("parseDevicesSpec(%q) = %+v, %v; want %+v", c.in, got, err, c.want)
		}
		// String gives back a form that parses to the same spec.
		if again, err := parseDevicesSpec(got.String()); err != nil || again != got {
			t.Errorf("%q: String %q parses to %+v, %v", c.in, got.String(), again, err)
		}
	}
	for _, in := range []string{"", "gpu", "sim:", "sim:0", "sim:-1", "sim:65", "sim:x", "sim:all", "cuda:", "cuda:-1", "cuda:x", "cuda:1,2", "CUDA"} {
		if got, err := parseDevicesSpec(in); err == nil || !strings.Contains(err.Error(), "--device") {
			t.Errorf("parseDevicesSpec(%q) = %+v, %v; want an error about --device", in, got, err)
		}
	}
}

// TestParseDeviceSpecOneDevice: the commands that use one device (replay,
// bench) keep sim, cuda and cuda:N, and refuse the serve-only forms.
func TestParseDeviceSpecOneDevice(t *testing.T) {
	for in, want := range map[string]deviceSpec{
		"sim":    {sim: true, count: 1},
		"cuda":   {count: 1},
		"cuda:2": {index: 2, count: 1},
	} {
		if got, err := parseDeviceSpec(in); err != nil || got != want {
			t.Errorf("parseDeviceSpec(%q) = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"sim:1", "sim:2", "cuda:all"} {
		if _, err := parseDeviceSpec(in); err == nil || !strings.Contains(err.Error(), "allocd serve") {
			t.Errorf("parseDeviceSpec(%q) = %v; want an error saying it is for allocd serve", in, err)
		}
	}
	if _, err := parseDeviceSpec("tpu"); err == nil || !strings.Contains(err.Error(), "expected sim, cuda or cuda:N") {
		t.Errorf("parseDeviceSpec(tpu) = %v", err)
	}
}

func TestOpenDevicesSim(t *testing.T) {
	spec, err := parseDevicesSpec("sim:3")
	if err != nil {
		t.Fatal(err)
	}
	devs, err := openDevices(spec, cudart.SimConfig{Capacity: 8 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer closeDevices(devs)
	if len(devs) != 3 {
		t.Fatalf("sim:3 opened %d devices", len(devs))
	}
	seen := map[cudart.Ptr]int{}
	for i, dev := range devs {
		info := dev.Info()
		if info.Index != i || info.TotalMemory != 8<<30 {
			t.Errorf("device %d: %+v", i, info)
		}
		p, err := dev.Malloc(2 << 20)
		if err != nil {
			t.Fatal(err)
		}
		if j, dup := seen[p]; dup {
			t.Errorf("devices %d and %d both handed out %#x", j, i, uint64(p))
		}
		seen[p] = i
	}
	one, err := openDevices(deviceSpec{sim: true, count: 1}, cudart.SimConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer closeDevices(one)
	if len(one) != 1 || one[0].Info().TotalMemory != defaultSimCapacity {
		t.Errorf("sim: %d devices of %d bytes", len(one), one[0].Info().TotalMemory)
	}
}

// fakeCUDA replaces the CUDA calls of openDevices with Sims: count devices,
// of which the one with index failAt (if any) cannot be opened.
func fakeCUDA(t *testing.T, count int, countErr error, failAt int) *[]*cudart.Sim {
	t.Helper()
	oldCount, oldOpen := cudaDeviceCount, openCUDAIndex
	t.Cleanup(func() { cudaDeviceCount, openCUDAIndex = oldCount, oldOpen })
	opened := &[]*cudart.Sim{}
	cudaDeviceCount = func() (int, error) { return count, countErr }
	openCUDAIndex = func(i int) (cudart.Device, error) {
		if i == failAt {
			return nil, fmt.Errorf("cudart: open device %d: cudaErrorDevicesUnavailable: busy", i)
		}
		if i >= count {
			return nil, fmt.Errorf("cudart: open device %d: no such device: %w", i, cudart.ErrInvalidValue)
		}
		s, err := cudart.NewSim(cudart.SimConfig{Capacity: 1 << 30, Index: i, Name: "fake GPU"})
		if err != nil {
			return nil, err
		}
		*opened = append(*opened, s)
		return s, nil
	}
	return opened
}

func TestOpenDevicesCUDAAll(t *testing.T) {
	all := deviceSpec{all: true}
	t.Run("every device", func(t *testing.T) {
		fakeCUDA(t, 4, nil, -1)
		devs, err := openDevices(all, cudart.SimConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer closeDevices(devs)
		if len(devs) != 4 {
			t.Fatalf("cuda:all opened %d devices, want 4", len(devs))
		}
		for i, d := range devs {
			if d.Info().Index != i {
				t.Errorf("device %d has index %d", i, d.Info().Index)
			}
		}
	})
	t.Run("one failing closes the others", func(t *testing.T) {
		opened := fakeCUDA(t, 4, nil, 2)
		devs, err := openDevices(all, cudart.SimConfig{})
		if devs != nil || err == nil || !strings.Contains(err.Error(), "opening device 2 of 4") {
			t.Fatalf("openDevices = %v, %v; want an error naming device 2", devs, err)
		}
		if len(*opened) != 2 {
			t.Fatalf("%d devices opened before the failure, want 2", len(*opened))
		}
		for _, s := range *opened {
			if _, err := s.Malloc(512); !errors.Is(err, cudart.ErrClosed) {
				t.Errorf("device %d left open after the failure: Malloc = %v", s.Info().Index, err)
			}
		}
	})
	t.Run("no device", func(t *testing.T) {
		fakeCUDA(t, 0, nil, -1)
		if _, err := openDevices(all, cudart.SimConfig{}); err == nil || !strings.Contains(err.Error(), "no device") {
			t.Errorf("openDevices with no device = %v", err)
		}
	})
	t.Run("no driver", func(t *testing.T) {
		fakeCUDA(t, 0, fmt.Errorf("cudart: no libcudart: %w", cudart.ErrNoDriver), -1)
		if _, err := openDevices(all, cudart.SimConfig{}); !errors.Is(err, cudart.ErrNoDriver) || !strings.Contains(err.Error(), "cuda:all") {
			t.Errorf("openDevices without a driver = %v", err)
		}
	})
	t.Run("cuda:N", func(t *testing.T) {
		fakeCUDA(t, 4, nil, -1)
		devs, err := openDevices(deviceSpec{index: 3, count: 1}, cudart.SimConfig{})
		if err != nil {
			t.Fatal(err)
		}
		defer closeDevices(devs)
		if len(devs) != 1 || devs[0].Info().Index != 3 {
			t.Errorf("cuda:3 opened %d devices, the first %+v", len(devs), devs[0].Info())
		}
		if _, err := openDevices(deviceSpec{index: 9, count: 1}, cudart.SimConfig{}); !errors.Is(err, cudart.ErrInvalidValue) {
			t.Errorf("cuda:9 of 4 = %v", err)
		}
	})
}

// TestRunServeCUDAAll runs the daemon on cuda:all with the CUDA calls
// replaced by three Sims: it serves every device under its own gpu label.
func TestRunServeCUDAAll(t *testing.T) {
	fakeCUDA(t, 3, nil, -1)
	d := startServeInProcess(t, "--device", "cuda:all")
	_, body := serveScrape(t, d.url+"/metrics")
	for i := range 3 {
		want := fmt.Sprintf(`allocd_device_info{UUID="SIM-%08x-0000-0000-0000-000000000000",gpu="%d",model_name="fake GPU"} 1`, i, i)
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	d.stop(t)
	for i := range 3 {
		if serveFindLogWith(d.logs.String(), "allocator closed: every segment returned to the device", "gpu", float64(i)) == nil {
			t.Errorf("no clean close of gpu %d:\n%s", i, d.logs)
		}
	}
}
