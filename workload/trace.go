package workload

import (
	"fmt"
	"path/filepath"

	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// Trace is a PyTorch memory trace made ready for replay: the operations
// of its first device's trace and the addresses of the segments it
// recorded.
type Trace struct {
	// Name is the file's base name.
	Name string
	// Ops are the allocations and frees to replay (trace.BuildOps).
	Ops trace.Ops
	// Addresses are the recorded segment addresses (SegmentAddresses),
	// for a Sim to hand out again.
	Addresses []simdev.Address

	planErr error // CheckSegments of the entries
}

// NewTrace builds the replay of one device trace's entries: its
// operations (trace.BuildOps) and its recorded segment addresses
// (SegmentAddresses), which CheckSegments checks; CheckPlan returns the
// result.
func NewTrace(name string, entries []snapshot.Entry) *Trace {
	return &Trace{Name: name, Ops: trace.BuildOps(entries), Addresses: SegmentAddresses(entries), planErr: CheckSegments(entries)}
}

// CheckPlan returns why tr's recorded segment addresses cannot be given to
// a simulated device (CheckSegments), or nil. A replay on a simulated
// device refuses such a trace before it runs.
func (tr *Trace) CheckPlan() error { return tr.planErr }

// LoadTrace reads the memory snapshot at path (trace.ReadFile: a plain or
// gzip pickle of torch.cuda.memory._dump_snapshot()), checks that it holds
// a device trace with entries, and builds the replay of its first
// device's. Every error names the file.
func LoadTrace(path string) (*Trace, error) {
	snap, err := trace.ReadFile(path, trace.ReadOptions{})
	if err != nil {
		return nil, err // names the file
	}
	if len(snap.DeviceTraces) == 0 || len(snap.DeviceTraces[0]) == 0 {
		return nil, fmt.Errorf("%s: the snapshot has no device trace (record with torch.cuda.memory._record_memory_history() before dumping it)", path)
	}
	return NewTrace(filepath.Base(path), snap.DeviceTraces[0]), nil
}
