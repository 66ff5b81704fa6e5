package debughttp

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/allocd/allocd/snapshot"
)

// Formats of /debug/snapshot.
const (
	formatJSON   = "json"
	formatPickle = "pickle"
)

// serveSnapshot writes the selected devices' snapshot, merged and with the
// most recent ?entries entries of each trace, as JSON or a pickle.
func (h *Handler) serveSnapshot(w http.ResponseWriter, r *http.Request, devs []device, q map[string]string) {
	format := h.opts.SnapshotFormat
	if f, ok := q["format"]; ok {
		if f != formatJSON && f != formatPickle {
			http.Error(w, fmt.Sprintf("format %q: expected %s or %s", f, formatJSON, formatPickle), http.StatusBadRequest)
			return
		}
		format = f
	}
	entries := h.opts.DefaultEntries
	if s, ok := q["entries"]; ok {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 || n > h.opts.MaxEntries {
			http.Error(w, fmt.Sprintf("entries %q: expected a count from 0 to %d", s, h.opts.MaxEntries), http.StatusBadRequest)
			return
		}
		entries = n
	}
	if format == formatPickle {
		setNoStore(w, "application/octet-stream")
		w.Header().Set("Content-Disposition", `attachment; filename="allocd_snapshot.pickle"`)
	} else {
		setNoStore(w, "application/json")
	}
	if r.Method == http.MethodHead {
		return
	}
	snap, wait := h.build(devs, entries)
	if snap == nil {
		w.Header().Del("Content-Disposition")
		w.Header().Set("Retry-After", strconv.Itoa(max(1, int(math.Ceil(wait.Seconds())))))
		http.Error(w, fmt.Sprintf("%s: snapshots are built one at a time and may take at most %g of the time; retry in %v",
			r.URL.Path, h.opts.LockShare, max(wait, 0).Round(time.Millisecond)), http.StatusServiceUnavailable)
		return
	}
	lw := &limitWriter{w: w, max: h.opts.MaxBodyBytes}
	var err error
	if format == formatPickle {
		err = snapshot.WritePickle(lw, snap)
	} else {
		err = writeJSON(lw, snap)
	}
	if err == nil {
		return
	}
	if errors.Is(err, errTooLarge) {
		if lw.sent == 0 {
			w.Header().Del("Content-Disposition")
			http.Error(w, fmt.Sprintf("snapshot larger than the %d-byte limit; ask for fewer ?entries", h.opts.MaxBodyBytes), http.StatusRequestEntityTooLarge)
			return
		}
		h.logErr(0, err)
		panic(http.ErrAbortHandler) // the client must not take a cut document for a whole one
	}
	h.logErr(0, err)
}

// lockBurst is how far ahead of its share snapshot building may run:
// builds shorter than this in total never wait for one another.
const lockBurst = 100 * time.Millisecond

// build takes the snapshots of devs and keeps the last entries of each
// trace (capMerge), when no other build runs and building has not taken
// more than Options.LockShare of the time (allowing lockBurst ahead).
// Otherwise it returns nil and how long to wait.
func (h *Handler) build(devs []device, entries int) (*snapshot.Snapshot, time.Duration) {
	h.buildMu.Lock()
	start := h.now()
	if h.building || start.Before(h.nextBuild.Add(-lockBurst)) {
		wait := h.nextBuild.Add(-lockBurst).Sub(start)
		h.buildMu.Unlock()
		return nil, wait
	}
	h.building = true
	h.buildMu.Unlock()

	var took time.Duration
	defer func() {
		h.buildMu.Lock()
		defer h.buildMu.Unlock()
		h.building = false
		end := start.Add(took)
		if h.nextBuild.Before(end) {
			h.nextBuild = end
		}
		h.nextBuild = h.nextBuild.Add(time.Duration(float64(took) * (1/h.opts.LockShare - 1)))
	}()
	snaps := make([]*snapshot.Snapshot, len(devs))
	for i, d := range devs {
		snaps[i] = d.src.Snapshot()
	}
	took = h.now().Sub(start)
	snap := capMerge(snaps, entries)
	clear(snaps) // the full histories are garbage from here on
	return snap, 0
}

