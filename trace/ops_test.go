package trace

import (
	"reflect"
	"testing"

	"github.com/allocd/allocd/snapshot"
)

func TestBuildOps(t *testing.T) {
	e := func(a snapshot.Action, addr, size, stream uint64) snapshot.Entry {
		return snapshot.Entry{Action: a, Addr: addr, Size: size, Stream: stream}
	}
	alloc := func(addr, size uint64) snapshot.Entry { return e(snapshot.ActionAlloc, addr, size, 0) }
	req := func(addr uint64) snapshot.Entry { return e(snapshot.ActionFreeRequested, addr, 0, 0) }
	done := func(addr uint64) snapshot.Entry { return e(snapshot.ActionFreeCompleted, addr, 0, 0) }
	op := func(k OpKind, id int32, size uint64) Op { return Op{Kind: k, ID: id, Size: size} }
	deferred := func(o Op) Op { o.Deferred = true; return o }

	cases := []struct {
		name    string
		entries []snapshot.Entry
		want    Ops
	}{
		{"empty", nil, Ops{Ops: []Op{}}},
		{"pair", []snapshot.Entry{alloc(10, 512), req(10), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 512), op(OpFree, 0, 512)}, NumIDs: 1, Streams: []uint64{0}}},
		{"address reuse gets a new ID", []snapshot.Entry{alloc(10, 512), req(10), done(10), alloc(10, 1024), req(10), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 512), op(OpFree, 0, 512), op(OpAlloc, 1, 1024), op(OpFree, 1, 1024)}, NumIDs: 2, Streams: []uint64{0}}},
		{"deferred by another alloc", []snapshot.Entry{alloc(10, 512), req(10), alloc(20, 64), done(10), req(20), done(20)},
			Ops{Ops: []Op{op(OpAlloc, 0, 512), deferred(op(OpFree, 0, 512)), op(OpAlloc, 1, 64), op(OpFreeCompleted, 0, 512), op(OpFree, 1, 64)},
				NumIDs: 2, Streams: []uint64{0}}},
		{"deferred by another free", []snapshot.Entry{alloc(10, 512), alloc(20, 64), req(10), req(20), done(20), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 512), op(OpAlloc, 1, 64), deferred(op(OpFree, 0, 512)), op(OpFree, 1, 64), op(OpFreeCompleted, 0, 512)},
				NumIDs: 2, Streams: []uint64{0}}},
		{"another completion in between does not defer", []snapshot.Entry{alloc(10, 1), alloc(20, 2), req(10), req(20), done(10), done(20)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpAlloc, 1, 2), deferred(op(OpFree, 0, 1)), op(OpFree, 1, 2), op(OpFreeCompleted, 0, 1)},
				NumIDs: 2, Streams: []uint64{0}}},
		{"segment events in between do not defer", []snapshot.Entry{alloc(10, 1), req(10), e(snapshot.ActionSegmentFree, 99, 1, 0), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpFree, 0, 1)}, NumIDs: 1, Streams: []uint64{0}, Ignored: map[snapshot.Action]int{snapshot.ActionSegmentFree: 1}}},
		{"old trace: free_completed is the free", []snapshot.Entry{alloc(10, 512), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 512), op(OpFree, 0, 512)}, NumIDs: 1, Streams: []uint64{0}}},
		{"unmatched frees are counted", []snapshot.Entry{req(10), done(10), alloc(20, 1), req(20), done(20), req(20), done(20)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpFree, 0, 1)}, NumIDs: 1, UnmatchedFrees: 4, DoubleFrees: 2, Streams: []uint64{0}}},
		{"a second free_requested while the first is pending", []snapshot.Entry{alloc(10, 1), req(10), req(10), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpFree, 0, 1)}, NumIDs: 1, UnmatchedFrees: 1, DoubleFrees: 1, Streams: []uint64{0}}},
		{"old trace: a second free_completed", []snapshot.Entry{alloc(10, 1), done(10), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpFree, 0, 1)}, NumIDs: 1, UnmatchedFrees: 1, DoubleFrees: 1, Streams: []uint64{0}}},
		{"reallocation resets, a free_requested after the completed free is double", []snapshot.Entry{alloc(10, 1), req(10), done(10), alloc(10, 2), done(10), req(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpFree, 0, 1), op(OpAlloc, 1, 2), op(OpFree, 1, 2)}, NumIDs: 2, UnmatchedFrees: 1, DoubleFrees: 1, Streams: []uint64{0}}},
		{"a free before any alloc of the address is no double free", []snapshot.Entry{req(10), done(10)},
			Ops{Ops: []Op{}, UnmatchedFrees: 2}},
		{"live at end and uncompleted", []snapshot.Entry{alloc(10, 1), alloc(20, 2), req(20)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpAlloc, 1, 2), op(OpFree, 1, 2)}, NumIDs: 2, LiveAtEnd: 1, UncompletedFrees: 1, Streams: []uint64{0}}},
		{"alloc over a live address", []snapshot.Entry{alloc(10, 1), alloc(10, 2), req(10), done(10)},
			Ops{Ops: []Op{op(OpAlloc, 0, 1), op(OpAlloc, 1, 2), op(OpFree, 1, 2)}, NumIDs: 2, LiveAtEnd: 1, DuplicateAllocs: 1, Streams: []uint64{0}}},
		{"streams in first-use order, free keeps the alloc's stream and size",
			[]snapshot.Entry{e(snapshot.ActionAlloc, 1, 8, 7), e(snapshot.ActionAlloc, 2, 8, 0), e(snapshot.ActionAlloc, 3, 8, 7), e(snapshot.ActionFreeRequested, 1, 999, 5), done(1)},
			Ops{Ops: []Op{{Kind: OpAlloc, ID: 0, Size: 8, Stream: 7}, {Kind: OpAlloc, ID: 1, Size: 8}, {Kind: OpAlloc, ID: 2, Size: 8, Stream: 7},
				{Kind: OpFree, ID: 0, Size: 8, Stream: 7}}, NumIDs: 3, LiveAtEnd: 2, Streams: []uint64{7, 0}}},
		{"ignored actions are counted", []snapshot.Entry{e(snapshot.ActionSegmentAlloc, 1, 2, 0), e(snapshot.ActionSnapshot, 0, 0, 0), e(snapshot.ActionOOM, 5, 6, 0), e(snapshot.ActionSegmentMap, 1, 2, 0), e(snapshot.ActionSegmentUnmap, 1, 2, 0)},
			Ops{Ops: []Op{}, Ignored: map[snapshot.Action]int{snapshot.ActionSegmentAlloc: 1, snapshot.ActionSnapshot: 1, snapshot.ActionOOM: 1, snapshot.ActionSegmentMap: 1, snapshot.ActionSegmentUnmap: 1}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := BuildOps(c.entries)
			if !reflect.DeepEqual(got, c.want) {
				t.Errorf("got  %+v\nwant %+v", got, c.want)
			}
		})
	}
}

func TestOpKindString(t *testing.T) {
	for k, want := range map[OpKind]string{OpAlloc: "alloc", OpFree: "free", OpFreeCompleted: "free_completed", 9: "OpKind(9)"} {
		if k.String() != want {
			t.Errorf("%d: %q, want %q", k, k.String(), want)
		}
	}
}
