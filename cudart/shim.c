//go:build cgo

// shim.c: cudart's C side. See shim.h for the contract and cuda.go for the
// design. No CUDA header is included: the types below are written by hand
// from cuda.h / driver_types.h (CUDA 12 and 13), and abicheck/abicheck.c
// checks them against the real headers where those exist.

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "shim.h"

// ---- Hand-written CUDA types -------------------------------------------

typedef int cudaError_t;  // enum cudaError
typedef int CUresult;     // enum cudaError_enum
typedef int CUdevice;     // CUdevice_v1
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
typedef void *cudaMemPool_t;
typedef unsigned long long CUdeviceptr;                  // CUdeviceptr_v2 (64-bit)
typedef unsigned long long CUmemGenericAllocationHandle; // CUmemGenericAllocationHandle_v1

typedef struct {
	char bytes[16];
} CUuuid;

typedef struct {
	int type; // CUmemLocationType
	int id;
} CUmemLocation;

typedef struct {
	int type;                 // CUmemAllocationType
	int requestedHandleTypes; // CUmemAllocationHandleType
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

typedef struct {
	CUmemLocation location;
	int flags; // CUmemAccess_flags
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation is 8 bytes");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "win32HandleMetaData at 16");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "allocFlags at 24");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");

// Enum values (driver_types.h, cuda.h).
#define cudaSuccess 0
#define cudaErrorInvalidResourceHandle 400
#define cudaErrorNotReady 600
#define cudaMemcpyHostToDevice 1
#define cudaMemcpyDeviceToHost 2
#define cudaMemcpyDeviceToDevice 3
#define cudaHostAllocPortable 0x01
#define cudaHostAllocMapped 0x02
#define cudaHostAllocWriteCombined 0x04
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02
#define cudaMemPoolAttrReleaseThreshold 0x4
#define cudaMemPoolAttrReservedMemCurrent 0x5
#define cudaMemPoolAttrUsedMemCurrent 0x7
#define CUDA_SUCCESS 0
#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_HANDLE_TYPE_NONE 0x0
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED 115
#define CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103
#define CUDA_ERROR_NOT_SUPPORTED 801

// ---- Function tables ---------------------------------------------------

static struct {
	cudaError_t (*SetDevice)(int);
	cudaError_t (*GetDevice)(int *);
	cudaError_t (*GetDeviceCount)(int *);
	cudaError_t (*MemGetInfo)(size_t *, size_t *);
	cudaError_t (*Malloc)(void **, size_t);
	cudaError_t (*Free)(void *);
	cudaError_t (*MallocAsync)(void **, size_t, cudaStream_t);
	cudaError_t (*FreeAsync)(void *, cudaStream_t);
	cudaError_t (*DeviceGetDefaultMemPool)(cudaMemPool_t *, int);
	cudaError_t (*MemPoolSetAttribute)(cudaMemPool_t, int, void *);
	cudaError_t (*MemPoolGetAttribute)(cudaMemPool_t, int, void *);
	cudaError_t (*MemPoolTrimTo)(cudaMemPool_t, size_t);
	cudaError_t (*Memset)(void *, int, size_t);
	cudaError_t (*MemsetAsync)(void *, int, size_t, cudaStream_t);
	cudaError_t (*Memcpy)(void *, const void *, size_t, int);
	cudaError_t (*MemcpyAsync)(void *, const void *, size_t, int, cudaStream_t);
	cudaError_t (*HostAlloc)(void **, size_t, unsigned int);
	cudaError_t (*FreeHost)(void *);
	cudaError_t (*StreamCreateWithFlags)(cudaStream_t *, unsigned int);
	cudaError_t (*StreamDestroy)(cudaStream_t);
	cudaError_t (*StreamSynchronize)(cudaStream_t);
	cudaError_t (*StreamQuery)(cudaStream_t);
	cudaError_t (*EventCreateWithFlags)(cudaEvent_t *, unsigned int);
	cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t);
	cudaError_t (*EventQuery)(cudaEvent_t);
	cudaError_t (*EventSynchronize)(cudaEvent_t);
	cudaError_t (*EventDestroy)(cudaEvent_t);
	cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned int);
	cudaError_t (*DeviceSynchronize)(void);
	const char *(*GetErrorName)(cudaError_t);
	const char *(*GetErrorString)(cudaError_t);
	cudaError_t (*GetLastError)(void);
	cudaError_t (*RuntimeGetVersion)(int *);
	cudaError_t (*DriverGetVersion)(int *);
} rt;

static struct {
	CUresult (*Init)(unsigned int);
	CUresult (*DeviceGet)(CUdevice *, int);
	CUresult (*DeviceGetName)(char *, int, CUdevice);
	CUresult (*DeviceGetUuid_v2)(CUuuid *, CUdevice); // optional
	CUresult (*DeviceGetUuid)(CUuuid *, CUdevice);    // optional
	CUresult (*DeviceTotalMem_v2)(size_t *, CUdevice);
	CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
	CUresult (*DevicePrimaryCtxGetState)(CUdevice, unsigned int *, int *);
	CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
	CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*MemAddressFree)(CUdeviceptr, size_t);
	CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
	CUresult (*MemRelease)(CUmemGenericAllocationHandle);
	CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
	CUresult (*MemUnmap)(CUdeviceptr, size_t);
	CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	// optional: sharing physical memory between processes
	CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
	CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
	CUresult (*GetErrorName)(CUresult, const char **);
	CUresult (*GetErrorString)(CUresult, const char **);
} drv;

