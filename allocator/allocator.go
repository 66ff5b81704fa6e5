// Package allocator is allocd's caching policy: a device-memory allocator
// that behaves like PyTorch's CUDA caching allocator
// (c10/cuda/CUDACachingAllocator.cpp) on top of a cudart.Device.
// Open(device) is the one call a program needs: it opens CUDA device N,
// configured by ALLOCD_CONF; OpenDevices does so for every GPU. New and
// NewDevices take a device and a Config of the caller's own instead.
//
//	a, err := allocator.Open(0) // honours ALLOCD_CONF and ALLOCD_DEVICE
//	if err != nil { ... }
//	defer a.Close()
//	p, err := a.Malloc(64<<20, stream)
//	...
//	a.Free(p)
//
// # Environment
//
// Open and OpenDevices read these as every allocd tool does (package
// devspec parses the device variables for all of them):
//
//   - ALLOCD_CONF: the configuration, in PYTORCH_CUDA_ALLOC_CONF's grammar
//     (ParseConfig); unset means PyTorch's defaults. WithConfig overrides it.
//   - ALLOCD_DEVICE: "cuda" (or unset) for the GPU; "sim" for a simulated
//     device, "sim:N" for N of them. Anything else is an error; a missing
//     driver is an error too, never a silent switch to the simulator.
//   - ALLOCD_SIM_CAPACITY: each simulated device's memory, in bytes or with
//     a KiB, MiB, GiB or TiB suffix (devspec.ParseSize); DefaultSimCapacity
//     (141 GiB) unset.
//
// # Snapshots and history
//
// Snapshot returns the state as a *snapshot.Snapshot, the shape of
// torch.cuda.memory._snapshot(); encoding/json renders it with PyTorch's
// keys and WriteSnapshot writes the pickle memory_viz opens.
// RecordHistory switches the event history on and off at run time, with
// Go stack frames of each Malloc and Free when asked.
//
// # Policy
//
// Requests round up to a multiple of 512 bytes (or to a power-of-two
// division with roundup_power2_divisions). A rounded size of at most 1 MiB
// is served from the small pool, whose segments are 2 MiB; larger sizes
// from the large pool, whose segments are 20 MiB for requests below 10 MiB
// and the request rounded up to 2 MiB otherwise. A request takes the
// smallest free block of its stream that fits (lowest address among equal
// sizes), split when the remainder is worth keeping; a freed block merges
// with its free neighbours. Blocks never cross streams. A block used by
// other streams (RecordStream) returns to the pool only once an event
// recorded on each of them has completed. When the device says no, cached
// blocks are released and the device asked once more before an OOMError.
// Segments come from a segment source (segments.go): one device malloc
// each, or, with expandable_segments:True, virtual ranges that grow by
// mapping pages at their end (expandable.go, over the ranges and pages
// of package allocator/internal/vmm).
//
// # Concurrency and cost
//
// Each stream has a shard with its own lock: its free indexes, its
// allocated blocks and its share of the statistics. A cached Malloc locks
// only its stream's shard, and a Free only the shard of the block's
// stream (found through an address-sorted directory of segments that is
// read without a lock), so goroutines on different streams do not contend.
// Everything else (device calls, the OOM path, EmptyCache, garbage
// collection, event queues, history, statistics reads, snapshots, Check)
// runs with the allocator's mutex and every shard's lock, taken in stream
// order, and sees one consistent whole. Statistics stay exact: counts are
// folded from the shards when read, and a peak is never passed on the hot
// path, whose increases stay within per-shard caps that add up to no more
// than the peak (shard.go). A shard lives only while its stream has live
// blocks or was used lately: ReleaseStream, EmptyCache and idle sweeps
// release the rest, so the whole costs O(live streams) (streams.go). A
// cached Malloc and Free allocate nothing on
// the Go heap, make no device call, read no clock and log nothing; the
// device is reached only to grow or release a segment, and to poll events
// while RecordStream'd blocks are pending.
package allocator

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/allocd/allocd/allocator/internal/vmm"
	"github.com/allocd/allocd/blocks"
	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/internal/eventpool"
)

// Sizes of PyTorch's policy.
const (
	minBlockSize   = 512      // every size is a multiple of this
	smallSize      = 1 << 20  // largest request served by the small pool
	smallBuffer    = 2 << 20  // small-pool segment size
	largeBuffer    = 20 << 20 // large-pool segment size for requests below minLargeAlloc
	minLargeAlloc  = 10 << 20 // requests from here get their own rounded segment
	roundLarge     = 2 << 20  // rounding of large segments
	maxRequestSize = 1 << 60  // beyond this, rounding would overflow
)

// Errors returned by the allocator; test with errors.Is. Every failed call
// leaves the allocator as it was (an OOM still counts in num_ooms).
var (
	// ErrOutOfMemory: the request could not be satisfied. The error is an
	// *OOMError and errors.Is(err, cudart.ErrOutOfMemory) holds too.
	ErrOutOfMemory = errors.New("out of memory")
	// ErrUnknownPointer: Free or RecordStream of an address this allocator
	// did not hand out.
	ErrUnknownPointer = errors.New("unknown pointer")
	// ErrDoubleFree: Free of a block already freed.
	ErrDoubleFree = errors.New("double free")
	// ErrInvalidStream: a stream the device does not know.
	ErrInvalidStream = errors.New("invalid stream")
	// ErrClosed: a call after Close.
	ErrClosed = errors.New("allocator closed")
	// ErrLiveBlocks: Close found allocations never freed (all memory is
	// still returned to the device).
	ErrLiveBlocks = errors.New("blocks still allocated")
	// ErrNotSupported: a configuration this build or device cannot serve.
	ErrNotSupported = errors.New("not supported")
)

// OOMError reports an allocation the device could not satisfy, with the
// facts PyTorch's message gives.
type OOMError struct {
	// Device is the device index.
	Device int
	// Requested is the size asked for; AllocSize the segment size the
	// allocator tried to obtain.
	Requested, AllocSize uint64
	// DeviceTotal and DeviceFree are the device's memory at the failure.
	DeviceTotal, DeviceFree uint64
	// Allowed is the per-process cap (per_process_memory_fraction), 0 when
	// unset.
	Allowed uint64
	// Allocated is memory handed out by this allocator; Reserved the
	// memory it holds from the device.
	Allocated, Reserved uint64
	// Cause is the device's error, if it gave one.
	Cause error
}

// Error formats the facts in PyTorch's order.
func (e *OOMError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "allocd: out of memory: tried to allocate %s (a request of %d bytes) on device %d. ",
		FormatSize(e.AllocSize), e.Requested, e.Device)
	fmt.Fprintf(&b, "Device %d has a total capacity of %s of which %s is free. ",
		e.Device, FormatSize(e.DeviceTotal), FormatSize(e.DeviceFree))
	if e.Allowed != 0 {
		fmt.Fprintf(&b, "This process may reserve at most %s (per_process_memory_fraction). ", FormatSize(e.Allowed))
	}
	unalloc := e.Reserved - e.Allocated
	fmt.Fprintf(&b, "Of the memory this allocator holds, %s is allocated and %s is reserved but unallocated.",
		FormatSize(e.Allocated), FormatSize(unalloc))
	if unalloc > 0 && unalloc >= e.Reserved/10 && unalloc >= 64<<20 {
		b.WriteString(" If reserved but unallocated memory is large, try ALLOCD_CONF=expandable_segments:True to avoid fragmentation.")
	}
	if e.Cause != nil {
		fmt.Fprintf(&b, " (device: %v)", e.Cause)
	}
	return b.String()
}

