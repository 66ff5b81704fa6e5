package simdev

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/allocd/allocd/cudart"
)

// newSharedSim returns a Sim with Config.Shared, closed when the test ends;
// it skips where memfds are not available.
func newSharedSim(t *testing.T, index int, capacity uint64) *Sim {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("Config.Shared needs memfds (Linux)")
	}
	s, err := New(Config{Capacity: capacity, Index: index, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// reserveMap reserves size bytes on s and maps h there.
func reserveMap(t *testing.T, s *Sim, size uint64, h cudart.Handle) cudart.Ptr {
	t.Helper()
	p, err := s.Reserve(size)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Map(p, size, h); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestSimShareRoundTrip: memory made shareable on one Sim, exported and
// imported into another, is one memory: bytes written through either
// mapping are read through the other, also after the exporter releases
// its handle. Imported memory is not counted against the importer's
// capacity; the calls are counted.
func TestSimShareRoundTrip(t *testing.T) {
	const size = 4 * vmmMiB
	a := newSharedSim(t, 0, 16*vmmMiB)
	b := newSharedSim(t, 1, 16*vmmMiB)

	ha, err := a.CreateShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := a.Export(ha)
	if err != nil {
		t.Fatal(err)
	}
	hb, err := b.Import(fd, size)
	if err != nil {
		t.Fatal(err)
	}
	if err := closeFD(fd); err != nil { // Import keeps its own descriptor
		t.Fatal(err)
	}
	pa := reserveMap(t, a, size, ha)
	pb := reserveMap(t, b, size, hb)

	// a → b, across the first granule's end.
	msg := []byte("written through the exporter's mapping")
	off := cudart.Ptr(2*vmmMiB - 8)
	if err := a.MemcpyHtoD(pa+off, msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if err := b.MemcpyDtoH(got, pb+off); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("read through the importer: %q, %v; want %q", got, err, msg)
	}
	// b → a, by memset.
	if err := b.MemsetAsync(pb+cudart.Ptr(3*vmmMiB), 0x5a, 4096, cudart.DefaultStream); err != nil {
		t.Fatal(err)
	}
	page := make([]byte, 4096)
	if err := a.MemcpyDtoH(page, pa+cudart.Ptr(3*vmmMiB)); err != nil || !bytes.Equal(page, bytes.Repeat([]byte{0x5a}, 4096)) {
		t.Fatalf("memset through the importer not seen by the exporter (%v)", err)
	}

	if a.Used() != size || b.Used() != 0 {
		t.Errorf("Used: exporter %d, importer %d; want %d and 0 (imported memory is the exporter's)", a.Used(), b.Used(), size)
	}
	if free, _, _ := b.MemGetInfo(); free != 16*vmmMiB {
		t.Errorf("importer's free memory %d, want all of its capacity %d", free, 16*vmmMiB)
	}
	ca, cb := a.VMMCounters(), b.VMMCounters()
	if ca.Creates != 1 || ca.Exports != 1 || ca.Imports != 0 || cb.Creates != 0 || cb.Imports != 1 || cb.HandleBytes != size {
		t.Errorf("counters: exporter %+v, importer %+v", ca, cb)
	}

	// The memory outlives the exporter's handle.
	if err := a.Unmap(pa, size); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(ha); err != nil {
		t.Fatal(err)
	}
	if err := b.MemcpyDtoH(got, pb+off); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("after the exporter released its handle: %q, %v; want %q", got, err, msg)
	}

	// An imported handle exports again, and the memory comes back.
	fd2, err := b.Export(hb)
	if err != nil {
		t.Fatal(err)
	}
	defer closeFD(fd2)
	ha2, err := a.Import(fd2, size)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Map(pa, size, ha2); err != nil {
		t.Fatal(err)
	}
	if err := a.MemcpyDtoH(got, pa+off); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("re-exported memory: %q, %v; want %q", got, err, msg)
	}
	if a.Used() != 0 {
		t.Errorf("exporter's Used = %d after releasing its memory and importing it back, want 0", a.Used())
	}
}

// TestSimShareCreateIsBacked: with Shared (and without Backed), Create's
// memory is a memfd too, and copies reach mappings of it side by side with
// CreateShareable's; Malloc's memory stays unbacked.
func TestSimShareCreateIsBacked(t *testing.T) {
	s := newSharedSim(t, 0, 16*vmmMiB)
	h1, err := s.Create(2 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	h2, err := s.CreateShareable(2 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	p, err := s.Reserve(4 * vmmMiB)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.MapRange(p, 2*vmmMiB, []cudart.Handle{h1, h2}); err != nil {
		t.Fatal(err)
	}
	msg := []byte("across two handles")
	at := p + cudart.Ptr(2*vmmMiB-5)
	if err := s.MemcpyHtoD(at, msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if err := s.MemcpyDtoH(got, at); err != nil || !bytes.Equal(got, msg) {
		t.Errorf("round trip across the handles: %q, %v", got, err)
	}
	m, err := s.Malloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	wantErr(t, "memcpy to Malloc's memory on a Shared, unbacked Sim", s.MemcpyHtoD(m, msg), ErrNotBacked, "Config.Backed")
}

// TestSimShareErrors: each refused call says what was wrong, wraps the
// sentinel and changes nothing: no counter, no capacity, no descriptor.
func TestSimShareErrors(t *testing.T) {
	const size = 4 * vmmMiB
	plain := newVMMSim(t, 64*vmmMiB, true)
	shared := newSharedSim(t, 1, 64*vmmMiB)
	closed := newSharedSim(t, 2, 64*vmmMiB)
	if err := closed.Close(); err != nil {
		t.Fatal(err)
	}
	plainH, err := plain.Create(size)
	if err != nil {
		t.Fatal(err)
	}
	createH, err := shared.Create(size)
	if err != nil {
		t.Fatal(err)
	}
	shareH, err := shared.CreateShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	fd, err := shared.Export(shareH)
	if err != nil {
		t.Fatal(err)
	}
	defer closeFD(fd)
	var pipe [2]*os.File
	if pipe[0], pipe[1], err = os.Pipe(); err != nil {
		t.Fatal(err)
	}
	defer pipe[0].Close()
	defer pipe[1].Close()
	const notOpen = 1 << 20 // past any descriptor this test opens

	imp := func(s *Sim, fd int, size uint64) func() error {
		return func() error { _, err := s.Import(fd, size); return err }
	}
	exp := func(s *Sim, h cudart.Handle) func() error {
		return func() error {
			fd, err := s.Export(h)
			if err == nil {
				_ = closeFD(fd)
			} else if fd != -1 {
				return fmt.Errorf("failed export returned descriptor %d, want -1", fd)
			}
			return err
		}
	}
	create := func(s *Sim, size uint64) func() error {
		return func() error { _, err := s.CreateShareable(size); return err }
	}
	for _, tc := range []struct {
		name  string
		call  func() error
		want  error
		words []string
	}{
		{"create shareable without Shared", create(plain, size), cudart.ErrNotSupported, []string{"create shareable", "Config.Shared"}},
		{"export without Shared", exp(plain, plainH), cudart.ErrNotSupported, []string{"export", "Config.Shared"}},
		{"import without Shared", imp(plain, fd, size), cudart.ErrNotSupported, []string{"import", "Config.Shared"}},
		{"export of an unknown handle", exp(shared, 0xdead), cudart.ErrInvalidValue, []string{"0xdead", "not live"}},
		{"export of Create's handle", exp(shared, createH), cudart.ErrInvalidValue, []string{"Create", "CreateShareable"}},
		{"import of the wrong size", imp(shared, fd, 2*vmmMiB), cudart.ErrInvalidValue, []string{"2097152", "4194304"}},
		{"import of a larger size", imp(shared, fd, 8*vmmMiB), cudart.ErrInvalidValue, []string{"8388608", "4194304"}},
		{"import of 0 bytes", imp(shared, fd, 0), cudart.ErrInvalidValue, []string{"granularity"}},
		{"import of a size off the granularity", imp(shared, fd, size+4096), cudart.ErrInvalidValue, []string{"granularity"}},
		{"import of a negative descriptor", imp(shared, -1, size), cudart.ErrInvalidValue, []string{"descriptor -1"}},
		{"import of a descriptor not open", imp(shared, notOpen, size), cudart.ErrInvalidValue, []string{"descriptor " + strconv.Itoa(notOpen), "fstat"}},
		{"import of a pipe", imp(shared, int(pipe[0].Fd()), size), cudart.ErrInvalidValue, []string{"not a memory file"}},
		{"create shareable past the capacity", create(shared, 64*vmmMiB), cudart.ErrOutOfMemory, []string{"out of memory"}},
		{"create shareable off the granularity", create(shared, vmmMiB), cudart.ErrInvalidValue, []string{"granularity"}},
		{"create shareable after Close", create(closed, size), cudart.ErrClosed, nil},
		{"export after Close", exp(closed, 1), cudart.ErrClosed, nil},
		{"import after Close", imp(closed, fd, size), cudart.ErrClosed, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, used, fds := shared.VMMCounters(), shared.Used(), openFDs(t)
			wantErr(t, tc.name, tc.call(), tc.want, tc.words...)
			after := shared.VMMCounters()
			after.FailedCreates = before.FailedCreates // a refused create counts there
			if after != before || shared.Used() != used {
				t.Errorf("state changed: counters %+v → %+v, used %d → %d", before, after, used, shared.Used())
			}
			if n := openFDs(t); n != fds {
				t.Errorf("%d descriptors open before, %d after", fds, n)
			}
		})
	}

	// A CreateShareable counts as a malloc call for Faults, as Create does.
	shared.Faults().FailMalloc(1, nil)
	failed := shared.VMMCounters().FailedCreates
	_, err = shared.CreateShareable(size)
	wantErr(t, "create shareable with a malloc fault", err, cudart.ErrOutOfMemory)
	if shared.VMMCounters().FailedCreates != failed+1 {
		t.Errorf("FailedCreates = %d, want %d", shared.VMMCounters().FailedCreates, failed+1)
	}
}

// TestSimShareReleasesDescriptors: every handle of a Shared Sim holds a
// descriptor and a mapping until Release, or until Close for those still
// live; many cycles leave none behind.
func TestSimShareReleasesDescriptors(t *testing.T) {
	const size = 2 * vmmMiB
	a := newSharedSim(t, 0, 64*vmmMiB)
	b := newSharedSim(t, 1, 64*vmmMiB)
	pa, err := a.Reserve(size)
	if err != nil {
		t.Fatal(err)
	}
	pb, err := b.Reserve(size)
	if err != nil {
		t.Fatal(err)
	}
	fds, maps := openFDs(t), memfdMappings(t)
	for i := range 200 {
		ha, err := a.CreateShareable(size)
		if err != nil {
			t.Fatal(err)
		}
		fd, err := a.Export(ha)
		if err != nil {
			t.Fatal(err)
		}
		hb, err := b.Import(fd, size)
		if err != nil {
			t.Fatal(err)
		}
		if err := closeFD(fd); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			if n := openFDs(t); n != fds+2 {
				t.Fatalf("%d descriptors open with two live handles, want %d", n, fds+2)
			}
		}
		if err := a.Map(pa, size, ha); err != nil {
			t.Fatal(err)
		}
		if err := b.Map(pb, size, hb); err != nil {
			t.Fatal(err)
		}
		if err := a.MemsetAsync(pa, byte(i), 4096, cudart.DefaultStream); err != nil {
			t.Fatal(err)
		}
		for _, m := range []struct {
			s *Sim
			p cudart.Ptr
			h cudart.Handle
		}{{a, pa, ha}, {b, pb, hb}} {
			if err := m.s.Unmap(m.p, size); err != nil {
				t.Fatal(err)
			}
			if err := m.s.Release(m.h); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n, m := openFDs(t), memfdMappings(t); n != fds || m != maps {
		t.Fatalf("after 200 cycles: %d descriptors and %d memfd mappings, want %d and %d", n, m, fds, maps)
	}

	// Close releases what is still live, mapped or not.
	h1, err := a.CreateShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Create(size); err != nil {
		t.Fatal(err)
	}
	if err := a.Map(pa, size, h1); err != nil {
		t.Fatal(err)
	}
	fd, err := a.Export(h1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Import(fd, size); err != nil {
		t.Fatal(err)
	}
	if err := closeFD(fd); err != nil {
		t.Fatal(err)
	}
	if n := openFDs(t); n != fds+3 {
		t.Errorf("%d descriptors open with three live handles, want %d", n, fds+3)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if n, m := openFDs(t), memfdMappings(t); n != fds || m != maps {
		t.Errorf("after Close: %d descriptors and %d memfd mappings, want %d and %d", n, m, fds, maps)
	}
}

// shareChildEnv, set in the child process of TestSimShareAcrossProcesses,
// holds the size of the memory behind descriptor 3.
const shareChildEnv = "ALLOCD_SIMDEV_SHARE_CHILD"

const (
	parentMsg = "from the parent, across a granule"
	childMsg  = "the child was here"
	parentAt  = 2<<20 - 11
	childAt   = 5 << 20
)

// TestSimShareAcrossProcesses: a descriptor from Export, passed to another
// process (the test binary again, as exec passes files; a broker sends it
// over a Unix socket), imports the same memory there: the child reads what
// the parent wrote and the parent reads what the child wrote back.
func TestSimShareAcrossProcesses(t *testing.T) {
	const size = 8 * vmmMiB
	s := newSharedSim(t, 0, 64*vmmMiB)
	h, err := s.CreateShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	p := reserveMap(t, s, size, h)
	if err := s.MemcpyHtoD(p+parentAt, []byte(parentMsg)); err != nil {
		t.Fatal(err)
	}
	fd, err := s.Export(h)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "sim-share")
	defer f.Close()

	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcessSimShare$", "-test.count=1")
	cmd.Env = append(os.Environ(), shareChildEnv+"="+strconv.FormatUint(size, 10))
	cmd.ExtraFiles = []*os.File{f} // descriptor 3 in the child
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	got := make([]byte, len(childMsg))
	if err := s.MemcpyDtoH(got, p+childAt); err != nil || string(got) != childMsg {
		t.Fatalf("the parent reads %q (%v) where the child wrote %q\nchild output:\n%s", got, err, childMsg, out)
	}
}

// TestHelperProcessSimShare is the child of TestSimShareAcrossProcesses;
// run on its own it does nothing.
func TestHelperProcessSimShare(t *testing.T) {
	v := os.Getenv(shareChildEnv)
	if v == "" {
		t.Skip("the child of TestSimShareAcrossProcesses")
	}
	size, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	s := newSharedSim(t, 0, vmmMiB*2) // smaller than what it imports: imports do not count
	h, err := s.Import(3, size)
	if err != nil {
		t.Fatal(err)
	}
	p := reserveMap(t, s, size, h)
	got := make([]byte, len(parentMsg))
	if err := s.MemcpyDtoH(got, p+parentAt); err != nil || string(got) != parentMsg {
		t.Fatalf("the child reads %q (%v) where the parent wrote %q", got, err, parentMsg)
	}
	if err := s.MemcpyHtoD(p+childAt, []byte(childMsg)); err != nil {
		t.Fatal(err)
	}
	if err := s.Unmap(p, size); err != nil {
		t.Fatal(err)
	}
	if err := s.Release(h); err != nil {
		t.Fatal(err)
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	es, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot list descriptors: %v", err)
	}
	return len(es)
}

// memfdMappings counts the mappings of Shared Sims' memfds in this process.
func memfdMappings(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("cannot read the mappings: %v", err)
	}
	return strings.Count(string(b), "memfd:allocd-sim")
}

// closeFD closes a descriptor this test owns.
func closeFD(fd int) error { return os.NewFile(uintptr(fd), "fd").Close() }
