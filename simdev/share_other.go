//go:build !linux

package simdev

import (
	"fmt"

	"github.com/allocd/allocd/cudart"
)

// shareSupported reports whether Config.Shared works here: it needs
// memfd_create, which only Linux has, so New refuses Shared and the
// functions below are never reached.
const shareSupported = false

func errNoMemfd(call string) error {
	return fmt.Errorf("%s: shareable memory needs memfds, which only Linux has: %w", call, cudart.ErrNotSupported)
}

func memfdMap(uint64) (int, []byte, error)  { return -1, nil, errNoMemfd("memfd_create") }
func mapShared(int, uint64) ([]byte, error) { return nil, errNoMemfd("mmap") }
func dupCloexec(int) (int, error)           { return -1, errNoMemfd("dup") }
func fdSize(int) (uint64, error)            { return 0, errNoMemfd("fstat") }
func unmapClose(int, []byte) error          { return errNoMemfd("munmap") }
