// Package debughttp serves allocd's debug pages over HTTP, for any Go
// program to mount beside promhttp's /metrics:
//
//	h, err := debughttp.ForDevices(devs, debughttp.Options{})
//	if err != nil { ... }
//	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//	mux.Handle("/debug/", h)
//
// The pages (Pages lists them) are
//
//   - /debug/summary: the torch.cuda.memory_summary() table of each device;
//   - /debug/stats: the torch.cuda.memory_stats() keys as JSON, one device's
//     flat map, or an object from device index ("0", "1", …) to its map when
//     several devices are selected;
//   - /debug/snapshot: the torch.cuda.memory._snapshot() of the selected
//     devices (snapshot.Snapshot, merged as snapshot.Merge merges) as JSON, or with
//     ?format=pickle as the pickle pytorch.org/memory_viz opens.
//
// Every page takes ?gpu=: absent selects every device, "all" every device
// by name, N device N, and "0,2" a list. /debug/stats answers one device's
// flat map for ?gpu=N, and for no ?gpu when only one device is served
// (unless Options.StatsByDevice); otherwise the per-device object. A
// malformed ?gpu is a 400, a device not served a 404. /debug/snapshot
// also takes ?format=json|pickle (default Options.SnapshotFormat, JSON)
// and ?entries=N, the most recent trace entries kept of each device (default
// Options.DefaultEntries, 100,000; at most Options.MaxEntries, 1,000,000;
// 0 gives segments only). A parameter given twice, an unknown parameter,
// an unparsable query and an unknown format are 400s whose message names
// the parameter and what is accepted. Only GET and HEAD are answered
// (405 otherwise); HEAD builds no body.
//
// # Bounds
//
// At most Options.MaxInFlight requests (default 4) are served at once,
// as promhttp's MaxRequestsInFlight bounds /metrics; a request beyond
// that gets 503 Service Unavailable with "Retry-After: 1" at once,
// instead of queueing. Snapshots are built one at a time, and spaced so
// that building them takes at most Options.LockShare (default 10%) of the
// time: a snapshot asked for while another is built, or too soon after
// the last, gets 503 with a Retry-After of the seconds left (at least 1). The snapshot is streamed: JSON is written segment
// by segment and trace entry by trace entry through a 64 KiB buffer, the
// pickle by snapshot.WritePickle through its own, so a response costs no
// document-sized buffer. What stays in memory per request is the
// snapshot value itself: Allocator.Snapshot copies the whole recorded
// history (72 bytes an entry) under the allocator's lock before the
// handler keeps the ?entries most recent, so a request costs the history's
// size for as long as it takes to copy it, and the allocator waits for
// that copy: 20 to 30 ms for a million entries, 0.7 s for
// allocator.MaxHistoryEntries (BenchmarkSnapshotFullHistory). LockShare
// bounds how often that happens, not how long one copy takes. Options.MaxBodyBytes, when
// set, caps a response's bytes: a snapshot that would exceed it is
// refused with 413 when nothing was sent yet, and its connection is
// aborted otherwise (so the client sees an error, never a document that
// looks complete).
//
// # Exposure
//
// The debug pages reveal device addresses, allocation sizes and, with
// stack recording, the program's file names and functions; a snapshot is
// also the most expensive request the process answers. Serve them on
// loopback (or a private admin listener) and reach them through a reverse
// proxy with authentication, or through kubectl port-forward or an SSH
// tunnel; do not put them on a listener the network can reach. /metrics
// (aggregate counters and gauges, no addresses) is safe to expose to a
// Prometheus scraper.
package debughttp

import (
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/stats"
)

// Source is one device's allocator as the handler reads it.
// *allocator.Allocator implements it.
type Source interface {
	// Stats returns a consistent copy of the statistics.
	Stats() allocator.Stats
	// Snapshot returns the state in the shape of
	// torch.cuda.memory._snapshot(), this device's history at its index
	// of DeviceTraces. The handler does not modify it.
	Snapshot() *snapshot.Snapshot
	// Device returns the device; its Info().Index names the source in
	// ?gpu= and in the pages.
	Device() cudart.Device
}

var _ Source = (*allocator.Allocator)(nil)

// Defaults and bounds of Options.
const (
	// DefaultMaxInFlight is Options.MaxInFlight when zero.
	DefaultMaxInFlight = 4
	// DefaultEntries is Options.DefaultEntries when zero.
	DefaultEntries = 100_000
	// DefaultMaxEntries is Options.MaxEntries when zero.
	DefaultMaxEntries = 1_000_000
	// DefaultLockShare is Options.LockShare when zero.
	DefaultLockShare = 0.1
)