// ---- Loading -----------------------------------------------------------

void *allocd_dlopen(const char *path, char *err, size_t errlen) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (h == NULL && err != NULL && errlen > 0) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e != NULL ? e : "dlopen failed");
	}
	return h;
}

const char *allocd_dlpath(void *handle) {
	struct link_map *lm = NULL;
	if (handle == NULL || dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || lm == NULL) {
		return NULL;
	}
	return lm->l_name;
}

void allocd_dlclose(void *handle) {
	if (handle != NULL) {
		dlclose(handle);
	}
}

static void add_missing(char *missing, size_t len, const char *sym) {
	size_t used = strlen(missing);
	if (used + 2 >= len) {
		return;
	}
	snprintf(missing + used, len - used, "%s%s", used ? ", " : "", sym);
}

#define BIND(h, table, field, sym)                      \
	do {                                                \
		*(void **)(&table.field) = dlsym(h, sym);       \
		if (table.field == NULL) {                      \
			add_missing(missing, missinglen, sym);      \
			bad = 1;                                    \
		}                                               \
	} while (0)

int allocd_bind(void *cudart, void *cuda, char *missing, size_t missinglen) {
	int bad = 0;
	if (missinglen > 0) {
		missing[0] = '\0';
	}
	BIND(cudart, rt, SetDevice, "cudaSetDevice");
	BIND(cudart, rt, GetDevice, "cudaGetDevice");
	BIND(cudart, rt, GetDeviceCount, "cudaGetDeviceCount");
	BIND(cudart, rt, MemGetInfo, "cudaMemGetInfo");
	BIND(cudart, rt, Malloc, "cudaMalloc");
	BIND(cudart, rt, Free, "cudaFree");
	BIND(cudart, rt, MallocAsync, "cudaMallocAsync");
	BIND(cudart, rt, FreeAsync, "cudaFreeAsync");
	BIND(cudart, rt, DeviceGetDefaultMemPool, "cudaDeviceGetDefaultMemPool");
	BIND(cudart, rt, MemPoolSetAttribute, "cudaMemPoolSetAttribute");
	BIND(cudart, rt, MemPoolGetAttribute, "cudaMemPoolGetAttribute");
	BIND(cudart, rt, MemPoolTrimTo, "cudaMemPoolTrimTo");
	BIND(cudart, rt, Memset, "cudaMemset");
	BIND(cudart, rt, MemsetAsync, "cudaMemsetAsync");
	BIND(cudart, rt, Memcpy, "cudaMemcpy");
	BIND(cudart, rt, MemcpyAsync, "cudaMemcpyAsync");
	BIND(cudart, rt, HostAlloc, "cudaHostAlloc");
	BIND(cudart, rt, FreeHost, "cudaFreeHost");
	BIND(cudart, rt, StreamCreateWithFlags, "cudaStreamCreateWithFlags");
	BIND(cudart, rt, StreamDestroy, "cudaStreamDestroy");
	BIND(cudart, rt, StreamSynchronize, "cudaStreamSynchronize");
	BIND(cudart, rt, StreamQuery, "cudaStreamQuery");
	BIND(cudart, rt, EventCreateWithFlags, "cudaEventCreateWithFlags");
	BIND(cudart, rt, EventRecord, "cudaEventRecord");
	BIND(cudart, rt, EventQuery, "cudaEventQuery");
	BIND(cudart, rt, EventSynchronize, "cudaEventSynchronize");
	BIND(cudart, rt, EventDestroy, "cudaEventDestroy");
	BIND(cudart, rt, StreamWaitEvent, "cudaStreamWaitEvent");
	BIND(cudart, rt, DeviceSynchronize, "cudaDeviceSynchronize");
	BIND(cudart, rt, GetErrorName, "cudaGetErrorName");
	BIND(cudart, rt, GetErrorString, "cudaGetErrorString");
	BIND(cudart, rt, GetLastError, "cudaGetLastError");
	BIND(cudart, rt, RuntimeGetVersion, "cudaRuntimeGetVersion");
	BIND(cudart, rt, DriverGetVersion, "cudaDriverGetVersion");

	BIND(cuda, drv, Init, "cuInit");
	BIND(cuda, drv, DeviceGet, "cuDeviceGet");
	BIND(cuda, drv, DeviceGetName, "cuDeviceGetName");
	BIND(cuda, drv, DeviceTotalMem_v2, "cuDeviceTotalMem_v2");
	BIND(cuda, drv, DeviceGetAttribute, "cuDeviceGetAttribute");
	BIND(cuda, drv, DevicePrimaryCtxGetState, "cuDevicePrimaryCtxGetState");
	BIND(cuda, drv, MemGetAllocationGranularity, "cuMemGetAllocationGranularity");
	BIND(cuda, drv, MemAddressReserve, "cuMemAddressReserve");
	BIND(cuda, drv, MemAddressFree, "cuMemAddressFree");
	BIND(cuda, drv, MemCreate, "cuMemCreate");
	BIND(cuda, drv, MemRelease, "cuMemRelease");
	BIND(cuda, drv, MemMap, "cuMemMap");
	BIND(cuda, drv, MemUnmap, "cuMemUnmap");
	BIND(cuda, drv, MemSetAccess, "cuMemSetAccess");
	BIND(cuda, drv, GetErrorName, "cuGetErrorName");
	BIND(cuda, drv, GetErrorString, "cuGetErrorString");
	// Either UUID entry point will do; _v2 (CUDA 11.4+) knows MIG instances.
	*(void **)(&drv.DeviceGetUuid_v2) = dlsym(cuda, "cuDeviceGetUuid_v2");
	*(void **)(&drv.DeviceGetUuid) = dlsym(cuda, "cuDeviceGetUuid");
	if (drv.DeviceGetUuid_v2 == NULL && drv.DeviceGetUuid == NULL) {
		add_missing(missing, missinglen, "cuDeviceGetUuid_v2 (or cuDeviceGetUuid)");
		bad = 1;
	}
	// Sharing memory between processes is optional: without these the
	// shareable calls report CUDA_ERROR_NOT_SUPPORTED.
	*(void **)(&drv.MemExportToShareableHandle) = dlsym(cuda, "cuMemExportToShareableHandle");
	*(void **)(&drv.MemImportFromShareableHandle) = dlsym(cuda, "cuMemImportFromShareableHandle");
	return bad ? -1 : 0;
}

