// Package devspec parses and opens the device specifications allocd's
// commands take, and the byte sizes that go with them:
//
//	sim        one simulated device
//	sim:N      N simulated devices, indexes 0..N-1 (1 to MaxSimDevices)
//	cuda       CUDA device 0
//	cuda:N     CUDA device N
//	cuda:all   every CUDA device the process can see
//
// Parse accepts every form; ParseOne only those naming one device (sim,
// cuda, cuda:N), for work that runs on a single device. Opener.Open opens
// what a Spec names. A simulated device is used only when the spec says
// sim: a missing CUDA driver is an error, never a silent switch.
package devspec

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/allocd/allocd/cudart"
)

// DefaultSimCapacity is a simulated device's memory when the SimConfig
// given to Opener leaves it 0: an H200's 141 GiB.
const DefaultSimCapacity = 141 << 30

// MaxSimDevices bounds sim:N. Each simulated device gets its own range of
// addresses (cudart.SimRange), SimDeviceSpan apart.
const MaxSimDevices = 64

// SimDeviceSpan is how far planned Sim addresses move for each simulated
// device past the first (PlanFor), so that no two simulated devices hand
// out the same address, as no two GPUs of one process do.
const SimDeviceSpan = cudart.SimDeviceSpan

// ErrSpec is wrapped by every error of Parse and ParseOne.
var ErrSpec = errors.New("bad device spec")

// Spec is a parsed device specification. The zero value is cuda (CUDA
// device 0 is Index 0 with Count 1; see Parse).
type Spec struct {
	// Sim is set for sim and sim:N.
	Sim bool
	// Index is cuda:N's device index.
	Index int
	// Count is sim:N's number of simulated devices (1 for sim, cuda and
	// cuda:N, 0 for cuda:all).
	Count int
	// All is set for cuda:all.
	All bool
}

// String returns the spec in the syntax Parse reads; Parse(s.String())
// gives s back.
func (s Spec) String() string {
	switch {
	case s.Sim && s.Count > 1:
		return fmt.Sprintf("sim:%d", s.Count)
	case s.Sim:
		return "sim"
	case s.All:
		return "cuda:all"
	}
	return fmt.Sprintf("cuda:%d", s.Index)
}

// Multi reports whether the spec can name several devices (sim:N with N
// above 1, cuda:all).
func (s Spec) Multi() bool { return s.All || s.Count > 1 }

// Parse parses any form: sim, sim:N, cuda, cuda:N or cuda:all. The error
// wraps ErrSpec and names the value and the accepted forms.
func Parse(s string) (Spec, error) {
	const expected = "expected sim, sim:N, cuda, cuda:N or cuda:all"
	switch {
	case s == "sim":
		return Spec{Sim: true, Count: 1}, nil
	case strings.HasPrefix(s, "sim:"):
		n, err := strconv.Atoi(strings.TrimPrefix(s, "sim:"))
		if err != nil || n < 1 || n > MaxSimDevices {
			return Spec{}, fmt.Errorf("%w %q: sim:N wants N simulated devices, 1 to %d (%s)", ErrSpec, s, MaxSimDevices, expected)
		}
		return Spec{Sim: true, Count: n}, nil
	case s == "cuda":
		return Spec{Count: 1}, nil
	case s == "cuda:all":
		return Spec{All: true}, nil
	case strings.HasPrefix(s, "cuda:"):
		n, err := strconv.Atoi(strings.TrimPrefix(s, "cuda:"))
		if err != nil || n < 0 {
			return Spec{}, fmt.Errorf("%w %q: cuda:N wants N a device index (0, 1, …) or all (%s)", ErrSpec, s, expected)
		}
		return Spec{Index: n, Count: 1}, nil
	}
	return Spec{}, fmt.Errorf("%w %q: %s", ErrSpec, s, expected)
}

// ParseOne parses a spec that names one device: sim, cuda (device 0) or
// cuda:N. The forms for several devices (sim:N, even sim:1, and cuda:all)
// are refused with an error wrapping ErrSpec that says so.
func ParseOne(s string) (Spec, error) {
	spec, err := Parse(s)
	if err != nil {
		return spec, fmt.Errorf("%w %q: expected sim, cuda or cuda:N", ErrSpec, s)
	}
	if spec.Multi() || strings.HasPrefix(s, "sim:") {
		return Spec{}, fmt.Errorf("%w %q: names several devices, where one is used: sim, cuda or cuda:N", ErrSpec, s)
	}
	return spec, nil
}