// Options configure the handler. The zero Options is valid and gives the
// documented defaults.
type Options struct {
	// MaxInFlight is how many requests are served at once (every page
	// counts); one more gets 503 with Retry-After. 0 means
	// DefaultMaxInFlight.
	MaxInFlight int
	// DefaultEntries is how many of the most recent trace entries of each
	// device a snapshot holds when the request has no ?entries. 0 means
	// DefaultEntries.
	DefaultEntries int
	// MaxEntries is the largest ?entries accepted (a larger one is a
	// 400). 0 means DefaultMaxEntries. DefaultEntries may not exceed it.
	MaxEntries int
	// MaxBodyBytes, above 0, caps the bytes of a snapshot response (see
	// the package doc); 0 means no cap.
	MaxBodyBytes int64
	// LockShare, in (0, 1], is the largest share of the time that
	// snapshot builds may take: one snapshot is built at a time, and after
	// a build that took t the next starts no sooner than
	// t × (1/LockShare − 1) later; a snapshot request before that gets 503
	// with Retry-After. Allocator.Snapshot holds the allocator's lock for
	// nearly all of its build, so this bounds how much of the time debug
	// requests stall Malloc and Free. 0 means DefaultLockShare.
	LockShare float64
	// ErrorLog, when set, receives errors of writing a response (a client
	// that went away, a body over MaxBodyBytes). Nil logs nothing.
	ErrorLog *log.Logger
	// SnapshotFormat is /debug/snapshot's format without ?format: "json"
	// or "pickle". "" means "json".
	SnapshotFormat string
	// StatsByDevice makes /debug/stats without ?gpu answer the object
	// from device index to map even when one device is served: for a
	// handler whose devices are created as they are used (ForDevices of
	// an allocator.NewLazyDevices), so that the page keeps one shape.
	StatsByDevice bool
	// StatsExtra, when set, gives keys added to a device's
	// /debug/stats map (a program's own counters beside the allocator's,
	// e.g. liballocd's num_bad_frees); they replace allocator keys of the
	// same name.
	StatsExtra func(device int) map[string]int64
}

// ErrOptions is wrapped by New's errors about bad Options.
var ErrOptions = errors.New("invalid debughttp options")

// Page is one page the Handler serves.
type Page struct {
	// Path is the page's path, e.g. "/debug/summary".
	Path string
	// Doc says in a line what the page holds and what it takes.
	Doc string
}

const (
	pathSummary  = "/debug/summary"
	pathStats    = "/debug/stats"
	pathSnapshot = "/debug/snapshot"
)

var pages = []Page{
	{pathSummary, "torch.cuda.memory_summary() table of each device; ?gpu=N, ?gpu=0,1 or ?gpu=all to select"},
	{pathStats, "torch.cuda.memory_stats() keys as JSON: one device's map, or one map per gpu with several; ?gpu= selects"},
	{pathSnapshot, "segments, blocks and recent history as JSON, or ?format=pickle for PyTorch's memory_viz; ?gpu= selects, ?entries=N caps the history"},
}

// Pages lists the pages the Handler serves, in the order of the package
// doc. The slice is a copy.
func Pages() []Page { return slices.Clone(pages) }

// device is one served source and its index.
type device struct {
	index int
	src   Source
}

// Handler serves the debug pages (Pages) of a fixed set of devices. It
// answers the exact paths of Pages, so mount it at "/debug/" (or each
// page at its path); under another prefix, strip it first
// (http.StripPrefix). It is safe for concurrent use.
type Handler struct {
	devices func() []device // the devices served now, ascending index
	opts    Options
	slots   chan struct{}
	serving func() // tests: called while a request holds its slot

	buildMu   sync.Mutex
	building  bool      // a snapshot is being built
	nextBuild time.Time // no build starts before
	now       func() time.Time
}

