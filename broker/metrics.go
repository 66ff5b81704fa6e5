package broker

import (
	"sort"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Stats is a snapshot of the broker's figures, taken under its lock.
type Stats struct {
	Devices []DeviceStats `json:"devices"`
	// Tenants has one entry per tenant and device the broker has seen
	// or its tenants file lists, sorted by tenant and device.
	Tenants []TenantStats `json:"tenants"`
	// Clients counts connected clients by tenant; ClientsReclaimed the
	// clients that went away holding memory.
	Clients          map[string]uint64 `json:"clients"`
	ClientsReclaimed map[string]uint64 `json:"clients_reclaimed"`
	// ProtocolErrors counts clients cut off, by reason: malformed,
	// truncated, timeout, version.
	ProtocolErrors map[string]uint64 `json:"protocol_errors"`
	// Reloads and ReloadFailures count tenants-file reloads;
	// LastReloadOK is false after a failed one.
	Reloads        uint64 `json:"reloads"`
	ReloadFailures uint64 `json:"reload_failures"`
	LastReloadOK   bool   `json:"last_reload_ok"`
	Stopping       bool   `json:"stopping"`
}

// DeviceStats is one device's figures.
type DeviceStats struct {
	Index int    `json:"gpu"`
	UUID  string `json:"uuid"`
	// DeviceBytes is the physical memory the broker holds: HeldBytes
	// (granted to clients, connected or waiting for their process to
	// exit) plus CachedBytes.
	DeviceBytes   uint64        `json:"device_bytes"`
	HeldBytes     uint64        `json:"held_bytes"`
	CachedBytes   uint64        `json:"cached_bytes"`
	Chunks        int           `json:"chunks"`
	CachedChunks  int           `json:"cached_chunks"`
	Creates       uint64        `json:"creates"`
	Releases      uint64        `json:"releases"`
	Scrubs        uint64        `json:"scrubs"`
	ScrubbedBytes uint64        `json:"scrubbed_bytes"`
	ScrubTime     time.Duration `json:"scrub_ns"`
}

// TenantStats is one tenant's figures on one device.
type TenantStats struct {
	Tenant string `json:"tenant"`
	Device int    `json:"gpu"`
	UUID   string `json:"uuid"`
	// Granted is what the tenant's clients hold; Quota its limit when
	// Limited.
	Granted uint64 `json:"granted_bytes"`
	Quota   uint64 `json:"quota_bytes"`
	Limited bool   `json:"limited"`
	Grants  uint64 `json:"grants"`
	// Refusals counts refused grants by reason.
	Refusals       map[Reason]uint64 `json:"refusals"`
	ReturnedBytes  uint64            `json:"returned_bytes"`
	ReclaimedBytes uint64            `json:"reclaimed_bytes"`
}

// Stats returns a snapshot of the broker's figures.
func (b *Broker) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := Stats{
		Clients: make(map[string]uint64), ClientsReclaimed: make(map[string]uint64), ProtocolErrors: make(map[string]uint64),
		Reloads: b.reloadOK, ReloadFailures: b.reloadBad, LastReloadOK: b.lastOK, Stopping: b.stopping,
	}
	for _, d := range b.devs {
		n := 0
		for _, l := range d.cache {
			n += len(l)
		}
		s.Devices = append(s.Devices, DeviceStats{
			Index: d.index, UUID: d.info.UUID,
			DeviceBytes: d.heldBytes + d.cachedBytes, HeldBytes: d.heldBytes, CachedBytes: d.cachedBytes,
			Chunks: d.chunks, CachedChunks: n, Creates: d.creates, Releases: d.releases,
			Scrubs: d.scrubs, ScrubbedBytes: d.scrubbedBytes, ScrubTime: d.scrubTime,
		})
	}
	for _, c := range b.clients {
		if !c.gone {
			s.Clients[c.tenant]++
		}
	}
	for t, n := range b.reclaims {
		s.ClientsReclaimed[t] = n
	}
	for r, n := range b.protoErrs {
		s.ProtocolErrors[r] = n
	}
	keys := make(map[tenantKey]bool, len(b.counters))
	for k := range b.counters {
		keys[k] = true
	}
	for _, name := range b.tenants.Names() {
		for _, d := range b.devs {
			keys[tenantKey{name, d.index}] = true
		}
	}
	for k := range keys {
		d := b.devs[k.dev]
		ts := TenantStats{Tenant: k.tenant, Device: k.dev, UUID: d.info.UUID, Refusals: make(map[Reason]uint64)}
		if c := b.counters[k]; c != nil {
			ts.Granted, ts.Grants, ts.ReturnedBytes, ts.ReclaimedBytes = c.held, c.grants, c.returned, c.reclaimed
			for r, n := range c.refusals {
				if n > 0 {
					ts.Refusals[Reason(r)] = n
				}
			}
		}
		if pol, ok := b.tenants.Lookup(k.tenant); ok {
			ts.Quota, ts.Limited = pol.QuotaOn(d.index, d.info.UUID)
			if !ts.Limited {
				ts.Quota = 0
			}
		}
		s.Tenants = append(s.Tenants, ts)
	}
	sort.Slice(s.Tenants, func(i, j int) bool {
		a, c := s.Tenants[i], s.Tenants[j]
		if a.Tenant != c.Tenant {
			return a.Tenant < c.Tenant
		}
		return a.Device < c.Device
	})
	return s
}

