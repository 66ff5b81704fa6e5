// A stand-in for libcudart, for cudart's TestShimAgainstMockCUDA: host
// memory plays device memory, two devices (ordinals 0 and 1, sharing one
// pool; the second lets TestDeviceRestored switch devices), streams and events
// are heap objects with a magic number. An event reports cudaErrorNotReady
// once after each record, so the not-ready path is exercised. Memsets over
// 16 MiB do nothing, so the tests' large buffers cost only address space.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static __thread int cur = 0, last = 0;
static int fail(int e) { last = e; return e; }

#define NDEV 2
int cudaSetDevice(int d) { if (d < 0 || d >= NDEV) return fail(101); cur = d; return 0; }
int cudaGetDevice(int *d) { *d = cur; return 0; }
int cudaGetDeviceCount(int *n) { *n = NDEV; return 0; }
int cudaMemGetInfo(size_t *f, size_t *t) { *f = 1000ull << 20; *t = 2000ull << 20; return 0; }
int cudaMalloc(void **p, size_t n) {
	if (n > (1ull << 40)) return fail(2);
	*p = aligned_alloc(512, (n + 511) / 512 * 512);
	return *p ? 0 : fail(2);
}
int cudaFree(void *p) { free(p); return 0; }

// The pool: each async allocation carries its size in a 512-byte header;
// freed memory stays reserved until cudaMemPoolTrimTo.
static uint64_t pool_reserved, pool_used;
int cudaMallocAsync(void **p, size_t n, void *s) {
	(void)s;
	void *b = NULL;
	int e = cudaMalloc(&b, n + 512);
	if (e != 0) return e;
	*(size_t *)b = n;
	__atomic_add_fetch(&pool_used, n, __ATOMIC_SEQ_CST);
	if (__atomic_load_n(&pool_reserved, __ATOMIC_SEQ_CST) < __atomic_load_n(&pool_used, __ATOMIC_SEQ_CST))
		__atomic_store_n(&pool_reserved, __atomic_load_n(&pool_used, __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST);
	*p = (char *)b + 512;
	return 0;
}
int cudaFreeAsync(void *p, void *s) {
	(void)s;
	char *b = (char *)p - 512;
	__atomic_sub_fetch(&pool_used, *(size_t *)b, __ATOMIC_SEQ_CST);
	free(b);
	return 0;
}

static int pool;
int cudaDeviceGetDefaultMemPool(void **pl, int d) { (void)d; *pl = &pool; return 0; }
int cudaMemPoolSetAttribute(void *pl, int a, void *v) {
	// cudart sets cudaMemPoolAttrReleaseThreshold (4) to UINT64_MAX.
	return (pl == &pool && a == 4 && *(uint64_t *)v == UINT64_MAX) ? 0 : fail(1);
}
int cudaMemPoolGetAttribute(void *pl, int a, void *v) {
	if (pl != &pool) return fail(1);
	switch (a) {
	case 5: *(uint64_t *)v = __atomic_load_n(&pool_reserved, __ATOMIC_SEQ_CST); return 0; // ReservedMemCurrent
	case 7: *(uint64_t *)v = __atomic_load_n(&pool_used, __ATOMIC_SEQ_CST); return 0;     // UsedMemCurrent
	}
	return fail(1);
}
int cudaMemPoolTrimTo(void *pl, size_t k) {
	if (pl != &pool) return fail(1);
	uint64_t u = __atomic_load_n(&pool_used, __ATOMIC_SEQ_CST);
	__atomic_store_n(&pool_reserved, u > k ? u : k < pool_reserved ? k : pool_reserved, __ATOMIC_SEQ_CST);
	return 0;
}

int cudaMemset(void *p, int v, size_t n) { if (n <= (16u << 20)) memset(p, v, n); return 0; }
int cudaMemsetAsync(void *p, int v, size_t n, void *s) { (void)s; return cudaMemset(p, v, n); }
int cudaMemcpy(void *d, const void *s, size_t n, int k) {
	if (k != 1 && k != 2) return fail(21); // HostToDevice, DeviceToHost
	memcpy(d, s, n);
	return 0;
}
int cudaMemcpyAsync(void *d, const void *s, size_t n, int k, void *st) {
	(void)st;
	if (k != 1 && k != 2 && k != 3) return fail(21); // HostToDevice, DeviceToHost, DeviceToDevice
	memcpy(d, s, n);
	return 0;
}
// Host memory: flags other than portable|mapped|write-combined are refused.
int cudaHostAlloc(void **p, size_t n, unsigned f) {
	if (f & ~7u) return fail(1);
	if (n > (1ull << 40)) return fail(2);
	*p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
	return *p ? 0 : fail(2);
}
int cudaFreeHost(void *p) { free(p); return 0; }

#define MAGIC 0x5354524dU
typedef struct { unsigned magic; unsigned flags; int pending; } obj;
static int live(void *o) { return o != NULL && ((obj *)o)->magic == MAGIC; }
static int stream_ok(void *s) { return (uintptr_t)s <= 2 || live(s); }

int cudaStreamCreateWithFlags(void **s, unsigned f) {
	if (f != 1) return fail(1); // cudaStreamNonBlocking
	obj *o = calloc(1, sizeof *o);
	o->magic = MAGIC;
	*s = o;
	return 0;
}
int cudaStreamDestroy(void *s) { if ((uintptr_t)s <= 2 || !live(s)) return fail(400); ((obj *)s)->magic = 0; free(s); return 0; }
int cudaStreamSynchronize(void *s) { return stream_ok(s) ? 0 : fail(400); }
int cudaStreamQuery(void *s) { return stream_ok(s) ? 0 : fail(400); }
int cudaEventCreateWithFlags(void **e, unsigned f) {
	if (f != 2) return fail(1); // cudaEventDisableTiming
	obj *o = calloc(1, sizeof *o);
	o->magic = MAGIC;
	*e = o;
	return 0;
}
int cudaEventRecord(void *e, void *s) { if (!live(e) || !stream_ok(s)) return fail(400); ((obj *)e)->pending = 1; return 0; }
int cudaEventQuery(void *e) {
	if (!live(e)) return fail(400);
	if (((obj *)e)->pending) { ((obj *)e)->pending = 0; return fail(600); }
	return 0;
}
// The mock's work completes at once: a stream that waits for an event
// finds it complete.
int cudaStreamWaitEvent(void *s, void *e, unsigned f) {
	if (f != 0) return fail(1);
	if (!live(e) || !stream_ok(s)) return fail(400);
	((obj *)e)->pending = 0;
	return 0;
}
int cudaEventSynchronize(void *e) { if (!live(e)) return fail(400); ((obj *)e)->pending = 0; return 0; }
int cudaEventDestroy(void *e) { if (!live(e)) return fail(400); ((obj *)e)->magic = 0; free(e); return 0; }
int cudaDeviceSynchronize(void) { return 0; }

const char *cudaGetErrorName(int e) {
	switch (e) {
	case 0: return "cudaSuccess";
	case 1: return "cudaErrorInvalidValue";
	case 2: return "cudaErrorMemoryAllocation";
	case 101: return "cudaErrorInvalidDevice";
	case 400: return "cudaErrorInvalidResourceHandle";
	case 600: return "cudaErrorNotReady";
	}
	return "unrecognized error code";
}
const char *cudaGetErrorString(int e) {
	switch (e) {
	case 2: return "out of memory";
	case 101: return "invalid device ordinal";
	case 400: return "invalid resource handle";
	}
	return "unrecognized error code";
}
int cudaGetLastError(void) { int e = last; last = 0; return e; }
int cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }
int cudaDriverGetVersion(int *v) { *v = 13000; return 0; }
