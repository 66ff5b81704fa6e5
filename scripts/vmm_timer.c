// Counts and times the CUDA driver's virtual memory calls of the process
// that loads it, for PyTorch's side of scripts/paired_replays.py: allocd
// times its own calls (`vmm` in `allocd bench --json`), PyTorch times none.
//
// PyTorch reaches the driver through entry points that the CUDA runtime
// looks up for it (c10/cuda/driver_api.cpp: cudaGetDriverEntryPointByVersion,
// or cudaGetDriverEntryPoint before CUDA 12.5), not through symbols it links
// against. This library defines those two lookups: loaded with RTLD_GLOBAL
// before torch (paired_replays.py --vmm-timer), its definitions come first in
// the global scope, so PyTorch's lookups reach them; each forwards to the
// runtime's own (the next definition, dlsym RTLD_NEXT) and, for cuMemCreate,
// cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease, hands back a
// wrapper that counts the call and adds its time (CLOCK_MONOTONIC around the
// driver's function) before returning the driver's result unchanged. Every
// other lookup is answered as the runtime answers it.
//
// vmm_timer_read copies the totals so far; a caller takes the difference
// around what it measures. vmm_timer_hooked says how many of the five
// functions were handed out wrapped: 0 after a replay means PyTorch found
// the driver some other way and nothing was counted.
//
// A plain C library without CUDA's headers (the few types it needs are
// integers and pointers), built with `cc -O2 -shared -fPIC ... -ldl`.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <string.h>
#include <time.h>

enum { CREATE, MAP, ACCESS, UNMAP, RELEASE, NCALLS };

static const char *const names[NCALLS] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"};
static void *real[NCALLS];
static long long counts[NCALLS], nanos[NCALLS];
static int hooked;

static long long now(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void add(int k, long long t0) {
	__atomic_fetch_add(&nanos[k], now() - t0, __ATOMIC_RELAXED);
	__atomic_fetch_add(&counts[k], 1, __ATOMIC_RELAXED);
}

typedef unsigned long long u64;

static int w_create(u64 *h, size_t size, const void *prop, u64 flags) {
	long long t0 = now();
	int r = ((int (*)(u64 *, size_t, const void *, u64))real[CREATE])(h, size, prop, flags);
	add(CREATE, t0);
	return r;
}

static int w_map(u64 ptr, size_t size, size_t offset, u64 h, u64 flags) {
	long long t0 = now();
	int r = ((int (*)(u64, size_t, size_t, u64, u64))real[MAP])(ptr, size, offset, h, flags);
	add(MAP, t0);
	return r;
}

static int w_access(u64 ptr, size_t size, const void *desc, size_t count) {
	long long t0 = now();
	int r = ((int (*)(u64, size_t, const void *, size_t))real[ACCESS])(ptr, size, desc, count);
	add(ACCESS, t0);
	return r;
}

static int w_unmap(u64 ptr, size_t size) {
	long long t0 = now();
	int r = ((int (*)(u64, size_t))real[UNMAP])(ptr, size);
	add(UNMAP, t0);
	return r;
}

static int w_release(u64 h) {
	long long t0 = now();
	int r = ((int (*)(u64))real[RELEASE])(h);
	add(RELEASE, t0);
	return r;
}

static void *const wrappers[NCALLS] = {(void *)w_create, (void *)w_map, (void *)w_access, (void *)w_unmap, (void *)w_release};

// wrap replaces *fn, the driver's function called symbol, by its wrapper
// when it is one of the five.
static void wrap(const char *symbol, void **fn) {
	if (symbol == NULL || fn == NULL || *fn == NULL) {
		return;
	}
	for (int k = 0; k < NCALLS; k++) {
		if (strcmp(symbol, names[k]) == 0) {
			if (*fn != wrappers[k]) {
				real[k] = *fn;
				*fn = wrappers[k];
				__atomic_fetch_add(&hooked, 1, __ATOMIC_RELAXED);
			}
			return;
		}
	}
}

// runtimeLib is the path of a loaded CUDA runtime library, found by
// findRuntime.
static const char *runtimeLib;

static int findRuntime(struct dl_phdr_info *info, size_t size, void *data) {
	(void)size;
	(void)data;
	if (info->dlpi_name != NULL && strstr(info->dlpi_name, "libcudart") != NULL) {
		runtimeLib = info->dlpi_name;
		return 1;
	}
	return 0;
}

// runtime returns the CUDA runtime's own definition of symbol, not self:
// the next one in the global scope, where torch's loader puts the runtime;
// else the one in a loaded library named libcudart*, when the runtime was
// loaded into a local scope. NULL when there is none.
static void *runtime(const char *symbol, void *self) {
	void *f = dlsym(RTLD_NEXT, symbol);
	if (f != NULL && f != self) {
		return f;
	}
	runtimeLib = NULL;
	dl_iterate_phdr(findRuntime, NULL);
	if (runtimeLib == NULL) {
		return NULL;
	}
	void *h = dlopen(runtimeLib, RTLD_LAZY | RTLD_NOLOAD);
	if (h == NULL) {
		return NULL;
	}
	f = dlsym(h, symbol);
	dlclose(h);
	return f != self ? f : NULL;
}

// The runtime's two lookups (cudaError_t is an int, the query result an
// enum, passed by pointer).
typedef int (*by_version_fn)(const char *, void **, unsigned int, unsigned long long, int *);
typedef int (*entry_point_fn)(const char *, void **, unsigned long long, int *);

int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags, int *status) {
	by_version_fn next = (by_version_fn)runtime("cudaGetDriverEntryPointByVersion", (void *)cudaGetDriverEntryPointByVersion);
	if (next == NULL) {
		return 1; // cudaErrorInvalidValue: no runtime behind this library
	}
	int r = next(symbol, fn, version, flags, status);
	if (r == 0) {
		wrap(symbol, fn);
	}
	return r;
}

int cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags, int *status) {
	entry_point_fn next = (entry_point_fn)runtime("cudaGetDriverEntryPoint", (void *)cudaGetDriverEntryPoint);
	if (next == NULL) {
		return 1;
	}
	int r = next(symbol, fn, flags, status);
	if (r == 0) {
		wrap(symbol, fn);
	}
	return r;
}

// vmm_timer_read writes the five calls' counts to out[0..4] and their
// nanoseconds to out[5..9], in the order create, map, set access, unmap,
// release.
void vmm_timer_read(long long *out) {
	for (int k = 0; k < NCALLS; k++) {
		out[k] = __atomic_load_n(&counts[k], __ATOMIC_RELAXED);
		out[NCALLS + k] = __atomic_load_n(&nanos[k], __ATOMIC_RELAXED);
	}
}

// vmm_timer_hooked returns how many lookups of the five were answered
// with a wrapper.
int vmm_timer_hooked(void) { return __atomic_load_n(&hooked, __ATOMIC_RELAXED); }
