package broker

import (
	"bytes"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"
)

func sampleMessages() []Message {
	return []Message{
		Hello{Version: ProtocolVersion, PID: 1234, Tenant: "training-1.a_b"},
		Welcome{Version: ProtocolVersion, Client: 7, Devices: []DeviceInfo{{Index: 0, UUID: "GPU-0000", Granularity: 2 << 20, Total: 141 << 30}, {Index: 1, UUID: "GPU-1111", Granularity: 2 << 20, Total: 80 << 30}}},
		Welcome{Version: ProtocolVersion, Client: 8},
		Grant{Req: 1, Device: 3, Size: 64 << 20},
		Granted{Req: 1, Chunk: 99, Size: 64 << 20, Scrubbed: true},
		Refused{Req: 2, Reason: ReasonQuota, Quota: 1 << 30, Used: 1 << 30, Asked: 2 << 20, Text: "over quota"},
		Return{Req: 3, Chunk: 99},
		Returned{Req: 3, Chunk: 99},
		Usage{Req: 4, Device: 1},
		UsageReport{Req: 4, Granted: 10, Quota: 20, Limited: true},
		Fault{Text: strings.Repeat("x", MaxText)},
	}
}

func TestFrameRoundTrip(t *testing.T) {
	for _, m := range sampleMessages() {
		f, err := AppendFrame(nil, m)
		if err != nil {
			t.Fatalf("%T: %v", m, err)
		}
		body, err := readFrame(bytes.NewReader(f), make([]byte, MaxFrame))
		if err != nil {
			t.Fatalf("%T: %v", m, err)
		}
		got, err := DecodeMessage(body)
		if err != nil {
			t.Fatalf("%T: %v", m, err)
		}
		if w, ok := m.(Welcome); ok && w.Devices == nil {
			m = Welcome{Version: w.Version, Client: w.Client}
		}
		if !reflect.DeepEqual(got, m) {
			t.Errorf("round trip of %#v gave %#v", m, got)
		}
	}
}

func TestEncodeRefusesOversize(t *testing.T) {
	for _, m := range []Message{
		Hello{Tenant: strings.Repeat("a", MaxTenantName+1)},
		Hello{Tenant: ""},
		Hello{Tenant: "has space"},
		Fault{Text: strings.Repeat("x", MaxText+1)},
		Refused{Reason: ReasonQuota, Text: strings.Repeat("x", MaxText+1)},
		Welcome{Devices: make([]DeviceInfo, MaxDevices+1)},
		Welcome{Devices: []DeviceInfo{{UUID: strings.Repeat("u", maxUUID+1)}}},
	} {
		if f, err := AppendFrame([]byte{1}, m); err == nil || !errors.Is(err, ErrProtocol) || len(f) != 1 {
			t.Errorf("AppendFrame(%T) = %d bytes, %v; want ErrProtocol and nothing appended", m, len(f), err)
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	grant, _ := AppendFrame(nil, Grant{Req: 1, Size: 2})
	granted, _ := AppendFrame(nil, Granted{Req: 1})
	refused, _ := AppendFrame(nil, Refused{Reason: ReasonQuota})
	hello, _ := AppendFrame(nil, Hello{Tenant: "a"})
	cases := []struct {
		name string
		body []byte
	}{
		{"empty", nil},
		{"unknown kind", []byte{0}},
		{"kind past the last", []byte{byte(KindFault) + 1}},
		{"short grant", grant[4 : len(grant)-1]},
		{"grant with a byte left over", append(append([]byte(nil), grant[4:]...), 0)},
		{"boolean of 2", append(append([]byte(nil), granted[4:len(granted)-1]...), 2)},
		{"unknown reason", func() []byte { b := append([]byte(nil), refused[4:]...); b[9] = 9; return b }()},
		{"zero reason", func() []byte { b := append([]byte(nil), refused[4:]...); b[9] = 0; return b }()},
		{"tenant with a slash", func() []byte { b := append([]byte(nil), hello[4:]...); b[len(b)-1] = '/'; return b }()},
		{"string longer than its limit", append([]byte{byte(KindFault)}, 0xff, 0xff)},
		{"string past the frame", append([]byte{byte(KindFault)}, 10, 0, 'a')},
		{"too many devices", append([]byte{byte(KindWelcome), 1, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 0xff, 0)},
		{"over MaxFrame", make([]byte, MaxFrame+1)},
	}
	for _, tc := range cases {
		if m, err := DecodeMessage(tc.body); err == nil || !errors.Is(err, ErrProtocol) {
			t.Errorf("%s: DecodeMessage = %#v, %v; want ErrProtocol", tc.name, m, err)
		}
	}
}

func TestReadFrameBounds(t *testing.T) {
	buf := make([]byte, MaxFrame)
	for _, tc := range []struct {
		name string
		in   []byte
		want error
	}{
		{"zero length", []byte{0, 0, 0, 0}, ErrProtocol},
		{"over MaxFrame", []byte{0x01, 0x10, 0, 0}, ErrProtocol},
		{"cut header", []byte{1, 0}, io.ErrUnexpectedEOF},
		{"cut body", []byte{5, 0, 0, 0, 1, 2}, io.ErrUnexpectedEOF},
		{"nothing", nil, io.EOF},
	} {
		if _, err := readFrame(bytes.NewReader(tc.in), buf); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
}

// FuzzDecodeMessage feeds the broker's decoder anything: it must never
// panic, and whatever it accepts must encode back to the same bytes.
func FuzzDecodeMessage(f *testing.F) {
	for _, m := range sampleMessages() {
		b, _ := AppendFrame(nil, m)
		f.Add(b[4:])
	}
	f.Add([]byte{})
	f.Add([]byte{byte(KindWelcome), 1, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1, 0})
	f.Fuzz(func(t *testing.T, body []byte) {
		m, err := DecodeMessage(body)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("error %v does not wrap ErrProtocol", err)
			}
			return
		}
		b, err := AppendFrame(nil, m)
		if err != nil {
			t.Fatalf("decoded %#v does not encode: %v", m, err)
		}
		if !bytes.Equal(b[4:], body) {
			t.Fatalf("%#v encodes to %x, decoded from %x", m, b[4:], body)
		}
	})
}
