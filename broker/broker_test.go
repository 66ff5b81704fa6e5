package broker

import (
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

const mib = 1 << 20

// harness is a broker on a socket, over shared simulated devices.
type harness struct {
	t    *testing.T
	b    *Broker
	sock string
	devs []*simdev.Sim
}

// shortDir returns a temporary directory with a path short enough for a
// Unix socket (108 bytes).
func shortDir(t testing.TB) string {
	dir, err := os.MkdirTemp("", "ab")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func newSharedSim(t testing.TB, index int, capacity uint64) *simdev.Sim {
	s, err := simdev.New(simdev.Config{Index: index, Capacity: capacity, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// startBroker serves a broker on ndev shared simulated devices of
// capacity bytes each; edit changes its Config. Cleanup stops it and
// fails the test if Check finds anything.
func startBroker(t *testing.T, ndev int, capacity uint64, edit func(*Config)) *harness {
	t.Helper()
	h := &harness{t: t, sock: filepath.Join(shortDir(t), "b.sock")}
	var devs []cudart.Device
	for i := range ndev {
		s := newSharedSim(t, i, capacity)
		h.devs = append(h.devs, s)
		devs = append(devs, s)
	}
	cfg := Config{Devices: devs}
	if edit != nil {
		edit(&cfg)
	}
	b, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.b = b
	l, err := Listen(h.sock, 0o600, -1)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- b.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		b.Stop(ctx)
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		if err := b.Check(); err != nil {
			t.Errorf("Check after the test: %v", err)
		}
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		for _, s := range h.devs {
			s.Close()
		}
	})
	return h
}

func (h *harness) dial(tenant string) *Client {
	h.t.Helper()
	c, err := Dial(context.Background(), "unix://"+h.sock, tenant, 5*time.Second)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { c.Close() })
	return c
}

func (h *harness) check() {
	h.t.Helper()
	if err := h.b.Check(); err != nil {
		h.t.Fatal(err)
	}
}

// mapped is a granted chunk imported and mapped by a client's own Sim.
type mapped struct {
	sim *simdev.Sim
	h   cudart.Handle
	p   cudart.Ptr
	n   uint64
}

func mapChunk(t *testing.T, sim *simdev.Sim, ch Chunk) mapped {
	t.Helper()
	h, err := sim.Import(ch.FD, ch.Size)
	unix.Close(ch.FD)
	if err != nil {
		t.Fatal(err)
	}
	p, err := sim.Reserve(ch.Size)
	if err != nil {
		t.Fatal(err)
	}
	if err := sim.Map(p, ch.Size, h); err != nil {
		t.Fatal(err)
	}
	return mapped{sim, h, p, ch.Size}
}

func (m mapped) write(t *testing.T, b byte) {
	t.Helper()
	if err := m.sim.MemcpyHtoD(m.p, bytes.Repeat([]byte{b}, int(m.n))); err != nil {
		t.Fatal(err)
	}
}

func (m mapped) read(t *testing.T) []byte {
	t.Helper()
	out := make([]byte, m.n)
	if err := m.sim.MemcpyDtoH(out, m.p); err != nil {
		t.Fatal(err)
	}
	return out
}

func (m mapped) unmap(t *testing.T) {
	t.Helper()
	if err := m.sim.Unmap(m.p, m.n); err != nil {
		t.Fatal(err)
	}
	if err := m.sim.ReleaseRange(m.p, m.n); err != nil {
		t.Fatal(err)
	}
	if err := m.sim.Release(m.h); err != nil {
		t.Fatal(err)
	}
}

func allIs(b []byte, v byte) bool {
	for _, c := range b {
		if c != v {
			return false
		}
	}
	return true
}

func TestGrantReturnAndReuse(t *testing.T) {
	h := startBroker(t, 1, 64*mib, nil)
	c := h.dial("a")
	if got := c.Devices(); len(got) != 1 || got[0].Granularity != 2*mib || got[0].UUID == "" {
		t.Fatalf("Devices = %+v", got)
	}
	ch, err := c.Grant(0, 4*mib)
	if err != nil {
		t.Fatal(err)
	}
	h.check()
	local := newSharedSim(t, 0, 64*mib)
	defer local.Close()
	m := mapChunk(t, local, ch)
	m.write(t, 0xab)
	m.unmap(t)
	if err := c.Return(ch.ID); err != nil {
		t.Fatal(err)
	}
	h.check()
	st := h.b.Stats()
	if d := st.Devices[0]; d.CachedBytes != 4*mib || d.HeldBytes != 0 || d.Creates != 1 {
		t.Fatalf("after return: %+v", d)
	}
	// The same tenant gets the same physical memory back, as it was.
	ch2, err := c.Grant(0, 4*mib)
	if err != nil {
		t.Fatal(err)
	}
	if ch2.ID != ch.ID || ch2.Scrubbed {
		t.Fatalf("second grant: chunk %d scrubbed %v, want chunk %d unscrubbed", ch2.ID, ch2.Scrubbed, ch.ID)
	}
	m2 := mapChunk(t, local, ch2)
	if !allIs(m2.read(t), 0xab) {
		t.Fatal("the same tenant's chunk did not keep its bytes: not the same memory")
	}
	m2.unmap(t)
	if err := c.Return(ch2.ID); err != nil {
		t.Fatal(err)
	}
	if err := c.Return(ch2.ID); err == nil || !strings.Contains(err.Error(), "not held") {
		t.Fatalf("second return: %v, want a refusal naming the chunk", err)
	}
	h.check()
}

func TestScrubBetweenTenants(t *testing.T) {
	h := startBroker(t, 1, 64*mib, nil)
	a, b := h.dial("a"), h.dial("b")
	simA, simB := newSharedSim(t, 0, 64*mib), newSharedSim(t, 0, 64*mib)
	defer simA.Close()
	defer simB.Close()
	ch, err := a.Grant(0, 2*mib)
	if err != nil {
		t.Fatal(err)
	}
	m := mapChunk(t, simA, ch)
	m.write(t, 0x5a)
	m.unmap(t)
	if err := a.Return(ch.ID); err != nil {
		t.Fatal(err)
	}
	chB, err := b.Grant(0, 2*mib)
	if err != nil {
		t.Fatal(err)
	}
	if chB.ID != ch.ID || !chB.Scrubbed {
		t.Fatalf("tenant b got chunk %d (scrubbed %v), want chunk %d scrubbed", chB.ID, chB.Scrubbed, ch.ID)
	}
	mB := mapChunk(t, simB, chB)
	if !allIs(mB.read(t), 0) {
		t.Fatal("tenant a's bytes reached tenant b")
	}
	mB.unmap(t)
	if err := b.Return(chB.ID); err != nil {
		t.Fatal(err)
	}
	if s := h.b.Stats().Devices[0]; s.Scrubs != 1 || s.ScrubbedBytes != 2*mib || s.ScrubTime <= 0 {
		t.Fatalf("scrub figures: %+v", s)
	}
	h.check()
}

func TestFreshChunkAfterDirtyReleaseIsScrubbed(t *testing.T) {
	// 8 MiB of device: a's 4 MiB chunk is cached; b's 6 MiB grant needs
	// it released, and the fresh chunk may hold a's bytes.
	h := startBroker(t, 1, 8*mib, nil)
	a, b := h.dial("a"), h.dial("b")
	ch, err := a.Grant(0, 4*mib)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Return(ch.ID); err != nil {
		t.Fatal(err)
	}
	chB, err := b.Grant(0, 6*mib)
	if err != nil {
		t.Fatal(err)
	}
	if !chB.Scrubbed {
		t.Fatal("a chunk made after a tenant's chunk was released was not scrubbed")
	}
	unix.Close(chB.FD)
	if s := h.b.Stats().Devices[0]; s.Releases != 1 || s.Creates != 2 {
		t.Fatalf("releases %d creates %d, want 1 and 2", s.Releases, s.Creates)
	}
	if err := b.Return(chB.ID); err != nil {
		t.Fatal(err)
	}
	h.check()
}

func TestQuotaExact(t *testing.T) {
	tenants, err := ParseTenants([]byte("tenants:\n  - name: a\n    quota: 6MiB\n    gpus:\n      \"1\": 2MiB\n  - name: b\n"))
	if err != nil {
		t.Fatal(err)
	}
	h := startBroker(t, 2, 64*mib, func(c *Config) { c.Tenants = tenants })
	a := h.dial("a")
	var ids []uint64
	for range 3 {
		ch, err := a.Grant(0, 2*mib)
		if err != nil {
			t.Fatalf("grant within the quota: %v", err)
		}
		unix.Close(ch.FD)
		ids = append(ids, ch.ID)
	}
	_, err = a.Grant(0, 2*mib)
	var re *RefusedError
	if !errors.As(err, &re) || re.Reason != ReasonQuota || re.Quota != 6*mib || re.Used != 6*mib || re.Asked != 2*mib {
		t.Fatalf("grant over the quota: %v (%+v)", err, re)
	}
	if !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Fatal("a quota refusal is not an out-of-memory error")
	}
	for _, want := range []string{`tenant "a"`, "quota 6.00 MiB", "in use 6.00 MiB", "asked 2.00 MiB"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not say %q", err, want)
		}
	}
	// GPU 1 has its own, smaller quota; b has none.
	if ch, err := a.Grant(1, 2*mib); err != nil {
		t.Fatal(err)
	} else {
		unix.Close(ch.FD)
		ids = append(ids, ch.ID)
	}
	if _, err := a.Grant(1, 2*mib); !errors.As(err, &re) || re.Reason != ReasonQuota {
		t.Fatalf("GPU 1 over its quota: %v", err)
	}
	u, err := a.Usage(0)
	if err != nil || u.Granted != 6*mib || u.Quota != 6*mib || !u.Limited {
		t.Fatalf("Usage = %+v, %v", u, err)
	}
	bc := h.dial("b")
	if ch, err := bc.Grant(0, 32*mib); err != nil {
		t.Fatalf("tenant without a quota: %v", err)
	} else {
		unix.Close(ch.FD)
		if err := bc.Return(ch.ID); err != nil {
			t.Fatal(err)
		}
	}
	// Returning one chunk makes room for exactly one more.
	if err := a.Return(ids[0]); err != nil {
		t.Fatal(err)
	}
	if ch, err := a.Grant(0, 2*mib); err != nil {
		t.Fatalf("grant after a return: %v", err)
	} else {
		unix.Close(ch.FD)
	}
	st := h.b.Stats()
	for _, ts := range st.Tenants {
		if ts.Tenant == "a" && ts.Device == 0 && (ts.Granted != 6*mib || ts.Refusals[ReasonQuota] != 1 || ts.Grants != 4) {
			t.Errorf("tenant a on GPU 0: %+v", ts)
		}
	}
	h.check()
}

