package stats

import (
	"fmt"
	"io"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

const simUUID = "SIM-00000000-0000-0000-0000-000000000000"

// The state scripted leaves: three live allocations (3 MiB large, 1 KiB and
// 700.5 KiB small) in one 20 MiB and one 2 MiB segment; 5 device mallocs,
// 3 device frees, 2 retries, 1 OOM, 1 empty cache.
const goldenExposition = `
# HELP allocd_allocated_bytes Bytes of live allocations (rounded sizes), as torch.cuda.memory_allocated().
# TYPE allocd_allocated_bytes gauge
allocd_allocated_bytes{UUID="` + simUUID + `",gpu="0",pool="large"} 3.145728e+06
allocd_allocated_bytes{UUID="` + simUUID + `",gpu="0",pool="small"} 718336
# HELP allocd_reserved_bytes Bytes of segments held from the device, as torch.cuda.memory_reserved().
# TYPE allocd_reserved_bytes gauge
allocd_reserved_bytes{UUID="` + simUUID + `",gpu="0",pool="large"} 2.097152e+07
allocd_reserved_bytes{UUID="` + simUUID + `",gpu="0",pool="small"} 2.097152e+06
# HELP allocd_requested_bytes Bytes callers asked for in live allocations, before rounding.
# TYPE allocd_requested_bytes gauge
allocd_requested_bytes{UUID="` + simUUID + `",gpu="0",pool="large"} 3.145728e+06
allocd_requested_bytes{UUID="` + simUUID + `",gpu="0",pool="small"} 717801
# HELP allocd_segments Segments (device allocations) held.
# TYPE allocd_segments gauge
allocd_segments{UUID="` + simUUID + `",gpu="0",pool="large"} 1
allocd_segments{UUID="` + simUUID + `",gpu="0",pool="small"} 1
# HELP allocd_allocations_total Allocations handed out (Malloc calls that returned memory).
# TYPE allocd_allocations_total counter
allocd_allocations_total{UUID="` + simUUID + `",gpu="0",pool="large"} 5
allocd_allocations_total{UUID="` + simUUID + `",gpu="0",pool="small"} 3
# HELP allocd_peak_allocated_bytes Peak of allocated bytes over all pools since start or the last peak reset, as torch.cuda.max_memory_allocated().
# TYPE allocd_peak_allocated_bytes gauge
allocd_peak_allocated_bytes{UUID="` + simUUID + `",gpu="0"} 9.47582464e+08
# HELP allocd_peak_reserved_bytes Peak of reserved bytes over all pools since start or the last peak reset, as torch.cuda.max_memory_reserved().
# TYPE allocd_peak_reserved_bytes gauge
allocd_peak_reserved_bytes{UUID="` + simUUID + `",gpu="0"} 9.66787072e+08
# HELP allocd_largest_free_block_bytes Size of the largest cached free block: the biggest request served without a device malloc.
# TYPE allocd_largest_free_block_bytes gauge
allocd_largest_free_block_bytes{UUID="` + simUUID + `",gpu="0"} 1.4680064e+07
# HELP allocd_device_mallocs_total Device malloc calls that returned a segment (cudaMalloc).
# TYPE allocd_device_mallocs_total counter
allocd_device_mallocs_total{UUID="` + simUUID + `",gpu="0"} 5
# HELP allocd_device_frees_total Device free calls (cudaFree).
# TYPE allocd_device_frees_total counter
allocd_device_frees_total{UUID="` + simUUID + `",gpu="0"} 3
# HELP allocd_alloc_retries_total Mallocs that released the cache and asked the device again after it said no.
# TYPE allocd_alloc_retries_total counter
allocd_alloc_retries_total{UUID="` + simUUID + `",gpu="0"} 2
# HELP allocd_ooms_total Mallocs that failed with an out-of-memory error.
# TYPE allocd_ooms_total counter
allocd_ooms_total{UUID="` + simUUID + `",gpu="0"} 1
# HELP allocd_empty_cache_total EmptyCache calls, as torch.cuda.empty_cache().
# TYPE allocd_empty_cache_total counter
allocd_empty_cache_total{UUID="` + simUUID + `",gpu="0"} 1
# HELP allocd_device_free_bytes Free device memory as the device reports it (cudaMemGetInfo), all processes counted.
# TYPE allocd_device_free_bytes gauge
allocd_device_free_bytes{UUID="` + simUUID + `",gpu="0"} 1.050673152e+09
# HELP allocd_device_total_bytes Total device memory (cudaMemGetInfo).
# TYPE allocd_device_total_bytes gauge
allocd_device_total_bytes{UUID="` + simUUID + `",gpu="0"} 1.073741824e+09
# HELP allocd_device_info Constant 1, labelled with the device's index, UUID and name.
# TYPE allocd_device_info gauge
allocd_device_info{UUID="` + simUUID + `",gpu="0",model_name="sim"} 1
`

func newCollector(t testing.TB, srcs ...Source) *Collector {
	t.Helper()
	c, err := NewCollector(srcs...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestCollectorExposition(t *testing.T) {
	c := newCollector(t, scripted(t))
	names := []string{
		"allocd_allocated_bytes", "allocd_reserved_bytes", "allocd_requested_bytes", "allocd_segments",
		"allocd_allocations_total", "allocd_peak_allocated_bytes", "allocd_peak_reserved_bytes",
		"allocd_largest_free_block_bytes", "allocd_device_mallocs_total", "allocd_device_frees_total",
		"allocd_alloc_retries_total", "allocd_ooms_total", "allocd_empty_cache_total",
		"allocd_device_free_bytes", "allocd_device_total_bytes", "allocd_device_info",
	}
	if err := testutil.CollectAndCompare(c, strings.NewReader(goldenExposition), names...); err != nil {
		t.Error(err)
	}
}

func TestCollectorLint(t *testing.T) {
	c := newCollector(t, scripted(t))
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	problems, err = testutil.CollectAndLint(BuildInfo("v1.2.3"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

// TestCollectorDescribesWhatItCollects registers with a pedantic registry,
// which checks every collected metric against the described ones, and
// checks that Metrics lists exactly what is collected.
func TestCollectorDescribesWhatItCollects(t *testing.T) {
	c := newCollector(t, scripted(t))
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, mf := range mfs {
		got[mf.GetName()] = strings.ToLower(mf.GetType().String())
	}
	if len(got) != len(Metrics()) {
		t.Errorf("collected %d metric families, Metrics lists %d", len(got), len(Metrics()))
	}
	for _, m := range Metrics() {
		if got[m.Name] != m.Type {
			t.Errorf("%s: collected as %q, listed as %q", m.Name, got[m.Name], m.Type)
		}
	}
	if n := testutil.CollectAndCount(c, "allocd_allocated_bytes"); n != 2 {
		t.Errorf("allocd_allocated_bytes has %d series, want one per pool", n)
	}
}

// TestCollectorHistogramCountsDeviceMallocs checks the histogram against
// the allocator's own count of device mallocs.
func TestCollectorHistogramCountsDeviceMallocs(t *testing.T) {
	a := scripted(t)
	c := newCollector(t, a)
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	st := a.Stats()
	for _, mf := range mfs {
		if mf.GetName() != "allocd_device_malloc_duration_seconds" {
			continue
		}
		h := mf.GetMetric()[0].GetHistogram()
		if h.GetSampleCount() != uint64(st.NumDeviceAlloc) || st.NumDeviceAlloc == 0 {
			t.Errorf("histogram count %d, device mallocs %d", h.GetSampleCount(), st.NumDeviceAlloc)
		}
		if len(h.GetBucket()) != len(allocator.DeviceMallocBuckets) {
			t.Errorf("%d buckets, want %d", len(h.GetBucket()), len(allocator.DeviceMallocBuckets))
		}
		if h.GetSampleSum() <= 0 {
			t.Errorf("histogram sum %g, want > 0", h.GetSampleSum())
		}
		return
	}
	t.Fatal("no allocd_device_malloc_duration_seconds")
}

// fakeSource serves fixed statistics for a device.
type fakeSource struct {
	st  allocator.Stats
	dev cudart.Device
}

func (f *fakeSource) Stats() allocator.Stats { return f.st }
func (f *fakeSource) Device() cudart.Device  { return f.dev }

// brokenDevice is a Sim whose MemGetInfo fails.
type brokenDevice struct{ *simdev.Sim }

func (brokenDevice) MemGetInfo() (uint64, uint64, error) {
	return 0, 0, fmt.Errorf("sim: %w", cudart.ErrClosed)
}

func newSim(t testing.TB, index int) *simdev.Sim {
	t.Helper()
	s, err := simdev.New(simdev.Config{Capacity: 80 << 30, Index: index, Name: "NVIDIA H200"})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestCollectorHistogramBuckets converts a known histogram: per-bucket
// counts become cumulative, and the overflow count shows only in +Inf.
func TestCollectorHistogramBuckets(t *testing.T) {
	src := &fakeSource{dev: newSim(t, 3)}
	h := &src.st.DeviceMallocLatency
	h.Counts = [len(allocator.DeviceMallocBuckets) + 1]uint64{0, 2, 5, 1, 0, 0, 0, 0, 1, 0, 3}
	h.Count, h.Sum = 12, 0.5
	c := newCollector(t, src)
	uuid := "SIM-00000003-0000-0000-0000-000000000000"
	want := `
# HELP allocd_device_malloc_duration_seconds Time spent in each successful device malloc (the allocator's slow path).
# TYPE allocd_device_malloc_duration_seconds histogram
`
	cum := []int{0, 2, 7, 8, 8, 8, 8, 8, 9, 9}
	for i, le := range []string{"1e-05", "2.5e-05", "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.01", "0.05"} {
		want += fmt.Sprintf("allocd_device_malloc_duration_seconds_bucket{UUID=%q,gpu=\"3\",le=%q} %d\n", uuid, le, cum[i])
	}
	want += fmt.Sprintf(`allocd_device_malloc_duration_seconds_bucket{UUID=%[1]q,gpu="3",le="+Inf"} 12
allocd_device_malloc_duration_seconds_sum{UUID=%[1]q,gpu="3"} 0.5
allocd_device_malloc_duration_seconds_count{UUID=%[1]q,gpu="3"} 12
`, uuid)
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "allocd_device_malloc_duration_seconds"); err != nil {
		t.Error(err)
	}
}

func TestCollectorSeveralGPUs(t *testing.T) {
	s0 := &fakeSource{dev: newSim(t, 0)}
	s1 := &fakeSource{dev: newSim(t, 1)}
	s0.st.ReservedBytes[allocator.PoolLarge].Current = 20 << 20
	s1.st.ReservedBytes[allocator.PoolSmall].Current = 2 << 20
	c := newCollector(t, s0, s1)
	want := `
# HELP allocd_reserved_bytes Bytes of segments held from the device, as torch.cuda.memory_reserved().
# TYPE allocd_reserved_bytes gauge
allocd_reserved_bytes{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",pool="large"} 2.097152e+07
allocd_reserved_bytes{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",pool="small"} 0
allocd_reserved_bytes{UUID="SIM-00000001-0000-0000-0000-000000000000",gpu="1",pool="large"} 0
allocd_reserved_bytes{UUID="SIM-00000001-0000-0000-0000-000000000000",gpu="1",pool="small"} 2.097152e+06
# HELP allocd_device_info Constant 1, labelled with the device's index, UUID and name.
# TYPE allocd_device_info gauge
allocd_device_info{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",model_name="NVIDIA H200"} 1
allocd_device_info{UUID="SIM-00000001-0000-0000-0000-000000000000",gpu="1",model_name="NVIDIA H200"} 1
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "allocd_reserved_bytes", "allocd_device_info"); err != nil {
		t.Error(err)
	}
}

func TestNewCollectorErrors(t *testing.T) {
	dup := newSim(t, 2)
	for name, srcs := range map[string][]Source{
		"none":      nil,
		"nil":       {nil},
		"no device": {&fakeSource{}},
		"duplicate": {&fakeSource{dev: dup}, &fakeSource{dev: newSim(t, 2)}},
	} {
		if c, err := NewCollector(srcs...); err == nil {
			t.Errorf("%s: NewCollector = %v, want an error", name, c)
		}
	}
}

// TestCollectorDeviceError: a device that cannot report its memory fails
// the two device gauges (the registry reports the error) and nothing else.
func TestCollectorDeviceError(t *testing.T) {
	src := &fakeSource{dev: brokenDevice{newSim(t, 0)}}
	src.st.NumOOMs = 4
	reg := prometheus.NewRegistry()
	reg.MustRegister(newCollector(t, src))
	mfs, err := reg.Gather()
	if err == nil || !strings.Contains(err.Error(), "gpu 0: reading device memory") {
		t.Fatalf("Gather error = %v, want the device's failure", err)
	}
	found := false
	for _, mf := range mfs {
		switch mf.GetName() {
		case "allocd_device_free_bytes", "allocd_device_total_bytes":
			t.Errorf("%s collected from a failing device", mf.GetName())
		case "allocd_ooms_total":
			found = mf.GetMetric()[0].GetCounter().GetValue() == 4
		}
	}
	if !found {
		t.Error("allocd_ooms_total missing or wrong beside the failing device gauges")
	}
}

// TestCollectorConcurrentScrapes scrapes over HTTP while goroutines use
// the allocator; run with -race.
func TestCollectorConcurrentScrapes(t *testing.T) {
	a := scripted(t)
	reg := prometheus.NewRegistry()
	reg.MustRegister(newCollector(t, a))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{EnableOpenMetrics: true}))
	defer srv.Close()
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := range 2 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				p, err := a.Malloc(uint64(512+(i*4099+g*77)%(8<<20)), cudart.DefaultStream)
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
	for range 20 {
		resp, err := srv.Client().Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		problems, err := lintResponse(resp.Body)
		resp.Body.Close()
		if err != nil || len(problems) > 0 {
			t.Fatalf("scrape: %v %v", err, problems)
		}
	}
	close(stop)
	wg.Wait()
}

// BenchmarkCollect measures one scrape's collection: one Stats copy, one
// MemGetInfo and the const metrics, without encoding.
func BenchmarkCollect(b *testing.B) {
	c := newCollector(b, scripted(b))
	ch := make(chan prometheus.Metric, 128)
	b.ReportAllocs()
	for b.Loop() {
		c.Collect(ch)
		for len(ch) > 0 {
			<-ch
		}
	}
}

// BenchmarkScrape measures a whole scrape through promhttp: gather and
// encode the text exposition.
func BenchmarkScrape(b *testing.B) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(newCollector(b, scripted(b)))
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	req := httptest.NewRequest("GET", "/metrics", nil)
	b.ReportAllocs()
	for b.Loop() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != 200 {
			b.Fatal(w.Code)
		}
	}
}

// lintResponse lints a text exposition with promlint.
func lintResponse(r io.Reader) ([]promlint.Problem, error) {
	return promlint.New(r).Lint()
}

// TestNewDevicesCollector labels each allocator of a Devices with its
// device index.
func TestNewDevicesCollector(t *testing.T) {
	d, err := allocator.NewDevices([]cudart.Device{newSim(t, 1), newSim(t, 0)}, allocator.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.MallocOn(1, 3<<20, cudart.DefaultStream); err != nil {
		t.Fatal(err)
	}
	c, err := NewDevicesCollector(d)
	if err != nil {
		t.Fatal(err)
	}
	want := `
# HELP allocd_live_allocations Allocations handed out and not yet freed.
# TYPE allocd_live_allocations gauge
allocd_live_allocations{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",pool="large"} 0
allocd_live_allocations{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",pool="small"} 0
allocd_live_allocations{UUID="SIM-00000001-0000-0000-0000-000000000000",gpu="1",pool="large"} 1
allocd_live_allocations{UUID="SIM-00000001-0000-0000-0000-000000000000",gpu="1",pool="small"} 0
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "allocd_live_allocations"); err != nil {
		t.Error(err)
	}
	if _, err := NewDevicesCollector(nil); err == nil {
		t.Error("NewDevicesCollector(nil) succeeded")
	}
}

// TestCollectorVMMCalls exports expandable segments' virtual memory calls
// from Stats.VMM: the handle counts, the runs revived and the waits as
// they are, and the calls' times in seconds (create, map, unmap and
// release together; the ordering calls apart).
func TestCollectorVMMCalls(t *testing.T) {
	src := &fakeSource{dev: newSim(t, 0)}
	src.st.VMM = allocator.VMMCalls{
		Creates: 7, Maps: 9, Unmaps: 4, Releases: 3, Revived: 5, Waits: 2,
		CreateTime: 100 * time.Microsecond, MapTime: 250 * time.Microsecond,
		UnmapTime: 120 * time.Microsecond, ReleaseTime: 30 * time.Microsecond,
		SyncTime: 1500 * time.Microsecond,
	}
	label := `{UUID="` + simUUID + `",gpu="0"}`
	want := `
# HELP allocd_expandable_handles_created_total Physical-memory handles that expandable segments created (cuMemCreate): growth that the handle cache could not serve.
# TYPE allocd_expandable_handles_created_total counter
allocd_expandable_handles_created_total` + label + ` 7
# HELP allocd_expandable_handles_released_total Physical-memory handles that expandable segments released (cuMemRelease): runs that a reclaim took and the growing pool cannot map, and memory EmptyCache, the out-of-memory path or a cap gave back.
# TYPE allocd_expandable_handles_released_total counter
allocd_expandable_handles_released_total` + label + ` 3
# HELP allocd_expandable_runs_revived_total Runs that a growth took back from a standby mapping at its own place, with no device call.
# TYPE allocd_expandable_runs_revived_total counter
allocd_expandable_runs_revived_total` + label + ` 5
# HELP allocd_expandable_reclaim_waits_total Times reclaim waited for a stream's queued work before unmapping memory or handing it to another stream (a stream or an event synchronised).
# TYPE allocd_expandable_reclaim_waits_total counter
allocd_expandable_reclaim_waits_total` + label + ` 2
# HELP allocd_expandable_vmm_seconds_total Time in the driver's virtual-memory calls of expandable segments: creating, mapping (access grants included), unmapping and releasing physical memory.
# TYPE allocd_expandable_vmm_seconds_total counter
allocd_expandable_vmm_seconds_total` + label + ` 0.0005
# HELP allocd_expandable_sync_seconds_total Time reclaim spent ordering memory against queued work: events created, recorded, queried, synchronised and destroyed, and streams synchronised, waits included.
# TYPE allocd_expandable_sync_seconds_total counter
allocd_expandable_sync_seconds_total` + label + ` 0.0015
`
	err := testutil.CollectAndCompare(newCollector(t, src), strings.NewReader(want),
		"allocd_expandable_handles_created_total", "allocd_expandable_handles_released_total",
		"allocd_expandable_runs_revived_total", "allocd_expandable_reclaim_waits_total",
		"allocd_expandable_vmm_seconds_total", "allocd_expandable_sync_seconds_total")
	if err != nil {
		t.Error(err)
	}
}
