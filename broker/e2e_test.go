package broker_test

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/internal/allocscript"
	"github.com/allocd/allocd/internal/brokertest"
	"github.com/allocd/allocd/simdev"
)

// The end-to-end tests run a broker in the test process and allocators
// in child processes: the test binary itself, started with
// ALLOCD_E2E_CLIENT set, serving package allocscript's commands.

const envE2EClient = "ALLOCD_E2E_CLIENT"

func TestMain(m *testing.M) {
	if os.Getenv(envE2EClient) != "" {
		os.Exit(allocscript.Run(os.Stdin, os.Stdout))
	}
	os.Exit(m.Run())
}

// startE2EBroker serves a broker over one shared simulated device of
// capacity bytes.
func startE2EBroker(t *testing.T, capacity uint64, tenantsYAML string) *brokertest.Server {
	t.Helper()
	sim, err := simdev.New(simdev.Config{Capacity: capacity, Shared: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sim.Close() })
	return brokertest.Serve(t, []cudart.Device{sim}, tenantsYAML)
}

// startClient starts a client process connected to e as tenant.
func startClient(t *testing.T, e *brokertest.Server, name, tenant string) *allocscript.TestChild {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envE2EClient+"=1", "ALLOCD_DEVICE=sim", "ALLOCD_SIM_CAPACITY=1GiB",
		"ALLOCD_BROKER="+e.Addr(), "ALLOCD_TENANT="+tenant, "ALLOCD_CONF=")
	cmd.Stderr = os.Stderr
	return allocscript.StartTest(t, name, cmd)
}

func tenantStats(b *broker.Broker, tenant string) broker.TenantStats {
	for _, ts := range b.Stats().Tenants {
		if ts.Tenant == tenant && ts.Device == 0 {
			return ts
		}
	}
	return broker.TenantStats{}
}

// TestE2EFourProcessesExchangeMemory: two tenants, four processes.
// Memory one process gave back reaches the next of its tenant as it was
// (the same physical memory, the Sim's memfd) and the other tenant's
// processes as zeros; quotas hold exactly.
func TestE2EFourProcessesExchangeMemory(t *testing.T) {
	e := startE2EBroker(t, 128<<20, "tenants:\n  - name: red\n    quota: 24MiB\n  - name: blue\n    quota: 24MiB\n")
	red1, blue1 := startClient(t, e, "red1", "red"), startClient(t, e, "blue1", "blue")
	red2, blue2 := startClient(t, e, "red2", "red"), startClient(t, e, "blue2", "blue")
	sizes := []string{"2097152", "6291456", "1048576", "4194304"} // 2, 6, 1, 4 MiB
	check := func() {
		t.Helper()
		if err := e.B.Check(); err != nil {
			t.Fatal(err)
		}
	}
	round := func(p *allocscript.TestChild, mark string) []string {
		t.Helper()
		for _, s := range sizes {
			p.Must("malloc " + s)
		}
		seen := strings.Split(p.Must("scan"), ",")
		p.Must("fill " + mark)
		p.Must("check")
		p.Must("free")
		p.Must("empty")
		check()
		return seen
	}
	round(red1, "0x11")
	st := e.B.Stats().Devices[0]
	if st.HeldBytes != 0 || st.CachedBytes == 0 {
		t.Fatalf("after red1: %+v", st)
	}
	creates := st.Creates
	// red2 makes the same requests and gets red1's chunks back as they
	// were: the same physical memory, from another process.
	if seen := round(red2, "0x12"); !slices.Contains(seen, "0x11") {
		t.Fatalf("red2 did not get red1's chunks as they were: saw %v", seen)
	}
	// blue1 gets the same chunks, zeroed: nothing of red's.
	if seen := round(blue1, "0x22"); !slices.Equal(seen, []string{"0x00"}) {
		t.Fatalf("blue1 read %v in memory red held before; want only zeros", seen)
	}
	st = e.B.Stats().Devices[0]
	if st.Creates != creates || st.Scrubs == 0 {
		t.Fatalf("red2 and blue1 made %d chunks and %d scrubs; the cache should have served both, zeroing for blue", st.Creates-creates, st.Scrubs)
	}
	if seen := round(blue2, "0x21"); !slices.Contains(seen, "0x22") || slices.Contains(seen, "0x12") {
		t.Fatalf("blue2 saw %v: want blue1's bytes and none of red's", seen)
	}
	// red1 takes blue's memory and more: it reads zeros, never blue's
	// bytes.
	red1.Must("malloc 25165824") // 96 MiB: the whole quota, more than red's cached chunks
	if seen := red1.Must("scan"); strings.Contains(seen, "0x2") {
		t.Fatalf("red1 read blue's bytes: %s", seen)
	}
	// Quotas hold exactly: red holds 24 MiB, its quota; another red
	// process gets nothing more, and its error names the quota.
	if ts := tenantStats(e.B, "red"); ts.Granted != 24<<20 {
		t.Fatalf("red holds %d bytes, want 24 MiB", ts.Granted)
	}
	_, err := red2.Do("malloc 2097152")
	if err == nil || !strings.Contains(err.Error(), "quota 24.00 MiB") || !strings.Contains(err.Error(), `tenant "red"`) {
		t.Fatalf("malloc over red's quota: %v", err)
	}
	blue1.Must("malloc 25165824") // blue's whole quota, beside red's
	red1.Must("free")
	red1.Must("empty")
	red2.Must("malloc 2097152")
	check()
	for _, p := range []*allocscript.TestChild{red1, blue1, red2, blue2} {
		p.Must("free")
		p.Must("check")
		p.Quit()
	}
	waitBroker(t, e.B, time.Second, func(s broker.Stats) bool { return s.Devices[0].HeldBytes == 0 })
	check()
}

