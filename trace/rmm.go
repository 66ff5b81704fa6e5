package trace

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"slices"
	"strconv"
	"unsafe"

	"github.com/allocd/allocd/internal/bytecount"
	"github.com/allocd/allocd/snapshot"
)

// RAPIDS RMM's logging_resource_adaptor writes a CSV log,
//
//	Thread,Time,Action,Pointer,Size,Stream
//	2342727,15:47:02.841961,allocate,0x10012400000,1048576,0x0
//	2342727,15:47:02.841977,free,0x10012400000,1048576,0x0
//
// with Action one of "allocate", "free" and "allocate failure" (pointer 0x0).
// Time is the wall clock (spdlog's %H:%M:%S.%f); a time that runs backwards
// by more than 12 hours is taken to have crossed midnight. Pointer and Stream
// are printed as pointers (0x...), and are also accepted in decimal.
//
// decodeRMM turns the log into a one-device Snapshot without segments: an
// allocate becomes an alloc entry, a free a free_requested immediately
// followed by its free_completed (RMM has no deferred frees), and an
// allocate failure an oom entry (Addr 0: RMM does not log the free memory).

var rmmColumns = [...]string{"thread", "time", "action", "pointer", "size", "stream"}

const (
	rmmThread = iota
	rmmTime
	rmmAction
	rmmPointer
	rmmSize
	rmmStream
)

// isRMMLog reports whether data starts with an RMM log header: a CSV header
// naming at least the Action, Pointer and Size columns.
func isRMMLog(data []byte) bool {
	_, ok := rmmHeader(firstLine(data))
	return ok
}

func firstLine(data []byte) []byte {
	data = bytes.TrimPrefix(data, []byte("\xef\xbb\xbf"))
	if i := bytes.IndexByte(data, '\n'); i >= 0 {
		data = data[:i]
	}
	return data
}

// rmmHeader maps the header's column names to their positions (-1 when
// absent); ok requires Action, Pointer and Size.
func rmmHeader(line []byte) (cols [len(rmmColumns)]int, ok bool) {
	for i := range cols {
		cols[i] = -1
	}
	for i, f := range bytes.Split(bytes.TrimSpace(line), []byte(",")) {
		for c, name := range rmmColumns {
			if bytes.EqualFold(bytes.TrimSpace(f), []byte(name)) && cols[c] < 0 {
				cols[c] = i
			}
		}
	}
	return cols, cols[rmmAction] >= 0 && cols[rmmPointer] >= 0 && cols[rmmSize] >= 0
}

// rmmReader holds the state of one log's conversion.
type rmmReader struct {
	cols    [len(rmmColumns)]int
	ncols   int      // fields a line needs: the last known column's index + 1
	fields  [][]byte // one line's fields, ncols long, reused line to line
	line    int
	off     int64
	entries []snapshot.Entry
	lastUS  int64 // last clock time seen, -1 before the first
	dayUS   int64 // days crossed, in microseconds
	lim     limits
}

// rmmEntryCost is the memory estimate of one entry: the Entry, and as much
// again for the slack of slice growth.
const rmmEntryCost = 2 * int64(unsafe.Sizeof(snapshot.Entry{}))

// decodeRMM reads an RMM log line by line: memory grows with the entries
// it holds, never with blank lines or the input's size.
func decodeRMM(in io.Reader, lim limits) (*snapshot.Snapshot, error) {
	br := bufio.NewReaderSize(in, MaxRMMLine)
	r := &rmmReader{lastUS: -1, lim: lim}
	for first := true; ; first = false {
		if !first {
			r.skipBlank(br)
		}
		line, err := br.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			r.line++
			return nil, r.errorf(ErrTooLarge, "line longer than MaxRMMLine (%s)", bytecount.Exact(MaxRMMLine))
		}
		if err != nil && err != io.EOF {
			return nil, err
		}
		if len(line) > 0 {
			r.line++
			body := bytes.TrimSuffix(line, []byte("\n"))
			if first {
				body = bytes.TrimPrefix(body, []byte("\xef\xbb\xbf"))
				r.cols, _ = rmmHeader(body)
				for _, c := range r.cols {
					r.ncols = max(r.ncols, c+1)
				}
				r.fields = make([][]byte, r.ncols)
			} else if perr := r.parseLine(bytes.TrimSpace(body)); perr != nil {
				return nil, perr
			}
			r.off += int64(len(line))
		}
		if err == io.EOF {
			break
		}
	}
	if r.entries == nil {
		r.entries = []snapshot.Entry{}
	}
	return &snapshot.Snapshot{DeviceTraces: [][]snapshot.Entry{slices.Clip(r.entries)}}, nil
}

// skipBlank consumes a run of line ends (blank lines) without a call per
// line, so that a log of a billion blank lines costs its reading only.
func (r *rmmReader) skipBlank(br *bufio.Reader) {
	for {
		if br.Buffered() == 0 {
			if _, err := br.Peek(1); err != nil {
				return
			}
		}
		b, _ := br.Peek(br.Buffered())
		i := 0
		for i < len(b) && (b[i] == '\n' || b[i] == '\r') {
			if b[i] == '\n' {
				r.line++
			}
			i++
		}
		_, _ = br.Discard(i)
		r.off += int64(i)
		if i < len(b) {
			return
		}
	}
}

