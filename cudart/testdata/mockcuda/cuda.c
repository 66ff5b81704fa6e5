// A stand-in for libcuda.so.1, for cudart's TestShimAgainstMockCUDA.
// Physical allocations are memfds; mapping one maps the memfd at the
// reserved address, and cuMemSetAccess makes it readable and writable, so
// the virtual-memory round trip moves real bytes. It checks the fields of
// CUmemAllocationProp and CUmemAccessDesc that cudart's shim fills in.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct { int type; int id; } loc;
typedef struct {
	int type, handleTypes;
	loc location;
	void *win32;
	unsigned char compression, rdma;
	unsigned short usage;
	unsigned char reserved[4];
} prop;
typedef struct { loc location; int flags; } access_desc;

#define GRAN (2u << 20)
#define NDEV 2 // as cudart.c


int cuInit(unsigned f) { return f == 0 ? 0 : 1; }
int cuDeviceGet(int *d, int o) { if (o < 0 || o >= NDEV) return 101; *d = o; return 0; }
// Every device's primary context counts as active: the device guard of
// cudart's shim then always restores the previous device.
int cuDevicePrimaryCtxGetState(int d, unsigned *flags, int *active) {
	if (d < 0 || d >= NDEV) return 101;
	*flags = 0;
	*active = 1;
	return 0;
}
int cuDeviceGetName(char *n, int len, int d) { (void)d; snprintf(n, len, "Mock GPU"); return 0; }
int cuDeviceGetUuid_v2(char *u, int d) { (void)d; for (int i = 0; i < 16; i++) u[i] = (char)(0x10 + i); return 0; }
int cuDeviceGetUuid(char *u, int d) { return cuDeviceGetUuid_v2(u, d); }
int cuDeviceTotalMem_v2(size_t *b, int d) { (void)d; *b = 2000ull << 20; return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) { (void)d; *v = (a == 102 || a == 115); return 0; }
static int prop_ok(const prop *p) {
	return p->type == 1 && p->handleTypes == 0 && p->location.type == 1 && p->location.id >= 0 && p->location.id < NDEV && p->win32 == NULL;
}
int cuMemGetAllocationGranularity(size_t *g, const prop *p, int o) {
	if (!prop_ok(p) || o != 0) return 1;
	*g = GRAN;
	return 0;
}
int cuMemAddressReserve(unsigned long long *p, size_t sz, size_t al, unsigned long long a, unsigned long long f) {
	if (al || a || f || sz % GRAN) return 1;
	void *m = mmap(NULL, sz + GRAN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (m == MAP_FAILED) return 2;
	*p = ((uintptr_t)m + GRAN - 1) & ~(uintptr_t)(GRAN - 1);
	return 0;
}
int cuMemAddressFree(unsigned long long p, size_t sz) { (void)p; (void)sz; return 0; }
int cuMemCreate(unsigned long long *h, size_t sz, const prop *p, unsigned long long f) {
	if (f || !prop_ok(p) || sz % GRAN) return 1;
	if (sz > (1ull << 40)) return 2;
	int fd = memfd_create("mockcuda", 0);
	if (fd < 0 || ftruncate(fd, (off_t)sz) != 0) return 2;
	*h = (unsigned long long)fd + 1000;
	return 0;
}
int cuMemRelease(unsigned long long h) { return close((int)(h - 1000)) == 0 ? 0 : 400; }
int cuMemMap(unsigned long long p, size_t sz, size_t off, unsigned long long h, unsigned long long f) {
	if (f || off) return 1;
	void *m = mmap((void *)(uintptr_t)p, sz, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)(h - 1000), 0);
	return m == MAP_FAILED ? 1 : 0;
}
int cuMemUnmap(unsigned long long p, size_t sz) {
	void *m = mmap((void *)(uintptr_t)p, sz, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
	return m == MAP_FAILED ? 1 : 0;
}
int cuMemSetAccess(unsigned long long p, size_t sz, const access_desc *d, size_t n) {
	if (n != 1 || d->location.type != 1 || d->location.id < 0 || d->location.id >= NDEV || d->flags != 3) return 1;
	return mprotect((void *)(uintptr_t)p, sz, PROT_READ | PROT_WRITE) ? 1 : 0;
}
int cuGetErrorName(int e, const char **s) {
	switch (e) {
	case 1: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
	case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
	}
	*s = NULL;
	return 1;
}
int cuGetErrorString(int e, const char **s) {
	if (e == 2) { *s = "out of memory"; return 0; }
	*s = NULL;
	return 1;
}