func waitBroker(t *testing.T, b *broker.Broker, d time.Duration, cond func(broker.Stats) bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond(b.Stats()) {
		if time.Since(start) > d {
			t.Fatalf("broker state not reached within %v: %+v", d, b.Stats())
		}
		time.Sleep(2 * time.Millisecond)
	}
	return time.Since(start)
}

// TestE2EKillReturnsMemory: kill -9 of a client holding memory returns
// all of it to the cache within a second, and the other tenant can use
// it at once.
func TestE2EKillReturnsMemory(t *testing.T) {
	e := startE2EBroker(t, 32<<20, "tenants:\n  - name: victim\n  - name: other\n")
	victim := startClient(t, e, "victim", "victim")
	victim.Must("malloc 16777216")
	victim.Must("malloc 8388608")
	victim.Must("fill 0x33")
	other := startClient(t, e, "other", "other")
	if _, err := other.Do("malloc 16777216"); err == nil {
		t.Fatal("the device had room for the other tenant beside the victim")
	}
	held := tenantStats(e.B, "victim").Granted
	if held < 24<<20 {
		t.Fatalf("victim holds %d bytes", held)
	}
	if err := victim.Process().Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	took := waitBroker(t, e.B, time.Second, func(s broker.Stats) bool { return s.Devices[0].HeldBytes == 0 })
	t.Logf("kill -9: %d bytes back in the cache after %v", held, took)
	ts := tenantStats(e.B, "victim")
	if ts.ReclaimedBytes != held || e.B.Stats().ClientsReclaimed["victim"] != 1 {
		t.Fatalf("victim's figures after the kill: %+v", ts)
	}
	other.Must("malloc 16777216")
	if seen := other.Must("scan"); strings.Contains(seen, "0x33") {
		t.Fatalf("the other tenant read the killed victim's bytes: %s", seen)
	}
	other.Must("free")
	other.Quit()
}

// TestE2EBrokerGone: when the broker goes away, allocations already
// made stay valid and new growth fails with a clear error.
func TestE2EBrokerGone(t *testing.T) {
	e := startE2EBroker(t, 128<<20, "tenants:\n  - name: a\n")
	p := startClient(t, e, "a", "a")
	p.Must("malloc 8388608")
	p.Must("fill 0x44")
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	e.B.Stop(ctx)
	if err := e.B.Close(); err != nil {
		t.Fatal(err)
	}
	if seen := p.Must("scan"); seen != "0x44" {
		t.Fatalf("after the broker went: held memory reads %q", seen)
	}
	_, err := p.Do("malloc 67108864")
	if err == nil || !strings.Contains(err.Error(), "ALLOCD_BROKER_FALLBACK=local") {
		t.Fatalf("growth without the broker: %v", err)
	}
	p.Must("free")
	p.Quit()
}
