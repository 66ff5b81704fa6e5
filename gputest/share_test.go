package gputest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
)

// The node broker's path (cudart.ShareableMemory) on a real GPU: physical
// memory made with CreateShareable, exported as a POSIX file descriptor,
// imported here or in another process and mapped there.

// shareChildEnv, set in the child process of the cross-process test, holds
// the size of the memory behind descriptor 3.
const shareChildEnv = "ALLOCD_GPUTEST_SHARE_CHILD"

const (
	shareParentMsg = "written by the exporting process"
	shareChildMsg  = "written back by the importing process"
	shareParentAt  = 1<<20 - 7 // inside the first 2 MiB granule
	shareChildAt   = 1<<20 + 4096
)

// shareableGPU opens device 0, skipping the test without a driver or
// without shareable memory.
func shareableGPU(t *testing.T) *cudart.CUDA {
	t.Helper()
	dev := openGPU(t)
	h, err := dev.CreateShareable(2 * miB)
	if errors.Is(err, cudart.ErrNotSupported) {
		t.Skipf("the device cannot share memory: %v", err)
	}
	if err != nil {
		t.Fatalf("CreateShareable(2 MiB): %v", err)
	}
	if err := dev.Release(h); err != nil {
		t.Fatal(err)
	}
	return dev
}

// reserveMap reserves size bytes and maps h there.
func reserveMap(t *testing.T, dev *cudart.CUDA, size uint64, h cudart.Handle) cudart.Ptr {
	t.Helper()
	p, err := dev.Reserve(size)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Map(p, size, h); err != nil {
		t.Fatal(err)
	}
	return p
}

// unmapRelease undoes reserveMap and releases h.
func unmapRelease(t *testing.T, dev *cudart.CUDA, p cudart.Ptr, size uint64, h cudart.Handle) {
	t.Helper()
	if err := dev.Unmap(p, size); err != nil {
		t.Fatal(err)
	}
	if err := dev.ReleaseRange(p, size); err != nil {
		t.Fatal(err)
	}
	if err := dev.Release(h); err != nil {
		t.Fatal(err)
	}
}

// closeFD closes a descriptor the test owns.
func closeFD(fd int) error { return os.NewFile(uintptr(fd), "fd").Close() }

// TestGPUShareableMemory: memory from CreateShareable, exported and
// imported in this process, is one memory behind two mappings; exported to
// another process, that process reads what this one wrote and this one
// reads what it wrote back. It also times the calls against plain Create:
// one line per figure, "share: <call> <size>MiB median_us=<µs>" on
// standard output, median of 20.
func TestGPUShareableMemory(t *testing.T) {
	dev := shareableGPU(t)
	for _, size := range []uint64{2 * miB, 64 * miB} {
		t.Run(fmt.Sprintf("in process %dMiB", size>>20), func(t *testing.T) { shareInProcess(t, dev, size) })
	}
	t.Run("across processes", func(t *testing.T) { shareAcrossProcesses(t, dev, 4*miB) })
	t.Run("cost", func(t *testing.T) {
		for _, size := range []uint64{2 * miB, 64 * miB} {
			shareCost(t, dev, size)
		}
	})
}

func shareInProcess(t *testing.T, dev *cudart.CUDA, size uint64) {
	h, err := dev.CreateShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := dev.Export(h)
	if err != nil {
		t.Fatal(err)
	}
	hi, err := dev.Import(fd, size)
	if err != nil {
		t.Fatal(err)
	}
	if err := closeFD(fd); err != nil { // the import holds its own reference
		t.Fatal(err)
	}
	pa := reserveMap(t, dev, size, h)
	pb := reserveMap(t, dev, size, hi)

	// Head, middle and tail, written through one mapping and read through
	// the other.
	for i, w := range checkWindows(size) {
		off, n := cudart.Ptr(w[0]), w[1]
		src := bytes.Repeat([]byte{byte(0x11 * (i + 1))}, int(n))
		copy(src, fmt.Sprintf("window %d of %d MiB", i, size>>20))
		if err := dev.MemcpyHtoD(pa+off, src); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, n)
		if err := dev.MemcpyDtoH(got, pb+off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, src) {
			t.Fatalf("window [%d, +%d) written at %#x, read at %#x: differs", w[0], n, uint64(pa+off), uint64(pb+off))
		}
	}
	// The other way, by memset of the last MiB.
	if err := dev.MemsetAsync(pb+cudart.Ptr(size-miB), 0xa5, miB, cudart.DefaultStream); err != nil {
		t.Fatal(err)
	}
	if err := dev.Synchronize(); err != nil {
		t.Fatal(err)
	}
	tail := make([]byte, 4*kiB)
	if err := dev.MemcpyDtoH(tail, pa+cudart.Ptr(size-4*kiB)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(tail, bytes.Repeat([]byte{0xa5}, len(tail))) {
		t.Fatal("memset through the imported mapping not seen through the exported one")
	}
	// The memory outlives the creating handle while the import holds it.
	unmapRelease(t, dev, pa, size, h)
	if err := dev.MemcpyDtoH(tail, pb+cudart.Ptr(size-4*kiB)); err != nil || tail[0] != 0xa5 {
		t.Fatalf("after releasing the creating handle: %#x, %v", tail[0], err)
	}
	unmapRelease(t, dev, pb, size, hi)
}