// ---- Status helpers ----------------------------------------------------

static allocd_status ok_status(void) {
	allocd_status s;
	memset(&s, 0, sizeof s);
	return s;
}

// rt_fail builds the status for a failed runtime call and clears the
// runtime's per-thread "last error", as PyTorch does after an OOM, so that a
// handled error is not reported again by an unrelated later call. A sticky
// error cannot be cleared; cudaGetLastError leaves it in place.
static allocd_status rt_fail(cudaError_t e, const char *op) {
	allocd_status s;
	s.code = e;
	s.driver = 0;
	s.op = op;
	s.name = rt.GetErrorName(e);
	s.text = rt.GetErrorString(e);
	(void)rt.GetLastError();
	return s;
}

static allocd_status drv_fail(CUresult e, const char *op) {
	allocd_status s;
	s.code = e;
	s.driver = 1;
	s.op = op;
	s.name = NULL;
	s.text = NULL;
	if (drv.GetErrorName(e, &s.name) != CUDA_SUCCESS) {
		s.name = NULL;
	}
	if (drv.GetErrorString(e, &s.text) != CUDA_SUCCESS) {
		s.text = NULL;
	}
	return s;
}

static allocd_status synthetic(int code, const char *op, const char *text) {
	allocd_status s;
	s.code = code;
	s.driver = 0;
	s.op = op;
	s.name = NULL;
	s.text = text;
	return s;
}

#define RT(call, op)                       \
	do {                                   \
		cudaError_t e_ = (call);           \
		if (e_ != cudaSuccess) {           \
			return rt_fail(e_, op);        \
		}                                  \
	} while (0)

#define DRV(call, op)                      \
	do {                                   \
		CUresult e_ = (call);              \
		if (e_ != CUDA_SUCCESS) {          \
			return drv_fail(e_, op);       \
		}                                  \
	} while (0)

// ---- Device guard ------------------------------------------------------
//
// The caller's current device is its own state: PyTorch, for one, frees and
// records streams from threads whose current device is not the block's, and
// keeps using the thread afterwards. So every call that switches the device
// declares a guard (DEVICE_GUARD, through USE_DEVICE or DRIVER_DEVICE) that
// remembers the device it switched away from and, when the function returns
// by any path, makes that device current again: get, set, call, set back.
//
// As c10::cuda::MaybeSetDevice does for PyTorch's CUDAGuard, the way back
// calls cudaSetDevice only when the previous device's primary context is
// active (cuDevicePrimaryCtxGetState): on CUDA 12+ cudaSetDevice creates the
// context, and a thread that merely reported the default device 0 must not
// make this process take memory on a GPU it never used. In that case the
// thread is left on the device of the call.

static int primary_context_active(int dev) {
	CUdevice d = 0;
	unsigned int flags = 0;
	int active = 0;
	if (drv.DeviceGet == NULL || drv.DevicePrimaryCtxGetState == NULL || drv.DeviceGet(&d, dev) != CUDA_SUCCESS ||
	    drv.DevicePrimaryCtxGetState(d, &flags, &active) != CUDA_SUCCESS) {
		return 0;
	}
	return active;
}

static void restore_device(const int *prev) {
	if (*prev < 0 || !primary_context_active(*prev)) {
		return;
	}
	if (rt.SetDevice(*prev) != cudaSuccess) {
		(void)rt.GetLastError();
	}
}

// current_device is cudaGetDevice, or -1 (and the error cleared) on failure.
static int current_device(void) {
	int cur = -1;
	if (rt.GetDevice(&cur) != cudaSuccess) {
		(void)rt.GetLastError();
		return -1;
	}
	return cur;
}

#define DEVICE_GUARD int guard_prev_ __attribute__((cleanup(restore_device))) = -1

