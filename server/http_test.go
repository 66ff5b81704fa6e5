package server_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/allocd/allocd/server"
)

// TestNewHTTPBadOptions: every negative bound is refused, naming it.
func TestNewHTTPBadOptions(t *testing.T) {
	for _, c := range []struct {
		name string
		o    server.HTTPOptions
	}{
		{"ReadHeaderTimeout", server.HTTPOptions{ReadHeaderTimeout: -1}},
		{"ReadTimeout", server.HTTPOptions{ReadTimeout: -time.Second}},
		{"WriteTimeout", server.HTTPOptions{WriteTimeout: -1}},
		{"IdleTimeout", server.HTTPOptions{IdleTimeout: -1}},
		{"MaxHeaderBytes", server.HTTPOptions{MaxHeaderBytes: -1}},
		{"MaxConns", server.HTTPOptions{MaxConns: -5}},
	} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		_, err = server.NewHTTP(ln, http.NotFoundHandler(), c.o)
		ln.Close()
		if !errors.Is(err, server.ErrHTTPOptions) || !strings.Contains(err.Error(), c.name) {
			t.Errorf("%s negative: err %v; want ErrHTTPOptions naming it", c.name, err)
		}
	}
}

// TestLimitListener: with 3 slots, 3 connections are accepted and the
// 4th waits until one closes; Close wakes a waiting Accept.
func TestLimitListener(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := server.LimitListener(inner, 3)
	accepted := make(chan net.Conn, 10)
	done := make(chan error, 1)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				done <- err
				return
			}
			accepted <- c
		}
	}()
	var clients []net.Conn
	for range 4 {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	var got []net.Conn
	for range 3 {
		select {
		case c := <-accepted:
			got = append(got, c)
		case <-time.After(5 * time.Second):
			t.Fatalf("accepted %d of the first 3 connections", len(got))
		}
	}
	select {
	case <-accepted:
		t.Fatal("a 4th connection was accepted while 3 were open")
	case <-time.After(100 * time.Millisecond):
	}
	got[0].Close()
	got[0].Close() // a second Close gives back nothing more
	select {
	case c := <-accepted:
		c.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the 4th connection was not accepted after one closed")
	}
	// Two slots are held; one is free: a 5th is accepted, a 6th waits,
	// and Close wakes that Accept.
	c5, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c5.Close()
	select {
	case c := <-accepted:
		defer c.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the 5th connection was not accepted with a slot free")
	}
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close: %v; want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not wake the waiting Accept")
	}
	for _, c := range got[1:] {
		c.Close()
	}
}

// TestLimitInFlight: with 2 slots and 2 requests inside, a third gets
// 503 with Retry-After at once; once they return it is served.
func TestLimitInFlight(t *testing.T) {
	release := make(chan struct{})
	var inside sync.WaitGroup
	inside.Add(2)
	h := server.LimitInFlight(2, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("block") == "1" {
			inside.Done()
			<-release
		}
		_, _ = io.WriteString(w, "done")
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			resp, err := http.Get(srv.URL + "/x?block=1")
			if err == nil {
				resp.Body.Close()
			}
		})
	}
	inside.Wait()
	resp, err := http.Get(srv.URL + "/x")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") != "1" || !strings.Contains(string(b), "2 requests in flight") {
		t.Errorf("third request: %s, Retry-After %q, %q; want 503, 1, naming the limit", resp.Status, resp.Header.Get("Retry-After"), b)
	}
	close(release)
	wg.Wait()
	resp, err = http.Get(srv.URL + "/x")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("after the others returned: %s", resp.Status)
	}
}

// TestLimitBody: a body within the limit passes whole; one over it before
// anything was sent is a 413; one over it part way aborts the connection
// (the client gets an error, not a short body that looks complete).
func TestLimitBody(t *testing.T) {
	write := func(chunks ...int) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Disposition", `attachment; filename="x"`)
			for _, n := range chunks {
				if _, err := w.Write([]byte(strings.Repeat("x", n))); err != nil {
					return
				}
				http.NewResponseController(w).Flush()
			}
		})
	}
	for _, c := range []struct {
		name    string
		chunks  []int
		status  int
		body    int
		wantErr bool
	}{
		{"within", []int{40, 60}, http.StatusOK, 100, false},
		{"first write over", []int{101}, http.StatusRequestEntityTooLarge, -1, false},
		{"over part way", []int{60, 60}, http.StatusOK, -1, true},
	} {
		srv := httptest.NewServer(server.LimitBody(100, write(c.chunks...)))
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		b, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		srv.Close()
		if resp.StatusCode != c.status || (rerr != nil) != c.wantErr || c.body >= 0 && len(b) != c.body {
			t.Errorf("%s: %s, %d bytes, read error %v; want %d, %d bytes, error %v", c.name, resp.Status, len(b), rerr, c.status, c.body, c.wantErr)
		}
		if c.status == http.StatusRequestEntityTooLarge && resp.Header.Get("Content-Disposition") != "" {
			t.Errorf("%s: a 413 carries Content-Disposition %q", c.name, resp.Header.Get("Content-Disposition"))
		}
	}
}

// TestHTTPServes: NewHTTP serves its handler on its listener, closes an
// idle keep-alive connection after IdleTimeout, and Shutdown stops it.
func TestHTTPServes(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s, err := server.NewHTTP(ln, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "hi") }),
		server.HTTPOptions{IdleTimeout: 200 * time.Millisecond, MaxConns: 2})
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve() }()
	c, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(c) // the response, then EOF when the idle timeout closes it
	if err != nil || !strings.HasSuffix(string(b), "hi") {
		t.Errorf("idle keep-alive connection: %q, %v; want the response and EOF", b, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		t.Errorf("Serve after Shutdown: %v", err)
	}
}
