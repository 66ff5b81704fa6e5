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
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/allocd/allocd/cudart"
)

// The free queue's Go half. allocd_torch_free (freequeue.c) queues its
// arguments in C and returns without entering Go; drain applies the queued
// frees, oldest first, and every export that reads or changes the
// allocators' state calls it first (through getDrained), as do the metrics
// server's handlers. One thread at a time takes a batch and applies it
// (liballocd_queue_state's DRAINING bit), and a caller that finds frees
// queued or a batch being applied waits for it. So a caller that returns
// from drain knows that every free that returned before its call has
// taken effect.

const (
	qLocked   = C.LIBALLOCD_QUEUE_LOCKED
	qDraining = C.LIBALLOCD_QUEUE_DRAINING
	qBuffer   = C.LIBALLOCD_QUEUE_BUFFER
	qOne      = C.LIBALLOCD_QUEUE_ONE
)

// The C globals of freequeue.h, read and written by Go directly (no call
// into C).
var (
	qState   = (*uint64)(unsafe.Pointer(&C.liballocd_queue_state))
	qBuffers = (*[2][C.LIBALLOCD_QUEUE_CAP]C.liballocd_free_entry)(unsafe.Pointer(&C.liballocd_queue[0][0]))
)

// backoff waits a little in a compare-and-swap loop: it spins first, then
// yields, then sleeps (another thread's batch may wait on the allocator).
func backoff(spins int) {
	switch {
	case spins < 64:
	case spins < 128:
		runtime.Gosched()
	default:
		time.Sleep(20 * time.Microsecond)
	}
}

// take takes the queued frees as a batch: it switches frees to the other
// buffer, sets DRAINING and returns the batch, which stays valid until
// drained. nil: nothing left to wait for. While another thread applies a
// batch, it waits.
func take() []C.liballocd_free_entry {
	for spins := 0; ; spins++ {
		s := atomic.LoadUint64(qState)
		if s&^(qLocked|qBuffer) == 0 {
			return nil // nothing queued (a free still holding the lock has not returned)
		}
		if s&(qLocked|qDraining) == 0 && atomic.CompareAndSwapUint64(qState, s, (s&qBuffer)^qBuffer|qDraining) {
			b := 0
			if s&qBuffer != 0 {
				b = 1
			}
			return qBuffers[b][:s/qOne]
		}
		backoff(spins)
	}
}

// drained clears DRAINING once the batch has been applied. Only a free
// writing its entry can hold it up (the lock bit, or a change between the
// load and the compare-and-swap), and a full buffer sends frees to drain,
// which waits for DRAINING: so it retries a bounded number of times, and it
// never sleeps, since every other drain waits for it.
func drained() {
	for spins := 0; ; spins++ {
		s := atomic.LoadUint64(qState)
		if s&qLocked == 0 && atomic.CompareAndSwapUint64(qState, s, s&^qDraining) {
			return
		}
		if spins >= 64 {
			runtime.Gosched()
		}
	}
}

// drain applies the queued frees. With setErr, a bad free's error becomes
// the calling thread's allocd_last_error message (the export's caller); the
// metrics server's goroutines pass false. A bad free is counted and logged
// by free either way.
func (l *lib) drain(setErr bool) {
	if atomic.LoadUint64(qState)&^(qLocked|qBuffer) == 0 {
		return
	}
	batch := take()
	if batch == nil {
		return
	}
	// Deferred, so that a free that panics (the export recovers) cannot
	// leave DRAINING set and every later call waiting.
	defer drained()
	for i := range batch {
		e := &batch[i]
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