// Is makes errors.Is hold for ErrOutOfMemory and cudart.ErrOutOfMemory.
func (e *OOMError) Is(target error) bool {
	return target == ErrOutOfMemory || target == cudart.ErrOutOfMemory
}

// Unwrap returns the device's error.
func (e *OOMError) Unwrap() error { return e.Cause }

// FormatSize renders a byte count as PyTorch's memory_summary does:
// "512 B", "2.00 MiB", "1.50 GiB" (devspec.FormatSize).
func FormatSize(n uint64) string { return devspec.FormatSize(n) }

// Option configures New.
type Option func(*options)

type options struct {
	log               *zap.Logger
	history           HistoryOptions
	cfg               *Config        // WithConfig: used by Open instead of ALLOCD_CONF
	pytorchExpandable bool           // WithPyTorchExpandable
	maxStreams        int            // WithMaxStreams
	expLargePage      uint64         // pageOf20MiB (tests)
	noLend            bool           // WithoutLending (tests, export_test.go)
	noPark            bool           // WithoutParking (tests, export_test.go)
	exactGrowth       bool           // WithoutGrowthRounding (tests, export_test.go)
	slowFromLarge     bool           // WithoutHotSmallFromLarge (tests, export_test.go)
	broker            *broker.Client // WithBroker
	brokerFallback    bool           // WithBroker
	ownsBroker        bool           // Open dialled the broker: Close closes it
}

// WithLogger sets the logger for segment growth and release, OOMs and
// configuration. The default logs nothing. Nothing is logged per malloc.
func WithLogger(l *zap.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.log = l
		}
	}
}

// pool is one of a shard's two block pools.
type pool struct {
	free     *blocks.FreeIndex
	small    bool
	stat     Pool
	sh       *shard
	recycler blocks.Recycler
}

// pendingEvent is a block waiting for an event on a stream that used it.
type pendingEvent struct {
	event cudart.Event
	block *blocks.Block
}

// eventQueue holds one stream's pending events in record order.
type eventQueue struct {
	stream cudart.Stream
	items  []pendingEvent
}

// Allocator is a caching device-memory allocator for one device. It is
// safe for concurrent use.
type Allocator struct {
	mu    sync.Mutex // world mode: mu, then every shard's (shard.go)
	world bool       // in world mode
	// capsDirty: a hot statistic or a peak changed in world mode, so
	// unlockWorld shares out the caps again.
	capsDirty bool
	// noPark (tests): every shard, those made later included, frees as
	// PyTorch does, straight into the index (shard.noPark).
	noPark bool
	// noLend (tests): the out-of-memory path lends nothing (expandable.go).
	noLend bool
	// slowFromLarge (tests): small requests at the limit take the large
	// pool's blocks in world mode only (smallFromLargeHot).
	slowFromLarge bool
	favored       *shard // the shard whose change marked the caps dirty
	// owner is the shard that keeps the peaks itself, or nil (shard.go,
	// "The sole shard"). Written with every shard lock held.
	owner  *shard
	res    *reservoir // slack no shard holds as cap (shard.go)
	dev    cudart.Device
	info   cudart.Info
	cfg    Config
	log    *zap.Logger
	closed bool

	shards   []*shard // one per live stream, in stream order (streams.go)
	byStream map[cudart.Stream]*shard
	shardTab atomic.Pointer[shardTable]
	// doomed are shards released by ReleaseStream that wait to be idle;
	// the next idle sweep runs once newShards reaches sweepEvery; swept
	// are streams recent sweeps released and misses the new shards of
	// those since the last sweep; maxStreams is the most shards at once
	// (streams.go).
	doomed     []*shard
	newShards  int
	sweepEvery int
	// unlockedMallocs counts the device mallocs running outside world
	// mode (release_lock_on_cudamalloc), each holding its shard busy.
	unlockedMallocs int
	swept           map[cudart.Stream]struct{}
	misses          int
	maxStreams      int
	dir             atomic.Pointer[directory] // segments by address, for Free
	segs            segTable                  // every segment, from any source (segments.go)
	scratch         []*blocks.Block           // reused by release paths
	// gcSearches counts searches of each pool while garbage collection is
	// on; blocks age by it (PyTorch's get_free_blocks_call_count).
	gcSearches [numPools]uint64

	queues      []eventQueue
	pending     int            // events not yet completed
	spareEvents eventpool.Pool // created events ready for reuse

	total   uint64 // device memory
	allowed uint64 // per-process cap; total when no fraction is set
	capped  bool   // per_process_memory_fraction set

	stats   Stats
	be      backend         // the policy behind the public calls (backend.go)
	async   *asyncAllocator // be, for backend:cudaMallocAsync; nil otherwise
	src     source          // where segments come from (segments.go)
	mal     mallocSource    // the cudaMalloc source; src unless exp is set
	exp     *vmm.Space      // expandable_segments:True's memory (expandable.go); nil otherwise
	history *history        // nil unless recording history

	// Private pools (pools.go), by id and by number; the captures under
	// way (BeginAllocateToPool) in the order they began, and their count;
	// the blocks whose events wait for the last capture to end. routes
	// and livePools are what Malloc and MallocInPool read without locks.
	private     map[PoolID]*privatePool
	privateSeq  map[uint64]*privatePool
	lastPoolSeq uint64 // the pool number newPoolSeq gave last
	captures    []capture
	capturing   int
	deferred    []*blocks.Block
	routes      atomic.Pointer[[]capture]
	livePools   atomic.Pointer[[]poolRef]
	ownsDevice  bool           // opened by Open: Close closes the device
	broker      *broker.Client // WithBroker, closed by Close when Open dialled it
	brokerMem   *brokerMemory  // the broker's segment source, when there is one
}

// call is the state of one Malloc or Free on its way down the slow path:
// the caller's stack in the history and the device's out-of-memory error.
// It lives on the caller's stack and is passed by pointer. Steps that run
// outside a world-mode Malloc or Free (EmptyCache, Close, stream sweeps,
// the hot paths, which record nothing) pass nil; their events carry no
// stack.
type call struct {
	stack  uint32 // interned stack of the caller (history.capture), or 0
	devErr error  // the device's last out-of-memory error in this call
	lender *pool  // the pool of the block grow returned when not the request's own (expandable.go: lent, or small from large), or nil
}

