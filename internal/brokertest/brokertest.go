// Package brokertest serves a node broker for a test: on a Unix socket
// in a temporary directory short enough for a socket's path, stopped,
// checked (Broker.Check) and closed when the test ends. The allocator's,
// the broker's end-to-end and the GPU tests share it.
package brokertest

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/allocd/allocd/broker"
	"github.com/allocd/allocd/cudart"
)

// Server is a broker serving on Sock for one test.
type Server struct {
	B    *broker.Broker
	Sock string
}

// Addr is the broker's address as ALLOCD_BROKER gives it.
func (s *Server) Addr() string { return "unix://" + s.Sock }

// Serve starts a broker over devs with the tenants file tenants (empty:
// every tenant, without a quota). When the test ends it stops the broker
// (waiting up to a second for clients), fails the test if clients are
// still connected or Check finds anything, and closes it; the devices
// stay the caller's.
func Serve(tb testing.TB, devs []cudart.Device, tenants string) *Server {
	tb.Helper()
	dir, err := os.MkdirTemp("", "ab") // t.TempDir's paths can pass a socket's 108 bytes
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	cfg := broker.Config{Devices: devs}
	if tenants != "" {
		if cfg.Tenants, err = broker.ParseTenants([]byte(tenants)); err != nil {
			tb.Fatal(err)
		}
	}
	b, err := broker.New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	s := &Server{B: b, Sock: filepath.Join(dir, "b.sock")}
	l, err := broker.Listen(s.Sock, 0o600, -1)
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- b.Serve(l) }()
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		for _, h := range b.Stop(ctx) {
			if h.Connected {
				tb.Errorf("broker: client %d (tenant %s) still connected at the end", h.Client, h.Tenant)
			}
		}
		if err := <-done; err != nil {
			tb.Errorf("broker: Serve: %v", err)
		}
		if err := b.Check(); err != nil {
			tb.Errorf("broker: Check: %v", err)
		}
		if err := b.Close(); err != nil {
			tb.Errorf("broker: Close: %v", err)
		}
	})
	return s
}

// Dial connects to s as tenant, failing the test if it cannot; the
// connection closes when the test ends.
func (s *Server) Dial(tb testing.TB, tenant string) *broker.Client {
	tb.Helper()
	c, err := broker.Dial(context.Background(), s.Addr(), tenant, 30*time.Second)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	return c
}
