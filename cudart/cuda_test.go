package cudart

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// Tests of the real CUDA backend. Those that need a GPU open device 0 and
// skip (t.Skip) when Open reports ErrNoDriver, so `go test ./cudart/`
// passes on machines without CUDA, with cgo on or off. The rest check the
// loader's errors, the error tables, the sticky-error and closed-handle
// paths (on handles that never reach C), and the ABI description.

const (
	kib = 1 << 10
	mib = 1 << 20
	gib = 1 << 30
)

// openOrSkip opens device 0, skipping the test where there is no driver.
func openOrSkip(t *testing.T) *CUDA {
	t.Helper()
	c, err := Open(0)
	if errors.Is(err, ErrNoDriver) {
		msg, _, _ := strings.Cut(err.Error(), ";")
		t.Skipf("no CUDA driver (%s; ...)", msg)
	}
	if err != nil {
		t.Fatalf("Open(0): %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// fakeCUDA is a handle that was never opened on a device. Calls on it that
// get past argument checking would reach C, which (without libraries)
// would crash: the tests using it check paths that must not get there.
func fakeCUDA(index int) *CUDA {
	return &CUDA{
		state:       &deviceState{index: index, streams: map[Stream]bool{}},
		info:        Info{Index: index, Name: "fake"},
		granularity: 2 * mib,
	}
}

// ---- Without a GPU ------------------------------------------------------

func TestOpenWithoutDriverNamesLibraries(t *testing.T) {
	if _, err := Probe(); err == nil {
		t.Skip("the CUDA libraries load on this machine")
	}
	_, err := Open(0)
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Open(0) = %v, want an error wrapping ErrNoDriver", err)
	}
	msg := err.Error()
	t.Logf("Open(0): %v", err)
	if !builtWithCgo {
		if !strings.Contains(msg, "cgo") {
			t.Errorf("error %q does not say the binary lacks cgo", msg)
		}
		return
	}
	libs := []string{"libcudart.so.13", "libcudart.so.12", "libcudart.so"}
	if strings.Contains(msg, "cannot load the CUDA driver library") {
		libs = append(libs, "libcuda.so.1")
	}
	for _, lib := range libs {
		if !strings.Contains(msg, lib+" (") {
			t.Errorf("error does not name %s with dlerror's reason: %s", lib, msg)
		}
	}
	if !strings.Contains(msg, "cannot open shared object file") {
		t.Errorf("error does not carry dlerror's reason: %s", msg)
	}
	for name, f := range map[string]func() error{
		"DeviceCount": func() error { _, err := DeviceCount(); return err },
		"Probe":       func() error { _, err := Probe(); return err },
		"ListDevices": func() error { _, err := ListDevices(); return err },
	} {
		if err := f(); !errors.Is(err, ErrNoDriver) {
			t.Errorf("%s = %v, want an error wrapping ErrNoDriver", name, err)
		}
	}
}

func TestTryLibrariesNamesEveryCandidate(t *testing.T) {
	if !builtWithCgo {
		t.Skip("built without cgo")
	}
	cands := []string{"liballocd-does-not-exist.so.1", "/nonexistent/dir/libcudart.so.13"}
	_, err := tryLibraries("the CUDA runtime library", cands)
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("tryLibraries = %v, want ErrNoDriver", err)
	}
	for _, c := range cands {
		if !strings.Contains(err.Error(), c+" (") {
			t.Errorf("error does not name %s with its reason: %v", c, err)
		}
	}
	// libc is always there: the first loadable candidate wins and the
	// earlier failures do not matter.
	path, err := tryLibraries("libc", []string{"liballocd-does-not-exist.so.1", "libc.so.6"})
	if err != nil || path == "" {
		t.Fatalf("tryLibraries(libc.so.6) = %q, %v", path, err)
	}
	t.Logf("libc.so.6 resolved to %s", path)
}

func TestOpenNegativeIndex(t *testing.T) {
	if _, err := Open(-1); !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("Open(-1) = %v, want ErrInvalidValue", err)
	}
}

func TestErrorTables(t *testing.T) {
	e := newCUDAError("cudaMalloc", 2, false, "", "")
	if got, want := e.Error(), "cudaMalloc: cudaErrorMemoryAllocation: out of memory"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if !errors.Is(e, ErrOutOfMemory) || e.Sticky {
		t.Errorf("runtime code 2: Is(ErrOutOfMemory)=%v Sticky=%v", errors.Is(e, ErrOutOfMemory), e.Sticky)
	}
	d := newCUDAError("cuMemCreate", 2, true, "", "")
	if d.Name != "CUDA_ERROR_OUT_OF_MEMORY" || !errors.Is(d, ErrOutOfMemory) {
		t.Errorf("driver code 2 = %+v", d)
	}
	if u := newCUDAError("cudaFoo", 12345, false, "unrecognized error code", "unrecognized error code"); u.Name != "cudaError(12345)" || u.Text != "CUDA error 12345" {
		t.Errorf("unknown code = %+v", u)
	}
	if l := newCUDAError("cudaFoo", 700, false, "cudaErrorIllegalAddress", "library text"); !l.Sticky || l.Text != "library text" {
		t.Errorf("code 700 = %+v, want sticky with the library's text", l)
	}
	for _, code := range []int{1, 2, 100, 400, 600, 701, 801, 999} {
		if stickyCodes[code] {
			t.Errorf("code %d is marked sticky", code)
		}
	}
	for code := range stickyCodes {
		if _, ok := runtimeErrorNames[code]; !ok {
			t.Errorf("sticky code %d has no runtime name", code)
		}
		if _, ok := driverErrorNames[code]; !ok {
			t.Errorf("sticky code %d has no driver name", code)
		}
	}
	for _, table := range []map[int]string{runtimeErrorNames, driverErrorNames} {
		seen := map[string]int{}
		for c, n := range table {
			if o, dup := seen[n]; dup {
				t.Errorf("name %s used for codes %d and %d", n, o, c)
			}
			seen[n] = c
		}
	}
	for _, n := range abiErrorNames {
		if _, ok := goABIAssumptions()[n]; !ok {
			t.Errorf("abiErrorNames entry %s is in neither table", n)
		}
	}
}