// Opener opens the devices a Spec names. The zero value opens simulated
// devices of DefaultSimCapacity and CUDA devices through cudart.
type Opener struct {
	// Sim configures each simulated device; its Index is set per device,
	// and its Addresses moved per device (PlanFor). A zero Capacity means
	// DefaultSimCapacity.
	Sim cudart.SimConfig
	// DeviceCount, when set, replaces cudart.DeviceCount (for cuda:all).
	DeviceCount func() (int, error)
	// OpenCUDA, when set, replaces cudart.Open.
	OpenCUDA func(index int) (cudart.Device, error)
}

// Open opens every device spec names, in ascending index: for sim:N, N
// simulated devices with indexes 0..N-1; for cuda:all, every device
// DeviceCount reports; otherwise the one device. If one cannot be opened,
// those already open are closed and the error, which wraps the device's,
// names the device. A missing CUDA driver gives an error wrapping
// cudart.ErrNoDriver.
func (o Opener) Open(spec Spec) ([]cudart.Device, error) {
	openCUDA := o.OpenCUDA
	if openCUDA == nil {
		openCUDA = func(i int) (cudart.Device, error) { return cudart.Open(i) }
	}
	var open func(i int) (cudart.Device, error)
	n := max(spec.Count, 1)
	switch {
	case spec.Sim:
		open = func(i int) (cudart.Device, error) {
			cfg := o.Sim
			if cfg.Capacity == 0 {
				cfg.Capacity = DefaultSimCapacity
			}
			cfg.Index, cfg.Addresses = i, PlanFor(o.Sim.Addresses, i)
			return cudart.NewSim(cfg)
		}
	case spec.All:
		count := o.DeviceCount
		if count == nil {
			count = cudart.DeviceCount
		}
		c, err := count()
		if err != nil {
			return nil, fmt.Errorf("cuda:all: %w", err)
		}
		if c == 0 {
			return nil, errors.New("cuda:all: the CUDA driver reports no device (is CUDA_VISIBLE_DEVICES empty?)")
		}
		n, open = c, openCUDA
	default:
		dev, err := openCUDA(spec.Index)
		if err != nil {
			return nil, err
		}
		return []cudart.Device{dev}, nil
	}
	devs := make([]cudart.Device, 0, n)
	for i := range n {
		dev, err := open(i)
		if err != nil {
			CloseAll(devs)
			return nil, fmt.Errorf("%s: opening device %d of %d: %w", spec, i, n, err)
		}
		devs = append(devs, dev)
	}
	return devs, nil
}

// PlanFor returns planned Sim addresses moved for simulated device index
// i by i × SimDeviceSpan (plan itself for device 0). Moving every address
// by the same amount keeps their order, and best fit breaks ties by
// address, so each device places blocks as the first does.
func PlanFor(plan []cudart.SimAddress, i int) []cudart.SimAddress {
	if i == 0 || len(plan) == 0 {
		return plan
	}
	out := make([]cudart.SimAddress, len(plan))
	for j, a := range plan {
		out[j] = cudart.SimAddress{Addr: a.Addr + cudart.Ptr(uint64(i)*SimDeviceSpan), Size: a.Size}
	}
	return out
}

// CloseAll closes devices, ignoring their errors: it undoes a partial
// open, or ends a program's use of devices it no longer needs.
func CloseAll(devs []cudart.Device) {
	for _, d := range devs {
		_ = d.Close()
	}
}

// ParseSize parses a byte size: "1234", "512MiB", "141GiB", "1.5TiB"
// (KB, MB, GB and TB mean the same binary units, as nvidia-smi's do). The
// result is from 1 byte to 8 EiB; anything else, NaN and Inf included, is
// an error stating that range.
func ParseSize(s string) (uint64, error) {
	units := []struct {
		suffix string
		mult   float64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
		{"TB", 1 << 40}, {"GB", 1 << 30}, {"MB", 1 << 20}, {"KB", 1 << 10}, {"B", 1}}
	t := strings.TrimSpace(s)
	mult := 1.0
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	// !(b >= 1) also rejects NaN, and a size that truncates to 0 bytes
	// (1e-300GiB); b < 1<<63 rejects +Inf.
	if b := v * mult; err != nil || !(b >= 1 && b < 1<<63) {
		return 0, fmt.Errorf("bad size %q: expected a number of bytes from 1 to 8 EiB, optionally with KiB, MiB, GiB or TiB (not NaN or Inf)", s)
	}
	return uint64(v * mult), nil
}
