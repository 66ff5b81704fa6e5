package broker

import (
	"errors"
	"fmt"
	"net"
	"slices"
	"sort"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
)

// Config configures a Broker.
type Config struct {
	// Devices are the GPUs the broker serves, in the order of its device
	// indexes. Each must implement cudart.ShareableMemory. The broker
	// does not close them.
	Devices []cudart.Device
	// Tenants is the tenants policy; nil means OpenTenants.
	Tenants *Tenants
	// Log receives the broker's lines; nil means none.
	Log *zap.Logger
	// HelloTimeout bounds how long a new connection may take to send its
	// Hello; FrameTimeout how long the rest of a frame may take once its
	// first byte has come (an idle client may wait any time between
	// frames); WriteTimeout how long a reply may wait for the client to
	// read. Zero means 5 s each.
	HelloTimeout, FrameTimeout, WriteTimeout time.Duration
	// MaxClients bounds the connections served at once; 0 means 4096.
	MaxClients int
	// MaxChunk bounds a chunk's size; 0 means the device's memory.
	MaxChunk uint64
}

// Broker holds a cache of physical memory chunks on each of its devices
// and grants them to client processes, one tenant's quota at a time.
// Its methods are safe for concurrent use.
//
// A chunk is in exactly one place: the device's cache, or held by one
// client. A held chunk goes back to the cache when its client returns
// it, or when the client's connection has closed and its process has
// exited (its mappings are then gone with it). A chunk a client held is
// zeroed before another tenant is granted it; within one tenant it moves
// as it is.
type Broker struct {
	cfg Config
	log *zap.Logger

	mu        sync.Mutex
	tenants   *Tenants
	devs      []*device
	clients   map[uint64]*client
	nextID    uint64 // clients and chunks share one sequence
	stopping  bool
	closing   bool          // Close has begun: processes are no longer awaited
	stopped   chan struct{} // closed when the last connection ends after Stop
	listeners []net.Listener
	counters  map[tenantKey]*tenantCounters
	reclaims  map[string]uint64 // clients that went away holding memory, by tenant
	protoErrs map[string]uint64
	reloadOK  uint64
	reloadBad uint64
	lastOK    bool
	grantHist *grantHistograms

	conns sync.WaitGroup
}

type device struct {
	index int
	info  cudart.Info
	sm    cudart.ShareableMemory
	gran  uint64
	total uint64

	// The scrubs' stream, made by the first scrub. Scrubs of one device
	// may run at once on it: each waits for the stream, its own memset
	// included.
	streamOnce sync.Once
	stream     cudart.Stream
	streamErr  error

	cache         map[uint64][]*chunk // free chunks by size, most recent last
	chunks        int
	cachedBytes   uint64
	heldBytes     uint64 // held by clients, connected or not
	dirtyReleased bool   // a chunk some tenant wrote was released: fresh ones may hold its bytes
	creates       uint64
	releases      uint64
	scrubs        uint64
	scrubbedBytes uint64
	scrubTime     time.Duration
}

// ownerUnknown marks a fresh chunk made after a tenant's chunk was
// released on the same device: it may hold that tenant's bytes.
const ownerUnknown = "\x00unknown"

type chunk struct {
	id     uint64
	dev    *device
	h      cudart.Handle
	fd     int // Export's descriptor, made once: exporting costs far more than a grant
	size   uint64
	owner  string    // the tenant that last held it; "" when never held
	holder *client   // nil while cached
	cached time.Time // when it entered the cache, for Trim
}

type client struct {
	id     uint64
	tenant string
	pid    int32
	uid    uint32
	conn   *net.UnixConn
	pidfd  int // -1 when not open
	gone   bool
	held   map[uint64]*chunk
}

type tenantKey struct {
	tenant string
	dev    int
}

type tenantCounters struct {
	held      uint64
	grants    uint64
	refusals  [len(reasonNames)]uint64
	returned  uint64
	reclaimed uint64
}

