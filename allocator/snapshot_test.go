package allocator

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"testing"

	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// TestSnapshotOneModel: the JSON view and the pickle come from the same
// *snapshot.Snapshot, with PyTorch's key names and the same settings.
func TestSnapshotOneModel(t *testing.T) {
	a, _ := newTestAllocator(t, giB, "max_split_size_mb:64")
	if err := a.RecordHistory(HistoryOptions{MaxEntries: 100}); err != nil {
		t.Fatal(err)
	}
	p := mustMalloc(t, a, 4096, 0)
	q := mustMalloc(t, a, 8*miB, 0)
	mustFree(t, a, q)
	snap := a.Snapshot()
	js, err := json.Marshal(snap)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(js, &doc); err != nil {
		t.Fatal(err)
	}
	settings, _ := doc["allocator_settings"].(map[string]any)
	if settings["backend"] != "allocd" || settings["PYTORCH_CUDA_ALLOC_CONF"] != a.Config().String() {
		t.Errorf("JSON allocator_settings = %v", settings)
	}
	segs, _ := doc["segments"].([]any)
	if len(segs) != 2 {
		t.Fatalf("JSON has %d segments, want 2: %s", len(segs), js)
	}
	seg0 := segs[0].(map[string]any)
	for _, k := range []string{"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream", "segment_type", "is_expandable", "blocks"} {
		if _, ok := seg0[k]; !ok {
			t.Errorf("JSON segment lacks %q: %v", k, seg0)
		}
	}
	blk := seg0["blocks"].([]any)[0].(map[string]any)
	if blk["state"] != string(snapshot.BlockActiveAllocated) || blk["requested_size"] != float64(4096) {
		t.Errorf("first block %v, want the 4096-byte allocation", blk)
	}
	var buf bytes.Buffer
	if err := a.WriteSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	back, err := trace.Read(&buf, trace.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back.Segments, snap.Segments) {
		t.Errorf("pickle segments\n%+v\nJSON model\n%+v", back.Segments, snap.Segments)
	}
	if back.AllocatorSettings["backend"] != "allocd" || back.AllocatorSettings["PYTORCH_CUDA_ALLOC_CONF"] != a.Config().String() {
		t.Errorf("pickle allocator_settings = %v", back.AllocatorSettings)
	}
	if len(back.DeviceTraces) != 1 || len(back.DeviceTraces[0]) != len(snap.DeviceTraces[0]) || len(snap.DeviceTraces[0]) != 6 {
		t.Errorf("traces: pickle %d, model %v", len(back.DeviceTraces), snap.DeviceTraces)
	}
	mustFree(t, a, p)
}

// TestDevicesSnapshot: one snapshot over every device, traces by index.
func TestDevicesSnapshot(t *testing.T) {
	d, _ := newTestDevices(t, giB, "", 0, 2)
	for _, a := range d.All() {
		if err := a.RecordHistory(HistoryOptions{MaxEntries: 10}); err != nil {
			t.Fatal(err)
		}
	}
	p, err := d.MallocOn(2, 4096, 0)
	if err != nil {
		t.Fatal(err)
	}
	snap := d.Snapshot()
	if len(snap.Segments) != 1 || snap.Segments[0].Device != 2 {
		t.Errorf("segments %+v, want one of device 2", snap.Segments)
	}
	if len(snap.DeviceTraces) != 3 || len(snap.DeviceTraces[0]) != 0 || len(snap.DeviceTraces[1]) != 0 || len(snap.DeviceTraces[2]) != 2 {
		t.Errorf("device traces %v, want device 2's two events at index 2", snap.DeviceTraces)
	}
	var buf bytes.Buffer
	if err := d.WriteSnapshot(&buf); err != nil {
		t.Fatal(err)
	}
	if err := d.Free(p); err != nil {
		t.Fatal(err)
	}
}

// TestRecordHistory: switched on and off at run time, bounded, and a ring
// that grows with the events rather than its bound.
func TestRecordHistory(t *testing.T) {
	a, _ := newTestAllocator(t, giB, "")
	for _, bad := range []HistoryOptions{{MaxEntries: 99999999999}, {MaxEntries: -1}, {MaxEntries: MaxHistoryEntries + 1}, {MaxEntries: 10, StackDepth: MaxStackDepth + 1}, {MaxEntries: 10, StackDepth: -1}} {
		if err := a.RecordHistory(bad); !errors.Is(err, ErrHistory) {
			t.Errorf("RecordHistory(%+v) = %v, want ErrHistory", bad, err)
		}
	}
	if _, err := New(a.Device(), DefaultConfig(), WithHistory(99999999999)); !errors.Is(err, ErrHistory) {
		t.Errorf("New with WithHistory(99999999999) = %v, want ErrHistory", err)
	}
	if err := a.RecordHistory(HistoryOptions{MaxEntries: MaxHistoryEntries}); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, mustMalloc(t, a, 512, 0))
	if c := cap(a.history.ring); c > 256 {
		t.Errorf("ring of %d entries reserved for 4 events", c)
	}
	if n := len(a.Snapshot().DeviceTraces[0]); n != 4 { // segment_alloc, alloc, free_requested, free_completed
		t.Errorf("%d events, want 4", n)
	}
	if err := a.RecordHistory(HistoryOptions{MaxEntries: 3}); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		mustFree(t, a, mustMalloc(t, a, 512, 0))
	}
	tr := a.Snapshot().DeviceTraces[0]
	if len(tr) != 3 || tr[0].Action != snapshot.ActionAlloc || tr[1].Action != snapshot.ActionFreeRequested || tr[2].Action != snapshot.ActionFreeCompleted {
		t.Errorf("ring of 3 holds %v, want the last alloc, free_requested, free_completed", tr)
	}
	if err := a.RecordHistory(HistoryOptions{}); err != nil {
		t.Fatal(err)
	}
	mustFree(t, a, mustMalloc(t, a, 512, 0))
	if tr := a.Snapshot().DeviceTraces[0]; len(tr) != 0 {
		t.Errorf("history off still shows %d events", len(tr))
	}
}
