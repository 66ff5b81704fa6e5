package bench

import (
	"errors"
	"fmt"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/workload"
)

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
func (t *Target) replayDevice(tr *workload.Trace) (cudart.Device, error) {
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
func (t *Target) Replay(tr *workload.Trace, cfg allocator.Config, opt workload.ReplayOptions, prepare func(*allocator.Allocator, *workload.ReplayOptions), aopts ...allocator.Option) (ReplayRow, error) {
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
	r, err := workload.Replay(&tr.Ops, a, opt)
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

// ReplayWarm replays tr twice on a fresh allocator configured by cfg with
// opt and returns the second pass (workload.ReplayWarm); the allocator's
// Check must pass after it, as in Replay. aopts are passed to
// allocator.New.
func (t *Target) ReplayWarm(tr *workload.Trace, cfg allocator.Config, opt workload.ReplayOptions, aopts ...allocator.Option) (workload.ReplayResult, error) {
	dev, err := t.replayDevice(tr)
	if err != nil {
		return workload.ReplayResult{}, err
	}
	a, err := allocator.New(dev, cfg, aopts...)
	if err != nil {
		return workload.ReplayResult{}, err
	}
	r, err := workload.ReplayWarm(&tr.Ops, a, opt)
	if err == nil {
		if cerr := a.Check(); cerr != nil {
			err = fmt.Errorf("warm replay: the allocator's Check failed after the replay: %w", cerr)
		}
	}
	if cerr := a.Close(); err == nil && cerr != nil && !errors.Is(cerr, allocator.ErrLiveBlocks) {
		err = cerr
	}
	return r, err
}

// SnapshotAtPeak returns the snapshot at the moment of tr's peak reserved
// memory with cfg (SnapshotAtPeak), its history bounded by
// historyEntries. It needs a simulated target, whose replays are
// deterministic. aopts are passed to allocator.New, as in Replay.
func (t *Target) SnapshotAtPeak(tr *workload.Trace, cfg allocator.Config, historyEntries int, aopts ...allocator.Option) (*snapshot.Snapshot, error) {
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
