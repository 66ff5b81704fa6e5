package stats

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
)

// Namespace prefixes every metric name.
const Namespace = "allocd"

// Label names. LabelGPU and LabelUUID follow dcgm-exporter, so that
// allocd's series join with DCGM's on the same GPU.
const (
	// LabelGPU is the device index ("0", "1", …).
	LabelGPU = "gpu"
	// LabelUUID is the device UUID ("GPU-…"), empty when the device has
	// none (an empty label is no label to Prometheus).
	LabelUUID = "UUID"
	// LabelPool is "small" or "large": the allocator's two block pools.
	LabelPool = "pool"
	// LabelModelName is the device name on allocd_device_info.
	LabelModelName = "model_name"
)

// Source is what the Collector reads: an allocator's statistics and its
// device. *allocator.Allocator implements it.
type Source interface {
	// Stats returns a consistent copy of the statistics.
	Stats() allocator.Stats
	// Device returns the device the statistics are about.
	Device() cudart.Device
}

var _ Source = (*allocator.Allocator)(nil)

// metricKind says how a stat becomes a sample.
type metricKind uint8

const (
	kindPool        metricKind = iota // one gauge or counter per pool
	kindPlain                         // one gauge or counter per device
	kindSeconds                       // one counter of seconds per device
	kindDeviceFree                    // MemGetInfo's free bytes
	kindDeviceTotal                   // MemGetInfo's total bytes
	kindHist                          // the device-malloc latency histogram
	kindInfo                          // allocd_device_info
)

// MetricInfo describes one metric the Collector exports. Metrics lists
// them all; docs/metrics.md is written from the same facts.
type MetricInfo struct {
	// Name is the full metric name, e.g. "allocd_reserved_bytes".
	Name string
	// Type is "gauge", "counter" or "histogram".
	Type string
	// Help is the metric's HELP text.
	Help string
	// Labels are the variable labels, in order.
	Labels []string
	// PyTorch is the torch.cuda.memory_stats() key the value comes from
	// ("" when PyTorch has none); POOL stands for small_pool and
	// large_pool.
	PyTorch string

	kind    metricKind
	vtype   prometheus.ValueType
	pool    func(*allocator.Stats, allocator.Pool) int64 // kindPool
	plain   func(*allocator.Stats) int64                 // kindPlain
	seconds func(*allocator.Stats) time.Duration         // kindSeconds
}

var (
	deviceLabels = []string{LabelGPU, LabelUUID}
	poolLabels   = []string{LabelGPU, LabelUUID, LabelPool}
	infoLabels   = []string{LabelGPU, LabelUUID, LabelModelName}
)

func poolGauge(name, help, torch string, f func(*allocator.Stats) *allocator.StatArray) MetricInfo {
	return MetricInfo{Name: Namespace + "_" + name, Type: "gauge", Help: help, Labels: poolLabels, PyTorch: torch + ".POOL.current",
		kind: kindPool, vtype: prometheus.GaugeValue,
		pool: func(s *allocator.Stats, p allocator.Pool) int64 { return f(s)[p].Current }}
}

func poolCounter(name, help, torch string, f func(*allocator.Stat) int64, arr func(*allocator.Stats) *allocator.StatArray) MetricInfo {
	return MetricInfo{Name: Namespace + "_" + name, Type: "counter", Help: help, Labels: poolLabels, PyTorch: torch,
		kind: kindPool, vtype: prometheus.CounterValue,
		pool: func(s *allocator.Stats, p allocator.Pool) int64 { return f(&arr(s)[p]) }}
}

func plainMetric(name, typ, help, torch string, f func(*allocator.Stats) int64) MetricInfo {
	vt := prometheus.GaugeValue
	if typ == "counter" {
		vt = prometheus.CounterValue
	}
	return MetricInfo{Name: Namespace + "_" + name, Type: typ, Help: help, Labels: deviceLabels, PyTorch: torch,
		kind: kindPlain, vtype: vt, plain: f}
}

