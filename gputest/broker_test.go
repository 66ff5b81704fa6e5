package gputest

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/allocscript"
	"github.com/allocd/allocd/internal/brokertest"
)

// The node broker on a real GPU: its grants timed beside cudaMalloc, a
// chunk moving between clients timed beside cudaFree + cudaMalloc, and
// allocator processes exchanging memory through it, with kill -9.

// brokerChildEnv makes the test binary an allocscript client.
const brokerChildEnv = "ALLOCD_GPUTEST_BROKER_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(brokerChildEnv) != "" {
		os.Exit(allocscript.Run(os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}

func quantiles(ds []time.Duration) (median, p99 time.Duration) {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2], s[min(len(s)-1, len(s)*99/100)]
}

func logFigure(t *testing.T, name string, size uint64, ds []time.Duration) {
	m, p := quantiles(ds)
	t.Logf("broker: %s %dMiB n=%d median_us=%.1f p99_us=%.1f", name, size>>20, len(ds), float64(m.Nanoseconds())/1e3, float64(p.Nanoseconds())/1e3)
}

// mappedChunk is a chunk imported and mapped by the test process.
type mappedChunk struct {
	h cudart.Handle
	p cudart.Ptr
	n uint64
}

func importMap(t *testing.T, dev *cudart.CUDA, ch broker.Chunk, p cudart.Ptr) mappedChunk {
	t.Helper()
	h, err := dev.Import(ch.FD, ch.Size)
	unix.Close(ch.FD)
	if err != nil {
		t.Fatal(err)
	}
	if err := dev.Map(p, ch.Size, h); err != nil {
		t.Fatal(err)
	}
	return mappedChunk{h, p, ch.Size}
}

func (m mappedChunk) drop(t *testing.T, dev *cudart.CUDA) {
	t.Helper()
	if err := dev.Unmap(m.p, m.n); err != nil {
		t.Fatal(err)
	}
	if err := dev.Release(m.h); err != nil {
		t.Fatal(err)
	}
}

// TestGPUBrokerLatency times, per size: a grant the broker must create
// (create, export, send), a grant from its cache, and cudaMalloc; and a
// chunk's move from one client to another (unmap, release, return; grant,
// import, map), within a tenant and across tenants (with the scrub),
// beside cudaFree + cudaMalloc.
func TestGPUBrokerLatency(t *testing.T) {
	dev := shareableGPU(t)
	g := brokertest.Serve(t, []cudart.Device{dev}, "tenants:\n  - name: lat\n  - name: xa\n  - name: xb\n")
	// xa and xb hold nothing but the moving chunk, so each of their grants
	// takes it, from the other tenant, zeroed; lat has chunks of its own
	// cached and would take one of those.
	c, xa, xb := g.Dial(t, "lat"), g.Dial(t, "xa"), g.Dial(t, "xb")
	const n = 30
	for _, size := range []uint64{2 * miB, 64 * miB} {
		// n grants timed, then all returned: the first round creates every
		// chunk, the second takes them from the cache.
		grantRound := func() []time.Duration {
			var ds []time.Duration
			var ids []uint64
			for range n {
				start := time.Now()
				ch, err := c.Grant(0, size)
				ds = append(ds, time.Since(start))
				if err != nil {
					t.Fatal(err)
				}
				unix.Close(ch.FD)
				ids = append(ids, ch.ID)
			}
			for _, id := range ids {
				if err := c.Return(id); err != nil {
					t.Fatal(err)
				}
			}
			return ds
		}
		fresh, cached := grantRound(), grantRound()
		var mallocs []time.Duration
		var frees, freeMallocs []time.Duration
		var ps []cudart.Ptr
		for range n {
			start := time.Now()
			p, err := dev.Malloc(size)
			mallocs = append(mallocs, time.Since(start))
			if err != nil {
				t.Fatal(err)
			}
			ps = append(ps, p)
		}
		for _, p := range ps {
			start := time.Now()
			if err := dev.Free(p); err != nil {
				t.Fatal(err)
			}
			frees = append(frees, time.Since(start))
		}
		p, err := dev.Malloc(size)
		if err != nil {
			t.Fatal(err)
		}
		for range n {
			start := time.Now()
			if err := dev.Free(p); err != nil {
				t.Fatal(err)
			}
			if p, err = dev.Malloc(size); err != nil {
				t.Fatal(err)
			}
			freeMallocs = append(freeMallocs, time.Since(start))
		}
		dev.Free(p)

		// A chunk moving between two clients, each with its own range.
		va, err := dev.Reserve(size)
		if err != nil {
			t.Fatal(err)
		}
		vb, err := dev.Reserve(size)
		if err != nil {
			t.Fatal(err)
		}
		ch, err := c.Grant(0, size)
		if err != nil {
			t.Fatal(err)
		}
		m := importMap(t, dev, ch, va)
		var same, cross []time.Duration
		cur, curVA := c, va // who holds the chunk, and where it is mapped
		for i := range 2 * n {
			// The first n moves stay within tenant lat; the next n pass
			// the chunk between xa and xb, so the broker zeroes it.
			crossing := i >= n
			next, nextVA := cur, vb
			if curVA == vb {
				nextVA = va
			}
			if crossing {
				next = xa
				if cur == xa {
					next = xb
				}
			}
			start := time.Now()
			m.drop(t, dev)
			if err := cur.Return(ch.ID); err != nil {
				t.Fatal(err)
			}
			if ch, err = next.Grant(0, size); err != nil {
				t.Fatal(err)
			}
			m = importMap(t, dev, ch, nextVA)
			d := time.Since(start)
			cur, curVA = next, nextVA
			if crossing {
				if !ch.Scrubbed {
					t.Fatalf("move %d to another tenant was not scrubbed", i)
				}
				cross = append(cross, d)
			} else {
				same = append(same, d)
			}
		}
		m.drop(t, dev)
		if err := cur.Return(ch.ID); err != nil {
			t.Fatal(err)
		}
		dev.ReleaseRange(va, size)
		dev.ReleaseRange(vb, size)

		logFigure(t, "grant_create", size, fresh)
		logFigure(t, "grant_cached", size, cached)
		logFigure(t, "cudaMalloc", size, mallocs)
		logFigure(t, "cudaFree", size, frees)
		logFigure(t, "move_same_tenant", size, same)
		logFigure(t, "move_cross_tenant_scrubbed", size, cross)
		logFigure(t, "cudaFree+cudaMalloc", size, freeMallocs)
	}
	st := g.B.Stats().Devices[0]
	t.Logf("broker: scrubs %d, %d bytes, %v", st.Scrubs, st.ScrubbedBytes, st.ScrubTime)
}

