//go:build cgo

package main

/*
#include <stddef.h>
#include "freequeue.h"

// The Go functions freequeue.c calls; hidden, like the rest of the
// library's internals (only the allocd_* API is exported).
void liballocd_go_free(void *ptr, size_t size, int device, void *stream) __attribute__((visibility("hidden")));
void liballocd_go_drain(void) __attribute__((visibility("hidden")));
*/
import "C"

import (
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/allocd/allocd/cudart"
)

// The free queue's Go half. allocd_torch_free (freequeue.c) queues its
// arguments in C and returns without entering Go; drain applies the queued
// frees, oldest first, and every export that reads or changes the
// allocators' state calls it first (through getDrained), as do the metrics
// server's handlers. Since a free counts as pending until it has been
// applied (liballocd_queue_pending), a caller that finds nothing pending
// knows that every free that returned before its call has taken effect, and
// one that finds some waits on drainMu for any batch being applied by
// another thread before it takes the rest.

var (
	drainMu  sync.Mutex
	drainBuf [C.LIBALLOCD_QUEUE_CAP]C.liballocd_free_entry // guarded by drainMu
)

// The C globals of freequeue.h, read and written by Go directly (no call
// into C).
var (
	qPending = (*int64)(unsafe.Pointer(&C.liballocd_queue_pending))
	qLock    = (*uint32)(unsafe.Pointer(&C.liballocd_queue_lock))
	qLen     = (*uint64)(unsafe.Pointer(&C.liballocd_queue_len))
	qEntries = (*[C.LIBALLOCD_QUEUE_CAP]C.liballocd_free_entry)(unsafe.Pointer(&C.liballocd_queue[0]))
)

// take moves the queued frees into drainBuf and returns how many; the
// caller holds drainMu. The spin lock is held only for the copy.
func take() int {
	for spins := 0; !atomic.CompareAndSwapUint32(qLock, 0, 1); spins++ {
		if spins >= 64 {
			runtime.Gosched()
		}
	}
	n := int(*qLen)
	copy(drainBuf[:n], qEntries[:n])
	*qLen = 0
	atomic.StoreUint32(qLock, 0)
	return n
}

// drain applies the queued frees. With setErr, a bad free's error becomes
// the calling thread's allocd_last_error message (the export's caller); the
// metrics server's goroutines pass false. A bad free is counted and logged
// by free either way.
func (l *lib) drain(setErr bool) {
	if atomic.LoadInt64(qPending) == 0 {
		return
	}
	drainMu.Lock()
	n := take()
	// One deferred call, not two: it releases drainMu and counts the batch
	// as applied even if a free panics (the export recovers), so that a
	// panic can neither deadlock nor leave every later call on this path.
	defer func() {
		atomic.AddInt64(qPending, -int64(n))
		drainMu.Unlock()
	}()
	for i := range n {
		e := &drainBuf[i]
		if err := l.free(cudart.Ptr(e.ptr), int(e.device)); err != nil && setErr {
			setError(err) // logged, rate limited, by free
		}
	}
}

// getDrained is get followed by drain: the start of every export that reads
// or changes allocator state.
func getDrained() (*lib, error) {
	l, err := get()
	if err != nil {
		return nil, err
	}
	l.drain(true)
	return l, nil
}

// liballocd_go_free applies the queued frees and then this one; the free
// that finds the queue full calls it.
//
//export liballocd_go_free
func liballocd_go_free(ptr unsafe.Pointer, size C.size_t, device C.int, stream unsafe.Pointer) {
	defer recovered("allocd_torch_free")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return
	}
	if err := l.free(cudart.Ptr(uintptr(ptr)), int(device)); err != nil {
		setError(err) // logged, rate limited, by free
	}
}

// liballocd_go_drain applies the queued frees; allocd_last_error calls it
// when some are pending.
//
//export liballocd_go_drain
func liballocd_go_drain() {
	defer recovered("allocd_last_error")
	if l, err := get(); err == nil {
		l.drain(true)
	}
}