// newHandler checks opts, fills in their defaults, and returns a handler
// serving no device yet.
func newHandler(opts Options) (*Handler, error) {
	if opts.MaxInFlight < 0 || opts.DefaultEntries < 0 || opts.MaxEntries < 0 || opts.MaxBodyBytes < 0 {
		return nil, fmt.Errorf("debughttp: %w: MaxInFlight, DefaultEntries, MaxEntries and MaxBodyBytes must not be negative", ErrOptions)
	}
	if !(opts.LockShare >= 0 && opts.LockShare <= 1) { // NaN too
		return nil, fmt.Errorf("debughttp: %w: LockShare %v: want a share in (0, 1], or 0 for the default", ErrOptions, opts.LockShare)
	}
	if opts.LockShare == 0 {
		opts.LockShare = DefaultLockShare
	}
	if opts.MaxInFlight == 0 {
		opts.MaxInFlight = DefaultMaxInFlight
	}
	if opts.MaxEntries == 0 {
		opts.MaxEntries = DefaultMaxEntries
	}
	if opts.DefaultEntries == 0 {
		opts.DefaultEntries = min(DefaultEntries, opts.MaxEntries)
	}
	if opts.DefaultEntries > opts.MaxEntries {
		return nil, fmt.Errorf("debughttp: %w: DefaultEntries %d above MaxEntries %d", ErrOptions, opts.DefaultEntries, opts.MaxEntries)
	}
	switch opts.SnapshotFormat {
	case "":
		opts.SnapshotFormat = formatJSON
	case formatJSON, formatPickle:
	default:
		return nil, fmt.Errorf("debughttp: %w: SnapshotFormat %q: want %s or %s", ErrOptions, opts.SnapshotFormat, formatJSON, formatPickle)
	}
	return &Handler{opts: opts, slots: make(chan struct{}, opts.MaxInFlight), now: time.Now}, nil
}

// New returns a handler over sources, which must be non-nil, with a
// device each, and have distinct device indexes. Options out of range are
// an error wrapping ErrOptions.
func New(opts Options, sources ...Source) (*Handler, error) {
	if len(sources) == 0 {
		return nil, errors.New("debughttp: New needs at least one source")
	}
	h, err := newHandler(opts)
	if err != nil {
		return nil, err
	}
	var devs []device
	for i, s := range sources {
		if s == nil {
			return nil, fmt.Errorf("debughttp: source %d is nil", i)
		}
		dev := s.Device()
		if dev == nil {
			return nil, fmt.Errorf("debughttp: source %d has no device", i)
		}
		idx := dev.Info().Index
		for _, d := range devs {
			if d.index == idx {
				return nil, fmt.Errorf("debughttp: two sources for device %d", idx)
			}
		}
		devs = append(devs, device{index: idx, src: s})
	}
	slices.SortFunc(devs, func(a, b device) int { return a.index - b.index })
	h.devices = func() []device { return devs }
	return h, nil
}

// ForAllocator returns a handler over one allocator: New(opts, a).
func ForAllocator(a *allocator.Allocator, opts Options) (*Handler, error) {
	if a == nil {
		return nil, errors.New("debughttp: ForAllocator of a nil allocator")
	}
	return New(opts, a)
}

// ForDevices returns a handler over every allocator of d, each under its
// device index. Each request serves the allocators d holds at that
// moment: with a lazy Devices (allocator.NewLazyDevices), the devices
// created so far, none at first (empty pages, "{}" for /debug/stats).
func ForDevices(d *allocator.Devices, opts Options) (*Handler, error) {
	if d == nil {
		return nil, errors.New("debughttp: ForDevices of nil Devices")
	}
	h, err := newHandler(opts)
	if err != nil {
		return nil, err
	}
	h.devices = func() []device {
		all := d.All() // ascending index
		devs := make([]device, len(all))
		for i, a := range all {
			devs[i] = device{index: a.Device().Info().Index, src: a}
		}
		return devs
	}
	return h, nil
}

// params are the query parameters each page accepts.
var params = map[string][]string{
	pathSummary:  {"gpu"},
	pathStats:    {"gpu"},
	pathSnapshot: {"gpu", "format", "entries"},
}

// ServeHTTP serves the page at r.URL.Path: 404 for a path not in Pages,
// 405 for a method other than GET and HEAD, 503 beyond MaxInFlight and
// 400 for a bad query; see the package doc.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	accepted, ok := params[r.URL.Path]
	if !ok {
		http.NotFound(w, r)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		http.Error(w, fmt.Sprintf("method %s not allowed; %s answers GET and HEAD", r.Method, r.URL.Path), http.StatusMethodNotAllowed)
		return
	}
	q, err := query(r.URL.RawQuery, accepted)
	if err != nil {
		http.Error(w, r.URL.Path+": "+err.Error(), http.StatusBadRequest)
		return
	}
	select {
	case h.slots <- struct{}{}:
		defer func() { <-h.slots }()
	default:
		w.Header().Set("Retry-After", "1")
		http.Error(w, fmt.Sprintf("%s: %d debug requests in flight already; retry later", r.URL.Path, cap(h.slots)), http.StatusServiceUnavailable)
		return
	}
	if h.serving != nil {
		h.serving()
	}
	devs, how, code, err := h.selectGPUs(q)
	if err != nil {
		http.Error(w, err.Error(), code)
		return
	}
	switch r.URL.Path {
	case pathSummary:
		h.serveSummary(w, devs)
	case pathStats:
		h.serveStats(w, devs, how)
	case pathSnapshot:
		h.serveSnapshot(w, r, devs, q)
	}
}

