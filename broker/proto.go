package broker

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// The wire protocol. Every message is one frame:
//
//	length  uint32, little endian: the bytes that follow (kind + body)
//	kind    uint8
//	body    the kind's fields, fixed-width integers little endian,
//	        strings as a uint16 length and that many bytes
//
// A frame is at most MaxFrame bytes after its length, and every string
// has its own smaller limit, so a reader never allocates more than
// MaxFrame for a message whatever the peer sends. The client speaks
// first (Hello, carrying ProtocolVersion); the broker answers Welcome or
// Fault. After that the client sends one request at a time and reads its
// answer: Grant → Granted or Refused, Return → Returned or Refused,
// Usage → UsageReport. A Granted frame carries the chunk's file
// descriptor as SCM_RIGHTS ancillary data on its first byte. The broker
// sends nothing unasked but a Fault, just before it closes a connection.

// ProtocolVersion is the version this package speaks. A broker refuses
// a Hello of another version with a Fault naming both.
const ProtocolVersion = 1

// Bounds of the protocol.
const (
	// MaxFrame is the largest frame after its length field.
	MaxFrame = 4096
	// MaxTenantName is the longest tenant name.
	MaxTenantName = 64
	// MaxText is the longest message text (Refused, Fault).
	MaxText = 1024
	// MaxDevices is the most devices a Welcome lists.
	MaxDevices = 64
	// maxUUID is the longest device UUID.
	maxUUID = 96
)

// Kind is a message's type.
type Kind uint8

// The message kinds.
const (
	KindHello Kind = iota + 1
	KindWelcome
	KindGrant
	KindGranted
	KindRefused
	KindReturn
	KindReturned
	KindUsage
	KindUsageReport
	KindFault
)

var kindNames = [...]string{"", "hello", "welcome", "grant", "granted", "refused", "return", "returned", "usage", "usage report", "fault"}

func (k Kind) String() string {
	if int(k) < len(kindNames) && k != 0 {
		return kindNames[k]
	}
	return fmt.Sprintf("kind %d", uint8(k))
}

// Reason says why the broker refused a request.
type Reason uint8

// The reasons for a refusal.
const (
	// ReasonQuota: the grant would take the tenant over its quota.
	ReasonQuota Reason = iota + 1
	// ReasonOutOfMemory: the device has no memory left for the chunk,
	// after the broker released what it had cached.
	ReasonOutOfMemory
	// ReasonStopping: the broker is shutting down and grants nothing.
	ReasonStopping
	// ReasonInvalid: the request names no such device or chunk, or a
	// size that is not a positive multiple of the device's granularity.
	ReasonInvalid
)

var reasonNames = [...]string{"", "quota", "out_of_memory", "stopping", "invalid"}

// String is the reason as the metrics' reason label spells it.
func (r Reason) String() string {
	if int(r) < len(reasonNames) && r != 0 {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason_%d", uint8(r))
}

// MarshalText gives the reason's name, so that JSON (Stats'
// refusals) spells it as the metrics do.
func (r Reason) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// Message is any of the protocol's messages.
type Message interface{ Kind() Kind }

// Hello opens a connection: the client's protocol version, its process
// id (informational: the broker trusts SO_PEERCRED) and its tenant.
type Hello struct {
	Version uint16
	PID     uint32
	Tenant  string
}

// DeviceInfo describes one of the broker's devices in a Welcome.
type DeviceInfo struct {
	Index       uint32
	UUID        string
	Granularity uint64
	Total       uint64
}

// Welcome accepts a Hello: the connection's id and the broker's devices.
type Welcome struct {
	Version uint16
	Client  uint64
	Devices []DeviceInfo
}

// Grant asks for a chunk of Size bytes on the broker's device Device.
type Grant struct {
	Req    uint64
	Device uint32
	Size   uint64
}

// Granted answers a Grant: the chunk's id and size. Its descriptor
// travels beside the frame. Scrubbed says the broker zeroed the chunk
// because another tenant held it before.
type Granted struct {
	Req      uint64
	Chunk    uint64
	Size     uint64
	Scrubbed bool
}

// Refused answers a Grant or a Return the broker did not carry out. For
// a quota refusal Quota and Used are the tenant's figures on the device,
// Asked the size asked for.
type Refused struct {
	Req    uint64
	Reason Reason
	Quota  uint64
	Used   uint64
	Asked  uint64
	Text   string
}

// Return gives a chunk back. The client must have released its own
// handle and every mapping of it first.
type Return struct {
	Req   uint64
	Chunk uint64
}

// Returned answers a Return.
type Returned struct {
	Req   uint64
	Chunk uint64
}

// Usage asks for the tenant's figures on a device.
type Usage struct {
	Req    uint64
	Device uint32
}

// UsageReport answers a Usage. Limited is false when the tenant has no
// quota on the device; Quota is then 0.
type UsageReport struct {
	Req     uint64
	Granted uint64
	Quota   uint64
	Limited bool
}

// Fault is the broker's last message on a connection it closes.
type Fault struct{ Text string }

func (Hello) Kind() Kind       { return KindHello }
func (Welcome) Kind() Kind     { return KindWelcome }
func (Grant) Kind() Kind       { return KindGrant }
func (Granted) Kind() Kind     { return KindGranted }
func (Refused) Kind() Kind     { return KindRefused }
func (Return) Kind() Kind      { return KindReturn }
func (Returned) Kind() Kind    { return KindReturned }
func (Usage) Kind() Kind       { return KindUsage }
func (UsageReport) Kind() Kind { return KindUsageReport }
func (Fault) Kind() Kind       { return KindFault }

// ErrProtocol: a peer sent something the protocol does not allow. The
// message says what.
var ErrProtocol = errors.New("broker protocol error")

func protoErr(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrProtocol}, args...)...)
}

