package trace

import (
	"bytes"
	"compress/gzip"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/allocd/allocd/snapshot"
)

// rmmSample is a log as RMM's logging_resource_adaptor writes it.
const rmmSample = `Thread,Time,Action,Pointer,Size,Stream
2342727,15:47:02.841961,allocate,0x10012400000,1048576,0x0
2342727,15:47:02.841970,allocate,0x10012500000,256,0x7f8a38001020
2342727,15:47:02.841977,free,0x10012400000,1048576,0x0
2342728,15:47:02.842000,allocate failure,0x0,85899345920,0x0
`

func TestRMMLog(t *testing.T) {
	s := mustRead(t, []byte(rmmSample), ReadOptions{})
	t0 := int64(15*3600+47*60+2) * 1e6
	want := &snapshot.Snapshot{DeviceTraces: [][]snapshot.Entry{{
		{Action: snapshot.ActionAlloc, Addr: 0x10012400000, Size: 1048576, TimeUS: t0 + 841961},
		{Action: snapshot.ActionAlloc, Addr: 0x10012500000, Size: 256, Stream: 0x7f8a38001020, TimeUS: t0 + 841970},
		{Action: snapshot.ActionFreeRequested, Addr: 0x10012400000, Size: 1048576, TimeUS: t0 + 841977},
		{Action: snapshot.ActionFreeCompleted, Addr: 0x10012400000, Size: 1048576, TimeUS: t0 + 841977},
		{Action: snapshot.ActionOOM, Size: 85899345920, TimeUS: t0 + 842000},
	}}}
	if !reflect.DeepEqual(s, want) {
		t.Errorf("got  %+v\nwant %+v", s, want)
	}
	ops := BuildOps(s.DeviceTraces[0])
	if ops.NumIDs != 2 || len(ops.Ops) != 3 || ops.LiveAtEnd != 1 || ops.Ignored[snapshot.ActionOOM] != 1 {
		t.Errorf("ops = %+v", ops)
	}
}

func TestRMMVariants(t *testing.T) {
	cases := []struct {
		name string
		log  string
		want []snapshot.Entry
	}{
		{"crlf, bom, decimal stream, colon micros", "\ufeffThread,Time,Action,Pointer,Size,Stream\r\n1,00:00:01:000250,allocate,0x10,5,7\r\n\r\n",
			[]snapshot.Entry{{Action: snapshot.ActionAlloc, Addr: 0x10, Size: 5, Stream: 7, TimeUS: 1000250}}},
		{"midnight", "Thread,Time,Action,Pointer,Size,Stream\n1,23:59:59.999999,allocate,0x10,5,0x0\n1,00:00:00.000001,free,0x10,5,0x0\n",
			[]snapshot.Entry{{Action: snapshot.ActionAlloc, Addr: 0x10, Size: 5, TimeUS: 86399999999},
				{Action: snapshot.ActionFreeRequested, Addr: 0x10, Size: 5, TimeUS: 86400000001},
				{Action: snapshot.ActionFreeCompleted, Addr: 0x10, Size: 5, TimeUS: 86400000001}}},
		{"small step back is not midnight", "Thread,Time,Action,Pointer,Size,Stream\n1,10:00:00.5,allocate,0x10,5,0x0\n2,10:00:00.4,allocate,0x20,5,0x0\n",
			[]snapshot.Entry{{Action: snapshot.ActionAlloc, Addr: 0x10, Size: 5, TimeUS: 36000500000},
				{Action: snapshot.ActionAlloc, Addr: 0x20, Size: 5, TimeUS: 36000400000}}},
		{"epoch seconds, deallocate, columns reordered, no stream",
			"Action,Pointer,Size,Time,Thread\nallocate,0x10,5,1634567890.123456,1\ndeallocate,16,5,1634567890.2,1\n",
			[]snapshot.Entry{{Action: snapshot.ActionAlloc, Addr: 0x10, Size: 5, TimeUS: 1634567890123456},
				{Action: snapshot.ActionFreeRequested, Addr: 0x10, Size: 5, TimeUS: 1634567890200000},
				{Action: snapshot.ActionFreeCompleted, Addr: 0x10, Size: 5, TimeUS: 1634567890200000}}},
		{"header only", "Thread,Time,Action,Pointer,Size,Stream\n", []snapshot.Entry{}},
		{"known columns after eight unknown ones",
			"A,B,C,D,E,F,G,H,I,Action,Pointer,Size\n1,2,3,4,5,6,7,8,9,allocate,0x10,5\n",
			[]snapshot.Entry{{Action: snapshot.ActionAlloc, Addr: 0x10, Size: 5}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s := mustRead(t, []byte(c.log), ReadOptions{})
			if len(s.DeviceTraces) != 1 || !reflect.DeepEqual(s.DeviceTraces[0], c.want) {
				t.Errorf("got  %+v\nwant %+v", s.DeviceTraces, c.want)
			}
		})
	}
}

func TestRMMGzip(t *testing.T) {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write([]byte(rmmSample))
	zw.Close()
	a := mustRead(t, []byte(rmmSample), ReadOptions{})
	b := mustRead(t, buf.Bytes(), ReadOptions{})
	if !reflect.DeepEqual(a, b) {
		t.Error("gzip RMM log decodes differently")
	}
}

func TestRMMErrors(t *testing.T) {
	const h = "Thread,Time,Action,Pointer,Size,Stream\n"
	cases := []struct {
		name, log, msg string
		err            error
	}{
		{"unknown action", h + "1,00:00:00.1,reallocate,0x10,5,0x0\n", `line 2: action "reallocate"`, ErrUnknownAction},
		{"bad pointer", h + "1,00:00:00.1,allocate,0xZZ,5,0x0\n", "line 2: pointer", ErrMalformed},
		{"bad size", h + "1,00:00:00.1,allocate,0x10,-5,0x0\n1,00:00:00.1,allocate,0x10,5,0x0\n", "line 2: size", ErrMalformed},
		{"bad stream", h + "1,00:00:00.1,allocate,0x10,5,stream\n", "stream", ErrMalformed},
		{"bad time", h + "1,25:00:00.1,allocate,0x10,5,0x0\n", "time", ErrMalformed},
		{"bad fraction", h + "1,10:00:00.1x,allocate,0x10,5,0x0\n", "time", ErrMalformed},
		{"short line", h + "1,00:00:00.1,allocate\n", "line 2: 3 fields, want 6", ErrMalformed},
		{"third line", h + "1,00:00:00.1,allocate,0x10,5,0x0\n1,00:00:00.2,allocate,0x10\n", "line 3", ErrMalformed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := decodeBytes([]byte(c.log), ReadOptions{})
			if !errors.Is(err, c.err) || !strings.Contains(err.Error(), c.msg) {
				t.Errorf("err = %v, want %v containing %q", err, c.err, c.msg)
			}
		})
	}
	// Not RMM logs: another CSV, or a header missing a column.
	for _, log := range []string{"a,b,c\n1,2,3\n", "Thread,Time,Action,Size,Stream\n"} {
		if _, err := decodeBytes([]byte(log), ReadOptions{}); !errors.Is(err, ErrNotSnapshot) {
			t.Errorf("%q: err = %v, want ErrNotSnapshot", log, err)
		}
	}
}
