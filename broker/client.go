package broker

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/allocd/allocd/cudart"
)

// ErrGone: the connection to the broker is closed or broken (the broker
// stopped or died, or cut this client off). Chunks already granted stay
// valid; no more can be had on this Client.
var ErrGone = errors.New("allocd broker connection lost")

// RefusedError is the broker's refusal of a grant or return. For the
// quota and out-of-memory reasons errors.Is(err, cudart.ErrOutOfMemory)
// holds, so an allocator's out-of-memory path handles it.
type RefusedError struct {
	Tenant string
	Device int
	Refused
}

// Error gives the broker's text, which names the tenant, the quota and
// the use where they apply.
func (e *RefusedError) Error() string {
	return fmt.Sprintf("allocd broker refused (%v): %s", e.Reason, e.Text)
}

// Is makes quota and out-of-memory refusals match cudart.ErrOutOfMemory.
func (e *RefusedError) Is(target error) bool {
	return target == cudart.ErrOutOfMemory && (e.Reason == ReasonQuota || e.Reason == ReasonOutOfMemory)
}

// Chunk is a granted chunk: its id, the broker's device index, its
// size, and a descriptor for its memory that the caller owns (Import it,
// then close it).
type Chunk struct {
	ID       uint64
	Device   int
	Size     uint64
	FD       int
	Scrubbed bool
}

// Client is one connection to a broker. Its methods are safe for
// concurrent use; requests go one at a time.
type Client struct {
	addr    string
	tenant  string
	timeout time.Duration

	mu      sync.Mutex
	conn    *net.UnixConn
	welcome Welcome
	req     uint64
	in      []byte
	rbuf    []byte
	oob     []byte
	fds     []int
	broken  error
}

// ParseAddress returns the socket path of a broker address:
// "unix:///run/allocd/allocd.sock" or a plain absolute path.
func ParseAddress(addr string) (string, error) {
	path, ok := strings.CutPrefix(addr, "unix://")
	if !ok && strings.Contains(addr, "://") {
		return "", fmt.Errorf("broker address %q: only unix:// addresses are supported", addr)
	}
	if !strings.HasPrefix(path, "/") {
		return "", fmt.Errorf("broker address %q: want unix:///absolute/path or an absolute path", addr)
	}
	return path, nil
}

// Dial connects to the broker at addr (ParseAddress) as tenant and
// exchanges Hello and Welcome. timeout bounds the connection and each
// later request (0 means 30 s).
func Dial(ctx context.Context, addr, tenant string, timeout time.Duration) (*Client, error) {
	path, err := ParseAddress(addr)
	if err != nil {
		return nil, err
	}
	if err := checkTenantName(tenant); err != nil {
		return nil, fmt.Errorf("broker: %w", err)
	}
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	d := net.Dialer{Timeout: timeout}
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("broker: connecting to %s: %w", addr, err)
	}
	c := &Client{addr: addr, tenant: tenant, timeout: timeout, conn: nc.(*net.UnixConn),
		rbuf: make([]byte, MaxFrame+4), oob: make([]byte, syscall.CmsgSpace(4*4))}
	m, err := c.roundTrip(Hello{Version: ProtocolVersion, PID: uint32(os.Getpid()), Tenant: tenant})
	if err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("broker: hello to %s as tenant %q: %w", addr, tenant, err)
	}
	w, ok := m.(Welcome)
	if !ok {
		_ = c.Close()
		return nil, fmt.Errorf("broker: hello to %s: %w", addr, protoErr("answer is %v, not welcome", m.Kind()))
	}
	c.welcome = w
	return c, nil
}

// Address is the broker's address as given to Dial.
func (c *Client) Address() string { return c.addr }

// Tenant is the tenant this client speaks for.
func (c *Client) Tenant() string { return c.tenant }

// ID is the broker's id for this connection.
func (c *Client) ID() uint64 { return c.welcome.Client }

// Devices lists the broker's devices.
func (c *Client) Devices() []DeviceInfo { return append([]DeviceInfo(nil), c.welcome.Devices...) }

// DeviceByUUID returns the broker's index of the device with uuid.
func (c *Client) DeviceByUUID(uuid string) (int, bool) {
	for _, d := range c.welcome.Devices {
		if d.UUID == uuid && uuid != "" {
			return int(d.Index), true
		}
	}
	return 0, false
}

