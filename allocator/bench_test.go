package allocator

import (
	"fmt"
	"testing"
)

// BenchmarkCachedPair measures the hot path: a malloc served from the
// cache and its free.
func BenchmarkCachedPair(b *testing.B) { benchmarkCachedPair(b, "") }

// BenchmarkCachedPairExpandable is BenchmarkCachedPair with expandable
// segments (the default reclaim policy).
func BenchmarkCachedPairExpandable(b *testing.B) { benchmarkCachedPair(b, "expandable_segments:True") }

func benchmarkCachedPair(b *testing.B, conf string) {
	for _, size := range []uint64{512, 4096, miB, 8 * miB, 64 * miB} {
		b.Run(fmt.Sprintf("size=%d", size), func(b *testing.B) {
			a, _ := newTestAllocator(b, 141*giB, conf)
			mustFree(b, a, mustMalloc(b, a, size, 0))
			b.ReportAllocs()
			for b.Loop() {
				p, err := a.Malloc(size, 0)
				if err != nil {
					b.Fatal(err)
				}
				if err := a.Free(p); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
