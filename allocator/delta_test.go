package allocator

import (
	"math"
	"testing"
)

// TestMallocDelta: the change of handing out a free block, case by case
// of PyTorch's alloc_found_block.
func TestMallocDelta(t *testing.T) {
	const (
		mb   = 1 << 20
		none = math.MaxUint64 // max_split_size unset
	)
	for _, tc := range []struct {
		name                         string
		small, expandable, wasSplit  bool
		size, rounded, req, maxSplit uint64
		want                         delta
	}{
		{"small whole segment split", true, false, false, 2 * mb, 512, 100, none,
			delta{allocs: 1, allocBytes: 512, active: 1, activeBytes: 512, requested: 100, split: 1, splitBytes: 2*mb - 512}},
		{"small split block split again", true, false, true, 4096, 1024, 1000, none,
			delta{allocs: 1, allocBytes: 1024, active: 1, activeBytes: 1024, requested: 1000, splitBytes: -1024}},
		{"split block handed out whole", true, false, true, 4096, 4096, 4000, none,
			delta{allocs: 1, allocBytes: 4096, active: 1, activeBytes: 4096, requested: 4000, split: -1, splitBytes: -4096}},
		{"large remainder too small to split", false, false, false, 20*mb + 512, 20 * mb, 20 * mb, none,
			delta{allocs: 1, allocBytes: 20*mb + 512, active: 1, activeBytes: 20*mb + 512, requested: 20 * mb}},
		{"large oversize not split", false, false, false, 64 * mb, 40 * mb, 40 * mb, 32 * mb,
			delta{allocs: 1, allocBytes: 64 * mb, active: 1, activeBytes: 64 * mb, requested: 40 * mb, over: 1}},
		{"large split below max_split_size", false, false, false, 64 * mb, 20 * mb, 20 * mb, 32 * mb,
			delta{allocs: 1, allocBytes: 20 * mb, active: 1, activeBytes: 20 * mb, requested: 20 * mb, split: 1, splitBytes: 44 * mb}},
		{"expandable split, not counted", false, true, true, 64 * mb, 20 * mb, 20 * mb, none,
			delta{allocs: 1, allocBytes: 20 * mb, active: 1, activeBytes: 20 * mb, requested: 20 * mb}},
	} {
		got := delta{allocs: 7, split: 7, over: 7} // overwritten
		split := splits(tc.small, tc.expandable, tc.size, tc.rounded, tc.maxSplit)
		if mallocDelta(&got, tc.expandable, tc.wasSplit, split, tc.size, tc.rounded, tc.req, tc.maxSplit); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}
