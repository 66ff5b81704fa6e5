package allocator

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// benchDirectory is a directory of n segments of 2 to 6 MiB, with a gap
// after every other one, alternating between two shards (so that Free's
// search runs), and 4096 addresses to look up: in segments, in gaps and
// outside, in a random order.
func benchDirectory(n int) (*directory, []uint64) {
	shards := []*shard{newShard(1), newShard(2)}
	rng := rand.New(rand.NewPCG(uint64(n), 1))
	d := make([]dirEntry, 0, n)
	addr := uint64(1 << 30)
	for i := range n {
		size := uint64(2<<20) * uint64(1+rng.IntN(3))
		d = append(d, dirEntry{addr, addr + size, shards[i%2]})
		addr += size + uint64(i%2)<<20
	}
	probes := make([]uint64, 4096)
	for i := range probes {
		probes[i] = 1<<30 - 1<<20 + rng.Uint64N(addr-1<<30+2<<20)
	}
	return newDirectory(d), probes
}

// BenchmarkDirLookup is Free's search of the segment directory, for
// directories of tens to tens of thousands of segments.
func BenchmarkDirLookup(b *testing.B) {
	for _, n := range []int{16, 256, 4096, 40000} {
		b.Run(fmt.Sprintf("segments=%d", n), func(b *testing.B) {
			a := &Allocator{}
			dir, probes := benchDirectory(n)
			a.dir.Store(dir)
			var found int
			i := 0
			for b.Loop() {
				if a.dirLookup(probes[i&(len(probes)-1)]) != nil {
					found++
				}
				i++
			}
			if found == 0 {
				b.Fatal("no address found")
			}
		})
	}
}
