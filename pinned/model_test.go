package pinned

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"unsafe"

	"github.com/allocd/allocd/cudart"
	"github.com/allocd/allocd/simdev"
)

// The model test and the fuzz target drive an Allocator on a Sim with
// ManualEvents, where a copy to or from pinned memory moves its bytes only
// when the test completes its stream, and check after every step:
//
//   - Check() holds;
//   - no two live buffers overlap;
//   - a block freed after streams used it is handed out again only after
//     each of those streams has completed since the Free;
//   - every live buffer holds the bytes the model expects (a copy queued by
//     an earlier owner landing in a reused block would change them), and
//     device memory gets the bytes the buffer held when it was queued;
//   - requested_bytes is the sum of the live buffers' sizes;
//
// and at the end that Close returns every byte of host memory.

const modelStreams = 3

type modelBuf struct {
	buf     Buffer
	want    []byte
	d2h     int // stream+1 of a queued copy into the buffer, 0 when none
	d2hWant []byte
	streams map[int]bool // streams that used it since Alloc
	h2d     map[int]int  // stream → its epoch when a copy from the buffer was queued on it
}

// readers reports whether a copy from b is queued on a stream other than s
// that has not completed since: a copy into b on s could overtake it.
func (m *model) readers(b *modelBuf, s int) bool {
	for r, e := range b.h2d {
		if r != s && m.epoch[r] == e {
			return true
		}
	}
	return false
}

type freedUse struct {
	stream int
	epoch  int
}

type model struct {
	t      testing.TB
	dev    *simdev.Sim
	a      *Allocator
	s      [modelStreams]cudart.Stream
	slot   [modelStreams]cudart.Ptr // device memory each stream copies to and from
	slotW  [modelStreams][]byte     // slot contents once the stream's queued work has run
	epoch  [modelStreams]int        // completions of each stream
	live   []*modelBuf
	freed  map[uintptr][]freedUse // base address → streams that must complete before reuse
	serial byte
}

const slotSize = 1 << 16

func newModel(t testing.TB, divisions int) *model {
	dev := newSim(t, true)
	m := &model{t: t, dev: dev, a: newAlloc(t, dev, Config{RoundupDivisions: divisions, Flags: DefaultFlags}), freed: map[uintptr][]freedUse{}}
	for i := range m.s {
		var err error
		if m.s[i], err = dev.StreamCreate(); err != nil {
			t.Fatal(err)
		}
		if m.slot[i], err = dev.Malloc(slotSize); err != nil {
			t.Fatal(err)
		}
		m.slotW[i] = make([]byte, slotSize)
	}
	return m
}

func base(b Buffer) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b.Bytes()))) }

func (m *model) fatalf(format string, args ...any) {
	m.t.Helper()
	m.t.Fatalf(format, args...)
}

func (m *model) verify(b *modelBuf, when string) {
	m.t.Helper()
	if b.d2h == 0 && !bytes.Equal(b.buf.Bytes(), b.want) {
		m.fatalf("%s: a live buffer of %d bytes does not hold its bytes", when, b.buf.Len())
	}
}

func (m *model) alloc(n int) {
	buf, err := m.a.Alloc(n)
	if err != nil {
		m.fatalf("Alloc(%d): %v", n, err)
	}
	p := base(buf)
	for _, u := range m.freed[p] {
		if m.epoch[u.stream] == u.epoch {
			m.fatalf("Alloc(%d) handed out a block freed while stream %d had not completed", n, u.stream)
		}
	}
	delete(m.freed, p)
	for _, o := range m.live {
		q := base(o.buf)
		if p < q+uintptr(o.buf.Len()) && q < p+uintptr(n) {
			m.fatalf("Alloc(%d) overlaps a live buffer", n)
		}
	}
	m.serial++
	for i := range buf.Bytes() {
		buf.Bytes()[i] = m.serial + byte(i*31)
	}
	m.live = append(m.live, &modelBuf{buf: buf, want: bytes.Clone(buf.Bytes()), streams: map[int]bool{}, h2d: map[int]int{}})
}

func (m *model) free(i int) {
	b := m.live[i]
	m.verify(b, "Free")
	p := base(b.buf)
	if err := m.a.Free(b.buf); err != nil {
		m.fatalf("Free: %v", err)
	}
	for s := range b.streams {
		m.freed[p] = append(m.freed[p], freedUse{stream: s, epoch: m.epoch[s]})
	}
	m.live = append(m.live[:i], m.live[i+1:]...)
}

func (m *model) complete(s int) {
	m.dev.CompleteStream(m.s[s])
	m.epoch[s]++
	got := make([]byte, slotSize)
	if err := m.dev.MemcpyDtoH(got, m.slot[s]); err != nil {
		m.fatalf("reading slot %d: %v", s, err)
	}
	if !bytes.Equal(got, m.slotW[s]) {
		m.fatalf("stream %d completed; its device slot does not hold what the copies queued on it put there", s)
	}
	for _, b := range m.live {
		if b.d2h == s+1 {
			b.d2h, b.want = 0, b.d2hWant
		}
		m.verify(b, "stream completion")
	}
}

