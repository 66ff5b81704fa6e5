package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newServeCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "serve",
		Short: "not built yet",
		RunE:  func(*cobra.Command, []string) error { return errors.New("serve: not built yet") },
	}
}
