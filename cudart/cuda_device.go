package cudart

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
)

// This file is the build-independent half of the real CUDA backend: the
// CUDA type, Open and friends. The calls into C are the shim* functions of
// cuda.go (cgo builds) or cuda_nocgo.go (stubs that are never reached,
// because Open fails first when cgo is off).

var (
	_ Device          = (*CUDA)(nil)
	_ AsyncAllocator  = (*CUDA)(nil)
	_ VirtualMemory   = (*CUDA)(nil)
	_ ShareableMemory = (*CUDA)(nil)
	_ StreamChecker   = (*CUDA)(nil)
	_ PoolReporter    = (*CUDA)(nil)
)

// Test hooks for the shim's device guard, set by cuda.go in cgo builds and
// nil otherwise: the calling OS thread's current device (cudaGetDevice, -1
// on error) and cudaSetDevice. Call them with the goroutine locked to its
// thread.
var (
	threadDevice    func() int
	setThreadDevice func(dev int) error
)

// minRuntimeVersion is the oldest libcudart Open accepts (CUDA 12.0): from
// 12.0 on, cudaSetDevice makes the primary context current at once, which
// the driver calls of the virtual-memory path rely on.
const minRuntimeVersion = 12000

// Versions describes the CUDA libraries this process loaded.
type Versions struct {
	// Runtime is cudaRuntimeGetVersion's answer, 1000*major + 10*minor
	// (13000 is CUDA 13.0).
	Runtime int
	// Driver is cudaDriverGetVersion's answer: the newest CUDA version the
	// installed driver supports, in the same encoding.
	Driver int
	// RuntimeLibrary is the path of the libcudart that was loaded.
	RuntimeLibrary string
	// DriverLibrary is the path of the libcuda that was loaded.
	DriverLibrary string
}

// String formats v as "runtime 13.0 (path), driver 13.0 (path)".
func (v Versions) String() string {
	return fmt.Sprintf("runtime %s (%s), driver %s (%s)",
		versionString(v.Runtime), v.RuntimeLibrary, versionString(v.Driver), v.DriverLibrary)
}

func versionString(v int) string {
	return fmt.Sprintf("%d.%d", v/1000, v%1000/10)
}

// DeviceStatus is one line of ListDevices: a device's description and the
// memory free on it when it was listed.
type DeviceStatus struct {
	Info
	// FreeMemory is cudaMemGetInfo's free byte count at listing time.
	FreeMemory uint64
}

type loadResult struct {
	runtimePath, driverPath       string
	runtimeVersion, driverVersion int
	err                           error
}

var (
	loadOnce sync.Once
	loaded   loadResult
)

// load loads the CUDA libraries once per process; later calls return the
// first outcome, success or failure.
func load() *loadResult {
	loadOnce.Do(func() { loaded = platformLoad() })
	return &loaded
}

func noLibraryError(what string, tried []string) error {
	return fmt.Errorf("cudart: cannot load %s; tried %s: %w", what, strings.Join(tried, ", "), ErrNoDriver)
}

func joinLoadErrors(errs []error) error {
	if len(errs) == 1 {
		return errs[0]
	}
	return errors.Join(errs...)
}

// rawInfo is what the shim reports about a device at Open.
type rawInfo struct {
	name         string
	uuid, uuidV1 [16]byte
	hasUUIDv1    bool
	total        uint64
	vmm, pools   bool
	granularity  uint64
	share        bool // POSIX file descriptor handles, and libcuda's calls for them
}

// deviceState is shared by every *CUDA of one device ordinal: the device's
// primary context, and so its sticky error, is process-wide.
type deviceState struct {
	index  int
	sticky atomic.Pointer[CUDAError]

	mu      sync.Mutex
	streams map[Stream]bool // true: made by StreamCreate and live; false: destroyed by StreamDestroy
}

var (
	statesMu sync.Mutex
	states   = map[int]*deviceState{}
)

func stateFor(index int) *deviceState {
	statesMu.Lock()
	defer statesMu.Unlock()
	st := states[index]
	if st == nil {
		st = &deviceState{index: index, streams: map[Stream]bool{}}
		states[index] = st
	}
	return st
}

