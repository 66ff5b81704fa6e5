// Package vmmtimertest tests scripts/vmm_timer.c, the library that counts
// and times PyTorch's virtual memory calls for scripts/paired_replays.py
// (--vmm-timer) on the GPU machine. It is a package of its own because Go
// refuses a package directory with C files that are not cgo's.
package vmmtimertest

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestVMMTimer builds vmm_timer.c and runs it against a stand-in for the
// CUDA runtime and a stand-in for PyTorch that looks the driver's
// functions up through it (testdata/vmm_timer_*.c), with the runtime in
// the global scope after the timer (as torch loads it) and in a local
// scope (found by its name): the two virtual memory functions looked up
// are handed out wrapped and counted with their time, the third
// function is handed out as it is, and every call returns what the
// runtime's function returned.
func TestVMMTimer(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler: ", err)
	}
	dir := t.TempDir()
	build := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
			t.Fatalf("cc %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	lib := func(name string) string { return filepath.Join(dir, name) }
	build("-O2", "-shared", "-fPIC", "-o", lib("libcudart_fake.so"), "testdata/vmm_timer_fake_runtime.c")
	build("-O2", "-shared", "-fPIC", "-o", lib("libuser.so"), "testdata/vmm_timer_user.c",
		"-L"+dir, "-l:libcudart_fake.so", "-Wl,-rpath,"+dir)
	build("-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", lib("vmm_timer.so"), "../vmm_timer.c", "-ldl")
	build("-O2", "-o", lib("main"), "testdata/vmm_timer_main.c", "-ldl")

	for _, scope := range []string{"global", "local"} {
		t.Run(scope, func(t *testing.T) {
			args := []string{lib("vmm_timer.so"), lib("libuser.so")}
			if scope == "global" {
				args = append(args, lib("libcudart_fake.so"))
			}
			cmd := exec.Command(lib("main"), args...)
			cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+dir)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("%v: %v\n%s", cmd, err, out)
			}
			var f []int64
			for _, w := range strings.Fields(string(out)) {
				n, err := strconv.ParseInt(w, 10, 64)
				if err != nil {
					t.Fatalf("output %q: %v", out, err)
				}
				f = append(f, n)
			}
			if len(f) != 12 {
				t.Fatalf("output %q: want 12 numbers", out)
			}
			result, hooked, counts, nanos := f[0], f[1], f[2:7], f[7:12]
			if result != 7003 {
				t.Errorf("the calls returned %d, want 7003 (each function's own result)", result)
			}
			if hooked != 2 {
				t.Errorf("%d lookups hooked, want 2 (cuMemCreate and cuMemMap)", hooked)
			}
			if want := []int64{1, 2, 0, 0, 0}; !slices.Equal(counts, want) {
				t.Errorf("counts (create, map, set access, unmap, release) %v, want %v", counts, want)
			}
			// The stand-in's create sleeps 1 ms, each map 2 ms.
			if nanos[0] < 1e6 || nanos[1] < 4e6 || nanos[2]+nanos[3]+nanos[4] != 0 {
				t.Errorf("nanoseconds (create, map, set access, unmap, release) %v: want at least 1 ms, 4 ms, then none", nanos)
			}
		})
	}
}
