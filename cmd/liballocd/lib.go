// Command liballocd is allocd as a shared library that PyTorch loads as its
// CUDA allocator (through allocd_torch's C++ class derived from c10's
// CUDAAllocator, which calls the C API; torchapi.go holds the exports that
// answer torch's statistics and snapshot calls, pools.go those of its
// private memory pools: CUDA graphs, torch.cuda.MemPool). Build it with
//
//	go build -buildmode=c-shared -o liballocd.so ./cmd/liballocd
//
// The exported C functions (forkguard.c, freequeue.c) fail at once in a
// forked child and otherwise call their Go halves (exports.go), which are
// thin: each recovers panics,
// reports errors through allocd_last_error, applies the frees that
// allocd_torch_free queued in C (freequeue.c, queue.go), and calls into this
// file, which holds the library's state: an allocator.Devices that creates
// each device's allocator on first use (allocator.NewLazyDevices), the
// count of bad frees, and the metrics server (server.go: server.NewHTTP
// and debughttp's pages).
//
// Environment (read once, at initialisation):
//
//	ALLOCD_CONF            allocator configuration, PYTORCH_CUDA_ALLOC_CONF's keys
//	ALLOCD_METRICS_LISTEN  address to serve /metrics and the debug pages on; unset: none
//	ALLOCD_LOG_LEVEL       debug, info, warn (default) or error; zap JSON on stderr
//	ALLOCD_DEVICE          cuda (or unset), sim, or sim:N for N simulated devices (1 to 64);
//	                       anything else is an error
//	ALLOCD_SIM_CAPACITY    simulated device memory, bytes or with KiB/MiB/GiB/TiB (default 141GiB)
//	ALLOCD_SIM_MANUAL_EVENTS=1  simulated stream events stay pending until a
//	                       synchronising call (empty_cache, the OOM path) waits for them
//	ALLOCD_BROKER          the node broker's address (unix:///run/allocd/allocd.sock):
//	                       physical memory comes from it (allocator.WithBroker)
//	ALLOCD_TENANT          the tenant to connect to the broker as
//	ALLOCD_BROKER_FALLBACK none (default) or local: what growth does once the broker is gone
//
// ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY are read by devspec.ParseEnv, and
// ALLOCD_CONF by allocator.ParseConfig, as allocator.Open and the allocd
// command read them: a value means the same in every tool.
//
// A simulated device has the default stream 0 and streams 1 to 16.
package main

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/allocd/allocd/allocator"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/devspec"
	"github.com/allocd/allocd/simdev"
)

// maxDevices bounds the device index: PyTorch's c10::DeviceIndex is an
// int8_t. A fixed bound lets initialisation run without asking CUDA
// anything; each device is opened at its first use.
const maxDevices = 128

// simStreams is the number of streams a simulated device has besides the
// default stream 0 (handles 1 to simStreams).
const simStreams = 16

// settings are the resolved initialisation arguments; two inits agree when
// their settings are equal.
type settings struct {
	conf, listen, level string
	// confVar names where conf came from, for its errors: ALLOCD_CONF,
	// or allocd_init's conf argument. It is not compared (sameArgs).
	confVar     string
	device      string // ALLOCD_DEVICE
	simCapacity string // ALLOCD_SIM_CAPACITY
	simManual   string // ALLOCD_SIM_MANUAL_EVENTS
}

// resolveSettings fills the arguments left NULL (nil) from the environment.
func resolveSettings(conf, listen, level *string) settings {
	pick := func(p *string, env, def string) string {
		if p != nil {
			return *p
		}
		if v, ok := os.LookupEnv(env); ok {
			return v
		}
		return def
	}
	confVar := "allocd_init's conf"
	if conf == nil {
		confVar = "ALLOCD_CONF"
	}
	return settings{
		conf:        pick(conf, "ALLOCD_CONF", ""),
		confVar:     confVar,
		listen:      pick(listen, "ALLOCD_METRICS_LISTEN", ""),
		level:       pick(level, "ALLOCD_LOG_LEVEL", "warn"),
		device:      os.Getenv("ALLOCD_DEVICE"),
		simCapacity: os.Getenv("ALLOCD_SIM_CAPACITY"),
		simManual:   os.Getenv("ALLOCD_SIM_MANUAL_EVENTS"),
	}
}