// encoder appends a frame's fields.
type encoder struct{ b []byte }

func (e *encoder) u8(v uint8)   { e.b = append(e.b, v) }
func (e *encoder) u16(v uint16) { e.b = binary.LittleEndian.AppendUint16(e.b, v) }
func (e *encoder) u32(v uint32) { e.b = binary.LittleEndian.AppendUint32(e.b, v) }
func (e *encoder) u64(v uint64) { e.b = binary.LittleEndian.AppendUint64(e.b, v) }
func (e *encoder) str(s string) { e.u16(uint16(len(s))); e.b = append(e.b, s...) }
func (e *encoder) bool(v bool) {
	if v {
		e.u8(1)
	} else {
		e.u8(0)
	}
}

// AppendFrame appends m's frame to b. It fails, appending nothing, when
// a string or list is over its bound.
func AppendFrame(b []byte, m Message) ([]byte, error) {
	if err := checkBounds(m); err != nil {
		return b, err
	}
	start := len(b)
	e := encoder{b: append(b, 0, 0, 0, 0)}
	e.u8(uint8(m.Kind()))
	switch m := m.(type) {
	case Hello:
		e.u16(m.Version)
		e.u32(m.PID)
		e.str(m.Tenant)
	case Welcome:
		e.u16(m.Version)
		e.u64(m.Client)
		e.u16(uint16(len(m.Devices)))
		for _, d := range m.Devices {
			e.u32(d.Index)
			e.str(d.UUID)
			e.u64(d.Granularity)
			e.u64(d.Total)
		}
	case Grant:
		e.u64(m.Req)
		e.u32(m.Device)
		e.u64(m.Size)
	case Granted:
		e.u64(m.Req)
		e.u64(m.Chunk)
		e.u64(m.Size)
		e.bool(m.Scrubbed)
	case Refused:
		e.u64(m.Req)
		e.u8(uint8(m.Reason))
		e.u64(m.Quota)
		e.u64(m.Used)
		e.u64(m.Asked)
		e.str(m.Text)
	case Return:
		e.u64(m.Req)
		e.u64(m.Chunk)
	case Returned:
		e.u64(m.Req)
		e.u64(m.Chunk)
	case Usage:
		e.u64(m.Req)
		e.u32(m.Device)
	case UsageReport:
		e.u64(m.Req)
		e.u64(m.Granted)
		e.u64(m.Quota)
		e.bool(m.Limited)
	case Fault:
		e.str(m.Text)
	default:
		return b, fmt.Errorf("broker: cannot encode %T", m)
	}
	n := len(e.b) - start - 4
	if n > MaxFrame {
		return b, protoErr("%v frame of %d bytes is over the %d-byte limit", m.Kind(), n, MaxFrame)
	}
	binary.LittleEndian.PutUint32(e.b[start:], uint32(n))
	return e.b, nil
}

func checkBounds(m Message) error {
	switch m := m.(type) {
	case Hello:
		return checkTenantName(m.Tenant)
	case Welcome:
		if len(m.Devices) > MaxDevices {
			return protoErr("welcome lists %d devices, more than %d", len(m.Devices), MaxDevices)
		}
		for _, d := range m.Devices {
			if len(d.UUID) > maxUUID {
				return protoErr("device UUID of %d bytes, more than %d", len(d.UUID), maxUUID)
			}
		}
	case Refused:
		if len(m.Text) > MaxText {
			return protoErr("refusal text of %d bytes, more than %d", len(m.Text), MaxText)
		}
	case Fault:
		if len(m.Text) > MaxText {
			return protoErr("fault text of %d bytes, more than %d", len(m.Text), MaxText)
		}
	}
	return nil
}

// checkTenantName accepts 1 to MaxTenantName characters of
// [A-Za-z0-9_.-]: a name that is safe as a label value and in a log line.
func checkTenantName(s string) error {
	if len(s) == 0 || len(s) > MaxTenantName {
		return protoErr("tenant name %q: want 1 to %d characters", s, MaxTenantName)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-') {
			return protoErr("tenant name %q: character %q is not one of A-Z a-z 0-9 _ . -", s, c)
		}
	}
	return nil
}