// USE_DEVICE makes dev the runtime's current device on this thread for the
// rest of the function, calling cudaSetDevice only when it is not already
// current, and restores the previous device on return. Runtime calls that
// follow initialise the primary context lazily if needed.
#define USE_DEVICE(dev)                                      \
	DEVICE_GUARD;                                            \
	do {                                                     \
		int cur_ = current_device();                         \
		if (cur_ != (dev)) {                                 \
			RT(rt.SetDevice(dev), "cudaSetDevice");          \
			guard_prev_ = cur_;                              \
		}                                                    \
	} while (0)

// DRIVER_DEVICE precedes driver (cu*) calls, which need a current context:
// cudaSetDevice (CUDA 12+) initialises dev's primary context and makes it
// current, so it is called unconditionally; cudaGetDevice alone would report
// device 0 on a fresh thread without any context being current. The previous
// device is restored on return, as for USE_DEVICE.
#define DRIVER_DEVICE(dev)                                   \
	DEVICE_GUARD;                                            \
	do {                                                     \
		int cur_ = current_device();                         \
		RT(rt.SetDevice(dev), "cudaSetDevice");              \
		if (cur_ != (dev)) {                                 \
			guard_prev_ = cur_;                              \
		}                                                    \
	} while (0)

int allocd_current_device(void) { return current_device(); }

int allocd_set_current_device(int dev) {
	if (rt.SetDevice(dev) != cudaSuccess) {
		(void)rt.GetLastError();
		return -1;
	}
	return 0;
}

// ---- Process-wide ------------------------------------------------------

allocd_status allocd_versions(int *runtime, int *driver) {
	RT(rt.RuntimeGetVersion(runtime), "cudaRuntimeGetVersion");
	RT(rt.DriverGetVersion(driver), "cudaDriverGetVersion");
	return ok_status();
}

allocd_status allocd_device_count(int *n) {
	*n = 0;
	RT(rt.GetDeviceCount(n), "cudaGetDeviceCount");
	return ok_status();
}

void allocd_error_name(int driver, int code, const char **name, const char **text) {
	*name = NULL;
	*text = NULL;
	if (driver) {
		if (drv.GetErrorName(code, name) != CUDA_SUCCESS) {
			*name = NULL;
		}
		if (drv.GetErrorString(code, text) != CUDA_SUCCESS) {
			*text = NULL;
		}
		return;
	}
	*name = rt.GetErrorName(code);
	*text = rt.GetErrorString(code);
}

// ---- Device ------------------------------------------------------------

static void device_prop(CUmemAllocationProp *prop, CUdevice d) {
	memset(prop, 0, sizeof *prop);
	prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE; // allocd_vmm_create_shareable asks for a type
	prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop->location.id = d;
}

allocd_status allocd_open(int dev, allocd_info *info) {
	CUdevice d = 0;
	memset(info, 0, sizeof *info);
	DRIVER_DEVICE(dev);
	DRV(drv.Init(0), "cuInit");
	DRV(drv.DeviceGet(&d, dev), "cuDeviceGet");
	DRV(drv.DeviceGetName(info->name, (int)sizeof info->name - 1, d), "cuDeviceGetName");
	CUuuid u;
	if (drv.DeviceGetUuid_v2 != NULL) {
		DRV(drv.DeviceGetUuid_v2(&u, d), "cuDeviceGetUuid_v2");
		memcpy(info->uuid, u.bytes, 16);
		if (drv.DeviceGetUuid != NULL && drv.DeviceGetUuid(&u, d) == CUDA_SUCCESS) {
			memcpy(info->uuid_v1, u.bytes, 16);
			info->has_uuid_v1 = 1;
		}
	} else {
		DRV(drv.DeviceGetUuid(&u, d), "cuDeviceGetUuid");
		memcpy(info->uuid, u.bytes, 16);
	}
	size_t total = 0;
	DRV(drv.DeviceTotalMem_v2(&total, d), "cuDeviceTotalMem_v2");
	info->total = total;
	DRV(drv.DeviceGetAttribute(&info->vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d),
	    "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)");
	DRV(drv.DeviceGetAttribute(&info->pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, d),
	    "cuDeviceGetAttribute(MEMORY_POOLS_SUPPORTED)");
	if (info->vmm) {
		CUmemAllocationProp prop;
		size_t g = 0;
		device_prop(&prop, d);
		DRV(drv.MemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
		    "cuMemGetAllocationGranularity");
		info->granularity = g;
		// Not fatal: a driver that cannot say cannot share.
		int fd_ok = 0;
		if (drv.MemExportToShareableHandle != NULL && drv.MemImportFromShareableHandle != NULL &&
		    drv.DeviceGetAttribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, d) == CUDA_SUCCESS) {
			info->share = fd_ok != 0;
		}
	}
	return ok_status();
}

allocd_status allocd_malloc(int dev, size_t size, unsigned long long *ptr) {
	void *p = NULL;
	USE_DEVICE(dev);
	RT(rt.Malloc(&p, size), "cudaMalloc");
	*ptr = (unsigned long long)(uintptr_t)p;
	return ok_status();
}

allocd_status allocd_free(int dev, unsigned long long ptr) {
	USE_DEVICE(dev);
	RT(rt.Free((void *)(uintptr_t)ptr), "cudaFree");
	return ok_status();
}

allocd_status allocd_mem_get_info(int dev, size_t *free_bytes, size_t *total_bytes) {
	USE_DEVICE(dev);
	RT(rt.MemGetInfo(free_bytes, total_bytes), "cudaMemGetInfo");
	return ok_status();
}