func TestStickyErrorShortCircuits(t *testing.T) {
	c := fakeCUDA(7)
	c.vmm, c.pools = true, true
	other := &CUDA{state: c.state, info: c.info, granularity: c.granularity, vmm: true, pools: true}
	sticky := newCUDAError("cudaEventQuery", 719, false, "", "")
	if !sticky.Sticky {
		t.Fatal("cudaErrorLaunchFailure is not marked sticky")
	}
	first := c.fail("event query 0x1", sticky)
	if !errors.Is(first, sticky) {
		t.Fatalf("fail() = %v, does not wrap the sticky error", first)
	}
	// A second sticky error does not replace the first.
	_ = c.fail("event query 0x2", newCUDAError("cudaEventQuery", 700, false, "", ""))

	calls := map[string]func(*CUDA) error{
		"Malloc":            func(c *CUDA) error { _, err := c.Malloc(1); return err },
		"Free":              func(c *CUDA) error { return c.Free(0x1000) },
		"MemGetInfo":        func(c *CUDA) error { _, _, err := c.MemGetInfo(); return err },
		"Synchronize":       func(c *CUDA) error { return c.Synchronize() },
		"StreamCreate":      func(c *CUDA) error { _, err := c.StreamCreate(); return err },
		"StreamDestroy":     func(c *CUDA) error { return c.StreamDestroy(0x1000) },
		"StreamSynchronize": func(c *CUDA) error { return c.StreamSynchronize(0) },
		"CheckStream":       func(c *CUDA) error { return c.CheckStream(0x1000) },
		"EventCreate":       func(c *CUDA) error { _, err := c.EventCreate(); return err },
		"EventRecord":       func(c *CUDA) error { return c.EventRecord(1, 0) },
		"EventQuery":        func(c *CUDA) error { _, err := c.EventQuery(1); return err },
		"EventSynchronize":  func(c *CUDA) error { return c.EventSynchronize(1) },
		"EventDestroy":      func(c *CUDA) error { return c.EventDestroy(1) },
		"StreamWaitEvent":   func(c *CUDA) error { return c.StreamWaitEvent(0, 1) },
		"MemsetAsync":       func(c *CUDA) error { return c.MemsetAsync(0x1000, 0, 1, 0) },
		"Memset":            func(c *CUDA) error { return c.Memset(0x1000, 0, 1) },
		"MemcpyHtoD":        func(c *CUDA) error { return c.MemcpyHtoD(0x1000, []byte{1}) },
		"MemcpyDtoH":        func(c *CUDA) error { return c.MemcpyDtoH(make([]byte, 1), 0x1000) },
		"MallocAsync":       func(c *CUDA) error { _, err := c.MallocAsync(1, 0); return err },
		"FreeAsync":         func(c *CUDA) error { return c.FreeAsync(0x1000, 0) },
		"TrimPool":          func(c *CUDA) error { return c.TrimPool() },
		"PoolUsage":         func(c *CUDA) error { _, _, err := c.PoolUsage(); return err },
		"Granularity":       func(c *CUDA) error { _, err := c.Granularity(); return err },
		"Reserve":           func(c *CUDA) error { _, err := c.Reserve(2 * mib); return err },
		"ReleaseRange":      func(c *CUDA) error { return c.ReleaseRange(0x1000, 2*mib) },
		"Create":            func(c *CUDA) error { _, err := c.Create(2 * mib); return err },
		"Release":           func(c *CUDA) error { return c.Release(1) },
		"Map":               func(c *CUDA) error { return c.Map(0x1000, 2*mib, 1) },
		"Unmap":             func(c *CUDA) error { return c.Unmap(0x1000, 2*mib) },
	}
	for name, call := range calls {
		for i, h := range []*CUDA{c, other} {
			err := call(h)
			var ce *CUDAError
			if !errors.As(err, &ce) || ce != sticky {
				t.Errorf("%s on handle %d after a sticky error = %v, want the first sticky error", name, i, err)
			}
		}
	}
	if c.Info().Name != "fake" {
		t.Errorf("Info after a sticky error = %+v", c.Info())
	}
}

func TestClosedAndZeroHandles(t *testing.T) {
	c := fakeCUDA(8)
	if err := c.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := c.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("second Close = %v, want ErrClosed", err)
	}
	if _, err := c.Malloc(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Malloc after Close = %v, want ErrClosed", err)
	}
	if _, err := c.EventQuery(1); !errors.Is(err, ErrClosed) {
		t.Errorf("EventQuery after Close = %v, want ErrClosed", err)
	}
	if c.Info().Index != 8 {
		t.Errorf("Info after Close = %+v", c.Info())
	}
	var z CUDA
	if _, err := z.Malloc(1); !errors.Is(err, ErrClosed) {
		t.Errorf("Malloc on a zero CUDA = %v, want ErrClosed", err)
	}
	if err := z.Close(); !errors.Is(err, ErrClosed) {
		t.Errorf("Close on a zero CUDA = %v, want ErrClosed", err)
	}
}

