package server

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// The HTTP server setup that `allocd serve` and liballocd's metrics
// server share: timeouts, a connection limit, and the handler wrappers
// that bound expensive pages (LimitInFlight) and response sizes
// (LimitBody). With them, a client that is slow, idle or never reads
// holds a connection, a goroutine and what its one request built for at
// most the timeouts, and never more connections than MaxConns in all.

// Defaults of HTTPOptions.
const (
	// DefaultReadHeaderTimeout is how long a connection may take to send a
	// request's headers.
	DefaultReadHeaderTimeout = 5 * time.Second
	// DefaultReadTimeout is how long reading a whole request may take.
	DefaultReadTimeout = 10 * time.Second
	// DefaultWriteTimeout is how long a response may take to write, from
	// the end of its request's headers: a client that reads slowly or not
	// at all is cut off then, and what its handler held is freed.
	DefaultWriteTimeout = time.Minute
	// DefaultIdleTimeout is how long a keep-alive connection may wait for
	// its next request.
	DefaultIdleTimeout = time.Minute
	// DefaultMaxHeaderBytes bounds a request's headers.
	DefaultMaxHeaderBytes = 64 << 10
	// DefaultMaxConns is how many connections are open at once; more wait
	// in the kernel's listen backlog, taking no file descriptor of the
	// process, until one closes.
	DefaultMaxConns = 64
	// DefaultMaxBodyBytes bounds the bytes of one expensive response (a
	// snapshot); see LimitBody.
	DefaultMaxBodyBytes = 1 << 30
)

// HTTPOptions bound an HTTP server. The zero value gives the defaults
// above; a negative value is an error.
type HTTPOptions struct {
	ReadHeaderTimeout time.Duration // 0: DefaultReadHeaderTimeout
	ReadTimeout       time.Duration // 0: DefaultReadTimeout
	WriteTimeout      time.Duration // 0: DefaultWriteTimeout
	IdleTimeout       time.Duration // 0: DefaultIdleTimeout
	MaxHeaderBytes    int           // 0: DefaultMaxHeaderBytes
	MaxConns          int           // 0: DefaultMaxConns
	// ErrorLog receives net/http's errors (a failed accept, a bad
	// request); nil is net/http's default, the standard logger.
	ErrorLog *log.Logger
}

// ErrHTTPOptions is wrapped by NewHTTP's errors about bad HTTPOptions.
var ErrHTTPOptions = errors.New("invalid HTTP options")