allocd_status allocd_device_synchronize(int dev) {
	USE_DEVICE(dev);
	RT(rt.DeviceSynchronize(), "cudaDeviceSynchronize");
	return ok_status();
}

allocd_status allocd_memset(int dev, unsigned long long ptr, int value, size_t n) {
	USE_DEVICE(dev);
	RT(rt.Memset((void *)(uintptr_t)ptr, value, n), "cudaMemset");
	return ok_status();
}

allocd_status allocd_memset_async(int dev, unsigned long long ptr, int value, size_t n, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.MemsetAsync((void *)(uintptr_t)ptr, value, n, (cudaStream_t)stream), "cudaMemsetAsync");
	return ok_status();
}

allocd_status allocd_memcpy_htod(int dev, unsigned long long dst, const void *src, size_t n) {
	USE_DEVICE(dev);
	RT(rt.Memcpy((void *)(uintptr_t)dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy(HostToDevice)");
	return ok_status();
}

allocd_status allocd_memcpy_dtoh(int dev, void *dst, unsigned long long src, size_t n) {
	USE_DEVICE(dev);
	RT(rt.Memcpy(dst, (const void *)(uintptr_t)src, n, cudaMemcpyDeviceToHost), "cudaMemcpy(DeviceToHost)");
	return ok_status();
}

// ---- Page-locked host memory and stream-ordered copies ------------------
//
// cudaHostAlloc memory belongs to the process, not to a device, but the call
// needs a context: the one of dev is made current, as for every other call,
// so that a process that only ever used device 1 does not create a context on
// device 0 for its host buffers. cudaFreeHost synchronises the device.

allocd_status allocd_host_alloc(int dev, size_t size, unsigned int flags, void **ptr) {
	void *p = NULL;
	USE_DEVICE(dev);
	RT(rt.HostAlloc(&p, size, flags), "cudaHostAlloc");
	*ptr = p;
	return ok_status();
}

allocd_status allocd_free_host(int dev, void *ptr) {
	USE_DEVICE(dev);
	RT(rt.FreeHost(ptr), "cudaFreeHost");
	return ok_status();
}

allocd_status allocd_memcpy_htod_async(int dev, unsigned long long dst, const void *src, size_t n, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.MemcpyAsync((void *)(uintptr_t)dst, src, n, cudaMemcpyHostToDevice, (cudaStream_t)stream),
	   "cudaMemcpyAsync(HostToDevice)");
	return ok_status();
}

allocd_status allocd_memcpy_dtoh_async(int dev, void *dst, unsigned long long src, size_t n, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.MemcpyAsync(dst, (const void *)(uintptr_t)src, n, cudaMemcpyDeviceToHost, (cudaStream_t)stream),
	   "cudaMemcpyAsync(DeviceToHost)");
	return ok_status();
}

allocd_status allocd_memcpy_dtod_async(int dev, unsigned long long dst, unsigned long long src, size_t n, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.MemcpyAsync((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, cudaMemcpyDeviceToDevice, (cudaStream_t)stream),
	   "cudaMemcpyAsync(DeviceToDevice)");
	return ok_status();
}

// ---- Streams and events ------------------------------------------------

allocd_status allocd_stream_create(int dev, uintptr_t *stream) {
	cudaStream_t s = NULL;
	USE_DEVICE(dev);
	RT(rt.StreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
	*stream = (uintptr_t)s;
	return ok_status();
}

allocd_status allocd_stream_destroy(int dev, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.StreamDestroy((cudaStream_t)stream), "cudaStreamDestroy");
	return ok_status();
}

allocd_status allocd_stream_synchronize(int dev, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.StreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize");
	return ok_status();
}

// readable reports whether 8 bytes at addr can be read by this process,
// without touching them: 1 yes, 0 no, -1 unknown (the syscall is refused).
static int readable(uintptr_t addr) {
	char buf[8];
	struct iovec local = {buf, sizeof buf};
	struct iovec remote = {(void *)addr, sizeof buf};
	ssize_t n = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
	if (n == (ssize_t)sizeof buf) {
		return 1;
	}
	if (n >= 0 || errno == EFAULT) {
		return 0;
	}
	return -1;
}

// allocd_stream_check asks cudaStreamQuery about a stream handle: success
// or cudaErrorNotReady mean the stream exists. A cudaStream_t is a pointer
// the runtime dereferences without validating it (CUDA 13.0 / driver 580
// segfaults on a destroyed stream or on garbage), so a handle that does not
// point to readable memory is refused here rather than handed to CUDA.
allocd_status allocd_stream_check(int dev, uintptr_t stream) {
	if (stream > 2 && readable(stream) == 0) {
		return synthetic(cudaErrorInvalidResourceHandle, "cudaStreamQuery",
		                 "invalid resource handle (the handle does not point to readable memory; not passed to CUDA)");
	}
	USE_DEVICE(dev);
	cudaError_t e = rt.StreamQuery((cudaStream_t)stream);
	if (e == cudaSuccess) {
		return ok_status();
	}
	if (e == cudaErrorNotReady) {
		(void)rt.GetLastError();
		return ok_status();
	}
	return rt_fail(e, "cudaStreamQuery");
}

