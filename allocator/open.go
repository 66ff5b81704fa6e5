package allocator

import (
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"

	"github.com/allocd/allocd/cudart"
)

// The environment variables Open and OpenDevices read.
const (
	// EnvConf holds the configuration, in PYTORCH_CUDA_ALLOC_CONF's
	// grammar (ParseConfig); unset or empty means PyTorch's defaults.
	EnvConf = "ALLOCD_CONF"
	// EnvDevice chooses the device: unset or "cuda" for the GPU, "sim" for
	// one simulated device, "sim:N" for N of them (OpenDevices).
	EnvDevice = "ALLOCD_DEVICE"
	// EnvSimCapacity is each simulated device's memory: bytes, or a
	// number with a KiB, MiB, GiB or TiB suffix; DefaultSimCapacity when
	// unset.
	EnvSimCapacity = "ALLOCD_SIM_CAPACITY"
)

// DefaultSimCapacity is a simulated device's memory when
// ALLOCD_SIM_CAPACITY is unset: 80 GiB, an A100's or H100's.
const DefaultSimCapacity = 80 << 30

// maxSimDevices bounds ALLOCD_DEVICE=sim:N.
const maxSimDevices = 64

// ErrEnv: an environment variable read by Open or OpenDevices has a value
// it does not accept. The message names the variable and what is accepted.
var ErrEnv = errors.New("invalid environment variable")

// WithConfig makes Open and OpenDevices use cfg instead of ALLOCD_CONF.
// New and NewDevices, which take their configuration as an argument,
// ignore it.
func WithConfig(cfg Config) Option {
	return func(o *options) { o.cfg = &cfg }
}

// deviceChoice is ALLOCD_DEVICE parsed: CUDA, or sims simulated devices.
type deviceChoice struct {
	sims     int // 0: CUDA
	capacity uint64
}

func envDevice() (deviceChoice, error) {
	v := strings.TrimSpace(os.Getenv(EnvDevice))
	switch {
	case v == "" || v == "cuda":
		return deviceChoice{}, nil
	case v == "sim" || strings.HasPrefix(v, "sim:"):
		n := 1
		if rest, ok := strings.CutPrefix(v, "sim:"); ok {
			var err error
			if n, err = strconv.Atoi(rest); err != nil || n < 1 || n > maxSimDevices {
				return deviceChoice{}, fmt.Errorf("allocator: %s=%q: %w: the count after sim: must be 1 to %d", EnvDevice, v, ErrEnv, maxSimDevices)
			}
		}
		capacity, err := envSimCapacity()
		if err != nil {
			return deviceChoice{}, err
		}
		return deviceChoice{sims: n, capacity: capacity}, nil
	}
	return deviceChoice{}, fmt.Errorf("allocator: %s=%q: %w: accepted are cuda (the default), sim and sim:N", EnvDevice, v, ErrEnv)
}

func envSimCapacity() (uint64, error) {
	v := strings.TrimSpace(os.Getenv(EnvSimCapacity))
	if v == "" {
		return DefaultSimCapacity, nil
	}
	n, err := parseBytes(v)
	if err != nil {
		return 0, fmt.Errorf("allocator: %s=%q: %w: %v", EnvSimCapacity, v, ErrEnv, err)
	}
	return n, nil
}

// parseBytes reads "1073741824", "80GiB", "512 MiB" or "1.5TiB".
func parseBytes(v string) (uint64, error) {
	mult := uint64(1)
	num := v
	for _, u := range []struct {
		suffix string
		mult   uint64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40}, {"B", 1}} {
		if s, ok := strings.CutSuffix(v, u.suffix); ok {
			num, mult = strings.TrimSpace(s), u.mult
			break
		}
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f <= 0 {
		return 0, errors.New("want a positive number of bytes, optionally with a KiB, MiB, GiB or TiB suffix")
	}
	b := f * float64(mult)
	if b < 1 || b >= 1<<60 {
		return 0, errors.New("want at least 1 byte and less than 1 EiB")
	}
	return uint64(b), nil
}