// New returns an allocator for dev. It reads the device's total memory once
// (for per_process_memory_fraction and error messages) and otherwise does
// not touch the device until the first allocation.
func New(dev cudart.Device, cfg Config, opts ...Option) (*Allocator, error) {
	if dev == nil {
		return nil, fmt.Errorf("allocator: nil device: %w", cudart.ErrInvalidValue)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	o := options{log: zap.NewNop(), maxStreams: DefaultMaxStreams}
	for _, opt := range opts {
		opt(&o)
	}
	if o.maxStreams < 1 {
		return nil, fmt.Errorf("allocator: WithMaxStreams(%d): at least 1 stream (the default stream) is needed: %w", o.maxStreams, cudart.ErrInvalidValue)
	}
	if err := o.history.validate(); err != nil {
		return nil, err
	}
	if o.broker != nil {
		// The broker's chunks are physical handles: they need expandable
		// segments to be mapped.
		cfg.ExpandableSegments = true
	}
	var vm cudart.VirtualMemory
	var brokerMem *brokerMemory
	if cfg.ExpandableSegments {
		var err error
		if vm, err = checkExpandable(dev, cfg); err != nil {
			return nil, err
		}
		if o.broker != nil {
			if brokerMem, vm, err = newBrokerMemory(dev, vm, o.broker, o.brokerFallback, o.log); err != nil {
				return nil, err
			}
		}
	}
	_, total, err := dev.MemGetInfo()
	if err != nil {
		return nil, fmt.Errorf("allocator: reading device memory: %w", err)
	}
	a := &Allocator{
		dev:   dev,
		info:  dev.Info(),
		cfg:   cfg,
		log:   o.log,
		total: total,

		maxStreams: o.maxStreams,
		sweepEvery: idleSweepMin,
		noPark:     o.noPark,
	}
	a.res = new(reservoir)
	a.dir.Store(&directory{})
	a.addShard(cudart.DefaultStream).mu.Unlock()
	a.mal = mallocSource{dev: dev, table: &a.segs, stats: &a.stats, maxSplit: cfg.MaxSplitSize}
	a.src = &a.mal
	a.be = native{a}
	if vm != nil {
		a.exp = vmm.New(dev, vm, vmm.Config{
			Total:       total,
			SmallPage:   smallBuffer,
			LargePage:   largeBuffer,
			ReclaimPage: cmp.Or(o.expLargePage, cfg.ExpandablePageSize, DefaultExpandablePage),
			Reclaim:     !o.pytorchExpandable,
			Coarse:      cfg.ExpandableReclaim == ReclaimCoarse,
			Standby:     !o.pytorchExpandable,
			Exact:       o.exactGrowth,
		}, o.log)
		a.src = expSource{space: a.exp, table: &a.segs, stats: &a.stats}
	}
	a.allowed = total
	a.noLend = o.noLend
	a.slowFromLarge = o.slowFromLarge
	a.brokerMem = brokerMem
	if o.ownsBroker {
		a.broker = o.broker
	}
	if cfg.Backend == BackendAsync {
		if a.async, err = newAsyncAllocator(a, dev); err != nil {
			return nil, err
		}
		a.be = a.async
	}
	if cfg.PerProcessMemoryFraction > 0 {
		a.capped = true
		a.allowed = uint64(cfg.PerProcessMemoryFraction * float64(total))
	}
	a.setExpandableCeiling()
	a.stats.MaxSplitSize = a.maxSplitStat()
	if o.history.MaxEntries > 0 {
		a.history = newHistory(o.history)
	}
	a.refreshGates()
	conf := cfg.String() // the keys that differ from PyTorch's defaults
	if conf == "" {
		conf = "defaults"
	}
	a.log.Info("allocator started",
		zap.Int("device", a.info.Index), zap.String("name", a.info.Name),
		zap.Uint64("total_bytes", total), zap.String("conf", conf))
	return a, nil
}

func (a *Allocator) maxSplitStat() int64 {
	if a.cfg.MaxSplitSize == math.MaxUint64 {
		return -1
	}
	return int64(a.cfg.MaxSplitSize)
}

// Device returns the device the allocator draws from.
func (a *Allocator) Device() cudart.Device { return a.dev }

// Config returns the configuration in effect.
func (a *Allocator) Config() Config { return a.cfg }

// roundSize is PyTorch's round_size.
func (a *Allocator) roundSize(size uint64) uint64 {
	if size < minBlockSize {
		return minBlockSize
	}
	div := a.cfg.RoundupPower2Divisions[roundupIndex(size)]
	if div > 1 && size > minBlockSize*div {
		return roundupPower2NextDivision(size, div)
	}
	return (size + minBlockSize - 1) / minBlockSize * minBlockSize
}

// roundupIndex maps a size to its power-of-two interval: sizes below 2 MiB
// to 0, [2^(20+i), 2^(21+i)) to i, the largest interval catching the rest.
func roundupIndex(size uint64) int {
	i := bits.Len64(size) - 1 - 20
	return max(0, min(i, roundupIntervals-1))
}

func roundupPower2NextDivision(size, divisions uint64) uint64 {
	if isPow2(size) {
		return size
	}
	floor := uint64(1) << (bits.Len64(size) - 1)
	step := floor >> (bits.Len64(divisions) - 1)
	if step == 0 {
		return floor << 1
	}
	rounded := size &^ (step - 1)
	if rounded == size {
		return size
	}
	return rounded + step
}

// poolOf returns the pool that holds b (world mode).
func (a *Allocator) poolOf(b *blocks.Block) *pool {
	sh := a.shardOf(cudart.Stream(b.Segment.Stream))
	if b.Segment.Small {
		return &sh.small
	}
	return &sh.large
}

// checkStream admits s if it is known, or the device vouches for it and
// there is room for it (makeRoom), and returns its shard (world mode). A
// stream in use is no longer doomed (ReleaseStream): its handle may
// belong to a new stream.
func (a *Allocator) checkStream(s cudart.Stream) (*shard, error) {
	var pp *privatePool
	if uint64(s)&blocks.PoolStreamBit != 0 {
		var err error
		if pp, err = a.checkPoolStream(s); err != nil {
			return nil, err
		}
	}
	if sh := a.byStream[s]; sh != nil {
		a.undoom(sh)
		return sh, nil
	}
	// No stream query while a capture is under way: it would end the
	// capture (pools.go). The capturing streams are valid.
	if c, ok := a.dev.(cudart.StreamChecker); ok && a.capturing == 0 {
		ds := blocks.DeviceStream(uint64(s))
		if err := c.CheckStream(cudart.Stream(ds)); err != nil {
			return nil, fmt.Errorf("allocator: stream %#x: %w: %w", ds, ErrInvalidStream, err)
		}
	}
	if err := a.makeRoom(s); err != nil {
		return nil, err
	}
	sh := a.addShard(s)
	if pp != nil {
		sh.pool = pp
		pp.shards++
	}
	return sh, nil
}

// Malloc returns size bytes of device memory for use on stream. The address
// is aligned to 512 bytes. Malloc(0) returns the zero Ptr and no error, as
// PyTorch returns a null pointer for empty tensors; Free(0) is a no-op.
//
// A request the device cannot satisfy returns an *OOMError after the cache
// has been released and the device asked again.
//
// While a capture is under way (BeginAllocateToPool), a Malloc on a stream
// its filter accepts is served from its private pool.
func (a *Allocator) Malloc(size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	if size == 0 {
		return 0, nil
	}
	if a.routes.Load() != nil || uint64(stream)&blocks.PoolStreamBit != 0 {
		return a.routedMalloc(size, stream)
	}
	if sh := a.lookupShard(stream); sh != nil {
		if !sh.mu.TryLock() { // sh.lock(), with TryLock inlined here
			spinLockSlow(&sh.mu)
		}
		p, busy := a.fastMalloc(sh, size, false)
		sh.mu.Unlock()
		if p != 0 {
			return p, nil
		}
		if busy {
			return a.retryMalloc(size, stream)
		}
	}
	return a.slowMalloc(size, stream)
}

// mallocStream is Malloc on stream, a device stream or a pool stream,
// after routing. Malloc repeats its body inline: the call would cost
// about 3 ns of a 60 ns cached pair (BenchmarkCachedPair).
func (a *Allocator) mallocStream(size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	if sh := a.lookupShard(stream); sh != nil {
		if !sh.mu.TryLock() { // sh.lock(), with TryLock inlined here
			spinLockSlow(&sh.mu)
		}
		p, busy := a.fastMalloc(sh, size, false)
		sh.mu.Unlock()
		if p != 0 {
			return p, nil
		}
		if busy {
			return a.retryMalloc(size, stream)
		}
	}
	return a.slowMalloc(size, stream)
}

// retryMalloc is Malloc after its hot path found its caps short, which it
// may not pass on its first try (fastMalloc): it gathers the other shards'
// slack (gatherSlack) and runs the hot path again, now free to escalate;
// when that found the allocator busy, it waits for the holder
// (awaitWorld) and runs it again, up to busyRetries times, before it takes
// the slow path.
func (a *Allocator) retryMalloc(size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	for i := range busyRetries + 1 {
		if i == 0 {
			a.gatherSlack(stream)
		} else {
			a.awaitWorld()
		}
		sh := a.lookupShard(stream)
		if sh == nil {
			break
		}
		sh.lock()
		p, busy := a.fastMalloc(sh, size, true)
		sh.mu.Unlock()
		if p != 0 {
			return p, nil
		}
		if !busy {
			break
		}
	}
	return a.slowMalloc(size, stream)
}

// busyRetries is how many times a hot path that had to escalate while
// another escalation or world-mode call held the allocator waits for it
// and starts again, before it takes the slow path itself.
const busyRetries = 2

// awaitWorld returns once the escalation or world-mode call that held the
// allocator's mutex has ended. A hot path that found the allocator busy
// waits here, holding no lock, and starts again rather than take the slow
// path: under load the slow path's world mode stops every shard, so one
// escalation would otherwise set off another stop in each goroutine that
// met it. The escalation just ended has usually shared out the caps the
// retry needs.
func (a *Allocator) awaitWorld() {
	spinLock(&a.mu)
	a.mu.Unlock()
}

// fastMalloc is Malloc's hot path under the stream's shard lock alone: a
// hit in the front cache or the free index. A hit that would pass the
// shard's caps, and cannot borrow, escalates (shard.go) when escalate is
// set. It returns 0 when the call needs world mode, having changed nothing
// but, perhaps, flushed the front cache; busy when that is only because
// the caps were short and escalate was not set, or another escalation or
// world-mode call held the allocator, so that the call may gather slack
// or wait, and try again (retryMalloc).
func (a *Allocator) fastMalloc(sh *shard, size uint64, escalate bool) (ptr cudart.Ptr, busy bool) {
	if size > sh.mallocMax {
		return 0, false
	}
	rounded := a.roundSize(size)
	if sh.parked != nil {
		if ptr := a.takeParked(sh, size, rounded); ptr != 0 {
			return ptr, false
		}
		a.flushParked(sh)
	}
	p := sh.poolFor(rounded)
	b := a.findFreeBlock(p, uint64(sh.stream), rounded)
	fromLarge := false
	if b == nil {
		if b = a.smallFromLargeHot(sh, p, rounded); b == nil {
			return 0, false
		}
		p, fromLarge = &sh.large, true
	}
	var d delta
	a.mallocDeltaOf(&d, p, b, rounded, size)
	if !a.fitsOrBorrow(sh, p.stat, &d) {
		if !escalate {
			return 0, true
		}
		return a.mallocEscalated(sh, p, b, &d, fromLarge)
	}
	p.free.Delete(b)
	a.allocFoundBlock(nil, p, b, &d)
	if fromLarge {
		sh.fromLarge++
	}
	return cudart.Ptr(b.Ptr), false
}

// mallocEscalated ends fastMalloc when the change d of handing out b
// from pool p passes sh's caps and it may escalate: with every shard held
// (escalate) it makes the change and settles the peaks (deescalate). It
// reports busy when another escalation or world-mode call held the
// allocator. A function of its own, so that fastMalloc, which seldom
// escalates, carries no deferred call.
func (a *Allocator) mallocEscalated(sh *shard, p *pool, b *blocks.Block, d *delta, fromLarge bool) (ptr cudart.Ptr, busy bool) {
	if !a.escalate(sh) {
		return 0, true
	}
	defer a.deescalate(sh)
	p.free.Delete(b)
	a.allocFoundBlock(nil, p, b, d)
	if fromLarge {
		sh.fromLarge++
	}
	return cudart.Ptr(b.Ptr), false
}

// slowMalloc is Malloc in world mode.
func (a *Allocator) slowMalloc(size uint64, stream cudart.Stream) (cudart.Ptr, error) {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return 0, fmt.Errorf("allocator: malloc: %w", ErrClosed)
	}
	sh, err := a.checkStream(stream)
	if err != nil {
		return 0, err
	}
	// sh stays while a device malloc runs unlocked (release_lock_on_cudamalloc).
	sh.busy++
	defer func() { sh.busy-- }()
	var c call
	if h := a.history; h != nil && h.depth > 0 {
		c.stack = h.capture()
	}
	if size > a.allowed || size > maxRequestSize {
		// No release of the cache can help: fail without touching it.
		return 0, a.outOfMemory(&c, size, size, stream, nil)
	}
	return a.backendMalloc(&c, sh, size)
}

