package pinned

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/allocd/allocd/internal/confgrammar"
)

// EnvConf is the environment variable ConfigFromEnv reads: the device
// allocator's (allocator.EnvConf), shared as PyTorch shares
// PYTORCH_CUDA_ALLOC_CONF between its device and host allocators.
const EnvConf = "ALLOCD_CONF"

// The host allocator's keys in ALLOCD_CONF.
const (
	// keyDivisions is allocd's own: size classes per power of two.
	keyDivisions = "pinned_roundup_power2_divisions"
	// keyHostRegister and keyBackground are PyTorch's; allocd accepts them
	// with the value it implements (False) and refuses the other.
	keyHostRegister = "pinned_use_cuda_host_register"
	keyBackground   = "pinned_use_background_threads"
)

// configKeys lists the keys ParseConfig takes for the host allocator. Keys
// without the pinned_ prefix are the device allocator's: skipped here,
// checked by allocator.ParseConfig.
var configKeys = []string{keyDivisions, keyHostRegister, keyBackground}

// unsupportedKeys are PyTorch's host-allocator keys that allocd does not
// implement, with the reason given in the error.
var unsupportedKeys = map[string]string{
	"pinned_num_register_threads":    "allocd page-locks with cudaHostAlloc, not malloc+cudaHostRegister, so there are no register threads",
	"pinned_max_register_threads":    "allocd page-locks with cudaHostAlloc, not malloc+cudaHostRegister, so there are no register threads",
	"pinned_reserve_segment_size_mb": "allocd does not carve small blocks from a reserved segment",
}

// ErrConfig is wrapped by every configuration error.
var ErrConfig = errors.New("invalid pinned allocator configuration")

// ConfigError names the key and value that were wrong and what is accepted.
type ConfigError struct {
	Key, Value string
	// Accepted says what the key takes.
	Accepted string
}

// Error formats the error.
func (e *ConfigError) Error() string {
	if e.Key == "" {
		return fmt.Sprintf("pinned config: %s (got %q)", e.Accepted, e.Value)
	}
	return fmt.Sprintf("pinned config: key %q: bad value %q: %s", e.Key, e.Value, e.Accepted)
}

// Unwrap makes errors.Is(err, ErrConfig) hold.
func (e *ConfigError) Unwrap() error { return ErrConfig }

// ParseConfig reads the host allocator's keys from a configuration string
// in ALLOCD_CONF's grammar (PYTORCH_CUDA_ALLOC_CONF's: comma-separated
// key:value pairs, lists in brackets), starting from DefaultConfig:
//
//   - pinned_roundup_power2_divisions:N (allocd's): N size classes per
//     power of two, N a power of two up to 64; 1 is PyTorch's rounding;
//   - pinned_use_cuda_host_register:False and
//     pinned_use_background_threads:False (PyTorch's): what allocd does;
//     True is refused, as are PyTorch's register-thread and reserved-segment
//     keys, each with the reason.
//
// Keys without the pinned_ prefix belong to the device allocator and are
// skipped (allocator.ParseConfig checks them). Unknown pinned_ keys, keys
// given twice and stray tokens are errors wrapping ErrConfig.
func ParseConfig(s string) (Config, error) {
	cfg := DefaultConfig()
	pairs, err := confgrammar.Split(s, configKeys)
	if err != nil {
		var se *confgrammar.Error
		errors.As(err, &se)
		return cfg, &ConfigError{Key: se.Key, Value: se.Value, Accepted: se.Problem}
	}
	for _, kv := range pairs {
		if err := cfg.set(kv.Key, kv.Val); err != nil {
			return DefaultConfig(), err
		}
	}
	return cfg, nil
}

// ConfigFromEnv parses $ALLOCD_CONF with ParseConfig; unset or empty
// gives DefaultConfig.
func ConfigFromEnv() (Config, error) {
	cfg, err := ParseConfig(os.Getenv(EnvConf))
	if err != nil {
		return cfg, fmt.Errorf("pinned: $%s: %w", EnvConf, err)
	}
	return cfg, nil
}

func (c *Config) set(key string, val []string) error {
	if !strings.HasPrefix(key, "pinned_") {
		return nil // the device allocator's
	}
	if why, ok := unsupportedKeys[key]; ok {
		return &ConfigError{Key: key, Value: strings.Join(val, ""), Accepted: "not supported: " + why}
	}
	if !slices.Contains(configKeys, key) {
		return &ConfigError{Key: key, Value: strings.Join(val, ""),
			Accepted: "unknown key; the host allocator takes " + strings.Join(configKeys, ", ")}
	}
	if len(val) != 1 {
		return &ConfigError{Key: key, Value: strings.Join(val, ""), Accepted: "expected a single value, not a list"}
	}
	v := val[0]
	switch key {
	case keyDivisions:
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 64 || n&(n-1) != 0 {
			return &ConfigError{Key: key, Value: v, Accepted: "a power of two from 1 to 64"}
		}
		c.RoundupDivisions = n
	case keyHostRegister, keyBackground:
		switch v {
		case "False", "false":
		case "True", "true":
			why := "allocd page-locks with cudaHostAlloc, not malloc+cudaHostRegister"
			if key == keyBackground {
				why = "allocd queries events on a cache miss, in the caller's goroutine"
			}
			return &ConfigError{Key: key, Value: v, Accepted: "only False is supported: " + why}
		default:
			return &ConfigError{Key: key, Value: v, Accepted: "expected True or False"}
		}
	}
	return nil
}
