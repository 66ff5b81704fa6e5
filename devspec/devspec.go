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
//
// It is also the one reader of the environment variables that choose the
// device, ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY (ParseEnv, FromEnv), and
// of sizes (ParseSize): allocator.Open, the allocd command and liballocd
// all read them here, so the same value means the same in every tool.
package devspec

import (
	"errors"
	"fmt"
	"math"
	"math/big"
	"os"
	"regexp"
	"strconv"
	"strings"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// DefaultSimCapacity is a simulated device's memory when the simdev.Config
// given to Opener leaves it 0 and ALLOCD_SIM_CAPACITY is unset, in every
// allocd tool: an H200's 141 GiB.
const DefaultSimCapacity = 141 << 30

// MaxSimDevices bounds sim:N. Each simulated device gets its own range of
// addresses (simdev.Range), SimDeviceSpan apart.
const MaxSimDevices = 64

// SimDeviceSpan is how far planned Sim addresses move for each simulated
// device past the first (PlanFor), so that no two simulated devices hand
// out the same address, as no two GPUs of one process do.
const SimDeviceSpan = simdev.DeviceSpan

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
	Sim simdev.Config
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
		open = func(i int) (cudart.Device, error) { return o.OpenIndex(spec, i) }
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
func PlanFor(plan []simdev.Address, i int) []simdev.Address {
	if i == 0 || len(plan) == 0 {
		return plan
	}
	out := make([]simdev.Address, len(plan))
	for j, a := range plan {
		out[j] = simdev.Address{Addr: a.Addr + cudart.Ptr(uint64(i)*SimDeviceSpan), Size: a.Size}
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

// MaxSize is the largest size ParseSize accepts: 8 EiB less one byte,
// the largest byte count an int64 holds.
const MaxSize = math.MaxInt64

// maxSizeLen bounds the length of ParseSize's number.
const maxSizeLen = 64

// FormatSize renders a byte count as PyTorch's memory_summary does:
// "512 B", "2.00 MiB", "1.50 GiB". The allocator's messages and the
// broker's refusals both write sizes with it.
func FormatSize(n uint64) string {
	switch {
	case n < 1<<10:
		return fmt.Sprintf("%d B", n)
	case n < 1<<20:
		return fmt.Sprintf("%.2f KiB", float64(n)/(1<<10))
	case n < 1<<30:
		return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20))
	case n < 1<<40:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	}
	return fmt.Sprintf("%.2f TiB", float64(n)/(1<<40))
}

// sizeSyntax is the number ParseSize reads: a decimal, optionally signed,
// with an optional exponent of at most three digits.
var sizeSyntax = regexp.MustCompile(`^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,3})?$`)

// sizeRange is the accepted range as ParseSize's errors state it.
const sizeRange = "a number of bytes from 1 to 9223372036854775807 (8 EiB less one byte), optionally with KiB, MiB, GiB or TiB (not NaN or Inf)"

// ParseSize parses a byte size: "1234", "512MiB", "141GiB", "1.5TiB",
// "512 MiB" (KB, MB, GB and TB mean the same binary units, as
// nvidia-smi's do). A fraction of a byte is dropped. The result is from 1
// to MaxSize; anything else, NaN, Inf and 0 included, is an error stating
// that range. The number is read exactly (to 128 bits), so the stated
// range and the check agree to the byte.
func ParseSize(s string) (uint64, error) {
	units := []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10},
		{"TB", 1 << 40}, {"GB", 1 << 30}, {"MB", 1 << 20}, {"KB", 1 << 10}, {"B", 1}}
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mult
			break
		}
	}
	bad := fmt.Errorf("bad size %q: expected %s", s, sizeRange)
	// Only plain decimals are read, with an exponent of at most three
	// digits: big.ParseFloat's time grows with the exponent (a hostile
	// "1e-99999999" takes seconds), and hex, underscores, NaN and Inf
	// are no sizes.
	if len(t) > maxSizeLen || !sizeSyntax.MatchString(t) {
		return 0, bad
	}
	// big.Float reads the decimal exactly enough for every integer up to
	// 2^128.
	v, _, err := big.ParseFloat(t, 10, 128, big.ToZero)
	if err != nil || v.IsInf() || v.Sign() <= 0 {
		return 0, bad
	}
	v.Mul(v, new(big.Float).SetInt64(mult))
	if v.Cmp(big.NewFloat(1)) < 0 || v.Cmp(new(big.Float).SetInt64(MaxSize)) > 0 {
		return 0, bad
	}
	n, _ := v.Uint64() // truncates a fraction of a byte
	return n, nil
}