// New returns a broker for cfg's devices. It checks that each can share
// memory and reads its granularity; it creates nothing on them yet.
func New(cfg Config) (*Broker, error) {
	if len(cfg.Devices) == 0 {
		return nil, fmt.Errorf("broker: no devices: %w", cudart.ErrInvalidValue)
	}
	if len(cfg.Devices) > MaxDevices {
		return nil, fmt.Errorf("broker: %d devices, more than %d: %w", len(cfg.Devices), MaxDevices, cudart.ErrInvalidValue)
	}
	for _, d := range []*time.Duration{&cfg.HelloTimeout, &cfg.FrameTimeout, &cfg.WriteTimeout} {
		if *d <= 0 {
			*d = 5 * time.Second
		}
	}
	if cfg.MaxClients <= 0 {
		cfg.MaxClients = 4096
	}
	if cfg.Tenants == nil {
		cfg.Tenants = OpenTenants()
	}
	log := cfg.Log
	if log == nil {
		log = zap.NewNop()
	}
	b := &Broker{
		cfg: cfg, log: log, tenants: cfg.Tenants,
		clients:   make(map[uint64]*client),
		counters:  make(map[tenantKey]*tenantCounters),
		reclaims:  make(map[string]uint64),
		protoErrs: make(map[string]uint64),
		lastOK:    true,
		stopped:   make(chan struct{}),
	}
	for i, dev := range cfg.Devices {
		info := dev.Info()
		sm, ok := dev.(cudart.ShareableMemory)
		if !ok {
			return nil, fmt.Errorf("broker: device %d (%s) cannot share memory between processes: %w", i, info.Name, cudart.ErrNotSupported)
		}
		gran, err := sm.Granularity()
		if err != nil {
			return nil, fmt.Errorf("broker: device %d (%s): granularity: %w", i, info.Name, err)
		}
		_, total, err := dev.MemGetInfo()
		if err != nil {
			return nil, fmt.Errorf("broker: device %d (%s): memory: %w", i, info.Name, err)
		}
		b.devs = append(b.devs, &device{index: i, info: info, sm: sm, gran: gran, total: total, cache: make(map[uint64][]*chunk)})
	}
	uuids := make([]string, len(b.devs))
	for i, d := range b.devs {
		uuids[i] = d.info.UUID
	}
	b.grantHist = newGrantHistograms(uuids)
	return b, nil
}

// SetTenants replaces the tenants policy, as a reload of the tenants
// file does. Clients already connected keep their grants; a tenant no
// longer listed is refused further grants, and a lowered quota refuses
// grants until use falls below it.
func (b *Broker) SetTenants(t *Tenants) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tenants = t
	b.reloadOK++
	b.lastOK = true
}

// ReloadFailed records a reload that could not read its file; the
// policy in force stays.
func (b *Broker) ReloadFailed() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reloadBad++
	b.lastOK = false
}

func (b *Broker) counter(tenant string, dev int) *tenantCounters {
	k := tenantKey{tenant, dev}
	c := b.counters[k]
	if c == nil {
		c = new(tenantCounters)
		b.counters[k] = c
	}
	return c
}

