package trace

import (
	"errors"
	"fmt"

	"github.com/allocd/allocd/internal/bytecount"
)

// ReadOptions select what Read decodes beyond the essentials, and the limits
// it holds the input to. A zero limit means its default.
type ReadOptions struct {
	// Frames decodes the recorded stacks into Entry.Frames, Block.Frames
	// and Segment.Frames. Without it the stacks are skipped, which is
	// faster and smaller.
	Frames bool
	// MaxBytes bounds the input after decompression (the input itself when
	// it is not compressed); 0 means DefaultMaxBytes. Past it Read fails
	// with ErrTooLarge. It bounds the time a read takes, and what a gzip
	// bomb of content that costs no memory (skipped values, blank lines)
	// can cost.
	MaxBytes int64
	// MaxMemory bounds the memory the decoder keeps, as it estimates it:
	// trace entries (about 112 bytes each while decoding), segments,
	// blocks, frames, strings, memo slots and generic values; 0 means
	// DefaultMaxMemory. Past it Read fails with ErrTooLarge. The estimate
	// counts what the result and the decoder's tables hold, not the
	// garbage left behind by slice growth, so the Go heap may peak at up
	// to about twice it.
	MaxMemory int64
}

// Defaults of the ReadOptions limits and the fixed limits of Read. Every
// input is held to them, so that reading a trace costs memory in proportion
// to what it really contains and never more than about
// DefaultMaxMemory (twice that in the Go heap, see ReadOptions.MaxMemory)
// plus a pickle stack of at most MaxStack 16-byte values.
const (
	// DefaultMaxBytes is ReadOptions.MaxBytes by default: 4 GiB. The
	// largest recorded trace in CI (913,006 entries) decompresses to
	// 65.6 MB.
	DefaultMaxBytes = 4 << 30
	// DefaultMaxMemory is ReadOptions.MaxMemory by default: 2 GiB, room
	// for about 15 million trace entries. The 913,006-entry trace uses
	// about 129 MiB of it.
	DefaultMaxMemory = 2 << 30
	// MaxStack bounds the values and MARKs on the pickle stack, and so the
	// nesting of lists, dicts and tuples. Python's pickler never holds
	// more than 2,001 values per level of nesting (it writes lists and
	// dicts in batches of 1000 items).
	MaxStack = 1 << 20
	// MaxDevices bounds the device traces of a snapshot; PyTorch records
	// one per CUDA device of the process.
	MaxDevices = 1 << 10
	// MaxString bounds one string or bytes value that Read keeps (a field
	// of an entry, segment, block or frame, a key, or a value of
	// allocator_settings). Longer strings in places whose value is not
	// kept (unknown keys, skipped stacks) are streamed past, costing no
	// memory, whatever their length.
	MaxString = 1 << 20
	// MaxRMMLine bounds one line of an RMM log.
	MaxRMMLine = 64 << 10
)

// Errors returned by Read and ReadFile, always wrapped; test
// with errors.Is.
var (
	// ErrNotSnapshot: the input is not a pickle, gzip or RMM log, or the
	// pickle's top level is not a dict with "device_traces" or "segments".
	ErrNotSnapshot = errors.New("not a memory snapshot")
	// ErrTruncated: the input ends before the pickle's STOP opcode.
	ErrTruncated = errors.New("truncated input")
	// ErrUnsupportedOpcode: the pickle uses an opcode a snapshot never
	// contains (objects, globals, sets, protocol 0/1 text opcodes).
	ErrUnsupportedOpcode = errors.New("unsupported pickle opcode")
	// ErrMalformed: the input is of a known format but broken: a bad gzip
	// stream or trailing data after it, a missing memo key, a stack
	// underflow, a value of the wrong type or range, a snapshot structure
	// PyTorch never writes, a bad RMM log line.
	ErrMalformed = errors.New("malformed input")
	// ErrUnknownAction: a trace entry's action is not one PyTorch records.
	ErrUnknownAction = errors.New("unknown trace action")
	// ErrTooLarge: the input exceeds a limit of Read (MaxBytes,
	// MaxMemory, MaxStack, MaxDevices, MaxString or MaxRMMLine); the
	// message names the limit.
	ErrTooLarge = errors.New("input exceeds a limit")
)

// DecodeError is the error Read returns for bad input. It wraps one of the
// Err* sentinels.
type DecodeError struct {
	// Err is the sentinel: ErrTruncated, ErrUnsupportedOpcode, ...
	Err error
	// Offset is the byte offset in the (decompressed) input where the
	// problem was found, or -1 when the problem has no single position.
	Offset int64
	// Line is the 1-based line of an RMM log, 0 for a pickle.
	Line int
	// Msg says what was wrong.
	Msg string
}

// Error formats the error with its position.
func (e *DecodeError) Error() string {
	switch {
	case e.Line > 0:
		return fmt.Sprintf("trace: %v: line %d: %s", e.Err, e.Line, e.Msg)
	case e.Offset >= 0:
		return fmt.Sprintf("trace: %v: offset %d: %s", e.Err, e.Offset, e.Msg)
	}
	return fmt.Sprintf("trace: %v: %s", e.Err, e.Msg)
}

// Unwrap returns the sentinel.
func (e *DecodeError) Unwrap() error { return e.Err }

// limits are the effective limits of one read.
type limits struct {
	maxBytes  int64
	maxMemory int64
}

func (o ReadOptions) limits() limits {
	l := limits{maxBytes: o.MaxBytes, maxMemory: o.MaxMemory}
	if l.maxBytes <= 0 {
		l.maxBytes = DefaultMaxBytes
	}
	if l.maxMemory <= 0 {
		l.maxMemory = DefaultMaxMemory
	}
	return l
}

// sizeLimit reads at most max bytes of r and then fails with errTooLarge.
type sizeLimit struct {
	r   interface{ Read([]byte) (int, error) }
	n   int64 // bytes left
	max int64
}

// errTooLarge is sizeLimit's error, turned into a *DecodeError by Read.
type errTooLarge struct{ max int64 }

func (e errTooLarge) Error() string {
	return fmt.Sprintf("the input is larger than ReadOptions.MaxBytes (%s)", bytecount.Exact(e.max))
}

func (l *sizeLimit) Read(p []byte) (int, error) {
	if l.n <= 0 {
		// Read one byte more than allowed to tell a stream of exactly
		// max bytes from a longer one.
		var one [1]byte
		n, err := l.r.Read(one[:])
		if n > 0 {
			return 0, errTooLarge{l.max}
		}
		return 0, err
	}
	if int64(len(p)) > l.n {
		p = p[:l.n]
	}
	n, err := l.r.Read(p)
	l.n -= int64(n)
	return n, err
}
