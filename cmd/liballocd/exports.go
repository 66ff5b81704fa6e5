//go:build cgo

package main

/*
#cgo noescape liballocd_set_error
#cgo nocallback liballocd_set_error
#include <stddef.h>
#include <stdint.h>
#include "lasterror.h"

// The exports below are hidden (exports.h declares them so): the API's
// functions are C (forkguard.c, freequeue.c), which check for a forked
// child before they call them.
#include "exports.h"
*/
import "C"

import (
	"bytes"
	"encoding/json"
	"fmt"
	"runtime/debug"
	"unsafe"

	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/stats"
)

// The C API of liballocd.so. Each API function is C (forkguard.c,
// freequeue.c): in a forked child it fails at once (forkguard.h says why),
// and otherwise calls its Go half here, liballocd_go_<name> for
// allocd_<name>. Each Go half is thin: it recovers panics (a
// panic is reported like an error and never crosses into C), and reports
// errors through the calling OS thread's allocd_last_error message (a Go
// function called from C runs on the calling thread, and so do the C calls
// it makes). allocd_torch_free and allocd_last_error are C functions
// (freequeue.c): a free is queued, and each export below that reads or
// changes allocator state applies the queued frees first (getDrained).

func main() {}

// setError makes err the calling thread's allocd_last_error message.
func setError(err error) {
	s := err.Error()
	if s == "" {
		s = "allocd: unknown error"
	}
	C.liballocd_set_error((*C.char)(unsafe.Pointer(unsafe.StringData(s))), C.size_t(len(s)))
}

// recovered reports a panic in export as an error; call it deferred.
func recovered(export string) {
	if r := recover(); r != nil {
		err := fmt.Errorf("allocd: internal error in %s: %v", export, r)
		setError(err)
		if l := state.Load(); l != nil {
			l.log.Error("panic recovered", zap.String("export", export), zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
		}
	}
}

// fail records err and returns -1; report logs it too, for void exports.
func fail(err error) C.int {
	setError(err)
	return -1
}

func report(l *lib, what string, err error) {
	setError(err)
	if l != nil {
		l.log.Warn(what, zap.Error(err))
	}
}

// copyOut copies s into buf (NUL-terminated, truncated to n) and returns
// len(s).
func copyOut(s string, buf *C.char, n C.size_t) C.size_t {
	if buf != nil && n > 0 {
		b := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n))
		k := copy(b[:len(b)-1], s)
		b[k] = 0
	}
	return C.size_t(len(s))
}

func goString(p *C.char) *string {
	if p == nil {
		return nil
	}
	s := C.GoString(p)
	return &s
}

//export liballocd_go_init
func liballocd_go_init(conf, metricsListen, logLevel *C.char) (rc C.int) {
	defer recovered("allocd_init")
	rc = -1
	if _, err := initLib(resolveSettings(goString(conf), goString(metricsListen), goString(logLevel)), true); err != nil {
		return fail(err)
	}
	return 0
}

// liballocd_go_malloc is allocd_torch_malloc (freequeue.c), which returns
// its result as a void*. The pointer travels as an integer: a result of
// pointer type costs the cgo check of a pointer returned to C on every call.
//
//export liballocd_go_malloc
func liballocd_go_malloc(size C.size_t, device C.int, stream C.uintptr_t) (p C.uintptr_t) {
	defer recovered("allocd_torch_malloc")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return 0
	}
	ptr, err := l.malloc(uint64(size), int(device), cudart.Stream(stream))
	if err != nil {
		setError(err)
		l.log.Debug("malloc failed", zap.Error(err))
		return 0
	}
	return C.uintptr_t(ptr)
}

//export liballocd_go_torch_record_stream
func liballocd_go_torch_record_stream(ptr unsafe.Pointer, stream unsafe.Pointer) {
	defer recovered("allocd_torch_record_stream")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return
	}
	if err := l.recordStream(cudart.Ptr(uintptr(ptr)), cudart.Stream(uintptr(stream))); err != nil {
		setError(err)
		l.badLog.Warn("record_stream failed", zap.Error(err))
	}
}

//export liballocd_go_torch_empty_cache
func liballocd_go_torch_empty_cache() {
	defer recovered("allocd_torch_empty_cache")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return
	}
	if err := l.devs.EmptyCache(); err != nil {
		report(l, "empty cache failed", err)
	}
}

//export liballocd_go_torch_set_memory_fraction
func liballocd_go_torch_set_memory_fraction(fraction C.double, device C.int) {
	defer recovered("allocd_torch_set_memory_fraction")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return
	}
	a, err := l.devs.ForDevice(int(device))
	if err == nil {
		err = a.SetMemoryFraction(float64(fraction))
	}
	if err != nil {
		report(l, "set memory fraction failed", err)
	}
}

