package trace

import (
	"encoding/binary"
	"fmt"
	"io"
	"math"

	"github.com/allocd/allocd/internal/bytecount"
	"github.com/allocd/allocd/internal/pickle"
	"github.com/allocd/allocd/snapshot"
)

// decoder is the pickle stack machine. See the package documentation.
type decoder struct {
	in    io.Reader // the (decompressed) pickle
	buf   []byte    // window of the input: buf[pos:end] is not consumed yet
	pos   int
	end   int
	start int64 // input offset of buf[0]
	eof   bool
	rerr  error // the reader's error, once it has returned one

	op    byte  // opcode being executed
	opOff int64 // its input offset
	opt   ReadOptions
	lim   limits
	used  int64 // estimated bytes kept, held to lim.maxMemory
	devs  int   // device trace lists opened, held to MaxDevices

	arena []byte // bytes of every string and bytes value (kStr, kBytes)

	stack []val
	marks []int32 // stack lengths at each MARK
	base  int     // len(stack) at the innermost MARK (0 without one)

	memo      [][]val        // chunks of memoChunk values
	memoBig   map[uint64]val // memo keys too far past the end of memo
	memoCount int            // distinct memo keys, the next MEMOIZE key

	ctx   []openCont   // containers that may still receive items
	conts []*container // containers with a typed or generic payload, one
	// allocation each, so that no growth copies them
	anys []any // boxed values (kAny)

	frameLists [][]snapshot.Frame // kFrames values
	frameDicts []snapshot.Frame   // kFrame values

	pool     []rawEntry        // entry dicts not yet taken by their trace
	badNames map[uint64]string // unknown actions of pooled entries, by kEntry id
	poolGen  uint32
	poolLive int

	intern map[string]string
}

// The input window starts small (tests and small snapshots stay cheap) and
// doubles at each refill up to maxWindow. Holding a large snapshot whole
// (tens of MB) would cost more to fault in than decoding it.
const (
	minWindow = 4 << 10
	maxWindow = 1 << 20
)

func newDecoder(in io.Reader, opt ReadOptions, lim limits) *decoder {
	return &decoder{
		in:     in,
		buf:    make([]byte, minWindow),
		opt:    opt,
		lim:    lim,
		stack:  make([]val, 0, 256),
		marks:  make([]int32, 0, 64),
		ctx:    make([]openCont, 0, 64),
		pool:   make([]rawEntry, 0, 64),
		intern: make(map[string]string),
	}
}

// fill makes at least n unread bytes available in buf[pos:end], moving the
// unread bytes to the front and growing buf when n exceeds it. It returns a
// truncation error (or the reader's error) when the input ends first.
func (d *decoder) fill(n int) error {
	if len(d.buf) < maxWindow && d.end == len(d.buf) {
		d.buf = append(d.buf[:d.end], make([]byte, len(d.buf))...)
	}
	if d.pos > 0 {
		copy(d.buf, d.buf[d.pos:d.end])
		d.start += int64(d.pos)
		d.end -= d.pos
		d.pos = 0
	}
	for zero := 0; d.end < n; {
		if d.eof {
			return d.truncated()
		}
		if d.end == len(d.buf) {
			// Grow by doubling as bytes arrive, so a forged length
			// cannot allocate more than twice the real input.
			d.buf = append(d.buf, make([]byte, len(d.buf))...)
		}
		m, err := d.in.Read(d.buf[d.end:])
		d.end += m
		if m == 0 && err == nil {
			if zero++; zero == 100 {
				err = io.ErrNoProgress
			}
		}
		if err == io.EOF {
			d.eof = true
		} else if err != nil {
			d.eof, d.rerr = true, err
		}
	}
	return nil
}

// errAt returns a *DecodeError at the current opcode.
func (d *decoder) errAt(kind error, format string, args ...any) error {
	return &DecodeError{Err: kind, Offset: d.opOff, Msg: fmt.Sprintf(format, args...)}
}

func (d *decoder) truncated() error {
	if d.rerr != nil {
		return d.rerr
	}
	return &DecodeError{Err: ErrTruncated, Offset: d.start + int64(d.end),
		Msg: fmt.Sprintf("input ends inside %s at offset %d", pickle.OpName(d.op), d.opOff)}
}

// need consumes and returns the next n argument bytes of the current
// opcode; they are valid until the next need or fill.
func (d *decoder) need(n int) ([]byte, error) {
	if n < 0 {
		return nil, d.errAt(ErrMalformed, "negative length %d", n)
	}
	if d.end-d.pos < n {
		if err := d.fill(n); err != nil {
			return nil, err
		}
	}
	b := d.buf[d.pos : d.pos+n]
	d.pos += n
	return b, nil
}

