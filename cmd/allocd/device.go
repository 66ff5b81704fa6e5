package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// defaultSimCapacity is the simulated device's memory: an H200's 141 GiB.
const defaultSimCapacity = 141 << 30

// deviceSpec is a parsed --device value: "sim", "cuda" or "cuda:N".
type deviceSpec struct {
	sim   bool
	index int
}

func parseDeviceSpec(s string) (deviceSpec, error) {
	switch {
	case s == "sim":
		return deviceSpec{sim: true}, nil
	case s == "cuda":
		return deviceSpec{}, nil
	case strings.HasPrefix(s, "cuda:"):
		n, err := strconv.Atoi(strings.TrimPrefix(s, "cuda:"))
		if err != nil || n < 0 {
			return deviceSpec{}, fmt.Errorf("--device %q: expected sim, cuda or cuda:N with N a device index", s)
		}
		return deviceSpec{index: n}, nil
	}
	return deviceSpec{}, fmt.Errorf("--device %q: expected sim, cuda or cuda:N", s)
}

// openDevice opens the device a spec names. A sim device is created with
// the given capacity and options.
func openDevice(spec deviceSpec, simCfg cudart.SimConfig) (cudart.Device, error) {
	if spec.sim {
		if simCfg.Capacity == 0 {
			simCfg.Capacity = defaultSimCapacity
		}
		return cudart.NewSim(simCfg)
	}
	return openCUDA(spec.index)
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