// liballocd_go_release_stream is allocd_release_stream: a stream torch or
// the program destroyed. Its cached segments go back to the device at
// once, or as soon as nothing on it is allocated or waits for events
// (Allocator.ReleaseStream). A device whose allocator does not exist yet
// has nothing cached: 0.
//
//export liballocd_go_release_stream
func liballocd_go_release_stream(device C.int, stream C.uintptr_t) (rc C.int) {
	defer recovered("allocd_release_stream")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return fail(err)
	}
	if device < 0 || device >= maxDevices {
		return fail(fmt.Errorf("allocd: release_stream: device %d: index outside 0..%d: %w", device, maxDevices-1, allocator.ErrNoSuchDevice))
	}
	if a := l.alloc(int(device)); a != nil {
		if err := a.ReleaseStream(cudart.Stream(stream)); err != nil {
			report(l, "release stream failed", fmt.Errorf("allocd: release_stream on device %d: %w", device, err))
			return -1
		}
	}
	return 0
}

//export liballocd_go_memory_stats_json
func liballocd_go_memory_stats_json(device C.int, buf *C.char, n C.size_t) (size C.size_t) {
	defer recovered("allocd_memory_stats_json")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return copyOut("{}", buf, n)
	}
	b, err := json.Marshal(l.flatStats(int(device)))
	if err != nil {
		setError(err)
		return copyOut("{}", buf, n)
	}
	return copyOut(string(b), buf, n)
}

//export liballocd_go_memory_summary
func liballocd_go_memory_summary(device C.int, abbreviated C.int, buf *C.char, n C.size_t) C.size_t {
	defer recovered("allocd_memory_summary")
	l, err := getDrained()
	if err != nil {
		setError(err)
		return copyOut("", buf, n)
	}
	var b bytes.Buffer
	st := l.deviceStats(int(device))
	_ = stats.WriteSummary(&b, st, int(device), abbreviated != 0)
	return copyOut(b.String(), buf, n)
}

// query runs f on device's allocator; 0 when it does not exist.
func query(export string, device C.int, f func(l *lib, device int) int64) (v C.longlong) {
	defer recovered(export)
	l, err := getDrained()
	if err != nil {
		setError(err)
		return 0
	}
	return C.longlong(f(l, int(device)))
}

//export liballocd_go_memory_allocated
func liballocd_go_memory_allocated(device C.int) C.longlong {
	return query("allocd_memory_allocated", device, func(l *lib, d int) int64 {
		if a := l.alloc(d); a != nil {
			return a.MemoryAllocated()
		}
		return 0
	})
}

//export liballocd_go_memory_reserved
func liballocd_go_memory_reserved(device C.int) C.longlong {
	return query("allocd_memory_reserved", device, func(l *lib, d int) int64 {
		if a := l.alloc(d); a != nil {
			return a.MemoryReserved()
		}
		return 0
	})
}

//export liballocd_go_max_memory_allocated
func liballocd_go_max_memory_allocated(device C.int) C.longlong {
	return query("allocd_max_memory_allocated", device, func(l *lib, d int) int64 {
		if a := l.alloc(d); a != nil {
			return a.MaxMemoryAllocated()
		}
		return 0
	})
}

//export liballocd_go_max_memory_reserved
func liballocd_go_max_memory_reserved(device C.int) C.longlong {
	return query("allocd_max_memory_reserved", device, func(l *lib, d int) int64 {
		if a := l.alloc(d); a != nil {
			return a.MaxMemoryReserved()
		}
		return 0
	})
}

//export liballocd_go_reset_peak_stats
func liballocd_go_reset_peak_stats(device C.int) (rc C.int) {
	defer recovered("allocd_reset_peak_stats")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return fail(err)
	}
	if a := l.alloc(int(device)); a != nil {
		a.ResetPeakStats()
	}
	return 0
}

//export liballocd_go_record_history
func liballocd_go_record_history(enabled C.int, maxEntries C.longlong, stackDepth C.int) (rc C.int) {
	defer recovered("allocd_record_history")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return fail(err)
	}
	if err := l.setHistory(historyOptions{Enabled: enabled != 0, MaxEntries: int(maxEntries), StackDepth: int(stackDepth)}); err != nil {
		report(l, "record history failed", err)
		return -1
	}
	return 0
}

//export liballocd_go_dump_snapshot
func liballocd_go_dump_snapshot(path *C.char) (rc C.int) {
	defer recovered("allocd_dump_snapshot")
	rc = -1
	l, err := getDrained()
	if err != nil {
		return fail(err)
	}
	if path == nil {
		return fail(fmt.Errorf("allocd: dump snapshot: NULL path"))
	}
	if err := l.dumpSnapshot(C.GoString(path)); err != nil {
		report(l, "dump snapshot failed", err)
		return -1
	}
	return 0
}

//export liballocd_go_metrics_address
func liballocd_go_metrics_address(buf *C.char, n C.size_t) C.size_t {
	defer recovered("allocd_metrics_address")
	l, err := get()
	if err != nil || l.metrics == nil {
		if err != nil {
			setError(err)
		}
		return copyOut("", buf, n)
	}
	return copyOut(l.metrics.addr, buf, n)
}
