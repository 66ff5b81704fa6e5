package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
)

// The CUDA calls serve's devices open with; tests replace them.
var (
	cudaDeviceCount = cudart.DeviceCount
	openCUDAIndex   = func(i int) (cudart.Device, error) { return cudart.Open(i) }
)

// defaultSimCapacityFlag is --sim-capacity's default: devspec's, the
// default of every allocd tool.
var defaultSimCapacityFlag = strconv.FormatUint(devspec.DefaultSimCapacity>>30, 10) + "GiB"

// parseSize parses a size flag (devspec.ParseSize), naming the flag.
func parseSize(flag, s string) (uint64, error) {
	n, err := devspec.ParseSize(s)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", flag, err)
	}
	return n, nil
}

// applyDeviceEnv fills the values of cmd's --device and --sim-capacity
// that the command line leaves out from ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY,
// read by devspec.ParseEnv as allocator.Open and liballocd read them (a
// bad value is an error naming the variable). A variable a flag overrides
// is not read. With one set, the command works on one device, and
// ALLOCD_DEVICE=sim:N means sim. It returns where the device came from:
// "--device", "ALLOCD_DEVICE", or "" for the flag's default.
func applyDeviceEnv(cmd *cobra.Command, device, simCapacity *string, one bool) (string, error) {
	fl := cmd.Flags()
	devEnv, capEnv := os.Getenv(devspec.EnvDevice), os.Getenv(devspec.EnvSimCapacity)
	if fl.Changed("device") {
		devEnv = ""
	}
	if fl.Changed("sim-capacity") {
		capEnv = ""
	}
	env, err := devspec.ParseEnv(devEnv, capEnv)
	if err != nil {
		return "", err
	}
	if strings.TrimSpace(capEnv) != "" {
		*simCapacity = strconv.FormatUint(env.SimCapacity, 10)
	}
	switch {
	case fl.Changed("device"):
		return "--device", nil
	case env.Set:
		*device = env.Spec.String()
		if env.Spec.Sim && one {
			*device = "sim"
		} else if !env.Spec.Sim {
			*device = "cuda"
		}
		return devspec.EnvDevice, nil
	}
	return "", nil
}

// resolveConf returns the configuration string to use and where it came
// from: the flag when set, else ALLOCD_CONF.
func resolveConf(flagValue string, flagSet bool) (conf, from string) {
	if flagSet {
		return flagValue, "--conf"
	}
	return os.Getenv(allocator.EnvConf), allocator.EnvConf
}

// parseConf parses a configuration string; the error names where it came
// from (--conf or ALLOCD_CONF) and the value.
func parseConf(s, from string) (allocator.Config, error) {
	cfg, err := allocator.ParseConfig(s)
	if err != nil {
		if from == allocator.EnvConf {
			return cfg, fmt.Errorf("%s=%q: %w", from, s, err)
		}
		return cfg, fmt.Errorf("%s %q: %w", from, s, err)
	}
	return cfg, nil
}

// usageError is an error for wrong arguments: the message, then the
// command's usage.
func usageError(cmd *cobra.Command, format string, args ...any) error {
	return fmt.Errorf("%s\n\n%s", fmt.Sprintf(format, args...), strings.TrimRight(cmd.UsageString(), "\n"))
}

// withUsage makes a positional-argument check's error carry the usage.
func withUsage(check cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			return usageError(cmd, "%v", err)
		}
		return nil
	}
}

// checkOutPath checks, before any work, that the output file path of
// flag can be written: it is not a directory, and its directory exists
// and takes a new file (or the file exists and opens for writing).
// Nothing is created or truncated; an empty path passes.
func checkOutPath(flag, path string) error {
	if path == "" {
		return nil
	}
	if st, err := os.Stat(path); err == nil {
		if st.IsDir() {
			return fmt.Errorf("%s %s: is a directory", flag, path)
		}
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return fmt.Errorf("%s %s: cannot be written: %w", flag, path, err)
		}
		return f.Close()
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("%s %s: %w", flag, path, err)
	}
	dir := filepath.Dir(path)
	if st, err := os.Stat(dir); err != nil {
		return fmt.Errorf("%s %s: %w", flag, path, err)
	} else if !st.IsDir() {
		return fmt.Errorf("%s %s: %s is not a directory", flag, path, dir)
	}
	f, err := os.CreateTemp(dir, ".allocd-check-*")
	if err != nil {
		return fmt.Errorf("%s %s: cannot create a file in %s (%v)", flag, path, dir, errors.Unwrap(err))
	}
	name := f.Name()
	f.Close()
	return os.Remove(name)
}
