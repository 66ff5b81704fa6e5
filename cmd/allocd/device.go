package main

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// defaultSimCapacity is the simulated device's memory: an H200's 141 GiB.
const defaultSimCapacity = 141 << 30

// maxSimDevices bounds sim:N. Each simulated device gets its own 1 TiB of
// address space; 64 keeps them, and the recorded addresses of a replay
// shifted per device (simPlanFor), well apart.
const maxSimDevices = 64

// simDeviceSpan is how far a replay's recorded segment addresses are moved
// for each simulated device past the first, so that no two simulated
// devices hand out the same address, as no two GPUs of one process do.
const simDeviceSpan = 1 << 40

// deviceSpec is a parsed --device value: "sim", "sim:N", "cuda", "cuda:N"
// or "cuda:all".
type deviceSpec struct {
	sim   bool
	index int  // cuda:N: the device index
	count int  // sim:N: the number of simulated devices (1 for sim)
	all   bool // cuda:all: every CUDA device visible
}

// String returns the spec in --device's syntax.
func (s deviceSpec) String() string {
	switch {
	case s.sim && s.count > 1:
		return fmt.Sprintf("sim:%d", s.count)
	case s.sim:
		return "sim"
	case s.all:
		return "cuda:all"
	}
	return fmt.Sprintf("cuda:%d", s.index)
}

// multi reports whether the spec can name several devices.
func (s deviceSpec) multi() bool { return s.all || s.count > 1 }

// parseDeviceSpec parses a --device value that names one device: sim,
// cuda (device 0) or cuda:N. The forms for several devices (sim:N,
// cuda:all) are refused with a word on where they work.
func parseDeviceSpec(s string) (deviceSpec, error) {
	spec, err := parseDevicesSpec(s)
	if err != nil {
		return spec, fmt.Errorf("--device %q: expected sim, cuda or cuda:N", s)
	}
	if spec.multi() || strings.HasPrefix(s, "sim:") {
		return deviceSpec{}, fmt.Errorf("--device %q: this command uses one device: sim, cuda or cuda:N (sim:N and cuda:all are for allocd serve)", s)
	}
	return spec, nil
}

// parseDevicesSpec parses a --device value of allocd serve: sim, sim:N (N
// simulated devices, indexes 0..N-1), cuda (device 0), cuda:N or cuda:all
// (every CUDA device visible).
func parseDevicesSpec(s string) (deviceSpec, error) {
	const expected = "expected sim, sim:N, cuda, cuda:N or cuda:all"
	switch {
	case s == "sim":
		return deviceSpec{sim: true, count: 1}, nil
	case strings.HasPrefix(s, "sim:"):
		n, err := strconv.Atoi(strings.TrimPrefix(s, "sim:"))
		if err != nil || n < 1 || n > maxSimDevices {
			return deviceSpec{}, fmt.Errorf("--device %q: sim:N wants N simulated devices, 1 to %d (%s)", s, maxSimDevices, expected)
		}
		return deviceSpec{sim: true, count: n}, nil
	case s == "cuda":
		return deviceSpec{count: 1}, nil
	case s == "cuda:all":
		return deviceSpec{all: true}, nil
	case strings.HasPrefix(s, "cuda:"):
		n, err := strconv.Atoi(strings.TrimPrefix(s, "cuda:"))
		if err != nil || n < 0 {
			return deviceSpec{}, fmt.Errorf("--device %q: cuda:N wants N a device index (0, 1, …) or all (%s)", s, expected)
		}
		return deviceSpec{index: n, count: 1}, nil
	}
	return deviceSpec{}, fmt.Errorf("--device %q: %s", s, expected)
}

// openDevice opens the device a single-device spec names. A sim device is
// created with the given capacity and options.
func openDevice(spec deviceSpec, simCfg cudart.SimConfig) (cudart.Device, error) {
	if spec.sim {
		if simCfg.Capacity == 0 {
			simCfg.Capacity = defaultSimCapacity
		}
		return cudart.NewSim(simCfg)
	}
	return openCUDA(spec.index)
}

// The CUDA calls of openDevices; tests replace them.
var (
	cudaDeviceCount = cudart.DeviceCount
	openCUDAIndex   = openCUDA
)

// openDevices opens every device a spec names, in ascending index: for
// sim:N, N simulated devices with indexes 0..N-1, each configured as
// simCfg (its planned addresses moved by simDeviceSpan per index, so that
// no two hand out the same address); for cuda:all, every device
// cudart.DeviceCount reports. If one cannot be opened, those already open
// are closed and the error names the device.
func openDevices(spec deviceSpec, simCfg cudart.SimConfig) ([]cudart.Device, error) {
	var open func(i int) (cudart.Device, error)
	n := max(spec.count, 1)
	switch {
	case spec.sim:
		open = func(i int) (cudart.Device, error) {
			cfg := simCfg
			cfg.Index = i
			cfg.Addresses = simPlanFor(simCfg.Addresses, i)
			return openDevice(spec, cfg)
		}
	case spec.all:
		count, err := cudaDeviceCount()
		if err != nil {
			return nil, fmt.Errorf("--device cuda:all: %w", err)
		}
		if count == 0 {
			return nil, errors.New("--device cuda:all: the CUDA driver reports no device (is CUDA_VISIBLE_DEVICES empty?)")
		}
		n, open = count, openCUDAIndex
	default:
		dev, err := openCUDAIndex(spec.index)
		if err != nil {
			return nil, err
		}
		return []cudart.Device{dev}, nil
	}
	devs := make([]cudart.Device, 0, n)
	for i := range n {
		dev, err := open(i)
		if err != nil {
			closeDevices(devs)
			return nil, fmt.Errorf("--device %s: opening device %d of %d: %w", spec, i, n, err)
		}
		devs = append(devs, dev)
	}
	return devs, nil
}

// simPlanFor moves planned Sim addresses for simulated device index i.
// Moving every address by the same amount keeps their order, and best fit
// breaks ties by address, so each device places blocks as the first does.
func simPlanFor(plan []cudart.SimAddress, i int) []cudart.SimAddress {
	if i == 0 || len(plan) == 0 {
		return plan
	}
	out := make([]cudart.SimAddress, len(plan))
	for j, a := range plan {
		out[j] = cudart.SimAddress{Addr: a.Addr + cudart.Ptr(i)*simDeviceSpan, Size: a.Size}
	}
	return out
}

// closeDevices closes devices, ignoring their errors: it undoes a
// partial open.
func closeDevices(devs []cudart.Device) {
	for _, d := range devs {
		_ = d.Close()
	}
}

// resolveConf returns the configuration string to use: the flag when set,
// else ALLOCD_CONF.
func resolveConf(flagValue string, flagSet bool) string {
	if flagSet {
		return flagValue
	}
	return os.Getenv("ALLOCD_CONF")
}

// parseConf parses a configuration string, naming where it came from.
func parseConf(s string) (allocator.Config, error) {
	cfg, err := allocator.ParseConfig(s)
	if err != nil {
		return cfg, fmt.Errorf("configuration %q: %w", s, err)
	}
	return cfg, nil
}
