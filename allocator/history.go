package allocator

import (
	"fmt"
	"runtime"
	"strings"
	"time"
	"unsafe"

	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/snapshot"
)

// Bounds of RecordHistory.
const (
	// MaxHistoryEntries is the largest HistoryOptions.MaxEntries: about
	// 480 MB of history (48 bytes an entry) once the ring is full.
	MaxHistoryEntries = 10_000_000
	// MaxStackDepth is the largest HistoryOptions.StackDepth.
	MaxStackDepth = 64
	// maxStacks bounds the distinct stacks interned; events from further
	// call sites are recorded without frames.
	maxStacks = 1 << 16
)

// ErrHistory: RecordHistory was given options out of range.
var ErrHistory = fmt.Errorf("invalid history options")

// HistoryOptions configure history recording (RecordHistory), as
// torch.cuda.memory._record_memory_history does.
type HistoryOptions struct {
	// MaxEntries is how many of the latest events are kept, at most
	// MaxHistoryEntries; 0 turns recording off. The ring grows with the
	// events actually recorded, so a large bound costs nothing until it
	// is used.
	MaxEntries int
	// StackDepth, when above 0, records up to that many Go stack frames
	// (at most MaxStackDepth) of each Malloc and Free: the call site
	// outside this package, innermost first. Identical stacks are stored
	// once; program counters are resolved to function, file and line only
	// when a snapshot is taken, where they appear as the frames of trace
	// entries and blocks (memory_viz shows them). Capturing a stack costs
	// about a microsecond per call.
	StackDepth int
}

// The actions recorded, in the order of actionNames.
const (
	actionAlloc uint8 = iota
	actionFreeRequested
	actionFreeCompleted
	actionSegmentAlloc
	actionSegmentFree
	actionSegmentMap
	actionSegmentUnmap
	actionOOM
)

var actionNames = [...]snapshot.Action{
	actionAlloc:         snapshot.ActionAlloc,
	actionFreeRequested: snapshot.ActionFreeRequested,
	actionFreeCompleted: snapshot.ActionFreeCompleted,
	actionSegmentAlloc:  snapshot.ActionSegmentAlloc,
	actionSegmentFree:   snapshot.ActionSegmentFree,
	actionSegmentMap:    snapshot.ActionSegmentMap,
	actionSegmentUnmap:  snapshot.ActionSegmentUnmap,
	actionOOM:           snapshot.ActionOOM,
}

// historyEntry is one recorded event; stack is 1 + the index of its
// interned stack, or 0.
type historyEntry struct {
	addr, size, stream uint64
	timeUS             int64
	stack              uint32
	action             uint8
}

// history is a bounded ring of events that grows as it fills, with the
// interned stacks of the events that have one.
type history struct {
	ring  []historyEntry
	limit int
	next  int // the oldest entry once len(ring) == limit
	depth int // stack frames to record; 0: none

	pcs      []uintptr         // scratch for runtime.Callers
	key      []byte            // scratch for the interning key
	stackIDs map[string]uint32 // stack key → 1 + index in stacks
	stacks   [][]uintptr
	frames   [][]snapshot.Frame // resolved stacks, filled by snapshots
	live     map[uint64]uint32
}

func newHistory(opt HistoryOptions) *history {
	h := &history{limit: opt.MaxEntries, depth: opt.StackDepth}
	if h.depth > 0 {
		// A few frames more than asked: the allocator's own are dropped.
		h.pcs = make([]uintptr, h.depth+8)
		h.stackIDs = make(map[string]uint32)
		h.live = make(map[uint64]uint32)
	}
	return h
}

func (h *history) add(e historyEntry) {
	if len(h.ring) < h.limit {
		if len(h.ring) == cap(h.ring) {
			grown := make([]historyEntry, len(h.ring), min(max(2*cap(h.ring), 256), h.limit))
			copy(grown, h.ring)
			h.ring = grown
		}
		h.ring = append(h.ring, e)
		return
	}
	h.ring[h.next] = e
	h.next++
	if h.next == h.limit {
		h.next = 0
	}
}

// inOrder calls f for each entry, oldest first.
func (h *history) inOrder(f func(*historyEntry)) {
	for i := h.next; i < len(h.ring); i++ {
		f(&h.ring[i])
	}
	for i := 0; i < h.next && len(h.ring) == h.limit; i++ {
		f(&h.ring[i])
	}
}