// CUDA is a real GPU reached through the CUDA runtime and driver, made by
// Open. It implements Device, AsyncAllocator, PoolReporter, VirtualMemory,
// ShareableMemory and StreamChecker, and is safe for concurrent use from any goroutines: every
// method makes its device current on the calling thread itself.
//
// A sticky error (an illegal address, a launch failure, ... : see
// CUDAError.Sticky) seen by any call leaves the device's context unusable;
// from then on every method of every *CUDA for that device returns an error
// wrapping that same *CUDAError without calling CUDA.
type CUDA struct {
	state       *deviceState
	info        Info
	granularity uint64
	vmm, pools  bool
	share       bool // ShareableMemory works: vmm, and POSIX file descriptor handles
	closed      atomic.Bool
}

// Open loads the CUDA libraries (once per process), makes device index
// current, which creates its primary context, and returns a handle to it.
//
// Errors: without cgo, without a loadable libcudart (12 or newer) and
// libcuda.so.1, or without a usable driver or device, the error wraps
// ErrNoDriver and says what was tried; an index past the device count
// wraps ErrInvalidValue.
func Open(index int) (*CUDA, error) {
	if index < 0 {
		return nil, fmt.Errorf("cudart: open device %d: negative device index: %w", index, ErrInvalidValue)
	}
	l := load()
	if l.err != nil {
		return nil, l.err
	}
	if l.runtimeVersion < minRuntimeVersion {
		return nil, fmt.Errorf("cudart: %s is CUDA runtime %s; cudart needs %s or newer: %w",
			l.runtimePath, versionString(l.runtimeVersion), versionString(minRuntimeVersion), ErrNoDriver)
	}
	st := stateFor(index)
	if e := st.sticky.Load(); e != nil {
		return nil, fmt.Errorf("cudart: open device %d: the device had a sticky error; restart the process: %w", index, e)
	}
	raw, e := shimOpen(index)
	if e != nil {
		if e.Sticky {
			st.sticky.CompareAndSwap(nil, e)
		}
		switch {
		case noDriverCodes[e.Code]:
			return nil, fmt.Errorf("cudart: open device %d: %w: %w", index, ErrNoDriver, e)
		case e.Code == 101: // cudaErrorInvalidDevice, CUDA_ERROR_INVALID_DEVICE
			return nil, fmt.Errorf("cudart: open device %d: no such device: %w: %w", index, ErrInvalidValue, e)
		}
		return nil, fmt.Errorf("cudart: open device %d: %w", index, e)
	}
	prefix := "GPU"
	if raw.hasUUIDv1 && raw.uuidV1 != raw.uuid {
		prefix = "MIG" // _v2 names the MIG instance, the old call the GPU
	}
	c := &CUDA{
		state: st,
		info: Info{
			Index:       index,
			Name:        raw.name,
			UUID:        formatUUID(prefix, raw.uuid),
			TotalMemory: raw.total,
		},
		granularity: raw.granularity,
		vmm:         raw.vmm && raw.granularity > 0,
		pools:       raw.pools,
	}
	c.share = c.vmm && raw.share
	return c, nil
}