// refusal is a grant the broker declines, as its Refused message.
func (b *Broker) refuse(req uint64, tenant string, d *device, r Reason, quota, used, asked uint64, format string, args ...any) Refused {
	if d != nil {
		b.counter(tenant, d.index).refusals[r]++
	}
	return Refused{Req: req, Reason: r, Quota: quota, Used: used, Asked: asked, Text: clip(fmt.Sprintf(format, args...), MaxText)}
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// grant serves g for c. It returns either the chunk (held by c) with
// its descriptor, which the caller sends and does not close, and
// whether it was zeroed; or a refusal. A chunk that passes from another
// tenant is zeroed outside the broker's lock, already held by c, so that
// other clients' grants do not wait for the memset.
func (b *Broker) grant(c *client, g Grant) (*chunk, int, Refused, bool) {
	start := time.Now()
	ch, scrub, refused := b.take(c, g)
	if ch == nil {
		return nil, -1, refused, false
	}
	d := ch.dev
	if scrub {
		took, err := b.scrubMemory(d, ch)
		b.mu.Lock()
		if err != nil {
			// A chunk that cannot be zeroed is never granted: release it.
			b.log.Error("scrubbing a chunk failed: releasing it", zap.Int("gpu", d.index), zap.Uint64("size", ch.size), zap.Error(err))
			b.unhold(ch)
			b.releaseChunk(ch)
			cnt := b.counter(c.tenant, d.index)
			cnt.grants--
			r := b.refuse(g.Req, c.tenant, d, ReasonOutOfMemory, 0, cnt.held, g.Size, "GPU %d: zeroing a chunk before its grant failed: %v", d.index, err)
			b.mu.Unlock()
			return nil, -1, r, false
		}
		d.scrubs++
		d.scrubbedBytes += ch.size
		d.scrubTime += took
		b.mu.Unlock()
	}
	b.grantHist.observe(d.index, time.Since(start))
	return ch, ch.fd, Refused{}, scrub
}

// take is grant's part under the broker's lock: the checks, the quota,
// and a chunk from the cache or made, held by c. scrub says the chunk
// held another tenant's bytes and must be zeroed before it is sent.
func (b *Broker) take(c *client, g Grant) (ch *chunk, scrub bool, _ Refused) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if int(g.Device) >= len(b.devs) {
		return nil, false, b.refuse(g.Req, c.tenant, nil, ReasonInvalid, 0, 0, g.Size, "no device %d: the broker has %d", g.Device, len(b.devs))
	}
	d := b.devs[g.Device]
	if b.stopping {
		return nil, false, b.refuse(g.Req, c.tenant, d, ReasonStopping, 0, 0, g.Size, "the allocd broker is stopping and grants no memory")
	}
	max := d.total
	if b.cfg.MaxChunk > 0 {
		max = min(max, b.cfg.MaxChunk)
	}
	if g.Size == 0 || g.Size%d.gran != 0 || g.Size > max {
		return nil, false, b.refuse(g.Req, c.tenant, d, ReasonInvalid, 0, 0, g.Size, "chunk size %d on GPU %d: want a positive multiple of %d bytes, at most %d", g.Size, d.index, d.gran, max)
	}
	cnt := b.counter(c.tenant, d.index)
	pol, listed := b.tenants.Lookup(c.tenant)
	if !listed {
		return nil, false, b.refuse(g.Req, c.tenant, d, ReasonQuota, 0, cnt.held, g.Size, "tenant %q is no longer in the broker's tenants file: no more memory on GPU %d (holds %s)", c.tenant, d.index, devspec.FormatSize(cnt.held))
	}
	if q, limited := pol.QuotaOn(d.index, d.info.UUID); limited && (g.Size > q || cnt.held > q-g.Size) {
		return nil, false, b.refuse(g.Req, c.tenant, d, ReasonQuota, q, cnt.held, g.Size,
			"tenant %q is over its quota on GPU %d (%s): quota %s, in use %s, asked %s more",
			c.tenant, d.index, d.info.UUID, devspec.FormatSize(q), devspec.FormatSize(cnt.held), devspec.FormatSize(g.Size))
	}
	ch = d.takeCached(g.Size, c.tenant)
	if ch == nil {
		var err error
		if ch, err = b.create(d, g.Size); err != nil {
			if !errors.Is(err, cudart.ErrOutOfMemory) {
				b.log.Error("creating a chunk", zap.Int("gpu", d.index), zap.Uint64("size", g.Size), zap.Error(err))
			}
			return nil, false, b.refuse(g.Req, c.tenant, d, ReasonOutOfMemory, 0, cnt.held, g.Size,
				"GPU %d (%s) has no memory for %s more, with the broker's cache released: the broker's clients hold %s of it (tenant %q %s): %v",
				d.index, d.info.UUID, devspec.FormatSize(g.Size), devspec.FormatSize(d.heldBytes), c.tenant, devspec.FormatSize(cnt.held), err)
		}
	}
	scrub = ch.owner != "" && ch.owner != c.tenant
	ch.owner, ch.holder = c.tenant, c
	c.held[ch.id] = ch
	d.heldBytes += ch.size
	cnt.held += ch.size
	cnt.grants++
	return ch, scrub, Refused{}
}

