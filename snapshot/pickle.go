package snapshot

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"reflect"
	"slices"

	"github.com/allocd/allocd/internal/pickle"
)

// WritePickle writes s as a PyTorch memory snapshot pickle: the dict that
// torch.cuda.memory._snapshot() returns, with PyTorch's key names and order
// ("segments", "device_traces", "allocator_settings",
// "external_annotations"), every key torch.cuda._memory_viz and the
// memory_viz web page read, "frames" on every segment, block and entry (an
// empty list where s has none), and
// "device_free" instead of "addr" for oom entries. Streams are written as
// PyTorch writes them, as signed 64-bit integers.
//
// The pickle is protocol 4 without framing and uses only opcodes that both
// Python's pickle and the web page's unpickler (MemoryViz.js) know. Repeated
// strings and shared Frames slices are memoized. allocator_settings may hold
// nil, bool, string, any integer type, *big.Int, float32/64, []byte, []any
// and map[string]any (keys are written sorted); another type is an error, as
// is a nil s. WritePickle returns the first error of w.
func WritePickle(w io.Writer, s *Snapshot) error {
	if s == nil {
		return errors.New("snapshot: WritePickle of a nil snapshot")
	}
	p := &pickler{w: bufio.NewWriterSize(w, 64<<10), strs: map[string]uint32{}, frames: map[*Frame]memoList{}}
	p.op(pickle.Proto, 4)
	p.op(pickle.EmptyDict, pickle.Mark)
	p.str("segments")
	p.list(len(s.Segments), func(i int) { p.segment(&s.Segments[i]) })
	p.str("device_traces")
	p.list(len(s.DeviceTraces), func(i int) {
		tr := s.DeviceTraces[i]
		p.list(len(tr), func(j int) { p.entry(&tr[j]) })
	})
	p.str("allocator_settings")
	if s.AllocatorSettings == nil {
		p.op(pickle.EmptyDict)
	} else {
		p.value(s.AllocatorSettings, "allocator_settings")
	}
	p.str("external_annotations")
	p.op(pickle.EmptyList)
	p.op(pickle.SetItems, pickle.Stop)
	if p.err != nil {
		return p.err
	}
	return p.w.Flush()
}

// pickler writes opcodes; the first error sticks.
type pickler struct {
	w      *bufio.Writer
	err    error
	memo   uint32              // next MEMOIZE index
	strs   map[string]uint32   // memoized strings
	frames map[*Frame]memoList // memoized frames lists, by first element
	empty  uint32              // 1 + memo index of the shared empty list
	nums   [16]byte            // scratch for an opcode and its argument
}

// memoList is a memoized list and its length.
type memoList struct {
	idx uint32
	n   int
}

// op writes opcodes and one-byte arguments.
func (p *pickler) op(b ...byte) {
	for _, c := range b {
		p.byte(c)
	}
}

func (p *pickler) byte(c byte) {
	if p.err == nil {
		p.err = p.w.WriteByte(c)
	}
}

func (p *pickler) write(b []byte) {
	if p.err == nil {
		_, p.err = p.w.Write(b)
	}
}

// opArg writes an opcode and a little-endian argument of n bytes.
func (p *pickler) opArg(op byte, v uint64, n int) {
	p.nums[0] = op
	binary.LittleEndian.PutUint64(p.nums[1:], v)
	p.write(p.nums[:1+n])
}

func (p *pickler) fail(err error) {
	if p.err == nil {
		p.err = err
	}
}

// get writes a reference to memo entry idx.
func (p *pickler) get(idx uint32) {
	if idx < 256 {
		p.opArg(pickle.BinGet, uint64(idx), 1)
		return
	}
	p.opArg(pickle.LongBinGet, uint64(idx), 4)
}

// str writes a string, memoized: keys, actions and file names repeat.
func (p *pickler) str(s string) {
	if idx, ok := p.strs[s]; ok {
		p.get(idx)
		return
	}
	if len(s) < 256 {
		p.opArg(pickle.ShortBinUnicode, uint64(len(s)), 1)
	} else {
		p.opArg(pickle.BinUnicode, uint64(len(s)), 4)
	}
	if p.err == nil {
		_, p.err = p.w.WriteString(s)
	}
	p.op(pickle.Memoize)
	p.strs[s] = p.memo
	p.memo++
}

