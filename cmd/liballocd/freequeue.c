//go:build cgo

// freequeue.c: allocd_torch_free, in C. PyTorch frees a block as often as it
// mallocs one, and each call from C into Go costs a transition (more than the
// allocator's own work on a cached block). So a free only records its
// arguments in a bounded queue and returns; Go applies the queue, in order,
// at the start of every other call into the library (queue.go), before it
// looks at or changes any state. Whatever a caller can observe is therefore
// as if each free had been applied when it returned.

#include <pthread.h>
#include <sched.h>

#include "freequeue.h"
#include "lasterror.h"

// The Go side (queue.go); hidden there too.
void liballocd_go_free(void *ptr, size_t size, int device, void *stream);
void liballocd_go_drain(void);

int64_t liballocd_queue_pending;
uint32_t liballocd_queue_lock;
uint64_t liballocd_queue_len;
liballocd_free_entry liballocd_queue[LIBALLOCD_QUEUE_CAP];

// The lock is held for a few stores (or, by Go, a copy of the queue): spin
// briefly, then yield the CPU to whoever holds it.
static void lock(void) {
	for (int spins = 0;; spins++) {
		uint32_t unlocked = 0;
		if (__atomic_load_n(&liballocd_queue_lock, __ATOMIC_RELAXED) == 0 &&
		    __atomic_compare_exchange_n(&liballocd_queue_lock, &unlocked, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
			return;
		}
		if (spins < 64) {
			__builtin_ia32_pause();
		} else {
			sched_yield();
		}
	}
}

static void unlock(void) { __atomic_store_n(&liballocd_queue_lock, 0, __ATOMIC_RELEASE); }

__attribute__((visibility("default"))) void allocd_torch_free(void *ptr, size_t size, int device, void *stream) {
	lock();
	uint64_t n = liballocd_queue_len;
	if (n < LIBALLOCD_QUEUE_CAP) {
		liballocd_queue[n] = (liballocd_free_entry){(uintptr_t)ptr, size, device, (uintptr_t)stream};
		liballocd_queue_len = n + 1;
		__atomic_add_fetch(&liballocd_queue_pending, 1, __ATOMIC_SEQ_CST);
		unlock();
		return;
	}
	unlock();
	// Full: Go applies the queue, then this free.
	liballocd_go_free(ptr, size, device, stream);
}

// allocd_last_error is C too: it calls into Go only when frees are queued, so
// that a bad free's message (set when the free is applied) is there to read.
__attribute__((visibility("default"))) size_t allocd_last_error(char *buf, size_t n) {
	if (__atomic_load_n(&liballocd_queue_pending, __ATOMIC_SEQ_CST) != 0) {
		liballocd_go_drain();
	}
	return liballocd_get_error(buf, n);
}

// Fork: a child must not inherit the lock held by a thread that fork did not
// copy. The prepare handler takes it, so no free is half-recorded at the
// fork; both sides release it. The child keeps the parent's queue, which
// belongs with the allocator state it inherited.
__attribute__((constructor)) static void register_fork_handlers(void) {
	pthread_atfork(lock, unlock, unlock);
}