// run executes opcodes up to STOP and returns the pickled value.
func (d *decoder) run() (val, error) {
	for {
		// Most opcodes take at most 9 argument bytes: one check serves
		// the common case, need() the rest.
		if d.end-d.pos < 10 {
			if err := d.fill(10); err != nil && d.end == d.pos {
				if _, ok := err.(*DecodeError); ok {
					return val{}, &DecodeError{Err: ErrTruncated, Offset: d.start + int64(d.end),
						Msg: "input ends before the STOP opcode"}
				}
				return val{}, err
			}
		}
		buf := d.buf[d.pos:d.end]
		d.op, d.opOff = buf[0], d.start+int64(d.pos)
		d.pos++
		var err error
		switch d.op {
		case pickle.LongBinGet:
			if len(buf) < 5 {
				return val{}, d.truncated()
			}
			err = d.memoGet(uint64(binary.LittleEndian.Uint32(buf[1:])))
			d.pos += 4
		case pickle.BinGet:
			if len(buf) < 2 {
				return val{}, d.truncated()
			}
			err = d.memoGet(uint64(buf[1]))
			d.pos++
		case pickle.Memoize:
			err = d.memoPut(uint64(d.memoCount))
		case pickle.BinInt1:
			if len(buf) < 2 {
				return val{}, d.truncated()
			}
			d.stack = append(d.stack, intVal(int64(buf[1])))
			d.pos++
		case pickle.BinInt2:
			if len(buf) < 3 {
				return val{}, d.truncated()
			}
			d.stack = append(d.stack, intVal(int64(binary.LittleEndian.Uint16(buf[1:]))))
			d.pos += 2
		case pickle.BinInt:
			if len(buf) < 5 {
				return val{}, d.truncated()
			}
			d.stack = append(d.stack, intVal(int64(int32(binary.LittleEndian.Uint32(buf[1:])))))
			d.pos += 4
		case pickle.Long1:
			err = d.long(1)
		case pickle.Long4:
			err = d.long(4)
		case pickle.ShortBinUnicode, pickle.ShortBinString:
			err = d.str(1, kStr)
		case pickle.BinUnicode, pickle.BinString:
			err = d.str(4, kStr)
		case pickle.BinUnicode8:
			err = d.str(8, kStr)
		case pickle.ShortBinBytes:
			err = d.str(1, kBytes)
		case pickle.BinBytes:
			err = d.str(4, kBytes)
		case pickle.BinBytes8:
			err = d.str(8, kBytes)
		case pickle.BinFloat:
			var b []byte
			if b, err = d.need(8); err == nil {
				d.stack = append(d.stack, val{kind: kFloat, n: binary.BigEndian.Uint64(b)})
			}
		case pickle.None:
			d.stack = append(d.stack, val{kind: kNone})
		case pickle.NewTrue:
			d.stack = append(d.stack, val{kind: kBool, n: 1})
		case pickle.NewFalse:
			d.stack = append(d.stack, val{kind: kBool})
		case pickle.Mark:
			d.marks = append(d.marks, int32(len(d.stack)))
			d.base = len(d.stack)
		case pickle.EmptyDict:
			err = d.open(true)
		case pickle.EmptyList:
			err = d.open(false)
		case pickle.EmptyTuple:
			if d.ignored() {
				d.stack = append(d.stack, val{kind: kSkip})
			} else {
				d.pushAny([]any{})
			}
		case pickle.SetItems:
			err = d.setItemsOp()
		case pickle.SetItem:
			err = d.setItemOp()
		case pickle.Appends:
			err = d.appendsOp()
		case pickle.Append:
			err = d.appendOp()
		case pickle.Tuple1, pickle.Tuple2, pickle.Tuple3:
			err = d.tupleN(int(d.op-pickle.Tuple1) + 1)
		case pickle.Tuple, pickle.List:
			err = d.listOp()
		case pickle.Dict:
			err = d.dictOp()
		case pickle.BinPut:
			var b []byte
			if b, err = d.need(1); err == nil {
				err = d.memoPut(uint64(b[0]))
			}
		case pickle.LongBinPut:
			var b []byte
			if b, err = d.need(4); err == nil {
				err = d.memoPut(uint64(binary.LittleEndian.Uint32(b)))
			}
		case pickle.Pop:
			err = d.popOp()
		case pickle.PopMark:
			var m int
			if m, err = d.popMark(); err == nil {
				d.truncate(m)
			}
		case pickle.Dup:
			if err = d.require(1); err == nil {
				d.stack = append(d.stack, d.stack[len(d.stack)-1])
			}
		case pickle.Frame:
			_, err = d.need(8)
		case pickle.Proto:
			var b []byte
			if b, err = d.need(1); err == nil && (b[0] < 2 || b[0] > 5) {
				err = d.errAt(ErrNotSnapshot, "pickle protocol %d (want 2 to 5)", b[0])
			}
		case pickle.Stop:
			if err = d.require(1); err != nil {
				return val{}, err
			}
			return d.stack[len(d.stack)-1], nil
		default:
			return val{}, d.errAt(ErrUnsupportedOpcode, "opcode 0x%02x (%s)", d.op, pickle.OpName(d.op))
		}
		if err != nil {
			return val{}, err
		}
		// Each opcode adds at most one stack value or MARK, and a bounded
		// amount of memory: checking after it keeps both within limits.
		if len(d.stack)+len(d.marks) > MaxStack || d.used > d.lim.maxMemory {
			return val{}, d.limitError()
		}
	}
}