// Reasons for a bad free, the reason label of allocd_bad_frees_total.
const (
	reasonUnknown = iota
	reasonDoubleFree
	reasonWrongDevice
	reasonOther
	numReasons
)

var reasonNames = [numReasons]string{"unknown_pointer", "double_free", "wrong_device", "error"}

// lib is the library's state after a successful initialisation.
type lib struct {
	set     settings
	sim     simSpec
	log     *zap.Logger
	badLog  *zap.Logger        // sampled: a storm of bad frees logs a few lines a second
	devs    *allocator.Devices // device indexes 0..maxDevices-1, each created on first use
	bad     [maxDevices][numReasons]atomic.Int64
	metrics *metricsServer // nil without metrics_listen
	// accBase holds, per device, the statistics at its last
	// reset_accumulated_memory_stats (nil: never reset): torch's views
	// count their totals from it (deviceStats), the allocator's own
	// counters and the metrics never go back.
	accBase [maxDevices]atomic.Pointer[allocator.Stats]
}

var (
	initMu sync.Mutex
	state  atomic.Pointer[lib]
)

// get returns the library, initialising it from the environment if no
// allocd_init came first. A failed initialisation is not kept: the next
// call tries again.
func get() (*lib, error) {
	if l := state.Load(); l != nil {
		return l, nil
	}
	return initLib(resolveSettings(nil, nil, nil), false)
}

// initLib initialises the library with set. With explicit set (allocd_init),
// an earlier initialisation with other settings is an error.
func initLib(set settings, explicit bool) (*lib, error) {
	initMu.Lock()
	defer initMu.Unlock()
	if l := state.Load(); l != nil {
		if explicit && !sameArgs(l.set, set) {
			return nil, fmt.Errorf("allocd: already initialised with conf %q, metrics_listen %q, log_level %q; "+
				"a second init with conf %q, metrics_listen %q, log_level %q is refused",
				l.set.conf, l.set.listen, l.set.level, set.conf, set.listen, set.level)
		}
		return l, nil
	}
	l, err := newLib(set)
	if err != nil {
		return nil, err
	}
	state.Store(l)
	return l, nil
}

func newLib(set settings) (*lib, error) {
	log, err := newLogger(set.level)
	if err != nil {
		return nil, err
	}
	cfg, err := allocator.ParseConfig(set.conf)
	if err != nil {
		return nil, fmt.Errorf("allocd: %s=%q: %w", set.confVar, set.conf, err)
	}
	sim, err := parseSim(set)
	if err != nil {
		return nil, err
	}
	l := &lib{set: set, sim: sim, log: log}
	opts := []allocator.Option{allocator.WithLogger(log.Named("allocator"))}
	// One connection to the broker serves every device of the process.
	bc, fallback, err := allocator.BrokerFromEnv(log.Named("broker"))
	if err != nil {
		return nil, fmt.Errorf("allocd: %w", err)
	}
	if bc != nil {
		opts = append(opts, allocator.WithBroker(bc, fallback))
		l.sim.shared = true
	}
	l.devs, err = allocator.NewLazyDevices(maxDevices, l.openDevice, cfg, opts...)
	if err != nil {
		return nil, fmt.Errorf("allocd: %w", err)
	}
	l.badLog = log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 5, 0)
	}))
	if set.listen != "" {
		m, err := startMetrics(l, set.listen, metricsHTTP)
		if err != nil {
			return nil, err
		}
		l.metrics = m
	}
	return l, nil
}

// newLogger returns zap JSON lines on stderr at level.
func newLogger(level string) (*zap.Logger, error) {
	lvl, err := zapcore.ParseLevel(level)
	if err != nil || lvl < zapcore.DebugLevel || lvl > zapcore.ErrorLevel {
		return nil, fmt.Errorf("allocd: log_level %q: expected debug, info, warn or error", level)
	}
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.RFC3339NanoTimeEncoder
	core := zapcore.NewCore(zapcore.NewJSONEncoder(enc), zapcore.Lock(os.Stderr), lvl)
	return zap.New(core, zap.ErrorOutput(zapcore.Lock(os.Stderr))).Named("allocd"), nil
}

