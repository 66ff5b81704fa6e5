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

#include "exports.h"
#include "forkguard.h"
#include "freequeue.h"
#include "lasterror.h"

// The Go side (queue.go); hidden there too.
void liballocd_go_free(void *ptr, size_t size, int device, void *stream);
void liballocd_go_drain(void);

uint64_t liballocd_queue_state;
liballocd_free_entry liballocd_queue[2][LIBALLOCD_QUEUE_CAP];

// cpu_relax tells the CPU that this thread spins.
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield");
#endif
}

// lock sets the lock bit and returns the state it found (lock bit clear).
// The lock is held for a few stores: spin briefly, then yield the CPU to
// whoever holds it.
static uint64_t lock(void) {
	for (int spins = 0;; spins++) {
		uint64_t s = __atomic_load_n(&liballocd_queue_state, __ATOMIC_RELAXED);
		if ((s & LIBALLOCD_QUEUE_LOCKED) == 0 &&
		    __atomic_compare_exchange_n(&liballocd_queue_state, &s, s | LIBALLOCD_QUEUE_LOCKED, 0, __ATOMIC_ACQUIRE,
		                                __ATOMIC_RELAXED)) {
			return s;
		}
		if (spins < 64) {
			cpu_relax();
		} else {
			sched_yield();
		}
	}
}

// unlock releases the lock, leaving state s (lock bit clear).
static void unlock(uint64_t s) { __atomic_store_n(&liballocd_queue_state, s, __ATOMIC_RELEASE); }

__attribute__((visibility("default"))) void allocd_torch_free(void *ptr, size_t size, int device, void *stream) {
	if (liballocd_forked_child()) {
		// The memory is the parent's; the child has no allocator to return it to.
		liballocd_fork_error();
		return;
	}
	uint64_t s = lock();
	uint64_t n = s / LIBALLOCD_QUEUE_ONE;
	if (n < LIBALLOCD_QUEUE_CAP) {
		liballocd_free_entry *e = &liballocd_queue[(s & LIBALLOCD_QUEUE_BUFFER) != 0][n];
		*e = (liballocd_free_entry){(uintptr_t)ptr, size, device, (uintptr_t)stream};
		unlock(s + LIBALLOCD_QUEUE_ONE);
		return;
	}
	unlock(s);
	// Full: Go applies the queue, then this free.
	liballocd_go_free(ptr, size, device, stream);
}

// allocd_torch_malloc is C only so that the pointer comes back from Go as an
// integer (exports.go says why).
__attribute__((visibility("default"))) void *allocd_torch_malloc(size_t size, int device, void *stream) {
	if (liballocd_forked_child()) {
		liballocd_fork_error();
		return NULL;
	}
	return (void *)liballocd_go_malloc(size, device, (uintptr_t)stream);
}

// allocd_torch_malloc_pool is allocd_torch_malloc into private pool (id0, id1)
// of device, which must have a user: NULL with allocd_last_error on failure.
__attribute__((visibility("default"))) void *allocd_torch_malloc_pool(size_t size, int device, void *stream, uint64_t id0,
                                                                      uint64_t id1) {
	if (liballocd_forked_child()) {
		liballocd_fork_error();
		return NULL;
	}
	return (void *)liballocd_go_malloc_pool(size, device, (uintptr_t)stream, id0, id1);
}

// allocd_last_error is C too: it calls into Go only when frees are queued, so
// that a bad free's message (set when the free is applied) is there to read,
// and never in a forked child.
__attribute__((visibility("default"))) size_t allocd_last_error(char *buf, size_t n) {
	if (!liballocd_forked_child() && __atomic_load_n(&liballocd_queue_state, __ATOMIC_ACQUIRE) / LIBALLOCD_QUEUE_ONE != 0) {
		liballocd_go_drain();
	}
	return liballocd_get_error(buf, n);
}

// Fork: a child must not inherit the lock held by a thread that fork did not
// copy. The prepare handler takes it, so no free is half-recorded at the
// fork, and the parent releases it. The child keeps the parent's queue,
// which belongs with the allocator state it inherited, but not DRAINING: the
// thread applying a batch is not in the child. (A child's calls never reach
// the queue or Go: forkguard.h.)
static uint64_t forked_state;
static void lock_for_fork(void) { forked_state = lock(); }
static void unlock_in_parent(void) { unlock(forked_state); }
static void unlock_in_child(void) { unlock(forked_state & ~(uint64_t)LIBALLOCD_QUEUE_DRAINING); }

__attribute__((constructor)) static void register_fork_handlers(void) {
	pthread_atfork(lock_for_fork, unlock_in_parent, unlock_in_child);
}