// capMerge merges snaps as snapshot.Merge does, keeping the last n entries of
// each device trace. The entries kept are copied, so that the snapshots'
// full histories are garbage once snaps is dropped.
func capMerge(snaps []*snapshot.Snapshot, n int) *snapshot.Snapshot {
	out := &snapshot.Snapshot{Segments: []snapshot.Segment{}, DeviceTraces: [][]snapshot.Entry{}}
	total := []int{}
	for _, s := range snaps {
		out.Segments = append(out.Segments, s.Segments...)
		if out.AllocatorSettings == nil {
			out.AllocatorSettings = s.AllocatorSettings
		}
		for d, tr := range s.DeviceTraces {
			for len(total) <= d {
				total = append(total, 0)
			}
			total[d] += len(tr)
		}
	}
	for d, t := range total {
		skip := max(t-n, 0) // entries to drop from the front of trace d
		kept := make([]snapshot.Entry, 0, t-skip)
		for _, s := range snaps {
			if d >= len(s.DeviceTraces) {
				continue
			}
			tr := s.DeviceTraces[d]
			drop := min(skip, len(tr))
			skip -= drop
			kept = append(kept, tr[drop:]...)
		}
		out.DeviceTraces = append(out.DeviceTraces, kept)
	}
	return out
}

// errTooLarge: a response would pass Options.MaxBodyBytes.
var errTooLarge = errors.New("response larger than MaxBodyBytes")

// limitWriter passes writes on while the total fits in max bytes (no
// limit when max is 0) and counts what it sent.
type limitWriter struct {
	w    io.Writer
	max  int64
	sent int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if l.max > 0 && l.sent+int64(len(p)) > l.max {
		return 0, errTooLarge
	}
	n, err := l.w.Write(p)
	l.sent += int64(n)
	return n, err
}

// writeJSON writes s as encoding/json renders a snapshot.Snapshot (the same
// keys and values; decoding either gives equal snapshots), streamed: one
// segment and one trace entry at a time through a 64 KiB buffer, one per
// line. It returns the first error of w.
func writeJSON(w io.Writer, s *snapshot.Snapshot) error {
	bw := bufio.NewWriterSize(w, 64<<10)
	jw := &jsonWriter{w: bw, frames: map[framesKey][]byte{}}
	jw.raw(`{"segments":[`)
	for i := range s.Segments {
		if i > 0 {
			jw.raw(",")
		}
		jw.raw("\n")
		jw.value(&s.Segments[i])
	}
	jw.raw("\n],\"device_traces\":[")
	for d, tr := range s.DeviceTraces {
		if d > 0 {
			jw.raw(",")
		}
		jw.raw("\n[")
		for i := range tr {
			if i > 0 {
				jw.raw(",")
			}
			jw.raw("\n")
			jw.entry(&tr[i])
		}
		if len(tr) > 0 {
			jw.raw("\n")
		}
		jw.raw("]")
	}
	jw.raw("\n],\"allocator_settings\":")
	jw.value(s.AllocatorSettings)
	jw.raw("}\n")
	if jw.err != nil {
		return jw.err
	}
	return bw.Flush()
}

// framesKey names a Frames slice: its first element and its length.
type framesKey struct {
	first *snapshot.Frame
	n     int
}

// jsonWriter writes JSON pieces; the first error sticks.
type jsonWriter struct {
	w      *bufio.Writer
	err    error
	buf    []byte               // scratch for an entry
	frames map[framesKey][]byte // encoded Frames (entries share them)
}

func (j *jsonWriter) raw(s string) {
	if j.err == nil {
		_, j.err = j.w.WriteString(s)
	}
}

func (j *jsonWriter) bytes(b []byte) {
	if j.err == nil {
		_, j.err = j.w.Write(b)
	}
}

func (j *jsonWriter) value(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		if j.err == nil {
			j.err = fmt.Errorf("debughttp: encoding a snapshot: %w", err)
		}
		return
	}
	j.bytes(b)
}

// entry writes e as encoding/json writes a snapshot.Entry.
func (j *jsonWriter) entry(e *snapshot.Entry) {
	b := append(j.buf[:0], `{"action":`...)
	b = appendString(b, string(e.Action))
	b = append(b, `,"addr":`...)
	b = strconv.AppendUint(b, e.Addr, 10)
	b = append(b, `,"size":`...)
	b = strconv.AppendUint(b, e.Size, 10)
	b = append(b, `,"stream":`...)
	b = strconv.AppendUint(b, e.Stream, 10)
	b = append(b, `,"time_us":`...)
	b = strconv.AppendInt(b, e.TimeUS, 10)
	if len(e.Frames) > 0 {
		key := framesKey{&e.Frames[0], len(e.Frames)}
		fs, ok := j.frames[key]
		if !ok || len(fs) == 0 {
			enc, err := json.Marshal(e.Frames)
			if err != nil && j.err == nil {
				j.err = fmt.Errorf("debughttp: encoding frames: %w", err)
			}
			fs = enc
			j.frames[key] = fs
		}
		b = append(b, `,"frames":`...)
		b = append(b, fs...)
	}
	b = append(b, '}')
	j.buf = b
	j.bytes(b)
}

// appendString appends s as a JSON string: as it is when it needs no
// escape, as encoding/json quotes it otherwise.
func appendString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			q, _ := json.Marshal(s) // a string always encodes
			return append(b, q...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}
