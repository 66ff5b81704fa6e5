package simdev

import "sync"

// Faults makes chosen calls of one Sim fail, so that tests reach their
// callers' error paths: the n-th malloc-like call (Malloc, and Create of
// cudart.VirtualMemory) or the n-th HostAlloc from now. Sim.Faults returns
// a Sim's; they are safe for concurrent use.
type Faults struct {
	mu        sync.Mutex
	malloc    fault
	hostAlloc fault
}

// fault is the planned failure of one kind of call.
type fault struct {
	calls int64 // calls so far, failed ones included
	at    int64 // the ordinal of the call to fail (0: none)
	err   error
}

func (f *fault) set(n int, err error) {
	if n <= 0 {
		f.at = 0
		return
	}
	f.at = f.calls + int64(n)
	f.err = err
}

// hit counts a call and reports whether it is the one to fail, with the
// error to return (nil: the call's own out-of-memory error).
func (f *fault) hit() (bool, error) {
	f.calls++
	if f.at == 0 || f.calls != f.at {
		return false, nil
	}
	f.at = 0
	return true, f.err
}

// FailMalloc makes the n-th malloc-like call from now (n = 1: the next
// one) fail with err, or with an out-of-memory error when err is nil.
// n <= 0 clears a pending fault. A Create counts as a malloc call.
func (f *Faults) FailMalloc(n int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.malloc.set(n, err)
}

// FailHostAlloc makes the n-th HostAlloc call from now (n = 1: the next)
// fail with err, or with an out-of-memory error when err is nil. n <= 0
// clears a pending fault.
func (f *Faults) FailHostAlloc(n int, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hostAlloc.set(n, err)
}

// mallocFault counts a malloc-like call and reports whether FailMalloc
// chose it to fail, with the error to return (nil: the caller's own
// out-of-memory error).
func (f *Faults) mallocFault() (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.malloc.hit()
}

// hostAllocFault is mallocFault for HostAlloc and FailHostAlloc.
func (f *Faults) hostAllocFault() (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hostAlloc.hit()
}