// openConfig is WithConfig's configuration, or else ALLOCD_CONF parsed.
func openConfig(opts []Option) (Config, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.cfg != nil {
		return *o.cfg, nil
	}
	cfg, err := ParseConfig(os.Getenv(EnvConf))
	if err != nil {
		return Config{}, fmt.Errorf("allocator: %s: %w", EnvConf, err)
	}
	return cfg, nil
}

func (c deviceChoice) open(index int) (cudart.Device, error) {
	if c.sims == 0 {
		dev, err := cudart.Open(index)
		if err != nil {
			return nil, fmt.Errorf("allocator: opening CUDA device %d (set %s=sim for a simulated device): %w", index, EnvDevice, err)
		}
		return dev, nil
	}
	if index < 0 || index >= c.sims {
		return nil, fmt.Errorf("allocator: simulated device %d: %w (%s gives devices 0 to %d)", index, ErrNoSuchDevice, EnvDevice, c.sims-1)
	}
	dev, err := cudart.NewSim(cudart.SimConfig{Capacity: c.capacity, Index: index})
	if err != nil {
		return nil, fmt.Errorf("allocator: simulated device %d: %w", index, err)
	}
	return dev, nil
}

// Open returns an allocator for device index device, configured the way a
// deployed program is: by ALLOCD_CONF (ParseConfig; a bad value is an
// error naming the variable), unless WithConfig overrides it. The device
// is CUDA device N (cudart.Open); it is a simulated device only when
// ALLOCD_DEVICE is "sim" or "sim:N", never as a fallback, with
// ALLOCD_SIM_CAPACITY bytes (default DefaultSimCapacity) and no backing
// memory (cudart.ErrNotBacked for memcpy). Any other ALLOCD_DEVICE value
// is an error wrapping ErrEnv.
//
// The allocator owns the device it opened: Close closes it too.
func Open(device int, opts ...Option) (*Allocator, error) {
	choice, err := envDevice()
	if err != nil {
		return nil, err
	}
	cfg, err := openConfig(opts)
	if err != nil {
		return nil, err
	}
	dev, err := choice.open(device)
	if err != nil {
		return nil, err
	}
	a, err := New(dev, cfg, opts...)
	if err != nil {
		return nil, errors.Join(err, dev.Close())
	}
	a.ownsDevice = true
	return a, nil
}

// OpenDevices is Open for every device: every CUDA device the driver
// reports (cudart.DeviceCount), or the N simulated devices of
// ALLOCD_DEVICE=sim:N (one for sim). The Devices owns them: its Close
// closes every device as well.
func OpenDevices(opts ...Option) (*Devices, error) {
	choice, err := envDevice()
	if err != nil {
		return nil, err
	}
	cfg, err := openConfig(opts)
	if err != nil {
		return nil, err
	}
	n := choice.sims
	if n == 0 {
		if n, err = cudart.DeviceCount(); err != nil {
			return nil, fmt.Errorf("allocator: counting CUDA devices (set %s=sim for a simulated device): %w", EnvDevice, err)
		}
		if n == 0 {
			return nil, fmt.Errorf("allocator: the CUDA driver reports no device: %w", ErrNoSuchDevice)
		}
	}
	devs := make([]cudart.Device, 0, n)
	closeAll := func() error {
		var errs []error
		for _, d := range devs {
			errs = append(errs, d.Close())
		}
		return errors.Join(errs...)
	}
	for i := range n {
		dev, err := choice.open(i)
		if err != nil {
			return nil, errors.Join(err, closeAll())
		}
		devs = append(devs, dev)
	}
	d, err := NewDevices(devs, cfg, opts...)
	if err != nil {
		return nil, errors.Join(err, closeAll())
	}
	for _, a := range d.allocs {
		a.ownsDevice = true
	}
	return d, nil
}