func TestOutOfMemoryRefusal(t *testing.T) {
	h := startBroker(t, 1, 8*mib, nil)
	c := h.dial("a")
	ch, err := c.Grant(0, 6*mib)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	_, err = c.Grant(0, 4*mib)
	var re *RefusedError
	if !errors.As(err, &re) || re.Reason != ReasonOutOfMemory || !errors.Is(err, cudart.ErrOutOfMemory) {
		t.Fatalf("grant past the device: %v", err)
	}
	if !strings.Contains(err.Error(), "GPU 0") {
		t.Errorf("refusal %q does not name the GPU", err)
	}
	h.check()
}

func TestBadRequests(t *testing.T) {
	tenants, err := ParseTenants([]byte("tenants:\n  - name: a\n  - name: only-root\n    uids: [4294967294]\n"))
	if err != nil {
		t.Fatal(err)
	}
	h := startBroker(t, 1, 64*mib, func(c *Config) { c.Tenants = tenants })
	c := h.dial("a")
	for _, tc := range []struct {
		dev  int
		size uint64
	}{{0, 0}, {0, 3 * mib}, {0, 1}, {1, 2 * mib}, {0, 128 * mib}} {
		_, err := c.Grant(tc.dev, tc.size)
		var re *RefusedError
		if !errors.As(err, &re) || re.Reason != ReasonInvalid {
			t.Errorf("Grant(%d, %d) = %v, want an invalid-request refusal", tc.dev, tc.size, err)
		}
	}
	// Still usable after refusals.
	if _, err := c.Usage(0); err != nil {
		t.Fatal(err)
	}
	for _, tenant := range []string{"nobody", "only-root"} {
		_, err := Dial(context.Background(), "unix://"+h.sock, tenant, time.Second)
		if err == nil || !errors.Is(err, ErrGone) {
			t.Errorf("Dial as %q: %v, want refused", tenant, err)
		}
	}
	if _, err := Dial(context.Background(), "unix://"+h.sock, "bad name", time.Second); err == nil {
		t.Error("Dial with a malformed tenant name succeeded")
	}
	for _, addr := range []string{"tcp://x:1", "relative/path", "unix://relative"} {
		if _, err := Dial(context.Background(), addr, "a", time.Second); err == nil {
			t.Errorf("Dial(%q) succeeded", addr)
		}
	}
	h.check()
}

