package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/server"
)

func brokerTestFlags(t *testing.T) (serveFlags, string) {
	dir, err := os.MkdirTemp("", "ab")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	f := serveFlags{
		device: "sim", simCapacity: "256MiB", listen: "127.0.0.1:0", logLevel: "info", rate: 0,
		readyFile:       filepath.Join(dir, "ready"),
		shutdownTimeout: 5 * time.Second, maxConns: 16, writeTimeout: 5 * time.Second, idleTimeout: 5 * time.Second,
		broker: brokerFlags{on: true, socket: filepath.Join(dir, "b.sock"), socketMode: "0600", tenants: filepath.Join(dir, "tenants.yaml"), stopTimeout: 5 * time.Second},
	}
	return f, dir
}

// startBroker runs runBroker with f until a signal on sigs; exited closes
// when it returns, having failed the test if it returned an error. It
// returns the metrics address once serving, and the daemon's log.
func startBroker(t *testing.T, f serveFlags, sigs, hups chan os.Signal) (string, *serveLogBuffer, <-chan struct{}) {
	t.Helper()
	logs := new(serveLogBuffer)
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		if err := runBroker(context.Background(), f, logs, sigs, hups); err != nil {
			t.Error(err)
		}
	}()
	return serveReadyAddr(t, f.readyFile, exited, logs), logs, exited
}

func brokerScrape(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get(addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// TestServeBroker runs `allocd serve --broker` on a simulated device: a
// client is granted memory within its quota, SIGHUP reloads the tenants
// file (a bad one is refused and counted), and SIGTERM stops granting
// and exits once the client has gone.
func TestServeBroker(t *testing.T) {
	f, _ := brokerTestFlags(t)
	if err := os.WriteFile(f.broker.tenants, []byte("tenants:\n  - name: a\n    quota: 4MiB\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sigs, hups := make(chan os.Signal, 2), make(chan os.Signal, 1)
	addr, logs, exited := startBroker(t, f, sigs, hups)
	fi, err := os.Stat(f.broker.socket)
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket: %v %v", fi, err)
	}
	c, err := broker.Dial(context.Background(), "unix://"+f.broker.socket, "a", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := c.Grant(0, 4<<20)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	if _, err := c.Grant(0, 2<<20); err == nil || !strings.Contains(err.Error(), "quota 4.00 MiB") {
		t.Fatalf("grant over the quota: %v", err)
	}
	m := brokerScrape(t, addr)
	for _, want := range []string{
		`allocd_broker_granted_bytes{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",tenant="a"} 4.194304e+06`,
		`allocd_broker_quota_bytes{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",tenant="a"} 4.194304e+06`,
		`allocd_broker_refusals_total{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",reason="quota",tenant="a"} 1`,
		`allocd_broker_clients{tenant="a"} 1`,
		`allocd_build_info`,
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}

	resp, err := http.Get(addr + "/debug/broker")
	if err != nil {
		t.Fatal(err)
	}
	var dbg struct {
		Stats struct {
			Tenants []struct {
				Tenant   string            `json:"tenant"`
				Granted  uint64            `json:"granted_bytes"`
				Refusals map[string]uint64 `json:"refusals"`
			} `json:"tenants"`
		} `json:"stats"`
		Holders []struct {
			Tenant    string            `json:"tenant"`
			Connected bool              `json:"connected"`
			Bytes     map[string]uint64 `json:"bytes_by_gpu"`
		} `json:"holders"`
	}
	err = json.NewDecoder(resp.Body).Decode(&dbg)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if len(dbg.Holders) != 1 || dbg.Holders[0].Tenant != "a" || !dbg.Holders[0].Connected || dbg.Holders[0].Bytes["0"] != 4<<20 {
		t.Errorf("/debug/broker holders: %+v", dbg.Holders)
	}
	if len(dbg.Stats.Tenants) != 1 || dbg.Stats.Tenants[0].Granted != 4<<20 || dbg.Stats.Tenants[0].Refusals["quota"] != 1 {
		t.Errorf("/debug/broker tenants: %+v", dbg.Stats.Tenants)
	}

	// A bad file is refused and the policy stays; a good one is taken.
	os.WriteFile(f.broker.tenants, []byte("tenants:\n  - name: a\n    qouta: 1GiB\n"), 0o600)
	hups <- syscall.SIGHUP
	serveWaitFor(t, 2*time.Second, "a failed reload", func() bool {
		return strings.Contains(brokerScrape(t, addr), `allocd_broker_config_reloads_total{result="failure"} 1`)
	})
	if !strings.Contains(brokerScrape(t, addr), "allocd_broker_config_last_reload_successful 0") {
		t.Error("a failed reload left last_reload_successful at 1")
	}
	os.WriteFile(f.broker.tenants, []byte("tenants:\n  - name: a\n    quota: 6MiB\n"), 0o600)
	hups <- syscall.SIGHUP
	serveWaitFor(t, 2*time.Second, "a reload", func() bool {
		return strings.Contains(brokerScrape(t, addr), `allocd_broker_config_reloads_total{result="success"} 1`)
	})
	ch2, err := c.Grant(0, 2<<20)
	if err != nil {
		t.Fatalf("grant under the reloaded quota: %v", err)
	}
	unix.Close(ch2.FD)

	// SIGTERM: /readyz turns 503, grants are refused, and the daemon
	// exits once the client is gone.
	sigs <- syscall.SIGTERM
	serveWaitFor(t, 2*time.Second, "stopping", func() bool {
		_, err := c.Grant(0, 2<<20)
		return err != nil && strings.Contains(err.Error(), "stopping")
	})
	select {
	case <-exited:
		t.Fatal("the broker exited with a client connected")
	case <-time.After(100 * time.Millisecond):
	}
	c.Close()
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		t.Fatal("the broker did not exit after its last client left")
	}
	if _, err := os.Stat(f.broker.socket); !os.IsNotExist(err) {
		t.Errorf("the socket is still there after exit: %v", err)
	}
	for _, msg := range []string{"allocd broker serving", "SIGHUP: tenants file not reloaded; the previous policy stays", "SIGHUP: tenants file reloaded", "allocd broker stopped"} {
		if serveFindLog(logs.String(), msg) == nil {
			t.Errorf("no log line %q", msg)
		}
	}
}

func TestServeBrokerFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		edit func(*serveFlags)
		want string
	}{
		{func(f *serveFlags) { f.broker.socket = "rel.sock" }, "absolute path"},
		{func(f *serveFlags) { f.broker.socketMode = "rw" }, "octal"},
		{func(f *serveFlags) { f.broker.socketMode = "01777" }, "octal"},
		{func(f *serveFlags) { f.broker.socketGroup = "no-such-group-allocd" }, "no such group"},
		{func(f *serveFlags) { f.replay = "x.pickle" }, "no --replay"},
		{func(f *serveFlags) { f.history = 10 }, "--history"},
		{func(f *serveFlags) { f.broker.stopTimeout = -time.Second }, "--broker-stop-timeout"},
		{func(f *serveFlags) { f.broker.cacheIdle = time.Millisecond }, "--broker-cache-idle"},
		{func(f *serveFlags) { f.broker.tenantsPoll = -time.Second }, "--broker-tenants-poll"},
	} {
		f, _ := brokerTestFlags(t)
		tc.edit(&f)
		if _, _, err := checkBrokerFlags(f); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", f.broker, err, tc.want)
		}
	}
	// A tenants file with an error stops the start.
	f, _ := brokerTestFlags(t)
	os.WriteFile(f.broker.tenants, []byte("tenants: []\n"), 0o600)
	err := runBroker(context.Background(), f, io.Discard, nil, nil)
	if err == nil || !strings.Contains(err.Error(), "no tenants") {
		t.Fatalf("bad tenants file: %v", err)
	}
}

