//go:build cgo

package cudart

// The cgo half of host.go: page-locked host memory and stream-ordered
// copies, one C call each (shim.c, "Page-locked host memory").

/*
#cgo noescape allocd_host_alloc
#cgo nocallback allocd_host_alloc
#cgo nocallback allocd_free_host
#cgo nocallback allocd_memcpy_htod_async
#cgo nocallback allocd_memcpy_dtoh_async
#cgo nocallback allocd_memcpy_dtod_async
#include "shim.h"
*/
import "C"

import "unsafe"

// The host-side pointers of the two host copies are not marked noescape:
// with page-locked memory they point outside the Go heap, and with
// pageable Go memory cgo must keep the bytes where they are for the call,
// during which CUDA stages (H2D) or completes (D2H) the copy.

func shimHostAlloc(dev int, size uint64, flags HostAllocFlags) (unsafe.Pointer, *CUDAError) {
	var p unsafe.Pointer
	e := convStatus(C.allocd_host_alloc(C.int(dev), C.size_t(size), C.uint(flags), &p))
	return p, e
}

func shimFreeHost(dev int, p unsafe.Pointer) *CUDAError {
	return convStatus(C.allocd_free_host(C.int(dev), p))
}

func shimMemcpyHtoDAsync(dev int, dst Ptr, src []byte, s Stream) *CUDAError {
	return convStatus(C.allocd_memcpy_htod_async(C.int(dev), C.ulonglong(dst), unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src)), C.uintptr_t(s)))
}

func shimMemcpyDtoHAsync(dev int, dst []byte, src Ptr, s Stream) *CUDAError {
	return convStatus(C.allocd_memcpy_dtoh_async(C.int(dev), unsafe.Pointer(unsafe.SliceData(dst)), C.ulonglong(src), C.size_t(len(dst)), C.uintptr_t(s)))
}

func shimMemcpyDtoDAsync(dev int, dst, src Ptr, n uint64, s Stream) *CUDAError {
	return convStatus(C.allocd_memcpy_dtod_async(C.int(dev), C.ulonglong(dst), C.ulonglong(src), C.size_t(n), C.uintptr_t(s)))
}
