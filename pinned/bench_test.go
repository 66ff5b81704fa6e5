package pinned

import (
	"strconv"
	"testing"
)

// BenchmarkCachedAllocFree is the hot path: an Alloc served from the free
// list and the Free of a buffer no stream used. It must report 0 allocs/op
// (TestCachedPathMakesNoDeviceCall checks that it makes no device call).
func BenchmarkCachedAllocFree(b *testing.B) {
	for _, size := range []int{4 << 10, 1 << 20, 64 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			dev := newSim(b, false)
			a := newAlloc(b, dev, DefaultConfig())
			warm, err := a.Alloc(size)
			if err != nil {
				b.Fatal(err)
			}
			_ = a.Free(warm)
			b.ReportAllocs()
			for b.Loop() {
				buf, err := a.Alloc(size)
				if err != nil {
					b.Fatal(err)
				}
				if err := a.Free(buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkCachedAllocFreeParallel: the same from every P at once, each on
// its own size class's free list, under the one mutex.
func BenchmarkCachedAllocFreeParallel(b *testing.B) {
	dev := newSim(b, false)
	a := newAlloc(b, dev, DefaultConfig())
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			buf, err := a.Alloc(1 << 20)
			if err != nil {
				b.Error(err)
				return
			}
			if err := a.Free(buf); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return strconv.Itoa(n>>20) + "MiB"
	case n >= 1<<10:
		return strconv.Itoa(n>>10) + "KiB"
	}
	return strconv.Itoa(n) + "B"
}

// BenchmarkCopyHelpersOverhead is the allocator's share of a pinned copy:
// Alloc, CopyToDevice, Free, on a device whose copies cost nothing and
// whose events are complete at once (each Alloc queries the previous
// Free's event and reuses the block).
func BenchmarkCopyHelpersOverhead(b *testing.B) {
	a, err := New(&nopDevice{}, DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	b.ReportAllocs()
	for b.Loop() {
		buf, err := a.Alloc(1 << 20)
		if err != nil {
			b.Fatal(err)
		}
		if err := a.CopyToDevice(0x1000, buf, 7); err != nil {
			b.Fatal(err)
		}
		if err := a.Free(buf); err != nil {
			b.Fatal(err)
		}
	}
}
