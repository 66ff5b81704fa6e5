//go:build cgo

// This file is the cgo half of the real CUDA backend (the Go half, with the
// CUDA type and its methods, is cuda_device.go; the C half is shim.c).
//
// # Design: dlopen, no CUDA SDK at build time
//
// Like NVIDIA/go-nvml, cudart links against nothing from CUDA. The C shim
// (shim.c) declares by hand the handful of CUDA types and enum values it
// uses (typedef int cudaError_t; typedef void *cudaStream_t; the
// CUmemAllocationProp / CUmemAccessDesc layouts ...), and at run time, once
// per process, loads
//
//   - the driver, libcuda.so.1 (for cuInit, device name/UUID/memory and the
//     virtual-memory calls cuMemCreate, cuMemMap, ... that expandable
//     segments need), and
//   - the runtime, trying libcudart.so.13, then libcudart.so.12, then
//     libcudart.so (then the same names under /usr/local/cuda/lib64),
//
// each with dlopen(RTLD_NOW|RTLD_LOCAL), and resolves every entry point with
// dlsym into a table of function pointers. The build therefore needs gcc and
// libc only, a binary built on a machine without a GPU runs on one with a
// driver, and a machine with no driver gets an error (wrapping ErrNoDriver)
// that names every library path tried and dlerror's reason for each.
// $ALLOCD_CUDART and $ALLOCD_LIBCUDA, when set, name a library file to try
// before the defaults (for a runtime installed by pip, say).
//
// # Calls, threads and devices
//
// Each Go method makes exactly one cgo call. The C function it calls takes
// the device ordinal and makes that device current on the calling OS thread
// before doing its work, inside the same C call: the goroutine cannot move
// to another thread in the middle, so no runtime.LockOSThread is needed and
// two *CUDA values for different devices can be used from any goroutines.
// Runtime calls switch with cudaSetDevice only when cudaGetDevice reports
// another device; driver calls always call cudaSetDevice first, which in
// CUDA 12 and later makes the device's primary context current (a fresh
// thread otherwise has no current context for the driver to use). A call
// that switched devices switches back before it returns (the device guard
// in shim.c): the thread belongs to the caller, PyTorch for instance, which
// frees from threads whose current device is another one and keeps its own
// idea of it. The way back is taken only when the previous device's primary
// context is active, as c10::cuda::MaybeSetDevice does, so that restoring
// never creates a context on a GPU the process did not use.
//
// Failed calls come back as a *CUDAError carrying the failing call, the
// code, and the library's own name and description of it (the tables in
// errors_cuda.go fill in when the library cannot). After a runtime error
// the shim calls cudaGetLastError so that a handled error (an OOM, say) is
// not reported again by an unrelated later call.

package cudart

