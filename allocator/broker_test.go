package allocator

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/brokertest"
	"github.com/allocd/allocd/simdev"
)

// testBroker serves a broker on one shared simulated device of capacity
// bytes, with the tenants file tenants (empty: every tenant, no quota).
// It returns the socket's address; Cleanup checks and closes it.
func testBroker(t *testing.T, capacity uint64, tenants string) (string, *broker.Broker) {
	t.Helper()
	return testBrokerN(t, 1, capacity, tenants)
}

// testBrokerN is testBroker over n devices, indexes 0 to n-1.
func testBrokerN(t *testing.T, n int, capacity uint64, tenants string) (string, *broker.Broker) {
	t.Helper()
	var devs []cudart.Device
	for i := range n {
		sim, err := simdev.New(simdev.Config{Index: i, Capacity: capacity, Shared: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sim.Close() })
		devs = append(devs, sim)
	}
	s := brokertest.Serve(t, devs, tenants)
	return s.Addr(), s.B
}

func brokerAllocator(t *testing.T, addr, tenant string, cfg Config, opts ...Option) *Allocator {
	t.Helper()
	c, err := broker.Dial(context.Background(), addr, tenant, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(sim, cfg, append(opts, WithBroker(c, false))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.Check(); err != nil {
			t.Errorf("Check: %v", err)
		}
		a.Close()
		sim.Close()
	})
	return a
}

