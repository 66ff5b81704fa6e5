package trace

import (
	"unsafe"

	"github.com/allocd/allocd/internal/pickle"
	"github.com/allocd/allocd/snapshot"
)

// schema is what a container of the snapshot is, and so what its items become.
type schema uint8

const (
	schSkip      schema = iota // contents dropped
	schGeneric                 // decoded into map[string]any / []any
	schTop                     // the snapshot dict
	schSegments                // "segments": list of segment dicts
	schSegment                 // one segment dict
	schBlocks                  // a segment's "blocks"
	schBlock                   // one block dict
	schDevTraces               // "device_traces": list of per-device lists
	schTrace                   // one device's list of entry dicts
	schEntry                   // one entry dict (lives in decoder.pool)
	schFrames                  // a "frames" list (lives in decoder.frameLists)
	schFrame                   // one frame dict (lives in decoder.frameDicts)
)

var schemaNames = [...]string{"skipped value", "generic value", "snapshot dict",
	"segments list", "segment dict", "blocks list", "block dict",
	"device_traces list", "device trace list", "trace entry dict",
	"frames list", "frame dict"}

func (s schema) String() string { return schemaNames[s] }

// openCont is a container that may still receive items.
type openCont struct {
	pos    int32 // its index on the stack
	cont   int32 // its index in decoder.conts, or -1
	sch    schema
	dict   bool
	closed bool // it has received its last batch
}

// container is the payload of a kCont value: the snapshot dict, segments,
// blocks, device traces and generic values, which are few. Only the fields of
// its schema are used. (Entries, frames lists and frame dicts, which are
// many, have their own small values.)
type container struct {
	sch    schema
	isDict bool
	taken  bool  // its payload was used by a parent: it must not change
	parent int32 // the container it was created in, or -1

	seg   snapshot.Segment   // schSegment
	blk   snapshot.Block     // schBlock
	segs  []snapshot.Segment // schSegments, and schTop's "segments"
	blks  []snapshot.Block   // schBlocks
	devs  [][]snapshot.Entry // schDevTraces, and schTop's "device_traces"
	trace entryChunks        // schTrace
	list  []any              // schGeneric list
	dict  map[string]any     // schGeneric dict

	hasSegs, hasDevs bool           // schTop
	settings         map[string]any // schTop
}

// Memory estimates of what open creates (see decoder.used).
const (
	containerSize = int64(unsafe.Sizeof(container{}))
	frameSize     = int64(unsafe.Sizeof(snapshot.Frame{}))
	sliceSize     = int64(unsafe.Sizeof([]snapshot.Frame{}))
)

// open pushes a new, empty dict or list and gives it a schema.
func (d *decoder) open(isDict bool) error {
	sch, parent := d.place(isDict)
	v := val{kind: kSkip}
	ci := int32(-1)
	switch sch {
	case schSkip:
	case schEntry:
		v = d.newEntry()
	case schFrames: // a stack per entry: kept out of the larger container
		v = val{kind: kFrames, n: uint64(len(d.frameLists))}
		d.frameLists = append(d.frameLists, nil)
		d.used += sliceSize
	case schFrame:
		v = val{kind: kFrame, n: uint64(len(d.frameDicts))}
		d.frameDicts = append(d.frameDicts, snapshot.Frame{})
		d.used += frameSize
	default:
		if sch == schTrace {
			if d.devs++; d.devs > MaxDevices {
				return d.errAt(ErrTooLarge, "more than MaxDevices (%d) device traces", MaxDevices)
			}
		}
		ci = int32(len(d.conts))
		d.conts = append(d.conts, &container{sch: sch, isDict: isDict, parent: parent})
		d.used += containerSize + 8
		v = val{kind: kCont, n: uint64(ci)}
	}
	d.ctx = append(d.ctx, openCont{pos: int32(len(d.stack)), cont: ci, sch: sch, dict: isDict})
	d.stack = append(d.stack, v)
	return nil
}

// ignored reports whether the value about to be pushed is dropped by the
// decoder: an item of a skipped container, the value of a key that its
// typed dict does not use, or a part of a tuple built for one of those. It
// follows place, without changing the open containers.
func (d *decoder) ignored() bool {
	topMark := int32(-1)
	if len(d.marks) > 0 {
		topMark = d.marks[len(d.marks)-1]
	}
	for i := len(d.ctx) - 1; i >= 0; i-- {
		p := &d.ctx[i]
		if p.closed {
			continue
		}
		if topMark > p.pos+1 {
			return inherit(p.sch) == schSkip
		}
		own := topMark == p.pos+1
		n := len(d.stack) - int(p.pos) - 1
		switch {
		case p.dict && (n == 1 || own && n%2 == 1):
			key, _ := d.keyBytes(d.stack[len(d.stack)-1])
			return !d.usesKey(p.sch, string(key))
		case p.dict && (n == 0 || own):
			return false // a key
		case !p.dict && (n == 0 || own):
			return p.sch == schSkip
		}
	}
	return false
}

