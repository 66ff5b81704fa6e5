package bench

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
)

// TestRunSuiteMixedRows: RunSuite reports one cold and one warm mixed row
// per goroutine count, in order, and none when MixedSteps is 0.
func TestRunSuiteMixedRows(t *testing.T) {
	target, err := OpenTarget("sim", 141<<30)
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	rep, err := RunSuite(target, allocator.DefaultConfig(), Suite{MixedSteps: 500, Threads: []int{1, 2}})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Mixed) != 2 || len(rep.Warm) != 2 {
		t.Fatalf("%d mixed and %d mixed_warm rows, want 2 and 2", len(rep.Mixed), len(rep.Warm))
	}
	for i, th := range []int{1, 2} {
		if rep.Mixed[i].Threads != th || rep.Warm[i].Threads != th || rep.Warm[i].Ops == 0 {
			t.Errorf("row %d: mixed %+v, mixed_warm %+v; want threads=%d with operations", i, rep.Mixed[i], rep.Warm[i], th)
		}
	}
	if rep, err = RunSuite(target, allocator.DefaultConfig(), Suite{Threads: []int{1}}); err != nil || len(rep.Mixed)+len(rep.Warm) != 0 {
		t.Errorf("MixedSteps 0: %d rows, err %v; want none", len(rep.Mixed)+len(rep.Warm), err)
	}
}

// TestRunSuiteWarmReplays: every trace's row carries its warm replay and
// driver figures: the warm pass makes no device malloc on the simulated
// device, and the driver costs less than the replay. The JSON has the
// fields beside ns_per_op, the table the columns; a row of `allocd
// replay` (no WarmFigures) has neither.
func TestRunSuiteWarmReplays(t *testing.T) {
	target, err := OpenTarget("sim", 141<<30)
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	names := []string{"resnet50_train", "multistream_prefetch"}
	var files []string
	for _, n := range names {
		files = append(files, traceFile(t, n))
	}
	rep, err := RunSuite(target, allocator.DefaultConfig(), Suite{Traces: files})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Replay) != len(names) {
		t.Fatalf("%d replay rows, want %d", len(rep.Replay), len(names))
	}
	for i, r := range rep.Replay {
		w := r.WarmFigures
		if r.Trace != names[i] || w == nil {
			t.Fatalf("row %d: trace %q, warm figures %v; want %s with warm figures", i, r.Trace, w, names[i])
		}
		if r.DeviceMallocs == 0 || w.WarmDeviceMallocs != 0 || w.WarmDeviceMallocNsPerOp != 0 {
			t.Errorf("%s: %d device mallocs cold, %d warm (%.1f ns/op); want some, then none", r.Trace, r.DeviceMallocs, w.WarmDeviceMallocs, w.WarmDeviceMallocNsPerOp)
		}
		if w.WarmNsPerOp <= 0 || w.DriverNsPerOp <= 0 || w.DriverNsPerOp >= r.NsPerOp || w.DriverNsPerOp >= w.WarmNsPerOp {
			t.Errorf("%s: cold %.1f, warm %.1f, driver %.1f ns/op; want the driver's below both", r.Trace, r.NsPerOp, w.WarmNsPerOp, w.DriverNsPerOp)
		}
	}
	js, err := json.Marshal(rep.Replay[0])
	if err != nil {
		t.Fatal(err)
	}
	var fields map[string]any
	if err := json.Unmarshal(js, &fields); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ns_per_op", "device_malloc_ns_per_op", "warm_ns_per_op", "warm_device_mallocs", "warm_device_malloc_ns_per_op", "driver_ns_per_op"} {
		if _, ok := fields[k]; !ok {
			t.Errorf("JSON row without %s: %s", k, js)
		}
	}
	plain := rep.Replay[0]
	plain.WarmFigures = nil
	if js, _ := json.Marshal(plain); strings.Contains(string(js), "warm") || strings.Contains(string(js), "driver") {
		t.Errorf("a row without warm figures shows them: %s", js)
	}
	var b strings.Builder
	if err := WriteReport(&b, rep); err != nil {
		t.Fatal(err)
	}
	for _, col := range []string{"device ns/op", "warm ns/op", "warm device mallocs", "driver ns/op"} {
		if !strings.Contains(b.String(), col) {
			t.Errorf("table without the %q column:\n%s", col, b.String())
		}
	}
	if strings.Contains(b.String(), "warm pass made") {
		t.Errorf("table notes device mallocs in a warm pass that made none:\n%s", b.String())
	}
}

// TestWriteReplayTableWarmMallocs: a warm pass that made device mallocs is
// named under the table.
func TestWriteReplayTableWarmMallocs(t *testing.T) {
	rows := []ReplayRow{
		{Trace: "a", Ops: 10, WarmFigures: &WarmFigures{WarmNsPerOp: 100, WarmDeviceMallocs: 3, WarmDeviceMallocNsPerOp: 40, DriverNsPerOp: 2}},
		{Trace: "b", Ops: 10, WarmFigures: &WarmFigures{WarmNsPerOp: 90, DriverNsPerOp: 2}},
	}
	var b strings.Builder
	if err := WriteReplayTable(&b, rows); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "a, (default): the warm pass made 3 device mallocs (40 ns/op)") || strings.Contains(b.String(), "b, (default): the warm") {
		t.Errorf("want a note for a alone:\n%s", b.String())
	}
}