// limitError reports the stack or memory limit that was exceeded.
func (d *decoder) limitError() error {
	if len(d.stack)+len(d.marks) > MaxStack {
		return d.errAt(ErrTooLarge, "more than MaxStack (%d) values and MARKs on the pickle stack", MaxStack)
	}
	return d.errAt(ErrTooLarge, "the snapshot needs more memory than ReadOptions.MaxMemory (%s)", bytecount.Exact(d.lim.maxMemory))
}

// skip consumes n bytes of input without keeping them: the window does not
// grow, whatever n.
func (d *decoder) skip(n int64) error {
	for n > 0 {
		if d.pos == d.end {
			if err := d.fill(1); err != nil {
				return err
			}
		}
		k := min(n, int64(d.end-d.pos))
		d.pos += int(k)
		n -= k
	}
	return nil
}

// require checks that n values lie above the innermost MARK.
func (d *decoder) require(n int) error {
	if len(d.stack)-d.base < n {
		return d.errAt(ErrMalformed, "%s needs %d stack values, has %d", pickle.OpName(d.op), n, len(d.stack)-d.base)
	}
	return nil
}

// popMark pops the innermost MARK and returns the stack length it recorded.
func (d *decoder) popMark() (int, error) {
	if len(d.marks) == 0 {
		return 0, d.errAt(ErrMalformed, "%s without MARK", pickle.OpName(d.op))
	}
	m := int(d.marks[len(d.marks)-1])
	d.marks = d.marks[:len(d.marks)-1]
	d.base = 0
	if len(d.marks) > 0 {
		d.base = int(d.marks[len(d.marks)-1])
	}
	return m, nil
}

// truncate shrinks the stack to n values and forgets the open containers
// that were popped with them.
func (d *decoder) truncate(n int) {
	d.stack = d.stack[:n]
	for len(d.ctx) > 0 && int(d.ctx[len(d.ctx)-1].pos) >= n {
		d.ctx = d.ctx[:len(d.ctx)-1]
	}
}

func (d *decoder) popOp() error {
	if len(d.stack) > d.base {
		d.truncate(len(d.stack) - 1)
		return nil
	}
	_, err := d.popMark() // POP on an empty frame discards the MARK
	return err
}

// valSize is the size of a val.
const valSize = 16

func (d *decoder) pushAny(x any) {
	d.used += 2 * valSize
	d.stack = append(d.stack, val{kind: kAny, n: uint64(len(d.anys))})
	d.anys = append(d.anys, x)
}

// long pushes a LONG1 or LONG4 integer; size is the width of its length.
func (d *decoder) long(size int) error {
	b, err := d.need(size)
	if err != nil {
		return err
	}
	n := int(b[0])
	if size == 4 {
		n = int(int32(binary.LittleEndian.Uint32(b)))
	}
	if n > maxLong {
		if n < 0 || !d.ignored() {
			return d.errAt(ErrTooLarge, "a %d-byte integer (Read keeps at most %d bytes)", n, maxLong)
		}
		if err := d.skip(int64(n)); err != nil {
			return err
		}
		d.stack = append(d.stack, val{kind: kSkipped})
		return nil
	}
	if b, err = d.need(n); err != nil {
		return err
	}
	if v, ok := decodeLong(b); ok {
		d.stack = append(d.stack, v)
	} else {
		d.pushAny(bigLong(b))
	}
	return nil
}

