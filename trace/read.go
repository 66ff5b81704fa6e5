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
	"strings"

	"github.com/allocd/allocd/internal/pickle"
	"github.com/allocd/allocd/snapshot"
)

// Read decodes a memory snapshot from r: a PyTorch snapshot pickle
// (protocol 2 to 5) or a RAPIDS RMM logging_resource_adaptor CSV log, either
// of them plain or gzip-compressed. The format is detected from the content.
// A pickle is decoded as it streams in, reading r up to the pickle's STOP
// opcode and then to the end, which must follow at once (for gzip, the end
// of the gzip stream, whose checksums are verified); an RMM log is read to
// the end, line by line. A gzip stream may
// hold several members, read as one (as gzip -d does); anything after the
// last member is an error. Read holds the input to the limits of opt (see
// ReadOptions and MaxStack). Errors on bad input wrap ErrNotSnapshot,
// ErrTruncated, ErrUnsupportedOpcode, ErrMalformed, ErrUnknownAction or
// ErrTooLarge in a *DecodeError; errors of r itself are returned wrapped as
// they are.
func Read(r io.Reader, opt ReadOptions) (*snapshot.Snapshot, error) {
	lim := opt.limits()
	br := bufio.NewReaderSize(r, 16<<10)
	var src io.Reader = br
	gz := false
	if magic, _ := br.Peek(2); isGzip(magic) {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, gzipHeaderError(err)
		}
		zr.Multistream(false)
		src, gz = &gzipMembers{zr: zr, br: br}, true
	}
	in := &sizeLimit{r: src, n: lim.maxBytes, max: lim.maxBytes}
	s, err := decodeStream(in, opt, lim, gz)
	if err != nil {
		return nil, inputError(err)
	}
	if gz {
		// Read the rest of the gzip stream, so that its checksums are
		// verified and trailing garbage is found.
		if _, err := io.Copy(io.Discard, in); err != nil {
			return nil, inputError(err)
		}
	}
	return s, nil
}

