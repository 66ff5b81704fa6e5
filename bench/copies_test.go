package bench

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/allocd/allocd/simdev"
)

func TestCopiesOnSim(t *testing.T) {
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30, Backed: true})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := Copies(sim, CopyOptions{Sizes: []int{4 << 10, 1 << 20}, AllocSizes: []int{1 << 20}, Bytes: 4 << 20, Trials: 1, CachedIters: 1000, CachedTime: time.Millisecond, HostAllocTime: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Copies) != 2 || len(rep.Alloc) != 1 {
		t.Fatalf("report %+v", rep)
	}
	for _, c := range rep.Copies {
		if c.PageableH2D <= 0 || c.PinnedH2D <= 0 || c.PageableD2H <= 0 || c.PinnedD2H <= 0 {
			t.Errorf("row %+v has a zero bandwidth", c)
		}
	}
	if a := rep.Alloc[0]; a.CachedNs <= 0 || a.CachedRun < 1000 || a.HostAllocFreeRun < 5 || a.Speedup <= 0 {
		t.Errorf("alloc row %+v", a)
	}
	if c := sim.HostCounters(); c.LiveHostAllocations != 0 {
		t.Errorf("Copies left %d host allocations", c.LiveHostAllocations)
	}
	if c := sim.Counters(); c.LiveAllocations != 0 || c.LiveStream != 0 {
		t.Errorf("Copies left %d device allocations, %d streams", c.LiveAllocations, c.LiveStream)
	}
	var b bytes.Buffer
	if err := rep.WriteText(&b); err != nil || !strings.Contains(b.String(), "1 MiB") {
		t.Errorf("WriteText: %v\n%s", err, b.String())
	}
}

func TestRunCopiesJSON(t *testing.T) {
	if testing.Short() {
		t.Skip("moves a few hundred MiB")
	}
	sim, _ := simdev.New(simdev.Config{Capacity: 1 << 30})
	var b bytes.Buffer
	if err := RunCopies(&b, sim, true); err != nil {
		t.Fatal(err)
	}
	var rep CopyReport
	if err := json.Unmarshal(b.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Copies) != 8 || rep.Copies[7].Bytes != 64<<20 || !strings.Contains(rep.Device, "simulated") {
		t.Errorf("sizes on the sim: %d rows, device %q", len(rep.Copies), rep.Device)
	}
}
