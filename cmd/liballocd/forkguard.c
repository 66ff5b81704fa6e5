//go:build cgo

// forkguard.c: the fork check of every export, and the exports written in
// C that only check it and call their Go half (exports.go, torchapi.go,
// pools.go). allocd_torch_malloc, allocd_torch_malloc_pool, allocd_torch_free
// and allocd_last_error are in freequeue.c.

#include <pthread.h>
#include <string.h>

#include "exports.h"
#include "forkguard.h"
#include "lasterror.h"

int liballocd_forked;

static void mark_forked_child(void) { __atomic_store_n(&liballocd_forked, 1, __ATOMIC_RELAXED); }

__attribute__((constructor)) static void register_fork_guard(void) { pthread_atfork(NULL, NULL, mark_forked_child); }

static const char fork_message[] =
	"allocd: called in a forked child; liballocd does not survive fork (the Go runtime it runs has only the forking "
	"thread there): start processes that use it with spawn, not fork";

void liballocd_fork_error(void) { liballocd_set_error(fork_message, sizeof fork_message - 1); }

// copy_out copies s into buf (NUL-terminated, truncated to n) and returns
// its length, as the Go exports' copyOut does.
static size_t copy_out(const char *s, char *buf, size_t n) {
	size_t len = strlen(s);
	if (buf != NULL && n > 0) {
		size_t k = len < n - 1 ? len : n - 1;
		memcpy(buf, s, k);
		buf[k] = '\0';
	}
	return len;
}

#define API __attribute__((visibility("default")))

// FORKED fails the export with value v in a forked child.
#define FORKED(v)                                                                                                      \
	do {                                                                                                               \
		if (liballocd_forked_child()) {                                                                                \
			liballocd_fork_error();                                                                                    \
			return v;                                                                                                  \
		}                                                                                                              \
	} while (0)

API int allocd_init(const char *conf, const char *metrics_listen, const char *log_level) {
	FORKED(-1);
	return liballocd_go_init((char *)conf, (char *)metrics_listen, (char *)log_level);
}

API void allocd_torch_record_stream(void *ptr, void *stream) {
	FORKED();
	liballocd_go_torch_record_stream(ptr, stream);
}

API void allocd_torch_empty_cache(void) {
	FORKED();
	liballocd_go_torch_empty_cache();
}

API void allocd_torch_set_memory_fraction(double fraction, int device) {
	FORKED();
	liballocd_go_torch_set_memory_fraction(fraction, device);
}

// allocd_release_stream: stream (a cudaStream_t) of device is destroyed,
// or will not be used again; its cached segments go back to the device
// (Allocator.ReleaseStream). 0, or -1 with allocd_last_error.
API int allocd_release_stream(int device, void *stream) {
	FORKED(-1);
	return liballocd_go_release_stream(device, (uintptr_t)stream);
}

API size_t allocd_memory_stats_json(int device, char *buf, size_t n) {
	FORKED(copy_out("{}", buf, n));
	return liballocd_go_memory_stats_json(device, buf, n);
}

API size_t allocd_memory_summary(int device, int abbreviated, char *buf, size_t n) {
	FORKED(copy_out("", buf, n));
	return liballocd_go_memory_summary(device, abbreviated, buf, n);
}

API long long allocd_memory_allocated(int device) {
	FORKED(0);
	return liballocd_go_memory_allocated(device);
}

API long long allocd_memory_reserved(int device) {
	FORKED(0);
	return liballocd_go_memory_reserved(device);
}

API long long allocd_max_memory_allocated(int device) {
	FORKED(0);
	return liballocd_go_max_memory_allocated(device);
}

API long long allocd_max_memory_reserved(int device) {
	FORKED(0);
	return liballocd_go_max_memory_reserved(device);
}

API int allocd_reset_peak_stats(int device) {
	FORKED(-1);
	return liballocd_go_reset_peak_stats(device);
}

API int allocd_record_history(int enabled, long long max_entries, int stack_depth) {
	FORKED(-1);
	return liballocd_go_record_history(enabled, max_entries, stack_depth);
}

API int allocd_dump_snapshot(const char *path) {
	FORKED(-1);
	return liballocd_go_dump_snapshot((char *)path);
}

API size_t allocd_metrics_address(char *buf, size_t n) {
	FORKED(copy_out("", buf, n));
	return liballocd_go_metrics_address(buf, n);
}

// The exports allocd_torch's CUDAAllocator answers torch's own APIs with
// (torchapi.go gives the layouts of the arrays).

