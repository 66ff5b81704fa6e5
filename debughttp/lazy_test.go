package debughttp

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
	"github.com/allocd/allocd/snapshot"
	"github.com/allocd/allocd/trace"
)

// TestLazyDevicesPages serves a lazy Devices as liballocd does: pickle
// snapshots by default, /debug/stats always by device with an extra key,
// and each request seeing the devices created so far: none at first
// (empty pages), then device 1, then devices 0 and 1.
func TestLazyDevicesPages(t *testing.T) {
	d, err := allocator.NewLazyDevices(2, func(i int) (cudart.Device, error) {
		return simdev.New(simdev.Config{Capacity: 1 << 30, Index: i})
	}, allocator.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	h := must(t)(ForDevices(d, Options{
		SnapshotFormat: "pickle",
		StatsByDevice:  true,
		StatsExtra:     func(i int) map[string]int64 { return map[string]int64{"num_bad_frees": int64(10 + i)} },
	}))
	srv := serve(t, h)

	stats := func() map[string]map[string]int64 {
		t.Helper()
		resp, body := get(t, srv.URL+"/debug/stats")
		var m map[string]map[string]int64
		if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &m) != nil {
			t.Fatalf("/debug/stats: %s %.300s", resp.Status, body)
		}
		return m
	}
	snapshot := func() *snapshot.Snapshot {
		t.Helper()
		resp, body := get(t, srv.URL+"/debug/snapshot")
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != "application/octet-stream" {
			t.Fatalf("/debug/snapshot: %s %s", resp.Status, resp.Header.Get("Content-Type"))
		}
		s, err := trace.Read(strings.NewReader(string(body)), trace.ReadOptions{})
		if err != nil {
			t.Fatalf("/debug/snapshot is no pickle: %v", err)
		}
		return s
	}
	if m := stats(); len(m) != 0 {
		t.Errorf("/debug/stats with no device created = %v, want {}", m)
	}
	if _, body := get(t, srv.URL+"/debug/summary"); len(body) != 0 {
		t.Errorf("/debug/summary with no device created = %q", body)
	}
	if s := snapshot(); len(s.Segments) != 0 {
		t.Errorf("snapshot with no device created has %d segments", len(s.Segments))
	}
	if _, err := d.MallocOn(1, 1<<20, cudart.DefaultStream); err != nil {
		t.Fatal(err)
	}
	m := stats()
	if len(m) != 1 || m["1"]["num_bad_frees"] != 11 || m["1"]["allocated_bytes.all.current"] != 1<<20 {
		t.Errorf("/debug/stats with device 1 = %v; want device 1's map by index, with num_bad_frees 11", m)
	}
	if resp, body := get(t, srv.URL+"/debug/stats?gpu=1"); !strings.Contains(string(body), `"num_bad_frees": 11`) {
		t.Errorf("/debug/stats?gpu=1: %s %.200s", resp.Status, body)
	}
	if resp, _ := get(t, srv.URL+"/debug/stats?gpu=0"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("/debug/stats?gpu=0 before device 0 exists: %s, want 404", resp.Status)
	}
	if _, err := d.ForDevice(0); err != nil {
		t.Fatal(err)
	}
	if m := stats(); len(m) != 2 {
		t.Errorf("/debug/stats with two devices has %d maps", len(m))
	}
	if _, body := get(t, srv.URL+"/debug/summary"); strings.Count(string(body), "GPU reserved memory") != 2 {
		t.Errorf("/debug/summary has not two tables:\n%s", body)
	}
	if s := snapshot(); len(s.Segments) != 1 || s.Segments[0].Device != 1 {
		t.Errorf("snapshot segments = %+v, want device 1's one", s.Segments)
	}
	if resp, body := get(t, srv.URL+"/debug/snapshot?format=json"); resp.StatusCode != http.StatusOK || decodeSnapshot(t, body) == nil {
		t.Errorf("?format=json: %s", resp.Status)
	}
}