// secondsCounter is a counter of the seconds f reads.
func secondsCounter(name, help string, f func(*allocator.Stats) time.Duration) MetricInfo {
	return MetricInfo{Name: Namespace + "_" + name, Type: "counter", Help: help, Labels: deviceLabels,
		kind: kindSeconds, vtype: prometheus.CounterValue, seconds: f}
}

func allocated(s *allocator.Stat) int64 { return s.Allocated }
func freed(s *allocator.Stat) int64     { return s.Freed }

// metrics is every metric, in exposition order within each kind.
var metrics = []MetricInfo{
	poolGauge("allocated_bytes", "Bytes of live allocations (rounded sizes), as torch.cuda.memory_allocated().",
		"allocated_bytes", func(s *allocator.Stats) *allocator.StatArray { return &s.AllocatedBytes }),
	poolGauge("reserved_bytes", "Bytes of segments held from the device, as torch.cuda.memory_reserved().",
		"reserved_bytes", func(s *allocator.Stats) *allocator.StatArray { return &s.ReservedBytes }),
	poolGauge("active_bytes", "Bytes of active blocks: live allocations and freed blocks still awaiting a stream's event.",
		"active_bytes", func(s *allocator.Stats) *allocator.StatArray { return &s.ActiveBytes }),
	poolGauge("inactive_split_bytes", "Bytes of free blocks inside split segments (cached but not releasable).",
		"inactive_split_bytes", func(s *allocator.Stats) *allocator.StatArray { return &s.InactiveSplitBytes }),
	poolGauge("requested_bytes", "Bytes callers asked for in live allocations, before rounding.",
		"requested_bytes", func(s *allocator.Stats) *allocator.StatArray { return &s.RequestedBytes }),
	poolGauge("segments", "Segments (device allocations) held.",
		"segment", func(s *allocator.Stats) *allocator.StatArray { return &s.Segment }),
	poolGauge("live_allocations", "Allocations handed out and not yet freed.",
		"allocation", func(s *allocator.Stats) *allocator.StatArray { return &s.Allocation }),
	poolGauge("active_blocks", "Active blocks: live allocations and freed blocks still awaiting a stream's event.",
		"active", func(s *allocator.Stats) *allocator.StatArray { return &s.Active }),
	poolGauge("inactive_split_blocks", "Free blocks inside split segments.",
		"inactive_split", func(s *allocator.Stats) *allocator.StatArray { return &s.InactiveSplit }),
	poolCounter("allocations_total", "Allocations handed out (Malloc calls that returned memory).",
		"allocation.POOL.allocated", allocated, func(s *allocator.Stats) *allocator.StatArray { return &s.Allocation }),
	poolCounter("frees_total", "Allocations freed.",
		"allocation.POOL.freed", freed, func(s *allocator.Stats) *allocator.StatArray { return &s.Allocation }),

	plainMetric("peak_allocated_bytes", "gauge", "Peak of allocated bytes over all pools since start or the last peak reset, as torch.cuda.max_memory_allocated().",
		"allocated_bytes.all.peak", func(s *allocator.Stats) int64 { return s.AllocatedBytes[allocator.PoolAll].Peak }),
	plainMetric("peak_reserved_bytes", "gauge", "Peak of reserved bytes over all pools since start or the last peak reset, as torch.cuda.max_memory_reserved().",
		"reserved_bytes.all.peak", func(s *allocator.Stats) int64 { return s.ReservedBytes[allocator.PoolAll].Peak }),
	plainMetric("peak_active_bytes", "gauge", "Peak of active bytes over all pools since start or the last peak reset.",
		"active_bytes.all.peak", func(s *allocator.Stats) int64 { return s.ActiveBytes[allocator.PoolAll].Peak }),
	plainMetric("peak_requested_bytes", "gauge", "Peak of requested bytes over all pools since start or the last peak reset.",
		"requested_bytes.all.peak", func(s *allocator.Stats) int64 { return s.RequestedBytes[allocator.PoolAll].Peak }),
	plainMetric("oversize_allocations", "gauge", "Live allocations of at least max_split_size.",
		"oversize_allocations.current", func(s *allocator.Stats) int64 { return s.OversizeAllocations.Current }),
	plainMetric("oversize_segments", "gauge", "Segments of at least max_split_size held.",
		"oversize_segments.current", func(s *allocator.Stats) int64 { return s.OversizeSegments.Current }),
	plainMetric("largest_free_block_bytes", "gauge", "Size of the largest cached free block: the biggest request served without a device malloc.",
		"", func(s *allocator.Stats) int64 { return s.LargestFreeBlock }),
	plainMetric("device_mallocs_total", "counter", "Device malloc calls that returned a segment (cudaMalloc).",
		"num_device_alloc", func(s *allocator.Stats) int64 { return s.NumDeviceAlloc }),
	plainMetric("device_frees_total", "counter", "Device free calls (cudaFree).",
		"num_device_free", func(s *allocator.Stats) int64 { return s.NumDeviceFree }),
	plainMetric("alloc_retries_total", "counter", "Mallocs that released the cache and asked the device again after it said no.",
		"num_alloc_retries", func(s *allocator.Stats) int64 { return s.NumAllocRetries }),
	plainMetric("ooms_total", "counter", "Mallocs that failed with an out-of-memory error.",
		"num_ooms", func(s *allocator.Stats) int64 { return s.NumOOMs }),
	plainMetric("sync_all_streams_total", "counter", "Times the allocator waited for every pending stream event (OOM path, empty cache).",
		"num_sync_all_streams", func(s *allocator.Stats) int64 { return s.NumSyncAllStreams }),
	plainMetric("empty_cache_total", "counter", "EmptyCache calls, as torch.cuda.empty_cache().",
		"", func(s *allocator.Stats) int64 { return s.NumEmptyCache }),
	plainMetric("escalations_total", "counter", "Cached mallocs and frees that took every stream's lock to settle a peak statistic: the hot path's contention between streams.",
		"", func(s *allocator.Stats) int64 { return s.NumEscalations }),
	plainMetric("cap_borrows_total", "counter", "Cached mallocs and frees that passed their stream's share of the slack under a peak statistic and took more from the slack all streams share.",
		"", func(s *allocator.Stats) int64 { return s.NumCapBorrows }),
	plainMetric("cap_steals_total", "counter", "Other streams' locks that those borrows took to move slack the other streams held but did not use back into the shared part.",
		"", func(s *allocator.Stats) int64 { return s.NumCapSteals }),
	plainMetric("expandable_reclaims_total", "counter", "Expandable-segment reclaims: mappings that took free pages first to keep reserved memory near its high-water mark; pages of the growing stream stay mapped where they were (standby) with no wait, others wait for the streams owning them.",
		"", func(s *allocator.Stats) int64 { return s.NumReclaims }),
	plainMetric("expandable_pages_moved_total", "counter", "Physical pages that reclaim unmapped from a free block and mapped again for a request.",
		"", func(s *allocator.Stats) int64 { return s.NumPagesMoved }),
	plainMetric("expandable_pages_moved_across_streams_total", "counter", "Pages moved by reclaim from one stream's range to another stream's.",
		"", func(s *allocator.Stats) int64 { return s.NumPagesMovedAcrossStreams }),
	plainMetric("expandable_small_from_large_total", "counter", "Small requests (up to 1 MiB) that expandable segments served from a free block of the stream's large pool instead of growing the small pool past what reclaim allows, which would move memory between the pools.",
		"", func(s *allocator.Stats) int64 { return s.NumSmallFromLarge }),
	plainMetric("expandable_lends_total", "counter", "Free blocks of one stream's expandable segment handed out, ordered after the owner's work on the device, to a request on another stream that the device or the per-process cap refused to map for even after cached memory was released, instead of failing with out of memory.",
		"", func(s *allocator.Stats) int64 { return s.NumLends }),
	plainMetric("expandable_handle_cache_bytes", "gauge", "Physical memory that reclaim took from free blocks and keeps for the next growths to map again (still mapped where it was, standby, when it came from the growing stream's own blocks); held from the device, so counted in reserved bytes.",
		"", func(s *allocator.Stats) int64 { return s.HandleCacheBytes }),
	plainMetric("expandable_handles_created_total", "counter", "Physical-memory handles that expandable segments created (cuMemCreate): growth that the handle cache could not serve.",
		"", func(s *allocator.Stats) int64 { return s.VMM.Creates }),
	plainMetric("expandable_handles_released_total", "counter", "Physical-memory handles that expandable segments released (cuMemRelease): runs that a reclaim took and the growing pool cannot map, and memory EmptyCache, the out-of-memory path or a cap gave back.",
		"", func(s *allocator.Stats) int64 { return s.VMM.Releases }),
	plainMetric("expandable_runs_revived_total", "counter", "Runs that a growth took back from a standby mapping at its own place, with no device call.",
		"", func(s *allocator.Stats) int64 { return s.VMM.Revived }),
	plainMetric("expandable_reclaim_waits_total", "counter", "Times reclaim waited for a stream's queued work before unmapping memory or handing it to another stream (a stream or an event synchronised).",
		"", func(s *allocator.Stats) int64 { return s.VMM.Waits }),
	secondsCounter("expandable_vmm_seconds_total", "Time in the driver's virtual-memory calls of expandable segments: creating, mapping (access grants included), unmapping and releasing physical memory.",
		func(s *allocator.Stats) time.Duration { return s.VMM.Total() }),
	secondsCounter("expandable_sync_seconds_total", "Time reclaim spent ordering memory against queued work: events created, recorded, queried, synchronised and destroyed, and streams synchronised, waits included.",
		func(s *allocator.Stats) time.Duration { return s.VMM.SyncTime }),
	plainMetric("private_pool_reserved_bytes", "gauge", "Memory that private pools (CUDA graphs, torch.cuda.MemPool) hold; counted in reserved bytes too.",
		"", func(s *allocator.Stats) int64 { return s.PrivateReservedBytes }),
	plainMetric("private_pool_allocated_bytes", "gauge", "Memory allocated from private pools (CUDA graphs, torch.cuda.MemPool); counted in allocated bytes too.",
		"", func(s *allocator.Stats) int64 { return s.PrivateAllocatedBytes }),

	{Name: Namespace + "_device_free_bytes", Type: "gauge", Help: "Free device memory as the device reports it (cudaMemGetInfo), all processes counted.",
		Labels: deviceLabels, PyTorch: "torch.cuda.mem_get_info()[0]", kind: kindDeviceFree},
	{Name: Namespace + "_device_total_bytes", Type: "gauge", Help: "Total device memory (cudaMemGetInfo).",
		Labels: deviceLabels, PyTorch: "torch.cuda.mem_get_info()[1]", kind: kindDeviceTotal},
	{Name: Namespace + "_device_malloc_duration_seconds", Type: "histogram", Help: "Time spent in each successful device malloc (the allocator's slow path).",
		Labels: deviceLabels, kind: kindHist},
	{Name: Namespace + "_device_info", Type: "gauge", Help: "Constant 1, labelled with the device's index, UUID and name.",
		Labels: infoLabels, kind: kindInfo},
}