func TestArgumentChecksNeverReachCUDA(t *testing.T) {
	c := fakeCUDA(9)
	invalid := map[string]error{}
	invalid["Malloc(0)"] = func() error { _, err := c.Malloc(0); return err }()
	invalid["Free(0)"] = c.Free(0)
	invalid["StreamDestroy(default)"] = c.StreamDestroy(DefaultStream)
	invalid["StreamDestroy(per-thread)"] = c.StreamDestroy(2)
	invalid["EventRecord(0)"] = c.EventRecord(0, 0)
	invalid["EventQuery(0)"] = func() error { _, err := c.EventQuery(0); return err }()
	invalid["EventSynchronize(0)"] = c.EventSynchronize(0)
	invalid["EventDestroy(0)"] = c.EventDestroy(0)
	invalid["StreamWaitEvent(0)"] = c.StreamWaitEvent(0, 0)
	invalid["MemsetAsync(nil)"] = c.MemsetAsync(0, 1, 10, 0)
	invalid["MemcpyHtoD(nil)"] = c.MemcpyHtoD(0, []byte{1})
	invalid["MemcpyDtoH(nil)"] = c.MemcpyDtoH([]byte{1}, 0)
	for name, err := range invalid {
		if !errors.Is(err, ErrInvalidValue) {
			t.Errorf("%s = %v, want ErrInvalidValue", name, err)
		}
	}
	for name, err := range map[string]error{
		"MemsetAsync(size 0)": c.MemsetAsync(0x1000, 1, 0, 0),
		"MemcpyHtoD(empty)":   c.MemcpyHtoD(0x1000, nil),
		"MemcpyDtoH(empty)":   c.MemcpyDtoH(nil, 0x1000),
		"CheckStream(0)":      c.CheckStream(DefaultStream),
		"CheckStream(legacy)": c.CheckStream(1),
	} {
		if err != nil {
			t.Errorf("%s = %v, want nil", name, err)
		}
	}
	// A stream this package destroyed is refused from the registry.
	c.state.streams[0xabc000] = false
	if err := c.CheckStream(0xabc000); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("CheckStream(destroyed) = %v, want ErrInvalidValue", err)
	}
	if err := c.StreamDestroy(0xabc000); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("StreamDestroy(destroyed) = %v, want ErrInvalidValue", err)
	}
	c.state.streams[0xdef000] = true
	if err := c.CheckStream(0xdef000); err != nil {
		t.Errorf("CheckStream(live) = %v", err)
	}
	// Capabilities the device lacks.
	for name, err := range map[string]error{
		"Granularity": func() error { _, err := c.Granularity(); return err }(),
		"Reserve":     func() error { _, err := c.Reserve(2 * mib); return err }(),
		"MallocAsync": func() error { _, err := c.MallocAsync(1, 0); return err }(),
		"TrimPool":    c.TrimPool(),
		"PoolUsage":   func() error { _, _, err := c.PoolUsage(); return err }(),
	} {
		if !errors.Is(err, ErrNotSupported) {
			t.Errorf("%s without the capability = %v, want ErrNotSupported", name, err)
		}
	}
	c.vmm, c.pools = true, true
	for name, err := range map[string]error{
		"Reserve(3)":       func() error { _, err := c.Reserve(3); return err }(),
		"Create(0)":        func() error { _, err := c.Create(0); return err }(),
		"Map(1 MiB)":       c.Map(0x1000, mib, 1),
		"Unmap(3 MiB)":     c.Unmap(0x1000, 3*mib),
		"ReleaseRange(0)":  c.ReleaseRange(0x1000, 0),
		"MallocAsync(0)":   func() error { _, err := c.MallocAsync(0, 0); return err }(),
		"FreeAsync(nil)":   c.FreeAsync(0, 0),
		"Reserve(2M+512)":  func() error { _, err := c.Reserve(2*mib + 512); return err }(),
		"Create(1 GiB+1)":  func() error { _, err := c.Create(gib + 1); return err }(),
		"Map(5 MiB)":       c.Map(0x1000, 5*mib, 1),
		"ReleaseRange(1M)": c.ReleaseRange(0x1000, mib),
	} {
		if !errors.Is(err, ErrInvalidValue) {
			t.Errorf("%s = %v, want ErrInvalidValue", name, err)
		}
	}
}