// usesKey reports whether a dict of schema s keeps the value of key.
func (d *decoder) usesKey(s schema, key string) bool {
	switch s {
	case schSkip:
		return false
	case schTop:
		return key == "segments" || key == "device_traces" || key == "allocator_settings"
	case schSegment:
		switch key {
		case "device", "address", "total_size", "allocated_size", "active_size",
			"requested_size", "stream", "segment_type", "is_expandable", "segment_pool_id", "blocks":
			return true
		}
	case schBlock:
		switch key {
		case "address", "size", "requested_size", "state":
			return true
		}
	case schEntry:
		switch key {
		case "action", "addr", "device_free", "size", "stream", "time_us":
			return true
		}
	case schFrame:
		return key == "filename" || key == "name" || key == "line"
	default:
		return true
	}
	return key == "frames" && d.opt.Frames
}

// place finds the open container a new dict or list is being built for and
// returns the new container's schema and its parent's container index.
//
// A pickler writes a container's items right after it: "L MARK x y APPENDS",
// or "L x APPEND" for one item, and the same with key/value pairs and
// SETITEMS/SETITEM for a dict. So, walking open containers from the
// innermost outwards, the new value belongs to the first one whose stack
// layout admits it as its next item (a list) or as the value of its pending
// key (a dict); a container that cannot take it is complete and is dropped.
func (d *decoder) place(isDict bool) (schema, int32) {
	for len(d.ctx) > 0 {
		p := &d.ctx[len(d.ctx)-1]
		if !p.closed {
			topMark := int32(-1)
			if len(d.marks) > 0 {
				topMark = d.marks[len(d.marks)-1]
			}
			if topMark > p.pos+1 {
				// Inside a MARK ... TUPLE/LIST/DICT built above p.
				return inherit(p.sch), -1
			}
			own := topMark == p.pos+1
			n := len(d.stack) - int(p.pos) - 1 // values above p
			switch {
			case p.dict && (n == 1 || own && n%2 == 1):
				key, _ := d.keyBytes(d.stack[len(d.stack)-1])
				return d.dictChild(p.sch, key, isDict), p.cont
			case !p.dict && (n == 0 || own):
				if sch, ok := d.listChild(p.sch, isDict); ok {
					return sch, p.cont
				}
			}
		}
		d.ctx = d.ctx[:len(d.ctx)-1]
	}
	if isDict {
		return schTop, -1
	}
	return schSkip, -1
}

// inherit is the schema of a value nested in something the decoder does not
// type (a tuple under construction): generic stays generic, else skipped.
func inherit(s schema) schema {
	if s == schGeneric {
		return schGeneric
	}
	return schSkip
}

// dictChild is the schema of a container stored under key in a parent of
// schema s.
func (d *decoder) dictChild(s schema, key []byte, isDict bool) schema {
	if !isDict && string(key) == "frames" && d.opt.Frames && s != schGeneric {
		// Frames may be shared (memoized) between blocks, history and
		// entries, so every frames list is typed when frames are wanted.
		return schFrames
	}
	switch s {
	case schGeneric:
		return schGeneric
	case schTop:
		switch string(key) {
		case "segments":
			return pick(!isDict, schSegments)
		case "device_traces":
			return pick(!isDict, schDevTraces)
		case "allocator_settings":
			return pick(isDict, schGeneric)
		}
	case schSegment:
		if string(key) == "blocks" {
			return pick(!isDict, schBlocks)
		}
	}
	return schSkip
}

// listChild is the schema of a container appended to a list of schema s;
// ok is false when such a list cannot hold it (so the list is complete).
func (d *decoder) listChild(s schema, isDict bool) (schema, bool) {
	switch s {
	case schSkip, schGeneric:
		return s, true
	case schSegments:
		return schSegment, isDict
	case schBlocks:
		return schBlock, isDict
	case schDevTraces:
		return schTrace, !isDict
	case schTrace:
		return schEntry, isDict
	case schFrames:
		return schFrame, isDict
	}
	return schSkip, false
}

func pick(ok bool, s schema) schema {
	if ok {
		return s
	}
	return schSkip
}

// markDone records that the container at stack index pos received a batch
// of n items (pairs for a dict) through a single-item opcode or not.
func (d *decoder) markDone(pos int, n int, single bool) {
	if len(d.ctx) == 0 {
		return
	}
	p := &d.ctx[len(d.ctx)-1]
	if int(p.pos) == pos && (single || n < pickle.BatchSize) {
		p.closed = true
	}
}
