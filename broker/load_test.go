package broker

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLoad: 64 clients of 4 tenants grant and return chunks as fast as
// they can. No chunk is lost (the broker's figures equal the sum of
// the clients' at a pause), no descriptor leaks, and the process's
// memory does not grow with the cycles. ALLOCD_BROKER_LOAD_CYCLES sets
// the cycles per client (default 100, or 30 with -short; the full load
// is 10000).
func TestLoad(t *testing.T) {
	cycles := 100
	if testing.Short() {
		cycles = 30
	}
	if v := os.Getenv("ALLOCD_BROKER_LOAD_CYCLES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 2 {
			t.Fatalf("ALLOCD_BROKER_LOAD_CYCLES=%q: want a number of cycles, at least 2", v)
		}
		cycles = n
	}
	const clients, tenants = 64, 4
	ts, _ := ParseTenants([]byte("tenants:\n  - name: t0\n    quota: 256MiB\n  - name: t1\n    quota: 256MiB\n  - name: t2\n  - name: t3\n"))
	h := startBroker(t, 1, 2<<30, func(c *Config) { c.Tenants = ts })
	cs := make([]*Client, clients)
	for i := range cs {
		cs[i] = h.dial("t" + strconv.Itoa(i%tenants))
	}
	// One run of half the cycles warms the caches; the second half must
	// not grow the heap or the descriptors.
	held := make([][]Chunk, clients)
	run := func(n int) time.Duration {
		start := time.Now()
		var wg sync.WaitGroup
		for i, c := range cs {
			wg.Go(func() {
				for j := range n {
					size := uint64(2+2*((i+j)%4)) * mib
					ch, err := c.Grant(0, size)
					if err != nil {
						t.Errorf("client %d cycle %d: %v", i, j, err)
						return
					}
					unix.Close(ch.FD)
					if err := c.Return(ch.ID); err != nil {
						t.Errorf("client %d cycle %d: %v", i, j, err)
						return
					}
				}
				// Each client ends holding two chunks, for the count below.
				for k := range 2 {
					ch, err := c.Grant(0, uint64(2+2*k)*mib)
					if err != nil {
						t.Errorf("client %d: %v", i, err)
						return
					}
					unix.Close(ch.FD)
					held[i] = append(held[i], ch)
				}
			})
		}
		wg.Wait()
		return time.Since(start)
	}
	// settle returns the heap in use, the process's anonymous resident
	// memory (RssAnon: not the chunks, which are memfd pages) and the
	// descriptors open, less the broker's chunks' (two each: the
	// simulated device's memfd and the broker's exported copy).
	settle := func() (heap, anon uint64, fds int) {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		ents, _ := os.ReadDir("/proc/self/fd")
		return ms.HeapInuse, rssAnon(t), len(ents) - 2*h.b.Stats().Devices[0].Chunks
	}
	countAndReturn := func() {
		t.Helper()
		var sum uint64
		perTenant := make(map[string]uint64)
		for i, hs := range held {
			for _, ch := range hs {
				sum += ch.Size
				perTenant[cs[i].Tenant()] += ch.Size
			}
		}
		st := h.b.Stats()
		if st.Devices[0].HeldBytes != sum {
			t.Fatalf("the broker counts %d bytes held; its clients hold %d", st.Devices[0].HeldBytes, sum)
		}
		for _, x := range st.Tenants {
			if x.Granted != perTenant[x.Tenant] {
				t.Fatalf("tenant %s: the broker counts %d bytes, its clients hold %d", x.Tenant, x.Granted, perTenant[x.Tenant])
			}
		}
		h.check()
		for i, hs := range held {
			for _, ch := range hs {
				if err := cs[i].Return(ch.ID); err != nil {
					t.Fatal(err)
				}
			}
			held[i] = nil
		}
	}
	first := run(cycles / 2)
	countAndReturn()
	heap1, anon1, fds1 := settle()
	second := run(cycles - cycles/2)
	countAndReturn()
	heap2, anon2, fds2 := settle()
	if fds2 != fds1 {
		t.Errorf("descriptors besides the chunks': %d after the first half, %d after the second", fds1, fds2)
	}
	if heap2 > heap1+4<<20 {
		t.Errorf("heap grew from %d to %d bytes over the second half", heap1, heap2)
	}
	if anon2 > anon1+16<<20 {
		t.Errorf("anonymous resident memory grew from %d to %d bytes over the second half", anon1, anon2)
	}
	st := h.b.Stats()
	ops := 2 * clients * cycles
	t.Logf("%d clients x %d grant/return cycles: %v + %v (%.1f µs per request, all clients); %d chunks made, %d scrubs; heap %d → %d bytes; RssAnon %d → %d KiB; %d descriptors besides the chunks'",
		clients, cycles, first, second, float64((first+second).Microseconds())/float64(ops), st.Devices[0].Creates, st.Devices[0].Scrubs, heap1, heap2, anon1>>10, anon2>>10, fds2)
	if st.Devices[0].HeldBytes != 0 {
		t.Fatalf("%d bytes held at the end", st.Devices[0].HeldBytes)
	}
}

// rssAnon reads RssAnon from /proc/self/status, in bytes.
func rssAnon(t *testing.T) uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "RssAnon:"); ok {
			kib, err := strconv.ParseUint(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kib << 10
		}
	}
	t.Fatal("no RssAnon in /proc/self/status")
	return 0
}