func TestVersionsString(t *testing.T) {
	v := Versions{Runtime: 13000, Driver: 13010, RuntimeLibrary: "/x/libcudart.so.13", DriverLibrary: "/y/libcuda.so.1"}
	if got, want := v.String(), "runtime 13.0 (/x/libcudart.so.13), driver 13.1 (/y/libcuda.so.1)"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
	if got, want := formatUUID("GPU", [16]byte{0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), "GPU-deadbeef-0102-0304-0506-0708090a0b0c"; got != want {
		t.Errorf("formatUUID = %q, want %q", got, want)
	}
}

// abicheckKeys reads the names abicheck.c prints from its source.
func abicheckKeys(t *testing.T, src string) []string {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	body := string(b)
	if i := strings.Index(body, "int main"); i >= 0 {
		body = body[i:]
	}
	var keys []string
	re := regexp.MustCompile(`\b([SOE])\(([A-Za-z_0-9]+)(?:, ([A-Za-z_0-9.]+))?\)`)
	for _, m := range re.FindAllStringSubmatch(body, -1) {
		switch m[1] {
		case "S":
			keys = append(keys, "sizeof."+m[2])
		case "O":
			keys = append(keys, "offsetof."+m[2]+"."+m[3])
		case "E":
			keys = append(keys, m[2])
		}
	}
	return keys
}

func findAbicheck() string {
	for _, p := range []string{os.Getenv("ALLOCD_ABICHECK"), "abicheck/abicheck.c", "abicheck.c", "../cudart/abicheck/abicheck.c"} {
		if p == "" {
			continue
		}
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

// TestABIKeysMatchAbicheck runs everywhere: every name abicheck.c prints
// must be one ABIAssumptions reports, and the other way round, so the
// comparison on a machine with headers cannot miss an entry.
func TestABIKeysMatchAbicheck(t *testing.T) {
	if !builtWithCgo {
		t.Skip("built without cgo: the shim's layout entries are not compiled in")
	}
	src := findAbicheck()
	if src == "" {
		t.Skip("abicheck.c not found")
	}
	keys := abicheckKeys(t, src)
	have := ABIAssumptions()
	if len(keys) != len(have) {
		t.Errorf("abicheck.c prints %d names, ABIAssumptions has %d", len(keys), len(have))
	}
	printed := map[string]bool{}
	for _, k := range keys {
		if printed[k] {
			t.Errorf("abicheck.c prints %s twice", k)
		}
		printed[k] = true
		if _, ok := have[k]; !ok {
			t.Errorf("abicheck.c prints %s, which ABIAssumptions lacks", k)
		}
	}
	for k := range have {
		if !printed[k] {
			t.Errorf("ABIAssumptions has %s, which abicheck.c does not print", k)
		}
	}
	for k, want := range map[string]int64{
		"sizeof.CUmemAllocationProp": 32, "sizeof.CUmemAccessDesc": 12, "sizeof.CUmemLocation": 8,
		"offsetof.CUmemAllocationProp.allocFlags": 24, "cudaErrorMemoryAllocation": 2, "cudaErrorNotReady": 600,
		"cudaMemPoolAttrReleaseThreshold": 4, "CU_MEM_ACCESS_FLAGS_PROT_READWRITE": 3,
	} {
		if have[k] != want {
			t.Errorf("ABIAssumptions[%s] = %d, want %d", k, have[k], want)
		}
	}
}

// TestABI compiles abicheck.c against CUDA's headers (where they are, as on
// the GPU machine) and compares its output with ABIAssumptions line by line.
func TestABI(t *testing.T) {
	const inc = "/usr/local/cuda/include"
	if _, err := os.Stat(filepath.Join(inc, "cuda.h")); err != nil {
		t.Skipf("no CUDA headers: %v", err)
	}
	if !builtWithCgo {
		t.Skip("built without cgo")
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skipf("no gcc: %v", err)
	}
	src := findAbicheck()
	if src == "" {
		t.Fatal("CUDA headers are here but abicheck.c is not (set ALLOCD_ABICHECK)")
	}
	bin := filepath.Join(t.TempDir(), "abicheck")
	if out, err := exec.Command(gcc, "-Wall", "-I"+inc, "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("gcc abicheck.c: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("abicheck: %v", err)
	}
	want := ABIAssumptions()
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	mismatches := 0
	for sc.Scan() {
		name, val, ok := strings.Cut(sc.Text(), "=")
		if !ok {
			t.Errorf("abicheck printed %q", sc.Text())
			continue
		}
		hv, err := strconv.ParseInt(val, 10, 64)
		if err != nil {
			t.Errorf("abicheck printed %q: %v", sc.Text(), err)
			continue
		}
		seen[name] = true
		sv, ok := want[name]
		switch {
		case !ok:
			t.Errorf("ABI %s: header=%d, shim has no value", name, hv)
			mismatches++
		case sv != hv:
			t.Errorf("ABI %s: header=%d shim=%d MISMATCH", name, hv, sv)
			mismatches++
		default:
			t.Logf("ABI %s: header=%d shim=%d ok", name, hv, sv)
		}
	}
	for name := range want {
		if !seen[name] {
			t.Errorf("ABI %s: shim assumes %d, abicheck does not print it", name, want[name])
			mismatches++
		}
	}
	t.Logf("ABI: %d entries compared, %d mismatches", len(seen), mismatches)
}

// mockEnv is set in the child process that TestShimAgainstMockCUDA runs.
const mockEnv = "ALLOCD_CUDART_MOCK"

// mockTests are the device tests TestShimAgainstMockCUDA runs against the
// mock libraries of testdata/mockcuda.
var mockTests = []string{
	"TestProbeAndCount", "TestInfo", "TestMallocFree", "TestMallocOOM", "TestMemsetMemcpyRoundTrip",
	"TestStreamsAndEvents", "TestCheckStreamBogusHandle", "TestMallocAsync", "TestVirtualMemory",
	"TestConcurrentUse", "TestCloseKeepsOtherHandles", "TestDeviceRestored", "TestHostMemory",
}

// TestShimAgainstMockCUDA covers the C shim and its Go plumbing on machines
// without a GPU: it builds stand-ins for libcudart and libcuda from
// testdata/mockcuda with gcc (host memory playing device memory) and runs
// the device tests against them in a child process, which loads them
// through $ALLOCD_CUDART and $ALLOCD_LIBCUDA.
func TestShimAgainstMockCUDA(t *testing.T) {
	if !builtWithCgo {
		t.Skip("built without cgo")
	}
	if os.Getenv(mockEnv) != "" {
		t.Skip("already the mock child")
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skipf("no gcc: %v", err)
	}
	dir := t.TempDir()
	rt, drv := filepath.Join(dir, "libcudart.so.13"), filepath.Join(dir, "libcuda.so.1")
	for lib, src := range map[string]string{rt: "testdata/mockcuda/cudart.c", drv: "testdata/mockcuda/cuda.c"} {
		if out, err := exec.Command(gcc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput(); err != nil {
			t.Skipf("cannot build the mock %s: %v\n%s", filepath.Base(lib), err, out)
		}
	}
	cmd := exec.Command(os.Args[0], "-test.run=^("+strings.Join(mockTests, "|")+")$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), mockEnv+"=1", "ALLOCD_CUDART="+rt, "ALLOCD_LIBCUDA="+drv)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("device tests against the mock libraries: %v\n%s", err, out)
	}
	for _, name := range mockTests {
		if !strings.Contains(string(out), "--- PASS: "+name+" ") {
			t.Errorf("%s did not pass against the mock libraries", name)
		}
	}
	if t.Failed() {
		t.Logf("child output:\n%s", out)
	}
}

// ---- On a GPU ----------------------------------------------------------

func TestProbeAndCount(t *testing.T) {
	openOrSkip(t)
	v, err := Probe()
	if err != nil {
		t.Fatalf("Probe: %v", err)
	}
	t.Logf("Probe: %v", v)
	if v.Runtime < minRuntimeVersion || v.Driver < v.Runtime/1000*1000 || v.RuntimeLibrary == "" || v.DriverLibrary == "" {
		t.Errorf("Probe = %+v", v)
	}
	n, err := DeviceCount()
	if err != nil || n < 1 {
		t.Fatalf("DeviceCount = %d, %v; want >= 1", n, err)
	}
	list, err := ListDevices()
	if err != nil || len(list) != n {
		t.Fatalf("ListDevices = %+v, %v; want %d devices", list, err, n)
	}
	for _, d := range list {
		t.Logf("device %d: %s %s total %d free %d", d.Index, d.Name, d.UUID, d.TotalMemory, d.FreeMemory)
		if d.FreeMemory == 0 || d.FreeMemory > d.TotalMemory {
			t.Errorf("device %d: free %d of %d", d.Index, d.FreeMemory, d.TotalMemory)
		}
	}
	if _, err := Open(n); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("Open(%d) past the last device = %v, want ErrInvalidValue", n, err)
	}
}

func TestInfo(t *testing.T) {
	c := openOrSkip(t)
	in := c.Info()
	t.Logf("Info: %+v", in)
	if in.Index != 0 || in.Name == "" || in.TotalMemory < gib {
		t.Errorf("Info = %+v", in)
	}
	if !regexp.MustCompile(`^(GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`).MatchString(in.UUID) {
		t.Errorf("UUID %q is not in nvidia-smi's form", in.UUID)
	}
	free, total, err := c.MemGetInfo()
	if err != nil || free == 0 || free > total {
		t.Fatalf("MemGetInfo = %d, %d, %v", free, total, err)
	}
	if total != in.TotalMemory {
		t.Logf("cudaMemGetInfo total %d differs from cuDeviceTotalMem %d", total, in.TotalMemory)
	}
	// Cross-check with nvidia-smi where there is exactly one GPU.
	if n, _ := DeviceCount(); n == 1 && os.Getenv(mockEnv) == "" {
		out, err := exec.Command("nvidia-smi", "--query-gpu=uuid,name", "--format=csv,noheader").Output()
		if err != nil {
			t.Logf("nvidia-smi: %v", err)
			return
		}
		line := strings.TrimSpace(string(out))
		t.Logf("nvidia-smi: %s", line)
		if uuid, name, _ := strings.Cut(line, ", "); uuid != in.UUID || name != in.Name {
			t.Errorf("nvidia-smi says %q %q, Info says %q %q", uuid, name, in.UUID, in.Name)
		}
	}
}

func TestMallocFree(t *testing.T) {
	c := openOrSkip(t)
	for _, size := range []uint64{1, 512, 4 * kib, mib + 3, 64 * mib} {
		p, err := c.Malloc(size)
		if err != nil {
			t.Fatalf("Malloc(%d): %v", size, err)
		}
		if p == 0 || p%512 != 0 {
			t.Errorf("Malloc(%d) = %#x, not 512-aligned", size, uint64(p))
		}
		if err := c.Free(p); err != nil {
			t.Fatalf("Free(%#x): %v", uint64(p), err)
		}
	}
	// How long the device calls take here (for the record, not a bound).
	var ds []time.Duration
	for range 21 {
		t0 := time.Now()
		p, err := c.Malloc(2 * mib)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Free(p); err != nil {
			t.Fatal(err)
		}
		ds = append(ds, time.Since(t0))
	}
	slices.Sort(ds)
	t.Logf("cudaMalloc+cudaFree of 2 MiB: p50 %v, min %v, max %v", ds[len(ds)/2], ds[0], ds[len(ds)-1])
}

func TestMallocOOM(t *testing.T) {
	c := openOrSkip(t)
	_, err := c.Malloc(1 << 50)
	if !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("Malloc(1 PiB) = %v, want ErrOutOfMemory", err)
	}
	if !strings.Contains(err.Error(), "cudaErrorMemoryAllocation") {
		t.Errorf("OOM error does not name cudaErrorMemoryAllocation: %v", err)
	}
	var ce *CUDAError
	if !errors.As(err, &ce) || ce.Sticky || ce.Op != "cudaMalloc" || ce.Code != 2 {
		t.Errorf("OOM error = %+v", ce)
	}
	t.Logf("OOM: %v", err)
	// The device is still usable, and the error does not linger.
	p, err := c.Malloc(4 * kib)
	if err != nil {
		t.Fatalf("Malloc after OOM: %v", err)
	}
	if err := c.Free(p); err != nil {
		t.Fatal(err)
	}
	if err := c.Synchronize(); err != nil {
		t.Fatalf("Synchronize after OOM: %v", err)
	}
}

func TestMemsetMemcpyRoundTrip(t *testing.T) {
	c := openOrSkip(t)
	const n = mib + 3
	p, err := c.Malloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Free(p) }()
	src := make([]byte, n)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	if err := c.MemcpyHtoD(p, src); err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, n)
	if err := c.MemcpyDtoH(dst, p); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(src, dst) {
		t.Fatal("host -> device -> host changed the bytes")
	}
	s, err := c.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.StreamDestroy(s) }()
	if err := c.MemsetAsync(p+100, 0x5a, 1000, s); err != nil {
		t.Fatal(err)
	}
	if err := c.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	if err := c.MemcpyDtoH(dst, p); err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(src)
	for i := 100; i < 1100; i++ {
		want[i] = 0x5a
	}
	if !bytes.Equal(want, dst) {
		t.Fatal("MemsetAsync of [100, 1100) did not give the expected bytes")
	}
	if err := c.Memset(p, 0, n); err != nil {
		t.Fatal(err)
	}
	if err := c.MemcpyDtoH(dst, p); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, make([]byte, n)) {
		t.Fatal("Memset(0) left non-zero bytes")
	}
}

