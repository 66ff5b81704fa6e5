//go:build !linux

package simdev

// physicalMemory returns 0: the machine's physical memory is not known
// here, and the Sim's host capacity alone bounds HostAlloc.
func physicalMemory() uint64 { return 0 }