// The environment variables every allocd tool reads the same way: the
// allocator's Open and OpenDevices, the allocd command and liballocd.
const (
	// EnvConf holds the allocator configuration, in
	// PYTORCH_CUDA_ALLOC_CONF's grammar (allocator.ParseConfig); unset or
	// empty means PyTorch's defaults.
	EnvConf = "ALLOCD_CONF"
	// EnvDevice chooses the kind of device (ParseEnv): unset, empty or
	// "cuda" for the GPU, "sim" for one simulated device, "sim:N" for N
	// of them.
	EnvDevice = "ALLOCD_DEVICE"
	// EnvSimCapacity is each simulated device's memory, in ParseSize's
	// syntax; DefaultSimCapacity when unset or empty.
	EnvSimCapacity = "ALLOCD_SIM_CAPACITY"
)

// ErrEnv is wrapped by every error of ParseEnv and FromEnv: an
// environment variable has a value allocd does not accept. The message
// names the variable, its value and what is accepted.
var ErrEnv = errors.New("invalid environment variable")

// Env is what the environment says about the devices to use.
type Env struct {
	// Spec is ALLOCD_DEVICE parsed: cuda (the zero Spec's Count 1, also
	// when the variable is unset), sim or sim:N.
	Spec Spec
	// Set reports whether ALLOCD_DEVICE was set to a non-empty value.
	Set bool
	// SimCapacity is ALLOCD_SIM_CAPACITY parsed, or DefaultSimCapacity.
	SimCapacity uint64
}

// ParseEnv parses the values of ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY
// (FromEnv reads them). ALLOCD_DEVICE takes cuda, sim or sim:N (N from 1
// to MaxSimDevices), surrounding spaces ignored; unset or empty means
// cuda. It names a kind of device, not an index: the program (PyTorch,
// Open's argument, serve's --device) picks the index, so cuda:N and
// cuda:all are refused. ALLOCD_SIM_CAPACITY is read by ParseSize whatever
// the device, so that a bad value is reported at once, not when a
// simulated device is first asked for. Errors wrap ErrEnv and name the
// variable.
func ParseEnv(device, simCapacity string) (Env, error) {
	env := Env{Spec: Spec{Count: 1}, SimCapacity: DefaultSimCapacity}
	if d := strings.TrimSpace(device); d != "" {
		spec, err := Parse(d)
		if err == nil && !spec.Sim && (spec.All || d != "cuda") {
			err = errors.New("ALLOCD_DEVICE names the kind of device; the program picks the index")
		}
		if err != nil {
			return Env{}, fmt.Errorf("%s=%q: %w: accepted are cuda (the default), sim and sim:N with N from 1 to %d (%v)",
				EnvDevice, device, ErrEnv, MaxSimDevices, err)
		}
		env.Spec, env.Set = spec, true
	}
	if c := strings.TrimSpace(simCapacity); c != "" {
		n, err := ParseSize(c)
		if err != nil {
			return Env{}, fmt.Errorf("%s=%q: %w: %v", EnvSimCapacity, simCapacity, ErrEnv, err)
		}
		env.SimCapacity = n
	}
	return env, nil
}

// FromEnv is ParseEnv of the process's ALLOCD_DEVICE and
// ALLOCD_SIM_CAPACITY.
func FromEnv() (Env, error) {
	return ParseEnv(os.Getenv(EnvDevice), os.Getenv(EnvSimCapacity))
}

// OpenIndex opens the one device of spec with index i: for sim and
// sim:N, simulated device i (from 0 to Count-1; another index is an error
// wrapping cudart.ErrInvalidValue), configured as Open configures it; for
// cuda, CUDA device i. Work that opens devices one at a time, as a
// program asks for them, uses it.
func (o Opener) OpenIndex(spec Spec, i int) (cudart.Device, error) {
	if !spec.Sim {
		if o.OpenCUDA != nil {
			return o.OpenCUDA(i)
		}
		return cudart.Open(i)
	}
	n := max(spec.Count, 1)
	if i < 0 || i >= n {
		return nil, fmt.Errorf("%s: simulated device %d: %w: the devices are 0 to %d", spec, i, cudart.ErrInvalidValue, n-1)
	}
	cfg := o.Sim
	if cfg.Capacity == 0 {
		cfg.Capacity = DefaultSimCapacity
	}
	cfg.Index, cfg.Addresses = i, PlanFor(o.Sim.Addresses, i)
	return simdev.New(cfg)
}
