//go:build !cgo

// This file stands in for cuda.go when the binary is built without cgo
// (CGO_ENABLED=0): there is then no way to dlopen the CUDA libraries, so
// Open, DeviceCount, Probe and ListDevices fail with an error wrapping
// ErrNoDriver that says why. The shim* stubs below are never reached, since
// no *CUDA can be opened.

package cudart

import "fmt"

// builtWithCgo reports whether this binary can reach CUDA at all.
const builtWithCgo = false

var errNoCgo = fmt.Errorf("cudart: this binary was built without cgo (CGO_ENABLED=0), so it cannot load the CUDA libraries "+
	"(libcudart.so.13, libcudart.so.12, libcudart.so, libcuda.so.1); rebuild with CGO_ENABLED=1 and a C compiler: %w", ErrNoDriver)

func platformLoad() loadResult { return loadResult{err: errNoCgo} }

func tryLibraries(what string, candidates []string) (string, error) { return "", errNoCgo }

// ABIAssumptions returns the error codes this package's tables assume, keyed
// by their enum names. Without cgo the struct layouts and enum values of
// the C shim are not compiled in, so only the Go-side entries are present.
func ABIAssumptions() map[string]int64 { return goABIAssumptions() }

func shimErrorName(code int, driver bool) (name, text string, ok bool) { return "", "", false }

func nocgo() *CUDAError {
	return &CUDAError{Op: "cudart", Code: 999, Name: "cudaErrorUnknown", Text: errNoCgo.Error()}
}

func shimDeviceCount() (int, *CUDAError)                        { return 0, nocgo() }
func shimOpen(int) (rawInfo, *CUDAError)                        { return rawInfo{}, nocgo() }
func shimMalloc(int, uint64) (Ptr, *CUDAError)                  { return 0, nocgo() }
func shimFree(int, Ptr) *CUDAError                              { return nocgo() }
func shimMemGetInfo(int) (uint64, uint64, *CUDAError)           { return 0, 0, nocgo() }
func shimDeviceSynchronize(int) *CUDAError                      { return nocgo() }
func shimMemset(int, Ptr, byte, uint64) *CUDAError              { return nocgo() }
func shimMemsetAsync(int, Ptr, byte, uint64, Stream) *CUDAError { return nocgo() }
func shimMemcpyHtoD(int, Ptr, []byte) *CUDAError                { return nocgo() }
func shimMemcpyDtoH(int, []byte, Ptr) *CUDAError                { return nocgo() }
func shimStreamCreate(int) (Stream, *CUDAError)                 { return 0, nocgo() }
func shimStreamDestroy(int, Stream) *CUDAError                  { return nocgo() }
func shimStreamSynchronize(int, Stream) *CUDAError              { return nocgo() }
func shimStreamCheck(int, Stream) *CUDAError                    { return nocgo() }
func shimEventCreate(int) (Event, *CUDAError)                   { return 0, nocgo() }
func shimEventRecord(int, Event, Stream) *CUDAError             { return nocgo() }
func shimEventQuery(int, Event) (bool, *CUDAError)              { return false, nocgo() }
func shimEventSynchronize(int, Event) *CUDAError                { return nocgo() }
func shimStreamWaitEvent(int, Stream, Event) *CUDAError         { return nocgo() }
func shimEventDestroy(int, Event) *CUDAError                    { return nocgo() }
func shimMallocAsync(int, uint64, Stream) (Ptr, *CUDAError)     { return 0, nocgo() }
func shimFreeAsync(int, Ptr, Stream) *CUDAError                 { return nocgo() }
func shimTrimPool(int) *CUDAError                               { return nocgo() }
func shimPoolUsage(int) (uint64, uint64, *CUDAError)            { return 0, 0, nocgo() }
func shimVMMReserve(int, uint64) (Ptr, *CUDAError)              { return 0, nocgo() }
func shimVMMAddressFree(int, Ptr, uint64) *CUDAError            { return nocgo() }
func shimVMMCreate(int, uint64) (Handle, *CUDAError)            { return 0, nocgo() }
func shimVMMRelease(int, Handle) *CUDAError                     { return nocgo() }
func shimVMMMap(int, Ptr, uint64, Handle) *CUDAError            { return nocgo() }
func shimVMMUnmap(int, Ptr, uint64) *CUDAError                  { return nocgo() }
func shimVMMMapRange(int, Ptr, uint64, []Handle) *CUDAError     { return nocgo() }
func shimVMMCreateShareable(int, uint64) (Handle, *CUDAError)   { return 0, nocgo() }
func shimVMMExport(int, Handle) (int, *CUDAError)               { return -1, nocgo() }
func shimVMMImport(int, int) (Handle, *CUDAError)               { return 0, nocgo() }
