package stats

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allocd/allocd/pinned"
)

// PinnedSource is what the PinnedCollector reads: a pinned host
// allocator's statistics and the device whose streams order its reuse.
// *pinned.Allocator implements it.
type PinnedSource interface {
	// Stats returns a consistent copy of the statistics.
	Stats() pinned.Stats
	// Device returns the allocator's device.
	Device() pinned.Device
}

var _ PinnedSource = (*pinned.Allocator)(nil)

// pinnedMetric is one metric of the host pool: its facts and its value.
type pinnedMetric struct {
	MetricInfo
	value func(*pinned.Stats) float64
}

func pinnedGauge(name, help, torch string, f func(*pinned.Stats) int64) pinnedMetric {
	return pinnedMetric{MetricInfo{Name: Namespace + "_pinned_" + name, Type: "gauge", Help: help, Labels: deviceLabels, PyTorch: torch, vtype: prometheus.GaugeValue},
		func(s *pinned.Stats) float64 { return float64(f(s)) }}
}

func pinnedCounter(name, help, torch string, f func(*pinned.Stats) float64) pinnedMetric {
	return pinnedMetric{MetricInfo{Name: Namespace + "_pinned_" + name, Type: "counter", Help: help, Labels: deviceLabels, PyTorch: torch, vtype: prometheus.CounterValue}, f}
}

// pinnedMetrics is every metric of the PinnedCollector, in exposition order.
var pinnedMetrics = []pinnedMetric{
	pinnedGauge("allocated_bytes", "Bytes of pinned host blocks in use: handed out, or freed and awaiting a stream's event (class sizes).",
		"allocated_bytes.current", func(s *pinned.Stats) int64 { return s.AllocatedBytes.Current }),
	pinnedGauge("reserved_bytes", "Bytes of pinned host memory held from the system (cudaHostAlloc), in use or cached.",
		"reserved_bytes.current", func(s *pinned.Stats) int64 { return s.ReservedBytes.Current }),
	pinnedGauge("requested_bytes", "Bytes callers asked for in live pinned buffers, before rounding to the size class.",
		"", func(s *pinned.Stats) int64 { return s.RequestedBytes.Current }),
	pinnedGauge("cached_bytes", "Bytes of free pinned blocks, ready for reuse and released by EmptyCache.",
		"", func(s *pinned.Stats) int64 { return s.CachedBytes }),
	pinnedGauge("live_allocations", "Pinned blocks in use: handed out, or freed and awaiting a stream's event.",
		"allocation.current", func(s *pinned.Stats) int64 { return s.Allocation.Current }),
	pinnedGauge("segments", "Pinned blocks held from the system (cudaHostAlloc).",
		"segment.current", func(s *pinned.Stats) int64 { return s.Segment.Current }),
	pinnedGauge("pending_events", "Events recorded at Free on streams that used a pinned block, not yet seen complete.",
		"", func(s *pinned.Stats) int64 { return int64(s.PendingEvents) }),
	pinnedGauge("peak_allocated_bytes", "Peak of pinned allocated bytes since start or the last peak reset.",
		"allocated_bytes.peak", func(s *pinned.Stats) int64 { return s.AllocatedBytes.Peak }),
	pinnedGauge("peak_reserved_bytes", "Peak of pinned reserved bytes since start or the last peak reset.",
		"reserved_bytes.peak", func(s *pinned.Stats) int64 { return s.ReservedBytes.Peak }),
	pinnedCounter("allocations_total", "Pinned buffers handed out (from the cache or new).",
		"allocation.allocated", func(s *pinned.Stats) float64 { return float64(s.Allocation.Allocated) }),
	pinnedCounter("host_allocs_total", "cudaHostAlloc calls that returned memory: requests the cache could not serve.",
		"num_host_alloc", func(s *pinned.Stats) float64 { return float64(s.NumHostAlloc) }),
	pinnedCounter("host_frees_total", "cudaFreeHost calls (EmptyCache, Close, the out-of-memory retry).",
		"num_host_free", func(s *pinned.Stats) float64 { return float64(s.NumHostFree) }),
	pinnedCounter("host_alloc_seconds_total", "Time spent in cudaHostAlloc.",
		"host_alloc_time.total", func(s *pinned.Stats) float64 { return float64(s.HostAllocTime.Total) / 1e6 }),
	pinnedCounter("host_free_seconds_total", "Time spent in cudaFreeHost.",
		"host_free_time.total", func(s *pinned.Stats) float64 { return float64(s.HostFreeTime.Total) / 1e6 }),
	pinnedCounter("device_syncs_total", "Device synchronisations made in place of stream events: a stream destroyed before Free, or an event whose query failed.",
		"", func(s *pinned.Stats) float64 { return float64(s.DestroyedStreamSyncs + s.QueryFailureSyncs) }),
}

