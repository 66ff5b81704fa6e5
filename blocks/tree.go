package blocks

// The free index's ordered set: a B+tree specialised to entries ordered by
// (size, address).
//
// Every Malloc searches it and most Mallocs and Frees change it, so its
// cost is the cost of a real mix of operations. A generic B-tree calls a
// comparison function through a pointer at every step and loads a Block
// for each comparison; this one keeps each entry's size and address in
// its nodes and compares them inline, so a search reads a few contiguous
// cache lines and calls nothing.
//
// Leaves hold the entries in order and are linked both ways, so the
// successor of a search's position and a walk in either direction cost
// one step each. An inner node holds its children and, for each child but
// the first, a separator: every entry of child i is at least seps[i] and
// below seps[i+1]. A separator is the first entry of its child when the
// child is made and may fall below it later (the entry deleted); routing
// stays correct, since it only needs the bounds. A leaf left empty is
// taken out of the tree and an inner node left without children with it;
// nodes are not merged when they run low, so the tree never restructures
// on a delete except to drop a node. Dropped nodes go to the spares the
// tree shares with the other bins of its index (up to keepFree of each
// kind) for reuse: once the index has reached its largest size, Insert and
// Delete allocate nothing.

import (
	"fmt"
	"math/bits"
)

const (
	leafCap  = 32  // entries per leaf
	innerCap = 32  // children per inner node
	maxDepth = 16  // inner levels; 32^16 entries is beyond any index
	keepFree = 256 // dropped nodes of each kind kept for reuse
)

// entry is an indexed block with the two fields it is ordered by.
type entry struct {
	size, ptr uint64
	b         *Block
}

// before reports whether e orders before (size, ptr).
func (e *entry) before(size, ptr uint64) bool { return less128(e.size, e.ptr, size, ptr) == 1 }

// less128 is 1 when (ah, al) < (bh, bl) as 128-bit numbers, else 0,
// computed without a branch: searches meet keys in no predictable order,
// and a mispredicted branch at each step costs more than the comparison.
func less128(ah, al, bh, bl uint64) int {
	_, borrow := bits.Sub64(al, bl, 0)
	_, borrow = bits.Sub64(ah, bh, borrow)
	return int(borrow)
}

type leaf struct {
	n          int
	keys       [leafCap]entry
	prev, next *leaf
}

// search returns the position of the first entry at or after (size, ptr).
func (l *leaf) search(size, ptr uint64) int {
	n := l.n
	if n == 0 {
		return 0
	}
	base := 0
	for n > 1 {
		half := n >> 1
		e := &l.keys[base+half]
		base += half & -less128(e.size, e.ptr, size, ptr) // a mask: no multiply in the chain
		n -= half
	}
	e := &l.keys[base]
	return base + less128(e.size, e.ptr, size, ptr)
}

type sep struct{ size, ptr uint64 }

// inner is an inner node: at height 1 its children are leaves, above that
// inner nodes.
type inner struct {
	n      int
	seps   [innerCap]sep // seps[0] is unused
	leaves [innerCap]*leaf
	inners [innerCap]*inner
}

// route returns the child whose range holds (size, ptr): the last i whose
// separator is at or below it, 0 when none is (x.n is at least 1).
func (x *inner) route(size, ptr uint64) int {
	// The number of separators seps[1:n] at or below (size, ptr), which
	// are a prefix of them.
	n := x.n - 1
	if n == 0 {
		return 0
	}
	base := 1
	for n > 1 {
		half := n >> 1
		s := &x.seps[base+half]
		base += half &^ -less128(size, ptr, s.size, s.ptr)
		n -= half
	}
	s := &x.seps[base]
	return base - less128(size, ptr, s.size, s.ptr)
}

// tree is the ordered set. The zero tree is empty and ready.
type tree struct {
	root        *inner // nil while the tree is one leaf
	height      int    // levels of inner nodes
	single      *leaf  // the only leaf when root is nil (nil when empty)
	first, last *leaf
	len         int
	spare       *spares // nil: dropped nodes are left to the garbage collector
}

// spares holds the nodes that trees dropped, for the next node they make:
// the trees of one index share one (index.go).
type spares struct {
	leaves []*leaf
	inners []*inner
}

// pos is a position in the tree: an entry of a leaf, or past the end when
// l is nil.
type pos struct {
	l *leaf
	i int
}

