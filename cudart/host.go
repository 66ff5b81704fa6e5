package cudart

import (
	"fmt"
	"sync"
	"unsafe"
)

// HostAllocFlags are cudaHostAlloc's flags.
type HostAllocFlags uint32

// Flags of HostAlloc, with cudaHostAlloc's values.
const (
	// HostAllocDefault is cudaHostAllocDefault: page-locked memory.
	HostAllocDefault HostAllocFlags = 0
	// HostAllocPortable (cudaHostAllocPortable): the memory counts as
	// page-locked for every CUDA context, not only the allocating one.
	HostAllocPortable HostAllocFlags = 1
	// HostAllocMapped (cudaHostAllocMapped): the memory is mapped into the
	// device address space (with unified addressing, at the same address).
	HostAllocMapped HostAllocFlags = 2
	// HostAllocWriteCombined (cudaHostAllocWriteCombined): faster for the
	// device to read, very slow for the CPU to read. Not used by allocd.
	HostAllocWriteCombined HostAllocFlags = 4
)

// maxHostSlice is the largest []byte this platform can hold.
const maxHostSlice = uint64(^uint(0) >> 1)

// hostAllocFlagsMask holds every flag HostAlloc accepts.
const hostAllocFlagsMask = HostAllocPortable | HostAllocMapped | HostAllocWriteCombined

// Valid reports whether f holds only flags HostAlloc accepts.
func (f HostAllocFlags) Valid() bool { return f&^hostAllocFlagsMask == 0 }

// HostDevice is implemented by devices that can allocate page-locked
// (pinned) host memory and queue copies between host and device memory on
// their streams. It is separate from Device so that Device's implementers
// need not grow; *CUDA and the simulated device (package simdev) implement
// both.
//
// Host memory from HostAlloc is the caller's until FreeHost: the returned
// slice must not be used after it, nor re-sliced beyond its capacity. The
// copy calls return once the copy is queued; the host bytes must stay valid
// and, for a copy from the host, unchanged until the work queued on the
// stream before an event recorded after the copy has completed.
type HostDevice interface {
	// HostAlloc allocates size bytes of page-locked host memory
	// (cudaHostAlloc with flags) and returns them as a slice of that
	// length and capacity. A size of 0 or an unknown flag gives an error
	// wrapping ErrInvalidValue; a refusal by the system, ErrOutOfMemory.
	HostAlloc(size uint64, flags HostAllocFlags) ([]byte, error)
	// FreeHost frees memory from HostAlloc (cudaFreeHost, which waits for
	// the device's queued work first). b must start where a live HostAlloc
	// slice starts; anything else gives ErrInvalidValue.
	FreeHost(b []byte) error
	// MemcpyHtoDAsync queues a copy of src to dst on s
	// (cudaMemcpyAsync host to device). With page-locked src it returns at
	// once; with ordinary (pageable) Go memory CUDA stages the bytes before
	// it returns, which makes the call synchronous for the host.
	MemcpyHtoDAsync(dst Ptr, src []byte, s Stream) error
	// MemcpyDtoHAsync queues a copy of len(dst) bytes from src into dst on
	// s (cudaMemcpyAsync device to host). With pageable dst the call
	// returns once the copy is done.
	MemcpyDtoHAsync(dst []byte, src Ptr, s Stream) error
	// MemcpyDtoDAsync queues a copy of size bytes from src to dst on s
	// (cudaMemcpyAsync device to device).
	MemcpyDtoDAsync(dst, src Ptr, size uint64, s Stream) error
}

var _ HostDevice = (*CUDA)(nil)

// hostAllocs is the live cudaHostAlloc memory of the process, base address
// to size, so that FreeHost refuses a pointer CUDA did not hand out
// (cudaFreeHost of one is undefined behaviour, not an error, in some
// driver versions). Pinned memory belongs to the process, not to a device,
// as CUDA's own bookkeeping of it does.
var hostAllocs = struct {
	sync.Mutex
	live map[uintptr]uint64
}{live: map[uintptr]uint64{}}