// takeCached removes and returns a cached chunk of exactly size, one
// tenant last held if there is one (no scrub needed), else any.
func (d *device) takeCached(size uint64, tenant string) *chunk {
	list := d.cache[size]
	if len(list) == 0 {
		return nil
	}
	i := len(list) - 1
	for j := len(list) - 1; j >= 0; j-- {
		if o := list[j].owner; o == tenant || o == "" {
			i = j
			break
		}
	}
	ch := list[i]
	list = slices.Delete(list, i, i+1)
	if len(list) == 0 {
		delete(d.cache, size)
	} else {
		d.cache[size] = list
	}
	d.cachedBytes -= ch.size
	return ch
}

func (d *device) putCached(ch *chunk) {
	ch.holder = nil
	ch.cached = time.Now()
	d.cache[ch.size] = append(d.cache[ch.size], ch)
	d.cachedBytes += ch.size
}

// create makes a chunk of size on d. When the device is out of memory it
// releases every cached chunk and tries once more.
func (b *Broker) create(d *device, size uint64) (*chunk, error) {
	h, err := d.sm.CreateShareable(size)
	if errors.Is(err, cudart.ErrOutOfMemory) && d.cachedBytes > 0 {
		b.log.Info("device out of memory: releasing the broker's cache", zap.Int("gpu", d.index), zap.Uint64("cached_bytes", d.cachedBytes))
		b.releaseCache(d)
		h, err = d.sm.CreateShareable(size)
	}
	if err != nil {
		return nil, err
	}
	// The descriptor is kept for the chunk's life and sent with each
	// grant (the kernel gives the client its own copy): on a GPU an
	// export costs half a millisecond, thirty times a cached grant.
	fd, err := d.sm.Export(h)
	if err != nil {
		if rerr := d.sm.Release(h); rerr != nil {
			b.log.Error("releasing a chunk that could not be exported", zap.Int("gpu", d.index), zap.Error(rerr))
		}
		return nil, fmt.Errorf("exporting: %w", err)
	}
	b.nextID++
	d.chunks++
	d.creates++
	owner := ""
	if d.dirtyReleased {
		owner = ownerUnknown
	}
	return &chunk{id: b.nextID, dev: d, h: h, fd: fd, size: size, owner: owner}, nil
}

// Trim releases every cached chunk that has waited in its cache for
// longer than idle, so that memory no client has asked for in that time
// goes back to the driver, where processes that do not use the broker
// can have it. It returns the bytes released. `allocd serve --broker`
// calls it periodically (--broker-cache-idle).
func (b *Broker) Trim(idle time.Duration) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	cutoff := time.Now().Add(-idle)
	var released uint64
	for _, d := range b.devs {
		for size, list := range d.cache {
			kept := list[:0]
			for _, ch := range list {
				if ch.cached.Before(cutoff) {
					d.cachedBytes -= ch.size
					released += ch.size
					b.releaseChunk(ch)
				} else {
					kept = append(kept, ch)
				}
			}
			clear(list[len(kept):])
			if len(kept) == 0 {
				delete(d.cache, size)
			} else {
				d.cache[size] = kept
			}
		}
	}
	return released
}

// releaseCache releases every cached chunk of d.
func (b *Broker) releaseCache(d *device) {
	for _, list := range d.cache {
		for _, ch := range list {
			d.cachedBytes -= ch.size
			b.releaseChunk(ch)
		}
	}
	clear(d.cache)
}

// releaseChunk releases a chunk that is in no list.
func (b *Broker) releaseChunk(ch *chunk) {
	d := ch.dev
	_ = unix.Close(ch.fd)
	if err := d.sm.Release(ch.h); err != nil {
		b.log.Error("releasing a chunk", zap.Int("gpu", d.index), zap.Uint64("size", ch.size), zap.Error(err))
	}
	d.chunks--
	d.releases++
	if ch.owner != "" {
		d.dirtyReleased = true
	}
}