// backendMalloc and backendFree call the backend's (backend.go) malloc
// and free by the concrete type: escape analysis cannot follow a call
// through an interface, so the call context passed down would move to the
// heap, one allocation per world-mode Malloc or Free.
func (a *Allocator) backendMalloc(c *call, sh *shard, size uint64) (cudart.Ptr, error) {
	if m := a.async; m != nil {
		return m.malloc(c, sh, size)
	}
	return native{a}.malloc(c, sh, size)
}

func (a *Allocator) backendFree(c *call, p cudart.Ptr) error {
	if m := a.async; m != nil {
		return m.free(c, p)
	}
	return native{a}.free(c, p)
}

// malloc is the native policy's Malloc in world mode, after the checks
// every backend shares.
func (n native) malloc(c *call, sh *shard, size uint64) (cudart.Ptr, error) {
	a, stream := n.a, sh.stream
	if a.pending > 0 && a.capturing == 0 { // no event query during a capture
		if err := a.processEvents(c); err != nil {
			return 0, err
		}
	}
	rounded := a.roundSize(size)
	p := sh.poolFor(rounded)
	b := a.getFreeBlock(p, uint64(stream), rounded)
	if b == nil {
		var err error
		if b, err = a.grow(c, p, stream, size, rounded); err != nil {
			return 0, err
		}
		if c.lender != nil {
			p = c.lender
		}
	}
	var d delta
	a.mallocDeltaOf(&d, p, b, rounded, size)
	a.allocFoundBlock(c, p, b, &d)
	return cudart.Ptr(b.Ptr), nil
}

