//go:build cgo

package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/server"
)

// The metrics server's bounds, tested in this process on the code the C
// library runs (startMetrics), with short timeouts so that each test takes
// a few seconds. Every server listens on loopback.

// testHTTP are the bounds the tests configure: timeouts of a fraction of a
// second, 32 connections.
var testHTTP = server.HTTPOptions{
	ReadHeaderTimeout: 300 * time.Millisecond,
	ReadTimeout:       500 * time.Millisecond,
	WriteTimeout:      500 * time.Millisecond,
	IdleTimeout:       300 * time.Millisecond,
	MaxConns:          32,
}

func testHTTPTimeouts() (idle, write time.Duration, conns int) {
	return testHTTP.IdleTimeout, testHTTP.WriteTimeout, testHTTP.MaxConns
}

// newTestLib returns a library on one simulated device of 1 GiB, without a
// metrics server, closed when the test ends.
func newTestLib(t testing.TB) *lib {
	t.Helper()
	l, err := newLib(settings{level: "error", device: "sim", simCapacity: "1GiB"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.devs.Close() })
	return l
}

// startTestMetrics starts l's metrics server on a free loopback port with
// the test bounds, stopped when the test ends, and returns its address.
func startTestMetrics(t testing.TB, l *lib) string {
	t.Helper()
	m, err := startMetrics(l, "127.0.0.1:0", testHTTP)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.srv.Close() })
	return m.addr
}

// dialGet connects to addr and sends a keep-alive GET of path. A
// receive buffer of rcvbuf bytes, when above 0, is set before the
// connection is made (set later, the window already offered would make
// the sender's data be dropped and retransmitted with backoff).
func dialGet(addr, path string, rcvbuf int) (net.Conn, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	if rcvbuf > 0 {
		d.Control = func(_, _ string, rc syscall.RawConn) error {
			var serr error
			err := rc.Control(func(fd uintptr) {
				serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf)
			})
			return errors.Join(err, serr)
		}
	}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: allocd\r\n\r\n", path); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// closedByServer reports whether the server closed c within wait: a read
// that ends in EOF or a reset, not in c's deadline. It reads and drops
// whatever is still to come.
func closedByServer(c net.Conn, wait time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(wait))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// TestMetricsIdleKeepAlive: 200 keep-alive clients that each get /healthz
// and then stay idle are all served (at most the connection limit at once)
// and all closed by the server after its idle timeout.
func TestMetricsIdleKeepAlive(t *testing.T) {
	addr := startTestMetrics(t, newTestLib(t))
	idle, _, _ := testHTTPTimeouts()
	const clients = 200
	var wg sync.WaitGroup
	var mu sync.Mutex
	var served, open int
	var errs []string
	for range clients {
		wg.Go(func() {
			c, err := dialGet(addr, "/healthz", 0)
			if err != nil {
				mu.Lock()
				errs = append(errs, err.Error())
				mu.Unlock()
				return
			}
			defer c.Close()
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			if err != nil || resp.StatusCode != http.StatusOK {
				mu.Lock()
				errs = append(errs, fmt.Sprintf("GET /healthz: %v", err))
				mu.Unlock()
				return
			}
			closed := closedByServer(c, idle+2*time.Second)
			mu.Lock()
			served++
			if !closed {
				open++
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Errorf("%d clients failed, first: %s", len(errs), errs[0])
	}
	t.Logf("%d of %d idle keep-alive clients served; %d still open %v after their response", served, clients, open, idle+2*time.Second)
	if served != clients || open != 0 {
		t.Errorf("served %d of %d, %d left open by the server; want all served and none open", served, clients, open)
	}
}

// heapInuse returns the bytes of in-use heap spans after a GC.
func heapInuse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// rssMiB returns the process's resident set (VmRSS) in MiB, or -1.
func rssMiB() int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kib int
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kib); err == nil {
				return kib >> 10
			}
		}
	}
	return -1
}

// TestMetricsSlowSnapshotClients: 12 clients ask for /debug/snapshot of a
// 200,000-entry history and never read. The heap must not hold a snapshot
// per client (at most a few build at once; the rest get 503), and each
// connection is closed by the server once its write timeout passes, after
// which the heap is back near where it started.
func TestMetricsSlowSnapshotClients(t *testing.T) {
	l := newTestLib(t)
	if err := l.setHistory(historyOptions{Enabled: true, MaxEntries: 200_000}); err != nil {
		t.Fatal(err)
	}
	a, err := l.devs.ForDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 100_000 {
		p, err := a.Malloc(uint64(512*(1+i%64)), cudart.Stream(0))
		if err != nil {
			t.Fatal(err)
		}
		if err := a.Free(p); err != nil {
			t.Fatal(err)
		}
	}
	addr := startTestMetrics(t, l)
	_, write, _ := testHTTPTimeouts()

	// One snapshot's cost: the heap while one is held.
	base := heapInuse()
	snap := l.devs.Snapshot()
	one := heapInuse() - base
	runtime.KeepAlive(snap)
	snap = nil
	base = heapInuse()
	rss0 := rssMiB()

	const clients = 12
	conns := make([]net.Conn, 0, clients)
	for range clients {
		c, err := dialGet(addr, "/debug/snapshot", 4096)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns = append(conns, c)
	}
	time.Sleep(write / 2)
	held := heapInuse() - min(base, heapInuse())
	t.Logf("one snapshot: %d MiB of heap; %d non-reading clients: heap %d MiB above the start, RSS %d MiB (%d at the start)",
		one>>20, clients, held>>20, rssMiB(), rss0)
	if held > 3*one {
		t.Errorf("%d non-reading clients hold %d MiB, more than 3 snapshots (%d MiB each)", clients, held>>20, one>>20)
	}
	var open int
	for _, c := range conns {
		if !closedByServer(c, write+2*time.Second) {
			open++
		}
	}
	// The handler unwinds after the client sees the close: allow it a
	// moment (longer under the race detector).
	var after uint64
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		after = heapInuse() - min(base, heapInuse())
		if after <= one/2 || time.Now().After(deadline) {
			break
		}
	}
	t.Logf("after the write timeout: %d of %d connections open, heap %d MiB above the start, RSS %d MiB", open, clients, after>>20, rssMiB())
	if open != 0 {
		t.Errorf("%d of %d non-reading clients still connected after the write timeout", open, clients)
	}
	if after > one/2 {
		t.Errorf("heap %d MiB above the start after the clients were cut off; one snapshot is %d MiB", after>>20, one>>20)
	}
}