// int writes an integer in its shortest encoding.
func (p *pickler) int(i int64) {
	switch {
	case i >= 0 && i < 1<<8:
		p.opArg(pickle.BinInt1, uint64(i), 1)
	case i >= 0 && i < 1<<16:
		p.opArg(pickle.BinInt2, uint64(i), 2)
	case i >= math.MinInt32 && i <= math.MaxInt32:
		p.opArg(pickle.BinInt, uint64(i), 4)
	default:
		// LONG1 with the fewest bytes, as Python's encode_long writes it.
		p.nums[0] = pickle.Long1
		b := binary.LittleEndian.AppendUint64(p.nums[:2], uint64(i))[2:]
		for len(b) > 1 && (b[len(b)-1] == 0 && b[len(b)-2] < 0x80 || b[len(b)-1] == 0xff && b[len(b)-2] >= 0x80) {
			b = b[:len(b)-1]
		}
		p.nums[1] = byte(len(b))
		p.write(p.nums[:2+len(b)])
	}
}

func (p *pickler) uint(u uint64) {
	if u <= math.MaxInt64 {
		p.int(int64(u))
		return
	}
	p.nums[0], p.nums[1], p.nums[10] = pickle.Long1, 9, 0
	binary.LittleEndian.PutUint64(p.nums[2:], u)
	p.write(p.nums[:11])
}

func (p *pickler) bigInt(x *big.Int) {
	if x.IsInt64() {
		p.int(x.Int64())
		return
	}
	// Two's complement, little-endian, with room for the sign bit.
	n := x.BitLen()/8 + 1
	m := new(big.Int).Set(x)
	if x.Sign() < 0 {
		m.Add(m, new(big.Int).Lsh(big.NewInt(1), uint(8*n)))
	}
	be := m.FillBytes(make([]byte, n))
	slices.Reverse(be)
	if n < 256 {
		p.opArg(pickle.Long1, uint64(n), 1)
	} else {
		p.opArg(pickle.Long4, uint64(n), 4)
	}
	p.write(be)
}

func (p *pickler) bool(b bool) {
	if b {
		p.op(pickle.NewTrue)
	} else {
		p.op(pickle.NewFalse)
	}
}

// list writes a list of n items.
func (p *pickler) list(n int, item func(int)) {
	p.op(pickle.EmptyList)
	p.listItems(n, item)
}

func (p *pickler) segment(s *Segment) {
	p.op(pickle.EmptyDict, pickle.Mark)
	p.str("device")
	p.int(int64(s.Device))
	p.str("address")
	p.uint(s.Address)
	p.str("total_size")
	p.uint(s.TotalSize)
	p.str("allocated_size")
	p.uint(s.AllocatedSize)
	p.str("active_size")
	p.uint(s.ActiveSize)
	p.str("requested_size")
	p.uint(s.RequestedSize)
	p.str("stream")
	p.int(int64(s.Stream))
	p.str("segment_type")
	p.str(s.SegmentType)
	p.str("segment_pool_id")
	p.uint(s.PoolID[0])
	p.uint(s.PoolID[1])
	p.op(pickle.Tuple2)
	p.str("is_expandable")
	p.bool(s.IsExpandable)
	p.str("frames")
	p.frameList(s.Frames)
	p.str("blocks")
	p.list(len(s.Blocks), func(i int) { p.block(&s.Blocks[i]) })
	p.op(pickle.SetItems)
}

func (p *pickler) block(b *Block) {
	p.op(pickle.EmptyDict, pickle.Mark)
	p.str("address")
	p.uint(b.Address)
	p.str("size")
	p.uint(b.Size)
	p.str("requested_size")
	p.uint(b.RequestedSize)
	p.str("state")
	p.str(string(b.State))
	p.str("frames")
	p.frameList(b.Frames)
	p.op(pickle.SetItems)
}