// getFreeBlock is PyTorch's get_free_block: best fit within the stream,
// refusing oversize blocks for small requests and much larger blocks for
// oversize requests.
func (a *Allocator) getFreeBlock(p *pool, stream, size uint64) *blocks.Block {
	gc := a.gcEnabled()
	if gc {
		a.gcSearches[p.stat]++
	}
	b := a.findFreeBlock(p, stream, size)
	if b == nil {
		return nil
	}
	p.free.Delete(b)
	if gc {
		b.GCBase = a.gcSearches[p.stat]
	}
	return b
}

// findFreeBlock is getFreeBlock's search, which changes nothing.
func (a *Allocator) findFreeBlock(p *pool, stream, size uint64) *blocks.Block {
	b := p.free.LowerBound(stream, size)
	if b == nil {
		return nil
	}
	if b.Segment.Expandable {
		b = vmm.Fit(p.free, b)
	}
	maxSplit := a.cfg.MaxSplitSize
	if size < maxSplit && b.Size >= maxSplit {
		return nil
	}
	if size >= maxSplit && b.Size >= size+a.cfg.MaxNonSplitRounding {
		return nil
	}
	return b
}

func (a *Allocator) gcEnabled() bool {
	return a.capped && a.cfg.GarbageCollectionThreshold > 0
}

// outOfMemory is every out-of-memory return, as PyTorch handles it: count
// it in num_ooms, record an oom event (with the device's free bytes as its
// address, as PyTorch records it), log it once and return the error.
func (a *Allocator) outOfMemory(c *call, size, allocSize uint64, stream cudart.Stream, cause error) *OOMError {
	a.stats.NumOOMs++
	oom := a.oomError(size, allocSize, cause)
	a.record(c, actionOOM, oom.DeviceFree, allocSize, stream)
	a.log.Warn("out of memory", zap.Error(oom))
	return oom
}

func (a *Allocator) oomError(size, allocSize uint64, cause error) *OOMError {
	free, total, err := a.dev.MemGetInfo()
	if err != nil {
		free, total = 0, a.total
	}
	e := &OOMError{
		Device: a.info.Index, Requested: size, AllocSize: allocSize,
		DeviceTotal: total, DeviceFree: free,
		Allocated: uint64(a.folded().AllocatedBytes[PoolAll].Current),
		Reserved:  a.segs.reserved, Cause: cause,
	}
	if a.capped {
		e.Allowed = a.allowed
	}
	return e
}

// splits is PyTorch's should_split: whether a free block of blockSize
// bytes, handing out size bytes, gives up its remainder as a free block.
func splits(small, expandable bool, blockSize, size, maxSplit uint64) bool {
	remaining := blockSize - size
	if small || expandable {
		return remaining >= minBlockSize
	}
	return size < maxSplit && remaining > smallSize
}

// mallocDeltaOf is mallocDelta for handing out the free block b of pool p.
func (a *Allocator) mallocDeltaOf(d *delta, p *pool, b *blocks.Block, rounded, requested uint64) {
	exp, maxSplit := b.Segment.Expandable, a.cfg.MaxSplitSize
	mallocDelta(d, exp, b.IsSplit(), splits(p.small, exp, b.Size, rounded, maxSplit), b.Size, rounded, requested, maxSplit)
}

// allocFoundBlock is PyTorch's alloc_found_block: split off the remainder
// when d (b's mallocDeltaOf) hands out less than b, mark the block
// allocated and make the change d.
func (a *Allocator) allocFoundBlock(c *call, p *pool, b *blocks.Block, d *delta) {
	if got := uint64(d.allocBytes); got < b.Size {
		p.free.Insert(blocks.Split(b, got, &p.recycler))
	}
	b.Allocated = true
	b.Requested = uint64(d.requested)
	p.sh.active.put(b.Ptr, b)
	p.sh.stats.apply(p.stat, d)
	if a.world {
		a.settleShard(p.sh)
		a.record(c, actionAlloc, b.Ptr, b.Requested, cudart.Stream(b.Segment.Stream))
	}
}

// Free returns p, obtained from Malloc, to the cache. If other streams used
// the block (RecordStream), it becomes reusable only once their work
// recorded so far has completed. Free(0) is a no-op.
func (a *Allocator) Free(p cudart.Ptr) error {
	if p == 0 {
		return nil
	}
	if sh := a.dirLookup(uint64(p)); sh != nil {
		if !sh.mu.TryLock() { // sh.lock(), with TryLock inlined here
			spinLockSlow(&sh.mu)
		}
		ok, busy := a.fastFree(sh, uint64(p), false)
		sh.mu.Unlock()
		if ok {
			return nil
		}
		if busy {
			return a.retryFree(p)
		}
	}
	return a.slowFree(p)
}

// retryFree is Free after its hot path found its caps short or the
// allocator busy, as retryMalloc is Malloc.
func (a *Allocator) retryFree(p cudart.Ptr) error {
	for i := range busyRetries + 1 {
		if i > 0 {
			a.awaitWorld()
		}
		sh := a.dirLookup(uint64(p))
		if sh == nil {
			break
		}
		if i == 0 {
			a.gatherSlack(sh.stream)
		}
		sh.lock()
		ok, busy := a.fastFree(sh, uint64(p), true)
		sh.mu.Unlock()
		if ok {
			return nil
		}
		if !busy {
			break
		}
	}
	return a.slowFree(p)
}

// fastFree is Free's hot path under the shard lock alone: a block no
// other stream used, parked in the front cache. A change that would pass
// the shard's caps, and cannot borrow, escalates (shard.go) when escalate
// is set. It reports false when the call needs world mode, having changed
// nothing but, perhaps, flushed the front cache, and busy when that is
// only because the caps were short and escalate was not set, or another
// escalation or world-mode call held the allocator (fastMalloc).
func (a *Allocator) fastFree(sh *shard, ptr uint64, escalate bool) (ok, busy bool) {
	if sh.freeOff {
		return false, false
	}
	if sh.parked != nil {
		a.flushParked(sh)
	}
	slot, found := sh.active.find(ptr)
	if !found {
		return false, false
	}
	b := sh.active.vals[slot]
	if len(b.StreamUses) > 0 || b.Lent {
		return false, false
	}
	pl := &sh.large
	if b.Segment.Small {
		pl = &sh.small
	}
	// Only the inactive-split statistics can grow (in an expandable
	// segment they do not change).
	var d delta
	freeDelta(&d, b)
	if !a.freeFitsOrBorrow(sh, pl.stat, &d) {
		if !escalate || !a.escalate(sh) {
			return false, true
		}
		defer a.deescalate(sh)
	}
	sh.active.delAt(slot)
	a.release(pl, b)
	if sh.noPark {
		a.freeBlock(nil, pl, b)
	} else {
		a.park(sh, pl, b, &d)
	}
	a.repay(sh, pl.stat)
	return true, false
}

