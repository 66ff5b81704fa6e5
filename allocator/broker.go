package allocator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
)

// The broker's segment source. With a node broker (allocd serve
// --broker), an allocator's expandable segments get their physical
// memory from the broker instead of creating it: a growth's Create asks
// the broker for a chunk, imports its descriptor and maps it as it maps
// a handle of its own; a Release unmaps, drops the handle and gives the
// chunk back. Everything above the physical handles (blocks, streams,
// reclaim, the handle cache, stats, snapshots) is the expandable
// segments' own, unchanged. The broker's refusals (a tenant's quota, a
// device out of memory) are out-of-memory errors to the allocator, which
// empties its caches, returns their chunks and asks again before it
// fails.

// The environment variables Open reads to use a broker.
const (
	// EnvBroker is the broker's address, unix:///path/to/allocd.sock;
	// unset or empty: no broker.
	EnvBroker = "ALLOCD_BROKER"
	// EnvTenant is the tenant to connect as; required with EnvBroker.
	EnvTenant = "ALLOCD_TENANT"
	// EnvBrokerFallback says what to do when the broker cannot be
	// reached or goes away: "none" (the default: new growth fails) or
	// "local" (create physical memory locally, as without a broker).
	EnvBrokerFallback = "ALLOCD_BROKER_FALLBACK"
)

// WithBroker makes the allocator's segments come from the broker c is
// connected to: expandable segments are switched on and every physical
// handle is a chunk granted by the broker. If the connection is lost,
// the next growth dials c's address again as c's tenant (at most once a
// second); fallbackLocal makes growth create memory locally while no
// broker answers, instead of failing. The device must implement
// cudart.ShareableMemory. The allocator does not close c unless Open
// made it; it closes the connections it dialled itself.
func WithBroker(c *broker.Client, fallbackLocal bool) Option {
	return func(o *options) { o.broker, o.brokerFallback = c, fallbackLocal }
}

// brokerMemory is the device's virtual memory with its physical handles
// taken from a broker.
//
// When the connection is lost (the broker restarted, or cut this client
// off), the next growth dials the broker again, at most once a second. A
// chunk is given back only on the connection that granted it: chunk ids
// are a broker's own, and a new broker knows nothing of the old one's
// chunks, whose memory this process's handles keep until it releases
// them. Until then they are not counted to the tenant by the new broker.
type brokerMemory struct {
	cudart.VirtualMemory
	sm       cudart.ShareableMemory
	uuid     string // this device's, to find it among the broker's
	fallback bool
	log      *zap.Logger

	mu       sync.Mutex
	client   *broker.Client // the connection growths use now
	dev      int            // the broker's index of this device, on client
	dialled  []*broker.Client
	lastDial time.Time
	chunks   map[cudart.Handle]chunkRef
	warned   bool
}

// chunkRef is a chunk an imported handle came from: its id, on the
// connection that granted it.
type chunkRef struct {
	client *broker.Client
	id     uint64
}

// redialEvery bounds how often a lost connection is dialled again.
const redialEvery = time.Second

// brokerRangeMemory is brokerMemory over a device that maps several
// handles in one call.
type brokerRangeMemory struct {
	*brokerMemory
	rm cudart.RangeMapper
}

func (m brokerRangeMemory) MapRange(p cudart.Ptr, page uint64, hs []cudart.Handle) error {
	return m.rm.MapRange(p, page, hs)
}

// newBrokerMemory wraps vm, dev's virtual memory, for c.
func newBrokerMemory(dev cudart.Device, vm cudart.VirtualMemory, c *broker.Client, fallback bool, log *zap.Logger) (*brokerMemory, cudart.VirtualMemory, error) {
	info := dev.Info()
	sm, ok := dev.(cudart.ShareableMemory)
	if !ok {
		return nil, nil, fmt.Errorf("allocator: broker %s: device %d (%s) cannot import shared memory: %w", c.Address(), info.Index, info.Name, ErrNotSupported)
	}
	idx, ok := c.DeviceByUUID(info.UUID)
	if !ok {
		return nil, nil, fmt.Errorf("allocator: broker %s serves no device with UUID %q (this process's device %d): %w", c.Address(), info.UUID, info.Index, ErrNotSupported)
	}
	m := &brokerMemory{VirtualMemory: vm, sm: sm, uuid: info.UUID, client: c, dev: idx, fallback: fallback, log: log, chunks: make(map[cudart.Handle]chunkRef)}
	if rm, ok := vm.(cudart.RangeMapper); ok {
		return m, brokerRangeMemory{m, rm}, nil
	}
	return m, m, nil
}

func (m *brokerMemory) current() (*broker.Client, int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.client, m.dev
}

