//go:build cgo

// shim.h: the C side of cudart's real CUDA backend (see cuda.go).
//
// Nothing here includes a CUDA header. shim.c declares the few CUDA types it
// needs by hand and reaches libcudart / libcuda through function pointers
// resolved with dlsym, so building needs gcc and libc only.
//
// Every allocd_* call that touches a device takes the device ordinal and
// makes that device current on the calling OS thread inside the same call,
// so a goroutine that migrates between threads between two calls is still
// correct. Every call returns an allocd_status by value: code 0 is success;
// otherwise it names the CUDA call that failed and carries the library's
// name and description of the error (static strings owned by the library).
// A call that switched the thread's current device switches it back before
// returning (see DEVICE_GUARD in shim.c), so callers such as PyTorch, which
// keep their own idea of the current device, see it unchanged.
//
// Symbol hygiene: every function here has hidden visibility, so a shared
// library built from this package (cmd/liballocd's c-shared build) does not
// export allocd_malloc and friends next to its own API. Definitions in
// shim.c inherit the visibility of these declarations.

#ifndef ALLOCD_SHIM_H
#define ALLOCD_SHIM_H

#include <stddef.h>
#include <stdint.h>

#pragma GCC visibility push(hidden)

typedef struct {
	int code;         // cudaError_t or CUresult; 0 is success
	int driver;       // 1 when code is a CUresult from libcuda
	const char *op;   // the CUDA call that failed (static string)
	const char *name; // cudaGetErrorName / cuGetErrorName, or NULL
	const char *text; // cudaGetErrorString / cuGetErrorString, or NULL
} allocd_status;

typedef struct {
	char name[256];
	unsigned char uuid[16];    // cuDeviceGetUuid_v2 (MIG instance aware)
	unsigned char uuid_v1[16]; // cuDeviceGetUuid (the physical GPU)
	int has_uuid_v1;
	unsigned long long total;       // cuDeviceTotalMem_v2
	int vmm;                        // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
	int pools;                      // CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED
	unsigned long long granularity; // minimum VMM granularity, 0 without VMM
	int share;                      // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, and
	                                // libcuda has cuMemExportToShareableHandle and cuMemImportFromShareableHandle
} allocd_info;

// Loading (called once per process, under a Go sync.Once).
void *allocd_dlopen(const char *path, char *err, size_t errlen);
const char *allocd_dlpath(void *handle);
int allocd_bind(void *cudart, void *cuda, char *missing, size_t missinglen);
void allocd_dlclose(void *handle);

// Process-wide queries.
allocd_status allocd_versions(int *runtime, int *driver);
allocd_status allocd_device_count(int *n);
void allocd_error_name(int driver, int code, const char **name, const char **text);

// Per device.
allocd_status allocd_open(int dev, allocd_info *info);
allocd_status allocd_malloc(int dev, size_t size, unsigned long long *ptr);
allocd_status allocd_free(int dev, unsigned long long ptr);
allocd_status allocd_mem_get_info(int dev, size_t *free_bytes, size_t *total_bytes);
allocd_status allocd_device_synchronize(int dev);
allocd_status allocd_memset(int dev, unsigned long long ptr, int value, size_t n);
allocd_status allocd_memset_async(int dev, unsigned long long ptr, int value, size_t n, uintptr_t stream);
allocd_status allocd_memcpy_htod(int dev, unsigned long long dst, const void *src, size_t n);
allocd_status allocd_memcpy_dtoh(int dev, void *dst, unsigned long long src, size_t n);

allocd_status allocd_host_alloc(int dev, size_t size, unsigned int flags, void **ptr);
allocd_status allocd_free_host(int dev, void *ptr);
allocd_status allocd_memcpy_htod_async(int dev, unsigned long long dst, const void *src, size_t n, uintptr_t stream);
allocd_status allocd_memcpy_dtoh_async(int dev, void *dst, unsigned long long src, size_t n, uintptr_t stream);
allocd_status allocd_memcpy_dtod_async(int dev, unsigned long long dst, unsigned long long src, size_t n, uintptr_t stream);

allocd_status allocd_stream_create(int dev, uintptr_t *stream);
allocd_status allocd_stream_destroy(int dev, uintptr_t stream);
allocd_status allocd_stream_synchronize(int dev, uintptr_t stream);
allocd_status allocd_stream_check(int dev, uintptr_t stream);

allocd_status allocd_event_create(int dev, uintptr_t *event);
allocd_status allocd_event_record(int dev, uintptr_t event, uintptr_t stream);
allocd_status allocd_event_query(int dev, uintptr_t event, int *done);
allocd_status allocd_event_synchronize(int dev, uintptr_t event);
allocd_status allocd_stream_wait_event(int dev, uintptr_t stream, uintptr_t event);
allocd_status allocd_event_destroy(int dev, uintptr_t event);

allocd_status allocd_malloc_async(int dev, size_t size, uintptr_t stream, unsigned long long *ptr);
allocd_status allocd_free_async(int dev, unsigned long long ptr, uintptr_t stream);
allocd_status allocd_trim_pool(int dev);
allocd_status allocd_pool_usage(int dev, unsigned long long *reserved, unsigned long long *used);

allocd_status allocd_vmm_reserve(int dev, size_t size, unsigned long long *ptr);
allocd_status allocd_vmm_address_free(int dev, unsigned long long ptr, size_t size);
allocd_status allocd_vmm_create(int dev, size_t size, unsigned long long *handle);
allocd_status allocd_vmm_release(int dev, unsigned long long handle);
allocd_status allocd_vmm_map(int dev, unsigned long long ptr, size_t size, unsigned long long handle);
allocd_status allocd_vmm_map_range(int dev, unsigned long long ptr, size_t page, const unsigned long long *handles, int n);
allocd_status allocd_vmm_unmap(int dev, unsigned long long ptr, size_t size);

// Physical memory shared between processes as POSIX file descriptors
// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). The export and import calls
// are optional symbols: without them these return CUDA_ERROR_NOT_SUPPORTED.
// allocd_vmm_export's descriptor is close-on-exec and the caller's;
// allocd_vmm_import does not consume fd.
allocd_status allocd_vmm_create_shareable(int dev, size_t size, unsigned long long *handle);
allocd_status allocd_vmm_export(int dev, unsigned long long handle, int *fd);
allocd_status allocd_vmm_import(int dev, int fd, unsigned long long *handle);

// ABI assumptions: the sizes, offsets and enum values shim.c was written
// against, as name=value pairs (same names as abicheck/abicheck.c prints).
// Returns the number of entries; fills at most cap of them.
int allocd_abi(const char **names, long long *values, int cap);

// Test hooks: the calling thread's current device (cudaGetDevice, -1 on
// error) and cudaSetDevice; 0 on success.
int allocd_current_device(void);
int allocd_set_current_device(int dev);

#pragma GCC visibility pop

#endif
