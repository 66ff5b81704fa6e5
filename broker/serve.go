package broker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Listen makes the broker's socket at path: it removes a stale socket
// left by a broker that died (refusing to if one still answers there),
// listens, and sets the file's mode and, when gid is not negative, its
// group.
func Listen(path string, mode os.FileMode, gid int) (*net.UnixListener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("broker: %s exists and is not a socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			_ = c.Close()
			return nil, fmt.Errorf("broker: another broker is listening on %s", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("broker: removing the stale socket: %w", err)
		}
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("broker: %w", err)
	}
	l.SetUnlinkOnClose(true)
	if err := os.Chmod(path, mode); err != nil {
		_ = l.Close()
		return nil, fmt.Errorf("broker: socket mode: %w", err)
	}
	if gid >= 0 {
		if err := os.Chown(path, -1, gid); err != nil {
			_ = l.Close()
			return nil, fmt.Errorf("broker: socket group: %w", err)
		}
	}
	return l, nil
}

// Serve accepts clients on l until Stop or Close closes it, and serves
// each on its own goroutine. It returns nil once the broker is stopping
// (closing l itself if the broker stopped before it began).
func (b *Broker) Serve(l *net.UnixListener) error {
	b.mu.Lock()
	if b.stopping {
		b.mu.Unlock()
		return l.Close()
	}
	b.listeners = append(b.listeners, l)
	b.mu.Unlock()
	var backoff time.Duration
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			b.mu.Lock()
			stopping := b.stopping
			b.mu.Unlock()
			if stopping || errors.Is(err, net.ErrClosed) {
				return nil
			}
			// Out of descriptors and the like: wait, as net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			b.log.Warn("accepting a client", zap.Error(err), zap.Duration("retry_in", backoff))
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		b.conns.Add(1)
		go func() {
			defer b.conns.Done()
			b.serveConn(c)
		}()
	}
}

// Stop stops granting memory and closes the listeners, then waits until
// every client has disconnected or ctx is done. It returns the clients
// still connected then, with what they hold, for the caller to log.
func (b *Broker) Stop(ctx context.Context) []Holder {
	b.mu.Lock()
	b.stopping = true
	ls := b.listeners
	b.listeners = nil
	if b.liveClientsLocked() == 0 {
		b.closeStopped()
	}
	b.mu.Unlock()
	for _, l := range ls {
		_ = l.Close()
	}
	select {
	case <-b.stopped:
	case <-ctx.Done():
	}
	return b.Holders()
}

// Holder is a client and what it holds.
type Holder struct {
	Client    uint64 `json:"client"`
	Tenant    string `json:"tenant"`
	PID       int32  `json:"pid"`
	Connected bool   `json:"connected"`
	// Bytes holds the bytes held on each device index.
	Bytes map[int]uint64 `json:"bytes_by_gpu"`
}

// Holders lists the clients the broker knows, connected or waiting for
// their process to exit, with what each holds.
func (b *Broker) Holders() []Holder {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []Holder
	for _, c := range b.clients {
		h := Holder{Client: c.id, Tenant: c.tenant, PID: c.pid, Connected: !c.gone, Bytes: make(map[int]uint64)}
		for _, ch := range c.held {
			h.Bytes[ch.dev.index] += ch.size
		}
		out = append(out, h)
	}
	return out
}

func (b *Broker) protoError(reason string, c *net.UnixConn, err error) {
	b.mu.Lock()
	b.protoErrs[reason]++
	b.mu.Unlock()
	b.log.Warn("client cut off", zap.String("reason", reason), zap.Error(err))
	if errors.Is(err, ErrProtocol) {
		b.writeFault(c, err.Error())
	}
}

func (b *Broker) writeFault(c *net.UnixConn, text string) {
	f, err := AppendFrame(nil, Fault{Text: clip(text, MaxText)})
	if err == nil {
		_ = c.SetWriteDeadline(time.Now().Add(b.cfg.WriteTimeout))
		_, _ = c.Write(f)
	}
}

