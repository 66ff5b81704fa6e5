// exports.h: the Go half of the C API (exports.go), which the C functions
// of exports.c and freequeue.c call after the fork check (forkguard.h).
// Hidden: only the allocd_* functions are liballocd.so's API.
#ifndef LIBALLOCD_EXPORTS_H
#define LIBALLOCD_EXPORTS_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)
int liballocd_go_init(char *conf, char *metrics_listen, char *log_level);
uintptr_t liballocd_go_malloc(size_t size, int device, uintptr_t stream);
void liballocd_go_torch_record_stream(void *ptr, void *stream);
void liballocd_go_torch_empty_cache(void);
void liballocd_go_torch_set_memory_fraction(double fraction, int device);
int liballocd_go_release_stream(int device, uintptr_t stream);
size_t liballocd_go_memory_stats_json(int device, char *buf, size_t n);
size_t liballocd_go_memory_summary(int device, int abbreviated, char *buf, size_t n);
long long liballocd_go_memory_allocated(int device);
long long liballocd_go_memory_reserved(int device);
long long liballocd_go_max_memory_allocated(int device);
long long liballocd_go_max_memory_reserved(int device);
int liballocd_go_reset_peak_stats(int device);
int liballocd_go_record_history(int enabled, long long max_entries, int stack_depth);
int liballocd_go_dump_snapshot(char *path);
size_t liballocd_go_metrics_address(char *buf, size_t n);
long long liballocd_go_device_stats(int device, long long *buf, size_t n);
int liballocd_go_reset_accumulated_stats(int device);
double liballocd_go_memory_fraction(int device);
long long liballocd_go_largest_free_block(int device);
long long liballocd_go_snapshot_flat(int traces, long long *buf, size_t n);
int liballocd_go_create_pool(int device, uint64_t id0, uint64_t id1);
int liballocd_go_release_pool(int device, uint64_t id0, uint64_t id1);
int liballocd_go_begin_pool(int device, uint64_t id0, uint64_t id1);
int liballocd_go_end_pool(int device, uint64_t id0, uint64_t id1);
int liballocd_go_empty_pool_cache(int device, uint64_t id0, uint64_t id1);
int liballocd_go_pool_use_count(int device, uint64_t id0, uint64_t id1);
uintptr_t liballocd_go_malloc_pool(size_t size, int device, uintptr_t stream, uint64_t id0, uint64_t id1);
uintptr_t liballocd_go_checkpoint_pool(int device, uint64_t id0, uint64_t id1);
void liballocd_go_checkpoint_free(uintptr_t checkpoint);
long long liballocd_go_restore_pool(int device, uintptr_t checkpoint, long long **out);
#pragma GCC visibility pop

#endif
