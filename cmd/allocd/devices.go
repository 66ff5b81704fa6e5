package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

func newDevicesCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "devices",
		Short: "List CUDA devices: index, name, total and free memory, UUID",
		Long: `Devices lists the CUDA devices this process can see. Without a CUDA driver it
prints why (the libraries it tried) and exits 1.`,
		Args: withUsage(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			devs, err := cudart.ListDevices()
			if err != nil {
				return err
			}
			return printDevices(cmd.OutOrStdout(), devs, asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return cmd
}

func printDevices(w io.Writer, devs []cudart.DeviceStatus, asJSON bool) error {
	if asJSON {
		type row struct {
			Index       int    `json:"index"`
			Name        string `json:"name"`
			UUID        string `json:"uuid"`
			TotalMemory uint64 `json:"total_memory_bytes"`
			FreeMemory  uint64 `json:"free_memory_bytes"`
		}
		rows := make([]row, len(devs))
		for i, d := range devs {
			rows[i] = row{d.Index, d.Name, d.UUID, d.TotalMemory, d.FreeMemory}
		}
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(rows)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "index\tname\ttotal\tfree\tuuid")
	for _, d := range devs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\n", d.Index, d.Name, allocator.FormatSize(d.TotalMemory), allocator.FormatSize(d.FreeMemory), d.UUID)
	}
	return tw.Flush()
}