// child starts an allocscript client process on the GPU, connected to
// g as tenant.
func child(t *testing.T, g *brokertest.Server, name, tenant string) *allocscript.TestChild {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	var env []string
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "ALLOCD_") {
			env = append(env, e)
		}
	}
	cmd.Env = append(env, brokerChildEnv+"=1", "ALLOCD_BROKER="+g.Addr(), "ALLOCD_TENANT="+tenant)
	cmd.Stderr = os.Stderr
	return allocscript.StartTest(t, name, cmd)
}

func waitHeld(t *testing.T, b *broker.Broker, tenant string, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		held := uint64(0)
		for _, ts := range b.Stats().Tenants {
			if ts.Tenant == tenant {
				held += ts.Granted
			}
		}
		if held == 0 {
			return time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("tenant %s still holds %d bytes after %v", tenant, held, within)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestGPUBrokerProcesses: allocator processes on the GPU exchange memory
// through the broker. A chunk one process of a tenant gave back reaches
// the next of that tenant as it was, and the other tenant as zeros;
// quotas hold; kill -9 of a process returns all its memory, which the
// other process then gets without the broker creating any.
func TestGPUBrokerProcesses(t *testing.T) {
	dev := shareableGPU(t)
	g := brokertest.Serve(t, []cudart.Device{dev}, "tenants:\n  - name: red\n    quota: 1GiB\n  - name: blue\n    quota: 1GiB\n  - name: victim\n  - name: heir\n")
	sizes := []string{"67108864", "20971520", "2097152", "4194304"}
	round := func(p *allocscript.TestChild, mark string) []string {
		for _, s := range sizes {
			p.Must("malloc " + s)
		}
		seen := strings.Split(p.Must("scan"), ",")
		p.Must("fill " + mark)
		p.Must("check")
		p.Must("free")
		p.Must("empty")
		if err := g.B.Check(); err != nil {
			t.Fatal(err)
		}
		return seen
	}
	red1, red2, blue1 := child(t, g, "red1", "red"), child(t, g, "red2", "red"), child(t, g, "blue1", "blue")
	round(red1, "0x11")
	creates := g.B.Stats().Devices[0].Creates
	if seen := round(red2, "0x12"); !slices.Contains(seen, "0x11") {
		t.Fatalf("red2 did not get red1's chunks as they were: saw %v", seen)
	}
	if seen := round(blue1, "0x22"); !slices.Equal(seen, []string{"0x00"}) {
		t.Fatalf("blue1 read %v in memory red held before; want only zeros", seen)
	}
	if st := g.B.Stats().Devices[0]; st.Creates != creates || st.Scrubs == 0 {
		t.Fatalf("the cache did not serve red2 and blue1: %d chunks made, %d scrubs", st.Creates-creates, st.Scrubs)
	}
	red1.Must("malloc 1073741824")
	if _, err := red2.Do("malloc 67108864"); err == nil || !strings.Contains(err.Error(), "quota 1.00 GiB") {
		t.Fatalf("red2 over red's quota: %v", err)
	}
	red1.Must("free")
	red1.Must("empty")
	t.Log("broker: processes exchanged memory: same tenant as it was, other tenant zeroed, quota exact")

	victim, heir := child(t, g, "victim", "victim"), child(t, g, "heir", "heir")
	victim.Must("malloc 2147483648")
	victim.Must("fill 0x5a")
	free0, _, err := dev.MemGetInfo()
	if err != nil {
		t.Fatal(err)
	}
	creates = g.B.Stats().Devices[0].Creates
	if err := victim.Process().Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	took := waitHeld(t, g.B, "victim", time.Second)
	heir.Must("malloc 2147483648")
	if seen := heir.Must("scan"); strings.Contains(seen, "0x5a") {
		t.Fatalf("the heir read the killed victim's bytes: %s", seen)
	}
	free1, _, err := dev.MemGetInfo()
	if err != nil {
		t.Fatal(err)
	}
	st := g.B.Stats().Devices[0]
	t.Logf("broker: kill9 2GiB reclaimed_ms=%.1f; the heir's 2 GiB came from the cache: %d chunks made; device free before %d MiB, after %d MiB",
		float64(took.Microseconds())/1e3, st.Creates-creates, free0>>20, free1>>20)
	if st.Creates != creates {
		t.Errorf("the heir's grant created %d chunks; the victim's memory should have served it", st.Creates-creates)
	}
	heir.Must("free")
	heir.Must("check")
	for _, p := range []*allocscript.TestChild{red1, red2, blue1, heir} {
		p.Quit()
	}
}
