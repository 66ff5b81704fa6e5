package blocks

import (
	"strings"
	"testing"
)

// oneBlock returns a segment of size bytes at ptr holding one allocated
// block.
func oneBlock(ptr, size uint64, index int) *Segment {
	s := &Segment{Ptr: ptr, Size: size, Index: index}
	s.Head = &Block{Ptr: ptr, Size: size, Segment: s, Allocated: true}
	return s
}

// TestCheckSegmentRanges: a segment at address 0, one that wraps past
// 2^64, and two that overlap are each reported; segments side by side are
// fine.
func TestCheckSegmentRanges(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		name string
		segs []*Segment
		want string // "" when Check must pass
	}{
		{"side by side", []*Segment{oneBlock(0x200000, 2*mib, 0), oneBlock(0x400000, 2*mib, 1)}, ""},
		{"at the top, not wrapping", []*Segment{oneBlock(^uint64(0)-2*mib+1, 2*mib, 0)}, ""},
		{"wraps past 2^64", []*Segment{oneBlock(^uint64(0)-2*mib+1, 20*mib, 0)}, "wraps past 2^64"},
		{"at address 0", []*Segment{oneBlock(0, 2*mib, 0)}, "address 0"},
		{"overlapping", []*Segment{oneBlock(0x400000, 2*mib, 0), oneBlock(0x200000, 4*mib, 1)}, "overlap"},
		{"the same address twice", []*Segment{oneBlock(0x200000, 2*mib, 0), oneBlock(0x200000, 2*mib, 1)}, "overlap"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Check(tc.segs, NewStreamFreeIndex(0))
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Check = %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Check = %v, want an error saying %q", err, tc.want)
			}
		})
	}
}