// Grant asks for a chunk of size bytes on the broker's device dev. A
// refusal is a *RefusedError; a lost connection wraps ErrGone.
func (c *Client) Grant(dev int, size uint64) (Chunk, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.req++
	m, err := c.roundTripLocked(Grant{Req: c.req, Device: uint32(dev), Size: size})
	if err != nil {
		return Chunk{}, err
	}
	switch m := m.(type) {
	case Granted:
		if len(c.fds) == 0 {
			return Chunk{}, c.breakLocked(protoErr("granted chunk %d came without its descriptor", m.Chunk))
		}
		fd := c.fds[0]
		c.fds = c.fds[1:]
		if m.Req != c.req || m.Size != size {
			_ = unix.Close(fd)
			return Chunk{}, c.breakLocked(protoErr("grant answer for request %d of %d bytes, asked request %d of %d", m.Req, m.Size, c.req, size))
		}
		return Chunk{ID: m.Chunk, Device: dev, Size: m.Size, FD: fd, Scrubbed: m.Scrubbed}, nil
	case Refused:
		return Chunk{}, &RefusedError{Tenant: c.tenant, Device: dev, Refused: m}
	}
	return Chunk{}, c.breakLocked(protoErr("grant answered by %v", m.Kind()))
}

// Return gives chunk id back. The caller must have released its handle
// and every mapping of the chunk first.
func (c *Client) Return(id uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.req++
	m, err := c.roundTripLocked(Return{Req: c.req, Chunk: id})
	if err != nil {
		return err
	}
	switch m := m.(type) {
	case Returned:
		if m.Chunk != id {
			return c.breakLocked(protoErr("return of chunk %d answered for chunk %d", id, m.Chunk))
		}
		return nil
	case Refused:
		return &RefusedError{Tenant: c.tenant, Refused: m}
	}
	return c.breakLocked(protoErr("return answered by %v", m.Kind()))
}

// Usage returns the tenant's granted bytes and quota on device dev.
func (c *Client) Usage(dev int) (UsageReport, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.req++
	m, err := c.roundTripLocked(Usage{Req: c.req, Device: uint32(dev)})
	if err != nil {
		return UsageReport{}, err
	}
	switch m := m.(type) {
	case UsageReport:
		return m, nil
	case Refused:
		return UsageReport{}, &RefusedError{Tenant: c.tenant, Device: dev, Refused: m}
	}
	return UsageReport{}, c.breakLocked(protoErr("usage answered by %v", m.Kind()))
}

// Close closes the connection. Chunks it was granted stay valid where
// they are mapped; the broker takes them back once this process exits.
func (c *Client) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, fd := range c.fds {
		_ = unix.Close(fd)
	}
	c.fds = nil
	if c.broken != nil {
		// Already closed: by an earlier Close, or when the connection broke.
		return nil
	}
	c.broken = fmt.Errorf("%w: closed by this process", ErrGone)
	return c.conn.Close()
}

func (c *Client) roundTrip(m Message) (Message, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.roundTripLocked(m)
}

func (c *Client) breakLocked(err error) error {
	if c.broken == nil {
		c.broken = fmt.Errorf("%w: %w", ErrGone, err)
		_ = c.conn.Close()
	}
	return c.broken
}

func (c *Client) roundTripLocked(m Message) (Message, error) {
	if c.broken != nil {
		return nil, c.broken
	}
	f, err := AppendFrame(nil, m)
	if err != nil {
		return nil, err
	}
	_ = c.conn.SetDeadline(time.Now().Add(c.timeout))
	if _, err := c.conn.Write(f); err != nil {
		return nil, c.breakLocked(fmt.Errorf("sending %v to %s: %w", m.Kind(), c.addr, err))
	}
	reply, err := c.readLocked()
	if err != nil {
		return nil, c.breakLocked(fmt.Errorf("reading the answer to %v from %s: %w", m.Kind(), c.addr, err))
	}
	if f, ok := reply.(Fault); ok {
		return nil, c.breakLocked(fmt.Errorf("the broker closed the connection: %s", f.Text))
	}
	return reply, nil
}

// readLocked reads one message, keeping any descriptors that come with
// its bytes.
func (c *Client) readLocked() (Message, error) {
	for {
		if len(c.in) >= 4 {
			n := binary.LittleEndian.Uint32(c.in)
			if n == 0 || n > MaxFrame {
				return nil, protoErr("frame length %d: want 1 to %d", n, MaxFrame)
			}
			if len(c.in) >= 4+int(n) {
				m, err := DecodeMessage(c.in[4 : 4+n])
				c.in = c.in[:copy(c.in, c.in[4+n:])]
				return m, err
			}
		}
		nr, noob, flags, _, err := c.conn.ReadMsgUnix(c.rbuf, c.oob)
		if noob > 0 {
			if ferr := c.takeFDs(c.oob[:noob]); ferr != nil {
				return nil, ferr
			}
		}
		if flags&syscall.MSG_CTRUNC != 0 {
			return nil, protoErr("descriptors were cut off")
		}
		c.in = append(c.in, c.rbuf[:nr]...)
		if err != nil {
			return nil, err
		}
		if nr == 0 {
			return nil, fmt.Errorf("connection closed")
		}
	}
}

func (c *Client) takeFDs(oob []byte) error {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return protoErr("control message: %v", err)
	}
	for _, m := range msgs {
		fds, err := syscall.ParseUnixRights(&m)
		if err != nil {
			return protoErr("control message: %v", err)
		}
		c.fds = append(c.fds, fds...)
	}
	return nil
}
