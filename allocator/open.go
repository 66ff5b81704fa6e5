package allocator

import (
	"errors"
	"fmt"
	"os"

	"go.uber.org/zap"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/simdev"
)

// The environment variables Open and OpenDevices read, as every allocd
// tool reads them (package devspec owns their parsing).
const (
	// EnvConf holds the configuration, in PYTORCH_CUDA_ALLOC_CONF's
	// grammar (ParseConfig); unset or empty means PyTorch's defaults.
	EnvConf = devspec.EnvConf
	// EnvDevice chooses the device: unset or "cuda" for the GPU, "sim" for
	// one simulated device, "sim:N" for N of them (OpenDevices).
	EnvDevice = devspec.EnvDevice
	// EnvSimCapacity is each simulated device's memory (devspec.ParseSize:
	// bytes, or a number with a KiB, MiB, GiB or TiB suffix);
	// DefaultSimCapacity when unset.
	EnvSimCapacity = devspec.EnvSimCapacity
)

// DefaultSimCapacity is a simulated device's memory when
// ALLOCD_SIM_CAPACITY is unset: an H200's 141 GiB, the same in every
// allocd tool (devspec.DefaultSimCapacity).
const DefaultSimCapacity = devspec.DefaultSimCapacity

// ErrEnv: an environment variable read by Open or OpenDevices has a value
// it does not accept. The message names the variable and what is accepted.
// It is devspec.ErrEnv.
var ErrEnv = devspec.ErrEnv

// WithConfig makes Open and OpenDevices use cfg instead of ALLOCD_CONF.
// New and NewDevices, which take their configuration as an argument,
// ignore it.
func WithConfig(cfg Config) Option {
	return func(o *options) { o.cfg = &cfg }
}

// envDevice reads ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY (devspec.FromEnv).
func envDevice() (devspec.Env, error) {
	env, err := devspec.FromEnv()
	if err != nil {
		return env, fmt.Errorf("allocator: %w", err)
	}
	return env, nil
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

// openIndex opens device index of env: CUDA device index, or simulated
// device index of sim:N.
func openIndex(env devspec.Env, index int, shared bool) (cudart.Device, error) {
	if !env.Spec.Sim {
		dev, err := cudart.Open(index)
		if err != nil {
			return nil, fmt.Errorf("allocator: opening CUDA device %d (set %s=sim for a simulated device): %w", index, EnvDevice, err)
		}
		return dev, nil
	}
	if index < 0 || index >= env.Spec.Count {
		return nil, fmt.Errorf("allocator: simulated device %d: %w (%s gives devices 0 to %d)", index, ErrNoSuchDevice, EnvDevice, env.Spec.Count-1)
	}
	o := devspec.Opener{Sim: simdev.Config{Capacity: env.SimCapacity, Shared: shared}}
	dev, err := o.OpenIndex(env.Spec, index)
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
// memory (simdev.ErrNotBacked for memcpy). Any other ALLOCD_DEVICE value
// is an error wrapping ErrEnv.
//
// The allocator owns the device it opened: Close closes it too.
func Open(device int, opts ...Option) (*Allocator, error) {
	env, err := envDevice()
	if err != nil {
		return nil, err
	}
	cfg, err := openConfig(opts)
	if err != nil {
		return nil, err
	}
	opts, shared, bc, err := openBroker(opts)
	if err != nil {
		return nil, err
	}
	if bc != nil {
		opts = append(opts, func(o *options) { o.ownsBroker = true })
	}
	dev, err := openIndex(env, device, shared)
	if err != nil {
		return nil, errors.Join(err, closeClient(bc))
	}
	a, err := New(dev, cfg, opts...)
	if err != nil {
		return nil, errors.Join(err, dev.Close(), closeClient(bc))
	}
	a.ownsDevice = true
	return a, nil
}

// openBroker connects to the broker EnvBroker names, unless opts
// already give one, and adds it to opts. shared says a broker is in use
// (a simulated device must then share its memory); c is the connection
// openBroker made, nil when it made none, which the caller owns.
func openBroker(opts []Option) (_ []Option, shared bool, c *broker.Client, err error) {
	o := options{log: zap.NewNop()}
	for _, opt := range opts {
		opt(&o)
	}
	if o.broker != nil {
		return opts, true, nil, nil
	}
	c, fallback, err := BrokerFromEnv(o.log)
	if err != nil || c == nil {
		return opts, false, nil, err
	}
	return append(opts[:len(opts):len(opts)], WithBroker(c, fallback)), true, c, nil
}

// closeClient closes c if there is one.
func closeClient(c *broker.Client) error {
	if c == nil {
		return nil
	}
	return c.Close()
}

// OpenDevices is Open for every device: every CUDA device the driver
// reports (cudart.DeviceCount), or the N simulated devices of
// ALLOCD_DEVICE=sim:N (one for sim). The Devices owns them: its Close
// closes every device as well. With ALLOCD_BROKER, one connection to the
// broker serves every device (each matched to the broker's by UUID), and
// Close closes it after the allocators.
func OpenDevices(opts ...Option) (*Devices, error) {
	env, err := envDevice()
	if err != nil {
		return nil, err
	}
	cfg, err := openConfig(opts)
	if err != nil {
		return nil, err
	}
	// One connection to the broker serves every device; the Devices owns
	// it and closes it after the allocators.
	opts, shared, bc, err := openBroker(opts)
	if err != nil {
		return nil, err
	}
	n := env.Spec.Count
	if !env.Spec.Sim {
		if n, err = cudart.DeviceCount(); err != nil {
			return nil, errors.Join(fmt.Errorf("allocator: counting CUDA devices (set %s=sim for a simulated device): %w", EnvDevice, err), closeClient(bc))
		}
		if n == 0 {
			return nil, errors.Join(fmt.Errorf("allocator: the CUDA driver reports no device: %w", ErrNoSuchDevice), closeClient(bc))
		}
	}
	devs := make([]cudart.Device, 0, n)
	closeAll := func() error {
		errs := []error{closeClient(bc)}
		for _, d := range devs {
			errs = append(errs, d.Close())
		}
		return errors.Join(errs...)
	}
	for i := range n {
		dev, err := openIndex(env, i, shared)
		if err != nil {
			return nil, errors.Join(err, closeAll())
		}
		devs = append(devs, dev)
	}
	d, err := NewDevices(devs, cfg, opts...)
	if err != nil {
		return nil, errors.Join(err, closeAll())
	}
	for _, a := range d.All() {
		a.ownsDevice = true
	}
	d.broker = bc
	return d, nil
}