// release ends b's allocation: it counts it as freed (not yet returned
// to the pool).
func (a *Allocator) release(pl *pool, b *blocks.Block) {
	b.Allocated = false
	st := &pl.sh.stats // the pool's entries alone (hotStats)
	st.Allocation[pl.stat].sub(1)
	st.AllocatedBytes[pl.stat].sub(int64(b.Size))
	if b.Size >= a.cfg.MaxSplitSize {
		st.OversizeAllocations.sub(1)
	}
}

// slowFree is Free in world mode.
func (a *Allocator) slowFree(p cudart.Ptr) error {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return fmt.Errorf("allocator: free of %#x: %w", uint64(p), ErrClosed)
	}
	var c call
	if h := a.history; h != nil && h.depth > 0 {
		c.stack = h.capture()
	}
	return a.backendFree(&c, p)
}

// free is the native policy's Free in world mode.
func (n native) free(c *call, p cudart.Ptr) error {
	a := n.a
	b := a.activeBlock(uint64(p))
	if b == nil {
		return a.unknownPointer("free", p)
	}
	pl := a.poolOf(b)
	pl.sh.active.del(b.Ptr)
	a.release(pl, b)
	a.record(c, actionFreeRequested, b.Ptr, b.Requested, cudart.Stream(b.Segment.Stream))
	if b.Lent && a.capturing == 0 {
		a.returnLent(b)
	}
	if len(b.StreamUses) > 0 || b.Lent {
		if a.capturing > 0 {
			a.deferEvents(b)
			return nil
		}
		a.eventsOrSync(c, pl, b)
		return nil
	}
	a.freeBlock(c, pl, b)
	return nil
}

// eventsOrSync records events on the streams that used freed block b, or
// when that fails waits for the device instead, so that reusing b is
// safe, and logs why; b returns to pl when no event is pending.
func (a *Allocator) eventsOrSync(c *call, pl *pool, b *blocks.Block) {
	if err := a.insertEvents(b); err != nil {
		a.log.Error("recording stream events failed; synchronising the device", zap.Error(err))
		if serr := a.dev.Synchronize(); serr != nil {
			a.log.Error("device synchronize failed", zap.Error(serr))
		}
		b.StreamUses = b.StreamUses[:0]
	}
	if b.EventCount == 0 {
		a.freeBlock(c, pl, b)
	}
}

// unknownPointer explains a bad address: a double free when p starts a
// block that is already free or pending, unknown otherwise.
func (a *Allocator) unknownPointer(op string, p cudart.Ptr) error {
	for _, s := range a.segs.list {
		if uint64(p) < s.Ptr || uint64(p) >= s.Ptr+s.Size {
			continue
		}
		for b := s.Head; b != nil; b = b.Next {
			if b.Ptr == uint64(p) && !b.Allocated {
				return fmt.Errorf("allocator: %s of %#x: %w (the block is already free)", op, uint64(p), ErrDoubleFree)
			}
		}
		return fmt.Errorf("allocator: %s of %#x: %w (inside segment %#x but not the start of an allocated block)", op, uint64(p), ErrUnknownPointer, s.Ptr)
	}
	return fmt.Errorf("allocator: %s of %#x: %w", op, uint64(p), ErrUnknownPointer)
}

// freeBlock is PyTorch's free_block: merge with free neighbours, index the
// result and make the change freeDelta says.
func (a *Allocator) freeBlock(c *call, p *pool, b *blocks.Block) {
	sh := p.sh
	ptr, requested := b.Ptr, b.Requested // before merging moves them
	var d delta
	freeDelta(&d, b)
	blocks.Merge(b, p.free, &p.recycler)
	b.Requested = 0
	p.free.Insert(b)
	sh.stats.apply(p.stat, &d)
	if a.world {
		a.settleShard(sh)
		a.record(c, actionFreeCompleted, ptr, requested, cudart.Stream(b.Segment.Stream))
	}
}

// activeBlock returns the allocated block at address p, or nil (world
// mode).
func (a *Allocator) activeBlock(p uint64) *blocks.Block {
	for _, sh := range a.shards {
		if b := sh.active.get(p); b != nil {
			return b
		}
	}
	return nil
}

// RecordStream marks the allocation p as used by stream s, as
// torch.Tensor.record_stream does: when p is freed, its memory is reused
// only after the work queued on s up to that Free has completed.
func (a *Allocator) RecordStream(p cudart.Ptr, s cudart.Stream) error {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return fmt.Errorf("allocator: record stream: %w", ErrClosed)
	}
	return a.be.recordStream(p, s)
}

// recordStream is the native policy's RecordStream in world mode.
func (n native) recordStream(p cudart.Ptr, s cudart.Stream) error {
	a := n.a
	b := a.activeBlock(uint64(p))
	if b == nil {
		return a.unknownPointer("record stream", p)
	}
	if uint64(s)&blocks.PoolStreamBit != 0 {
		return fmt.Errorf("allocator: record stream %#x: %w (not a CUDA stream)", uint64(s), ErrInvalidStream)
	}
	if _, err := a.checkStream(s); err != nil {
		return err
	}
	if uint64(s) == blocks.DeviceStream(b.Segment.Stream) || (b.Lent && uint64(s) == b.Borrower) {
		return nil // its own stream: ordered already
	}
	for _, u := range b.StreamUses {
		if u == uint64(s) {
			return nil
		}
	}
	b.StreamUses = append(b.StreamUses, uint64(s))
	return nil
}

// insertEvents records an event on every stream that used b. On error the
// events already queued stay valid and complete normally; the caller
// synchronises the device for the rest.
func (a *Allocator) insertEvents(b *blocks.Block) error {
	for _, s := range b.StreamUses {
		ev, err := a.getEvent()
		if err != nil {
			return err
		}
		if err := a.dev.EventRecord(ev, cudart.Stream(s)); err != nil {
			a.spareEvents.Put(ev)
			return fmt.Errorf("allocator: recording an event on stream %#x: %w", s, err)
		}
		b.EventCount++
		a.pending++
		a.shardOf(cudart.Stream(b.Segment.Stream)).pendingEv++
		q := a.queue(cudart.Stream(s))
		q.items = append(q.items, pendingEvent{event: ev, block: b})
	}
	b.StreamUses = b.StreamUses[:0]
	return nil
}

// getEvent returns an idle event or a new one.
func (a *Allocator) getEvent() (cudart.Event, error) {
	ev, err := a.spareEvents.Get(a.dev)
	if err != nil {
		return 0, fmt.Errorf("allocator: creating an event: %w", err)
	}
	return ev, nil
}

