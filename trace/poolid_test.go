package trace

import (
	"bytes"
	"testing"

	"github.com/allocd/allocd/snapshot"
)

// TestReadSegmentPoolID: a segment's private pool (segment_pool_id, a
// pair) survives a write and a read, for a graph's pool, a MemPool's and
// the general cache's.
func TestReadSegmentPoolID(t *testing.T) {
	ids := [][2]uint64{{0, 0}, {3, 0}, {0, 1 << 40}}
	in := &snapshot.Snapshot{Segments: []snapshot.Segment{}, DeviceTraces: [][]snapshot.Entry{{}}}
	for i, id := range ids {
		in.Segments = append(in.Segments, snapshot.Segment{Address: uint64(i+1) << 30, TotalSize: 2 << 20, SegmentType: "large",
			PoolID: id, Blocks: []snapshot.Block{{Address: uint64(i+1) << 30, Size: 2 << 20, State: snapshot.BlockInactive}}})
	}
	var buf bytes.Buffer
	if err := snapshot.WritePickle(&buf, in); err != nil {
		t.Fatal(err)
	}
	out, err := Read(&buf, ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Segments) != len(ids) {
		t.Fatalf("%d segments read, %d written", len(out.Segments), len(ids))
	}
	for i, s := range out.Segments {
		if s.PoolID != ids[i] {
			t.Errorf("segment %d: pool %v, written %v", i, s.PoolID, ids[i])
		}
	}
}