// serveConn serves one connection from Hello to its end.
func (b *Broker) serveConn(conn *net.UnixConn) {
	defer conn.Close()
	cred, err := peerCred(conn)
	if err != nil {
		b.log.Warn("reading a client's credentials", zap.Error(err))
		return
	}
	buf := make([]byte, MaxFrame)
	_ = conn.SetReadDeadline(time.Now().Add(b.cfg.HelloTimeout))
	body, err := readFrame(conn, buf)
	if err != nil {
		b.protoError(readReason(err), conn, fmt.Errorf("hello from pid %d: %w", cred.Pid, err))
		return
	}
	m, err := DecodeMessage(body)
	if err != nil {
		b.protoError("malformed", conn, err)
		return
	}
	hello, ok := m.(Hello)
	if !ok {
		b.protoError("malformed", conn, protoErr("first message is %v, not hello", m.Kind()))
		return
	}
	if hello.Version != ProtocolVersion {
		b.protoError("version", conn, protoErr("client speaks protocol version %d; this broker speaks %d", hello.Version, ProtocolVersion))
		return
	}
	c, welcome, text := b.admit(conn, hello, cred)
	if c == nil {
		b.log.Warn("client refused", zap.String("tenant", hello.Tenant), zap.Int32("pid", cred.Pid), zap.Uint32("uid", cred.Uid), zap.String("why", text))
		b.writeFault(conn, text)
		return
	}
	defer b.disconnect(c)
	if err := b.write(conn, welcome, -1); err != nil {
		return
	}
	b.log.Info("client connected", zap.Uint64("client", c.id), zap.String("tenant", c.tenant), zap.Int32("pid", c.pid), zap.Uint32("uid", c.uid))
	for {
		body, err := b.readRequest(conn, buf)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				b.protoError(readReason(err), conn, fmt.Errorf("client %d (pid %d): %w", c.id, c.pid, err))
			}
			return
		}
		m, err := DecodeMessage(body)
		if err != nil {
			b.protoError("malformed", conn, fmt.Errorf("client %d (pid %d): %w", c.id, c.pid, err))
			return
		}
		var reply Message
		fd := -1
		switch m := m.(type) {
		case Grant:
			ch, f, refused, scrubbed := b.grant(c, m)
			if ch == nil {
				reply = refused
			} else {
				reply, fd = Granted{Req: m.Req, Chunk: ch.id, Size: ch.size, Scrubbed: scrubbed}, f
			}
		case Return:
			reply = b.giveBack(c, m)
		case Usage:
			reply = b.usage(c, m)
		default:
			b.protoError("malformed", conn, protoErr("client %d sent %v, which only the broker sends", c.id, m.Kind()))
			return
		}
		if err := b.write(conn, reply, fd); err != nil {
			b.protoError("timeout", conn, fmt.Errorf("client %d (pid %d): writing a reply: %w", c.id, c.pid, err))
			return
		}
	}
}

func readReason(err error) string {
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return "truncated"
	}
	return "malformed"
}

// readRequest waits as long as need be for a frame's first byte, then
// gives the rest FrameTimeout.
func (b *Broker) readRequest(conn *net.UnixConn, buf []byte) ([]byte, error) {
	_ = conn.SetReadDeadline(time.Time{})
	var hdr [4]byte
	if _, err := io.ReadFull(conn, hdr[:1]); err != nil {
		return nil, err
	}
	_ = conn.SetReadDeadline(time.Now().Add(b.cfg.FrameTimeout))
	if _, err := io.ReadFull(conn, hdr[1:]); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return readFrameRest(conn, hdr, buf)
}

func (b *Broker) write(conn *net.UnixConn, m Message, fd int) error {
	f, err := AppendFrame(nil, m)
	if err != nil {
		return err
	}
	_ = conn.SetWriteDeadline(time.Now().Add(b.cfg.WriteTimeout))
	var oob []byte
	if fd >= 0 {
		oob = syscall.UnixRights(fd)
	}
	n, _, err := conn.WriteMsgUnix(f, oob, nil)
	if err == nil && n < len(f) {
		err = io.ErrShortWrite
	}
	return err
}