func (a *Allocator) queue(s cudart.Stream) *eventQueue {
	for i := range a.queues {
		if a.queues[i].stream == s {
			return &a.queues[i]
		}
	}
	a.queues = append(a.queues, eventQueue{stream: s})
	return &a.queues[len(a.queues)-1]
}

// processEvents is PyTorch's process_events: in each stream's queue,
// retire events from the front while they have completed.
func (a *Allocator) processEvents(c *call) error {
	for i := range a.queues {
		q := &a.queues[i]
		for len(q.items) > 0 {
			pe := q.items[0]
			done, err := a.dev.EventQuery(pe.event)
			if err != nil {
				return fmt.Errorf("allocator: querying a stream event: %w", err)
			}
			if !done {
				break
			}
			q.items[0] = pendingEvent{}
			q.items = q.items[1:]
			a.retire(c, pe)
		}
	}
	a.dropEmptyQueues()
	return nil
}

func (a *Allocator) retire(c *call, pe pendingEvent) {
	a.spareEvents.Put(pe.event)
	a.pending--
	pe.block.EventCount--
	pl := a.poolOf(pe.block)
	pl.sh.pendingEv--
	if pe.block.EventCount == 0 {
		a.freeBlock(c, pl, pe.block)
	}
}

// dropEmptyQueues removes the event queues of streams with no pending
// event, so that the queues stay as many as the streams waited for.
func (a *Allocator) dropEmptyQueues() {
	a.queues = slices.DeleteFunc(a.queues, func(q eventQueue) bool { return len(q.items) == 0 })
}

// synchronizeAndFreeEvents waits for every pending event and returns their
// blocks to the pools.
func (a *Allocator) synchronizeAndFreeEvents(c *call) error {
	if a.pending == 0 {
		return nil
	}
	a.stats.NumSyncAllStreams++
	for i := range a.queues {
		q := &a.queues[i]
		for len(q.items) > 0 {
			pe := q.items[0]
			if err := a.dev.EventSynchronize(pe.event); err != nil {
				return fmt.Errorf("allocator: waiting for a stream event: %w", err)
			}
			q.items[0] = pendingEvent{}
			q.items = q.items[1:]
			a.retire(c, pe)
		}
	}
	a.dropEmptyQueues()
	return nil
}

// releaseCachedBlocks is PyTorch's release_cached_blocks: wait for pending
// events, then return every whole free segment to the device.
func (a *Allocator) releaseCachedBlocks(c *call) error {
	if err := a.synchronizeAndFreeEvents(c); err != nil {
		return err
	}
	return a.releaseSourceCached(c)
}

// EmptyCache waits for pending stream events, then returns every cached
// segment that holds no allocation to the device, as
// torch.cuda.empty_cache() does. Segments with a live block stay.
func (a *Allocator) EmptyCache() error {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return fmt.Errorf("allocator: empty cache: %w", ErrClosed)
	}
	if a.capturing > 0 {
		return fmt.Errorf("allocator: empty cache: %w", ErrCaptureUnderway)
	}
	a.stats.NumEmptyCache++
	if err := a.be.emptyCache(); err != nil {
		return err
	}
	a.dropIdle()
	return nil
}

// emptyCache is the native policy's EmptyCache: release_cached_blocks;
// with expandable segments the Space then starts over (vmm.Space.StartOver)
// from what is still allocated.
func (n native) emptyCache() error {
	a := n.a
	if err := a.releaseCachedBlocks(nil); err != nil {
		return err
	}
	if a.exp != nil {
		sums, _ := a.hotSums()
		a.exp.StartOver(uint64(sums[hotAllocatedBytes][PoolAll]))
	}
	return nil
}

// Close waits for pending events and returns every segment to the device,
// including segments with blocks still allocated; it then reports those
// blocks in an error wrapping ErrLiveBlocks. The allocator is unusable
// afterwards (ErrClosed). The device is closed too when Open opened it;
// an allocator from New leaves it open.
func (a *Allocator) Close() error {
	a.lockWorld()
	defer a.unlockWorld()
	if a.closed {
		return fmt.Errorf("allocator: close: %w", ErrClosed)
	}
	liveBytes := a.folded().AllocatedBytes[PoolAll].Current
	live, errs := a.be.close()
	errs = append(errs, a.spareEvents.Destroy(a.dev)...)
	a.log.Info("allocator closed", zap.Int("segments_released", len(a.segs.list)),
		zap.Uint64("bytes_released", a.segs.reserved), zap.Int("live_blocks", live))
	// Everything went back to the device: current values drop to zero.
	st := &a.stats
	for _, arr := range st.namedArrays() {
		for p := range arr.a {
			arr.a[p].sub(arr.a[p].Current)
		}
	}
	st.OversizeAllocations.sub(st.OversizeAllocations.Current)
	st.OversizeSegments.sub(st.OversizeSegments.Current)
	for _, sh := range a.shards {
		for _, arr := range sh.stats.summed() {
			for p := range arr {
				arr[p].sub(arr[p].Current)
			}
		}
		sh.stats.OversizeAllocations.sub(sh.stats.OversizeAllocations.Current)
		sh.small.free, sh.large.free = blocks.NewStreamFreeIndex(uint64(sh.stream)), blocks.NewStreamFreeIndex(uint64(sh.stream))
		sh.active = newPtrMap(0)
		sh.segments, sh.pendingEv = 0, 0
	}
	a.segs.list, a.queues = nil, nil
	a.res = new(reservoir)
	a.dir.Store(&directory{})
	a.segs.reserved, a.pending = 0, 0
	a.closed = true
	if a.brokerMem != nil {
		if err := a.brokerMem.close(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: closing broker connections: %w", err))
		}
	}
	if a.broker != nil {
		if err := a.broker.Close(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: closing the broker connection: %w", err))
		}
	}
	if a.ownsDevice {
		if err := a.dev.Close(); err != nil {
			errs = append(errs, fmt.Errorf("allocator: closing device %d: %w", a.info.Index, err))
		}
	}
	if live > 0 {
		errs = append(errs, fmt.Errorf("allocator: close: %d blocks (%d bytes) were never freed: %w", live, liveBytes, ErrLiveBlocks))
	}
	return errors.Join(errs...)
}

// close is the native policy's part of Close: wait for the pending
// events and return every segment to the device. It returns the number of
// blocks still allocated.
func (n native) close() (int, []error) {
	a := n.a
	var errs []error
	live := 0
	for _, sh := range a.shards {
		live += sh.active.len()
	}
	if err := a.synchronizeAndFreeEvents(nil); err != nil {
		errs = append(errs, err)
		if serr := a.dev.Synchronize(); serr != nil {
			errs = append(errs, serr)
		}
	}
	return live, append(errs, a.src.close()...)
}

// Stats returns a copy of the statistics, consistent as of one moment.
func (a *Allocator) Stats() Stats {
	a.lockWorld()
	defer a.unlockWorld()
	s := a.folded()
	var largest uint64
	for _, x := range a.freeIndexes() {
		if b := x.Largest(); b != nil && b.Size > largest {
			largest = b.Size
		}
	}
	s.LargestFreeBlock = int64(largest)
	s.PrivateReservedBytes, s.PrivateAllocatedBytes = a.privateBytes()
	if a.exp != nil {
		s.HandleCacheBytes = int64(a.exp.Cached(false) + a.exp.Cached(true))
		s.VMM = a.exp.Calls()
	}
	return s
}