// str pushes a string or bytes value whose length is a size-byte integer.
func (d *decoder) str(size int, kind vkind) error {
	b, err := d.need(size)
	if err != nil {
		return err
	}
	var u uint64
	switch size {
	case 1:
		u = uint64(b[0])
	case 4:
		u = uint64(binary.LittleEndian.Uint32(b))
		if d.op == pickle.BinString && int32(u) < 0 { // signed, as Python reads it
			return d.errAt(ErrMalformed, "negative length %d", int32(u))
		}
	default:
		u = binary.LittleEndian.Uint64(b)
	}
	if u > skipMin {
		// A long string is streamed past when its value is not kept.
		if d.ignored() {
			if u > math.MaxInt64 {
				return d.errAt(ErrMalformed, "%d-byte string", u)
			}
			if err := d.skip(int64(u)); err != nil {
				return err
			}
			d.stack = append(d.stack, val{kind: kSkipped})
			return nil
		}
		if u > MaxString {
			return d.errAt(ErrTooLarge, "a %d-byte string is longer than MaxString (%s)", u, bytecount.Exact(MaxString))
		}
	}
	n := int(u)
	if b, err = d.need(n); err != nil {
		return err
	}
	if ref, ok := packRef(len(d.arena), n); ok {
		if len(d.arena)+n > cap(d.arena) {
			c := max(2*cap(d.arena), len(d.arena)+n, 4096)
			d.used += int64(c - cap(d.arena))
			d.arena = append(make([]byte, 0, c), d.arena...)
		}
		d.arena = append(d.arena, b...)
		d.stack = append(d.stack, val{kind: kind, n: ref})
	} else if kind == kStr {
		d.used += int64(n)
		d.pushAny(string(b))
	} else {
		d.used += int64(n)
		d.pushAny(append([]byte(nil), b...))
	}
	return nil
}

// Strings longer than skipMin bytes are not kept where their value is not
// used; maxLong bounds the bytes of a LONG1/LONG4 integer that is kept.
// (Shorter strings are kept: a key or a field may be memoized where it is
// not used, and referenced where it is.)
const (
	skipMin = 256
	maxLong = 1 << 10
)

// The memo is kept in chunks of memoChunk values: a snapshot memoizes
// millions of values, and growing one slice would copy them all several
// times. Only the first chunk starts small and doubles, so that a small
// pickle allocates little.
const (
	memoChunkBits = 14
	memoChunk     = 1 << memoChunkBits
	// memoLimit bounds how far past its end a BINPUT may grow the memo;
	// farther keys go to a map, so a hostile key cannot allocate gigabytes.
	memoLimit = 1 << 16
)

// memoSize is the number of memo slots allocated.
func (d *decoder) memoSize() uint64 {
	if len(d.memo) == 0 {
		return 0
	}
	return uint64(len(d.memo)-1)<<memoChunkBits + uint64(len(d.memo[len(d.memo)-1]))
}

// memoSlot returns the slot of key in the chunks, or nil.
func (d *decoder) memoSlot(key uint64) *val {
	c, i := key>>memoChunkBits, key&(memoChunk-1)
	if c < uint64(len(d.memo)) && i < uint64(len(d.memo[c])) {
		return &d.memo[c][i]
	}
	return nil
}

// growMemo allocates slots up to key.
func (d *decoder) growMemo(key uint64) {
	for d.memoSize() <= key {
		switch {
		case len(d.memo) == 0:
			d.memo = append(d.memo, make([]val, 64))
			d.used += 64 * valSize
		case len(d.memo) == 1 && len(d.memo[0]) < memoChunk:
			d.used += int64(len(d.memo[0])) * valSize
			d.memo[0] = append(d.memo[0], make([]val, len(d.memo[0]))...)
		default:
			d.memo = append(d.memo, make([]val, memoChunk))
			d.used += memoChunk * valSize
		}
	}
}

func (d *decoder) memoPut(key uint64) error {
	if len(d.stack) <= d.base {
		return d.errAt(ErrMalformed, "%s on an empty stack", pickle.OpName(d.op))
	}
	v := d.stack[len(d.stack)-1]
	slot := d.memoSlot(key)
	if slot == nil && key < d.memoSize()+memoLimit {
		d.growMemo(key)
		slot = d.memoSlot(key)
	}
	if slot != nil {
		if slot.kind == kInvalid {
			d.memoCount++
		}
		*slot = v
		return nil
	}
	if d.memoBig == nil {
		d.memoBig = make(map[uint64]val)
	}
	if _, ok := d.memoBig[key]; !ok {
		d.memoCount++
		d.used += 4 * valSize // a map entry
	}
	d.memoBig[key] = v
	return nil
}

func (d *decoder) memoGet(key uint64) error {
	var v val
	if slot := d.memoSlot(key); slot != nil {
		v = *slot
	} else if d.memoBig != nil {
		v = d.memoBig[key]
	}
	if v.kind == kInvalid {
		return d.errAt(ErrMalformed, "memo key %d is not set", key)
	}
	d.stack = append(d.stack, v)
	return nil
}