func (p pos) valid() bool { return p.l != nil }

func (p pos) entry() *entry { return &p.l.keys[p.i] }

func (p pos) block() *Block { return p.l.keys[p.i].b }

func (p pos) next() pos {
	if p.i+1 < p.l.n {
		return pos{p.l, p.i + 1}
	}
	if p.l.next == nil {
		return pos{}
	}
	return pos{p.l.next, 0}
}

func (p pos) prev() pos {
	if p.i > 0 {
		return pos{p.l, p.i - 1}
	}
	if p.l.prev == nil {
		return pos{}
	}
	return pos{p.l.prev, p.l.prev.n - 1}
}

// path records a descent: the inner node and child index at each level,
// root first.
type path struct {
	nodes [maxDepth]*inner
	idx   [maxDepth]int
}

// descend finds the leaf whose range holds (size, ptr), recording the way
// down in pt when it is not nil.
func (t *tree) descend(size, ptr uint64, pt *path) *leaf {
	if t.root == nil {
		return t.single
	}
	x := t.root
	for lvl := 0; ; lvl++ {
		i := x.route(size, ptr)
		if pt != nil {
			pt.nodes[lvl], pt.idx[lvl] = x, i
		}
		if lvl == t.height-1 {
			return x.leaves[i]
		}
		x = x.inners[i]
	}
}

// lowerBound returns the position of the first entry at or after
// (size, ptr).
func (t *tree) lowerBound(size, ptr uint64) pos {
	l := t.descend(size, ptr, nil)
	if l == nil {
		return pos{}
	}
	if i := l.search(size, ptr); i < l.n {
		return pos{l, i}
	}
	if l.next == nil {
		return pos{}
	}
	return pos{l.next, 0}
}

// find returns the position of the entry of b, or an invalid position.
func (t *tree) find(b *Block, size, ptr uint64) pos {
	p := t.lowerBound(size, ptr)
	if p.valid() && p.entry().b == b {
		return p
	}
	return pos{}
}

// head and tail return the first and the last entry's positions.
func (t *tree) head() pos {
	if t.first == nil {
		return pos{}
	}
	return pos{t.first, 0}
}

func (t *tree) tail() pos {
	if t.last == nil {
		return pos{}
	}
	return pos{t.last, t.last.n - 1}
}

func (t *tree) newLeaf() *leaf {
	if s := t.spare; s != nil && len(s.leaves) > 0 {
		l := s.leaves[len(s.leaves)-1]
		s.leaves = s.leaves[:len(s.leaves)-1]
		return l
	}
	return new(leaf)
}

func (t *tree) newInner() *inner {
	if s := t.spare; s != nil && len(s.inners) > 0 {
		x := s.inners[len(s.inners)-1]
		s.inners = s.inners[:len(s.inners)-1]
		return x
	}
	return new(inner)
}

// dropLeaf takes an empty leaf, whose keys are all zero already (a leaf
// clears the keys past its n).
func (t *tree) dropLeaf(l *leaf) {
	l.n, l.prev, l.next = 0, nil, nil
	if s := t.spare; s != nil && len(s.leaves) < keepFree {
		s.leaves = append(s.leaves, l)
	}
}

func (t *tree) dropInner(x *inner) {
	*x = inner{}
	if s := t.spare; s != nil && len(s.inners) < keepFree {
		s.inners = append(s.inners, x)
	}
}

// insert adds e, which must not be in the tree.
func (t *tree) insert(e entry) {
	t.len++
	if t.single == nil && t.root == nil {
		l := t.newLeaf()
		l.keys[0], l.n = e, 1
		t.single, t.first, t.last = l, l, l
		return
	}
	if l := t.single; l != nil && l.n < leafCap {
		// One leaf with room: no descent, no path (most bins of an index).
		l.insertAt(l.search(e.size, e.ptr), e)
		return
	}
	var pt path
	l := t.descend(e.size, e.ptr, &pt)
	if l.n < leafCap {
		l.insertAt(l.search(e.size, e.ptr), e)
		return
	}
	// Split the full leaf in two halves, then insert into the half whose
	// range holds e.
	r := t.newLeaf()
	half := leafCap / 2
	r.n = copy(r.keys[:], l.keys[half:l.n])
	clear(l.keys[half:l.n])
	l.n = half
	r.prev, r.next = l, l.next
	if l.next != nil {
		l.next.prev = r
	} else {
		t.last = r
	}
	l.next = r
	if r.keys[0].before(e.size, e.ptr) {
		r.insertAt(r.search(e.size, e.ptr), e)
	} else {
		l.insertAt(l.search(e.size, e.ptr), e)
	}
	t.addChild(&pt, t.height-1, sep{r.keys[0].size, r.keys[0].ptr}, r, nil)
}

