package allocator

import "github.com/allocd/allocd/blocks"

// ptrMap maps a device address to its allocated block. It is an
// open-addressing hash table with linear probing and backward-shift
// deletion, so that steady-state inserts and deletes allocate nothing
// (Go's built-in map may allocate as tombstones accumulate). It grows by
// doubling at 50% load and never shrinks.
type ptrMap struct {
	keys  []uint64 // 0 marks an empty slot; device addresses are never 0
	vals  []*blocks.Block
	mask  uint64
	count int
}

func newPtrMap(capacity int) ptrMap {
	n := 64
	for n < 2*capacity {
		n <<= 1
	}
	return ptrMap{keys: make([]uint64, n), vals: make([]*blocks.Block, n), mask: uint64(n - 1)}
}

// slot hashes an address. Addresses are 512-byte aligned and clustered, so
// mix the bits (the 64-bit finaliser of MurmurHash3) before masking.
func (m *ptrMap) slot(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	return k & m.mask
}

func (m *ptrMap) get(k uint64) *blocks.Block {
	i, ok := m.find(k)
	if !ok {
		return nil
	}
	return m.vals[i]
}

// find returns the slot of k, and false when k is absent: a Free finds
// its block and then deletes it from the same slot (delAt), one probe.
func (m *ptrMap) find(k uint64) (uint64, bool) {
	for i := m.slot(k); ; i = (i + 1) & m.mask {
		switch m.keys[i] {
		case k:
			return i, true
		case 0:
			return 0, false
		}
	}
}

func (m *ptrMap) put(k uint64, v *blocks.Block) {
	if 2*(m.count+1) > len(m.keys) {
		m.grow()
	}
	i := m.slot(k)
	for m.keys[i] != 0 && m.keys[i] != k {
		i = (i + 1) & m.mask
	}
	if m.keys[i] == 0 {
		m.count++
	}
	m.keys[i], m.vals[i] = k, v
}

func (m *ptrMap) grow() {
	old := *m
	*m = newPtrMap(len(old.keys))
	for i, k := range old.keys {
		if k != 0 {
			m.put(k, old.vals[i])
		}
	}
}

// del removes k and reports whether it was present.
func (m *ptrMap) del(k uint64) bool {
	i, ok := m.find(k)
	if ok {
		m.delAt(i)
	}
	return ok
}

// delAt removes the entry in slot i, which find returned and nothing has
// changed since.
func (m *ptrMap) delAt(i uint64) {
	// Backward-shift: move later entries of the probe run into the hole
	// when their home slot does not lie cyclically in (hole, j].
	for j := (i + 1) & m.mask; m.keys[j] != 0; j = (j + 1) & m.mask {
		h := m.slot(m.keys[j])
		if (j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j)) {
			m.keys[i], m.vals[i] = m.keys[j], m.vals[j]
			i = j
		}
	}
	m.keys[i], m.vals[i] = 0, nil
	m.count--
}

func (m *ptrMap) len() int { return m.count }

// each calls fn for every entry.
func (m *ptrMap) each(fn func(*blocks.Block)) {
	for i, k := range m.keys {
		if k != 0 {
			fn(m.vals[i])
		}
	}
}