// capture interns the calling goroutine's stack and returns its id, or 0.
func (h *history) capture() uint32 {
	n := runtime.Callers(2, h.pcs) // from capture's caller; resolve drops this package's frames
	if n == 0 {
		return 0
	}
	pcs := h.pcs[:n]
	h.key = h.key[:0]
	h.key = append(h.key, unsafe.Slice((*byte)(unsafe.Pointer(&pcs[0])), n*int(unsafe.Sizeof(pcs[0])))...)
	if id, ok := h.stackIDs[string(h.key)]; ok {
		return id
	}
	if len(h.stacks) >= maxStacks {
		return 0
	}
	h.stacks = append(h.stacks, append([]uintptr(nil), pcs...))
	id := uint32(len(h.stacks))
	h.stackIDs[string(h.key)] = id
	return id
}

// resolve returns the frames of stack id (1-based), resolving them on
// first use: innermost first, without this package's own frames, at most
// depth of them.
func (h *history) resolve(id uint32) []snapshot.Frame {
	if id == 0 || int(id) > len(h.stacks) {
		return nil
	}
	for len(h.frames) < len(h.stacks) {
		h.frames = append(h.frames, nil)
	}
	if fs := h.frames[id-1]; fs != nil {
		return fs
	}
	fs := []snapshot.Frame{}
	frames := runtime.CallersFrames(h.stacks[id-1])
	for len(fs) < h.depth {
		f, more := frames.Next()
		if !(len(fs) == 0 && isAllocatorFrame(f.Function)) {
			fs = append(fs, snapshot.Frame{Filename: f.File, Line: f.Line, Name: f.Function})
		}
		if !more {
			break
		}
	}
	h.frames[id-1] = fs
	return fs
}

const allocatorPkg = "github.com/allocd/allocd/allocator."

// isAllocatorFrame reports whether fn is a function of this package.
func isAllocatorFrame(fn string) bool { return strings.HasPrefix(fn, allocatorPkg) }

// WithHistory turns on history recording at New: the last limit allocator
// events are kept, as RecordHistory(HistoryOptions{MaxEntries: limit})
// does; a limit above MaxHistoryEntries makes New fail.
func WithHistory(limit int) Option {
	return func(o *options) { o.history = HistoryOptions{MaxEntries: max(limit, 0)} }
}

func (o HistoryOptions) validate() error {
	if o.MaxEntries < 0 || o.MaxEntries > MaxHistoryEntries {
		return fmt.Errorf("allocator: history of %d entries: %w (want 0 to %d)", o.MaxEntries, ErrHistory, MaxHistoryEntries)
	}
	if o.StackDepth < 0 || o.StackDepth > MaxStackDepth {
		return fmt.Errorf("allocator: history stack depth %d: %w (want 0 to %d)", o.StackDepth, ErrHistory, MaxStackDepth)
	}
	return nil
}

// RecordHistory switches history recording on (opt.MaxEntries > 0) or off
// (0) at run time, as torch.cuda.memory._record_memory_history does. Each
// call starts an empty history: what was recorded before is dropped.
// Options out of range are refused with an error wrapping ErrHistory and
// change nothing. Off, recording costs Malloc and Free one nil check.
func (a *Allocator) RecordHistory(opt HistoryOptions) error {
	if err := opt.validate(); err != nil {
		return err
	}
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return fmt.Errorf("allocator: record history: %w", ErrClosed)
	}
	a.history = nil
	if opt.MaxEntries > 0 {
		a.history = newHistory(opt)
	}
	return nil
}

// record adds an event of call c (nil: of no Malloc or Free) to the
// history when recording is on.
func (a *Allocator) record(c *call, action uint8, addr, size uint64, stream cudart.Stream) {
	h := a.history
	if h == nil {
		return
	}
	var stack uint32
	if c != nil {
		stack = c.stack
	}
	h.add(historyEntry{action: action, addr: addr, size: size, stream: blocks.DeviceStream(uint64(stream)), timeUS: time.Now().UnixMicro(), stack: stack})
	if h.live != nil {
		switch action {
		case actionAlloc:
			if stack != 0 {
				h.live[addr] = stack
			}
		case actionFreeRequested:
			delete(h.live, addr)
		}
	}
}

// traceEntries returns the history as trace entries, oldest first.
func (h *history) traceEntries() []snapshot.Entry {
	out := make([]snapshot.Entry, 0, len(h.ring))
	h.inOrder(func(e *historyEntry) {
		out = append(out, snapshot.Entry{Action: actionNames[e.action], Addr: e.addr, Size: e.size,
			Stream: e.stream, TimeUS: e.timeUS, Frames: h.resolve(e.stack)})
	})
	return out
}