func (l *leaf) insertAt(i int, e entry) {
	if l.n-i <= shortShift {
		for j := l.n; j > i; j-- {
			l.keys[j] = l.keys[j-1]
		}
	} else {
		copy(l.keys[i+1:l.n+1], l.keys[i:l.n])
	}
	l.keys[i] = e
	l.n++
}

// shortShift is the most entries a leaf shifts one by one: an entry holds
// a pointer, so copy calls the runtime (typedslicecopy), which costs more
// than a few moves, and most leaves of a binned index are short.
const shortShift = 4

// removeKey deletes entry i of l, clearing the slot it leaves.
func (l *leaf) removeKey(i int) {
	if l.n-i-1 <= shortShift {
		for j := i; j < l.n-1; j++ {
			l.keys[j] = l.keys[j+1]
		}
	} else {
		copy(l.keys[i:], l.keys[i+1:l.n])
	}
	l.n--
	l.keys[l.n] = entry{}
}

// addChild puts the new right sibling (leaf rl or inner ri, first entry s)
// of the child at path level lvl after it in its parent, splitting the
// parent when it is full; lvl -1 means the sibling is of the root (or of
// the single leaf), and the tree grows a level.
func (t *tree) addChild(pt *path, lvl int, s sep, rl *leaf, ri *inner) {
	if lvl < 0 {
		root := t.newInner()
		root.n = 2
		root.seps[1] = s
		if rl != nil {
			root.leaves[0], root.leaves[1] = t.single, rl
		} else {
			root.inners[0], root.inners[1] = t.root, ri
		}
		t.root, t.single = root, nil
		t.height++
		return
	}
	x, i := pt.nodes[lvl], pt.idx[lvl]+1
	if x.n < innerCap {
		x.insertAt(i, s, rl, ri)
		return
	}
	// Split x; the new child goes into the half that holds position i.
	y := t.newInner()
	half := innerCap / 2
	y.n = x.n - half
	copy(y.seps[:], x.seps[half:x.n])
	copy(y.leaves[:], x.leaves[half:x.n])
	copy(y.inners[:], x.inners[half:x.n])
	ys := y.seps[0]
	y.seps[0] = sep{}
	clear(x.seps[half:x.n])
	clear(x.leaves[half:x.n])
	clear(x.inners[half:x.n])
	x.n = half
	if i <= half {
		x.insertAt(i, s, rl, ri)
	} else {
		y.insertAt(i-half, s, rl, ri)
	}
	t.addChild(pt, lvl-1, ys, nil, y)
}

func (x *inner) insertAt(i int, s sep, rl *leaf, ri *inner) {
	copy(x.seps[i+1:x.n+1], x.seps[i:x.n])
	copy(x.leaves[i+1:x.n+1], x.leaves[i:x.n])
	copy(x.inners[i+1:x.n+1], x.inners[i:x.n])
	x.seps[i], x.leaves[i], x.inners[i] = s, rl, ri
	x.n++
}

func (x *inner) removeAt(i int) {
	copy(x.seps[i:], x.seps[i+1:x.n])
	copy(x.leaves[i:], x.leaves[i+1:x.n])
	copy(x.inners[i:], x.inners[i+1:x.n])
	x.n--
	x.seps[x.n], x.leaves[x.n], x.inners[x.n] = sep{}, nil, nil
	x.seps[0] = sep{}
}

// removeAt deletes the entry at p when its leaf keeps others (the tree
// keeps its shape) or is the tree's only leaf, and reports whether it did.
func (t *tree) removeAt(p pos) bool {
	l := p.l
	if l == nil || p.i >= l.n || l.n < 2 && l != t.single {
		return false
	}
	l.removeKey(p.i)
	t.len--
	if l.n == 0 {
		t.dropLeaf(l)
		t.single, t.first, t.last = nil, nil, nil
	}
	return true
}

