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

// liballocd_queue_state is the queue's one word of state, changed only
// with atomic operations, by C and by Go (queue.go) alike, so that draining
// costs no call from Go into C:
//
//	bit 0  LIBALLOCD_QUEUE_LOCKED: a free is writing its entry
//	bit 1  LIBALLOCD_QUEUE_DRAINING: Go has taken a batch and not yet
//	       applied it all; no other thread takes one meanwhile
//	bit 2  LIBALLOCD_QUEUE_BUFFER: which of the two buffers of
//	       liballocd_queue frees go into; Go takes a batch by switching
//	       buffers, and reads the other while frees fill this one
//	bits 3-63  how many frees that buffer holds, oldest first
//
// Every change but the lock holder's own release is a compare-and-swap that
// expects the lock bit clear. So a state without queued frees and without
// DRAINING means every free that has returned has been applied.
#define LIBALLOCD_QUEUE_LOCKED 1
#define LIBALLOCD_QUEUE_DRAINING 2
#define LIBALLOCD_QUEUE_BUFFER 4
#define LIBALLOCD_QUEUE_ONE 8
extern uint64_t liballocd_queue_state;
extern liballocd_free_entry liballocd_queue[2][LIBALLOCD_QUEUE_CAP];

#pragma GCC visibility pop

#endif