// floodChildEnv makes the test binary run TestMetricsFloodChild as the
// server of TestMetricsConnFlood.
const floodChildEnv = "LIBALLOCD_TEST_FLOOD_CHILD"

// TestMetricsConnFlood: a process limited to 128 open files serves
// metrics; 300 connections that never send a request must not take its
// file descriptors: it holds at most the listener and MaxConns sockets,
// still opens 40 files while they are held, and once the flood is cut off
// by the header timeout it answers /healthz.
func TestMetricsConnFlood(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("RLIMIT_NOFILE and /dev/null: Linux")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestMetricsFloodChild$", "-test.v")
	cmd.Env = append(os.Environ(), floodChildEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(30*time.Second, func() { _ = cmd.Process.Kill() })
	defer timer.Stop()
	sc := bufio.NewScanner(stdout)
	var addr string
	var lines []string
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if a, ok := strings.CutPrefix(sc.Text(), "ADDR "); ok {
			addr = a
			break
		}
	}
	if addr == "" {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("the child printed no address:\n%s\n%s", strings.Join(lines, "\n"), stderr.String())
	}
	const flood = 300
	var conns []net.Conn
	for range flood {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatalf("connection %d: %v", len(conns), err)
		}
		defer c.Close()
		conns = append(conns, c)
	}
	time.Sleep(200 * time.Millisecond) // the server accepts what it will
	_, _ = io.WriteString(stdin, "open\n")
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if strings.HasPrefix(sc.Text(), "SOCKETS ") || strings.HasPrefix(sc.Text(), "OPEN ") && sc.Text() != "OPEN ok" {
			break
		}
	}
	// After the flood, the server answers again.
	c, err := dialGet(addr, "/healthz", 0)
	status := ""
	if err == nil {
		_ = c.SetReadDeadline(time.Now().Add(15 * time.Second))
		resp, rerr := http.ReadResponse(bufio.NewReader(c), nil)
		if rerr == nil {
			status = resp.Status
			resp.Body.Close()
		} else {
			err = rerr
		}
		c.Close()
	}
	_ = stdin.Close()
	_ = cmd.Wait()
	out := strings.Join(lines, "\n")
	t.Logf("child:\n%s", out)
	if !strings.Contains(out, "OPEN ok") {
		t.Errorf("with %d connections held, the serving process could not open files:\n%s\n%s", flood, out, stderr.String())
	}
	if err != nil || status != "200 OK" {
		t.Errorf("GET /healthz after the flood: %v %s", err, status)
	}
	var sockets int
	if _, err := fmt.Sscanf(lines[len(lines)-1], "SOCKETS %d", &sockets); err != nil || sockets < 1 || sockets > testHTTP.MaxConns+1 {
		t.Errorf("the serving process held %d sockets (%q) with %d connections made; want at most the listener and %d connections",
			sockets, lines[len(lines)-1], flood, testHTTP.MaxConns)
	}
}

// countSockets counts this process's open sockets (its listener and
// connections), from /proc/self/fd; -1 when it cannot be read.
func countSockets() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(target, "socket:") {
			n++
		}
	}
	return n
}

// TestMetricsFloodChild is TestMetricsConnFlood's server process: under
// RLIMIT_NOFILE 128 it serves metrics, prints ADDR, and on a line on stdin
// opens 40 files and prints OPEN ok and its count of sockets (SOCKETS n),
// or OPEN and the error.
func TestMetricsFloodChild(t *testing.T) {
	if os.Getenv(floodChildEnv) != "1" {
		t.Skip("run by TestMetricsConnFlood")
	}
	lim := syscall.Rlimit{Cur: 128, Max: 128}
	var cur syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &cur); err == nil && cur.Max < lim.Max {
		lim.Max = cur.Max
	}
	lim.Cur = lim.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	addr := startTestMetrics(t, newTestLib(t))
	fmt.Printf("ADDR %s\n", addr)
	sc := bufio.NewScanner(os.Stdin)
	if !sc.Scan() {
		return
	}
	var files []*os.File
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	for range 40 {
		f, err := os.Open(os.DevNull)
		if err != nil {
			fmt.Printf("OPEN %v (after %d files)\n", err, len(files))
			return
		}
		files = append(files, f)
	}
	fmt.Println("OPEN ok")
	fmt.Printf("SOCKETS %d\n", countSockets())
	sc.Scan() // until the parent is done
}