// remove deletes the entry of b, filed under (size, ptr), and reports
// whether it was there.
func (t *tree) remove(b *Block, size, ptr uint64) bool {
	if l := t.single; l != nil {
		i := l.search(size, ptr)
		return i < l.n && l.keys[i].b == b && t.removeAt(pos{l, i})
	}
	var pt path
	l := t.descend(size, ptr, &pt)
	if l == nil {
		return false
	}
	i := l.search(size, ptr)
	if i == l.n || l.keys[i].b != b {
		return false
	}
	l.removeKey(i)
	t.len--
	if l.n > 0 {
		return true
	}
	// Take the empty leaf out of the chain and of the tree.
	if l.prev != nil {
		l.prev.next = l.next
	} else {
		t.first = l.next
	}
	if l.next != nil {
		l.next.prev = l.prev
	} else {
		t.last = l.prev
	}
	t.dropLeaf(l)
	if t.root == nil {
		t.single = nil
		return true
	}
	for lvl := t.height - 1; lvl >= 0; lvl-- {
		x := pt.nodes[lvl]
		x.removeAt(pt.idx[lvl])
		if x.n > 0 {
			break
		}
		t.dropInner(x)
		if lvl == 0 { // the root had one child (it never does after the loop below)
			t.root, t.height = nil, 0
		}
	}
	// A root with one child gives way to it.
	for t.root != nil && t.root.n == 1 {
		old := t.root
		if t.height == 1 {
			t.single, t.root = old.leaves[0], nil
		} else {
			t.root = old.inners[0]
		}
		t.height--
		t.dropInner(old)
	}
	return true
}

// check walks the whole tree and reports the first broken invariant: the
// leaf chain holds len entries in strictly increasing order, its links
// agree both ways and with first and last, no leaf is empty, and a walk
// from the root meets the same leaves in the same order, each entry
// within the bounds its separators give it.
func (t *tree) check() error {
	n := 0
	var prevLeaf *leaf
	var last *entry
	for l := t.first; l != nil; l = l.next {
		if l.prev != prevLeaf {
			return fmt.Errorf("leaf chain: a leaf's prev link does not point at the leaf before it")
		}
		if l.n <= 0 || l.n > leafCap {
			return fmt.Errorf("leaf chain: a leaf holds %d entries", l.n)
		}
		for i := range l.n {
			e := &l.keys[i]
			if last != nil && !last.before(e.size, e.ptr) {
				return fmt.Errorf("entries out of order: (%d, %#x) before (%d, %#x)", last.size, last.ptr, e.size, e.ptr)
			}
			last = e
			n++
		}
		prevLeaf = l
	}
	if prevLeaf != t.last {
		return fmt.Errorf("leaf chain: the last leaf is not the tree's last")
	}
	if n != t.len {
		return fmt.Errorf("the leaves hold %d entries, the tree counts %d", n, t.len)
	}
	if t.root == nil {
		if t.single != t.first || t.single != t.last {
			return fmt.Errorf("a tree of one leaf does not start and end at it")
		}
		return nil
	}
	next := t.first
	var walk func(x *inner, lvl int, lo, hi *sep) error
	walk = func(x *inner, lvl int, lo, hi *sep) error {
		if x.n < 1 || x.n > innerCap || x == t.root && x.n < 2 {
			return fmt.Errorf("an inner node at level %d has %d children", lvl, x.n)
		}
		for i := range x.n {
			clo, chi := lo, hi
			if i > 0 {
				clo = &x.seps[i]
			}
			if i+1 < x.n {
				chi = &x.seps[i+1]
			}
			if lvl == t.height-1 {
				l := x.leaves[i]
				if l == nil || l != next {
					return fmt.Errorf("the leaves under the root are not the leaf chain")
				}
				next = l.next
				for j := range l.n {
					e := &l.keys[j]
					if clo != nil && e.before(clo.size, clo.ptr) || chi != nil && !e.before(chi.size, chi.ptr) {
						return fmt.Errorf("entry (%d, %#x) lies outside its separators", e.size, e.ptr)
					}
				}
				continue
			}
			if x.inners[i] == nil {
				return fmt.Errorf("an inner node at level %d lacks child %d", lvl, i)
			}
			if err := walk(x.inners[i], lvl+1, clo, chi); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(t.root, 0, nil, nil); err != nil {
		return err
	}
	if next != nil {
		return fmt.Errorf("the leaf chain goes on past the tree's leaves")
	}
	return nil
}