allocd_status allocd_event_create(int dev, uintptr_t *event) {
	cudaEvent_t e = NULL;
	USE_DEVICE(dev);
	RT(rt.EventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
	*event = (uintptr_t)e;
	return ok_status();
}

allocd_status allocd_event_record(int dev, uintptr_t event, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.EventRecord((cudaEvent_t)event, (cudaStream_t)stream), "cudaEventRecord");
	return ok_status();
}

allocd_status allocd_event_query(int dev, uintptr_t event, int *done) {
	USE_DEVICE(dev);
	cudaError_t e = rt.EventQuery((cudaEvent_t)event);
	if (e == cudaSuccess) {
		*done = 1;
		return ok_status();
	}
	if (e == cudaErrorNotReady) {
		(void)rt.GetLastError();
		*done = 0;
		return ok_status();
	}
	*done = 0;
	return rt_fail(e, "cudaEventQuery");
}

allocd_status allocd_event_synchronize(int dev, uintptr_t event) {
	USE_DEVICE(dev);
	RT(rt.EventSynchronize((cudaEvent_t)event), "cudaEventSynchronize");
	return ok_status();
}

allocd_status allocd_stream_wait_event(int dev, uintptr_t stream, uintptr_t event) {
	USE_DEVICE(dev);
	RT(rt.StreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0), "cudaStreamWaitEvent");
	return ok_status();
}

allocd_status allocd_event_destroy(int dev, uintptr_t event) {
	USE_DEVICE(dev);
	RT(rt.EventDestroy((cudaEvent_t)event), "cudaEventDestroy");
	return ok_status();
}

// ---- Stream-ordered pool -----------------------------------------------

#define ALLOCD_MAX_DEVICES 4096
static int pool_ready[ALLOCD_MAX_DEVICES];

// allocd_malloc_async allocates from the device's current pool. The first
// call for a device sets the default pool's release threshold to UINT64_MAX
// (as PyTorch's cudaMallocAsync backend does) so that synchronising does not
// hand the pool's memory back to the system; TrimPool does that instead.
// Two threads racing here both set the same value, which is harmless.
allocd_status allocd_malloc_async(int dev, size_t size, uintptr_t stream, unsigned long long *ptr) {
	void *p = NULL;
	USE_DEVICE(dev);
	if (dev >= 0 && dev < ALLOCD_MAX_DEVICES && !__atomic_load_n(&pool_ready[dev], __ATOMIC_ACQUIRE)) {
		cudaMemPool_t pool = NULL;
		uint64_t threshold = UINT64_MAX;
		RT(rt.DeviceGetDefaultMemPool(&pool, dev), "cudaDeviceGetDefaultMemPool");
		RT(rt.MemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
		   "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)");
		__atomic_store_n(&pool_ready[dev], 1, __ATOMIC_RELEASE);
	}
	RT(rt.MallocAsync(&p, size, (cudaStream_t)stream), "cudaMallocAsync");
	*ptr = (unsigned long long)(uintptr_t)p;
	return ok_status();
}

allocd_status allocd_free_async(int dev, unsigned long long ptr, uintptr_t stream) {
	USE_DEVICE(dev);
	RT(rt.FreeAsync((void *)(uintptr_t)ptr, (cudaStream_t)stream), "cudaFreeAsync");
	return ok_status();
}

// allocd_trim_pool synchronises the device, so that every cudaFreeAsync has
// completed, then releases all unused memory of the default pool.
allocd_status allocd_trim_pool(int dev) {
	cudaMemPool_t pool = NULL;
	USE_DEVICE(dev);
	RT(rt.DeviceSynchronize(), "cudaDeviceSynchronize");
	RT(rt.DeviceGetDefaultMemPool(&pool, dev), "cudaDeviceGetDefaultMemPool");
	RT(rt.MemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
	return ok_status();
}

// allocd_pool_usage reads the default pool's reserved and used bytes
// (cudaMemPoolAttrReservedMemCurrent, cudaMemPoolAttrUsedMemCurrent).
allocd_status allocd_pool_usage(int dev, unsigned long long *reserved, unsigned long long *used) {
	cudaMemPool_t pool = NULL;
	uint64_t r = 0, u = 0;
	USE_DEVICE(dev);
	RT(rt.DeviceGetDefaultMemPool(&pool, dev), "cudaDeviceGetDefaultMemPool");
	RT(rt.MemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &r),
	   "cudaMemPoolGetAttribute(cudaMemPoolAttrReservedMemCurrent)");
	RT(rt.MemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &u),
	   "cudaMemPoolGetAttribute(cudaMemPoolAttrUsedMemCurrent)");
	*reserved = r;
	*used = u;
	return ok_status();
}

// ---- Virtual memory (driver API) ----------------------------------------

allocd_status allocd_vmm_reserve(int dev, size_t size, unsigned long long *ptr) {
	CUdeviceptr p = 0;
	DRIVER_DEVICE(dev);
	DRV(drv.MemAddressReserve(&p, size, 0, 0, 0), "cuMemAddressReserve");
	*ptr = p;
	return ok_status();
}

allocd_status allocd_vmm_address_free(int dev, unsigned long long ptr, size_t size) {
	DRIVER_DEVICE(dev);
	DRV(drv.MemAddressFree(ptr, size), "cuMemAddressFree");
	return ok_status();
}

