package trace

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/allocd/allocd/internal/pickle"
	"github.com/allocd/allocd/snapshot"
)

// Memory estimates of the typed items (see decoder.used).
const (
	segmentSize = int64(unsafe.Sizeof(snapshot.Segment{}))
	blockSize   = int64(unsafe.Sizeof(snapshot.Block{}))
)

// setItemsOp executes SETITEMS: MARK k v k v ... into the dict below the MARK.
func (d *decoder) setItemsOp() error {
	m, err := d.popMark()
	if err != nil {
		return err
	}
	if m-1 < d.base {
		return d.errAt(ErrMalformed, "SETITEMS without a dict")
	}
	items := d.stack[m:]
	if len(items)%2 != 0 {
		return d.errAt(ErrMalformed, "SETITEMS with an odd number of values")
	}
	if err := d.setItems(d.stack[m-1], items); err != nil {
		return err
	}
	d.truncate(m)
	d.markDone(m-1, len(items)/2, false)
	return nil
}

// setItemOp executes SETITEM: dict key value.
func (d *decoder) setItemOp() error {
	if err := d.require(3); err != nil {
		return err
	}
	n := len(d.stack)
	if err := d.setItems(d.stack[n-3], d.stack[n-2:]); err != nil {
		return err
	}
	d.truncate(n - 2)
	d.markDone(n-3, 1, true)
	return nil
}

// appendsOp executes APPENDS: MARK x y ... into the list below the MARK.
func (d *decoder) appendsOp() error {
	m, err := d.popMark()
	if err != nil {
		return err
	}
	if m-1 < d.base {
		return d.errAt(ErrMalformed, "APPENDS without a list")
	}
	n := len(d.stack) - m
	if err := d.appendItems(d.stack[m-1], d.stack[m:]); err != nil {
		return err
	}
	d.truncate(m)
	d.markDone(m-1, n, false)
	return nil
}

// appendOp executes APPEND: list value.
func (d *decoder) appendOp() error {
	if err := d.require(2); err != nil {
		return err
	}
	n := len(d.stack)
	if err := d.appendItems(d.stack[n-2], d.stack[n-1:]); err != nil {
		return err
	}
	d.truncate(n - 1)
	d.markDone(n-2, 1, true)
	return nil
}

// setItems stores key/value pairs into the dict value target.
func (d *decoder) setItems(target val, kv []val) error {
	switch target.kind {
	case kSkip:
		return nil
	case kEntry:
		e, err := d.poolEntry(target)
		if err != nil {
			return err
		}
		for i := 0; i < len(kv); i += 2 {
			if err := d.setEntry(e, target.n, kv[i], kv[i+1]); err != nil {
				return err
			}
		}
		return nil
	case kFrame:
		for i := 0; i < len(kv); i += 2 {
			if key, ok := d.keyBytes(kv[i]); ok {
				if err := d.setFrame(&d.frameDicts[target.n], string(key), kv[i+1]); err != nil {
					return err
				}
			}
		}
		return nil
	case kCont:
		c := d.conts[target.n]
		if !c.isDict {
			return d.errAt(ErrMalformed, "%s on a list", pickle.OpName(d.op))
		}
		for i := 0; i < len(kv); i += 2 {
			if err := d.setField(c, kv[i], kv[i+1]); err != nil {
				return err
			}
		}
		return nil
	}
	return d.errAt(ErrMalformed, "%s on a value that is not a dict", pickle.OpName(d.op))
}

// setField stores one key/value pair into a typed or generic dict.
func (d *decoder) setField(c *container, k, v val) error {
	if c.taken {
		return d.changedAfterUse(c)
	}
	if c.sch == schGeneric {
		return d.setGeneric(c, k, v)
	}
	key, ok := d.keyBytes(k)
	if !ok {
		return nil // typed dicts ignore non-string keys
	}
	switch c.sch {
	case schTop:
		return d.setTop(c, string(key), v)
	case schSegment:
		return d.setSegment(&c.seg, string(key), v)
	case schBlock:
		return d.setBlock(&c.blk, string(key), v)
	}
	return nil
}