func TestDisconnectReturnsChunksOfThisProcess(t *testing.T) {
	h := startBroker(t, 1, 64*mib, nil)
	c := h.dial("a")
	for range 3 {
		ch, err := c.Grant(0, 2*mib)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ch.FD)
	}
	c.Close()
	waitFor(t, time.Second, func() bool { return h.b.Stats().Devices[0].HeldBytes == 0 })
	st := h.b.Stats()
	if st.Devices[0].CachedBytes != 6*mib || st.ClientsReclaimed["a"] != 1 {
		t.Fatalf("after disconnect: %+v, reclaimed clients %v", st.Devices[0], st.ClientsReclaimed)
	}
	h.check()
}

func waitFor(t *testing.T, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %v", d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestBadClientsDoNotHarmOthers: garbage, half a frame, a wrong version
// and a client that never reads are each cut off while a good client
// goes on being served.
func TestBadClientsDoNotHarmOthers(t *testing.T) {
	h := startBroker(t, 1, 64*mib, func(c *Config) {
		c.FrameTimeout, c.HelloTimeout, c.WriteTimeout = time.Second, time.Second, time.Second
	})
	good := h.dial("good")
	raw := func() *net.UnixConn {
		c, err := net.Dial("unix", h.sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	hello, _ := AppendFrame(nil, Hello{Version: ProtocolVersion, Tenant: "bad"})
	usage, _ := AppendFrame(nil, Usage{Req: 1})

	garbage := raw()
	garbage.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	half := raw()
	half.Write(hello[:len(hello)-2])
	version := raw()
	v2, _ := AppendFrame(nil, Hello{Version: 99, Tenant: "bad"})
	version.Write(v2)
	afterHello := raw()
	afterHello.Write(hello)
	afterHello.Write([]byte{0xff, 0xff, 0xff, 0x7f}) // a frame longer than MaxFrame
	deaf := raw()
	deaf.Write(hello)
	// The deaf client never reads: its answers fill the socket until a
	// write times out.
	go func() {
		for range 200000 {
			if _, err := deaf.Write(usage); err != nil {
				return
			}
		}
	}()
	// Meanwhile the good client is served without delay.
	for range 50 {
		start := time.Now()
		ch, err := good.Grant(0, 2*mib)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ch.FD)
		if err := good.Return(ch.ID); err != nil {
			t.Fatal(err)
		}
		// A grant that waited on a bad client would wait for its
		// timeout, a second.
		if d := time.Since(start); d > 500*time.Millisecond {
			t.Fatalf("a good client's grant took %v beside bad clients", d)
		}
	}
	waitFor(t, 5*time.Second, func() bool {
		e := h.b.Stats().ProtocolErrors
		return e["malformed"] >= 2 && e["timeout"] >= 2 && e["version"] >= 1
	})
	for _, c := range []*net.UnixConn{garbage, version} {
		c.SetReadDeadline(time.Now().Add(time.Second))
		buf := make([]byte, MaxFrame)
		body, err := readFrame(c, buf)
		if err != nil {
			t.Fatalf("no fault before the cut: %v", err)
		}
		if m, err := DecodeMessage(body); err != nil || m.Kind() != KindFault {
			t.Fatalf("last message %v, %v, want a fault", m, err)
		}
	}
	if _, err := good.Usage(0); err != nil {
		t.Fatal(err)
	}
	h.check()
}

func TestStopRefusesAndWaits(t *testing.T) {
	h := startBroker(t, 1, 64*mib, nil)
	c := h.dial("a")
	ch, err := c.Grant(0, 2*mib)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	stopped := make(chan []Holder, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		stopped <- h.b.Stop(ctx)
	}()
	waitFor(t, time.Second, func() bool { return h.b.Stats().Stopping })
	_, err = c.Grant(0, 2*mib)
	var re *RefusedError
	if !errors.As(err, &re) || re.Reason != ReasonStopping {
		t.Fatalf("grant while stopping: %v", err)
	}
	if err := c.Return(ch.ID); err != nil {
		t.Fatalf("return while stopping: %v", err)
	}
	select {
	case <-stopped:
		t.Fatal("Stop returned with a client connected")
	case <-time.After(50 * time.Millisecond):
	}
	c.Close()
	select {
	case hs := <-stopped:
		if len(hs) != 0 {
			t.Fatalf("holders after every client left: %+v", hs)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Stop did not return once the clients left")
	}
}

func TestStopTimeoutNamesHolders(t *testing.T) {
	h := startBroker(t, 1, 64*mib, nil)
	c := h.dial("keeper")
	ch, err := c.Grant(0, 4*mib)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	hs := h.b.Stop(ctx)
	if len(hs) != 1 || hs[0].Tenant != "keeper" || hs[0].Bytes[0] != 4*mib || !hs[0].Connected {
		t.Fatalf("holders = %+v", hs)
	}
}

func TestReloadTenants(t *testing.T) {
	t1, _ := ParseTenants([]byte("tenants:\n  - name: a\n    quota: 4MiB\n"))
	h := startBroker(t, 1, 64*mib, func(c *Config) { c.Tenants = t1 })
	c := h.dial("a")
	ch, err := c.Grant(0, 4*mib)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	if _, err := c.Grant(0, 2*mib); err == nil {
		t.Fatal("over the first quota")
	}
	t2, _ := ParseTenants([]byte("tenants:\n  - name: a\n    quota: 6MiB\n"))
	h.b.SetTenants(t2)
	ch2, err := c.Grant(0, 2*mib)
	if err != nil {
		t.Fatalf("after raising the quota: %v", err)
	}
	unix.Close(ch2.FD)
	t3, _ := ParseTenants([]byte("tenants:\n  - name: other\n"))
	h.b.SetTenants(t3)
	if _, err := c.Grant(0, 2*mib); err == nil || !strings.Contains(err.Error(), "no longer") {
		t.Fatalf("grant to a removed tenant: %v", err)
	}
	// What it holds stays held, and can be returned.
	if err := c.Return(ch.ID); err != nil {
		t.Fatal(err)
	}
	h.b.ReloadFailed()
	if st := h.b.Stats(); st.Reloads != 2 || st.ReloadFailures != 1 || st.LastReloadOK {
		t.Fatalf("reload figures: %+v", st)
	}
	h.check()
}

func TestListenRefusesLiveSocketAndRemovesStale(t *testing.T) {
	dir := shortDir(t)
	path := filepath.Join(dir, "s.sock")
	l, err := Listen(path, 0o660, -1)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o660 {
		t.Fatalf("socket mode: %v %v", fi.Mode(), err)
	}
	if _, err := Listen(path, 0o660, -1); err == nil || !strings.Contains(err.Error(), "another broker") {
		t.Fatalf("second Listen: %v", err)
	}
	// A stale socket (its listener gone without unlinking) is replaced.
	l.SetUnlinkOnClose(false)
	l.Close()
	l2, err := Listen(path, 0o600, -1)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	l2.Close()
	notSock := filepath.Join(dir, "file")
	os.WriteFile(notSock, nil, 0o600)
	if _, err := Listen(notSock, 0o600, -1); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
}

// TestConcurrentClients runs many clients of several tenants at once,
// with Check between rounds.
func TestConcurrentClients(t *testing.T) {
	tenants, _ := ParseTenants([]byte("tenants:\n  - name: t0\n    quota: 16MiB\n  - name: t1\n    quota: 16MiB\n  - name: t2\n"))
	h := startBroker(t, 2, 256*mib, func(c *Config) { c.Tenants = tenants })
	var wg sync.WaitGroup
	for i := range 12 {
		c := h.dial([]string{"t0", "t1", "t2"}[i%3])
		wg.Go(func() {
			var held []uint64
			for j := range 200 {
				if j%3 != 2 {
					ch, err := c.Grant(j%2, uint64(1+j%3)*2*mib)
					if err != nil {
						if !errors.Is(err, cudart.ErrOutOfMemory) {
							t.Error(err)
							return
						}
						continue
					}
					unix.Close(ch.FD)
					held = append(held, ch.ID)
				} else if len(held) > 0 {
					if err := c.Return(held[0]); err != nil {
						t.Error(err)
						return
					}
					held = held[1:]
				}
			}
			for _, id := range held {
				if err := c.Return(id); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	h.check()
	st := h.b.Stats()
	for _, d := range st.Devices {
		if d.HeldBytes != 0 {
			t.Errorf("GPU %d: %d bytes still held after every client returned all", d.Index, d.HeldBytes)
		}
	}
	for _, ts := range st.Tenants {
		if ts.Limited && ts.Granted > ts.Quota {
			t.Errorf("tenant %s over quota: %+v", ts.Tenant, ts)
		}
	}
}

// failingMemset is a shared Sim whose memsets fail while fail is set.
type failingMemset struct {
	*simdev.Sim
	fail atomic.Bool
}

func (f *failingMemset) MemsetAsync(p cudart.Ptr, v byte, n uint64, s cudart.Stream) error {
	if f.fail.Load() {
		return errors.New("injected memset failure")
	}
	return f.Sim.MemsetAsync(p, v, n, s)
}

// TestScrubFailureReleasesChunk: a chunk that cannot be zeroed is never
// granted: the grant is refused, the chunk released, and nothing is
// counted to the tenant.
func TestScrubFailureReleasesChunk(t *testing.T) {
	dev := &failingMemset{Sim: newSharedSim(t, 0, 64*mib)}
	defer dev.Close()
	h := &harness{t: t, sock: filepath.Join(shortDir(t), "b.sock")}
	b, err := New(Config{Devices: []cudart.Device{dev}})
	if err != nil {
		t.Fatal(err)
	}
	h.b = b
	l, err := Listen(h.sock, 0o600, -1)
	if err != nil {
		t.Fatal(err)
	}
	go b.Serve(l)
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		b.Stop(ctx)
		b.Close()
	}()
	a, c := h.dial("a"), h.dial("b")
	ch, err := a.Grant(0, 2*mib)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	if err := a.Return(ch.ID); err != nil {
		t.Fatal(err)
	}
	dev.fail.Store(true)
	_, err = c.Grant(0, 2*mib)
	var re *RefusedError
	if !errors.As(err, &re) || re.Reason != ReasonOutOfMemory || !strings.Contains(err.Error(), "zeroing") {
		t.Fatalf("grant of a chunk that cannot be zeroed: %v", err)
	}
	h.check()
	st := b.Stats()
	if d := st.Devices[0]; d.Releases != 1 || d.HeldBytes != 0 || d.Chunks != 0 || d.Scrubs != 0 {
		t.Fatalf("after the failed scrub: %+v", d)
	}
	for _, ts := range st.Tenants {
		if ts.Tenant == "b" && (ts.Grants != 0 || ts.Granted != 0 || ts.Refusals[ReasonOutOfMemory] != 1) {
			t.Fatalf("tenant b: %+v", ts)
		}
	}
	dev.fail.Store(false)
	ch, err = c.Grant(0, 2*mib)
	if err != nil {
		t.Fatal(err)
	}
	if !ch.Scrubbed {
		t.Fatal("a fresh chunk after a's chunk was released was not zeroed")
	}
	unix.Close(ch.FD)
	if err := c.Return(ch.ID); err != nil {
		t.Fatal(err)
	}
	h.check()
	a.Close()
	c.Close()
}

// TestTrimReleasesIdleChunks: Trim releases the cached chunks that have
// waited longer than asked, keeps the others and what clients hold, and
// chunks made after a tenant's chunk went back to the driver are zeroed.
func TestTrimReleasesIdleChunks(t *testing.T) {
	h := startBroker(t, 1, 64*mib, nil)
	a, b := h.dial("a"), h.dial("b")
	grant := func(c *Client, size uint64) Chunk {
		t.Helper()
		ch, err := c.Grant(0, size)
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ch.FD)
		return ch
	}
	old1, old2, kept := grant(a, 2*mib), grant(a, 4*mib), grant(a, 6*mib)
	a.Return(old1.ID)
	a.Return(old2.ID)
	if n := h.b.Trim(time.Hour); n != 0 {
		t.Fatalf("Trim(1h) released %d bytes of chunks cached just now", n)
	}
	// The two returned chunks wait 300ms; the next one is returned just
	// before the Trim, which keeps what waited less than 150ms: a margin
	// that a loaded machine running the race detector does not eat up
	// between a Return's reply and the Trim.
	time.Sleep(300 * time.Millisecond)
	held := grant(a, 8*mib)
	a.Return(held.ID) // cached just now
	if n := h.b.Trim(150 * time.Millisecond); n != 6*mib {
		t.Fatalf("Trim released %d bytes, want the two idle chunks' 6 MiB", n)
	}
	h.check()
	st := h.b.Stats().Devices[0]
	if st.CachedBytes != 8*mib || st.HeldBytes != 6*mib || st.Releases != 2 || st.Chunks != 2 {
		t.Fatalf("after Trim: %+v", st)
	}
	if ch := grant(b, 2*mib); !ch.Scrubbed {
		t.Fatal("a chunk made after a's chunks went back to the driver was not zeroed")
	}
	a.Return(kept.ID)
	h.check()
}