// ReadFile decodes the snapshot in the named file, as Read does.
func ReadFile(path string, opt ReadOptions) (*snapshot.Snapshot, error) {
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

// gzipMembers reads the members of a gzip stream one after another, as gzip -d
// does. It looks at what follows each member itself, because the gzip
// package's own multistream reading reports a few bytes of trailing garbage
// (too short for a member header) as a truncated stream.
type gzipMembers struct {
	zr *gzip.Reader
	br *bufio.Reader
}

// errTrailingData is returned for bytes after the last member that do not
// start another member.
var errTrailingData = errors.New("trailing data after the gzip stream")

func (g *gzipMembers) Read(p []byte) (int, error) {
	for {
		n, err := g.zr.Read(p)
		if err != io.EOF {
			return n, err
		}
		// The member ended and its checksum matched.
		next, perr := g.br.Peek(2)
		switch {
		case len(next) == 0 && perr == io.EOF:
			return n, io.EOF
		case len(next) == 0:
			return n, perr
		case !isGzip(next):
			return n, errTrailingData
		}
		if err := g.zr.Reset(g.br); err != nil {
			return n, err
		}
		g.zr.Multistream(false)
		if n > 0 {
			return n, nil
		}
	}
}

// decodeStream detects the format of the decompressed input and decodes it;
// gz says the input was gzip-compressed.
func decodeStream(in io.Reader, opt ReadOptions, lim limits, gz bool) (*snapshot.Snapshot, error) {
	d := newDecoder(in, opt, lim)
	_ = d.fill(minWindow) // a short input is judged on what there is
	if d.end == 0 && d.rerr != nil {
		return nil, d.rerr
	}
	head := d.buf[:d.end]
	switch {
	case len(head) > 0 && head[0] == pickle.Proto:
		return d.snapshot()
	case isRMMLog(head):
		var rest io.Reader = in
		if d.eof {
			rest = eofReader{d.rerr}
		}
		return decodeRMM(io.MultiReader(bytes.NewReader(head), rest), lim)
	}
	if d.rerr != nil {
		return nil, d.rerr
	}
	if gz {
		// A broken gzip stream is reported as such, not as content.
		if _, err := io.Copy(io.Discard, in); err != nil {
			return nil, err
		}
		return nil, &DecodeError{Err: ErrNotSnapshot, Offset: 0,
			Msg: "the gzip stream holds neither a pickle of protocol 2 or later nor an RMM log"}
	}
	return nil, &DecodeError{Err: ErrNotSnapshot, Offset: 0,
		Msg: "neither a pickle of protocol 2 or later, nor gzip, nor an RMM log"}
}

// eofReader returns err, or io.EOF when err is nil.
type eofReader struct{ err error }

func (r eofReader) Read([]byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	return 0, io.EOF
}

// gzipHeaderError classifies an error of gzip.NewReader.
func gzipHeaderError(err error) error {
	if errors.Is(err, gzip.ErrHeader) {
		return &DecodeError{Err: ErrMalformed, Offset: 0, Msg: "gzip: invalid header"}
	}
	return inputError(err)
}

// inputError classifies errors of the gzip layer and of the size limit, and
// passes others through. A gzip header error past the first member's header
// is data after the end of a member that is not another member.
func inputError(err error) error {
	var ce flate.CorruptInputError
	var tl errTooLarge
	switch {
	case errors.As(err, &tl):
		return &DecodeError{Err: ErrTooLarge, Offset: tl.max, Msg: tl.Error()}
	case errors.Is(err, io.ErrUnexpectedEOF):
		return &DecodeError{Err: ErrTruncated, Offset: -1, Msg: "gzip stream ends early"}
	case errors.Is(err, gzip.ErrHeader), errors.Is(err, errTrailingData):
		return &DecodeError{Err: ErrMalformed, Offset: -1,
			Msg: "gzip: trailing data after the end of the compressed stream"}
	case errors.As(err, &ce), errors.Is(err, gzip.ErrChecksum):
		return &DecodeError{Err: ErrMalformed, Offset: -1,
			Msg: "gzip: " + strings.TrimPrefix(err.Error(), "gzip: ")}
	}
	var de *DecodeError
	if errors.As(err, &de) {
		return err
	}
	return fmt.Errorf("trace: reading: %w", err)
}

// snapshot runs the decoder and assembles the Snapshot.
func (d *decoder) snapshot() (*snapshot.Snapshot, error) {
	top, err := d.run()
	if err != nil {
		return nil, err
	}
	if err := d.atEnd(); err != nil {
		return nil, err
	}
	if top.kind != kCont || d.conts[top.n].sch != schTop {
		return nil, &DecodeError{Err: ErrNotSnapshot, Offset: -1,
			Msg: "the pickled value is " + d.describe(top) + ", not a snapshot dict"}
	}
	c := d.conts[top.n]
	if !c.hasSegs && !c.hasDevs {
		return nil, &DecodeError{Err: ErrNotSnapshot, Offset: -1,
			Msg: "the pickled dict has neither device_traces nor segments"}
	}
	return &snapshot.Snapshot{Segments: c.segs, DeviceTraces: c.devs, AllocatorSettings: c.settings}, nil
}

// atEnd checks, after the STOP opcode, that the (decompressed) input holds
// nothing more: a pickle followed by anything, a second pickle included,
// is malformed. An error of the reader found on the way is returned.
func (d *decoder) atEnd() error {
	if d.pos == d.end && !d.eof {
		_ = d.fill(1) // at the end of the input it reports truncation: not an error here
	}
	if d.pos < d.end {
		off := d.start + int64(d.pos)
		return &DecodeError{Err: ErrMalformed, Offset: off,
			Msg: fmt.Sprintf("data after the pickle's STOP opcode (at offset %d): trailing bytes start at offset %d", d.opOff, off)}
	}
	return d.rerr
}

// decodeBytes decodes an in-memory input (used by tests and benchmarks).
func decodeBytes(data []byte, opt ReadOptions) (*snapshot.Snapshot, error) {
	return Read(bytes.NewReader(data), opt)
}