/*
#cgo LDFLAGS: -ldl
#cgo noescape allocd_versions
#cgo nocallback allocd_versions
#cgo noescape allocd_device_count
#cgo nocallback allocd_device_count
#cgo noescape allocd_open
#cgo nocallback allocd_open
#cgo noescape allocd_malloc
#cgo nocallback allocd_malloc
#cgo nocallback allocd_free
#cgo noescape allocd_mem_get_info
#cgo nocallback allocd_mem_get_info
#cgo nocallback allocd_device_synchronize
#cgo nocallback allocd_memset
#cgo nocallback allocd_memset_async
#cgo noescape allocd_memcpy_htod
#cgo nocallback allocd_memcpy_htod
#cgo noescape allocd_memcpy_dtoh
#cgo nocallback allocd_memcpy_dtoh
#cgo noescape allocd_stream_create
#cgo nocallback allocd_stream_create
#cgo nocallback allocd_stream_destroy
#cgo nocallback allocd_stream_synchronize
#cgo nocallback allocd_stream_check
#cgo noescape allocd_event_create
#cgo nocallback allocd_event_create
#cgo nocallback allocd_event_record
#cgo noescape allocd_event_query
#cgo nocallback allocd_event_query
#cgo nocallback allocd_event_synchronize
#cgo nocallback allocd_stream_wait_event
#cgo nocallback allocd_event_destroy
#cgo noescape allocd_malloc_async
#cgo nocallback allocd_malloc_async
#cgo nocallback allocd_free_async
#cgo nocallback allocd_trim_pool
#cgo noescape allocd_pool_usage
#cgo nocallback allocd_pool_usage
#cgo noescape allocd_vmm_reserve
#cgo nocallback allocd_vmm_reserve
#cgo nocallback allocd_vmm_address_free
#cgo noescape allocd_vmm_create
#cgo nocallback allocd_vmm_create
#cgo nocallback allocd_vmm_release
#cgo nocallback allocd_vmm_map
#cgo nocallback allocd_vmm_unmap
#cgo noescape allocd_vmm_map_range
#cgo nocallback allocd_vmm_map_range
#cgo noescape allocd_vmm_create_shareable
#cgo nocallback allocd_vmm_create_shareable
#cgo noescape allocd_vmm_export
#cgo nocallback allocd_vmm_export
#cgo noescape allocd_vmm_import
#cgo nocallback allocd_vmm_import
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"unsafe"
)

// builtWithCgo reports whether this binary can reach CUDA at all.
const builtWithCgo = true

// runtimeCandidates lists the libcudart files tried, in order.
func runtimeCandidates() []string {
	var c []string
	if p := os.Getenv("ALLOCD_CUDART"); p != "" {
		c = append(c, p)
	}
	names := []string{"libcudart.so.13", "libcudart.so.12", "libcudart.so"}
	c = append(c, names...)
	for _, n := range names {
		c = append(c, filepath.Join("/usr/local/cuda/lib64", n))
	}
	return c
}

// driverCandidates lists the libcuda files tried, in order.
func driverCandidates() []string {
	var c []string
	if p := os.Getenv("ALLOCD_LIBCUDA"); p != "" {
		c = append(c, p)
	}
	return append(c, "libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1")
}

// dlopenFirst dlopens the candidates in order and returns the first that
// loads, with its resolved path; tried holds "candidate: dlerror" for each
// failure before it.
func dlopenFirst(candidates []string) (handle unsafe.Pointer, path string, tried []string) {
	var errbuf [512]C.char
	for _, name := range candidates {
		cname := C.CString(name)
		h := C.allocd_dlopen(cname, &errbuf[0], C.size_t(len(errbuf)))
		C.free(unsafe.Pointer(cname))
		if h != nil {
			path = name
			if p := C.allocd_dlpath(h); p != nil {
				path = C.GoString(p)
			}
			return h, path, tried
		}
		tried = append(tried, fmt.Sprintf("%s (%s)", name, C.GoString(&errbuf[0])))
	}
	return nil, "", tried
}

// tryLibraries reports which of candidates dlopen loads first (the library
// is closed again); the error wraps ErrNoDriver and names every candidate.
// It touches none of the process-wide state that Open uses.
func tryLibraries(what string, candidates []string) (string, error) {
	h, path, tried := dlopenFirst(candidates)
	if h == nil {
		return "", noLibraryError(what, tried)
	}
	C.allocd_dlclose(h)
	return path, nil
}

// platformLoad loads libcuda and libcudart, binds every symbol and reads
// the versions. It runs once per process (see load).
func platformLoad() loadResult {
	var r loadResult
	dh, dpath, dtried := dlopenFirst(driverCandidates())
	rh, rpath, rtried := dlopenFirst(runtimeCandidates())
	if dh == nil || rh == nil {
		var errs []error
		if dh == nil {
			errs = append(errs, noLibraryError("the CUDA driver library", dtried))
		}
		if rh == nil {
			errs = append(errs, noLibraryError("the CUDA runtime library", rtried))
		}
		C.allocd_dlclose(dh)
		C.allocd_dlclose(rh)
		r.err = joinLoadErrors(errs)
		return r
	}
	var missing [2048]C.char
	if C.allocd_bind(rh, dh, &missing[0], C.size_t(len(missing))) != 0 {
		r.err = fmt.Errorf("cudart: %s or %s lacks symbols cudart needs (%s): %w",
			rpath, dpath, C.GoString(&missing[0]), ErrNoDriver)
		return r // the libraries stay loaded: the table may be half filled
	}
	r.runtimePath, r.driverPath = rpath, dpath
	var rv, dv C.int
	if e := convStatus(C.allocd_versions(&rv, &dv)); e != nil {
		r.err = fmt.Errorf("cudart: reading CUDA versions from %s: %w: %w", rpath, ErrNoDriver, e)
		return r
	}
	r.runtimeVersion, r.driverVersion = int(rv), int(dv)
	return r
}

func init() {
	threadDevice = func() int { return int(C.allocd_current_device()) }
	setThreadDevice = func(dev int) error {
		if C.allocd_set_current_device(C.int(dev)) != 0 {
			return fmt.Errorf("cudart: cudaSetDevice(%d) failed", dev)
		}
		return nil
	}
}

// convStatus turns a shim status into nil (success) or a *CUDAError.
func convStatus(s C.allocd_status) *CUDAError {
	if s.code == 0 {
		return nil
	}
	var op, name, text string
	if s.op != nil {
		op = C.GoString(s.op)
	}
	if s.name != nil {
		name = C.GoString(s.name)
	}
	if s.text != nil {
		text = C.GoString(s.text)
	}
	return newCUDAError(op, int(s.code), s.driver != 0, name, text)
}

// shimErrorName asks the loaded library for the name and description of a
// code (cudaGetErrorName / cuGetErrorName); ok is false before loading.
func shimErrorName(code int, driver bool) (name, text string, ok bool) {
	if l := load(); l.err != nil {
		return "", "", false
	}
	var n, t *C.char
	d := C.int(0)
	if driver {
		d = 1
	}
	C.allocd_error_name(d, C.int(code), &n, &t)
	if n != nil {
		name = C.GoString(n)
	}
	if t != nil {
		text = C.GoString(t)
	}
	return name, text, true
}

func shimDeviceCount() (int, *CUDAError) {
	var n C.int
	e := convStatus(C.allocd_device_count(&n))
	return int(n), e
}

func shimOpen(dev int) (rawInfo, *CUDAError) {
	var ci C.allocd_info
	if e := convStatus(C.allocd_open(C.int(dev), &ci)); e != nil {
		return rawInfo{}, e
	}
	r := rawInfo{
		name:        C.GoString(&ci.name[0]),
		hasUUIDv1:   ci.has_uuid_v1 != 0,
		total:       uint64(ci.total),
		vmm:         ci.vmm != 0,
		pools:       ci.pools != 0,
		granularity: uint64(ci.granularity),
		share:       ci.share != 0,
	}
	for i := range r.uuid {
		r.uuid[i] = byte(ci.uuid[i])
		r.uuidV1[i] = byte(ci.uuid_v1[i])
	}
	return r, nil
}

func shimMalloc(dev int, size uint64) (Ptr, *CUDAError) {
	var p C.ulonglong
	e := convStatus(C.allocd_malloc(C.int(dev), C.size_t(size), &p))
	return Ptr(p), e
}

func shimFree(dev int, p Ptr) *CUDAError {
	return convStatus(C.allocd_free(C.int(dev), C.ulonglong(p)))
}

func shimMemGetInfo(dev int) (free, total uint64, e *CUDAError) {
	var f, t C.size_t
	e = convStatus(C.allocd_mem_get_info(C.int(dev), &f, &t))
	return uint64(f), uint64(t), e
}

func shimDeviceSynchronize(dev int) *CUDAError {
	return convStatus(C.allocd_device_synchronize(C.int(dev)))
}

func shimMemset(dev int, p Ptr, value byte, n uint64) *CUDAError {
	return convStatus(C.allocd_memset(C.int(dev), C.ulonglong(p), C.int(value), C.size_t(n)))
}

func shimMemsetAsync(dev int, p Ptr, value byte, n uint64, s Stream) *CUDAError {
	return convStatus(C.allocd_memset_async(C.int(dev), C.ulonglong(p), C.int(value), C.size_t(n), C.uintptr_t(s)))
}

func shimMemcpyHtoD(dev int, dst Ptr, src []byte) *CUDAError {
	return convStatus(C.allocd_memcpy_htod(C.int(dev), C.ulonglong(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

func shimMemcpyDtoH(dev int, dst []byte, src Ptr) *CUDAError {
	return convStatus(C.allocd_memcpy_dtoh(C.int(dev), unsafe.Pointer(&dst[0]), C.ulonglong(src), C.size_t(len(dst))))
}

func shimStreamCreate(dev int) (Stream, *CUDAError) {
	var s C.uintptr_t
	e := convStatus(C.allocd_stream_create(C.int(dev), &s))
	return Stream(s), e
}

func shimStreamDestroy(dev int, s Stream) *CUDAError {
	return convStatus(C.allocd_stream_destroy(C.int(dev), C.uintptr_t(s)))
}

func shimStreamSynchronize(dev int, s Stream) *CUDAError {
	return convStatus(C.allocd_stream_synchronize(C.int(dev), C.uintptr_t(s)))
}

func shimStreamCheck(dev int, s Stream) *CUDAError {
	return convStatus(C.allocd_stream_check(C.int(dev), C.uintptr_t(s)))
}

func shimEventCreate(dev int) (Event, *CUDAError) {
	var ev C.uintptr_t
	e := convStatus(C.allocd_event_create(C.int(dev), &ev))
	return Event(ev), e
}

func shimEventRecord(dev int, ev Event, s Stream) *CUDAError {
	return convStatus(C.allocd_event_record(C.int(dev), C.uintptr_t(ev), C.uintptr_t(s)))
}

func shimEventQuery(dev int, ev Event) (bool, *CUDAError) {
	var done C.int
	e := convStatus(C.allocd_event_query(C.int(dev), C.uintptr_t(ev), &done))
	return done != 0, e
}

func shimEventSynchronize(dev int, ev Event) *CUDAError {
	return convStatus(C.allocd_event_synchronize(C.int(dev), C.uintptr_t(ev)))
}

func shimStreamWaitEvent(dev int, s Stream, ev Event) *CUDAError {
	return convStatus(C.allocd_stream_wait_event(C.int(dev), C.uintptr_t(s), C.uintptr_t(ev)))
}

func shimEventDestroy(dev int, ev Event) *CUDAError {
	return convStatus(C.allocd_event_destroy(C.int(dev), C.uintptr_t(ev)))
}

func shimMallocAsync(dev int, size uint64, s Stream) (Ptr, *CUDAError) {
	var p C.ulonglong
	e := convStatus(C.allocd_malloc_async(C.int(dev), C.size_t(size), C.uintptr_t(s), &p))
	return Ptr(p), e
}

func shimFreeAsync(dev int, p Ptr, s Stream) *CUDAError {
	return convStatus(C.allocd_free_async(C.int(dev), C.ulonglong(p), C.uintptr_t(s)))
}

func shimTrimPool(dev int) *CUDAError {
	return convStatus(C.allocd_trim_pool(C.int(dev)))
}

func shimPoolUsage(dev int) (reserved, used uint64, e *CUDAError) {
	var r, u C.ulonglong
	e = convStatus(C.allocd_pool_usage(C.int(dev), &r, &u))
	return uint64(r), uint64(u), e
}

func shimVMMReserve(dev int, size uint64) (Ptr, *CUDAError) {
	var p C.ulonglong
	e := convStatus(C.allocd_vmm_reserve(C.int(dev), C.size_t(size), &p))
	return Ptr(p), e
}

func shimVMMAddressFree(dev int, p Ptr, size uint64) *CUDAError {
	return convStatus(C.allocd_vmm_address_free(C.int(dev), C.ulonglong(p), C.size_t(size)))
}

func shimVMMCreate(dev int, size uint64) (Handle, *CUDAError) {
	var h C.ulonglong
	e := convStatus(C.allocd_vmm_create(C.int(dev), C.size_t(size), &h))
	return Handle(h), e
}

func shimVMMRelease(dev int, h Handle) *CUDAError {
	return convStatus(C.allocd_vmm_release(C.int(dev), C.ulonglong(h)))
}

func shimVMMMap(dev int, p Ptr, size uint64, h Handle) *CUDAError {
	return convStatus(C.allocd_vmm_map(C.int(dev), C.ulonglong(p), C.size_t(size), C.ulonglong(h)))
}

func shimVMMMapRange(dev int, p Ptr, page uint64, hs []Handle) *CUDAError {
	return convStatus(C.allocd_vmm_map_range(C.int(dev), C.ulonglong(p), C.size_t(page),
		(*C.ulonglong)(unsafe.Pointer(&hs[0])), C.int(len(hs))))
}

func shimVMMUnmap(dev int, p Ptr, size uint64) *CUDAError {
	return convStatus(C.allocd_vmm_unmap(C.int(dev), C.ulonglong(p), C.size_t(size)))
}

func shimVMMCreateShareable(dev int, size uint64) (Handle, *CUDAError) {
	var h C.ulonglong
	e := convStatus(C.allocd_vmm_create_shareable(C.int(dev), C.size_t(size), &h))
	return Handle(h), e
}

func shimVMMExport(dev int, h Handle) (int, *CUDAError) {
	var fd C.int
	e := convStatus(C.allocd_vmm_export(C.int(dev), C.ulonglong(h), &fd))
	return int(fd), e
}

func shimVMMImport(dev int, fd int) (Handle, *CUDAError) {
	var h C.ulonglong
	e := convStatus(C.allocd_vmm_import(C.int(dev), C.int(fd), &h))
	return Handle(h), e
}

// ABIAssumptions returns the struct sizes and offsets, enum values and
// error codes that the shim and this package were written against, keyed
// by the names abicheck/abicheck.c prints ("sizeof.CUmemAllocationProp",
// "offsetof.CUmemAccessDesc.flags", "cudaErrorMemoryAllocation", ...).
// The layout entries come from the C side (sizeof/offsetof of the
// hand-written structs in shim.c), so a test on a machine with CUDA's
// headers can compare the two outputs key by key. It needs no CUDA library.
func ABIAssumptions() map[string]int64 {
	const capacity = 256
	var names [capacity]*C.char
	var values [capacity]C.longlong
	n := int(C.allocd_abi(&names[0], &values[0], capacity))
	n = min(n, capacity)
	m := goABIAssumptions()
	for i := 0; i < n; i++ {
		m[C.GoString(names[i])] = int64(values[i])
	}
	return m
}
