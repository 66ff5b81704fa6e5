package main

import (
	"errors"
	"fmt"

	"github.com/allocd/allocd/allocator"
)

// This file holds the two calls the allocator does not offer yet: history
// recording at run time and a memory fraction set after creation. Each
// returns an error wrapping errNotAvailable until it is wired to the
// allocator's API.

// errNotAvailable is what the pending calls wrap.
var errNotAvailable = errors.New("not available in this build")

// historyOptions is allocd_record_history's request.
type historyOptions struct {
	Enabled    bool
	MaxEntries int
	StackDepth int
}

// recordHistory switches a's history recording on or off (a is nil when no
// device exists yet).
func recordHistory(a *allocator.Allocator, h historyOptions) error {
	_, _ = a, h
	return fmt.Errorf("allocd: record_history: run-time history recording is %w", errNotAvailable)
}

// setMemoryFraction caps a's reserved memory at f × the device's total.
func setMemoryFraction(a *allocator.Allocator, f float64) error {
	_, _ = a, f
	return fmt.Errorf("allocd: set_memory_fraction(%g): setting the fraction at run time is %w "+
		"(ALLOCD_CONF=per_process_memory_fraction:F sets it at start)", f, errNotAvailable)
}