func (d *decoder) setTop(c *container, key string, v val) error {
	var err error
	switch key {
	case "segments":
		c.segs, err = typed(d, v, schSegments, key, func(c *container) []snapshot.Segment { return c.segs })
		c.hasSegs = err == nil
	case "device_traces":
		c.devs, err = typed(d, v, schDevTraces, key, func(c *container) [][]snapshot.Entry { return c.devs })
		c.hasDevs = err == nil
	case "allocator_settings":
		c.settings, err = d.settings(v)
	}
	return err
}

// typed returns the payload of v, which must be a container of schema want.
func typed[T any](d *decoder, v val, want schema, what string, get func(*container) T) (T, error) {
	var zero T
	if v.kind != kCont || d.conts[v.n].sch != want {
		return zero, d.errAt(ErrMalformed, "%s: want a %s, have %s", what, want, d.describe(v))
	}
	d.conts[v.n].taken = true
	return get(d.conts[v.n]), nil
}

// changedAfterUse reports a container filled after its parent copied it.
func (d *decoder) changedAfterUse(c *container) error {
	return d.errAt(ErrMalformed, "a %s changes after it was used; PyTorch snapshots never do that", c.sch)
}

func (d *decoder) settings(v val) (map[string]any, error) {
	if v.kind == kNone {
		return nil, nil
	}
	x, err := d.toAny(v)
	if err != nil {
		return nil, err
	}
	m, ok := x.(map[string]any)
	if !ok {
		return nil, d.errAt(ErrMalformed, "allocator_settings: want a dict, have %s", d.describe(v))
	}
	return m, nil
}

func (d *decoder) setSegment(s *snapshot.Segment, key string, v val) error {
	var err error
	switch key {
	case "device":
		s.Device, err = d.int(v, key)
	case "address":
		s.Address, err = d.u64(v, key)
	case "total_size":
		s.TotalSize, err = d.u64(v, key)
	case "allocated_size":
		s.AllocatedSize, err = d.u64(v, key)
	case "active_size":
		s.ActiveSize, err = d.u64(v, key)
	case "requested_size":
		s.RequestedSize, err = d.u64(v, key)
	case "stream":
		s.Stream, err = d.stream(v, key)
	case "segment_type":
		s.SegmentType, err = d.string(v, key)
	case "is_expandable":
		s.IsExpandable, err = d.bool(v, key)
	case "segment_pool_id":
		s.PoolID, err = d.poolID(v, key)
	case "blocks":
		s.Blocks, err = typed(d, v, schBlocks, key, func(c *container) []snapshot.Block { return c.blks })
	case "frames":
		if d.opt.Frames {
			s.Frames, err = d.frames(v)
		}
	}
	return err
}

func (d *decoder) setBlock(b *snapshot.Block, key string, v val) error {
	var err error
	switch key {
	case "address":
		b.Address, err = d.u64(v, key)
	case "size":
		b.Size, err = d.u64(v, key)
	case "requested_size":
		b.RequestedSize, err = d.u64(v, key)
	case "state":
		var st string
		st, err = d.string(v, key)
		b.State = snapshot.BlockState(st)
	case "frames":
		if d.opt.Frames {
			b.Frames, err = d.frames(v)
		}
	}
	return err
}

func (d *decoder) setFrame(f *snapshot.Frame, key string, v val) error {
	var err error
	switch key {
	case "filename":
		f.Filename, err = d.string(v, key)
	case "name":
		f.Name, err = d.string(v, key)
	case "line":
		f.Line, err = d.int(v, key)
	}
	return err
}

// setEntry sets one key of the pooled entry e, whose kEntry id is id.
func (d *decoder) setEntry(e *rawEntry, id uint64, k, v val) error {
	key, ok := d.keyBytes(k)
	if !ok {
		return nil
	}
	var err error
	switch string(key) {
	case "action":
		err = d.action(e, id, v)
	case "addr", "device_free":
		e.addr, err = d.u64(v, "addr")
	case "size":
		e.size, err = d.u64(v, "size")
	case "stream":
		e.stream, err = d.stream(v, "stream")
	case "time_us":
		e.time, err = d.time(v)
	case "frames":
		if d.opt.Frames {
			if _, err = d.frames(v); err == nil && v.n < math.MaxUint32 {
				e.ref = uint32(v.n) + 1
			}
		}
	}
	return err
}

