package main

import (
	"strings"
	"testing"

	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/workload"
	"go.uber.org/zap"
)

// TestServeReplayRefusesBadPlan: serve --replay on simulated devices
// refuses a trace whose recorded segments overlap, naming the entry.
func TestServeReplayRefusesBadPlan(t *testing.T) {
	seg := snapshot.Entry{Action: snapshot.ActionSegmentAlloc, Addr: 0x7f0000000000, Size: 2 << 20}
	tr := workload.NewTrace("dup", []snapshot.Entry{seg, seg})
	spec, err := devspec.Parse("sim:2")
	if err != nil {
		t.Fatal(err)
	}
	devs, err := openServeDevices(spec, "--device sim:2", 1<<30, &workload.Load{Trace: tr}, zap.NewNop())
	if err == nil {
		devspec.CloseAll(devs)
		t.Fatal("opened devices for a trace whose segments overlap")
	}
	if !strings.Contains(err.Error(), "entry 1") || !strings.Contains(err.Error(), "0x7f0000000000") {
		t.Errorf("%q does not name entry 1 and its address", err)
	}
}