// formatUUID writes a UUID in nvidia-smi's form, "GPU-8-4-4-4-12" in hex.
func formatUUID(prefix string, b [16]byte) string {
	return fmt.Sprintf("%s-%x-%x-%x-%x-%x", prefix, b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// DeviceCount returns the number of CUDA devices visible to this process
// (cudaGetDeviceCount, which honours CUDA_VISIBLE_DEVICES). A machine with
// a driver but no device gives 0 and no error; a machine without the
// libraries or with an unusable driver gives an error wrapping ErrNoDriver.
func DeviceCount() (int, error) {
	l := load()
	if l.err != nil {
		return 0, l.err
	}
	n, e := shimDeviceCount()
	if e != nil {
		if e.Code == 100 { // cudaErrorNoDevice
			return 0, nil
		}
		if noDriverCodes[e.Code] {
			return 0, fmt.Errorf("cudart: device count: %w: %w", ErrNoDriver, e)
		}
		return 0, fmt.Errorf("cudart: device count: %w", e)
	}
	return n, nil
}

// Probe loads the CUDA libraries (once per process) and reports their
// versions and paths. It creates no context. The error wraps ErrNoDriver
// when the libraries cannot be loaded.
func Probe() (Versions, error) {
	l := load()
	if l.err != nil {
		return Versions{}, l.err
	}
	return Versions{Runtime: l.runtimeVersion, Driver: l.driverVersion, RuntimeLibrary: l.runtimePath, DriverLibrary: l.driverPath}, nil
}

// ListDevices opens every visible device in turn and returns its
// description and free memory (what `allocd devices` prints). Opening
// creates each device's primary context, which itself takes some device
// memory (a few hundred MiB) for the life of the process. Errors are those
// of DeviceCount and Open; devices listed before a failure are returned
// with it.
func ListDevices() ([]DeviceStatus, error) {
	n, err := DeviceCount()
	if err != nil {
		return nil, err
	}
	out := make([]DeviceStatus, 0, n)
	for i := 0; i < n; i++ {
		c, err := Open(i)
		if err != nil {
			return out, err
		}
		free, _, err := c.MemGetInfo()
		_ = c.Close()
		if err != nil {
			return out, err
		}
		out = append(out, DeviceStatus{Info: c.Info(), FreeMemory: free})
	}
	return out, nil
}

// usable returns the error for a call on a closed handle, a zero CUDA, or a
// device with a sticky error; nil otherwise. It allocates only on failure.
func (c *CUDA) usable(op string) error {
	if c.state == nil {
		return fmt.Errorf("cudart: %s on a CUDA value not made by Open: %w", op, ErrClosed)
	}
	if c.closed.Load() {
		return fmt.Errorf("cudart: device %d: %s: %w", c.state.index, op, ErrClosed)
	}
	if e := c.state.sticky.Load(); e != nil {
		return fmt.Errorf("cudart: device %d: %s not attempted: the device had a sticky error; restart the process: %w",
			c.state.index, op, e)
	}
	return nil
}

// fail wraps a CUDA error with the device and what was being done, and
// records a sticky error for the device.
func (c *CUDA) fail(what string, e *CUDAError) error {
	if e.Sticky {
		c.state.sticky.CompareAndSwap(nil, e)
	}
	return fmt.Errorf("cudart: device %d: %s: %w", c.state.index, what, e)
}

func (c *CUDA) invalid(format string, args ...any) error {
	return fmt.Errorf("cudart: device %d: %s: %w", c.state.index, fmt.Sprintf(format, args...), ErrInvalidValue)
}

func (c *CUDA) notSupported(what string) error {
	return fmt.Errorf("cudart: device %d (%s): %s: %w", c.state.index, c.info.Name, what, ErrNotSupported)
}

// isDefaultStream reports the stream handles that always exist: 0 (the
// legacy default stream), cudaStreamLegacy (1) and cudaStreamPerThread (2).
func isDefaultStream(s Stream) bool { return s <= 2 }

// Info returns the device's index, name, UUID ("GPU-..." or, for a MIG
// instance, "MIG-...") and total memory, as read at Open. It works after
// Close.
func (c *CUDA) Info() Info { return c.info }

// Malloc allocates size bytes with cudaMalloc. A size of 0 is an error
// wrapping ErrInvalidValue; a request the device cannot satisfy returns an
// error for which errors.Is(err, ErrOutOfMemory) holds and whose text names
// cudaErrorMemoryAllocation. The device stays usable after an OOM.
func (c *CUDA) Malloc(size uint64) (Ptr, error) {
	if err := c.usable("malloc"); err != nil {
		return 0, err
	}
	if size == 0 {
		return 0, c.invalid("malloc of 0 bytes")
	}
	p, e := shimMalloc(c.state.index, size)
	if e != nil {
		return 0, c.fail(fmt.Sprintf("malloc of %d bytes", size), e)
	}
	return p, nil
}

// Free releases memory from Malloc with cudaFree, which waits for the
// device to finish its queued work first. Free(0) is an error wrapping
// ErrInvalidValue (it is never a live allocation).
func (c *CUDA) Free(p Ptr) error {
	if err := c.usable("free"); err != nil {
		return err
	}
	if p == 0 {
		return c.invalid("free of the zero pointer")
	}
	if e := shimFree(c.state.index, p); e != nil {
		return c.fail(fmt.Sprintf("free of %#x", uint64(p)), e)
	}
	return nil
}

// MemGetInfo reports the device's free and total memory (cudaMemGetInfo).
func (c *CUDA) MemGetInfo() (free, total uint64, err error) {
	if err := c.usable("mem get info"); err != nil {
		return 0, 0, err
	}
	f, t, e := shimMemGetInfo(c.state.index)
	if e != nil {
		return 0, 0, c.fail("mem get info", e)
	}
	return f, t, nil
}

// Synchronize waits for all work on the device (cudaDeviceSynchronize).
func (c *CUDA) Synchronize() error {
	if err := c.usable("synchronize"); err != nil {
		return err
	}
	if e := shimDeviceSynchronize(c.state.index); e != nil {
		return c.fail("synchronize", e)
	}
	return nil
}

// StreamCreate creates a non-blocking stream (cudaStreamCreateWithFlags
// with cudaStreamNonBlocking). The caller owns it: Close does not destroy
// it.
func (c *CUDA) StreamCreate() (Stream, error) {
	if err := c.usable("stream create"); err != nil {
		return 0, err
	}
	s, e := shimStreamCreate(c.state.index)
	if e != nil {
		return 0, c.fail("stream create", e)
	}
	c.state.mu.Lock()
	c.state.streams[s] = true
	c.state.mu.Unlock()
	return s, nil
}

// StreamDestroy destroys a stream (cudaStreamDestroy). The default stream
// handles (0, cudaStreamLegacy, cudaStreamPerThread) and a stream already
// destroyed through this package are refused with ErrInvalidValue without
// calling CUDA.
func (c *CUDA) StreamDestroy(s Stream) error {
	if err := c.usable("stream destroy"); err != nil {
		return err
	}
	if isDefaultStream(s) {
		return c.invalid("stream destroy: the default stream %d cannot be destroyed", uint64(s))
	}
	c.state.mu.Lock()
	live, known := c.state.streams[s]
	c.state.mu.Unlock()
	if known && !live {
		return c.invalid("stream destroy: stream %#x was already destroyed", uint64(s))
	}
	if e := shimStreamDestroy(c.state.index, s); e != nil {
		return c.fail(fmt.Sprintf("stream destroy %#x", uint64(s)), e)
	}
	c.state.mu.Lock()
	c.state.streams[s] = false
	c.state.mu.Unlock()
	return nil
}

// StreamSynchronize waits for the work queued on s (cudaStreamSynchronize).
func (c *CUDA) StreamSynchronize(s Stream) error {
	if err := c.usable("stream synchronize"); err != nil {
		return err
	}
	if e := shimStreamSynchronize(c.state.index, s); e != nil {
		return c.fail(fmt.Sprintf("stream synchronize %#x", uint64(s)), e)
	}
	return nil
}

// CheckStream returns nil when s is usable: a default stream handle, a
// stream made by StreamCreate and not destroyed, or any other handle for
// which cudaStreamQuery answers cudaSuccess or cudaErrorNotReady (a stream
// made by other code in the process). Otherwise the error wraps
// ErrInvalidValue. A stream destroyed through this package, and a handle
// that does not point to readable memory, are refused without calling CUDA.
//
// Any other handle goes to cudaStreamQuery, and CUDA does not validate
// handles: with CUDA 13.0 and driver 580 (H200, 2026-12) a handle to
// readable memory that is not a live stream (garbage, or a stream destroyed
// by code outside this package) crashes the process with SIGSEGV inside
// libcuda. CheckStream therefore catches mistakes with streams made here and
// wild pointers, not arbitrary garbage.
func (c *CUDA) CheckStream(s Stream) error {
	if err := c.usable("check stream"); err != nil {
		return err
	}
	if isDefaultStream(s) {
		return nil
	}
	c.state.mu.Lock()
	live, known := c.state.streams[s]
	c.state.mu.Unlock()
	if known {
		if live {
			return nil
		}
		return c.invalid("check stream: stream %#x was destroyed", uint64(s))
	}
	e := shimStreamCheck(c.state.index, s)
	if e == nil {
		return nil
	}
	if e.Sticky {
		return c.fail(fmt.Sprintf("check stream %#x", uint64(s)), e)
	}
	return fmt.Errorf("cudart: device %d: check stream %#x: %w: %w", c.state.index, uint64(s), ErrInvalidValue, e)
}

// EventCreate creates an event with timing disabled
// (cudaEventCreateWithFlags with cudaEventDisableTiming). The caller owns
// it: Close does not destroy it.
func (c *CUDA) EventCreate() (Event, error) {
	if err := c.usable("event create"); err != nil {
		return 0, err
	}
	ev, e := shimEventCreate(c.state.index)
	if e != nil {
		return 0, c.fail("event create", e)
	}
	return ev, nil
}

// EventRecord records ev on s (cudaEventRecord). The zero Event is refused
// with ErrInvalidValue.
func (c *CUDA) EventRecord(ev Event, s Stream) error {
	if err := c.usable("event record"); err != nil {
		return err
	}
	if ev == 0 {
		return c.invalid("event record: the zero event")
	}
	if e := shimEventRecord(c.state.index, ev, s); e != nil {
		return c.fail(fmt.Sprintf("event record %#x on stream %#x", uint64(ev), uint64(s)), e)
	}
	return nil
}

// EventQuery reports whether ev has completed (cudaEventQuery), without
// blocking: cudaErrorNotReady is "not done", not an error. An event never
// recorded counts as done. The zero Event is refused with ErrInvalidValue.
func (c *CUDA) EventQuery(ev Event) (bool, error) {
	if err := c.usable("event query"); err != nil {
		return false, err
	}
	if ev == 0 {
		return false, c.invalid("event query: the zero event")
	}
	done, e := shimEventQuery(c.state.index, ev)
	if e != nil {
		return false, c.fail(fmt.Sprintf("event query %#x", uint64(ev)), e)
	}
	return done, nil
}

// EventSynchronize blocks until ev has completed (cudaEventSynchronize).
func (c *CUDA) EventSynchronize(ev Event) error {
	if err := c.usable("event synchronize"); err != nil {
		return err
	}
	if ev == 0 {
		return c.invalid("event synchronize: the zero event")
	}
	if e := shimEventSynchronize(c.state.index, ev); e != nil {
		return c.fail(fmt.Sprintf("event synchronize %#x", uint64(ev)), e)
	}
	return nil
}

// StreamWaitEvent makes the work queued on s after this call wait, on the
// device, until ev as last recorded has completed (cudaStreamWaitEvent);
// the host does not wait. It implements StreamWaiter.
func (c *CUDA) StreamWaitEvent(s Stream, ev Event) error {
	if err := c.usable("stream wait event"); err != nil {
		return err
	}
	if ev == 0 {
		return c.invalid("stream wait event: the zero event")
	}
	if e := shimStreamWaitEvent(c.state.index, s, ev); e != nil {
		return c.fail(fmt.Sprintf("stream %#x wait event %#x", uint64(s), uint64(ev)), e)
	}
	return nil
}

// EventDestroy destroys ev (cudaEventDestroy).
func (c *CUDA) EventDestroy(ev Event) error {
	if err := c.usable("event destroy"); err != nil {
		return err
	}
	if ev == 0 {
		return c.invalid("event destroy: the zero event")
	}
	if e := shimEventDestroy(c.state.index, ev); e != nil {
		return c.fail(fmt.Sprintf("event destroy %#x", uint64(ev)), e)
	}
	return nil
}

// MemsetAsync queues setting size bytes at p to value on s
// (cudaMemsetAsync). A size of 0 does nothing; the zero pointer is refused
// with ErrInvalidValue.
func (c *CUDA) MemsetAsync(p Ptr, value byte, size uint64, s Stream) error {
	if err := c.usable("memset"); err != nil {
		return err
	}
	if size == 0 {
		return nil
	}
	if p == 0 {
		return c.invalid("memset of the zero pointer")
	}
	if e := shimMemsetAsync(c.state.index, p, value, size, s); e != nil {
		return c.fail(fmt.Sprintf("memset of %d bytes at %#x on stream %#x", size, uint64(p), uint64(s)), e)
	}
	return nil
}

// Memset sets size bytes at p to value (cudaMemset: ordered on the legacy
// default stream and returning once queued, like CUDA's). A size of 0 does
// nothing; the zero pointer is refused with ErrInvalidValue.
func (c *CUDA) Memset(p Ptr, value byte, size uint64) error {
	if err := c.usable("memset"); err != nil {
		return err
	}
	if size == 0 {
		return nil
	}
	if p == 0 {
		return c.invalid("memset of the zero pointer")
	}
	if e := shimMemset(c.state.index, p, value, size); e != nil {
		return c.fail(fmt.Sprintf("memset of %d bytes at %#x", size, uint64(p)), e)
	}
	return nil
}

// MemcpyHtoD copies src to device address dst (cudaMemcpy host to device),
// returning when the copy is done. An empty src does nothing.
func (c *CUDA) MemcpyHtoD(dst Ptr, src []byte) error {
	if err := c.usable("memcpy host to device"); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	if dst == 0 {
		return c.invalid("memcpy host to device: the zero pointer")
	}
	if e := shimMemcpyHtoD(c.state.index, dst, src); e != nil {
		return c.fail(fmt.Sprintf("memcpy of %d bytes host to device %#x", len(src), uint64(dst)), e)
	}
	return nil
}

// MemcpyDtoH copies len(dst) bytes from device address src into dst
// (cudaMemcpy device to host), returning when the copy is done. An empty
// dst does nothing.
func (c *CUDA) MemcpyDtoH(dst []byte, src Ptr) error {
	if err := c.usable("memcpy device to host"); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	if src == 0 {
		return c.invalid("memcpy device to host: the zero pointer")
	}
	if e := shimMemcpyDtoH(c.state.index, dst, src); e != nil {
		return c.fail(fmt.Sprintf("memcpy of %d bytes device %#x to host", len(dst), uint64(src)), e)
	}
	return nil
}

// Close marks the handle closed; later calls on it return errors wrapping
// ErrClosed (a second Close too). It destroys nothing: allocations,
// streams, events and mappings belong to the caller, and the device's
// primary context lives as long as the process. Other handles to the same
// device are unaffected.
func (c *CUDA) Close() error {
	if c.state == nil {
		return fmt.Errorf("cudart: close of a CUDA value not made by Open: %w", ErrClosed)
	}
	if !c.closed.CompareAndSwap(false, true) {
		return fmt.Errorf("cudart: device %d: close: %w", c.state.index, ErrClosed)
	}
	return nil
}

// MallocAsync allocates size bytes ordered on stream s from the device's
// current memory pool (cudaMallocAsync). The first call for a device sets
// the default pool's release threshold to the maximum (as PyTorch's
// cudaMallocAsync backend does), so the pool keeps freed memory until
// TrimPool. OOM is reported as for Malloc; a device without memory pools
// gives ErrNotSupported; a size of 0 gives ErrInvalidValue.
func (c *CUDA) MallocAsync(size uint64, s Stream) (Ptr, error) {
	if err := c.usable("malloc async"); err != nil {
		return 0, err
	}
	if !c.pools {
		return 0, c.notSupported("malloc async: the device has no stream-ordered memory pools")
	}
	if size == 0 {
		return 0, c.invalid("malloc async of 0 bytes")
	}
	p, e := shimMallocAsync(c.state.index, size, s)
	if e != nil {
		return 0, c.fail(fmt.Sprintf("malloc async of %d bytes on stream %#x", size, uint64(s)), e)
	}
	return p, nil
}

// FreeAsync frees p, from MallocAsync, ordered on stream s (cudaFreeAsync).
func (c *CUDA) FreeAsync(p Ptr, s Stream) error {
	if err := c.usable("free async"); err != nil {
		return err
	}
	if !c.pools {
		return c.notSupported("free async: the device has no stream-ordered memory pools")
	}
	if p == 0 {
		return c.invalid("free async of the zero pointer")
	}
	if e := shimFreeAsync(c.state.index, p, s); e != nil {
		return c.fail(fmt.Sprintf("free async of %#x on stream %#x", uint64(p), uint64(s)), e)
	}
	return nil
}

// TrimPool synchronises the device, so that every FreeAsync has completed,
// then returns all unused memory of the device's default pool to the
// system (cudaMemPoolTrimTo(pool, 0)).
func (c *CUDA) TrimPool() error {
	if err := c.usable("trim pool"); err != nil {
		return err
	}
	if !c.pools {
		return c.notSupported("trim pool: the device has no stream-ordered memory pools")
	}
	if e := shimTrimPool(c.state.index); e != nil {
		return c.fail("trim pool", e)
	}
	return nil
}

// PoolUsage implements PoolReporter for the device's default pool (the one
// MallocAsync draws from unless other code changed the device's current
// pool): reserved is what the pool holds from the device
// (cudaMemPoolAttrReservedMemCurrent), used what live allocations take
// (cudaMemPoolAttrUsedMemCurrent). A device without memory pools gives
// ErrNotSupported.
func (c *CUDA) PoolUsage() (reserved, used uint64, err error) {
	if err := c.usable("pool usage"); err != nil {
		return 0, 0, err
	}
	if !c.pools {
		return 0, 0, c.notSupported("pool usage: the device has no stream-ordered memory pools")
	}
	r, u, e := shimPoolUsage(c.state.index)
	if e != nil {
		return 0, 0, c.fail("pool usage", e)
	}
	return r, u, nil
}

// Granularity returns the minimum granularity of physical allocations and
// mappings on this device (cuMemGetAllocationGranularity, read at Open; 2
// MiB on current GPUs). Devices without virtual memory management give
// ErrNotSupported.
func (c *CUDA) Granularity() (uint64, error) {
	if err := c.usable("granularity"); err != nil {
		return 0, err
	}
	if !c.vmm {
		return 0, c.notSupported("virtual memory management")
	}
	return c.granularity, nil
}

func (c *CUDA) vmmSize(op string, size uint64) error {
	if err := c.usable(op); err != nil {
		return err
	}
	if !c.vmm {
		return c.notSupported(op + ": virtual memory management")
	}
	if size == 0 || size%c.granularity != 0 {
		return c.invalid("%s: size %d is not a positive multiple of the granularity %d", op, size, c.granularity)
	}
	return nil
}

// Reserve reserves size bytes of virtual address space
// (cuMemAddressReserve, default alignment). size must be a positive
// multiple of Granularity, else ErrInvalidValue.
func (c *CUDA) Reserve(size uint64) (Ptr, error) {
	if err := c.vmmSize("reserve", size); err != nil {
		return 0, err
	}
	p, e := shimVMMReserve(c.state.index, size)
	if e != nil {
		return 0, c.fail(fmt.Sprintf("reserve %d bytes of address space", size), e)
	}
	return p, nil
}

// ReleaseRange frees a reservation made by Reserve (cuMemAddressFree); p and
// size must be the reservation's. Every mapping in it must be unmapped first.
func (c *CUDA) ReleaseRange(p Ptr, size uint64) error {
	if err := c.vmmSize("release range", size); err != nil {
		return err
	}
	if e := shimVMMAddressFree(c.state.index, p, size); e != nil {
		return c.fail(fmt.Sprintf("release range %#x+%d", uint64(p), size), e)
	}
	return nil
}

// Create allocates size bytes of pinned physical memory on the device
// (cuMemCreate). size must be a positive multiple of Granularity, else
// ErrInvalidValue; a request the device cannot satisfy gives an error
// wrapping ErrOutOfMemory (CUDA_ERROR_OUT_OF_MEMORY).
func (c *CUDA) Create(size uint64) (Handle, error) {
	if err := c.vmmSize("create", size); err != nil {
		return 0, err
	}
	h, e := shimVMMCreate(c.state.index, size)
	if e != nil {
		return 0, c.fail(fmt.Sprintf("create %d bytes of physical memory", size), e)
	}
	return h, nil
}

// Release frees physical memory made by Create (cuMemRelease). Memory still
// mapped is freed once its last mapping is unmapped.
func (c *CUDA) Release(h Handle) error {
	if err := c.usable("release"); err != nil {
		return err
	}
	if !c.vmm {
		return c.notSupported("release: virtual memory management")
	}
	if e := shimVMMRelease(c.state.index, h); e != nil {
		return c.fail(fmt.Sprintf("release handle %#x", uint64(h)), e)
	}
	return nil
}

// Map maps the physical memory h at p (size bytes, from offset 0 of h) and
// grants this device read/write access (cuMemMap, cuMemSetAccess); if access
// cannot be granted the mapping is undone. size must be a positive multiple
// of Granularity, else ErrInvalidValue.
func (c *CUDA) Map(p Ptr, size uint64, h Handle) error {
	if err := c.vmmSize("map", size); err != nil {
		return err
	}
	if e := shimVMMMap(c.state.index, p, size, h); e != nil {
		return c.fail(fmt.Sprintf("map handle %#x at %#x+%d", uint64(h), uint64(p), size), e)
	}
	return nil
}

// MapRange maps hs[i] at p + i*page for every i and then grants this
// device read/write access to the whole range with one cuMemSetAccess
// (RangeMapper). page must be a positive multiple of Granularity, else
// ErrInvalidValue; on error nothing stays mapped.
func (c *CUDA) MapRange(p Ptr, page uint64, hs []Handle) error {
	if len(hs) == 0 {
		return nil
	}
	if err := c.vmmSize("map", page); err != nil {
		return err
	}
	if e := shimVMMMapRange(c.state.index, p, page, hs); e != nil {
		return c.fail(fmt.Sprintf("map %d handles at %#x, %d bytes each", len(hs), uint64(p), page), e)
	}
	return nil
}

// Unmap unmaps size bytes at p (cuMemUnmap). size must be a positive
// multiple of Granularity, else ErrInvalidValue.
func (c *CUDA) Unmap(p Ptr, size uint64) error {
	if err := c.vmmSize("unmap", size); err != nil {
		return err
	}
	if e := shimVMMUnmap(c.state.index, p, size); e != nil {
		return c.fail(fmt.Sprintf("unmap %#x+%d", uint64(p), size), e)
	}
	return nil
}

// shareCheck is vmmSize for the sharing calls (checkSize false: no size to
// check): it also refuses, with ErrNotSupported, a device or driver that
// cannot share memory as POSIX file descriptors.
func (c *CUDA) shareCheck(op string, size uint64, checkSize bool) error {
	if err := c.usable(op); err != nil {
		return err
	}
	if !c.share {
		return c.notSupported(op + ": sharing physical memory as POSIX file descriptors " +
			"(virtual memory management, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, " +
			"cuMemExportToShareableHandle and cuMemImportFromShareableHandle)")
	}
	if checkSize {
		return c.vmmSize(op, size)
	}
	return nil
}

// shareFail is fail for the sharing calls: CUDA_ERROR_NOT_SUPPORTED also
// wraps ErrNotSupported.
func (c *CUDA) shareFail(what string, e *CUDAError) error {
	if e.Code == 801 { // cudaErrorNotSupported, CUDA_ERROR_NOT_SUPPORTED
		return fmt.Errorf("cudart: device %d: %s: %w: %w", c.state.index, what, ErrNotSupported, e)
	}
	return c.fail(what, e)
}

// CreateShareable allocates size bytes of pinned physical memory that
// Export can share (cuMemCreate with requestedHandleTypes
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). Its errors are Create's; a
// device or driver that cannot share memory as POSIX file descriptors
// (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, read at
// Open, or a libcuda without cuMemExportToShareableHandle and
// cuMemImportFromShareableHandle) gives ErrNotSupported. Release frees it.
func (c *CUDA) CreateShareable(size uint64) (Handle, error) {
	if err := c.shareCheck("create shareable", size, true); err != nil {
		return 0, err
	}
	h, e := shimVMMCreateShareable(c.state.index, size)
	if e != nil {
		return 0, c.shareFail(fmt.Sprintf("create %d bytes of shareable physical memory", size), e)
	}
	return h, nil
}

// Export returns a new POSIX file descriptor for h
// (cuMemExportToShareableHandle), which CreateShareable made or Import
// returned. The descriptor is close-on-exec; the caller owns it and closes
// it, and h stays valid. A handle the driver cannot export (one from
// Create: CUDA_ERROR_INVALID_VALUE, so ErrInvalidValue) gives the driver's
// error; a device that cannot share gives ErrNotSupported. On error the
// descriptor is -1.
func (c *CUDA) Export(h Handle) (int, error) {
	if err := c.shareCheck("export", 0, false); err != nil {
		return -1, err
	}
	fd, e := shimVMMExport(c.state.index, h)
	if e != nil {
		return -1, c.shareFail(fmt.Sprintf("export handle %#x", uint64(h)), e)
	}
	return fd, nil
}

// Import returns a handle to the physical memory behind fd, a descriptor
// from Export in this process or another (cuMemImportFromShareableHandle),
// which Map and Release take as any other handle. fd is not consumed: the
// caller still closes it. size must be a positive multiple of Granularity
// and fd a descriptor from Export, else ErrInvalidValue. The driver does
// not tell an imported handle's size, so size is not checked against the
// memory here: Map of more than the memory holds fails there (with
// CUDA_ERROR_NOT_SUPPORTED on an H200), and Map of less maps the memory's
// first size bytes. A device that cannot share gives ErrNotSupported.
// Release drops this process's reference; importing in the process that
// exported gives a handle of its own, which Release drops as well.
func (c *CUDA) Import(fd int, size uint64) (Handle, error) {
	if err := c.shareCheck("import", size, true); err != nil {
		return 0, err
	}
	if fd < 0 {
		return 0, c.invalid("import of descriptor %d", fd)
	}
	h, e := shimVMMImport(c.state.index, fd)
	if e != nil {
		what := fmt.Sprintf("import %d bytes from descriptor %d", size, fd)
		if e.Code == 999 && !e.Sticky {
			// CUDA_ERROR_UNKNOWN is the driver's answer to a descriptor
			// that is not open or not one of its exports (driver 580,
			// H200); the device stays usable.
			return 0, fmt.Errorf("cudart: device %d: %s: not a descriptor from Export: %w: %w", c.state.index, what, ErrInvalidValue, e)
		}
		return 0, c.shareFail(what, e)
	}
	return h, nil
}