// HostAlloc implements HostDevice with cudaHostAlloc, made with this
// device current. The memory is outside the Go heap: the garbage collector
// neither moves nor frees it. cudaHostAlloc's refusal
// (cudaErrorMemoryAllocation) is an error wrapping ErrOutOfMemory; so is a
// size no slice can hold, refused without calling CUDA.
func (c *CUDA) HostAlloc(size uint64, flags HostAllocFlags) ([]byte, error) {
	if err := c.usable("host alloc"); err != nil {
		return nil, err
	}
	if size == 0 {
		return nil, c.invalid("host alloc of 0 bytes")
	}
	if !flags.Valid() {
		return nil, c.invalid("host alloc: unknown flags %#x", uint32(flags))
	}
	if size > maxHostSlice {
		// Larger than a Go slice (and than size_t on 32-bit platforms):
		// refused as CUDA refuses what it cannot page-lock.
		return nil, c.fail(fmt.Sprintf("host alloc of %d bytes", size), hostAllocOOM())
	}
	p, e := shimHostAlloc(c.state.index, size, flags)
	if e != nil {
		return nil, c.fail(fmt.Sprintf("host alloc of %d bytes", size), e)
	}
	hostAllocs.Lock()
	hostAllocs.live[uintptr(p)] = size
	hostAllocs.Unlock()
	return unsafe.Slice((*byte)(p), size), nil
}

// hostAllocOOM is cudaHostAlloc's out-of-memory error.
func hostAllocOOM() *CUDAError {
	return &CUDAError{Op: "cudaHostAlloc", Code: 2, Name: "cudaErrorMemoryAllocation", Text: "out of memory"}
}

// FreeHost implements HostDevice with cudaFreeHost. A slice that does not
// start at a live HostAlloc allocation is refused with ErrInvalidValue
// without calling CUDA.
func (c *CUDA) FreeHost(b []byte) error {
	if err := c.usable("free host"); err != nil {
		return err
	}
	p := unsafe.Pointer(unsafe.SliceData(b))
	hostAllocs.Lock()
	_, ok := hostAllocs.live[uintptr(p)]
	hostAllocs.Unlock()
	if p == nil || !ok {
		return c.invalid("free host of %p, which is not a live host allocation", p)
	}
	if e := shimFreeHost(c.state.index, p); e != nil {
		return c.fail(fmt.Sprintf("free host of %p", p), e)
	}
	hostAllocs.Lock()
	delete(hostAllocs.live, uintptr(p))
	hostAllocs.Unlock()
	return nil
}

// MemcpyHtoDAsync implements HostDevice (cudaMemcpyAsync host to device).
// An empty src does nothing; the zero dst is refused with ErrInvalidValue.
func (c *CUDA) MemcpyHtoDAsync(dst Ptr, src []byte, s Stream) error {
	if err := c.usable("memcpy async host to device"); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	if dst == 0 {
		return c.invalid("memcpy async host to device: the zero pointer")
	}
	if e := shimMemcpyHtoDAsync(c.state.index, dst, src, s); e != nil {
		return c.fail(fmt.Sprintf("memcpy async of %d bytes host to device %#x on stream %#x", len(src), uint64(dst), uint64(s)), e)
	}
	return nil
}

// MemcpyDtoHAsync implements HostDevice (cudaMemcpyAsync device to host).
// An empty dst does nothing; the zero src is refused with ErrInvalidValue.
func (c *CUDA) MemcpyDtoHAsync(dst []byte, src Ptr, s Stream) error {
	if err := c.usable("memcpy async device to host"); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	if src == 0 {
		return c.invalid("memcpy async device to host: the zero pointer")
	}
	if e := shimMemcpyDtoHAsync(c.state.index, dst, src, s); e != nil {
		return c.fail(fmt.Sprintf("memcpy async of %d bytes device %#x to host on stream %#x", len(dst), uint64(src), uint64(s)), e)
	}
	return nil
}

// MemcpyDtoDAsync implements HostDevice (cudaMemcpyAsync device to
// device). A size of 0 does nothing; a zero pointer is refused with
// ErrInvalidValue.
func (c *CUDA) MemcpyDtoDAsync(dst, src Ptr, size uint64, s Stream) error {
	if err := c.usable("memcpy async device to device"); err != nil {
		return err
	}
	if size == 0 {
		return nil
	}
	if dst == 0 || src == 0 {
		return c.invalid("memcpy async device to device: the zero pointer")
	}
	if e := shimMemcpyDtoDAsync(c.state.index, dst, src, size, s); e != nil {
		return c.fail(fmt.Sprintf("memcpy async of %d bytes device %#x to device %#x on stream %#x", size, uint64(src), uint64(dst), uint64(s)), e)
	}
	return nil
}