// TestServeBrokerPollsTenants: a change of the tenants file's content
// is picked up without a signal, as a ConfigMap volume's is; a bad one is
// counted once and leaves the policy.
func TestServeBrokerPollsTenants(t *testing.T) {
	f, _ := brokerTestFlags(t)
	f.broker.tenantsPoll = 100 * time.Millisecond
	os.WriteFile(f.broker.tenants, []byte("tenants:\n  - name: a\n    quota: 2MiB\n"), 0o600)
	sigs := make(chan os.Signal, 2)
	addr, _, exited := startBroker(t, f, sigs, nil)
	// The file is replaced, as a ConfigMap volume's is: a poll that met
	// os.WriteFile's truncation would read an empty file and count a
	// failure of its own.
	replace := func(s string) {
		t.Helper()
		if err := server.WriteFileAtomic(f.broker.tenants, s); err != nil {
			t.Fatal(err)
		}
	}
	replace("tenants:\n  - name: a\n    quota: 4MiB\n")
	serveWaitFor(t, 3*time.Second, "the change picked up", func() bool {
		return strings.Contains(brokerScrape(t, addr), `quota_bytes{UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0",tenant="a"} 4.194304e+06`)
	})
	replace("tenants: [\n")
	serveWaitFor(t, 3*time.Second, "a failure counted", func() bool {
		return strings.Contains(brokerScrape(t, addr), `allocd_broker_config_reloads_total{result="failure"} 1`)
	})
	time.Sleep(300 * time.Millisecond)
	m := brokerScrape(t, addr)
	if !strings.Contains(m, `allocd_broker_config_reloads_total{result="failure"} 1`) || !strings.Contains(m, `tenant="a"} 4.194304e+06`) {
		t.Errorf("after polls of the same bad file: failures counted again or the policy lost:\n%s", m)
	}
	sigs <- syscall.SIGTERM
	<-exited
}

// TestServeBrokerTrimsCache: with --broker-cache-idle, chunks no client
// takes go back to the driver, and the counters say so.
func TestServeBrokerTrimsCache(t *testing.T) {
	f, _ := brokerTestFlags(t)
	f.broker.tenants = ""
	f.broker.cacheIdle = 100 * time.Millisecond
	sigs := make(chan os.Signal, 2)
	addr, logs, exited := startBroker(t, f, sigs, nil)
	c, err := broker.Dial(context.Background(), "unix://"+f.broker.socket, "a", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := c.Grant(0, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	if err := c.Return(ch.ID); err != nil {
		t.Fatal(err)
	}
	const uuid = `UUID="SIM-00000000-0000-0000-0000-000000000000",gpu="0"`
	serveWaitFor(t, 3*time.Second, "the idle chunk released", func() bool {
		m := brokerScrape(t, addr)
		return strings.Contains(m, `allocd_broker_chunks_released_total{`+uuid+`} 1`) && strings.Contains(m, `allocd_broker_cached_bytes{`+uuid+`} 0`)
	})
	if !strings.Contains(brokerScrape(t, addr), `allocd_broker_chunks_created_total{`+uuid+`} 1`) {
		t.Error("chunks_created_total is not 1")
	}
	c.Close()
	sigs <- syscall.SIGTERM
	<-exited
	if serveFindLog(logs.String(), "released chunks idle in the cache") == nil {
		t.Error("no log line for the trim")
	}
}