func (d *decoder) frames(v val) ([]snapshot.Frame, error) {
	if v.kind != kFrames {
		return nil, d.errAt(ErrMalformed, "frames: want a %s, have %s", schFrames, d.describe(v))
	}
	return d.frameLists[v.n], nil
}

// appendItems appends items to the list value target.
func (d *decoder) appendItems(target val, items []val) error {
	switch target.kind {
	case kSkip:
		return nil
	case kFrames:
		return d.appendFrames(target.n, items)
	}
	if target.kind != kCont || d.conts[target.n].isDict {
		return d.errAt(ErrMalformed, "%s on %s", pickle.OpName(d.op), d.describe(target))
	}
	ci := target.n
	for _, it := range items {
		if err := d.appendItem(ci, it); err != nil {
			return err
		}
	}
	if d.poolLive <= 0 && len(d.pool) > 0 {
		d.recyclePool()
	}
	return nil
}

func (d *decoder) appendItem(ci uint64, it val) error {
	c := d.conts[ci]
	if c.taken {
		return d.changedAfterUse(c)
	}
	var err error
	switch c.sch {
	case schGeneric:
		var x any
		if x, err = d.toAny(it); err == nil {
			c.list = append(c.list, x)
			d.used += valSize
		}
	case schTrace:
		err = d.appendEntry(c, it)
	case schSegments:
		var s *container
		if s, err = d.item(it, schSegment, "segments"); err == nil {
			c.segs = append(c.segs, s.seg)
			d.used += segmentSize
		}
	case schBlocks:
		var b *container
		if b, err = d.item(it, schBlock, "blocks"); err == nil {
			c.blks = append(c.blks, b.blk)
			d.used += blockSize
		}
	case schDevTraces:
		var t *container
		if t, err = d.item(it, schTrace, "device_traces"); err == nil {
			ents := d.entries(&t.trace)
			c.devs = append(c.devs, ents)
			d.used += sliceSize
		}
	}
	return err
}

func (d *decoder) appendFrames(list uint64, items []val) error {
	for _, it := range items {
		if it.kind != kFrame {
			return d.errAt(ErrMalformed, "frames item: want a %s, have %s", schFrame, d.describe(it))
		}
		d.frameLists[list] = append(d.frameLists[list], d.frameDicts[it.n])
		d.used += frameSize
	}
	return nil
}

// item returns the container of a list item, which must have schema want.
// The pointer is valid until the next container is created.
func (d *decoder) item(it val, want schema, list string) (*container, error) {
	if it.kind != kCont || d.conts[it.n].sch != want {
		return nil, d.errAt(ErrMalformed, "%s item: want a %s, have %s", list, want, d.describe(it))
	}
	d.conts[it.n].taken = true
	return d.conts[it.n], nil
}

// describe names a value for error messages.
func (d *decoder) describe(v val) string {
	switch v.kind {
	case kCont:
		return d.conts[v.n].sch.String()
	case kEntry:
		return schEntry.String()
	case kFrames:
		return schFrames.String()
	case kFrame:
		return schFrame.String()
	case kSkip:
		return "a container in an unexpected place"
	case kNone:
		return "None"
	case kBool:
		if v.n != 0 {
			return "a bool (True)"
		}
		return "a bool (False)"
	case kInt, kUint:
		return "an int"
	case kFloat:
		return "a float"
	case kStr:
		return "a string"
	case kBytes:
		return "bytes"
	case kAny:
		return fmt.Sprintf("a %T", d.anys[v.n])
	case kSkipped:
		return "a long value in a place whose value is not kept"
	}
	return "an unset value"
}

// keyBytes returns the bytes of a string value.
func (d *decoder) keyBytes(v val) ([]byte, bool) {
	switch v.kind {
	case kStr:
		off, n := unpackRef(v.n)
		return d.arena[off : off+n], true
	case kAny:
		if s, ok := d.anys[v.n].(string); ok {
			return []byte(s), true
		}
	}
	return nil, false
}

// string returns a string value, interned: snapshots repeat a few states,
// segment types, file and function names many times.
func (d *decoder) string(v val, key string) (string, error) {
	b, ok := d.keyBytes(v)
	if !ok {
		return "", d.errAt(ErrMalformed, "%s: want a string, have %s", key, d.describe(v))
	}
	if s, ok := d.intern[string(b)]; ok {
		return s, nil
	}
	s := string(b)
	d.intern[s] = s
	d.used += int64(len(s)) + 2*valSize
	return s, nil
}