func TestStreamsAndEvents(t *testing.T) {
	c := openOrSkip(t)
	s, err := c.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.CheckStream(s); err != nil {
		t.Errorf("CheckStream(new stream) = %v", err)
	}
	ev, err := c.EventCreate()
	if err != nil {
		t.Fatal(err)
	}
	if done, err := c.EventQuery(ev); err != nil || !done {
		t.Errorf("EventQuery(unrecorded) = %v, %v; want done", done, err)
	}
	big, err := c.Malloc(gib)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 8 {
		if err := c.MemsetAsync(big, byte(i), gib, s); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.EventRecord(ev, s); err != nil {
		t.Fatal(err)
	}
	pending, err := c.EventQuery(ev)
	if err != nil {
		t.Fatalf("EventQuery(pending) = %v", err)
	}
	t.Logf("EventQuery right after queueing 8 GiB of memset: done=%v", pending)
	// A second stream that waits for ev has, once it drains, waited for
	// the memsets: StreamWaitEvent orders it after them on the device.
	s2, err := c.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.StreamWaitEvent(s2, ev); err != nil {
		t.Fatalf("StreamWaitEvent: %v", err)
	}
	if err := c.StreamSynchronize(s2); err != nil {
		t.Fatal(err)
	}
	if done, err := c.EventQuery(ev); err != nil || !done {
		t.Errorf("EventQuery after synchronising a stream that waited for it = %v, %v; want done", done, err)
	}
	if err := c.StreamDestroy(s2); err != nil {
		t.Fatal(err)
	}
	if err := c.EventSynchronize(ev); err != nil {
		t.Fatal(err)
	}
	if done, err := c.EventQuery(ev); err != nil || !done {
		t.Errorf("EventQuery after EventSynchronize = %v, %v; want done", done, err)
	}
	if allocs := testing.AllocsPerRun(100, func() { _, _ = c.EventQuery(ev) }); allocs != 0 {
		t.Errorf("EventQuery allocates %v times per call, want 0", allocs)
	}
	if err := c.EventRecord(ev, DefaultStream); err != nil {
		t.Errorf("EventRecord on the default stream: %v", err)
	}
	if err := c.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	if err := c.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if err := c.EventDestroy(ev); err != nil {
		t.Fatal(err)
	}
	if err := c.Free(big); err != nil {
		t.Fatal(err)
	}
	if err := c.StreamDestroy(s); err != nil {
		t.Fatal(err)
	}
	if err := c.CheckStream(s); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("CheckStream(destroyed) = %v, want ErrInvalidValue", err)
	}
	if err := c.StreamDestroy(s); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("second StreamDestroy = %v, want ErrInvalidValue", err)
	}
	if err := c.StreamDestroy(DefaultStream); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("StreamDestroy(default) = %v, want ErrInvalidValue", err)
	}
}