// step runs one operation read from ops and returns the rest.
func (m *model) step(ops []byte) []byte {
	op, ops := ops[0], ops[1:]
	arg := func() int {
		if len(ops) < 2 {
			return 0
		}
		v := int(ops[0])<<8 | int(ops[1])
		ops = ops[2:]
		return v
	}
	pick := func() *modelBuf {
		if len(m.live) == 0 {
			return nil
		}
		return m.live[arg()%len(m.live)]
	}
	switch op % 8 {
	case 0, 1:
		v := arg()
		n := 1 + v%4096
		if v%5 == 0 {
			n = 1 + v*3%slotSize
		}
		if len(m.live) < 64 {
			m.alloc(n)
		}
	case 2:
		if len(m.live) > 0 {
			m.free(arg() % len(m.live))
		}
	case 3:
		if b := pick(); b != nil {
			s := arg() % modelStreams
			if err := m.a.RecordStream(b.buf, m.s[s]); err != nil {
				m.fatalf("RecordStream: %v", err)
			}
			b.streams[s] = true
		}
	case 4: // H2D from a buffer whose bytes are known
		if b := pick(); b != nil && b.d2h == 0 {
			s := arg() % modelStreams
			m.verify(b, "CopyToDevice")
			if err := m.a.CopyToDevice(m.slot[s], b.buf, m.s[s]); err != nil {
				m.fatalf("CopyToDevice: %v", err)
			}
			copy(m.slotW[s], b.want)
			b.streams[s] = true
			b.h2d[s] = m.epoch[s]
		}
	case 5: // D2H into a buffer with no copy queued into it or, on other streams, from it
		if b := pick(); b != nil && b.d2h == 0 {
			s := arg() % modelStreams
			if m.readers(b, s) {
				break
			}
			if err := m.a.CopyFromDevice(b.buf, m.slot[s], m.s[s]); err != nil {
				m.fatalf("CopyFromDevice: %v", err)
			}
			b.d2h, b.d2hWant = s+1, bytes.Clone(m.slotW[s][:b.buf.Len()])
			b.streams[s] = true
		}
	case 6:
		m.complete(arg() % modelStreams)
	case 7:
		if arg()%4 == 0 {
			before := m.a.Stats().NumHostFree
			if err := m.a.EmptyCache(); err != nil {
				m.fatalf("EmptyCache: %v", err)
			}
			if m.a.Stats().NumHostFree != before {
				// cudaFreeHost synchronises the device: every stream completed.
				for s := range modelStreams {
					m.complete(s)
				}
			}
		} else {
			m.complete(0)
			m.complete(1)
			m.complete(2)
		}
	}
	if err := m.a.Check(); err != nil {
		m.fatalf("Check after op %d: %v", op%8, err)
	}
	var req int64
	for _, b := range m.live {
		req += int64(b.buf.Len())
	}
	if got := m.a.Stats().RequestedBytes.Current; got != req {
		m.fatalf("requested_bytes.current = %d, live buffers hold %d", got, req)
	}
	return ops
}

func (m *model) run(ops []byte) {
	for len(ops) > 0 {
		ops = m.step(ops)
	}
	for s := range modelStreams {
		m.complete(s)
	}
	for len(m.live) > 0 {
		m.free(len(m.live) - 1)
	}
	if err := m.a.Close(); err != nil {
		m.fatalf("Close: %v", err)
	}
	if c := m.dev.HostCounters(); c.LiveHostAllocations != 0 || c.PendingCopies != 0 {
		m.fatalf("after Close: %d host allocations live, %d copies pending", c.LiveHostAllocations, c.PendingCopies)
	}
}

func TestModelRandom(t *testing.T) {
	seeds, steps := 12, 2000
	if testing.Short() {
		seeds, steps = 4, 1000
	}
	for seed := range seeds {
		r := rand.New(rand.NewPCG(uint64(seed), 14))
		ops := make([]byte, steps*3)
		for i := range ops {
			ops[i] = byte(r.Uint32())
		}
		// Bias toward allocations early and completions throughout.
		newModel(t, []int{1, 1, 2, 4}[seed%4]).run(ops)
		if t.Failed() {
			t.Fatalf("seed %d", seed)
		}
	}
}

func FuzzAllocator(f *testing.F) {
	f.Add([]byte{0, 1, 0, 4, 0, 0, 2, 0, 0, 0, 0, 1, 6, 0, 0})
	f.Add([]byte{0, 9, 9, 0, 1, 1, 5, 0, 0, 0, 1, 2, 0, 0, 0, 2, 0, 7, 0, 0, 1, 4, 0, 7})
	f.Add([]byte{0, 255, 255, 3, 0, 0, 0, 1, 2, 0, 0, 7, 0, 0, 0, 5, 0, 6, 0, 1})
	f.Fuzz(func(t *testing.T, ops []byte) {
		if len(ops) > 4096 {
			ops = ops[:4096]
		}
		newModel(t, 1).run(ops)
	})
}