// drv_missing is the status of a call to an optional driver entry point
// that libcuda lacks: CUDA_ERROR_NOT_SUPPORTED, from the driver.
static allocd_status drv_missing(const char *op) {
	allocd_status s = synthetic(CUDA_ERROR_NOT_SUPPORTED, op, "operation not supported (libcuda lacks this entry point)");
	s.driver = 1;
	return s;
}

// vmm_create is cuMemCreate of size bytes on dev, exportable as the
// handle types asked for (CU_MEM_HANDLE_TYPE_NONE: not exportable).
static allocd_status vmm_create(int dev, size_t size, int handle_types, unsigned long long *handle) {
	CUdevice d = 0;
	CUmemAllocationProp prop;
	CUmemGenericAllocationHandle h = 0;
	DRIVER_DEVICE(dev);
	DRV(drv.DeviceGet(&d, dev), "cuDeviceGet");
	device_prop(&prop, d);
	prop.requestedHandleTypes = handle_types;
	DRV(drv.MemCreate(&h, size, &prop, 0), "cuMemCreate");
	*handle = h;
	return ok_status();
}

allocd_status allocd_vmm_create(int dev, size_t size, unsigned long long *handle) {
	return vmm_create(dev, size, CU_MEM_HANDLE_TYPE_NONE, handle);
}

allocd_status allocd_vmm_create_shareable(int dev, size_t size, unsigned long long *handle) {
	return vmm_create(dev, size, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, handle);
}