func TestCheckStreamBogusHandle(t *testing.T) {
	c := openOrSkip(t)
	for _, s := range []Stream{DefaultStream, 1, 2} {
		if err := c.CheckStream(s); err != nil {
			t.Errorf("CheckStream(%d) = %v", s, err)
		}
	}
	// Below mmap_min_addr nothing is ever mapped.
	err := c.CheckStream(0x1000)
	if !errors.Is(err, ErrInvalidValue) {
		t.Fatalf("CheckStream(0x1000) = %v, want ErrInvalidValue", err)
	}
	t.Logf("CheckStream(0x1000): %v", err)
	if err := c.Synchronize(); err != nil {
		t.Fatalf("device unusable after a bogus stream check: %v", err)
	}
}

// TestCheckStreamGarbageHandle records, in child processes so that a crash
// cannot take the test binary down, what cudaStreamQuery does with a
// handle that points to readable memory that is not a stream, and with a
// stream destroyed behind this package's back. It reports; it does not
// fail: that behaviour is CUDA's (CUDA 13.0 / driver 580 segfaults on both).
func TestCheckStreamGarbageHandle(t *testing.T) {
	switch os.Getenv("ALLOCD_CUDART_CHILD") {
	case "garbage":
		c := openOrSkip(t)
		buf := make([]byte, 4096)
		for i := range buf {
			buf[i] = 0xab
		}
		err := c.CheckStream(Stream(uintptr(unsafe.Pointer(&buf[0]))))
		runtime.KeepAlive(buf)
		fmt.Printf("CHILD-RESULT garbage handle: err=%v\n", err)
		return
	case "destroyed":
		c := openOrSkip(t)
		s, err := shimStreamCreate(0)
		if err != nil {
			t.Fatal(err)
		}
		if e := shimStreamDestroy(0, s); e != nil {
			t.Fatal(e)
		}
		e := shimStreamCheck(0, s)
		fmt.Printf("CHILD-RESULT destroyed stream: err=%v\n", e)
		_ = c
		return
	}
	openOrSkip(t)
	for _, mode := range []string{"garbage", "destroyed"} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestCheckStreamGarbageHandle$", "-test.v")
		cmd.Env = append(os.Environ(), "ALLOCD_CUDART_CHILD="+mode)
		out, err := cmd.CombinedOutput()
		result := "no result line"
		for _, l := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(l, "CHILD-RESULT") || strings.HasPrefix(l, "SIGSEGV") ||
				strings.HasPrefix(l, "PC=") || strings.HasPrefix(l, "signal arrived") {
				if result == "no result line" {
					result = ""
				}
				result += strings.TrimSpace(l) + "; "
			}
		}
		t.Logf("%s: exit=%v; %s", mode, err, result)
	}
}

