//go:build !cgo

package cudart

import "unsafe"

// Stubs for host.go without cgo; never reached, since no *CUDA can be
// opened (see cuda_nocgo.go).

func shimHostAlloc(int, uint64, HostAllocFlags) (unsafe.Pointer, *CUDAError) { return nil, nocgo() }
func shimFreeHost(int, unsafe.Pointer) *CUDAError                            { return nocgo() }
func shimMemcpyHtoDAsync(int, Ptr, []byte, Stream) *CUDAError                { return nocgo() }
func shimMemcpyDtoHAsync(int, []byte, Ptr, Stream) *CUDAError                { return nocgo() }
func shimMemcpyDtoDAsync(int, Ptr, Ptr, uint64, Stream) *CUDAError           { return nocgo() }