func (p *pickler) entry(e *Entry) {
	p.op(pickle.EmptyDict, pickle.Mark)
	p.str("action")
	p.str(string(e.Action))
	if e.Action == ActionOOM {
		p.str("device_free")
	} else {
		p.str("addr")
	}
	p.uint(e.Addr)
	p.str("size")
	p.uint(e.Size)
	p.str("stream")
	p.int(int64(e.Stream))
	p.str("time_us")
	p.int(e.TimeUS)
	p.str("frames")
	p.frameList(e.Frames)
	p.op(pickle.SetItems)
}

// emptyFrames writes the empty frames list, one memoized list shared by
// every segment, block and entry without frames, as PyTorch writes it.
func (p *pickler) emptyFrames() {
	if p.empty > 0 {
		p.get(p.empty - 1)
		return
	}
	p.op(pickle.EmptyList, pickle.Memoize)
	p.memo++
	p.empty = p.memo
}

// frameList writes a stack; entries that share a Frames slice (as trace.Read
// returns them) share one pickled list.
func (p *pickler) frameList(fs []Frame) {
	if len(fs) == 0 {
		p.emptyFrames()
		return
	}
	if m, ok := p.frames[&fs[0]]; ok && m.n == len(fs) {
		p.get(m.idx)
		return
	}
	// A pickler memoizes a list before it fills it.
	p.op(pickle.EmptyList, pickle.Memoize)
	p.frames[&fs[0]] = memoList{p.memo, len(fs)}
	p.memo++
	p.listItems(len(fs), func(i int) {
		f := &fs[i]
		p.op(pickle.EmptyDict, pickle.Mark)
		p.str("name")
		p.str(f.Name)
		p.str("filename")
		p.str(f.Filename)
		p.str("line")
		p.int(int64(f.Line))
		p.op(pickle.SetItems)
	})
}

// listItems writes the items of the list on top of the stack in batches, as
// Python's pickler does: MARK up to 1000 items APPENDS, and a last single
// item with APPEND.
func (p *pickler) listItems(n int, item func(int)) {
	for start := 0; start < n; start += pickle.BatchSize {
		k := min(pickle.BatchSize, n-start)
		if k == 1 {
			item(start)
			p.op(pickle.Append)
			continue
		}
		p.op(pickle.Mark)
		for i := start; i < start+k; i++ {
			item(i)
		}
		p.op(pickle.Appends)
	}
}

// value writes a generic allocator_settings value; path names it in errors.
func (p *pickler) value(v any, path string) {
	switch x := v.(type) {
	case nil:
		p.op(pickle.None)
	case bool:
		p.bool(x)
	case string:
		p.str(x)
	case int:
		p.int(int64(x))
	case int8:
		p.int(int64(x))
	case int16:
		p.int(int64(x))
	case int32:
		p.int(int64(x))
	case int64:
		p.int(x)
	case uint:
		p.uint(uint64(x))
	case uint8:
		p.uint(uint64(x))
	case uint16:
		p.uint(uint64(x))
	case uint32:
		p.uint(uint64(x))
	case uint64:
		p.uint(x)
	case *big.Int:
		p.bigInt(x)
	case float32:
		p.float(float64(x))
	case float64:
		p.float(x)
	case []byte:
		p.opArg(pickle.BinBytes, uint64(len(x)), 4)
		p.write(x)
	case []any:
		p.list(len(x), func(i int) { p.value(x[i], fmt.Sprintf("%s[%d]", path, i)) })
	case map[string]any:
		p.dict(x, path)
	default:
		p.fail(fmt.Errorf("snapshot: WritePickle: %s: cannot pickle a %s", path, reflect.TypeOf(v)))
	}
}

func (p *pickler) float(f float64) {
	p.nums[0] = pickle.BinFloat
	binary.BigEndian.PutUint64(p.nums[1:], math.Float64bits(f))
	p.write(p.nums[:9])
}

func (p *pickler) dict(m map[string]any, path string) {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	p.op(pickle.EmptyDict)
	for start := 0; start < len(keys); start += pickle.BatchSize {
		batch := keys[start:min(start+pickle.BatchSize, len(keys))]
		if len(batch) > 1 {
			p.op(pickle.Mark)
		}
		for _, k := range batch {
			p.str(k)
			p.value(m[k], fmt.Sprintf("%s[%q]", path, k))
		}
		if len(batch) > 1 {
			p.op(pickle.SetItems)
		} else {
			p.op(pickle.SetItem)
		}
	}
}