// allocd_vmm_export returns a new descriptor for handle, made close-on-exec
// here (the driver does not promise it), so that it reaches another process
// only when the caller passes it on. A fork between the export and the
// fcntl can still inherit it.
allocd_status allocd_vmm_export(int dev, unsigned long long handle, int *fd) {
	int out = -1;
	*fd = -1;
	if (drv.MemExportToShareableHandle == NULL) {
		return drv_missing("cuMemExportToShareableHandle");
	}
	DRIVER_DEVICE(dev);
	DRV(drv.MemExportToShareableHandle(&out, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
	    "cuMemExportToShareableHandle");
	int flags = fcntl(out, F_GETFD);
	if (flags >= 0) {
		(void)fcntl(out, F_SETFD, flags | FD_CLOEXEC);
	}
	*fd = out;
	return ok_status();
}

// allocd_vmm_import returns a handle to the memory behind fd. The driver
// takes its own reference: fd stays the caller's to close.
allocd_status allocd_vmm_import(int dev, int fd, unsigned long long *handle) {
	CUmemGenericAllocationHandle h = 0;
	if (drv.MemImportFromShareableHandle == NULL) {
		return drv_missing("cuMemImportFromShareableHandle");
	}
	DRIVER_DEVICE(dev);
	DRV(drv.MemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
	    "cuMemImportFromShareableHandle");
	*handle = h;
	return ok_status();
}

allocd_status allocd_vmm_release(int dev, unsigned long long handle) {
	DRIVER_DEVICE(dev);
	DRV(drv.MemRelease(handle), "cuMemRelease");
	return ok_status();
}

// allocd_vmm_map maps handle at [ptr, ptr+size) and grants the device
// read/write access; if granting access fails the mapping is undone.
allocd_status allocd_vmm_map(int dev, unsigned long long ptr, size_t size, unsigned long long handle) {
	CUdevice d = 0;
	CUmemAccessDesc access;
	DRIVER_DEVICE(dev);
	DRV(drv.DeviceGet(&d, dev), "cuDeviceGet");
	DRV(drv.MemMap(ptr, size, 0, handle, 0), "cuMemMap");
	memset(&access, 0, sizeof access);
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = d;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	CUresult e = drv.MemSetAccess(ptr, size, &access, 1);
	if (e != CUDA_SUCCESS) {
		allocd_status s = drv_fail(e, "cuMemSetAccess");
		(void)drv.MemUnmap(ptr, size);
		return s;
	}
	return ok_status();
}

// allocd_vmm_map_range maps handles[i] at ptr + i*page for each i < n and
// then grants the device read/write access to the whole range in one call,
// as PyTorch's expandable segments do: one device switch and one access
// update for n pages instead of n of each. On failure every mapping it
// made is undone.
allocd_status allocd_vmm_map_range(int dev, unsigned long long ptr, size_t page, const unsigned long long *handles, int n) {
	CUdevice d = 0;
	CUmemAccessDesc access;
	DRIVER_DEVICE(dev);
	DRV(drv.DeviceGet(&d, dev), "cuDeviceGet");
	for (int i = 0; i < n; i++) {
		CUresult e = drv.MemMap(ptr + (unsigned long long)i * page, page, 0, handles[i], 0);
		if (e != CUDA_SUCCESS) {
			allocd_status s = drv_fail(e, "cuMemMap");
			for (int j = 0; j < i; j++) {
				(void)drv.MemUnmap(ptr + (unsigned long long)j * page, page);
			}
			return s;
		}
	}
	memset(&access, 0, sizeof access);
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = d;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	CUresult e = drv.MemSetAccess(ptr, (size_t)n * page, &access, 1);
	if (e != CUDA_SUCCESS) {
		allocd_status s = drv_fail(e, "cuMemSetAccess");
		for (int j = 0; j < n; j++) {
			(void)drv.MemUnmap(ptr + (unsigned long long)j * page, page);
		}
		return s;
	}
	return ok_status();
}

allocd_status allocd_vmm_unmap(int dev, unsigned long long ptr, size_t size) {
	DRIVER_DEVICE(dev);
	DRV(drv.MemUnmap(ptr, size), "cuMemUnmap");
	return ok_status();
}

// ---- ABI assumptions ---------------------------------------------------

int allocd_abi(const char **names, long long *values, int cap) {
	int n = 0;
#define ABI(key, v)                          \
	do {                                     \
		if (n < cap) {                       \
			names[n] = key;                  \
			values[n] = (long long)(v);      \
		}                                    \
		n++;                                 \
	} while (0)
	ABI("sizeof.CUmemLocation", sizeof(CUmemLocation));
	ABI("offsetof.CUmemLocation.type", offsetof(CUmemLocation, type));
	ABI("offsetof.CUmemLocation.id", offsetof(CUmemLocation, id));
	ABI("sizeof.CUmemAllocationProp", sizeof(CUmemAllocationProp));
	ABI("offsetof.CUmemAllocationProp.type", offsetof(CUmemAllocationProp, type));
	ABI("offsetof.CUmemAllocationProp.requestedHandleTypes", offsetof(CUmemAllocationProp, requestedHandleTypes));
	ABI("offsetof.CUmemAllocationProp.location", offsetof(CUmemAllocationProp, location));
	ABI("offsetof.CUmemAllocationProp.win32HandleMetaData", offsetof(CUmemAllocationProp, win32HandleMetaData));
	ABI("offsetof.CUmemAllocationProp.allocFlags", offsetof(CUmemAllocationProp, allocFlags));
	ABI("offsetof.CUmemAllocationProp.allocFlags.compressionType", offsetof(CUmemAllocationProp, allocFlags.compressionType));
	ABI("offsetof.CUmemAllocationProp.allocFlags.gpuDirectRDMACapable", offsetof(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable));
	ABI("offsetof.CUmemAllocationProp.allocFlags.usage", offsetof(CUmemAllocationProp, allocFlags.usage));
	ABI("sizeof.CUmemAccessDesc", sizeof(CUmemAccessDesc));
	ABI("offsetof.CUmemAccessDesc.location", offsetof(CUmemAccessDesc, location));
	ABI("offsetof.CUmemAccessDesc.flags", offsetof(CUmemAccessDesc, flags));
	ABI("sizeof.CUuuid", sizeof(CUuuid));
	ABI("sizeof.CUdevice", sizeof(CUdevice));
	ABI("sizeof.CUdeviceptr", sizeof(CUdeviceptr));
	ABI("sizeof.CUmemGenericAllocationHandle", sizeof(CUmemGenericAllocationHandle));
	ABI("sizeof.CUresult", sizeof(CUresult));
	ABI("sizeof.cudaError_t", sizeof(cudaError_t));
	ABI("sizeof.cudaStream_t", sizeof(cudaStream_t));
	ABI("sizeof.cudaEvent_t", sizeof(cudaEvent_t));
	ABI("sizeof.cudaMemPool_t", sizeof(cudaMemPool_t));
	ABI("cudaSuccess", cudaSuccess);
	ABI("cudaErrorInvalidResourceHandle", cudaErrorInvalidResourceHandle);
	ABI("cudaErrorNotReady", cudaErrorNotReady);
	ABI("cudaMemcpyHostToDevice", cudaMemcpyHostToDevice);
	ABI("cudaMemcpyDeviceToHost", cudaMemcpyDeviceToHost);
	ABI("cudaMemcpyDeviceToDevice", cudaMemcpyDeviceToDevice);
	ABI("cudaHostAllocPortable", cudaHostAllocPortable);
	ABI("cudaHostAllocMapped", cudaHostAllocMapped);
	ABI("cudaHostAllocWriteCombined", cudaHostAllocWriteCombined);
	ABI("cudaStreamNonBlocking", cudaStreamNonBlocking);
	ABI("cudaEventDisableTiming", cudaEventDisableTiming);
	ABI("cudaMemPoolAttrReleaseThreshold", cudaMemPoolAttrReleaseThreshold);
	ABI("cudaMemPoolAttrReservedMemCurrent", cudaMemPoolAttrReservedMemCurrent);
	ABI("cudaMemPoolAttrUsedMemCurrent", cudaMemPoolAttrUsedMemCurrent);
	ABI("cudaStreamLegacy", 1);
	ABI("cudaStreamPerThread", 2);
	ABI("CUDA_SUCCESS", CUDA_SUCCESS);
	ABI("CU_MEM_ALLOCATION_TYPE_PINNED", CU_MEM_ALLOCATION_TYPE_PINNED);
	ABI("CU_MEM_HANDLE_TYPE_NONE", CU_MEM_HANDLE_TYPE_NONE);
	ABI("CU_MEM_LOCATION_TYPE_DEVICE", CU_MEM_LOCATION_TYPE_DEVICE);
	ABI("CU_MEM_ACCESS_FLAGS_PROT_READWRITE", CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
	ABI("CU_MEM_ALLOC_GRANULARITY_MINIMUM", CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	ABI("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
	ABI("CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED", CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
#undef ABI
	return n;
}
