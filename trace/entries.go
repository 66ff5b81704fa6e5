package trace

import (
	"unsafe"

	"github.com/allocd/allocd/snapshot"
)

// Entry dicts are decoded into a small pool instead of containers: a kEntry
// value packs the pool generation and slot. When its device trace takes an
// entry (APPENDS), the entry moves into the trace's chunks; when every
// pooled entry has been taken, the pool is emptied and its generation
// advances, so a stale reference (a memoized entry dict used twice) is
// detected instead of reading a reused slot.
//
// Until the end, entries are rawEntry values: 40 bytes without Go pointers,
// kept in chunks that are never copied, so that neither growth nor the
// garbage collector touches a million entries more than once. The final
// []Entry is allocated at its exact size when the trace is complete.

// rawEntry is an Entry while decoding.
type rawEntry struct {
	addr, size, stream uint64
	time               int64
	// ref is 1 + the index of its frames list in decoder.frameLists, or 0.
	ref    uint32
	action uint8 // index in actionCodes; actUnknown: see decoder.badNames
}

// actionCodes are the known actions by code; code 0 is a missing action.
var actionCodes = [...]snapshot.Action{"", snapshot.ActionAlloc, snapshot.ActionFreeRequested, snapshot.ActionFreeCompleted,
	snapshot.ActionSegmentAlloc, snapshot.ActionSegmentFree, snapshot.ActionSegmentMap, snapshot.ActionSegmentUnmap,
	snapshot.ActionSnapshot, snapshot.ActionOOM}

const actUnknown = uint8(len(actionCodes))

// entryChunks is a device trace under construction.
type entryChunks struct {
	chunks [][]rawEntry
	n      int
}

const maxChunk = 1 << 15

func (t *entryChunks) add(e rawEntry) {
	if len(t.chunks) == 0 || len(t.chunks[len(t.chunks)-1]) == cap(t.chunks[len(t.chunks)-1]) {
		size := 256
		if len(t.chunks) > 0 {
			size = min(2*cap(t.chunks[len(t.chunks)-1]), maxChunk)
		}
		t.chunks = append(t.chunks, make([]rawEntry, 0, size))
	}
	last := &t.chunks[len(t.chunks)-1]
	*last = append(*last, e)
	t.n++
}

// entries converts a finished trace into its final slice. Fields are set
// one by one into the zeroed slice: copying whole Entry values would take
// the bulk write barrier path for every entry while the collector runs.
func (d *decoder) entries(t *entryChunks) []snapshot.Entry {
	d.used += int64(t.n) * entrySize
	out := make([]snapshot.Entry, t.n)
	i := 0
	for _, c := range t.chunks {
		for j := range c {
			r, e := &c[j], &out[i]
			i++
			e.Action = actionCodes[r.action]
			e.Addr, e.Size, e.Stream, e.TimeUS = r.addr, r.size, r.stream, r.time
			if r.ref > 0 {
				e.Frames = d.frameLists[r.ref-1]
			}
		}
	}
	t.chunks = nil // the collector may take them now
	return out
}

// Memory estimates of an entry while decoding and once decoded.
const (
	rawEntrySize = int64(unsafe.Sizeof(rawEntry{}))
	entrySize    = int64(unsafe.Sizeof(snapshot.Entry{}))
)

func (d *decoder) newEntry() val {
	slot := len(d.pool)
	if slot == cap(d.pool) {
		d.used += int64(slot) * rawEntrySize
	}
	d.pool = append(d.pool, rawEntry{})
	d.poolLive++
	return val{kind: kEntry, n: uint64(d.poolGen)<<32 | uint64(slot)}
}

// poolEntry returns the pooled entry a kEntry value refers to. The pointer is
// valid until the next newEntry.
func (d *decoder) poolEntry(v val) (*rawEntry, error) {
	gen, slot := uint32(v.n>>32), v.n&(1<<32-1)
	if gen != d.poolGen || slot >= uint64(len(d.pool)) {
		return nil, d.errAt(ErrMalformed, "a trace entry dict is used twice; PyTorch snapshots never share entries")
	}
	return &d.pool[slot], nil
}

func (d *decoder) recyclePool() {
	clear(d.badNames)
	d.pool = d.pool[:0]
	d.poolGen++
	d.poolLive = 0
}

// appendEntry moves an entry dict into the device trace c.
func (d *decoder) appendEntry(c *container, it val) error {
	if it.kind != kEntry {
		return d.errAt(ErrMalformed, "device trace item: want a %s, have %s", schEntry, d.describe(it))
	}
	e, err := d.poolEntry(it)
	if err != nil {
		return err
	}
	if e.action == 0 || e.action == actUnknown {
		return d.badAction(c, e, it.n)
	}
	c.trace.add(*e)
	d.used += rawEntrySize
	d.poolLive--
	return nil
}

func (d *decoder) badAction(c *container, e *rawEntry, id uint64) error {
	dev := "?"
	if c.parent >= 0 && d.conts[c.parent].sch == schDevTraces {
		dev = itoa(len(d.conts[c.parent].devs))
	}
	if e.action == 0 {
		return d.errAt(ErrMalformed, "device_traces[%s][%d]: entry has no action", dev, c.trace.n)
	}
	return d.errAt(ErrUnknownAction, "device_traces[%s][%d]: action %q", dev, c.trace.n, d.badNames[id])
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b [20]byte
	n := len(b)
	for ; i > 0; i /= 10 {
		n--
		b[n] = byte('0' + i%10)
	}
	return string(b[n:])
}