// scrubMemory zeroes ch through a mapping of the broker's own, on the
// device's scrub stream, and waits for it. It runs without the broker's
// lock: ch is held by the client it is being granted to, and only that
// client's goroutine uses it until the grant is sent.
func (b *Broker) scrubMemory(d *device, ch *chunk) (took time.Duration, err error) {
	start := time.Now()
	dev := b.cfg.Devices[d.index]
	d.streamOnce.Do(func() { d.stream, d.streamErr = dev.StreamCreate() })
	if d.streamErr != nil {
		return 0, fmt.Errorf("creating the scrub stream: %w", d.streamErr)
	}
	p, err := d.sm.Reserve(ch.size)
	if err != nil {
		return 0, fmt.Errorf("reserving %d bytes of address space: %w", ch.size, err)
	}
	defer func() {
		if e := d.sm.ReleaseRange(p, ch.size); e != nil && err == nil {
			err = e
		}
	}()
	if err := d.sm.Map(p, ch.size, ch.h); err != nil {
		return 0, fmt.Errorf("mapping: %w", err)
	}
	err = dev.MemsetAsync(p, 0, ch.size, d.stream)
	if err == nil {
		err = dev.StreamSynchronize(d.stream)
	}
	if e := d.sm.Unmap(p, ch.size); err == nil {
		err = e
	}
	return time.Since(start), err
}

// giveBack serves a Return.
func (b *Broker) giveBack(c *client, r Return) Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	ch := c.held[r.Chunk]
	if ch == nil {
		return b.refuse(r.Req, c.tenant, nil, ReasonInvalid, 0, 0, 0, "chunk %d is not held by this client", r.Chunk)
	}
	b.unhold(ch)
	b.counter(c.tenant, ch.dev.index).returned += ch.size
	ch.dev.putCached(ch)
	return Returned{Req: r.Req, Chunk: r.Chunk}
}

// unhold takes ch from its holder's accounts.
func (b *Broker) unhold(ch *chunk) {
	c := ch.holder
	delete(c.held, ch.id)
	ch.dev.heldBytes -= ch.size
	b.counter(c.tenant, ch.dev.index).held -= ch.size
}

func (b *Broker) usage(c *client, u Usage) Message {
	b.mu.Lock()
	defer b.mu.Unlock()
	if int(u.Device) >= len(b.devs) {
		return b.refuse(u.Req, c.tenant, nil, ReasonInvalid, 0, 0, 0, "no device %d: the broker has %d", u.Device, len(b.devs))
	}
	d := b.devs[u.Device]
	rep := UsageReport{Req: u.Req, Granted: b.counter(c.tenant, d.index).held}
	if pol, ok := b.tenants.Lookup(c.tenant); ok {
		rep.Quota, rep.Limited = pol.QuotaOn(d.index, d.info.UUID)
		if !rep.Limited {
			rep.Quota = 0
		}
	}
	return rep
}

// reclaim returns everything c holds to the caches: its connection has
// closed and its process has exited, so no mapping of its chunks is
// left.
func (b *Broker) reclaim(c *client) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(c.held) > 0 {
		perGPU := make(map[int]uint64)
		for _, ch := range c.held {
			perGPU[ch.dev.index] += ch.size
		}
		for _, ch := range sortedChunks(c.held) {
			b.unhold(ch)
			b.counter(c.tenant, ch.dev.index).reclaimed += ch.size
			ch.dev.putCached(ch)
		}
		b.reclaims[c.tenant]++
		b.log.Info("client went away holding memory: reclaimed", zap.Uint64("client", c.id), zap.String("tenant", c.tenant),
			zap.Int32("pid", c.pid), zap.Any("bytes_by_gpu", perGPU))
	}
	delete(b.clients, c.id)
	if b.stopping && b.liveClientsLocked() == 0 {
		b.closeStopped()
	}
}