// Metrics describes every metric the Collector exports, in its order.
func Metrics() []MetricInfo { return append([]MetricInfo(nil), metrics...) }

// source is one allocator and its label values, read once.
type source struct {
	src              Source
	dev              cudart.Device
	gpu, uuid, model string
}

// Collector is a prometheus.Collector over one or more allocators, one per
// GPU. Each Collect takes one Stats() copy and one MemGetInfo() per
// allocator and sends const metrics built from them; the allocator's lock
// is held only for the copy. Collector is safe for concurrent scrapes.
type Collector struct {
	sources []source
	descs   []*prometheus.Desc // parallel to metrics
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a collector over sources, which must have distinct
// device indexes (they label the series with gpu="N"). The device's Info is
// read once, here. Register it with a prometheus.Registerer of your own;
// the package never touches the global registry.
func NewCollector(sources ...Source) (*Collector, error) {
	if len(sources) == 0 {
		return nil, errors.New("stats: NewCollector needs at least one source")
	}
	c := &Collector{descs: make([]*prometheus.Desc, len(metrics))}
	seen := make(map[int]bool, len(sources))
	for i, s := range sources {
		if s == nil {
			return nil, fmt.Errorf("stats: source %d is nil", i)
		}
		dev := s.Device()
		if dev == nil {
			return nil, fmt.Errorf("stats: source %d has no device", i)
		}
		info := dev.Info()
		if seen[info.Index] {
			return nil, fmt.Errorf("stats: two sources for device %d: each gpu label value must be unique", info.Index)
		}
		seen[info.Index] = true
		c.sources = append(c.sources, source{src: s, dev: dev, gpu: strconv.Itoa(info.Index), uuid: info.UUID, model: info.Name})
	}
	for i, m := range metrics {
		c.descs[i] = prometheus.NewDesc(m.Name, m.Help, m.Labels, nil)
	}
	return c, nil
}

// NewDevicesCollector returns a collector over every allocator of d, each
// under its device index: NewCollector of d.All().
func NewDevicesCollector(d *allocator.Devices) (*Collector, error) {
	if d == nil {
		return nil, errors.New("stats: NewDevicesCollector of nil Devices")
	}
	all := d.All()
	srcs := make([]Source, len(all))
	for i, a := range all {
		srcs[i] = a
	}
	return NewCollector(srcs...)
}

// Describe sends the fixed descriptors of every metric.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

// Collect takes one Stats() copy and one MemGetInfo() per allocator and
// sends the metrics built from them. A device that cannot report its
// memory yields an invalid metric for the two device gauges (the scrape
// reports the error) and the rest as usual.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for i := range c.sources {
		c.collect(ch, &c.sources[i])
	}
}

