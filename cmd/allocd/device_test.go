package main

import (
	"fmt"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// fakeCUDA replaces the CUDA calls of serve's devices with Sims: count devices,
// of which the one with index failAt (if any) cannot be opened.
func fakeCUDA(t *testing.T, count int, countErr error, failAt int) *[]*simdev.Sim {
	t.Helper()
	oldCount, oldOpen := cudaDeviceCount, openCUDAIndex
	t.Cleanup(func() { cudaDeviceCount, openCUDAIndex = oldCount, oldOpen })
	opened := &[]*simdev.Sim{}
	cudaDeviceCount = func() (int, error) { return count, countErr }
	openCUDAIndex = func(i int) (cudart.Device, error) {
		if i == failAt {
			return nil, fmt.Errorf("cudart: open device %d: cudaErrorDevicesUnavailable: busy", i)
		}
		if i >= count {
			return nil, fmt.Errorf("cudart: open device %d: no such device: %w", i, cudart.ErrInvalidValue)
		}
		s, err := simdev.New(simdev.Config{Capacity: 1 << 30, Index: i, Name: "fake GPU"})
		if err != nil {
			return nil, err
		}
		*opened = append(*opened, s)
		return s, nil
	}
	return opened
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