// withDefaults returns o with every zero field at its default, or an
// error naming a negative one.
func (o HTTPOptions) withDefaults() (HTTPOptions, error) {
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"ReadHeaderTimeout", &o.ReadHeaderTimeout, DefaultReadHeaderTimeout},
		{"ReadTimeout", &o.ReadTimeout, DefaultReadTimeout},
		{"WriteTimeout", &o.WriteTimeout, DefaultWriteTimeout},
		{"IdleTimeout", &o.IdleTimeout, DefaultIdleTimeout},
	} {
		if *d.v < 0 {
			return o, fmt.Errorf("server: %w: %s %v is negative", ErrHTTPOptions, d.name, *d.v)
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	for _, d := range []struct {
		name string
		v    *int
		def  int
	}{
		{"MaxHeaderBytes", &o.MaxHeaderBytes, DefaultMaxHeaderBytes},
		{"MaxConns", &o.MaxConns, DefaultMaxConns},
	} {
		if *d.v < 0 {
			return o, fmt.Errorf("server: %w: %s %d is negative", ErrHTTPOptions, d.name, *d.v)
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	return o, nil
}

// HTTP is an http.Server over a listener that holds at most MaxConns
// connections at once.
type HTTP struct {
	srv *http.Server
	ln  net.Listener
}

// NewHTTP returns a server of h on ln with o's bounds. It serves nothing
// until Serve.
func NewHTTP(ln net.Listener, h http.Handler, o HTTPOptions) (*HTTP, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: o.ReadHeaderTimeout,
		ReadTimeout:       o.ReadTimeout,
		WriteTimeout:      o.WriteTimeout,
		IdleTimeout:       o.IdleTimeout,
		MaxHeaderBytes:    o.MaxHeaderBytes,
		ErrorLog:          o.ErrorLog,
	}
	return &HTTP{srv: srv, ln: LimitListener(ln, o.MaxConns)}, nil
}

// Addr is the listener's address.
func (s *HTTP) Addr() net.Addr { return s.ln.Addr() }

// Serve serves until Shutdown or Close (then it returns
// http.ErrServerClosed) or the listener fails.
func (s *HTTP) Serve() error { return s.srv.Serve(s.ln) }

// Shutdown stops accepting and waits for in-flight requests until ctx
// ends (http.Server.Shutdown).
func (s *HTTP) Shutdown(ctx context.Context) error { return s.srv.Shutdown(ctx) }

// Close closes the listener and every connection at once.
func (s *HTTP) Close() error { return s.srv.Close() }

// LimitListener returns a listener that holds at most n connections of
// ln open at once: Accept waits, without accepting, while n are open, so
// that the rest wait in the kernel's listen backlog and take no file
// descriptor. Closing the returned listener wakes a waiting Accept.
func LimitListener(ln net.Listener, n int) net.Listener {
	return &limitListener{Listener: ln, slots: make(chan struct{}, n), done: make(chan struct{})}
}

type limitListener struct {
	net.Listener
	slots     chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

func (l *limitListener) Accept() (net.Conn, error) {
	select {
	case l.slots <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.slots
		return nil, err
	}
	return &limitConn{Conn: c, release: func() { <-l.slots }}, nil
}

func (l *limitListener) Close() error {
	err := l.Listener.Close()
	l.closeOnce.Do(func() { close(l.done) })
	return err
}

// limitConn gives its slot back on its first Close.
type limitConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}

// LimitInFlight returns a handler that serves at most n requests of h at
// once; one more gets 503 Service Unavailable with "Retry-After: 1" at
// once, instead of queueing. Wrap an expensive page in it (a snapshot),
// so that what its requests hold is bounded by n.
func LimitInFlight(n int, h http.Handler) http.Handler {
	slots := make(chan struct{}, n)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case slots <- struct{}{}:
			defer func() { <-slots }()
		default:
			w.Header().Set("Retry-After", "1")
			http.Error(w, fmt.Sprintf("%s: %d requests in flight already; retry later", r.URL.Path, n), http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// errBodyTooLarge is what a LimitBody response's Write returns past the
// limit.
var errBodyTooLarge = errors.New("server: response body over its byte limit")

// LimitBody returns a handler whose responses carry at most max bytes of
// body. A response that would pass it is refused with 413 when none of
// its body was written yet; otherwise its connection is aborted, so that
// the client sees an error rather than a cut document that looks whole.
// Writes past the limit return an error, which ends a streaming handler.
func LimitBody(max int64, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		lw := &limitBodyWriter{ResponseWriter: w, max: max}
		h.ServeHTTP(lw, r)
		if lw.over {
			if lw.sent > 0 || lw.wroteHeader {
				panic(http.ErrAbortHandler)
			}
			w.Header().Del("Content-Disposition")
			http.Error(w, "response larger than "+strconv.FormatInt(max, 10)+" bytes", http.StatusRequestEntityTooLarge)
		}
	})
}

type limitBodyWriter struct {
	http.ResponseWriter
	max         int64
	sent        int64
	over        bool
	wroteHeader bool
}

func (l *limitBodyWriter) WriteHeader(code int) {
	l.wroteHeader = true
	l.ResponseWriter.WriteHeader(code)
}

func (l *limitBodyWriter) Write(p []byte) (int, error) {
	if l.over || l.sent+int64(len(p)) > l.max {
		l.over = true
		return 0, errBodyTooLarge
	}
	n, err := l.ResponseWriter.Write(p)
	l.sent += int64(n)
	return n, err
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (l *limitBodyWriter) Unwrap() http.ResponseWriter { return l.ResponseWriter }