// simSpec says whether devices are simulated, and how.
type simSpec struct {
	on       bool
	count    int
	capacity uint64
	manual   bool
	shared   bool // a broker is in use: the memory must cross processes
}

// parseSim reads ALLOCD_DEVICE and ALLOCD_SIM_CAPACITY as every allocd
// tool does (devspec.ParseEnv), and ALLOCD_SIM_MANUAL_EVENTS.
func parseSim(set settings) (simSpec, error) {
	env, err := devspec.ParseEnv(set.device, set.simCapacity)
	if err != nil {
		return simSpec{}, fmt.Errorf("allocd: %w", err)
	}
	if !env.Spec.Sim {
		return simSpec{}, nil
	}
	return simSpec{on: true, count: env.Spec.Count, capacity: env.SimCapacity, manual: set.simManual == "1"}, nil
}

// sameArgs reports whether two initialisations agree: the same
// arguments, wherever they came from.
func sameArgs(a, b settings) bool {
	a.confVar, b.confVar = "", ""
	return a == b
}

// openDevice opens device index for l.devs, as devspec opens it for
// every allocd tool (Opener.OpenIndex): a simulated device under
// ALLOCD_DEVICE=sim, with simStreams streams, else the CUDA device through
// the libcudart already loaded in the process (which makes it current,
// creating its primary context; the caller's current device is restored).
func (l *lib) openDevice(index int) (cudart.Device, error) {
	if l.sim.on && index >= l.sim.count {
		return nil, fmt.Errorf("allocd: device %d: ALLOCD_DEVICE gives %d simulated devices: %w",
			index, l.sim.count, allocator.ErrNoSuchDevice)
	}
	o := devspec.Opener{Sim: simdev.Config{Capacity: l.sim.capacity, ManualEvents: l.sim.manual, Shared: l.sim.shared}}
	dev, err := o.OpenIndex(devspec.Spec{Sim: l.sim.on, Count: max(l.sim.count, 1)}, index)
	if err != nil {
		return nil, err
	}
	if !l.sim.on {
		l.checkRuntimeCopies()
		return dev, nil
	}
	for range simStreams {
		if _, err := dev.StreamCreate(); err != nil {
			return nil, errors.Join(err, dev.Close())
		}
	}
	return dev, nil
}

// alloc returns device's allocator, or nil if it has not been created.
func (l *lib) alloc(device int) *allocator.Allocator {
	a, _ := l.devs.Created(device)
	return a
}

func (l *lib) malloc(size uint64, device int, stream cudart.Stream) (cudart.Ptr, error) {
	a, err := l.devs.ForDevice(device)
	if err != nil {
		return 0, err
	}
	return a.Malloc(size, stream)
}

// free frees p on device. A bad free (an unknown pointer, a double free, a
// pointer of another device: allocator.Devices.FreeOn names its owner)
// changes nothing; it is counted and logged, and returned.
//
// A negative device means the caller does not know it (allocd_torch's
// CUDAAllocator keeps no map of its pointers): the allocator whose device
// handed p out frees it (Devices.Free).
func (l *lib) free(p cudart.Ptr, device int) error {
	var err error
	if device < 0 {
		err = l.devs.Free(p)
	} else {
		err = l.devs.FreeOn(device, p)
	}
	if err == nil {
		return nil
	}
	reason := reasonOther
	switch {
	case errors.Is(err, allocator.ErrWrongDevice):
		reason = reasonWrongDevice
	case errors.Is(err, allocator.ErrDoubleFree):
		reason = reasonDoubleFree
	case errors.Is(err, allocator.ErrUnknownPointer), errors.Is(err, allocator.ErrNoSuchDevice):
		reason = reasonUnknown
	}
	if counted := max(device, 0); counted < maxDevices { // a free of no known device counts on device 0
		l.bad[counted][reason].Add(1)
	}
	l.badLog.Warn("bad free", zap.String("reason", reasonNames[reason]), zap.Int("device", device),
		zap.String("ptr", fmt.Sprintf("%#x", uint64(p))), zap.Error(err))
	return err
}