func shareAcrossProcesses(t *testing.T, dev *cudart.CUDA, size uint64) {
	h, err := dev.CreateShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	p := reserveMap(t, dev, size, h)
	defer unmapRelease(t, dev, p, size, h)
	if err := dev.MemcpyHtoD(p+shareParentAt, []byte(shareParentMsg)); err != nil {
		t.Fatal(err)
	}
	fd, err := dev.Export(h)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "gpu-share")
	defer f.Close()

	cmd := exec.Command(os.Args[0], "-test.run=^TestGPUShareHelperProcess$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), shareChildEnv+"="+strconv.FormatUint(size, 10))
	cmd.ExtraFiles = []*os.File{f} // descriptor 3 in the child
	t0 := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if !bytes.Contains(out, []byte("--- PASS: TestGPUShareHelperProcess")) {
		t.Fatalf("the child did not pass:\n%s", out)
	}
	got := make([]byte, len(shareChildMsg))
	if err := dev.MemcpyDtoH(got, p+shareChildAt); err != nil || string(got) != shareChildMsg {
		t.Fatalf("the parent reads %q (%v) where the child wrote %q\nchild output:\n%s", got, err, shareChildMsg, out)
	}
	t.Logf("share: the child process imported, read and wrote %d MiB in %v (its start and CUDA context included)", size>>20, time.Since(t0).Round(time.Millisecond))
}

// TestGPUShareHelperProcess is the child of TestGPUShareableMemory's
// cross-process test; run on its own it skips.
func TestGPUShareHelperProcess(t *testing.T) {
	v := os.Getenv(shareChildEnv)
	if v == "" {
		t.Skip("the child of TestGPUShareableMemory")
	}
	size, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := cudart.Open(0)
	if err != nil {
		t.Fatalf("the child cannot open the GPU its parent used: %v", err)
	}
	defer dev.Close()
	h, err := dev.Import(3, size)
	if err != nil {
		t.Fatal(err)
	}
	p := reserveMap(t, dev, size, h)
	got := make([]byte, len(shareParentMsg))
	if err := dev.MemcpyDtoH(got, p+shareParentAt); err != nil || string(got) != shareParentMsg {
		t.Fatalf("the child reads %q (%v) where the parent wrote %q", got, err, shareParentMsg)
	}
	if err := dev.MemcpyHtoD(p+shareChildAt, []byte(shareChildMsg)); err != nil {
		t.Fatal(err)
	}
	unmapRelease(t, dev, p, size, h)
}

// shareCost times CreateShareable, Export and Import (in this process)
// against Create, 20 times each, and prints the medians.
func shareCost(t *testing.T, dev *cudart.CUDA, size uint64) {
	const n = 20
	var create, createShareable, export, imp, release, releaseImported []time.Duration
	since := func(ds *[]time.Duration, t0 time.Time) { *ds = append(*ds, time.Since(t0)) }
	for range n {
		t0 := time.Now()
		h, err := dev.Create(size)
		if err != nil {
			t.Fatal(err)
		}
		since(&create, t0)
		t0 = time.Now()
		if err := dev.Release(h); err != nil {
			t.Fatal(err)
		}
		since(&release, t0)

		t0 = time.Now()
		if h, err = dev.CreateShareable(size); err != nil {
			t.Fatal(err)
		}
		since(&createShareable, t0)
		t0 = time.Now()
		fd, err := dev.Export(h)
		if err != nil {
			t.Fatal(err)
		}
		since(&export, t0)
		t0 = time.Now()
		hi, err := dev.Import(fd, size)
		if err != nil {
			t.Fatal(err)
		}
		since(&imp, t0)
		if err := closeFD(fd); err != nil {
			t.Fatal(err)
		}
		t0 = time.Now()
		if err := dev.Release(hi); err != nil {
			t.Fatal(err)
		}
		since(&releaseImported, t0)
		if err := dev.Release(h); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []struct {
		name string
		ds   []time.Duration
	}{
		{"create", create}, {"create_shareable", createShareable}, {"export", export},
		{"import", imp}, {"release", release}, {"release_imported", releaseImported},
	} {
		line := fmt.Sprintf("share: %s %dMiB median_us=%.1f", f.name, size>>20, medianMicros(f.ds))
		t.Log(line)
		fmt.Println(line)
	}
}

// medianMicros returns the median of ds in microseconds.
func medianMicros(ds []time.Duration) float64 {
	s := slices.Clone(ds)
	slices.Sort(s)
	m := s[len(s)/2]
	if len(s)%2 == 0 {
		m = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return float64(m.Nanoseconds()) / 1e3
}