func TestMallocAsync(t *testing.T) {
	c := openOrSkip(t)
	s, err := c.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.StreamDestroy(s) }()
	free0, _, _ := c.MemGetInfo()
	var ps []Ptr
	for range 4 {
		p, err := c.MallocAsync(64*mib, s)
		if err != nil {
			t.Fatalf("MallocAsync: %v", err)
		}
		if err := c.MemsetAsync(p, 1, 64*mib, s); err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	if err := c.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	r0, u0, err := c.PoolUsage()
	if err != nil {
		t.Fatalf("PoolUsage: %v", err)
	}
	if u0 < 4*64*mib || r0 < u0 {
		t.Errorf("PoolUsage with 256 MiB live = reserved %d, used %d", r0, u0)
	}
	for _, p := range ps {
		if err := c.FreeAsync(p, s); err != nil {
			t.Fatalf("FreeAsync: %v", err)
		}
	}
	if err := c.StreamSynchronize(s); err != nil {
		t.Fatal(err)
	}
	free1, _, _ := c.MemGetInfo()
	r1, u1, err := c.PoolUsage()
	if err != nil {
		t.Fatalf("PoolUsage: %v", err)
	}
	if u1 != u0-4*64*mib || r1 < 4*64*mib {
		t.Errorf("PoolUsage after FreeAsync = reserved %d, used %d; want used %d and the memory kept reserved", r1, u1, u0-4*64*mib)
	}
	if err := c.TrimPool(); err != nil {
		t.Fatalf("TrimPool: %v", err)
	}
	free2, _, _ := c.MemGetInfo()
	r2, u2, err := c.PoolUsage()
	if err != nil {
		t.Fatalf("PoolUsage: %v", err)
	}
	t.Logf("free: before %d MiB, after FreeAsync %d MiB (pool keeps it), after TrimPool %d MiB", free0/mib, free1/mib, free2/mib)
	t.Logf("pool reserved/used MiB: live %d/%d, after FreeAsync %d/%d, after TrimPool %d/%d",
		r0/mib, u0/mib, r1/mib, u1/mib, r2/mib, u2/mib)
	if free2 < free1 {
		t.Errorf("TrimPool lowered free memory: %d -> %d", free1, free2)
	}
	if r2 > r1 || r2 < u2 {
		t.Errorf("PoolUsage after TrimPool = reserved %d, used %d (before: reserved %d)", r2, u2, r1)
	}
	_, err = c.MallocAsync(1<<50, s)
	if !errors.Is(err, ErrOutOfMemory) {
		t.Errorf("MallocAsync(1 PiB) = %v, want ErrOutOfMemory", err)
	}
	t.Logf("MallocAsync OOM: %v", err)
	if err := c.StreamSynchronize(s); err != nil {
		t.Fatalf("stream unusable after an async OOM: %v", err)
	}
}

func TestVirtualMemory(t *testing.T) {
	c := openOrSkip(t)
	g, err := c.Granularity()
	if err != nil {
		t.Fatalf("Granularity: %v", err)
	}
	if g != 2*mib {
		t.Errorf("Granularity = %d, want 2 MiB", g)
	}
	r, err := c.Reserve(4 * g)
	if err != nil {
		t.Fatalf("Reserve: %v", err)
	}
	h1, err := c.Create(2 * g)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	h2, err := c.Create(2 * g)
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	if err := c.Map(r, 2*g, h1); err != nil {
		t.Fatalf("Map: %v", err)
	}
	if err := c.Map(r+Ptr(2*g), 2*g, h2); err != nil {
		t.Fatalf("Map: %v", err)
	}
	if err := c.MemsetAsync(r, 0x11, 4*g, DefaultStream); err != nil {
		t.Fatalf("memset over two mappings: %v", err)
	}
	if err := c.MemsetAsync(r+Ptr(2*g)-2, 0x22, 4, DefaultStream); err != nil {
		t.Fatalf("memset across the boundary: %v", err)
	}
	if err := c.Synchronize(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8)
	if err := c.MemcpyDtoH(got, r+Ptr(2*g)-4); err != nil {
		t.Fatal(err)
	}
	if want := []byte{0x11, 0x11, 0x22, 0x22, 0x22, 0x22, 0x11, 0x11}; !bytes.Equal(got, want) {
		t.Errorf("bytes around the mapping boundary = % x, want % x", got, want)
	}
	last := make([]byte, 1)
	if err := c.MemcpyDtoH(last, r+Ptr(4*g)-1); err != nil || last[0] != 0x11 {
		t.Errorf("last byte = %#x, %v", last[0], err)
	}
	for _, step := range []struct {
		name string
		f    func() error
	}{
		{"Unmap low", func() error { return c.Unmap(r, 2*g) }},
		{"Unmap high", func() error { return c.Unmap(r+Ptr(2*g), 2*g) }},
		// The same two handles again, with one call and one access grant.
		{"MapRange", func() error { return c.MapRange(r, 2*g, []Handle{h1, h2}) }},
		{"memset over the range", func() error {
			if err := c.MemsetAsync(r, 0x33, 4*g, DefaultStream); err != nil {
				return err
			}
			if err := c.Synchronize(); err != nil {
				return err
			}
			b := make([]byte, 2)
			if err := c.MemcpyDtoH(b, r+Ptr(2*g)-1); err != nil {
				return err
			}
			if b[0] != 0x33 || b[1] != 0x33 {
				return fmt.Errorf("bytes across the pages = % x, want 33 33", b)
			}
			return nil
		}},
		{"Unmap the range", func() error { return c.Unmap(r, 4*g) }},
		{"Release h1", func() error { return c.Release(h1) }},
		{"Release h2", func() error { return c.Release(h2) }},
		{"ReleaseRange", func() error { return c.ReleaseRange(r, 4*g) }},
	} {
		if err := step.f(); err != nil {
			t.Errorf("%s: %v", step.name, err)
		}
	}
	_, err = c.Create(1 << 50)
	if !errors.Is(err, ErrOutOfMemory) {
		t.Errorf("Create(1 PiB) = %v, want ErrOutOfMemory", err)
	}
	t.Logf("Create OOM: %v", err)
	if err := c.Synchronize(); err != nil {
		t.Fatalf("device unusable after the VMM test: %v", err)
	}
}

