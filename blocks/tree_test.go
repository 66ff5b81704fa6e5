package blocks

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// treeModel drives a FreeIndex and a sorted slice with the same
// operations and compares every answer, checking the tree's invariants
// after each change.
type treeModel struct {
	t     testing.TB
	idx   *FreeIndex
	seg   *Segment
	live  []*Block // indexed blocks, in (size, address) order
	spare []*Block
}

func newTreeModel(t testing.TB) *treeModel {
	return &treeModel{t: t, idx: NewStreamFreeIndex(3), seg: &Segment{Stream: 3}}
}

func lessBlock(a, b *Block) int {
	if a.Size != b.Size {
		return cmpU(a.Size, b.Size)
	}
	return cmpU(a.Ptr, b.Ptr)
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (m *treeModel) insert(size, ptr uint64) {
	b := &Block{Size: size, Ptr: ptr, Segment: m.seg}
	i, found := slices.BinarySearchFunc(m.live, b, lessBlock)
	if found {
		return
	}
	m.idx.Insert(b)
	m.live = slices.Insert(m.live, i, b)
	m.verify("insert")
}

func (m *treeModel) delete(k int) {
	if len(m.live) == 0 {
		return
	}
	k %= len(m.live)
	m.idx.Delete(m.live[k])
	m.live = slices.Delete(m.live, k, k+1)
	m.verify("delete")
}

func (m *treeModel) query(size uint64, k int) {
	i, _ := slices.BinarySearchFunc(m.live, &Block{Size: size}, lessBlock)
	var want *Block
	if i < len(m.live) {
		want = m.live[i]
	}
	if got := m.idx.LowerBound(3, size); got != want {
		m.t.Fatalf("LowerBound(%d) = %v, want %v", size, got, want)
	}
	if want != nil && k%3 == 0 {
		// A Malloc's pattern: delete the block the search found.
		m.idx.Delete(want)
		m.live = slices.Delete(m.live, i, i+1)
		m.verify("delete after a search")
		return
	}
	var skip *Block
	if len(m.live) > 0 {
		skip = m.live[k%len(m.live)]
	}
	want = nil
	for _, b := range m.live[i:] {
		if b != skip {
			want = b
			break
		}
	}
	if got := m.idx.LowerBoundExcept(3, size, skip); got != want {
		m.t.Fatalf("LowerBoundExcept(%d, %v) = %v, want %v", size, skip, got, want)
	}
	if skip != nil {
		j := k % len(m.live)
		want = nil
		if j+1 < len(m.live) {
			want = m.live[j+1]
		}
		if got := m.idx.After(skip); got != want {
			m.t.Fatalf("After(%v) = %v, want %v", skip, got, want)
		}
	}
	var below []*Block
	m.idx.DescendStream(3, size, func(b *Block) bool { below = append(below, b); return len(below) < 3 })
	for n, b := range below {
		if i-1-n < 0 || m.live[i-1-n] != b {
			m.t.Fatalf("DescendStream(%d) step %d = %v", size, n, b)
		}
	}
	if len(below) < 3 && len(below) != i {
		m.t.Fatalf("DescendStream(%d) gave %d blocks, %d lie below", size, len(below), i)
	}
}

func (m *treeModel) verify(op string) {
	if err := m.idx.check(); err != nil {
		m.t.Fatalf("after %s (%d blocks): %v", op, len(m.live), err)
	}
	if m.idx.Len() != len(m.live) {
		m.t.Fatalf("after %s: Len %d, model %d", op, m.idx.Len(), len(m.live))
	}
	var want *Block
	if n := len(m.live); n > 0 {
		want = m.live[n-1]
	}
	if got := m.idx.Largest(); got != want {
		m.t.Fatalf("after %s: Largest %v, want %v", op, got, want)
	}
}

func (m *treeModel) all() {
	i := 0
	m.idx.Ascend(func(b *Block) bool {
		if i >= len(m.live) || m.live[i] != b {
			m.t.Fatalf("Ascend step %d = %v", i, b)
		}
		i++
		return true
	})
	if i != len(m.live) {
		m.t.Fatalf("Ascend gave %d blocks of %d", i, len(m.live))
	}
}

// TestTreeModel grows the index to two levels of inner nodes in a bin, shrinks it to
// nothing and grows it again, with sizes drawn from few values (many equal
// sizes, ordered by address, in a few bins) and from many (over many bins), comparing every answer with a sorted
// slice and checking the tree after every change.
func TestTreeModel(t *testing.T) {
	n := 6000
	if testing.Short() {
		n = 2500
	}
	for _, sizes := range []uint64{2, 1 << 20} {
		t.Run(fmt.Sprint("sizes=", sizes), func(t *testing.T) {
			r := rand.New(rand.NewPCG(sizes, 7))
			m := newTreeModel(t)
			phase := func(steps int, growth float64) {
				for range steps {
					size := 512 * (1 + r.Uint64N(sizes))
					switch x := r.Float64(); {
					case x < growth:
						m.insert(size, 512*r.Uint64N(1<<30))
					case x < 0.9:
						m.delete(r.IntN(1 << 30))
					default:
						m.query(size, r.IntN(1<<30))
					}
				}
				m.all()
			}
			phase(n, 0.85)
			height, bins := 0, 0
			for i := range numBins {
				if bt := m.idx.bin(i); bt != nil && bt.len > 0 {
					height, bins = max(height, bt.height), bins+1
				}
			}
			// Few sizes fill few bins deep; many sizes spread over many bins.
			if sizes == 2 && height < 2 || sizes > 2 && bins < 100 {
				t.Fatalf("%d blocks fill %d bins, the tallest of height %d; the test wants inner levels and many bins", len(m.live), bins, height)
			}
			for len(m.live) > 0 {
				m.delete(r.IntN(1 << 30))
			}
			for i := range numBins {
				if bt := m.idx.bin(i); bt != nil && (bt.root != nil || bt.single != nil) {
					t.Fatal("an emptied index keeps nodes")
				}
			}
			if m.idx.Bytes() != 0 || m.idx.summary != 0 {
				t.Fatal("an emptied index keeps bytes or marked bins")
			}
			phase(n/2, 0.6)
		})
	}
}

// FuzzTree reads operations from the input (insert, delete, query) and
// runs them on the index and the model.
func FuzzTree(f *testing.F) {
	f.Add([]byte{0, 1, 2, 0, 3, 4, 1, 0, 2, 9})
	f.Add(make([]byte, 300))
	f.Fuzz(func(t *testing.T, ops []byte) {
		m := newTreeModel(t)
		for i := 0; i+1 < len(ops); i += 2 {
			size := 512 * uint64(1+ops[i+1]%16)
			switch ops[i] % 4 {
			case 0, 1:
				m.insert(size, 512*uint64(ops[i]/4)+512*256*uint64(i))
			case 2:
				m.delete(int(ops[i+1]))
			default:
				m.query(size, int(ops[i]))
			}
		}
		m.all()
	})
}

// BenchmarkFreeIndex times the index's share of a cached malloc and free
// in a real mix: a delete, an insert and a lower-bound search, on an
// index of n blocks. It allocates nothing.
func BenchmarkFreeIndex(b *testing.B) {
	for _, n := range []int{16, 128, 1024, 16384} {
		b.Run(fmt.Sprint("blocks=", n), func(b *testing.B) {
			seg := &Segment{Stream: 0}
			idx := NewStreamFreeIndex(0)
			r := rand.New(rand.NewPCG(1, 2))
			bs := make([]*Block, n)
			for i := range bs {
				bs[i] = &Block{Ptr: uint64(i+1) << 30, Size: 512 * (1 + r.Uint64N(4096)), Segment: seg}
				idx.Insert(bs[i])
			}
			for b.Loop() {
				x := bs[r.IntN(n)]
				idx.Delete(x)
				x.Size = 512 * (1 + r.Uint64N(4096))
				idx.Insert(x)
				_ = idx.LowerBound(0, 512*(1+r.Uint64N(4096)))
			}
		})
	}
}
