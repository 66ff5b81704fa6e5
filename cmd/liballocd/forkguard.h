// forkguard.h: whether this process is a forked child of the one that
// loaded liballocd.so (forkguard.c). The Go runtime does not survive
// fork(): a child has only the thread that forked, and the runtime's other
// threads, and whatever locks they held, are gone, so a call into Go there
// may wait for ever. Every export checks liballocd_forked_child() first
// and, in a child, fails at once without entering Go. Hidden.
#ifndef LIBALLOCD_FORKGUARD_H
#define LIBALLOCD_FORKGUARD_H

#pragma GCC visibility push(hidden)
// liballocd_forked is set, in the child only, by a pthread_atfork handler.
extern int liballocd_forked;

// liballocd_forked_child reports whether the process is a forked child:
// one relaxed load.
static inline int liballocd_forked_child(void) { return __atomic_load_n(&liballocd_forked, __ATOMIC_RELAXED); }

// liballocd_fork_error makes the fork's message the calling thread's
// allocd_last_error.
void liballocd_fork_error(void);
#pragma GCC visibility pop

#endif