// allocd_device_stats writes device's statistics as c10's DeviceStats
// fields, n values at most, and returns how many there are; -1 with
// allocd_last_error.
API long long allocd_device_stats(int device, long long *buf, size_t n) {
	FORKED(-1);
	return liballocd_go_device_stats(device, buf, n);
}

// allocd_reset_accumulated_stats: torch.cuda.reset_accumulated_memory_stats.
API int allocd_reset_accumulated_stats(int device) {
	FORKED(-1);
	return liballocd_go_reset_accumulated_stats(device);
}

// allocd_memory_fraction: torch.cuda.get_per_process_memory_fraction (1 when unset).
API double allocd_memory_fraction(int device) {
	FORKED(1);
	return liballocd_go_memory_fraction(device);
}

// allocd_largest_free_block: the largest cached free block of device, in bytes.
API long long allocd_largest_free_block(int device) {
	FORKED(0);
	return liballocd_go_largest_free_block(device);
}

// allocd_snapshot_flat writes the snapshot of every device as int64 values
// when n holds them all, and returns how many there are; -1 with
// allocd_last_error.
API long long allocd_snapshot_flat(int traces, long long *buf, size_t n) {
	FORKED(-1);
	return liballocd_go_snapshot_flat(traces, buf, n);
}

// The private pools of torch's CUDA graphs and torch.cuda.MemPool (pools.go):
// each names its pool as torch's MempoolId_t pair (id0, id1). The int
// functions return 0, or -1 with allocd_last_error; allocd_torch_malloc_pool
// is in freequeue.c.

// allocd_torch_create_pool: the pool gains a user, created when it has none.
API int allocd_torch_create_pool(int device, uint64_t id0, uint64_t id1) {
	FORKED(-1);
	return liballocd_go_create_pool(device, id0, id1);
}

// allocd_torch_release_pool: one user lets go; at the last the pool's memory
// returns to the device.
API int allocd_torch_release_pool(int device, uint64_t id0, uint64_t id1) {
	FORKED(-1);
	return liballocd_go_release_pool(device, id0, id1);
}

// allocd_torch_begin_pool: the pool gains a user, and a capture to it is
// under way until allocd_torch_end_pool.
API int allocd_torch_begin_pool(int device, uint64_t id0, uint64_t id1) {
	FORKED(-1);
	return liballocd_go_begin_pool(device, id0, id1);
}

// allocd_torch_end_pool: the earliest capture to the pool under way ends.
API int allocd_torch_end_pool(int device, uint64_t id0, uint64_t id1) {
	FORKED(-1);
	return liballocd_go_end_pool(device, id0, id1);
}

// allocd_torch_empty_pool_cache: torch's emptyCache(pool); releases nothing
// (pools.go says why). device -1: every device.
API int allocd_torch_empty_pool_cache(int device, uint64_t id0, uint64_t id1) {
	FORKED(-1);
	return liballocd_go_empty_pool_cache(device, id0, id1);
}

// allocd_torch_pool_use_count: the pool's users, 0 when it has none; -1 with
// allocd_last_error.
API int allocd_torch_pool_use_count(int device, uint64_t id0, uint64_t id1) {
	FORKED(-1);
	return liballocd_go_pool_use_count(device, id0, id1);
}

// allocd_torch_checkpoint_pool: the pool's layout (torch's getCheckpointState), as
// a handle for allocd_torch_restore_pool, dropped with allocd_torch_checkpoint_free;
// 0 with allocd_last_error.
API uintptr_t allocd_torch_checkpoint_pool(int device, uint64_t id0, uint64_t id1) {
	FORKED(0);
	return liballocd_go_checkpoint_pool(device, id0, id1);
}

// allocd_torch_checkpoint_free: drops a checkpoint's handle.
API void allocd_torch_checkpoint_free(uintptr_t checkpoint) {
	FORKED();
	liballocd_go_checkpoint_free(checkpoint);
}

// allocd_torch_restore_pool: the checkpoint's pool set back to it (torch's
// setCheckpointPoolState). *out gets a malloc'd array, for the caller to free():
// the numbers of blocks freed and allocated, then their addresses. Returns its
// length, or -1 with allocd_last_error (*out NULL unless a failed restore did
// part of its work: then what it did).
API long long allocd_torch_restore_pool(int device, uintptr_t checkpoint, long long **out) {
	if (out != NULL) {
		*out = NULL;
	}
	FORKED(-1);
	return liballocd_go_restore_pool(device, checkpoint, out);
}
