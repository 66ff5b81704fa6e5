//go:build cgo

package main

/*
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include "exports.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"runtime/cgo"
	"unsafe"

	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// The exports behind torch's private memory pools (CUDA graph capture,
// torch.cuda.MemPool), which allocd_torch's CUDAAllocator
// (python/allocd_torch/_allocator.cpp) answers torch's pool calls with.
// Each names its pool as torch's MempoolId_t, the pair (id0, id1), and
// works on one device's allocator (allocator/pools.go):
//
//	allocd_torch_create_pool        createOrIncrefPool: CreatePool
//	allocd_torch_release_pool       releasePool: ReleasePool
//	allocd_torch_begin_pool         beginAllocateToPool: BeginAllocateToPool
//	allocd_torch_end_pool           endAllocateToPool: EndAllocateToPool
//	allocd_torch_malloc_pool        a malloc routed to a pool: MallocInPool
//	allocd_torch_empty_pool_cache   emptyCache(pool): nothing to release (below)
//	allocd_torch_pool_use_count     getPoolUseCount: the pool's Users
//	allocd_torch_checkpoint_pool    getCheckpointState: CheckpointPool, as a handle
//	allocd_torch_checkpoint_free    the checkpoint's handle dropped
//	allocd_torch_restore_pool       setCheckpointPoolState: RestorePool
//
// The C++ class keeps torch's stream filters itself: beginAllocateToPool's
// filter is a C++ std::function, which Go cannot call. So
// allocd_torch_begin_pool passes Go a filter that accepts no stream: Go
// routes nothing by itself, but knows that a capture is under way (no
// event queries, deferred events, no releases: allocator/pools.go), and the C++
// class walks its own filters and routes a malloc that one accepts with
// allocd_torch_malloc_pool.

// refuseAll is the stream filter of the captures begun through the C API:
// the C++ class routes explicitly (MallocInPool).
func refuseAll(cudart.Stream) bool { return false }

// poolID is the pool (id0, id1).
func poolID(id0, id1 C.uint64_t) allocator.PoolID { return allocator.PoolID{uint64(id0), uint64(id1)} }

// poolDevice returns the allocator of device for a pool call. With create
// it is created when it does not exist yet (a pool's first user); without,
// a device not created has no pool (ErrUnknownPool).
func poolDevice(l *lib, device C.int, create bool) (*allocator.Allocator, error) {
	if device < 0 || device >= maxDevices {
		return nil, fmt.Errorf("device %d: index outside 0..%d: %w", device, maxDevices-1, allocator.ErrNoSuchDevice)
	}
	if create {
		return l.devs.ForDevice(int(device))
	}
	if a := l.alloc(int(device)); a != nil {
		return a, nil
	}
	return nil, fmt.Errorf("device %d has no allocator yet, so no pool: %w", device, allocator.ErrUnknownPool)
}

// poolCall is the body of the pool exports that return 0, or -1 with
// allocd_last_error: it runs f on device's allocator for pool (id0, id1).
// A failure is logged, and its message names the device (the
// allocator's errors name the call and the pool).
func poolCall(export, what string, device C.int, id0, id1 C.uint64_t, create bool,
	f func(a *allocator.Allocator, id allocator.PoolID) error) (rc C.int) {
	defer recovered(export)
	rc = -1
	l, err := getDrained()
	if err != nil {
		return fail(err)
	}
	id := poolID(id0, id1)
	a, err := poolDevice(l, device, create)
	if err != nil {
		err = fmt.Errorf("allocd: %s %v: %w", what, id, err)
	} else if err = f(a, id); err != nil {
		err = fmt.Errorf("allocd: device %d: %w", device, err)
	}
	if err != nil {
		report(l, what+" failed", err)
		return -1
	}
	return 0
}

// liballocd_go_create_pool is allocd_torch_create_pool: pool (id0, id1) of
// device gains a user, and is created when it has none (torch's
// createOrIncrefPool, which torch.cuda.MemPool calls).
//
//export liballocd_go_create_pool
func liballocd_go_create_pool(device C.int, id0, id1 C.uint64_t) C.int {
	return poolCall("allocd_torch_create_pool", "create pool", device, id0, id1, true,
		func(a *allocator.Allocator, id allocator.PoolID) error { return a.CreatePool(id) })
}

// liballocd_go_release_pool is allocd_torch_release_pool: one user of the
// pool lets go (torch's releasePool: a CUDA graph's reset, a MemPool's
// destruction, the end of use_mem_pool). At the last, the pool's memory
// returns to the device: its free segments at once, the rest as their
// blocks are freed (Allocator.ReleasePool).
//
//export liballocd_go_release_pool
func liballocd_go_release_pool(device C.int, id0, id1 C.uint64_t) C.int {
	return poolCall("allocd_torch_release_pool", "release pool", device, id0, id1, false,
		func(a *allocator.Allocator, id allocator.PoolID) error { return a.ReleasePool(id) })
}

// liballocd_go_begin_pool is allocd_torch_begin_pool: the pool gains a
// user, created when needed, and a capture to it is under way until
// allocd_torch_end_pool (torch's beginAllocateToPool). No stream is routed
// to it in Go (refuseAll): the caller routes with allocd_torch_malloc_pool.
//
//export liballocd_go_begin_pool
func liballocd_go_begin_pool(device C.int, id0, id1 C.uint64_t) C.int {
	return poolCall("allocd_torch_begin_pool", "begin allocate to pool", device, id0, id1, true,
		func(a *allocator.Allocator, id allocator.PoolID) error { return a.BeginAllocateToPool(id, refuseAll) })
}

// liballocd_go_end_pool is allocd_torch_end_pool: the earliest capture to
// the pool still under way ends (torch's endAllocateToPool); its user
// stays until allocd_torch_release_pool.
//
//export liballocd_go_end_pool
func liballocd_go_end_pool(device C.int, id0, id1 C.uint64_t) C.int {
	return poolCall("allocd_torch_end_pool", "end allocate to pool", device, id0, id1, false,
		func(a *allocator.Allocator, id allocator.PoolID) error { return a.EndAllocateToPool(id) })
}

// liballocd_go_empty_pool_cache is allocd_torch_empty_pool_cache: torch's
// emptyCache(pool) for a private pool, which a MemPool's destructor calls
// right after its releasePool. It releases nothing, on purpose:
//
//   - a pool without users is gone or on its way: ReleasePool returned its
//     free segments to the device at once, and the rest go as their blocks
//     are freed (the frees queued in C are applied before this call, and
//     with them whatever memory they free);
//   - a pool with users (another MemPool or CUDA graph shares it) keeps its
//     cached memory for them: it is theirs, and allocd has no per-pool
//     EmptyCache. PyTorch's emptyCache(pool) would return the pool's free
//     unsplit segments here; allocd keeps them until the last user lets go.
//
// A device < 0 means every device, as torch's emptyCache(pool) has no
// device; pool (0, 0) is the general cache (allocd_torch_empty_cache),
// an error here. Returns 0, or -1 with allocd_last_error.
//
//export liballocd_go_empty_pool_cache
func liballocd_go_empty_pool_cache(device C.int, id0, id1 C.uint64_t) (rc C.int) {
	defer recovered("allocd_torch_empty_pool_cache")
	rc = -1
	if _, err := getDrained(); err != nil {
		return fail(err)
	}
	if id := poolID(id0, id1); id == (allocator.PoolID{}) {
		return fail(fmt.Errorf("allocd: empty pool cache %v: (0, 0) is the general cache (allocd_torch_empty_cache), not a private pool: %w",
			id, allocator.ErrUnknownPool))
	}
	if device >= maxDevices {
		return fail(fmt.Errorf("allocd: empty pool cache on device %d: index outside 0..%d: %w", device, maxDevices-1, allocator.ErrNoSuchDevice))
	}
	return 0
}

// liballocd_go_pool_use_count is allocd_torch_pool_use_count: the pool's
// users (torch's getPoolUseCount, MemPool.use_count()): 0 for a pool that
// has none, or does not exist, or a device not created; -1 with
// allocd_last_error on failure.
//
//export liballocd_go_pool_use_count
func liballocd_go_pool_use_count(device C.int, id0, id1 C.uint64_t) (rc C.int) {
	defer recovered("allocd_torch_pool_use_count")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return fail(err)
	}
	a, err := poolDevice(l, device, false)
	if errors.Is(err, allocator.ErrUnknownPool) {
		return 0
	}
	if err != nil {
		return fail(fmt.Errorf("allocd: pool use count: %w", err))
	}
	id := poolID(id0, id1)
	for _, p := range a.Pools() {
		if p.ID == id {
			return C.int(p.Users)
		}
	}
	return 0
}

// liballocd_go_malloc_pool is allocd_torch_malloc_pool (freequeue.c): a
// malloc into pool (id0, id1) of device, which must have a user
// (Allocator.MallocInPool); the C++ class calls it for a malloc that a
// capture's filter routes to the pool. 0 with allocd_last_error on
// failure. The pointer travels as an integer, as liballocd_go_malloc's.
//
//export liballocd_go_malloc_pool
func liballocd_go_malloc_pool(size C.size_t, device C.int, stream C.uintptr_t, id0, id1 C.uint64_t) (p C.uintptr_t) {
	defer recovered("allocd_torch_malloc_pool")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return 0
	}
	a, err := poolDevice(l, device, false)
	if err != nil {
		setError(fmt.Errorf("allocd: malloc in pool %v: %w", poolID(id0, id1), err))
		return 0
	}
	ptr, err := a.MallocInPool(poolID(id0, id1), uint64(size), cudart.Stream(stream))
	if err != nil {
		setError(err)
		l.log.Debug("malloc in pool failed", zap.Error(err))
		return 0
	}
	return C.uintptr_t(ptr)
}

// checkpoint is what a checkpoint's handle (allocd_torch_checkpoint_pool)
// holds: a Go pointer, which C may not keep, so C keeps a cgo.Handle.
type checkpoint struct {
	device int
	ck     *allocator.PoolCheckpoint
}

// liballocd_go_checkpoint_pool is allocd_torch_checkpoint_pool: the layout
// of the pool (id0, id1) of device, which must have a user (torch's
// getCheckpointState, which torch.compile's CUDA graph trees call after
// each recording; Allocator.CheckpointPool), as a handle that
// allocd_torch_checkpoint_free drops. 0 with allocd_last_error.
//
//export liballocd_go_checkpoint_pool
func liballocd_go_checkpoint_pool(device C.int, id0, id1 C.uint64_t) (h C.uintptr_t) {
	defer recovered("allocd_torch_checkpoint_pool")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return 0
	}
	id := poolID(id0, id1)
	a, err := poolDevice(l, device, false)
	if err != nil {
		report(l, "checkpoint pool failed", fmt.Errorf("allocd: checkpoint pool %v: %w", id, err))
		return 0
	}
	ck, err := a.CheckpointPool(id)
	if err != nil {
		report(l, "checkpoint pool failed", fmt.Errorf("allocd: device %d: %w", device, err))
		return 0
	}
	return C.uintptr_t(cgo.NewHandle(&checkpoint{device: int(device), ck: ck}))
}

// liballocd_go_checkpoint_free is allocd_torch_checkpoint_free: the
// checkpoint's handle is dropped (once; 0 is nothing).
//
//export liballocd_go_checkpoint_free
func liballocd_go_checkpoint_free(h C.uintptr_t) {
	defer recovered("allocd_torch_checkpoint_free")
	if h != 0 {
		cgo.Handle(h).Delete()
	}
}

// liballocd_go_restore_pool is allocd_torch_restore_pool: the pool of the
// checkpoint h, taken on device, is set back to it (torch's
// setCheckpointPoolState; Allocator.RestorePool): every block allocated in
// it now is freed, and the blocks allocated at the checkpoint are
// allocated again at their addresses, the caller's as if malloc had
// returned them. *out gets an array of C's malloc, which the caller frees
// with free(): the number of blocks freed, the number allocated, the
// freed addresses, then the allocated ones. It returns the array's length;
// or -1 with allocd_last_error, *out then NULL when nothing changed, else
// (a restore that failed half way) the array of what was done.
//
//export liballocd_go_restore_pool
func liballocd_go_restore_pool(device C.int, h C.uintptr_t, out **C.longlong) (n C.longlong) {
	defer recovered("allocd_torch_restore_pool")
	n = -1
	if out == nil {
		return C.longlong(fail(errors.New("allocd: restore pool: NULL result pointer")))
	}
	*out = nil
	l, err := getDrained()
	if err != nil {
		return C.longlong(fail(err))
	}
	ck, ok := cgo.Handle(h).Value().(*checkpoint)
	switch {
	case !ok:
		return C.longlong(fail(fmt.Errorf("allocd: restore pool: handle %#x is not a checkpoint", uintptr(h))))
	case ck.device != int(device):
		return C.longlong(fail(fmt.Errorf("allocd: restore pool %v on device %d: the checkpoint is of device %d",
			ck.ck.ID(), device, ck.device)))
	}
	a, err := poolDevice(l, device, false)
	if err != nil {
		return C.longlong(fail(fmt.Errorf("allocd: restore pool %v: %w", ck.ck.ID(), err)))
	}
	freed, allocated, err := a.RestorePool(ck.ck)
	if err == nil || len(freed)+len(allocated) > 0 {
		vals := make([]int64, 0, 2+len(freed)+len(allocated))
		vals = append(vals, int64(len(freed)), int64(len(allocated)))
		for _, p := range freed {
			vals = append(vals, int64(p))
		}
		for _, p := range allocated {
			vals = append(vals, int64(p))
		}
		buf := C.malloc(C.size_t(len(vals)) * C.size_t(unsafe.Sizeof(C.longlong(0))))
		copy(unsafe.Slice((*int64)(buf), len(vals)), vals)
		*out = (*C.longlong)(buf)
		n = C.longlong(len(vals))
	}
	if err != nil {
		report(l, "restore pool failed", fmt.Errorf("allocd: device %d: %w", device, err))
		return -1
	}
	return n
}