func sortedChunks(m map[uint64]*chunk) []*chunk {
	out := make([]*chunk, 0, len(m))
	for _, ch := range m {
		out = append(out, ch)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

func (b *Broker) liveClientsLocked() int {
	n := 0
	for _, c := range b.clients {
		if !c.gone {
			n++
		}
	}
	return n
}

func (b *Broker) closeStopped() {
	select {
	case <-b.stopped:
	default:
		close(b.stopped)
	}
}

// Check walks every structure of the broker and reports each broken
// invariant: every chunk in one place, the caches' and holders' sums
// equal to the counters, and the tenants' figures equal to their
// clients'.
func (b *Broker) Check() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	var errs []error
	seen := make(map[uint64]string)
	place := func(ch *chunk, where string) {
		if prev, dup := seen[ch.id]; dup {
			errs = append(errs, fmt.Errorf("chunk %d is in %s and in %s", ch.id, prev, where))
		}
		seen[ch.id] = where
	}
	held := make(map[tenantKey]uint64)
	for _, d := range b.devs {
		var cached uint64
		n := 0
		for size, list := range d.cache {
			for _, ch := range list {
				place(ch, fmt.Sprintf("GPU %d's cache", d.index))
				if ch.size != size || ch.dev != d || ch.holder != nil {
					errs = append(errs, fmt.Errorf("cached chunk %d (size %d, holder %v) is in GPU %d's %d-byte list", ch.id, ch.size, ch.holder != nil, d.index, size))
				}
				cached += ch.size
				n++
			}
		}
		if cached != d.cachedBytes {
			errs = append(errs, fmt.Errorf("GPU %d: cached chunks sum to %d bytes, the counter says %d", d.index, cached, d.cachedBytes))
		}
		var heldOnDev uint64
		for _, c := range b.clients {
			for _, ch := range c.held {
				if ch.dev == d {
					heldOnDev += ch.size
					n++
				}
			}
		}
		if heldOnDev != d.heldBytes {
			errs = append(errs, fmt.Errorf("GPU %d: held chunks sum to %d bytes, the counter says %d", d.index, heldOnDev, d.heldBytes))
		}
		if n != d.chunks {
			errs = append(errs, fmt.Errorf("GPU %d: %d chunks found, %d made and not released", d.index, n, d.chunks))
		}
	}
	for id, c := range b.clients {
		if c.id != id {
			errs = append(errs, fmt.Errorf("client %d is filed as %d", c.id, id))
		}
		for cid, ch := range c.held {
			place(ch, fmt.Sprintf("client %d", c.id))
			if ch.id != cid || ch.holder != c || ch.owner != c.tenant {
				errs = append(errs, fmt.Errorf("chunk %d held by client %d (tenant %q) names holder %v, owner %q", ch.id, c.id, c.tenant, ch.holder != nil, ch.owner))
			}
			held[tenantKey{c.tenant, ch.dev.index}] += ch.size
		}
	}
	for k, cnt := range b.counters {
		if held[k] != cnt.held {
			errs = append(errs, fmt.Errorf("tenant %q on GPU %d: clients hold %d bytes, the counter says %d", k.tenant, k.dev, held[k], cnt.held))
		}
		delete(held, k)
	}
	for k, v := range held {
		errs = append(errs, fmt.Errorf("tenant %q on GPU %d holds %d bytes with no counter", k.tenant, k.dev, v))
	}
	return errors.Join(errs...)
}

// Close releases every chunk the broker holds in its caches and stops
// serving. Chunks still held by clients stay valid for them (their
// imported handles keep the memory) and are released with the broker's
// handle. Call it after Stop.
func (b *Broker) Close() error {
	b.mu.Lock()
	b.stopping, b.closing = true, true
	ls := b.listeners
	b.listeners = nil
	b.mu.Unlock()
	for _, l := range ls {
		_ = l.Close()
	}
	b.mu.Lock()
	for _, c := range b.clients {
		if c.conn != nil {
			_ = c.conn.Close()
		}
	}
	b.mu.Unlock()
	b.conns.Wait()
	b.mu.Lock()
	defer b.mu.Unlock()
	var errs []error
	for _, d := range b.devs {
		b.releaseCache(d)
		for _, c := range b.clients {
			for _, ch := range sortedChunks(c.held) {
				if ch.dev == d {
					b.unhold(ch)
					b.releaseChunk(ch)
				}
			}
		}
		// No scrub runs now (every connection has ended): take the stream,
		// or make sure none is made.
		d.streamOnce.Do(func() { d.streamErr = errClosed })
		if d.streamErr == nil {
			if err := b.cfg.Devices[d.index].StreamDestroy(d.stream); err != nil {
				errs = append(errs, err)
			}
			d.streamErr = errClosed
		}
	}
	for _, c := range b.clients {
		closePidfd(c)
	}
	clear(b.clients)
	return errors.Join(errs...)
}

// errClosed marks a device's scrub stream once Close has run.
var errClosed = errors.New("broker closed")