// grantBuckets are the grant-duration histogram's buckets, in seconds:
// from a cached chunk's few microseconds to a create and scrub of a
// large one.
var grantBuckets = []float64{10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3}

// grantHistograms records grant durations per device. Histograms
// have their own synchronisation, so a scrape never waits on the
// broker's lock for them.
type grantHistograms struct {
	h []prometheus.Histogram // by device index
}

func newGrantHistograms(uuids []string) *grantHistograms {
	g := new(grantHistograms)
	for i, uuid := range uuids {
		g.h = append(g.h, prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "allocd_broker_grant_duration_seconds", Help: "Time the broker took to serve a grant: from the cache, or creating (and, for another tenant's chunk, zeroing) it.",
			Buckets: grantBuckets, ConstLabels: prometheus.Labels{"gpu": strconv.Itoa(i), "UUID": uuid},
		}))
	}
	return g
}

func (g *grantHistograms) observe(dev int, d time.Duration) { g.h[dev].Observe(d.Seconds()) }

// Collector exports a broker's figures to Prometheus, from one Stats
// snapshot per scrape.
type Collector struct {
	b *Broker

	granted, quota, grants, refusals, returned, reclaimed *prometheus.Desc
	clientsReclaimed, clients                             *prometheus.Desc
	cached, deviceBytes, held, creates, releases          *prometheus.Desc
	scrubs, scrubbed, scrubSeconds                        *prometheus.Desc
	reloads, lastReload, stopping, protoErrs              *prometheus.Desc
	grantSeconds                                          *prometheus.Desc
}