// query parses a raw query, refusing a parameter not in accepted, one
// given twice and an unparsable query. It returns one value per key.
func query(raw string, accepted []string) (map[string]string, error) {
	v, err := url.ParseQuery(raw)
	if err != nil {
		return nil, fmt.Errorf("bad query %q: %w", raw, err)
	}
	q := make(map[string]string, len(v))
	for k, vals := range v {
		if !slices.Contains(accepted, k) {
			return nil, fmt.Errorf("unknown parameter %q; this page takes %s", k, strings.Join(accepted, ", "))
		}
		if len(vals) != 1 {
			return nil, fmt.Errorf("parameter %q given %d times; give it once", k, len(vals))
		}
		q[k] = vals[0]
	}
	return q, nil
}

// How a request chose its devices with ?gpu=.
const (
	gpuDefault = iota // no ?gpu: every device
	gpuAll            // ?gpu=all, or a list
	gpuOne            // ?gpu=N: device N
)

// selectGPUs reads ?gpu=: absent or "all" selects every device, N the
// device with index N, "N,M" those devices in ascending index. A malformed
// value is a 400 and an index not served a 404.
func (h *Handler) selectGPUs(q map[string]string) (devs []device, how, code int, err error) {
	served := h.devices()
	v, given := q["gpu"]
	if !given {
		return served, gpuDefault, 0, nil
	}
	if v == "all" {
		return served, gpuAll, 0, nil
	}
	var want []int
	for _, s := range strings.Split(v, ",") {
		i, err := strconv.Atoi(s)
		if err != nil || i < 0 {
			return nil, 0, http.StatusBadRequest, fmt.Errorf("gpu %q: expected a device index (0, 1, …), a list of them (0,1) or all", v)
		}
		if slices.Contains(want, i) {
			return nil, 0, http.StatusBadRequest, fmt.Errorf("gpu %q: device %d listed twice", v, i)
		}
		want = append(want, i)
	}
	for _, d := range served {
		if slices.Contains(want, d.index) {
			devs = append(devs, d)
		}
	}
	if len(devs) != len(want) {
		for _, i := range want {
			if !slices.ContainsFunc(devs, func(d device) bool { return d.index == i }) {
				return nil, 0, http.StatusNotFound, fmt.Errorf("gpu %d: not served here; devices: %v", i, indexes(served))
			}
		}
	}
	how = gpuAll
	if len(want) == 1 && !strings.Contains(v, ",") {
		how = gpuOne
	}
	return devs, how, 0, nil
}

func indexes(devs []device) []int {
	out := make([]int, len(devs))
	for i, d := range devs {
		out[i] = d.index
	}
	return out
}

func setNoStore(w http.ResponseWriter, contentType string) {
	w.Header().Set("Content-Type", contentType)
	w.Header().Set("Cache-Control", "no-store")
}

// serveSummary writes the memory_summary() table of each device, in
// ascending index, separated by a blank line.
func (h *Handler) serveSummary(w http.ResponseWriter, devs []device) {
	var b strings.Builder
	for i, d := range devs {
		if i > 0 {
			b.WriteByte('\n')
		}
		b.WriteString(stats.Summary(d.src.Stats(), d.index))
	}
	setNoStore(w, "text/plain; charset=utf-8")
	h.logErr(w.Write([]byte(b.String())))
}

// serveStats writes one device's flat memory_stats() map (?gpu=N, or the
// only device with no ?gpu), or else an object from each device index to
// its map. encoding/json sorts the keys, as memory_stats() does.
func (h *Handler) serveStats(w http.ResponseWriter, devs []device, how int) {
	var v any
	if how == gpuOne || how == gpuDefault && len(devs) == 1 && !h.opts.StatsByDevice {
		v = h.flat(devs[0])
	} else {
		per := make(map[string]map[string]int64, len(devs))
		for _, d := range devs {
			per[strconv.Itoa(d.index)] = h.flat(d)
		}
		v = per
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	setNoStore(w, "application/json")
	h.logErr(w.Write(append(b, '\n')))
}

// flat returns d's memory_stats() map with Options.StatsExtra's keys.
func (h *Handler) flat(d device) map[string]int64 {
	st := d.src.Stats()
	m := st.Flat()
	if h.opts.StatsExtra != nil {
		for k, v := range h.opts.StatsExtra(d.index) {
			m[k] = v
		}
	}
	return m
}

func (h *Handler) logErr(_ int, err error) {
	if err != nil && h.opts.ErrorLog != nil {
		h.opts.ErrorLog.Printf("debughttp: writing a response: %v", err)
	}
}