// PinnedMetrics describes every metric the PinnedCollector exports, in its
// order; the PyTorch keys are torch.cuda.host_memory_stats()'s.
func PinnedMetrics() []MetricInfo {
	out := make([]MetricInfo, len(pinnedMetrics))
	for i, m := range pinnedMetrics {
		out[i] = m.MetricInfo
	}
	return out
}

type pinnedSource struct {
	src       PinnedSource
	gpu, uuid string
}

// PinnedCollector is a prometheus.Collector over pinned host allocators,
// one per device. Each Collect takes one Stats() copy per allocator. It is
// safe for concurrent scrapes.
type PinnedCollector struct {
	sources []pinnedSource
	descs   []*prometheus.Desc // parallel to pinnedMetrics
}

var _ prometheus.Collector = (*PinnedCollector)(nil)

// NewPinnedCollector returns a collector over sources, which must have
// distinct device indexes (the gpu label). Register it with a registerer
// of your own, beside the device allocators' Collector.
func NewPinnedCollector(sources ...PinnedSource) (*PinnedCollector, error) {
	if len(sources) == 0 {
		return nil, errors.New("stats: NewPinnedCollector needs at least one source")
	}
	c := &PinnedCollector{descs: make([]*prometheus.Desc, len(pinnedMetrics))}
	seen := map[int]bool{}
	for i, s := range sources {
		if s == nil || s.Device() == nil {
			return nil, fmt.Errorf("stats: pinned source %d is nil or has no device", i)
		}
		info := s.Device().Info()
		if seen[info.Index] {
			return nil, fmt.Errorf("stats: two pinned sources for device %d: each gpu label value must be unique", info.Index)
		}
		seen[info.Index] = true
		c.sources = append(c.sources, pinnedSource{src: s, gpu: strconv.Itoa(info.Index), uuid: info.UUID})
	}
	for i, m := range pinnedMetrics {
		c.descs[i] = prometheus.NewDesc(m.Name, m.Help, m.Labels, nil)
	}
	return c, nil
}

// Describe sends the fixed descriptors of every metric.
func (c *PinnedCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

// Collect sends every metric of every source.
func (c *PinnedCollector) Collect(ch chan<- prometheus.Metric) {
	for _, s := range c.sources {
		st := s.src.Stats()
		for i, m := range pinnedMetrics {
			ch <- prometheus.MustNewConstMetric(c.descs[i], m.vtype, m.value(&st), s.gpu, s.uuid)
		}
	}
}

// PinnedSummary renders s as memory_summary-style lines for the pinned
// host pool of device, in the table's format and units (75 characters
// between the bars):
//
//	|===========================================================================|
//	|                 allocd pinned host memory summary, device ID 0            |
//	|---------------------------------------------------------------------------|
//	|  cudaHostAlloc calls: 3            |        cudaFreeHost calls: 1         |
//	|===========================================================================|
//	|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
//	|---------------------------------------------------------------------------|
//	| Pinned allocated      |   2048 KiB |   4096 KiB |  10240 KiB |   8192 KiB |
//	…
func PinnedSummary(s pinned.Stats, device int) string {
	var b strings.Builder
	line := func(format string, args ...any) {
		b.WriteByte('|')
		fmt.Fprintf(&b, format, args...)
		b.WriteString("|\n")
	}
	rule := func(c string) { line("%s", strings.Repeat(c, summaryWidth)) }
	rule("=")
	line(" %15s allocd pinned host memory summary, device ID %-12d ", "", device)
	rule("-")
	line("  cudaHostAlloc calls: %-12d | %6s cudaFreeHost calls: %-9d ", s.NumHostAlloc, "", s.NumHostFree)
	rule("=")
	line("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")
	rule("-")
	for _, r := range []struct {
		title string
		bytes bool
		st    pinned.Stat
	}{
		{"Pinned allocated", true, s.AllocatedBytes},
		{"Pinned requested", true, s.RequestedBytes},
		{"Pinned reserved", true, s.ReservedBytes},
		{"Pinned allocations", false, s.Allocation},
		{"Pinned segments", false, s.Segment},
	} {
		f := formatCount
		if r.bytes {
			f = formatSize
		}
		st := r.st
		line(" %-21s | %s | %s | %s | %s ", r.title, f(st.Current, st.Current), f(st.Peak, st.Peak), f(st.Allocated, st.Allocated), f(st.Freed, st.Freed))
	}
	rule("-")
	n := int64(s.PendingEvents)
	line(" %-21s | %s | %10s | %10s | %10s ", "Pending stream events", formatCount(n, n), "", "", "")
	rule("=")
	return b.String()
}
