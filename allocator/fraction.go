package allocator

import "fmt"

// SetMemoryFraction changes per_process_memory_fraction at run time, as
// torch.cuda.set_per_process_memory_fraction does: from now on the
// allocator reserves at most f × the device's total memory, and a request
// beyond that fails with an *OOMError. f must be in [0, 1] (NaN and
// infinities are refused, as the configuration key refuses them); 0
// removes the cap, as an unset per_process_memory_fraction does (PyTorch
// would refuse every allocation instead). Memory already reserved above a
// lower cap is not released; EmptyCache returns what is cached. A bad f
// gets an error wrapping ErrConfig and changes nothing. Config() reports
// the new value.
func (a *Allocator) SetMemoryFraction(f float64) error {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return fmt.Errorf("allocator: set memory fraction: %w", ErrClosed)
	}
	cfg := a.cfg
	cfg.PerProcessMemoryFraction = f
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("allocator: set memory fraction: %w", err)
	}
	a.cfg = cfg
	a.capped = f > 0
	a.allowed = a.total
	if a.capped {
		a.allowed = uint64(f * float64(a.total))
	}
	a.setExpandableCeiling()
	return nil
}

// setExpandableCeiling tells the expandable segments' Space the cap, so
// that a growth rounded to the page boundary never maps past it.
func (a *Allocator) setExpandableCeiling() {
	if a.exp == nil {
		return
	}
	var ceiling uint64
	if a.capped {
		ceiling = a.allowed
	}
	a.exp.SetCeiling(ceiling)
}