// MemoryAllocated returns the bytes currently handed out (rounded sizes),
// as torch.cuda.memory_allocated().
func (a *Allocator) MemoryAllocated() int64 {
	a.lockWorld()
	defer a.unlockWorld()
	s := a.folded()
	return s.AllocatedBytes[PoolAll].Current
}

// MemoryReserved returns the bytes held from the device, as
// torch.cuda.memory_reserved().
func (a *Allocator) MemoryReserved() int64 {
	a.lockWorld()
	defer a.unlockWorld()
	return a.stats.ReservedBytes[PoolAll].Current
}

// Usage returns the current allocated, reserved and requested bytes (all
// pools) under one lock: cheaper than Stats for callers that sample often.
func (a *Allocator) Usage() (allocated, reserved, requested int64) {
	a.lockWorld()
	defer a.unlockWorld()
	allocated, requested = a.stats.AllocatedBytes[PoolAll].Current, a.stats.RequestedBytes[PoolAll].Current
	for _, sh := range a.shards {
		allocated += sh.stats.AllocatedBytes.current()
		requested += sh.stats.RequestedBytes.current()
	}
	return allocated, a.stats.ReservedBytes[PoolAll].Current, requested
}

// MaxMemoryAllocated returns the peak of MemoryAllocated since the last
// ResetPeakStats.
func (a *Allocator) MaxMemoryAllocated() int64 {
	a.lockWorld()
	defer a.unlockWorld()
	return a.stats.AllocatedBytes[PoolAll].Peak
}

// MaxMemoryReserved returns the peak of MemoryReserved since the last
// ResetPeakStats.
func (a *Allocator) MaxMemoryReserved() int64 {
	a.lockWorld()
	defer a.unlockWorld()
	return a.stats.ReservedBytes[PoolAll].Peak
}

// ResetPeakStats sets every peak to its current value.
func (a *Allocator) ResetPeakStats() {
	a.lockWorld()
	defer a.unlockWorld()
	st := &a.stats
	for _, arr := range st.namedArrays() {
		arr.a.resetPeak()
	}
	st.OversizeAllocations.resetPeak()
	st.OversizeSegments.resetPeak()
	// The hot statistics' global currents live in the shards: fold them in.
	f := a.folded()
	g, h := st.hotArrays(), f.hotArrays()
	for k := range numHot {
		for p := range numPools {
			g[k][p].Peak = h[k][p].Current
		}
	}
	st.OversizeAllocations.Peak = f.OversizeAllocations.Current
	a.capsDirty = true
}

// Check walks every segment, block and index and compares what it finds
// with the statistics. It returns nil when every invariant holds and an
// error listing each broken one otherwise. It is meant for tests and
// debugging: it costs time proportional to the number of blocks.
func (a *Allocator) Check() error {
	a.lockAll()
	defer a.unlockWorld()
	parked := a.checkParked()
	a.flushAll()
	return errors.Join(append(append(parked, a.be.check()), a.checkStreams()...)...)
}

// check is the native policy's Check, after the front cache was checked
// and flushed.
func (n native) check() error {
	a := n.a
	t, err := blocks.Check(a.segs.list, a.freeIndexes()...)
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, a.checkShards()...)
	errs = append(errs, a.checkPools()...)
	folded := a.folded()
	st := &folded
	want := func(name string, got, exp int64) {
		if got != exp {
			errs = append(errs, fmt.Errorf("stat %s is %d, structures say %d", name, got, exp))
		}
	}
	// segment counts device allocations: expandable ranges do not count.
	want("segment", st.Segment[PoolAll].Current, int64(t.Segments-t.ExpandableSegments))
	// The handle cache of expandable segments is held, so reserved.
	var cached uint64
	if a.exp != nil {
		cached = a.exp.Cached(false) + a.exp.Cached(true)
	}
	want("reserved_bytes", st.ReservedBytes[PoolAll].Current, int64(t.SegmentBytes+cached))
	want("reserved", int64(a.segs.reserved), int64(t.SegmentBytes+cached))
	want("allocation", st.Allocation[PoolAll].Current, int64(t.AllocatedCount))
	want("allocated_bytes", st.AllocatedBytes[PoolAll].Current, int64(t.AllocatedBytes))
	want("active", st.Active[PoolAll].Current, int64(t.AllocatedCount+t.PendingCount))
	want("active_bytes", st.ActiveBytes[PoolAll].Current, int64(t.AllocatedBytes+t.PendingBytes))
	want("requested_bytes", st.RequestedBytes[PoolAll].Current, int64(t.RequestedBytes))
	want("inactive_split", st.InactiveSplit[PoolAll].Current, int64(t.InactiveSplitCount))
	want("inactive_split_bytes", st.InactiveSplitBytes[PoolAll].Current, int64(t.InactiveSplitBytes))
	live := 0
	for _, sh := range a.shards {
		live += sh.active.len()
	}
	want("active map size", int64(live), int64(t.AllocatedCount))
	for _, arr := range st.namedArrays() {
		want(arr.name+" pools", arr.a[PoolSmall].Current+arr.a[PoolLarge].Current, arr.a[PoolAll].Current)
	}
	var events int
	for _, s := range a.segs.list {
		for b := s.Head; b != nil; b = b.Next {
			events += b.EventCount
			if b.Allocated && a.shardOf(cudart.Stream(s.Stream)).active.get(b.Ptr) != b {
				errs = append(errs, fmt.Errorf("allocated %v is missing from its stream's active map", b))
			}
			if b.Lent && ((!b.Allocated && b.EventCount == 0) || !s.Expandable || b.Borrower == blocks.DeviceStream(s.Stream) || blocks.PoolSeq(s.Stream) != 0) {
				errs = append(errs, fmt.Errorf("%v of stream %#x is lent to stream %#x but not an allocated (or deferred) block of another stream's expandable segment", b, s.Stream, b.Borrower))
			}
			if !b.Lent && b.Borrower != 0 {
				errs = append(errs, fmt.Errorf("%v has borrower %#x but is not lent", b, b.Borrower))
			}
		}
	}
	// A block whose events a capture deferred counts one (pools.go).
	want("pending events", int64(a.pending+len(a.deferred)), int64(events))
	errs = append(errs, a.checkPoolCounts(st)...)
	errs = append(errs, a.src.check()...)
	for _, sh := range a.shards {
		for i, p := range []*pool{&sh.small, &sh.large} {
			p.free.Ascend(func(b *blocks.Block) bool {
				if b.Segment.Small != p.small {
					errs = append(errs, fmt.Errorf("%v is in pool %d but its segment belongs to the other", b, i))
				}
				if b.Segment.Stream != uint64(sh.stream) {
					errs = append(errs, fmt.Errorf("%v of stream %#x is in the shard of stream %#x", b, b.Segment.Stream, uint64(sh.stream)))
				}
				return true
			})
		}
	}
	return errors.Join(errs...)
}