func (r *rmmReader) errorf(kind error, format string, args ...any) error {
	msg := format
	if len(args) > 0 {
		msg = fmt.Sprintf(format, args...)
	}
	return &DecodeError{Err: kind, Offset: r.off, Line: r.line, Msg: msg}
}

// parseLine converts one log line into entries.
func (r *rmmReader) parseLine(line []byte) error {
	if len(line) == 0 {
		return nil
	}
	fields := r.fields
	n := splitFields(line, fields)
	if n < r.ncols {
		return r.errorf(ErrMalformed, "%d fields, want %d", n, r.ncols)
	}
	field := func(c int) []byte {
		if r.cols[c] < 0 {
			return nil
		}
		return bytes.TrimSpace(fields[r.cols[c]])
	}
	var e snapshot.Entry
	var err error
	if e.Addr, err = r.number(field(rmmPointer), "pointer"); err != nil {
		return err
	}
	if e.Size, err = r.number(field(rmmSize), "size"); err != nil {
		return err
	}
	if s := field(rmmStream); s != nil {
		if e.Stream, err = r.number(s, "stream"); err != nil {
			return err
		}
	}
	if t := field(rmmTime); t != nil {
		if e.TimeUS, err = r.time(t); err != nil {
			return err
		}
	}
	return r.add(e, field(rmmAction))
}

func (r *rmmReader) add(e snapshot.Entry, action []byte) error {
	if int64(len(r.entries)+2)*rmmEntryCost > r.lim.maxMemory {
		return r.errorf(ErrTooLarge, "the log needs more memory than ReadOptions.MaxMemory (%s)", bytecount.Exact(r.lim.maxMemory))
	}
	switch string(action) {
	case "allocate":
		e.Action = snapshot.ActionAlloc
		r.entries = append(r.entries, e)
	case "free", "deallocate":
		e.Action = snapshot.ActionFreeRequested
		r.entries = append(r.entries, e)
		e.Action = snapshot.ActionFreeCompleted
		r.entries = append(r.entries, e)
	case "allocate failure":
		e.Action, e.Addr = snapshot.ActionOOM, 0
		r.entries = append(r.entries, e)
	default:
		return r.errorf(ErrUnknownAction, "action %q", string(action))
	}
	return nil
}

// splitFields splits a CSV line without quoting into at most len(f) fields
// and returns how many there are (which may exceed len(f)).
func splitFields(line []byte, f [][]byte) int {
	n := 0
	for {
		i := bytes.IndexByte(line, ',')
		if n < len(f) {
			if i < 0 {
				f[n] = line
			} else {
				f[n] = line[:i]
			}
		}
		n++
		if i < 0 {
			return n
		}
		line = line[i+1:]
	}
}

// number parses a decimal or 0x-prefixed hexadecimal unsigned integer.
func (r *rmmReader) number(b []byte, what string) (uint64, error) {
	s := string(b)
	base := 10
	if len(s) > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') {
		s, base = s[2:], 16
	}
	u, err := strconv.ParseUint(s, base, 64)
	if err != nil {
		return 0, r.errorf(ErrMalformed, "%s %q is not a number", what, string(b))
	}
	return u, nil
}

// time parses HH:MM:SS[.:]frac (wall clock, unwrapped across midnight) or
// seconds[.frac] since the epoch, into microseconds.
func (r *rmmReader) time(b []byte) (int64, error) {
	parts := bytes.Split(b, []byte(":"))
	if len(parts) == 1 {
		us, ok := secondsUS(parts[0])
		if !ok {
			return 0, r.errorf(ErrMalformed, "time %q", string(b))
		}
		return us, nil
	}
	if len(parts) == 4 { // HH:MM:SS:micros, as RMM's own log parser reads it
		parts = [][]byte{parts[0], parts[1], append(append(append([]byte(nil), parts[2]...), '.'), parts[3]...)}
	}
	if len(parts) != 3 {
		return 0, r.errorf(ErrMalformed, "time %q", string(b))
	}
	h, err1 := strconv.ParseUint(string(parts[0]), 10, 8)
	m, err2 := strconv.ParseUint(string(parts[1]), 10, 8)
	sec, ok := secondsUS(parts[2])
	if err1 != nil || err2 != nil || !ok || h > 23 || m > 59 || sec >= 61e6 {
		return 0, r.errorf(ErrMalformed, "time %q", string(b))
	}
	us := int64(h)*3600e6 + int64(m)*60e6 + sec
	if r.lastUS >= 0 && us+r.dayUS < r.lastUS-12*3600e6 {
		r.dayUS += 24 * 3600e6
	}
	r.lastUS = us + r.dayUS
	return r.lastUS, nil
}

// secondsUS parses seconds with an optional fraction into microseconds.
func secondsUS(b []byte) (int64, bool) {
	whole, frac, _ := bytes.Cut(b, []byte("."))
	s, err := strconv.ParseUint(string(whole), 10, 40)
	if err != nil {
		return 0, false
	}
	us := int64(s) * 1e6
	scale := int64(1e5)
	for _, c := range frac {
		if c < '0' || c > '9' {
			return 0, false
		}
		us += int64(c-'0') * scale
		scale /= 10
	}
	return us, true
}