// action sets an entry's action code; an unknown name is kept for the error
// reported when the entry joins its trace.
func (d *decoder) action(e *rawEntry, id uint64, v val) error {
	b, ok := d.keyBytes(v)
	if !ok {
		return d.errAt(ErrMalformed, "action: want a string, have %s", d.describe(v))
	}
	switch string(b) {
	case "alloc":
		e.action = 1
	case "free_requested":
		e.action = 2
	case "free_completed":
		e.action = 3
	case "segment_alloc":
		e.action = 4
	case "segment_free":
		e.action = 5
	case "segment_map":
		e.action = 6
	case "segment_unmap":
		e.action = 7
	case "snapshot":
		e.action = 8
	case "oom":
		e.action = 9
	default:
		e.action = actUnknown
		if d.badNames == nil {
			d.badNames = make(map[uint64]string)
		}
		d.badNames[id] = string(b)
		d.used += int64(len(b)) + 2*valSize
	}
	return nil
}

// u64 accepts a non-negative int. A bool is refused: Python's True is an
// int, but a snapshot never holds one where a size or address belongs.
func (d *decoder) u64(v val, key string) (uint64, error) {
	switch {
	case v.kind == kInt && int64(v.n) >= 0, v.kind == kUint:
		return v.n, nil
	}
	return 0, d.errAt(ErrMalformed, "%s: want a non-negative 64-bit int, have %s", key, d.describeNum(v))
}

// poolID accepts PyTorch's MempoolId_t, a pair of non-negative ints.
func (d *decoder) poolID(v val, key string) ([2]uint64, error) {
	x, err := d.toAny(v)
	if err != nil {
		return [2]uint64{}, err
	}
	var id [2]uint64
	l, ok := x.([]any)
	if ok && len(l) == 2 {
		for i, e := range l {
			switch n := e.(type) {
			case int64:
				ok = ok && n >= 0
				id[i] = uint64(n)
			case uint64:
				id[i] = n
			default:
				ok = false
			}
		}
	} else {
		ok = false
	}
	if !ok {
		return [2]uint64{}, d.errAt(ErrMalformed, "%s: want a pair of non-negative ints, have %s", key, d.describe(v))
	}
	return id, nil
}

// stream accepts PyTorch's int64(cudaStream_t) and keeps its bits.
func (d *decoder) stream(v val, key string) (uint64, error) {
	if v.kind == kInt || v.kind == kUint {
		return v.n, nil
	}
	return 0, d.errAt(ErrMalformed, "%s: want a 64-bit int, have %s", key, d.describeNum(v))
}

func (d *decoder) int(v val, key string) (int, error) {
	if v.kind == kInt && int64(v.n) >= math.MinInt && int64(v.n) <= math.MaxInt {
		return int(int64(v.n)), nil
	}
	return 0, d.errAt(ErrMalformed, "%s: want an int, have %s", key, d.describeNum(v))
}

func (d *decoder) bool(v val, key string) (bool, error) {
	switch v.kind {
	case kBool:
		return v.n != 0, nil
	case kInt:
		return v.n != 0, nil
	}
	return false, d.errAt(ErrMalformed, "%s: want a bool, have %s", key, d.describe(v))
}

// time accepts an int or a float number of microseconds.
func (d *decoder) time(v val) (int64, error) {
	switch v.kind {
	case kInt:
		return int64(v.n), nil
	case kFloat:
		f := math.Float64frombits(v.n)
		if f >= math.MinInt64 && f < math.MaxInt64 {
			return int64(f), nil
		}
	}
	return 0, d.errAt(ErrMalformed, "time_us: want a 64-bit int or a float, have %s", d.describeNum(v))
}

func (d *decoder) describeNum(v val) string {
	switch v.kind {
	case kInt:
		return fmt.Sprintf("%d", int64(v.n))
	case kUint:
		return fmt.Sprintf("%d", v.n)
	case kFloat:
		return fmt.Sprintf("%g", math.Float64frombits(v.n))
	case kAny:
		if x, ok := d.anys[v.n].(fmt.Stringer); ok {
			return x.String()
		}
	}
	return d.describe(v)
}
