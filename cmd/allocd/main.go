// Command allocd serves and exercises allocd's caching GPU allocator.
//
//	allocd serve     metrics and debug endpoints over an allocator
//	allocd replay    replay PyTorch memory traces through the allocator
//	allocd bench     the pair, mixed and replay benchmarks
//	allocd devices   list CUDA devices
//	allocd version   print the version
//
// The allocator's configuration comes from --conf or, when that is not
// given, the ALLOCD_CONF environment variable, in PYTORCH_CUDA_ALLOC_CONF's
// grammar.
package main

import (
	"fmt"
	"os"
	"runtime/debug"

	"github.com/spf13/cobra"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func buildVersion() string {
	if version != "dev" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return version
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "allocd",
		Short:         "A caching GPU memory allocator for Go, and its daemon",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	// Wrong flags print the command's usage after the error.
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error { return usageError(cmd, "%v", err) })
	root.AddCommand(newReplayCmd(), newServeCmd(), newBenchCmd(), newDevicesCmd(), newVersionCmd())
	return root
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print allocd's version",
		Args:  withUsage(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := fmt.Fprintln(cmd.OutOrStdout(), "allocd", buildVersion())
			return err
		},
	}
}

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "allocd:", err)
		os.Exit(1)
	}
}
