package main

import (
	"fmt"
	"os"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
)

// The CUDA calls serve's devices open with; tests replace them.
var (
	cudaDeviceCount = cudart.DeviceCount
	openCUDAIndex   = func(i int) (cudart.Device, error) { return cudart.Open(i) }
)

// parseSize parses a size flag (devspec.ParseSize), naming the flag.
func parseSize(flag, s string) (uint64, error) {
	n, err := devspec.ParseSize(s)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", flag, err)
	}
	return n, nil
}

// resolveConf returns the configuration string to use: the flag when set,
// else ALLOCD_CONF.
func resolveConf(flagValue string, flagSet bool) string {
	if flagSet {
		return flagValue
	}
	return os.Getenv(allocator.EnvConf)
}

// parseConf parses a configuration string, naming where it came from.
func parseConf(s string) (allocator.Config, error) {
	cfg, err := allocator.ParseConfig(s)
	if err != nil {
		return cfg, fmt.Errorf("configuration %q: %w", s, err)
	}
	return cfg, nil
}