// admit registers a client after its Hello, or says why not.
func (b *Broker) admit(conn *net.UnixConn, h Hello, cred *unix.Ucred) (*client, Welcome, string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopping {
		return nil, Welcome{}, "the allocd broker is stopping"
	}
	if b.liveClientsLocked() >= b.cfg.MaxClients {
		return nil, Welcome{}, fmt.Sprintf("the allocd broker serves %d clients, its limit", b.cfg.MaxClients)
	}
	pol, ok := b.tenants.Lookup(h.Tenant)
	if !ok {
		return nil, Welcome{}, fmt.Sprintf("tenant %q is not in the broker's tenants file", h.Tenant)
	}
	if len(pol.UIDs) > 0 && !slices.Contains(pol.UIDs, cred.Uid) {
		return nil, Welcome{}, fmt.Sprintf("uid %d may not use tenant %q", cred.Uid, h.Tenant)
	}
	b.nextID++
	c := &client{id: b.nextID, tenant: h.Tenant, pid: cred.Pid, uid: cred.Uid, conn: conn, pidfd: -1, held: make(map[uint64]*chunk)}
	if fd, err := unix.PidfdOpen(int(cred.Pid), 0); err == nil {
		c.pidfd = fd
	} else {
		b.log.Warn("pidfd_open failed: the client's memory returns when its connection closes", zap.Int32("pid", cred.Pid), zap.Error(err))
	}
	b.clients[c.id] = c
	w := Welcome{Version: ProtocolVersion, Client: c.id}
	for _, d := range b.devs {
		w.Devices = append(w.Devices, DeviceInfo{Index: uint32(d.index), UUID: d.info.UUID, Granularity: d.gran, Total: d.total})
	}
	return c, w, ""
}

// disconnect ends c's connection. What it holds returns to the caches
// once its process has exited: a live process may still have the chunks
// mapped (a client cut off for a protocol error, or one that closed its
// socket without returning them), and another tenant must never be
// granted memory a live process can still write.
//
// A client reclaimed at once leaves the broker's list before a Stop
// waiting for the last client returns (reclaim releases Stop), so Stop's
// holders never include it; one whose process is awaited releases Stop
// here and is listed as a holder until its process exits.
func (b *Broker) disconnect(c *client) {
	b.mu.Lock()
	c.gone = true
	c.conn = nil
	// Nothing held, no way to watch the process, or the client is this
	// process (tests): its mappings are its own business.
	now := len(c.held) == 0 || c.pidfd < 0 || c.pid == int32(os.Getpid())
	if !now && b.stopping && b.liveClientsLocked() == 0 {
		b.closeStopped()
	}
	b.mu.Unlock()
	b.log.Info("client disconnected", zap.Uint64("client", c.id), zap.String("tenant", c.tenant), zap.Int32("pid", c.pid))
	if now {
		b.reclaimAndClose(c)
		return
	}
	b.conns.Add(1)
	go func() {
		defer b.conns.Done()
		b.awaitExit(c)
		b.reclaimAndClose(c)
	}()
}

func (b *Broker) reclaimAndClose(c *client) {
	b.reclaim(c)
	closePidfd(c)
}

func closePidfd(c *client) {
	if c.pidfd >= 0 {
		_ = unix.Close(c.pidfd)
		c.pidfd = -1
	}
}

// awaitExit waits until c's process has exited, or the broker closes.
func (b *Broker) awaitExit(c *client) {
	for {
		fds := []unix.PollFd{{Fd: int32(c.pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, 100)
		if n > 0 || (err != nil && !errors.Is(err, unix.EINTR)) {
			return
		}
		b.mu.Lock()
		closing := b.closing
		b.mu.Unlock()
		if closing {
			return
		}
	}
}

func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	err = raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	return cred, nil
}