// decoder reads a frame body's fields; the first short read sets err.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if len(d.b) < n {
		d.err = protoErr("frame ends %d bytes early", n-len(d.b))
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) u8() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *decoder) u16() uint16 {
	if v := d.take(2); v != nil {
		return binary.LittleEndian.Uint16(v)
	}
	return 0
}

func (d *decoder) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}

func (d *decoder) u64() uint64 {
	if v := d.take(8); v != nil {
		return binary.LittleEndian.Uint64(v)
	}
	return 0
}

func (d *decoder) str(limit int, what string) string {
	n := int(d.u16())
	if d.err == nil && n > limit {
		d.err = protoErr("%s of %d bytes, more than %d", what, n, limit)
	}
	return string(d.take(n))
}

func (d *decoder) bool() bool {
	switch v := d.u8(); v {
	case 0:
		return false
	case 1:
		return true
	default:
		if d.err == nil {
			d.err = protoErr("boolean field holds %d", v)
		}
		return false
	}
}

// DecodeMessage decodes one frame's body (kind and fields, without the
// length). Every field must be present, every bound kept and nothing
// left over; otherwise the error wraps ErrProtocol. It never panics and
// allocates no more than the body's size, whatever the input.
func DecodeMessage(body []byte) (Message, error) {
	if len(body) == 0 {
		return nil, protoErr("empty frame")
	}
	if len(body) > MaxFrame {
		return nil, protoErr("frame of %d bytes is over the %d-byte limit", len(body), MaxFrame)
	}
	d := decoder{b: body[1:]}
	var m Message
	switch k := Kind(body[0]); k {
	case KindHello:
		h := Hello{Version: d.u16(), PID: d.u32()}
		h.Tenant = d.str(MaxTenantName, "tenant name")
		if d.err == nil {
			d.err = checkTenantName(h.Tenant)
		}
		m = h
	case KindWelcome:
		w := Welcome{Version: d.u16(), Client: d.u64()}
		n := int(d.u16())
		if d.err == nil && n > MaxDevices {
			d.err = protoErr("welcome lists %d devices, more than %d", n, MaxDevices)
		}
		for i := 0; i < n && d.err == nil; i++ {
			di := DeviceInfo{Index: d.u32()}
			di.UUID = d.str(maxUUID, "device UUID")
			di.Granularity, di.Total = d.u64(), d.u64()
			w.Devices = append(w.Devices, di)
		}
		m = w
	case KindGrant:
		m = Grant{Req: d.u64(), Device: d.u32(), Size: d.u64()}
	case KindGranted:
		m = Granted{Req: d.u64(), Chunk: d.u64(), Size: d.u64(), Scrubbed: d.bool()}
	case KindRefused:
		r := Refused{Req: d.u64(), Reason: Reason(d.u8()), Quota: d.u64(), Used: d.u64(), Asked: d.u64()}
		r.Text = d.str(MaxText, "refusal text")
		if d.err == nil && (r.Reason == 0 || int(r.Reason) >= len(reasonNames)) {
			d.err = protoErr("unknown refusal reason %d", uint8(r.Reason))
		}
		m = r
	case KindReturn:
		m = Return{Req: d.u64(), Chunk: d.u64()}
	case KindReturned:
		m = Returned{Req: d.u64(), Chunk: d.u64()}
	case KindUsage:
		m = Usage{Req: d.u64(), Device: d.u32()}
	case KindUsageReport:
		m = UsageReport{Req: d.u64(), Granted: d.u64(), Quota: d.u64(), Limited: d.bool()}
	case KindFault:
		m = Fault{Text: d.str(MaxText, "fault text")}
	default:
		return nil, protoErr("unknown message kind %d", uint8(k))
	}
	if d.err != nil {
		return nil, fmt.Errorf("%v message: %w", Kind(body[0]), d.err)
	}
	if len(d.b) != 0 {
		return nil, protoErr("%v message has %d bytes left over", Kind(body[0]), len(d.b))
	}
	return m, nil
}

// readFrame reads one frame from r into buf (which must hold MaxFrame
// bytes) and returns its body. A length over MaxFrame or of zero is an
// error wrapping ErrProtocol; a frame cut short is io.ErrUnexpectedEOF.
func readFrame(r io.Reader, buf []byte) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	return readFrameRest(r, hdr, buf)
}

// readFrameRest is readFrame once the length hdr has been read.
func readFrameRest(r io.Reader, hdr [4]byte, buf []byte) ([]byte, error) {
	n := binary.LittleEndian.Uint32(hdr[:])
	if n == 0 || n > MaxFrame {
		return nil, protoErr("frame length %d: want 1 to %d", n, MaxFrame)
	}
	body := buf[:n]
	if _, err := io.ReadFull(r, body); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return body, nil
}
