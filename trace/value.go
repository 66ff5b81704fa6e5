package trace

import (
	"encoding/binary"
	"math"
	"math/big"
)

// vkind is the kind of a decoder value.
type vkind uint8

const (
	kInvalid vkind = iota // the zero value: an unset memo slot
	kNone
	kBool    // n is 0 or 1
	kInt     // n is an int64
	kUint    // n is a uint64 above math.MaxInt64
	kFloat   // n holds float64 bits
	kStr     // n packs an offset and length into decoder.arena (packRef)
	kBytes   // like kStr, for bytes
	kAny     // n indexes decoder.anys: big ints, long strings, tuples, LIST/DICT
	kCont    // n indexes decoder.conts: an open or finished container
	kEntry   // n packs a pool generation and slot: an entry dict
	kFrames  // n indexes decoder.frameLists: a frames list
	kFrame   // n indexes decoder.frameDicts: a frame dict
	kSkip    // a container whose contents are not kept
	kSkipped // a long string, bytes or integer streamed past, not kept
)

// val is one value on the decoder's stack or in its memo. It holds no Go
// pointer, so the stack and the memo (millions of values) cost the garbage
// collector nothing.
type val struct {
	kind vkind
	n    uint64
}

// A string or bytes value packs its offset (40 bits) and length (24 bits)
// in decoder.arena; longer ones are boxed in decoder.anys.
const (
	refLenBits = 24
	maxRefLen  = 1<<refLenBits - 1
	maxRefOff  = 1<<(64-refLenBits) - 1
)

func packRef(off, n int) (uint64, bool) {
	if n > maxRefLen || off > maxRefOff {
		return 0, false
	}
	return uint64(off)<<refLenBits | uint64(n), true
}

func unpackRef(n uint64) (off, length int) {
	return int(n >> refLenBits), int(n & maxRefLen)
}

func intVal(i int64) val { return val{kind: kInt, n: uint64(i)} }

// decodeLong decodes a LONG1/LONG4 payload: little-endian two's complement.
// It returns an int or uint value when the number fits in 64 bits, else
// ok=false and the caller boxes bigLong(b).
func decodeLong(b []byte) (val, bool) {
	switch {
	case len(b) == 0:
		return intVal(0), true
	case len(b) <= 8:
		var buf [8]byte
		if b[len(b)-1]&0x80 != 0 {
			buf = [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
		}
		copy(buf[:], b)
		return intVal(int64(binary.LittleEndian.Uint64(buf[:]))), true
	case len(b) == 9 && b[8] == 0:
		u := binary.LittleEndian.Uint64(b)
		if u <= math.MaxInt64 {
			return intVal(int64(u)), true
		}
		return val{kind: kUint, n: u}, true
	}
	return val{}, false
}

// bigLong decodes a little-endian two's complement integer of any size.
func bigLong(b []byte) *big.Int {
	be := make([]byte, len(b))
	for i, c := range b {
		be[len(b)-1-i] = c
	}
	x := new(big.Int).SetBytes(be)
	if len(b) > 0 && b[len(b)-1]&0x80 != 0 {
		x.Sub(x, new(big.Int).Lsh(big.NewInt(1), uint(8*len(b))))
	}
	return x
}