// NewCollector returns b's collector; register it on the daemon's
// registry.
func NewCollector(b *Broker) *Collector {
	tl := []string{"tenant", "gpu", "UUID"}
	dl := []string{"gpu", "UUID"}
	return &Collector{
		b:                b,
		granted:          prometheus.NewDesc("allocd_broker_granted_bytes", "Bytes of chunks the tenant's clients hold on the GPU (connected, or waiting for their process to exit).", tl, nil),
		quota:            prometheus.NewDesc("allocd_broker_quota_bytes", "The tenant's quota on the GPU; absent when it has none.", tl, nil),
		grants:           prometheus.NewDesc("allocd_broker_grants_total", "Chunks granted to the tenant's clients.", tl, nil),
		refusals:         prometheus.NewDesc("allocd_broker_refusals_total", "Grants refused, by reason: quota, out_of_memory, stopping or invalid.", append(tl, "reason"), nil),
		returned:         prometheus.NewDesc("allocd_broker_returned_bytes_total", "Bytes the tenant's clients gave back.", tl, nil),
		reclaimed:        prometheus.NewDesc("allocd_broker_reclaimed_bytes_total", "Bytes taken back from the tenant's clients that went away holding them (exit, crash, kill -9, cut off).", tl, nil),
		clientsReclaimed: prometheus.NewDesc("allocd_broker_clients_reclaimed_total", "Clients of the tenant that went away holding memory.", []string{"tenant"}, nil),
		clients:          prometheus.NewDesc("allocd_broker_clients", "Connected clients of the tenant.", []string{"tenant"}, nil),
		cached:           prometheus.NewDesc("allocd_broker_cached_bytes", "Chunks the broker holds and has granted to nobody.", dl, nil),
		deviceBytes:      prometheus.NewDesc("allocd_broker_device_bytes", "Physical memory the broker holds on the GPU: granted plus cached.", dl, nil),
		held:             prometheus.NewDesc("allocd_broker_held_bytes", "Chunks granted to clients on the GPU, all tenants.", dl, nil),
		creates:          prometheus.NewDesc("allocd_broker_chunks_created_total", "Chunks the broker created on the GPU: grants its cache could not serve.", dl, nil),
		releases:         prometheus.NewDesc("allocd_broker_chunks_released_total", "Chunks the broker released to the driver: trimmed after waiting in the cache, or its cache released for a grant that found the GPU full.", dl, nil),
		scrubs:           prometheus.NewDesc("allocd_broker_scrubs_total", "Chunks zeroed before passing to another tenant.", dl, nil),
		scrubbed:         prometheus.NewDesc("allocd_broker_scrubbed_bytes_total", "Bytes zeroed before passing to another tenant.", dl, nil),
		scrubSeconds:     prometheus.NewDesc("allocd_broker_scrub_seconds_total", "Time spent zeroing chunks, mapping and waiting included.", dl, nil),
		reloads:          prometheus.NewDesc("allocd_broker_config_reloads_total", "Reloads of the tenants file, by result: success or failure.", []string{"result"}, nil),
		lastReload:       prometheus.NewDesc("allocd_broker_config_last_reload_successful", "1 when the last reload of the tenants file succeeded (or none was asked for), else 0.", nil, nil),
		stopping:         prometheus.NewDesc("allocd_broker_stopping", "1 while the broker is shutting down and grants nothing.", nil, nil),
		protoErrs:        prometheus.NewDesc("allocd_broker_protocol_errors_total", "Clients cut off, by reason: malformed, truncated, timeout or version.", []string{"reason"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.granted, c.quota, c.grants, c.refusals, c.returned, c.reclaimed, c.clientsReclaimed, c.clients,
		c.cached, c.deviceBytes, c.held, c.creates, c.releases, c.scrubs, c.scrubbed, c.scrubSeconds, c.reloads, c.lastReload, c.stopping, c.protoErrs} {
		ch <- d
	}
	for _, h := range c.b.grantHist.h {
		h.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.b.Stats()
	gauge, counter := prometheus.GaugeValue, prometheus.CounterValue
	for _, t := range s.Tenants {
		gpu := strconv.Itoa(t.Device)
		ch <- prometheus.MustNewConstMetric(c.granted, gauge, float64(t.Granted), t.Tenant, gpu, t.UUID)
		if t.Limited {
			ch <- prometheus.MustNewConstMetric(c.quota, gauge, float64(t.Quota), t.Tenant, gpu, t.UUID)
		}
		ch <- prometheus.MustNewConstMetric(c.grants, counter, float64(t.Grants), t.Tenant, gpu, t.UUID)
		for r := ReasonQuota; int(r) < len(reasonNames); r++ {
			ch <- prometheus.MustNewConstMetric(c.refusals, counter, float64(t.Refusals[r]), t.Tenant, gpu, t.UUID, r.String())
		}
		ch <- prometheus.MustNewConstMetric(c.returned, counter, float64(t.ReturnedBytes), t.Tenant, gpu, t.UUID)
		ch <- prometheus.MustNewConstMetric(c.reclaimed, counter, float64(t.ReclaimedBytes), t.Tenant, gpu, t.UUID)
	}
	tenants := make(map[string]bool)
	for _, t := range s.Tenants {
		tenants[t.Tenant] = true
	}
	for t := range tenants {
		ch <- prometheus.MustNewConstMetric(c.clients, gauge, float64(s.Clients[t]), t)
		ch <- prometheus.MustNewConstMetric(c.clientsReclaimed, counter, float64(s.ClientsReclaimed[t]), t)
	}
	for _, d := range s.Devices {
		gpu := strconv.Itoa(d.Index)
		ch <- prometheus.MustNewConstMetric(c.cached, gauge, float64(d.CachedBytes), gpu, d.UUID)
		ch <- prometheus.MustNewConstMetric(c.deviceBytes, gauge, float64(d.DeviceBytes), gpu, d.UUID)
		ch <- prometheus.MustNewConstMetric(c.held, gauge, float64(d.HeldBytes), gpu, d.UUID)
		ch <- prometheus.MustNewConstMetric(c.creates, counter, float64(d.Creates), gpu, d.UUID)
		ch <- prometheus.MustNewConstMetric(c.releases, counter, float64(d.Releases), gpu, d.UUID)
		ch <- prometheus.MustNewConstMetric(c.scrubs, counter, float64(d.Scrubs), gpu, d.UUID)
		ch <- prometheus.MustNewConstMetric(c.scrubbed, counter, float64(d.ScrubbedBytes), gpu, d.UUID)
		ch <- prometheus.MustNewConstMetric(c.scrubSeconds, counter, d.ScrubTime.Seconds(), gpu, d.UUID)
	}
	ch <- prometheus.MustNewConstMetric(c.reloads, counter, float64(s.Reloads), "success")
	ch <- prometheus.MustNewConstMetric(c.reloads, counter, float64(s.ReloadFailures), "failure")
	ch <- prometheus.MustNewConstMetric(c.lastReload, gauge, b2f(s.LastReloadOK))
	ch <- prometheus.MustNewConstMetric(c.stopping, gauge, b2f(s.Stopping))
	for _, r := range []string{"malformed", "truncated", "timeout", "version"} {
		ch <- prometheus.MustNewConstMetric(c.protoErrs, counter, float64(s.ProtocolErrors[r]), r)
	}
	for _, h := range c.b.grantHist.h {
		h.Collect(ch)
	}
}

func b2f(v bool) float64 {
	if v {
		return 1
	}
	return 0
}
