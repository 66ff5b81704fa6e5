// Package cudart is allocd's device boundary: the small set of CUDA runtime
// and driver calls a caching allocator needs, behind the Device interface.
//
// The real implementation (Open) reaches the CUDA runtime through a tiny C
// shim that dlopens libcudart at run time, so a binary built without the
// CUDA toolkit runs wherever a driver is installed. The simulated device,
// which CI, the tests and `allocd replay` use on machines without a GPU,
// lives beside this package in simdev, behind the same interfaces.
//
// Nothing else in allocd calls cgo. The allocator calls a Device only on its
// slow path: growing or releasing a segment and polling events.
package cudart

import (
	"errors"
	"fmt"
)

// Ptr is a device address. The zero Ptr is never a valid allocation.
type Ptr uint64

// Stream identifies a CUDA stream on one device. The zero Stream is the
// legacy default stream, which always exists.
type Stream uint64

// Event identifies a CUDA event created by Device.EventCreate.
type Event uint64

// DefaultStream is the legacy default stream (cudaStreamLegacy's handle 0).
const DefaultStream Stream = 0

// Info describes a device. Fields a backend cannot know are zero.
type Info struct {
	// Index is the device ordinal (cudaSetDevice's argument).
	Index int
	// Name is the marketing name, e.g. "NVIDIA H200" or "sim".
	Name string
	// UUID is the device UUID in nvidia-smi's form ("GPU-xxxxxxxx-..."),
	// empty when unknown.
	UUID string
	// TotalMemory is the device memory in bytes.
	TotalMemory uint64
}

// Device is one GPU's memory, streams and events. Implementations are safe
// for concurrent use.
//
// Every method that can fail returns an error wrapping ErrOutOfMemory,
// ErrInvalidValue, ErrClosed or another sentinel of this package where one
// applies, and a *CUDAError for errors reported by the CUDA runtime.
type Device interface {
	// Info returns the device's description.
	Info() Info
	// Malloc reserves size bytes of device memory (cudaMalloc). The address
	// is aligned to at least 512 bytes. A request the device cannot satisfy
	// returns an error for which errors.Is(err, ErrOutOfMemory) holds.
	Malloc(size uint64) (Ptr, error)
	// Free returns memory obtained from Malloc (cudaFree). It waits for
	// work on the device to finish, as cudaFree does.
	Free(p Ptr) error
	// MemGetInfo reports the device's free and total memory in bytes.
	MemGetInfo() (free, total uint64, err error)
	// Synchronize waits for all work on the device (cudaDeviceSynchronize).
	Synchronize() error

	// StreamCreate creates a non-blocking stream.
	StreamCreate() (Stream, error)
	// StreamDestroy destroys a stream made by StreamCreate.
	StreamDestroy(s Stream) error
	// StreamSynchronize waits for all work queued on s.
	StreamSynchronize(s Stream) error

	// EventCreate creates an event with timing disabled.
	EventCreate() (Event, error)
	// EventRecord records e on s: e completes when the work queued on s
	// before this call has finished.
	EventRecord(e Event, s Stream) error
	// EventQuery reports whether e has completed, without blocking.
	EventQuery(e Event) (done bool, err error)
	// EventSynchronize blocks until e has completed.
	EventSynchronize(e Event) error
	// EventDestroy destroys e.
	EventDestroy(e Event) error

	// MemsetAsync sets size bytes at p to value, queued on s.
	MemsetAsync(p Ptr, value byte, size uint64, s Stream) error
	// MemcpyHtoD copies len(src) bytes from host memory to p, synchronously.
	MemcpyHtoD(dst Ptr, src []byte) error
	// MemcpyDtoH copies len(dst) bytes from p to host memory, synchronously.
	MemcpyDtoH(dst []byte, src Ptr) error

	// Close releases the backend's own resources (not the allocations,
	// which belong to their owner). Calls after Close return ErrClosed.
	Close() error
}

// AsyncAllocator is implemented by devices with a stream-ordered memory pool
// (cudaMallocAsync / cudaFreeAsync on the device's default pool).
type AsyncAllocator interface {
	// MallocAsync allocates size bytes ordered on stream s.
	MallocAsync(size uint64, s Stream) (Ptr, error)
	// FreeAsync frees p ordered on stream s.
	FreeAsync(p Ptr, s Stream) error
	// TrimPool releases unused pool memory back to the system.
	TrimPool() error
}

// Handle is a physical memory allocation made by VirtualMemory.Create.
type Handle uint64

// VirtualMemory is implemented by devices that support the driver's virtual
// memory management calls, which expandable segments build on.
type VirtualMemory interface {
	// Granularity is the size physical allocations and mappings are
	// multiples of (2 MiB on current GPUs).
	Granularity() (uint64, error)
	// Reserve reserves size bytes of virtual address space.
	Reserve(size uint64) (Ptr, error)
	// ReleaseRange frees a reservation made by Reserve.
	ReleaseRange(p Ptr, size uint64) error
	// Create allocates size bytes of physical memory.
	Create(size uint64) (Handle, error)
	// Release frees physical memory made by Create.
	Release(h Handle) error
	// Map maps h at p (size bytes) and enables read/write access from the
	// device.
	Map(p Ptr, size uint64, h Handle) error
	// Unmap unmaps size bytes at p.
	Unmap(p Ptr, size uint64) error
}