// TestDeviceRestored checks the shim's device guard: with device 1 current
// on the calling thread, every kind of call on device 0 (runtime calls that
// switch only when needed, driver calls that always switch, Open itself)
// leaves device 1 current afterwards, and a call on the current device
// leaves it there. It needs two devices (the mock has two).
func TestDeviceRestored(t *testing.T) {
	openOrSkip(t)
	if threadDevice == nil {
		t.Skip("no device hooks in this build")
	}
	if n, err := DeviceCount(); err != nil || n < 2 {
		t.Skipf("needs two devices; DeviceCount = %d, %v", n, err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if _, err := Open(1); err != nil {
		t.Fatal(err)
	}
	if err := setThreadDevice(1); err != nil {
		t.Fatal(err)
	}
	var c *CUDA
	steps := []struct {
		name string
		f    func() error
	}{
		{"Open(0)", func() (err error) { c, err = Open(0); return err }},
		{"Malloc and Free", func() error {
			p, err := c.Malloc(mib)
			if err != nil {
				return err
			}
			return c.Free(p)
		}},
		{"MemGetInfo", func() error { _, _, err := c.MemGetInfo(); return err }},
		{"Synchronize", c0(&c, (*CUDA).Synchronize)},
		{"streams and events", func() error {
			s, err := c.StreamCreate()
			if err != nil {
				return err
			}
			ev, err := c.EventCreate()
			if err != nil {
				return err
			}
			if err := c.EventRecord(ev, s); err != nil {
				return err
			}
			if _, err := c.EventQuery(ev); err != nil {
				return err
			}
			if err := c.CheckStream(s); err != nil {
				return err
			}
			if err := c.EventDestroy(ev); err != nil {
				return err
			}
			return c.StreamDestroy(s)
		}},
		{"virtual memory (driver calls)", func() error {
			g, err := c.Granularity()
			if err != nil {
				return err
			}
			r, err := c.Reserve(g)
			if err != nil {
				return err
			}
			h, err := c.Create(g)
			if err != nil {
				return err
			}
			if err := c.Map(r, g, h); err != nil {
				return err
			}
			if err := c.Unmap(r, g); err != nil {
				return err
			}
			if err := c.Release(h); err != nil {
				return err
			}
			return c.ReleaseRange(r, g)
		}},
		{"host memory and async copies", func() error {
			h, err := c.HostAlloc(kib, HostAllocPortable|HostAllocMapped)
			if err != nil {
				return err
			}
			p, err := c.Malloc(2 * kib)
			if err != nil {
				return err
			}
			if err := c.MemcpyHtoDAsync(p, h, DefaultStream); err != nil {
				return err
			}
			if err := c.MemcpyDtoDAsync(p+kib, p, kib, DefaultStream); err != nil {
				return err
			}
			if err := c.MemcpyDtoHAsync(h, p+kib, DefaultStream); err != nil {
				return err
			}
			if err := c.Free(p); err != nil {
				return err
			}
			return c.FreeHost(h)
		}},
		{"failed Malloc", func() error {
			if _, err := c.Malloc(1 << 50); !errors.Is(err, ErrOutOfMemory) {
				return fmt.Errorf("Malloc(1 PiB) = %v, want ErrOutOfMemory", err)
			}
			return nil
		}},
	}
	for _, st := range steps {
		if err := st.f(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if d := threadDevice(); d != 1 {
			t.Errorf("after %s the thread's current device is %d, want 1 (restored)", st.name, d)
			_ = setThreadDevice(1)
		}
	}
	// On the current device nothing switches.
	if err := setThreadDevice(0); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.MemGetInfo(); err != nil {
		t.Fatal(err)
	}
	if d := threadDevice(); d != 0 {
		t.Errorf("after MemGetInfo on the current device 0 the current device is %d", d)
	}
}

// c0 adapts a method of *c that takes no arguments, read when called.
func c0(c **CUDA, f func(*CUDA) error) func() error {
	return func() error { return f(*c) }
}

func TestErrorNamesMatchLibrary(t *testing.T) {
	openOrSkip(t)
	for _, tc := range []struct {
		driver bool
		table  map[int]string
	}{{false, runtimeErrorNames}, {true, driverErrorNames}} {
		codes := make([]int, 0, len(tc.table))
		for c := range tc.table {
			codes = append(codes, c)
		}
		sort.Ints(codes)
		var unknown []string
		for _, code := range codes {
			name, _, ok := shimErrorName(code, tc.driver)
			if !ok {
				t.Fatal("libraries not loaded")
			}
			switch {
			case name == "" || strings.Contains(name, "unrecognized"):
				unknown = append(unknown, tc.table[code])
			case name != tc.table[code]:
				t.Errorf("code %d (driver=%v): library says %s, table says %s", code, tc.driver, name, tc.table[code])
			}
		}
		if len(unknown) > 0 {
			t.Logf("driver=%v: the loaded library does not know %v", tc.driver, unknown)
		}
	}
}

func TestConcurrentUse(t *testing.T) {
	c := openOrSkip(t)
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := c.StreamCreate()
			if err != nil {
				errs <- err
				return
			}
			ev, err := c.EventCreate()
			if err != nil {
				errs <- err
				return
			}
			for i := range 50 {
				p, err := c.Malloc(uint64(g+1) * 4 * kib)
				if err == nil {
					err = c.MemsetAsync(p, byte(i), 4*kib, s)
				}
				if err == nil {
					err = c.EventRecord(ev, s)
				}
				if err == nil {
					_, err = c.EventQuery(ev)
				}
				if err == nil {
					err = c.StreamSynchronize(s)
				}
				if err == nil {
					err = c.Free(p)
				}
				if err != nil {
					errs <- err
					return
				}
				runtime.Gosched()
			}
			if err := c.EventDestroy(ev); err != nil {
				errs <- err
			}
			if err := c.StreamDestroy(s); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestCloseKeepsOtherHandles(t *testing.T) {
	a := openOrSkip(t)
	b, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	p, err := b.Malloc(mib)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(p); !errors.Is(err, ErrClosed) {
		t.Errorf("Free on a closed handle = %v, want ErrClosed", err)
	}
	// The allocation outlives the closed handle; another handle frees it.
	if err := a.Free(p); err != nil {
		t.Errorf("Free through another handle: %v", err)
	}
}
