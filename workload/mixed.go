package workload

// MixedWindow is the number of slots of the mixed workload: the mixed
// benchmark's goroutines share them out (bench.Mixed), and Load's mixed steps
// use them all.
const MixedWindow = 4096

// SplitMix64 is the generator the mixed benchmark and PyTorch's anchor
// share, so both run the same operation streams.
type SplitMix64 struct{ s uint64 }

// NewSplitMix64 returns a generator seeded with seed.
func NewSplitMix64(seed uint64) SplitMix64 { return SplitMix64{s: seed} }

// Next returns the next value.
func (r *SplitMix64) Next() uint64 {
	r.s += 0x9E3779B97F4A7C15
	z := r.s
	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
	z = (z ^ z>>27) * 0x94D049BB133111EB
	return z ^ z>>31
}

// MixedSize draws a request size: 80% up to 1 MiB, 18% up to 32 MiB, 2%
// up to 256 MiB.
func MixedSize(r *SplitMix64) uint64 {
	c := r.Next() % 100
	switch {
	case c < 80:
		return 512 + r.Next()%(1<<20)
	case c < 98:
		return 1<<20 + r.Next()%(31<<20)
	}
	return 32<<20 + r.Next()%(224<<20)
}