// RangeMapper is a VirtualMemory that maps several pages side by side in
// one call: MapRange maps hs[i] at p + i*page (each handle holds page
// bytes) and grants the device read/write access to the whole range at
// once, as PyTorch's expandable segments do, instead of once per page. On
// error nothing stays mapped. Expandable segments use it when the device
// has it.
type RangeMapper interface {
	MapRange(p Ptr, page uint64, hs []Handle) error
}

// ShareableMemory is a VirtualMemory whose physical allocations can pass
// between processes as POSIX file descriptors (the driver's
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). The node broker creates its
// chunks with CreateShareable and sends Export's descriptor over a Unix
// socket; the client Imports it and maps the handle as it maps one it
// created. The physical memory lives while any process holds a handle to
// it or a mapping of it, so a client's mappings stay valid after the
// exporting process releases its own handle, and a dead client's mappings
// go with its process.
type ShareableMemory interface {
	VirtualMemory
	// CreateShareable allocates size bytes of physical memory (a multiple
	// of the granularity) that Export can share. Release frees it as it
	// frees Create's handles.
	CreateShareable(size uint64) (Handle, error)
	// Export returns a new file descriptor for h, which CreateShareable
	// made. The caller owns the descriptor and closes it; h stays valid.
	Export(h Handle) (fd int, err error)
	// Import returns a handle to the size bytes of physical memory behind
	// fd, a descriptor from Export in this process or another. fd is not
	// consumed: the caller still closes it. size must be the memory's
	// size: the simulated device checks it (ErrInvalidValue), a GPU
	// driver cannot, and there a wrong size fails at Map or maps only the
	// memory's first bytes. Release drops this process's reference.
	Import(fd int, size uint64) (Handle, error)
}

// Sentinel errors. Backends wrap them; test with errors.Is.
var (
	// ErrOutOfMemory: the device could not satisfy an allocation.
	ErrOutOfMemory = errors.New("out of memory")
	// ErrInvalidValue: an argument was out of range (size 0, unknown
	// pointer, unknown stream or event).
	ErrInvalidValue = errors.New("invalid value")
	// ErrClosed: the device was used after Close.
	ErrClosed = errors.New("device closed")
	// ErrNoDriver: no CUDA runtime or driver library could be loaded.
	ErrNoDriver = errors.New("no CUDA driver")
	// ErrNotSupported: the backend lacks the capability asked for.
	ErrNotSupported = errors.New("not supported")
)

// CUDAError is an error reported by the CUDA runtime or driver.
type CUDAError struct {
	// Op is the call that failed, e.g. "cudaMalloc".
	Op string
	// Code is the numeric cudaError_t / CUresult.
	Code int
	// Name is the enum name, e.g. "cudaErrorMemoryAllocation".
	Name string
	// Text is the runtime's description, e.g. "out of memory".
	Text string
	// Sticky reports an error that leaves the context unusable; the process
	// must be restarted to use the device again.
	Sticky bool
}

// Error formats the error as "op: cudaErrorName: text".
func (e *CUDAError) Error() string {
	return fmt.Sprintf("%s: %s: %s", e.Op, e.Name, e.Text)
}

// Is makes errors.Is(err, ErrOutOfMemory) hold for allocation failures and
// errors.Is(err, ErrInvalidValue) for invalid arguments.
func (e *CUDAError) Is(target error) bool {
	switch target {
	case ErrOutOfMemory:
		return e.Code == 2 // cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY
	case ErrInvalidValue:
		return e.Code == 1 || e.Code == 101 || e.Code == 400 // invalid value, invalid device, invalid resource handle
	}
	return false
}

// StreamChecker is implemented by devices that can tell whether a stream
// handle is valid. The allocator asks once per stream, the first time it
// sees one, so a bad stream is an error rather than undefined behaviour.
type StreamChecker interface {
	// CheckStream returns nil for a usable stream and an error wrapping
	// ErrInvalidValue otherwise.
	CheckStream(s Stream) error
}

// StreamWaiter is implemented by devices that can order one stream's work
// after another's on the device (cudaStreamWaitEvent), without the host
// waiting. The allocator uses it to lend a free block of one stream's
// expandable segment to another stream.
type StreamWaiter interface {
	// StreamWaitEvent makes the work queued on s after this call wait
	// until e, as last recorded, has completed.
	StreamWaitEvent(s Stream, e Event) error
}

// PoolReporter is implemented by AsyncAllocator devices that can report
// their stream-ordered pool's usage.
type PoolReporter interface {
	// PoolUsage returns the bytes the pool holds from the device and the
	// bytes in use by live allocations.
	PoolUsage() (reserved, used uint64, err error)
}

// AddressRanger is a Device whose addresses all lie in one range, known
// before it hands any out: a simulated device (package simdev) is one. Callers that hold
// several devices find the owner of a pointer from it.
type AddressRanger interface {
	// AddressRange returns the range [lo, hi) that holds every address the
	// device hands out.
	AddressRange() (lo, hi Ptr)
}
