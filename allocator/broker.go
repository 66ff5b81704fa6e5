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
// handle is a chunk granted by the broker. fallbackLocal makes growth
// create memory locally once the broker is gone, instead of failing. The
// device must implement cudart.ShareableMemory. The allocator does not
// close c unless Open made it.
func WithBroker(c *broker.Client, fallbackLocal bool) Option {
	return func(o *options) { o.broker, o.brokerFallback = c, fallbackLocal }
}

// brokerMemory is the device's virtual memory with its physical handles
// taken from a broker.
type brokerMemory struct {
	cudart.VirtualMemory
	sm       cudart.ShareableMemory
	client   *broker.Client
	dev      int // the broker's index of this device
	fallback bool
	log      *zap.Logger

	mu     sync.Mutex
	chunks map[cudart.Handle]uint64 // imported handle → chunk id
	warned bool
}

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
func newBrokerMemory(dev cudart.Device, vm cudart.VirtualMemory, c *broker.Client, fallback bool, log *zap.Logger) (cudart.VirtualMemory, error) {
	info := dev.Info()
	sm, ok := dev.(cudart.ShareableMemory)
	if !ok {
		return nil, fmt.Errorf("allocator: broker %s: device %d (%s) cannot import shared memory: %w", c.Address(), info.Index, info.Name, ErrNotSupported)
	}
	idx, ok := c.DeviceByUUID(info.UUID)
	if !ok {
		return nil, fmt.Errorf("allocator: broker %s serves no device with UUID %q (this process's device %d): %w", c.Address(), info.UUID, info.Index, ErrNotSupported)
	}
	m := &brokerMemory{VirtualMemory: vm, sm: sm, client: c, dev: idx, fallback: fallback, log: log, chunks: make(map[cudart.Handle]uint64)}
	if rm, ok := vm.(cudart.RangeMapper); ok {
		return brokerRangeMemory{m, rm}, nil
	}
	return m, nil
}

// Create asks the broker for a chunk of size bytes and imports it. Once
// the broker is gone it creates the memory locally if fallback allows.
func (m *brokerMemory) Create(size uint64) (cudart.Handle, error) {
	ch, err := m.client.Grant(m.dev, size)
	if err != nil {
		if errors.Is(err, broker.ErrGone) {
			if m.fallback {
				m.mu.Lock()
				if !m.warned {
					m.warned = true
					m.log.Warn("allocd broker gone: creating memory locally", zap.String("broker", m.client.Address()), zap.Error(err))
				}
				m.mu.Unlock()
				return m.VirtualMemory.Create(size)
			}
			return 0, fmt.Errorf("allocator: growing by %d bytes: %w (memory already granted stays valid; set %s=local to create memory locally instead)", size, err, EnvBrokerFallback)
		}
		return 0, fmt.Errorf("allocator: growing by %d bytes: %w", size, err)
	}
	h, err := m.sm.Import(ch.FD, ch.Size)
	_ = unix.Close(ch.FD)
	if err != nil {
		return 0, errors.Join(fmt.Errorf("allocator: importing broker chunk %d: %w", ch.ID, err), m.client.Return(ch.ID))
	}
	m.mu.Lock()
	m.chunks[h] = ch.ID
	m.mu.Unlock()
	return h, nil
}

// Release drops the handle and, for a chunk, gives it back to the
// broker. A broker that is gone takes it back when this process exits.
func (m *brokerMemory) Release(h cudart.Handle) error {
	if err := m.VirtualMemory.Release(h); err != nil {
		return err
	}
	m.mu.Lock()
	id, ok := m.chunks[h]
	delete(m.chunks, h)
	m.mu.Unlock()
	if !ok {
		return nil
	}
	if err := m.client.Return(id); err != nil && !errors.Is(err, broker.ErrGone) {
		return fmt.Errorf("allocator: returning chunk %d to the broker: %w", id, err)
	}
	return nil
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
