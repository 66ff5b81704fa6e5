package debughttp

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/stats"
	"github.com/allocd/allocd/trace"
)

// newDevices returns n Sims (indexes 0..n-1) under one Devices, each with
// history on and a few allocations; device i holds i more than device 0.
func newDevices(t testing.TB, n int, history int) *allocator.Devices {
	t.Helper()
	var devs []cudart.Device
	for i := range n {
		dev, err := simdev.New(simdev.Config{Capacity: 4 << 30, Index: i})
		if err != nil {
			t.Fatal(err)
		}
		devs = append(devs, dev)
	}
	d, err := allocator.NewDevices(devs, allocator.DefaultConfig(), allocator.WithHistory(history))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	for i, a := range d.All() {
		for _, size := range []uint64{4096, 1 << 20, 3 << 20, 64 << 20} {
			if _, err := a.Malloc(size, cudart.DefaultStream); err != nil {
				t.Fatal(err)
			}
		}
		p, err := a.Malloc(8<<20, cudart.DefaultStream)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
		for range i {
			if _, err := a.Malloc(1<<20+1, cudart.DefaultStream); err != nil {
				t.Fatal(err)
			}
		}
	}
	return d
}

// serve starts a loopback server for h.
func serve(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(h)
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

func get(t testing.TB, url string) (*http.Response, []byte) {
	t.Helper()
	return do(t, "GET", url)
}

func do(t testing.TB, method, url string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func must(t testing.TB) func(*Handler, error) *Handler {
	return func(h *Handler, err error) *Handler {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
}

func decodeSnapshot(t testing.TB, body []byte) *snapshot.Snapshot {
	t.Helper()
	var s snapshot.Snapshot
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&s); err != nil {
		t.Fatalf("decoding the snapshot: %v\n%.500s", err, body)
	}
	return &s
}

// TestOneAllocator serves every page over one allocator.
func TestOneAllocator(t *testing.T) {
	a := newDevices(t, 1, 1000).All()[0]
	srv := serve(t, must(t)(ForAllocator(a, Options{})))

	resp, body := get(t, srv.URL+"/debug/summary")
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") || string(body) != stats.Summary(a.Stats(), 0) {
		t.Errorf("/debug/summary = %d %s:\n%s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
	}

	for _, q := range []string{"", "?gpu=0"} {
		resp, body = get(t, srv.URL+"/debug/stats"+q)
		var flat map[string]int64
		if err := json.Unmarshal(body, &flat); err != nil || resp.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("/debug/stats%s: %v %s", q, err, resp.Header.Get("Content-Type"))
		}
		st := a.Stats()
		if !reflect.DeepEqual(flat, st.Flat()) {
			t.Errorf("/debug/stats%s differs from Stats().Flat()", q)
		}
	}
	_, body = get(t, srv.URL+"/debug/stats?gpu=all")
	var per map[string]map[string]int64
	if err := json.Unmarshal(body, &per); err != nil || len(per) != 1 || per["0"]["num_device_alloc"] != a.Stats().NumDeviceAlloc {
		t.Errorf("/debug/stats?gpu=all: %v %.200s", err, body)
	}

	// The JSON snapshot is Snapshot(), rendered from the one model.
	resp, body = get(t, srv.URL+"/debug/snapshot")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("/debug/snapshot = %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	got, want := decodeSnapshot(t, body), a.Snapshot()
	if len(want.DeviceTraces[0]) == 0 || len(want.Segments) != 3 {
		t.Fatalf("fixture: %d segments, %d entries", len(want.Segments), len(want.DeviceTraces[0]))
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("JSON snapshot differs from Snapshot():\n got %+v\nwant %+v", got, want)
	}
	// And encoding/json of the same value decodes to the same thing.
	std, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	if again := decodeSnapshot(t, std); !reflect.DeepEqual(again, got) {
		t.Errorf("streamed JSON and encoding/json's differ")
	}

	// The pickle reads back as the same snapshot.
	resp, body = get(t, srv.URL+"/debug/snapshot?format=pickle")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/octet-stream" {
		t.Fatalf("pickle: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	read, err := trace.Read(bytes.NewReader(body), trace.ReadOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(read.Segments, want.Segments) || !reflect.DeepEqual(read.DeviceTraces, want.DeviceTraces) {
		t.Errorf("pickle reads back as\n%+v\nwant\n%+v", read, want)
	}
	if read.AllocatorSettings["backend"] != "allocd" {
		t.Errorf("pickle allocator_settings = %v", read.AllocatorSettings)
	}

	// HEAD: the headers without a body.
	resp, body = do(t, "HEAD", srv.URL+"/debug/snapshot?format=pickle")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/octet-stream" || len(body) != 0 {
		t.Errorf("HEAD snapshot = %d %s, %d bytes", resp.StatusCode, resp.Header.Get("Content-Type"), len(body))
	}
}

// TestTwoDevices serves every page over a Devices of two.
func TestTwoDevices(t *testing.T) {
	d := newDevices(t, 2, 1000)
	a0, a1 := d.All()[0], d.All()[1]
	srv := serve(t, must(t)(ForDevices(d, Options{})))
	s0, s1 := stats.Summary(a0.Stats(), 0), stats.Summary(a1.Stats(), 1)
	for q, want := range map[string]string{"": s0 + "\n" + s1, "?gpu=all": s0 + "\n" + s1, "?gpu=1": s1, "?gpu=1,0": s0 + "\n" + s1, "?gpu=0": s0} {
		if _, body := get(t, srv.URL+"/debug/summary"+q); string(body) != want {
			t.Errorf("/debug/summary%s:\n%s\nwant:\n%s", q, body, want)
		}
	}
	st0, st1 := a0.Stats(), a1.Stats()
	for _, q := range []string{"", "?gpu=all", "?gpu=0,1"} {
		_, body := get(t, srv.URL+"/debug/stats"+q)
		var per map[string]map[string]int64
		if err := json.Unmarshal(body, &per); err != nil || !reflect.DeepEqual(per, map[string]map[string]int64{"0": st0.Flat(), "1": st1.Flat()}) {
			t.Errorf("/debug/stats%s: %v %.300s", q, err, body)
		}
	}
	_, body := get(t, srv.URL+"/debug/stats?gpu=1")
	var flat map[string]int64
	if err := json.Unmarshal(body, &flat); err != nil || !reflect.DeepEqual(flat, st1.Flat()) {
		t.Errorf("/debug/stats?gpu=1: %v %.300s", err, body)
	}

	_, body = get(t, srv.URL+"/debug/snapshot")
	if got, want := decodeSnapshot(t, body), d.Snapshot(); !reflect.DeepEqual(got, want) {
		t.Errorf("snapshot of both differs from Devices.Snapshot()")
	}
	_, body = get(t, srv.URL+"/debug/snapshot?gpu=1")
	one := decodeSnapshot(t, body)
	if want := snapshot.Merge(a1.Snapshot()); !reflect.DeepEqual(one, want) || len(one.DeviceTraces) != 2 || len(one.DeviceTraces[0]) != 0 {
		t.Errorf("snapshot of gpu 1: %d device traces, want device 1's alone", len(one.DeviceTraces))
	}
	resp, body := get(t, srv.URL+"/debug/snapshot?gpu=1&format=pickle")
	if resp.StatusCode != 200 {
		t.Fatalf("pickle of gpu 1: %d", resp.StatusCode)
	}
	read, err := trace.Read(bytes.NewReader(body), trace.ReadOptions{})
	if err != nil || !reflect.DeepEqual(read.DeviceTraces, one.DeviceTraces) || !reflect.DeepEqual(read.Segments, one.Segments) {
		t.Errorf("pickle of gpu 1 reads back differently: %v", err)
	}
}

// TestBadRequests: each bad query is a 400 (or 404, 405) whose message
// names what was wrong.
func TestBadRequests(t *testing.T) {
	srv := serve(t, must(t)(ForDevices(newDevices(t, 2, 100), Options{})))
	for _, c := range []struct {
		path string
		code int
		says string
	}{
		{"/debug/snapshot?format=json&format=pickle", 400, `"format" given 2 times`},
		{"/debug/snapshot?format=xml", 400, "expected json or pickle"},
		{"/debug/snapshot?format=", 400, "expected json or pickle"},
		{"/debug/snapshot?entries=-1", 400, "entries"},
		{"/debug/snapshot?entries=x", 400, "entries"},
		{"/debug/snapshot?entries=1000001", 400, "0 to 1000000"},
		{"/debug/snapshot?entries=1&entries=2", 400, `"entries" given 2 times`},
		{"/debug/snapshot?pretty=1", 400, `unknown parameter "pretty"; this page takes gpu, format, entries`},
		{"/debug/stats?format=json", 400, `unknown parameter "format"; this page takes gpu`},
		{"/debug/summary?gpu=0&gpu=1", 400, `"gpu" given 2 times`},
		{"/debug/stats?gpu=", 400, "gpu"},
		{"/debug/stats?gpu=-1", 400, "gpu"},
		{"/debug/stats?gpu=x", 400, "gpu"},
		{"/debug/stats?gpu=0,0", 400, "listed twice"},
		{"/debug/stats?gpu=0,", 400, "gpu"},
		{"/debug/stats?gpu=2", 404, "gpu 2: not served here; devices: [0 1]"},
		{"/debug/snapshot?gpu=0,2", 404, "gpu 2"},
		{"/debug/summary?%zz", 400, "bad query"},
		{"/debug/", 404, ""},
		{"/debug/pprof/", 404, ""},
	} {
		resp, body := get(t, srv.URL+c.path)
		if resp.StatusCode != c.code || !strings.Contains(string(body), c.says) {
			t.Errorf("GET %s = %d %q, want %d saying %q", c.path, resp.StatusCode, body, c.code, c.says)
		}
	}
	resp, _ := do(t, "POST", srv.URL+"/debug/snapshot")
	if resp.StatusCode != 405 || resp.Header.Get("Allow") != "GET, HEAD" {
		t.Errorf("POST = %d, Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
}

// TestInFlightLimit holds MaxInFlight requests inside the handler and
// finds the next one refused with 503 and Retry-After, then served once
// a slot is free.
func TestInFlightLimit(t *testing.T) {
	h := must(t)(ForDevices(newDevices(t, 1, 100), Options{MaxInFlight: 2}))
	entered := make(chan struct{})
	release := make(chan struct{})
	var block sync.Mutex
	blocking := true
	h.serving = func() {
		block.Lock()
		b := blocking
		block.Unlock()
		if b {
			entered <- struct{}{}
			<-release
		}
	}
	srv := serve(t, h)
	var wg sync.WaitGroup
	codes := make([]int, 2)
	for i := range 2 {
		wg.Go(func() {
			// /debug/stats, not /debug/snapshot: two snapshots released
			// together may be paced (one is built at a time), which is not
			// what this test is about.
			resp, err := http.Get(srv.URL + "/debug/stats")
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes[i] = resp.StatusCode
		})
	}
	<-entered
	<-entered
	for _, path := range []string{"/debug/snapshot", "/debug/stats", "/debug/summary"} {
		resp, body := get(t, srv.URL+path)
		if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" || !strings.Contains(string(body), "2 debug requests in flight") {
			t.Errorf("%s with 2 in flight = %d, Retry-After %q, %q; want 503", path, resp.StatusCode, resp.Header.Get("Retry-After"), body)
		}
	}
	block.Lock()
	blocking = false
	block.Unlock()
	close(release)
	wg.Wait()
	if codes[0] != 200 || codes[1] != 200 {
		t.Errorf("held requests answered %v, want 200s", codes)
	}
	if resp, _ := get(t, srv.URL+"/debug/snapshot"); resp.StatusCode != 200 {
		t.Errorf("after release = %d, want 200", resp.StatusCode)
	}
}

// TestEntriesCap: ?entries=N keeps the N most recent entries of each
// device's trace, and the default applies without it.
func TestEntriesCap(t *testing.T) {
	d := newDevices(t, 2, 1000)
	srv := serve(t, must(t)(ForDevices(d, Options{DefaultEntries: 3, MaxEntries: 50})))
	full := d.Snapshot()
	for q, n := range map[string]int{"": 3, "?entries=5": 5, "?entries=0": 0, "?entries=50": 50, "?entries=2&format=pickle": 2} {
		_, body := get(t, srv.URL+"/debug/snapshot"+q)
		var got *snapshot.Snapshot
		if strings.Contains(q, "pickle") {
			var err error
			if got, err = trace.Read(bytes.NewReader(body), trace.ReadOptions{}); err != nil {
				t.Fatal(err)
			}
		} else {
			got = decodeSnapshot(t, body)
		}
		if len(got.DeviceTraces) != 2 || !reflect.DeepEqual(got.Segments, full.Segments) {
			t.Fatalf("?%s: %d traces", q, len(got.DeviceTraces))
		}
		for dev, tr := range full.DeviceTraces {
			want := tr[max(len(tr)-n, 0):]
			if len(got.DeviceTraces[dev]) != len(want) || len(want) > 0 && !reflect.DeepEqual(got.DeviceTraces[dev], want) {
				t.Errorf("%q: device %d has %d entries, want the last %d of %d", q, dev, len(got.DeviceTraces[dev]), len(want), len(tr))
			}
		}
	}
	if resp, body := get(t, srv.URL+"/debug/snapshot?entries=51"); resp.StatusCode != 400 || !strings.Contains(string(body), "0 to 50") {
		t.Errorf("entries=51 = %d %q", resp.StatusCode, body)
	}
}

// TestCapMerge: the cap applies to the concatenation when two snapshots
// share a trace index.
func TestCapMerge(t *testing.T) {
	e := func(i int) snapshot.Entry { return snapshot.Entry{Action: snapshot.ActionAlloc, Addr: uint64(i)} }
	a := &snapshot.Snapshot{DeviceTraces: [][]snapshot.Entry{{e(1), e(2), e(3)}}}
	b := &snapshot.Snapshot{DeviceTraces: [][]snapshot.Entry{{e(4), e(5)}, {e(6)}}}
	got := capMerge([]*snapshot.Snapshot{a, b}, 3)
	want := [][]snapshot.Entry{{e(3), e(4), e(5)}, {e(6)}}
	if !reflect.DeepEqual(got.DeviceTraces, want) {
		t.Errorf("capMerge = %v, want %v", got.DeviceTraces, want)
	}
	if m := snapshot.Merge(a, b); !reflect.DeepEqual(capMerge([]*snapshot.Snapshot{a, b}, 10).DeviceTraces, m.DeviceTraces) {
		t.Errorf("uncapped capMerge differs from snapshot.Merge")
	}
}

// TestMaxBodyBytes: a snapshot over the cap is a 413 when nothing was sent
// yet, and an aborted response (a client error) when it was.
func TestMaxBodyBytes(t *testing.T) {
	d := newDevices(t, 1, 200_000)
	a := d.All()[0]
	for i := range 60_000 { // 120,000 entries: a JSON body of several MiB
		p, err := a.Malloc(uint64(512+i%4096), cudart.DefaultStream)
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	srv := serve(t, must(t)(ForDevices(d, Options{MaxBodyBytes: 1 << 20, LockShare: 1})))
	if resp, body := get(t, srv.URL+"/debug/snapshot?entries=10"); resp.StatusCode != 200 {
		t.Errorf("small snapshot = %d %q", resp.StatusCode, body)
	}
	srv2 := serve(t, must(t)(ForDevices(d, Options{MaxBodyBytes: 1000, LockShare: 1})))
	if resp, body := get(t, srv2.URL+"/debug/snapshot?entries=1000"); resp.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(string(body), "1000-byte limit") {
		t.Errorf("snapshot over 1000 bytes = %d %q, want 413", resp.StatusCode, body)
	}
	for _, f := range []string{"json", "pickle"} {
		resp, err := http.Get(srv.URL + "/debug/snapshot?format=" + f)
		if err != nil {
			t.Fatal(err)
		}
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil {
			t.Errorf("%s snapshot over 1 MiB read without error (status %d)", f, resp.StatusCode)
		}
	}
}

func TestNewErrors(t *testing.T) {
	a := newDevices(t, 1, 0).All()[0]
	for name, o := range map[string]Options{
		"negative in flight":  {MaxInFlight: -1},
		"negative entries":    {DefaultEntries: -1},
		"default above max":   {DefaultEntries: 11, MaxEntries: 10},
		"negative body bytes": {MaxBodyBytes: -5},
		"lock share above 1":  {LockShare: 1.5},
		"negative lock share": {LockShare: -0.1},
		"NaN lock share":      {LockShare: math.NaN()},
		"unknown format":      {SnapshotFormat: "xml"},
	} {
		if _, err := New(o, a); !errors.Is(err, ErrOptions) {
			t.Errorf("%s: New = %v, want ErrOptions", name, err)
		}
	}
	if _, err := New(Options{}); err == nil {
		t.Error("New without sources succeeded")
	}
	if _, err := New(Options{}, a, a); err == nil || !strings.Contains(err.Error(), "two sources for device 0") {
		t.Errorf("New with a duplicate device = %v", err)
	}
	if _, err := New(Options{}, nil); err == nil {
		t.Error("New with a nil source succeeded")
	}
	if h, err := New(Options{MaxEntries: 10}, a); err != nil || h.opts.DefaultEntries != 10 {
		t.Errorf("MaxEntries 10 alone: %v, default entries %v", err, h)
	}
}

// TestConcurrentSnapshots fetches snapshots while the allocator works;
// run with -race.
func TestConcurrentSnapshots(t *testing.T) {
	d := newDevices(t, 2, 10_000)
	srv := serve(t, must(t)(ForDevices(d, Options{})))
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, a := range d.All() {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				p, err := a.Malloc(uint64(512+i*4099%(8<<20)), cudart.DefaultStream)
				if err != nil {
					t.Error(err)
					return
				}
				if err := a.Free(p); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	var clients sync.WaitGroup
	for c := range 3 {
		clients.Go(func() {
			for i := range 5 {
				url := fmt.Sprintf("%s/debug/snapshot?gpu=%d&format=%s", srv.URL, (c+i)%2, []string{"json", "pickle"}[i%2])
				resp, err := http.Get(url)
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 && resp.StatusCode != 503 {
					t.Errorf("%s = %d", url, resp.StatusCode)
				}
			}
		})
	}
	clients.Wait()
	close(stop)
	wg.Wait()
}

// fakeClock is a clock that moves only when told.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// slowSource is an allocator whose Snapshot takes a second of a fake clock.
type slowSource struct {
	*allocator.Allocator
	clock *fakeClock
}

func (s slowSource) Snapshot() *snapshot.Snapshot {
	s.clock.add(time.Second)
	return s.Allocator.Snapshot()
}

// TestLockShare: after a build of 1 s, the next may start only 9 s later
// with the default share of 10% (less the burst allowance).
func TestLockShare(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1000, 0)}
	a := newDevices(t, 1, 100).All()[0]
	h := must(t)(New(Options{}, slowSource{a, clock}))
	h.now = clock.now
	srv := serve(t, h)
	if resp, _ := get(t, srv.URL+"/debug/snapshot"); resp.StatusCode != 200 {
		t.Fatalf("first snapshot = %d", resp.StatusCode)
	}
	resp, body := get(t, srv.URL+"/debug/snapshot?format=pickle")
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "9" || resp.Header.Get("Content-Disposition") != "" ||
		!strings.Contains(string(body), "at most 0.1 of the time; retry in 8.9s") {
		t.Errorf("snapshot right after = %d, Retry-After %q, %q; want 503 and 9", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if resp, _ := get(t, srv.URL+"/debug/stats"); resp.StatusCode != 200 {
		t.Errorf("/debug/stats while snapshots wait = %d, want 200", resp.StatusCode)
	}
	clock.add(8*time.Second + 950*time.Millisecond)
	if resp, _ := get(t, srv.URL+"/debug/snapshot"); resp.StatusCode != 200 {
		t.Errorf("snapshot 8.95 s later = %d, want 200", resp.StatusCode)
	}
}

// FuzzRequest sends arbitrary paths and queries, by any method, straight
// to the handler (no network): it never panics, answers with a status the
// pages document (200, 400, 404, 405, 503) and, for a 200 JSON page,
// writes valid JSON.
func FuzzRequest(f *testing.F) {
	for _, s := range []string{
		"/debug/snapshot?gpu=1&format=pickle&entries=3", "/debug/stats", "/debug/summary?gpu=all",
		"/debug/stats?gpu=0,1", "/debug/snapshot?entries=-1", "/debug/summary?%zz", "/debug/", "/metrics",
		"/debug/snapshot?format=json&format=pickle", "/debug/stats?gpu=99999999999999999999",
	} {
		f.Add("GET", s)
	}
	f.Add("HEAD", "/debug/snapshot")
	f.Add("POST", "/debug/stats")
	h := must(f)(ForDevices(newDevices(f, 2, 100), Options{}))
	f.Fuzz(func(t *testing.T, method, target string) {
		if !strings.HasPrefix(target, "/") {
			target = "/" + target
		}
		req, err := http.NewRequest(method, "http://127.0.0.1"+target, nil)
		if err != nil {
			return // not a request a client could send
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		switch rec.Code {
		case 200, 400, 404, 405, 503:
		default:
			t.Fatalf("%s %s = %d %q", method, target, rec.Code, rec.Body.String())
		}
		if rec.Code == 200 && method == http.MethodGet && strings.HasPrefix(rec.Header().Get("Content-Type"), "application/json") && !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("%s %s wrote invalid JSON: %.200q", method, target, rec.Body.String())
		}
	})
}