// recordStream marks p as used by stream on the device whose allocator
// handed it out.
func (l *lib) recordStream(p cudart.Ptr, stream cudart.Stream) error {
	if i, ok := l.devs.Owner(p); ok {
		if a := l.alloc(i); a != nil {
			return a.RecordStream(p, stream)
		}
	}
	return fmt.Errorf("allocd: record_stream of %#x: no device allocator handed it out: %w", uint64(p), allocator.ErrUnknownPointer)
}

// badFrees returns the bad frees counted on device, all reasons together.
func (l *lib) badFrees(device int) int64 {
	if device < 0 || device >= maxDevices {
		return 0
	}
	var n int64
	for r := range numReasons {
		n += l.bad[device][r].Load()
	}
	return n
}

// deviceStats returns device's statistics as torch's views show them
// (zero for a device not created): the accumulated totals count from the
// last resetAccumulatedStats.
func (l *lib) deviceStats(device int) allocator.Stats {
	var st allocator.Stats
	if a := l.alloc(device); a != nil {
		st = a.Stats()
		if device >= 0 && device < maxDevices {
			if base := l.accBase[device].Load(); base != nil {
				st = st.AccumulatedSince(base)
			}
		}
	}
	return st
}

// resetAccumulatedStats makes device's accumulated totals, as torch's views
// show them, start again from zero (PyTorch's
// reset_accumulated_memory_stats). A device not created has none.
func (l *lib) resetAccumulatedStats(device int) error {
	if device < 0 || device >= maxDevices {
		return fmt.Errorf("allocd: reset_accumulated_memory_stats: device %d: index outside 0..%d: %w", device, maxDevices-1, allocator.ErrNoSuchDevice)
	}
	if a := l.alloc(device); a != nil {
		st := a.Stats()
		l.accBase[device].Store(&st)
	}
	return nil
}

// flatStats returns device's statistics (zero for a device not created)
// as torch.cuda.memory_stats()'s flat keys plus num_bad_frees.
func (l *lib) flatStats(device int) map[string]int64 {
	st := l.deviceStats(device)
	m := st.Flat()
	m["num_bad_frees"] = l.badFrees(device)
	return m
}

// historyOptions is allocd_record_history's request.
type historyOptions struct {
	Enabled    bool
	MaxEntries int
	StackDepth int
}

// defaultHistoryEntries is the history bound when recording is switched on
// without one.
const defaultHistoryEntries = 1_000_000

// setHistory switches history recording on or off for every allocator,
// those created so far and those created later (Devices.RecordHistory).
// Each allocator starts an empty history. Options out of range change
// nothing (an error wrapping allocator.ErrHistory).
func (l *lib) setHistory(h historyOptions) error {
	var opt allocator.HistoryOptions
	if h.Enabled {
		opt = allocator.HistoryOptions{MaxEntries: h.MaxEntries, StackDepth: h.StackDepth}
		if opt.MaxEntries <= 0 {
			opt.MaxEntries = defaultHistoryEntries
		}
	}
	if err := l.devs.RecordHistory(opt); err != nil {
		return fmt.Errorf("allocd: record_history: %w", err)
	}
	return nil
}

// checkRuntimeCopies warns when the process maps more than one libcudart:
// the library must share torch's copy (dlopen by soname returns it).
func (l *lib) checkRuntimeCopies() {
	paths, err := runtimeCopies()
	if err != nil {
		l.log.Debug("cannot read the process's mappings", zap.Error(err))
		return
	}
	if len(paths) > 1 {
		l.log.Warn("more than one CUDA runtime library is mapped; allocd may not share the program's", zap.Strings("paths", paths))
	}
}

// runtimeCopies lists the distinct libcudart files mapped into this
// process, from /proc/self/maps.
func runtimeCopies() ([]string, error) {
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return nil, err
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 6 {
			continue
		}
		path := f[len(f)-1]
		if strings.Contains(path[strings.LastIndex(path, "/")+1:], "libcudart") && !contains(out, path) {
			out = append(out, path)
		}
	}
	return out, nil
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}
