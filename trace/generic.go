package trace

import (
	"fmt"
	"math"
)

// toAny converts a finished value for a generic container: None → nil,
// bool, int64 (uint64, *big.Int), float64, string, []byte, list or tuple →
// []any, dict → map[string]any. A skipped container becomes nil; a typed
// snapshot part inside a generic value is an error.
func (d *decoder) toAny(v val) (any, error) {
	switch v.kind {
	case kNone, kSkip, kSkipped:
		return nil, nil
	case kBool:
		return v.n != 0, nil
	case kInt:
		return int64(v.n), nil
	case kUint:
		return v.n, nil
	case kFloat:
		return math.Float64frombits(v.n), nil
	case kStr:
		off, n := unpackRef(v.n)
		return string(d.arena[off : off+n]), nil
	case kBytes:
		off, n := unpackRef(v.n)
		return append([]byte(nil), d.arena[off:off+n]...), nil
	case kAny:
		return d.anys[v.n], nil
	case kCont:
		c := d.conts[v.n]
		if c.sch != schGeneric {
			break
		}
		c.taken = true
		if c.isDict {
			if c.dict == nil {
				c.dict = map[string]any{}
			}
			return c.dict, nil
		}
		if c.list == nil {
			return []any{}, nil
		}
		return c.list, nil
	}
	return nil, d.errAt(ErrMalformed, "%s inside a generic value", d.describe(v))
}

// anyKey converts a dict key for map[string]any: strings as they are,
// numbers, bools and None formatted as Python's str() would.
func (d *decoder) anyKey(k val) (string, error) {
	switch k.kind {
	case kStr, kAny:
		if b, ok := d.keyBytes(k); ok {
			return string(b), nil
		}
	case kNone:
		return "None", nil
	case kBool:
		if k.n != 0 {
			return "True", nil
		}
		return "False", nil
	case kInt, kUint, kFloat:
		x, _ := d.toAny(k)
		return fmt.Sprint(x), nil
	}
	return "", d.errAt(ErrMalformed, "dict key is %s", d.describe(k))
}

func (d *decoder) setGeneric(c *container, k, v val) error {
	key, err := d.anyKey(k)
	if err != nil {
		return err
	}
	x, err := d.toAny(v)
	if err != nil {
		return err
	}
	if c.dict == nil {
		c.dict = map[string]any{}
	}
	c.dict[key] = x
	d.used += int64(len(key)) + 4*valSize
	return nil
}

// anyList converts stack values into a []any.
func (d *decoder) anyList(items []val) ([]any, error) {
	d.used += int64(len(items)) * valSize
	l := make([]any, len(items))
	for i, it := range items {
		x, err := d.toAny(it)
		if err != nil {
			return nil, err
		}
		l[i] = x
	}
	return l, nil
}

// tupleN executes TUPLE1, TUPLE2 and TUPLE3.
func (d *decoder) tupleN(n int) error {
	if err := d.require(n); err != nil {
		return err
	}
	at := len(d.stack) - n
	if d.skipBuilt(at) {
		return nil
	}
	l, err := d.anyList(d.stack[at:])
	if err != nil {
		return err
	}
	d.truncate(at)
	d.pushAny(l)
	return nil
}

// listOp executes TUPLE and LIST: MARK items.
func (d *decoder) listOp() error {
	m, err := d.popMark()
	if err != nil {
		return err
	}
	if d.skipBuilt(m) {
		return nil
	}
	l, err := d.anyList(d.stack[m:])
	if err != nil {
		return err
	}
	d.truncate(m)
	d.pushAny(l)
	return nil
}

// skipBuilt replaces the items above stack index m with one kSkip value
// when the tuple, list or dict built of them would be dropped.
func (d *decoder) skipBuilt(m int) bool {
	n := len(d.stack)
	d.stack = d.stack[:m] // ignored looks at the stack without the items
	ign := d.ignored()
	d.stack = d.stack[:n]
	if ign {
		d.truncate(m)
		d.stack = append(d.stack, val{kind: kSkip})
	}
	return ign
}

// dictOp executes DICT: MARK k v k v.
func (d *decoder) dictOp() error {
	m, err := d.popMark()
	if err != nil {
		return err
	}
	kv := d.stack[m:]
	if len(kv)%2 != 0 {
		return d.errAt(ErrMalformed, "DICT with an odd number of values")
	}
	if d.skipBuilt(m) {
		return nil
	}
	c := container{sch: schGeneric, isDict: true, dict: map[string]any{}}
	for i := 0; i < len(kv); i += 2 {
		if err := d.setGeneric(&c, kv[i], kv[i+1]); err != nil {
			return err
		}
	}
	d.truncate(m)
	d.pushAny(c.dict)
	return nil
}
