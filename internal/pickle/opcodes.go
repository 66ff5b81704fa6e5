// Package pickle names the opcodes of Python's pickle protocol
// (Lib/pickle.py) for the snapshot pickle writer (package snapshot) and
// reader (package trace). It holds constants and names only, no codec.
package pickle

// Pickle opcodes. The reader implements the binary ones a snapshot can
// contain and the writer uses some of them; the others are listed for the
// reader's error messages.
const (
	Mark           = '('
	Stop           = '.'
	Pop            = '0'
	PopMark        = '1'
	Dup            = '2'
	BinInt         = 'J'
	BinInt1        = 'K'
	BinInt2        = 'M'
	None           = 'N'
	BinFloat       = 'G'
	BinString      = 'T'
	ShortBinString = 'U'
	BinUnicode     = 'X'
	BinBytes       = 'B'
	ShortBinBytes  = 'C'
	Append         = 'a'
	Appends        = 'e'
	Dict           = 'd'
	EmptyDict      = '}'
	List           = 'l'
	EmptyList      = ']'
	SetItem        = 's'
	SetItems       = 'u'
	Tuple          = 't'
	EmptyTuple     = ')'
	BinGet         = 'h'
	LongBinGet     = 'j'
	BinPut         = 'q'
	LongBinPut     = 'r'

	Proto           = 0x80
	Tuple1          = 0x85
	Tuple2          = 0x86
	Tuple3          = 0x87
	NewTrue         = 0x88
	NewFalse        = 0x89
	Long1           = 0x8a
	Long4           = 0x8b
	ShortBinUnicode = 0x8c
	BinUnicode8     = 0x8d
	BinBytes8       = 0x8e
	Memoize         = 0x94
	Frame           = 0x95
)

// BatchSize is Python's pickler batch size: it writes at most this many
// items per APPENDS or SETITEMS, so a list or dict whose last batch carried
// fewer is complete.
const BatchSize = 1000

// opNames names every pickle opcode, for error messages.
var opNames = map[byte]string{
	'(': "MARK", '.': "STOP", '0': "POP", '1': "POP_MARK", '2': "DUP",
	'F': "FLOAT", 'I': "INT", 'J': "BININT", 'K': "BININT1", 'L': "LONG",
	'M': "BININT2", 'N': "NONE", 'P': "PERSID", 'Q': "BINPERSID",
	'R': "REDUCE", 'S': "STRING", 'T': "BINSTRING", 'U': "SHORT_BINSTRING",
	'V': "UNICODE", 'X': "BINUNICODE", 'a': "APPEND", 'b': "BUILD",
	'c': "GLOBAL", 'd': "DICT", '}': "EMPTY_DICT", 'e': "APPENDS", 'g': "GET",
	'h': "BINGET", 'i': "INST", 'j': "LONG_BINGET", 'l': "LIST",
	']': "EMPTY_LIST", 'o': "OBJ", 'p': "PUT", 'q': "BINPUT",
	'r': "LONG_BINPUT", 's': "SETITEM", 't': "TUPLE", ')': "EMPTY_TUPLE",
	'u': "SETITEMS", 'G': "BINFLOAT", 'B': "BINBYTES", 'C': "SHORT_BINBYTES",
	0x80: "PROTO", 0x81: "NEWOBJ", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4",
	0x85: "TUPLE1", 0x86: "TUPLE2", 0x87: "TUPLE3", 0x88: "NEWTRUE",
	0x89: "NEWFALSE", 0x8a: "LONG1", 0x8b: "LONG4", 0x8c: "SHORT_BINUNICODE",
	0x8d: "BINUNICODE8", 0x8e: "BINBYTES8", 0x8f: "EMPTY_SET",
	0x90: "ADDITEMS", 0x91: "FROZENSET", 0x92: "NEWOBJ_EX",
	0x93: "STACK_GLOBAL", 0x94: "MEMOIZE", 0x95: "FRAME", 0x96: "BYTEARRAY8",
	0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}

// OpName returns the opcode's pickle name, or "not an opcode".
func OpName(op byte) string {
	if n, ok := opNames[op]; ok {
		return n
	}
	return "not an opcode"
}
