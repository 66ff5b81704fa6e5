package simdev

import (
	"errors"
	"fmt"
	"math"

	"github.com/allocd/allocd/cudart"
	"golang.org/x/sys/unix"
)

// shareSupported reports whether Config.Shared works here: it needs
// memfd_create, which Linux has.
const shareSupported = true

// memfdMap makes a memfd of size bytes and maps it shared: the memory of a
// Shared Sim's handle. The descriptor is close-on-exec, so that it reaches
// another process only through Export.
func memfdMap(size uint64) (int, []byte, error) {
	fd, err := unix.MemfdCreate("allocd-sim", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, nil, osError("memfd_create", err)
	}
	if size > math.MaxInt64 {
		_ = unix.Close(fd)
		return -1, nil, fmt.Errorf("ftruncate to %d bytes: past the largest file size: %w", size, cudart.ErrInvalidValue)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd)
		return -1, nil, osError("ftruncate", err)
	}
	mem, err := mapShared(fd, size)
	if err != nil {
		_ = unix.Close(fd)
		return -1, nil, err
	}
	return fd, mem, nil
}

// mapShared maps size bytes of fd from offset 0, readable, writable and
// MAP_SHARED.
func mapShared(fd int, size uint64) ([]byte, error) {
	if size > math.MaxInt {
		return nil, fmt.Errorf("mmap of %d bytes: larger than this process can address: %w", size, cudart.ErrInvalidValue)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, osError("mmap", err)
	}
	return mem, nil
}

// dupCloexec duplicates fd with the close-on-exec flag set
// (F_DUPFD_CLOEXEC).
func dupCloexec(fd int) (int, error) {
	nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, osError("dup", err)
	}
	return nfd, nil
}

// fdSize returns the size of the regular file (a memfd) open as fd.
func fdSize(fd int) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, osError("fstat", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, fmt.Errorf("not a memory file (mode %#o): %w", st.Mode, cudart.ErrInvalidValue)
	}
	return uint64(st.Size), nil
}

// unmapClose unmaps mem (when not nil) and closes fd. If the unmap fails
// nothing is closed and the error is returned; close's own error is not,
// since Linux frees the descriptor whatever close reports.
func unmapClose(fd int, mem []byte) error {
	if mem != nil {
		if err := unix.Munmap(mem); err != nil {
			return osError("munmap", err)
		}
	}
	_ = unix.Close(fd)
	return nil
}

// osError wraps a system call's error with the call's name and the sentinel
// that fits it: cudart.ErrOutOfMemory when the system ran out of memory or
// descriptors, cudart.ErrInvalidValue otherwise (a descriptor that is not
// open, not a file, not mappable).
func osError(call string, err error) error {
	sentinel := cudart.ErrInvalidValue
	for _, e := range []error{unix.ENOMEM, unix.ENOSPC, unix.EMFILE, unix.ENFILE} {
		if errors.Is(err, e) {
			sentinel = cudart.ErrOutOfMemory
		}
	}
	return fmt.Errorf("%s: %w: %w", call, err, sentinel)
}
