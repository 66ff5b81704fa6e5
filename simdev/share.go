package simdev

import (
	"errors"
	"fmt"

	"github.com/allocd/allocd/cudart"
)

// Physical memory shared between processes (cudart.ShareableMemory), as the
// node broker uses it: the broker's Sim makes a handle with CreateShareable
// and hands Export's descriptor to a client over a Unix socket; the
// client's Sim Imports it and maps it as any other handle.
//
// With Config.Shared every handle's memory is a memfd mapped MAP_SHARED
// into this process, so bytes written through one process's mapping are
// read through another's, as on a GPU. The Sim keeps the driver's rules
// where a test should catch their breach: only CreateShareable's (and
// Import's) handles can be exported, and Import takes the memory's exact
// size. The memory lives while any process holds a descriptor or a mapping
// of it, so a client's handle stays valid after the broker releases its own.

var _ cudart.ShareableMemory = (*Sim)(nil)

// errNotShared is the error of the sharing calls on a Sim without
// Config.Shared.
func errNotShared(op string) error {
	return fmt.Errorf("cudart: sim %s: the sim's physical memory is not shareable (set Config.Shared): %w", op, cudart.ErrNotSupported)
}

// CreateShareable implements cudart.ShareableMemory: Create, with a handle
// that Export accepts. The memory counts against Capacity and in
// VMMCounters.Creates, and a CreateShareable counts as a malloc call for
// Faults.FailMalloc, as a Create does. Without Config.Shared it fails with
// an error wrapping cudart.ErrNotSupported.
func (s *Sim) CreateShareable(size uint64) (cudart.Handle, error) {
	return s.create("create shareable", size, true)
}

// Export implements cudart.ShareableMemory: it returns a new descriptor (a
// duplicate of the handle's memfd, close-on-exec) that the caller owns and
// closes; h stays valid. h must be live and made by CreateShareable or
// Import, else the error wraps cudart.ErrInvalidValue: a handle from
// Create is refused even though its memory is a memfd too, as the driver
// refuses it (CUDA_ERROR_INVALID_VALUE). Without Config.Shared the error
// wraps cudart.ErrNotSupported. On error the descriptor is -1 and nothing
// has changed.
func (s *Sim) Export(h cudart.Handle) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return -1, fmt.Errorf("cudart: sim export: %w", cudart.ErrClosed)
	}
	if !s.cfg.Shared {
		return -1, errNotShared("export")
	}
	s.vmm.init()
	sh, ok := s.vmm.handles[h]
	switch {
	case !ok:
		return -1, fmt.Errorf("cudart: sim export of handle %#x, which is not live: %w", uint64(h), cudart.ErrInvalidValue)
	case !sh.shareable:
		return -1, fmt.Errorf("cudart: sim export of handle %#x, which Create made (the driver exports only memory created shareable; use CreateShareable): %w", uint64(h), cudart.ErrInvalidValue)
	}
	fd, err := dupCloexec(sh.fd)
	if err != nil {
		return -1, fmt.Errorf("cudart: sim export of handle %#x: %w", uint64(h), err)
	}
	s.vmm.counters.Exports++
	return fd, nil
}

// Import implements cudart.ShareableMemory: it returns a handle to the
// memory behind fd, a descriptor from Export in this process or another,
// which Map, Unmap and Release treat as any other handle. size must be the
// memory's size exactly (else an error wrapping cudart.ErrInvalidValue
// that names both) and a positive multiple of the granularity (2 MiB); a
// descriptor that is not open or cannot be mapped is an error wrapping
// cudart.ErrInvalidValue too. fd is not consumed: the Sim keeps a
// duplicate, and the caller still closes fd.
//
// Imported memory does not count against this Sim's Capacity, nor in Used
// or MemGetInfo: the exporting process's device holds it and counts it.
// Import counts in VMMCounters.Imports, not in Creates. Without
// Config.Shared it fails with an error wrapping cudart.ErrNotSupported.
func (s *Sim) Import(fd int, size uint64) (cudart.Handle, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, fmt.Errorf("cudart: sim import: %w", cudart.ErrClosed)
	}
	if !s.cfg.Shared {
		return 0, errNotShared("import")
	}
	if err := s.vmmCheck("import", size); err != nil {
		return 0, err
	}
	if fd < 0 {
		return 0, fmt.Errorf("cudart: sim import of descriptor %d: not a descriptor: %w", fd, cudart.ErrInvalidValue)
	}
	n, err := fdSize(fd)
	if err != nil {
		return 0, fmt.Errorf("cudart: sim import of descriptor %d: %w", fd, err)
	}
	if n != size {
		return 0, fmt.Errorf("cudart: sim import of %d bytes from descriptor %d, whose memory holds %d bytes: %w", size, fd, n, cudart.ErrInvalidValue)
	}
	own, err := dupCloexec(fd)
	if err != nil {
		return 0, fmt.Errorf("cudart: sim import of descriptor %d: %w", fd, err)
	}
	mem, err := mapShared(own, size)
	if err != nil {
		_ = unmapClose(own, nil)
		return 0, fmt.Errorf("cudart: sim import of %d bytes from descriptor %d: %w", size, fd, err)
	}
	h := s.vmm.nextHandle
	s.vmm.nextHandle++
	s.vmm.handles[h] = &simHandle{size: size, mem: mem, fd: own, shareable: true, imported: true}
	s.vmm.counters.Imports++
	return h, nil
}

// releaseSharedLocked unmaps and closes the memfd of every handle that has
// one (Close; s.mu held). The handles stay in the tables, without memory.
func (s *Sim) releaseSharedLocked() error {
	var errs []error
	for h, sh := range s.vmm.handles {
		if sh.fd < 0 {
			continue
		}
		if err := unmapClose(sh.fd, sh.mem); err != nil {
			errs = append(errs, fmt.Errorf("cudart: sim close: handle %#x: %w", uint64(h), err))
			continue
		}
		sh.fd, sh.mem = -1, nil
	}
	return errors.Join(errs...)
}