// brokerOps runs a fixed sequence of mallocs and frees.
func brokerOps(t *testing.T, a *Allocator) {
	t.Helper()
	var ps []cudart.Ptr
	for i, n := range []uint64{3 << 20, 512, 40 << 20, 1 << 20, 7 << 20, 100 << 10, 25 << 20} {
		p, err := a.Malloc(n, cudart.DefaultStream)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
		if i%3 == 2 {
			if err := a.Free(ps[0]); err != nil {
				t.Fatal(err)
			}
			ps = ps[1:]
		}
		if err := a.Check(); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range ps {
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
}

// TestBrokerStatsUnchanged: the broker's chunks change where physical
// memory comes from and nothing else: the same operations give the same
// statistics as local expandable segments.
func TestBrokerStatsUnchanged(t *testing.T) {
	addr, b := testBroker(t, 1<<30, "")
	cfg := DefaultConfig()
	cfg.ExpandableSegments = true
	withBroker := brokerAllocator(t, addr, "a", cfg)
	local, err := New(newTestSims(t, 1<<30, 0)[0], cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	brokerOps(t, withBroker)
	brokerOps(t, local)
	sb, sl := withBroker.Stats(), local.Stats()
	got, want := sb.Flat(), sl.Flat()
	for _, k := range []string{"vmm_create_ns", "vmm_map_ns", "vmm_unmap_ns", "vmm_release_ns", "vmm_total_ns", "vmm_sync_ns"} {
		delete(got, k)
		delete(want, k)
	}
	if !maps.Equal(got, want) {
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s: %d with the broker, %d without", k, got[k], v)
			}
		}
	}
	held := b.Stats().Devices[0].HeldBytes
	if r := uint64(withBroker.Stats().ReservedBytes[PoolAll].Current); held != r {
		t.Fatalf("the broker counts %d bytes held; the allocator reserves %d", held, r)
	}
	if err := withBroker.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if st := b.Stats().Devices[0]; st.HeldBytes != 0 || st.CachedBytes == 0 {
		t.Fatalf("after EmptyCache: %+v", st)
	}
}

// TestBrokerQuotaIsOutOfMemory: a grant refused for the tenant's quota
// makes the allocator release its cache (giving the chunks back) and
// retry, and fails as out of memory, naming the quota, when that is not
// enough.
func TestBrokerQuotaIsOutOfMemory(t *testing.T) {
	addr, _ := testBroker(t, 1<<30, "tenants:\n  - name: a\n    quota: 64MiB\n")
	// PyTorch's expandable policy (20 MiB pages) unmaps nothing before an
	// out-of-memory error, so the quota, not a reclaim, decides.
	a := brokerAllocator(t, addr, "a", DefaultConfig(), WithPyTorchExpandable())
	first, err := a.Malloc(20<<20, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	second, err := a.Malloc(20<<20, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Free(first); err != nil {
		t.Fatal(err)
	}
	// 40 MiB held, the first page free; 24 MiB more takes two pages,
	// past the quota until the free page goes back.
	third, err := a.Malloc(24<<20, cudart.DefaultStream)
	if err != nil {
		t.Fatalf("malloc that needs the cache released: %v", err)
	}
	if st := a.Stats(); st.NumAllocRetries != 1 {
		t.Fatalf("retries = %d, want 1", st.NumAllocRetries)
	}
	_, err = a.Malloc(20<<20, cudart.DefaultStream) // a fourth page: 80 MiB
	var oom *OOMError
	if !errors.As(err, &oom) || !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Fatalf("malloc over the quota: %v, want an OOMError", err)
	}
	if !strings.Contains(err.Error(), `tenant "a"`) || !strings.Contains(err.Error(), "quota 64.00 MiB") {
		t.Errorf("the error does not name the tenant and its quota: %v", err)
	}
	for _, p := range []cudart.Ptr{second, third} {
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
}

func TestOpenWithBrokerEnv(t *testing.T) {
	addr, b := testBroker(t, 1<<30, "tenants:\n  - name: env\n")
	t.Setenv("ALLOCD_DEVICE", "sim")
	t.Setenv("ALLOCD_CONF", "")
	t.Setenv("ALLOCD_SIM_CAPACITY", "1GiB")
	t.Setenv(EnvBroker, addr)
	t.Setenv(EnvTenant, "env")
	t.Setenv(EnvBrokerFallback, "")
	a, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	if !a.Config().ExpandableSegments {
		t.Error("a broker did not switch on expandable segments")
	}
	p, err := a.Malloc(4<<20, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	if got := b.Stats().Devices[0].HeldBytes; got == 0 {
		t.Fatal("the allocator's memory did not come from the broker")
	}
	a.Free(p)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Second)
	for b.Stats().Devices[0].HeldBytes != 0 {
		if time.Now().After(deadline) {
			t.Fatal("Close did not give every chunk back")
		}
		time.Sleep(5 * time.Millisecond)
	}

	for _, tc := range []struct {
		broker, tenant, fallback string
		want                     string
		ok                       bool
	}{
		{addr, "", "", EnvTenant, false},
		{addr, "env", "sometimes", EnvBrokerFallback, false},
		{"tcp://host:1", "env", "", EnvBroker, false},
		{"unix:///nonexistent/allocd.sock", "env", "", "ALLOCD_BROKER_FALLBACK=local", false},
		{"unix:///nonexistent/allocd.sock", "env", "local", "", true},
		{addr, "not-listed", "", "not in the broker's tenants file", false},
	} {
		t.Setenv(EnvBroker, tc.broker)
		t.Setenv(EnvTenant, tc.tenant)
		t.Setenv(EnvBrokerFallback, tc.fallback)
		a, err := Open(0)
		if tc.ok {
			if err != nil {
				t.Errorf("%+v: %v", tc, err)
				continue
			}
			if _, err := a.Malloc(1<<20, cudart.DefaultStream); err != nil {
				t.Errorf("%+v: malloc on local memory: %v", tc, err)
			}
			a.Close()
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error naming %q", tc, err, tc.want)
		}
		if err != nil && tc.want != "not in the broker's tenants file" && !strings.Contains(tc.want, "=") && !errors.Is(err, ErrEnv) {
			t.Errorf("%+v: %v does not wrap ErrEnv", tc, err)
		}
	}
}

// TestOpenDevicesWithBroker: OpenDevices shares one connection between
// its devices, each matched to the broker's by UUID, and Close gives
// everything back.
func TestOpenDevicesWithBroker(t *testing.T) {
	addr, b := testBrokerN(t, 2, 1<<30, "")
	t.Setenv("ALLOCD_DEVICE", "sim:2")
	t.Setenv("ALLOCD_CONF", "")
	t.Setenv("ALLOCD_SIM_CAPACITY", "1GiB")
	t.Setenv(EnvBroker, addr)
	t.Setenv(EnvTenant, "multi")
	t.Setenv(EnvBrokerFallback, "")
	d, err := OpenDevices()
	if err != nil {
		t.Fatal(err)
	}
	var ps []cudart.Ptr
	for _, a := range d.All() {
		p, err := a.Malloc(6<<20, cudart.DefaultStream)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	st := b.Stats()
	for _, dev := range st.Devices {
		if dev.HeldBytes == 0 {
			t.Errorf("GPU %d: nothing granted; each device's memory should come from its own broker device", dev.Index)
		}
	}
	if got := st.Clients["multi"]; got != 1 {
		t.Errorf("%d connections for two devices, want 1", got)
	}
	for i, a := range d.All() {
		if err := a.Free(ps[i]); err != nil {
			t.Fatal(err)
		}
		if err := a.Check(); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Second)
	for b.Stats().Devices[0].HeldBytes+b.Stats().Devices[1].HeldBytes != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("Close did not give everything back: %+v", b.Stats().Devices)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// serveBrokerAt serves a broker on a new shared simulated device at
// sock; stop stops it and checks it.
func serveBrokerAt(t *testing.T, sock string) (b *broker.Broker, stop func()) {
	t.Helper()
	sim, err := simdev.New(simdev.Config{Capacity: 1 << 30, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	b, err = broker.New(broker.Config{Devices: []cudart.Device{sim}})
	if err != nil {
		t.Fatal(err)
	}
	l, err := broker.Listen(sock, 0o600, -1)
	if err != nil {
		t.Fatal(err)
	}
	go b.Serve(l)
	return b, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		b.Stop(ctx)
		if err := b.Check(); err != nil {
			t.Errorf("broker Check: %v", err)
		}
		b.Close()
		sim.Close()
	}
}

// TestBrokerRestart: when the broker restarts, the allocator's next
// growth connects to the new one; memory the old one granted stays valid
// and is released without being given to the new one.
func TestBrokerRestart(t *testing.T) {
	dir, err := os.MkdirTemp("", "ab")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "b.sock")
	_, stopOld := serveBrokerAt(t, sock)
	a := brokerAllocator(t, "unix://"+sock, "a", DefaultConfig())
	old, err := a.Malloc(8<<20, cudart.DefaultStream)
	if err != nil {
		t.Fatal(err)
	}
	stopOld()
	nb, stopNew := serveBrokerAt(t, sock)
	defer stopNew()
	fresh, err := a.Malloc(40<<20, cudart.DefaultStream)
	if err != nil {
		t.Fatalf("growth after the broker restarted: %v", err)
	}
	if err := a.Check(); err != nil {
		t.Fatal(err)
	}
	held := nb.Stats().Devices[0].HeldBytes
	if held == 0 || held >= uint64(a.Stats().ReservedBytes[PoolAll].Current) {
		t.Fatalf("the new broker holds %d bytes for the allocator's %d reserved: want its growth only", held, a.Stats().ReservedBytes[PoolAll].Current)
	}
	for _, p := range []cudart.Ptr{old, fresh} {
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if st := nb.Stats().Devices[0]; st.HeldBytes != 0 {
		t.Fatalf("after EmptyCache the new broker still counts %d bytes held", st.HeldBytes)
	}
}
