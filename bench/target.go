package bench

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/simdev"
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
func NewTrace(name string, entries []trace.Entry) *Trace {
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

// Target gives each replay or benchmark its device: a fresh simulated
// device every time, or one CUDA device that every run shares.
type Target struct {
	capacity uint64        // simulated devices' memory
	cuda     cudart.Device // nil: simulated
	// Desc says which device it is, for people: "simulated device, 141.00
	// GiB" or "CUDA device 0 (NVIDIA H200)".
	Desc string
}

// OpenTarget opens the target a device flag names: "sim", "cuda",
// "cuda:N" (devspec.ParseOne), or "auto", CUDA device 0 when a driver is
// present and otherwise a simulated device, which Desc then says.
// simCapacity is each simulated device's memory. Only "auto" falls back
// to the simulator; a missing driver is an error for "cuda".
func OpenTarget(device string, simCapacity uint64) (*Target, error) {
	sim := &Target{capacity: simCapacity, Desc: "simulated device, " + allocator.FormatSize(simCapacity)}
	spec := devspec.Spec{Count: 1}
	if device != "auto" {
		var err error
		if spec, err = devspec.ParseOne(device); err != nil {
			return nil, err
		}
		if spec.Sim {
			return sim, nil
		}
	}
	dev, err := cudart.Open(spec.Index)
	if err != nil {
		if device == "auto" && errors.Is(err, cudart.ErrNoDriver) {
			sim.Desc += " (no CUDA driver found; `allocd devices` says why)"
			return sim, nil
		}
		return nil, err
	}
	info := dev.Info()
	return &Target{cuda: dev, Desc: fmt.Sprintf("CUDA device %d (%s)", info.Index, info.Name)}, nil
}

// Sim reports whether the target's devices are simulated.
func (t *Target) Sim() bool { return t.cuda == nil }

// Device returns the device for one run: a new Sim of the target's
// capacity configured by cfg (its Capacity is ignored), or the CUDA
// device, the same every time (cfg is ignored). The caller closes a Sim;
// the target closes the CUDA device.
func (t *Target) Device(cfg simdev.Config) (cudart.Device, error) {
	if t.cuda != nil {
		return t.cuda, nil
	}
	cfg.Capacity = t.capacity
	return simdev.New(cfg)
}

// Close closes the CUDA device, if the target has one.
func (t *Target) Close() error {
	if t.cuda != nil {
		return t.cuda.Close()
	}
	return nil
}

// replayDevice is the device for a replay of tr: on a Sim, events that
// complete only when the replay says (so deferred frees happen at the
// trace's positions) and the trace's segment addresses (so that blocks
// land where the recorded program's did), once CheckPlan accepts them.
func (t *Target) replayDevice(tr *Trace) (cudart.Device, error) {
	if t.Sim() {
		if err := tr.CheckPlan(); err != nil {
			return nil, err
		}
	}
	return t.Device(simdev.Config{ManualEvents: true, Addresses: tr.Addresses})
}

// Replay replays tr on a fresh allocator configured by cfg and returns
// its row (Trace and Conf left for the caller). prepare, when set, is
// called with the allocator before the replay, to attach observers to
// opt. An allocator closed with live blocks is not an error: a trace may
// end with memory in use. After the replay the allocator's Check must
// pass: an allocator whose structures and statistics disagree is an
// error, whatever the peaks say. aopts are passed to allocator.New (for
// example allocator.WithPyTorchExpandable).
func (t *Target) Replay(tr *Trace, cfg allocator.Config, opt ReplayOptions, prepare func(*allocator.Allocator, *ReplayOptions), aopts ...allocator.Option) (ReplayRow, error) {
	dev, err := t.replayDevice(tr)
	if err != nil {
		return ReplayRow{}, err
	}
	a, err := allocator.New(dev, cfg, aopts...)
	if err != nil {
		return ReplayRow{}, err
	}
	if prepare != nil {
		prepare(a, &opt)
	}
	r, err := Replay(&tr.Ops, a, opt)
	if err == nil {
		if cerr := a.Check(); cerr != nil {
			err = fmt.Errorf("replay: the allocator's Check failed after the replay: %w", cerr)
		}
	}
	if cerr := a.Close(); err == nil && cerr != nil && !errors.Is(cerr, allocator.ErrLiveBlocks) {
		err = cerr
	}
	if err != nil {
		return ReplayRow{}, err
	}
	return RowOf(r), nil
}

// SnapshotAtPeak returns the snapshot at the moment of tr's peak reserved
// memory with cfg (SnapshotAtPeak), its history bounded by
// historyEntries. It needs a simulated target, whose replays are
// deterministic. aopts are passed to allocator.New, as in Replay.
func (t *Target) SnapshotAtPeak(tr *Trace, cfg allocator.Config, historyEntries int, aopts ...allocator.Option) (*trace.Snapshot, error) {
	if !t.Sim() {
		return nil, errors.New("a snapshot at peak needs the simulated device, whose replays are deterministic")
	}
	snap, _, err := SnapshotAtPeak(&tr.Ops, func(history bool) (*allocator.Allocator, error) {
		dev, err := t.replayDevice(tr)
		if err != nil {
			return nil, err
		}
		opts := append([]allocator.Option(nil), aopts...)
		if history {
			opts = append(opts, allocator.WithHistory(historyEntries))
		}
		return allocator.New(dev, cfg, opts...)
	})
	return snap, err
}