func (c *Collector) collect(ch chan<- prometheus.Metric, s *source) {
	st := s.src.Stats()
	free, total, memErr := s.dev.MemGetInfo()
	for i := range metrics {
		m := &metrics[i]
		d := c.descs[i]
		switch m.kind {
		case kindPool:
			ch <- prometheus.MustNewConstMetric(d, m.vtype, float64(m.pool(&st, allocator.PoolSmall)), s.gpu, s.uuid, "small")
			ch <- prometheus.MustNewConstMetric(d, m.vtype, float64(m.pool(&st, allocator.PoolLarge)), s.gpu, s.uuid, "large")
		case kindPlain:
			ch <- prometheus.MustNewConstMetric(d, m.vtype, float64(m.plain(&st)), s.gpu, s.uuid)
		case kindSeconds:
			ch <- prometheus.MustNewConstMetric(d, m.vtype, m.seconds(&st).Seconds(), s.gpu, s.uuid)
		case kindDeviceFree, kindDeviceTotal:
			if memErr != nil {
				ch <- prometheus.NewInvalidMetric(d, fmt.Errorf("gpu %s: reading device memory: %w", s.gpu, memErr))
				continue
			}
			v := free
			if m.kind == kindDeviceTotal {
				v = total
			}
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), s.gpu, s.uuid)
		case kindHist:
			h := &st.DeviceMallocLatency
			buckets := make(map[float64]uint64, len(allocator.DeviceMallocBuckets))
			var cum uint64
			for j, bound := range allocator.DeviceMallocBuckets {
				cum += h.Counts[j]
				buckets[bound] = cum
			}
			// The last count (above every bound) is the +Inf bucket,
			// which Prometheus derives from the total count.
			ch <- prometheus.MustNewConstHistogram(d, h.Count, h.Sum, buckets, s.gpu, s.uuid)
		case kindInfo:
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, 1, s.gpu, s.uuid, s.model)
		}
	}
}

// BuildInfo returns a collector of the constant gauge
// allocd_build_info{version, goversion} = 1.
func BuildInfo(version string) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace:   Namespace,
		Name:        "build_info",
		Help:        "Constant 1, labelled with the allocd version and the Go version it was built with.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version()},
	}, func() float64 { return 1 })
}
