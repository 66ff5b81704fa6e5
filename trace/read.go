package trace

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
)

// Read decodes a memory snapshot from r: a PyTorch snapshot pickle
// (protocol 2 to 5) or a RAPIDS RMM logging_resource_adaptor CSV log, either
// of them plain or gzip-compressed. The format is detected from the content.
// A pickle is decoded as it streams in, reading r up to the pickle's STOP
// opcode (and, for gzip, to the end of the gzip member, whose checksum is
// verified); an RMM log is read to the end. Errors on bad input wrap
// ErrNotSnapshot, ErrTruncated, ErrUnsupportedOpcode, ErrMalformed or
// ErrUnknownAction in a *DecodeError; errors of r itself are returned
// wrapped as they are.
func Read(r io.Reader, opt ReadOptions) (*Snapshot, error) {
	br := bufio.NewReaderSize(r, 16<<10)
	var src io.Reader = br
	var zr *gzip.Reader
	if magic, _ := br.Peek(2); isGzip(magic) {
		var err error
		if zr, err = gzip.NewReader(br); err != nil {
			return nil, inputError(err)
		}
		zr.Multistream(false)
		src = zr
	}
	s, err := decodeStream(src, opt)
	if err != nil {
		return nil, inputError(err)
	}
	if zr != nil {
		// Read the gzip trailer so that its checksum is verified.
		if _, err := io.Copy(io.Discard, zr); err != nil {
			return nil, inputError(err)
		}
	}
	return s, nil
}

// ReadFile decodes the snapshot in the named file, as Read does.
func ReadFile(path string, opt ReadOptions) (*Snapshot, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	defer f.Close()
	s, err := Read(f, opt)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

func isGzip(b []byte) bool { return len(b) >= 2 && b[0] == 0x1f && b[1] == 0x8b }

// decodeStream detects the format of the decompressed input and decodes it.
func decodeStream(in io.Reader, opt ReadOptions) (*Snapshot, error) {
	d := newDecoder(in, opt)
	_ = d.fill(minWindow) // a short input is judged on what there is
	if d.end == 0 && d.rerr != nil {
		return nil, d.rerr
	}
	head := d.buf[:d.end]
	switch {
	case len(head) > 0 && head[0] == opProto:
		return d.snapshot()
	case isRMMLog(head):
		rest, err := io.ReadAll(in)
		if err != nil {
			return nil, err
		}
		return decodeRMM(append(head, rest...))
	}
	if d.rerr != nil {
		return nil, d.rerr
	}
	return nil, &DecodeError{Err: ErrNotSnapshot, Offset: 0,
		Msg: "neither a pickle of protocol 2 or later, nor gzip, nor an RMM log"}
}

// inputError classifies errors of the gzip layer and passes others through.
func inputError(err error) error {
	var ce flate.CorruptInputError
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &DecodeError{Err: ErrTruncated, Offset: -1, Msg: "gzip stream ends early"}
	case errors.As(err, &ce),
		errors.Is(err, gzip.ErrHeader), errors.Is(err, gzip.ErrChecksum):
		return &DecodeError{Err: ErrMalformed, Offset: -1, Msg: "gzip: " + err.Error()}
	}
	var de *DecodeError
	if errors.As(err, &de) {
		return err
	}
	return fmt.Errorf("trace: reading: %w", err)
}

// snapshot runs the decoder and assembles the Snapshot.
func (d *decoder) snapshot() (*Snapshot, error) {
	top, err := d.run()
	if err != nil {
		return nil, err
	}
	if top.kind != kCont || d.conts[top.n].sch != schTop {
		return nil, &DecodeError{Err: ErrNotSnapshot, Offset: -1,
			Msg: "the pickled value is " + d.describe(top) + ", not a snapshot dict"}
	}
	c := &d.conts[top.n]
	if !c.hasSegs && !c.hasDevs {
		return nil, &DecodeError{Err: ErrNotSnapshot, Offset: -1,
			Msg: "the pickled dict has neither device_traces nor segments"}
	}
	return &Snapshot{Segments: c.segs, DeviceTraces: c.devs, AllocatorSettings: c.settings}, nil
}

// decodeBytes decodes an in-memory input (used by tests and benchmarks).
func decodeBytes(data []byte, opt ReadOptions) (*Snapshot, error) {
	return Read(bytes.NewReader(data), opt)
}