// redial replaces the lost connection old, unless another growth already
// did or the last try was less than redialEvery ago. It returns the
// connection to use, or nil.
func (m *brokerMemory) redial(old *broker.Client) (*broker.Client, int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.client != old {
		return m.client, m.dev
	}
	if time.Since(m.lastDial) < redialEvery {
		return nil, 0
	}
	m.lastDial = time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := broker.Dial(ctx, old.Address(), old.Tenant(), 0)
	if err != nil {
		m.log.Warn("allocd broker connection lost; dialling it again failed", zap.String("broker", old.Address()), zap.Error(err))
		return nil, 0
	}
	idx, ok := c.DeviceByUUID(m.uuid)
	if !ok {
		m.log.Warn("allocd broker reconnected but serves this device no more", zap.String("broker", old.Address()), zap.String("uuid", m.uuid))
		_ = c.Close()
		return nil, 0
	}
	m.log.Info("allocd broker connection lost: reconnected", zap.String("broker", old.Address()), zap.Uint64("client", c.ID()))
	m.client, m.dev = c, idx
	m.dialled = append(m.dialled, c)
	return c, idx
}

// Create asks the broker for a chunk of size bytes and imports it. A
// lost connection is dialled again first; once the broker cannot be
// reached, it creates the memory locally if fallback allows.
func (m *brokerMemory) Create(size uint64) (cudart.Handle, error) {
	c, dev := m.current()
	ch, err := c.Grant(dev, size)
	if errors.Is(err, broker.ErrGone) {
		if nc, ndev := m.redial(c); nc != nil {
			c = nc
			ch, err = c.Grant(ndev, size)
		}
	}
	if err != nil {
		if errors.Is(err, broker.ErrGone) {
			if m.fallback {
				m.mu.Lock()
				if !m.warned {
					m.warned = true
					m.log.Warn("allocd broker gone: creating memory locally", zap.String("broker", c.Address()), zap.Error(err))
				}
				m.mu.Unlock()
				return m.VirtualMemory.Create(size)
			}
			return 0, fmt.Errorf("allocator: growing by %d bytes: %w (memory already granted stays valid; dialling the broker again failed; set %s=local to create memory locally instead)", size, err, EnvBrokerFallback)
		}
		return 0, fmt.Errorf("allocator: growing by %d bytes: %w", size, err)
	}
	h, err := m.sm.Import(ch.FD, ch.Size)
	_ = unix.Close(ch.FD)
	if err != nil {
		return 0, errors.Join(fmt.Errorf("allocator: importing broker chunk %d: %w", ch.ID, err), c.Return(ch.ID))
	}
	m.mu.Lock()
	m.chunks[h] = chunkRef{c, ch.ID}
	m.mu.Unlock()
	return h, nil
}

// Release drops the handle and, for a chunk, gives it back on the
// connection that granted it. A chunk whose connection is gone goes back
// to that broker when this process exits (or went with it).
func (m *brokerMemory) Release(h cudart.Handle) error {
	if err := m.VirtualMemory.Release(h); err != nil {
		return err
	}
	m.mu.Lock()
	ref, ok := m.chunks[h]
	delete(m.chunks, h)
	m.mu.Unlock()
	if !ok {
		return nil
	}
	if err := ref.client.Return(ref.id); err != nil && !errors.Is(err, broker.ErrGone) {
		return fmt.Errorf("allocator: returning chunk %d to the broker: %w", ref.id, err)
	}
	return nil
}

// close closes the connections redial made. The allocator calls it once
// every handle is released.
func (m *brokerMemory) close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	for _, c := range m.dialled {
		errs = append(errs, c.Close())
	}
	m.dialled = nil
	return errors.Join(errs...)
}

// BrokerFromEnv connects to the broker EnvBroker names, as EnvTenant,
// for a program that passes it to WithBroker itself (several allocators
// may share one Client). It returns a nil client when EnvBroker is
// unset, or when the broker cannot be reached and EnvBrokerFallback is
// "local" (which it logs); fallback is that setting. A bad value of any
// of the three variables is an error wrapping ErrEnv.
func BrokerFromEnv(log *zap.Logger) (c *broker.Client, fallback bool, err error) {
	addr := os.Getenv(EnvBroker)
	if addr == "" {
		return nil, false, nil
	}
	switch v := os.Getenv(EnvBrokerFallback); v {
	case "", "none":
	case "local":
		fallback = true
	default:
		return nil, false, fmt.Errorf("allocator: %s=%q: %w: want none or local", EnvBrokerFallback, v, ErrEnv)
	}
	if _, err := broker.ParseAddress(addr); err != nil {
		return nil, false, fmt.Errorf("allocator: %s: %w: %w", EnvBroker, ErrEnv, err)
	}
	tenant := os.Getenv(EnvTenant)
	if tenant == "" {
		return nil, false, fmt.Errorf("allocator: %s is set but %s is not: %w: name the tenant to connect as", EnvBroker, EnvTenant, ErrEnv)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err = broker.Dial(ctx, addr, tenant, 0)
	if err != nil {
		if fallback {
			log.Warn("allocd broker unreachable: using local memory", zap.String("broker", addr), zap.Error(err))
			return nil, true, nil
		}
		return nil, false, fmt.Errorf("allocator: %s: %w (set %s=local to run without it)", EnvBroker, err, EnvBrokerFallback)
	}
	return c, fallback, nil
}
