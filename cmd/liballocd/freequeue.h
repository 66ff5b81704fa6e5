// freequeue.h: the queue of frees not yet applied (freequeue.c). Hidden:
// nothing here is part of liballocd.so's API.
#ifndef LIBALLOCD_FREEQUEUE_H
#define LIBALLOCD_FREEQUEUE_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

// LIBALLOCD_QUEUE_CAP is how many frees wait at most; the free that finds the
// queue full calls into Go, which applies the queue and then that free.
#define LIBALLOCD_QUEUE_CAP 256

// liballocd_free_entry is one allocd_torch_free call's arguments.
typedef struct {
	uintptr_t ptr;
	size_t size;
	int device;
	uintptr_t stream;
} liballocd_free_entry;

// liballocd_queue_pending counts the frees queued or taken but not yet
// applied: allocd_torch_free adds 1 to it (atomically, before it returns),
// and Go subtracts a batch once it has applied it. Zero means every free
// that has returned has been applied.
extern int64_t liballocd_queue_pending;

// The queue: liballocd_queue[0:liballocd_queue_len], oldest first, guarded
// by the spin lock liballocd_queue_lock (0 free, 1 held), which Go takes
// with atomic compare-and-swap too (queue.go), so that draining costs no
// call from Go into C.
extern uint32_t liballocd_queue_lock;
extern uint64_t liballocd_queue_len;
extern liballocd_free_entry liballocd_queue[LIBALLOCD_QUEUE_CAP];

#pragma GCC visibility pop

#endif
