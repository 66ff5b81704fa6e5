package simdev

import (
	"sync"
	"syscall"
)

// physicalMemory returns the machine's physical memory in bytes, or 0 when
// the system does not say. It is read once.
var physicalMemory = sync.OnceValue(func() uint64 {
	var si syscall.Sysinfo_t
	if err := syscall.Sysinfo(&si); err != nil {
		return 0
	}
	unit := uint64(si.Unit)
	if unit == 0 {
		unit = 1
	}
	total := uint64(si.Totalram)
	if total > ^uint64(0)/unit {
		return 0
	}
	return total * unit
})
