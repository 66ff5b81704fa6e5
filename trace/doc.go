// Package trace reads PyTorch CUDA memory snapshots, the pickles that
// torch.cuda.memory._dump_snapshot() writes, into the model of package
// snapshot (which also writes them), and turns their device traces into
// replayable operations.
//
// # Reading
//
// Read and ReadFile accept a snapshot pickle (protocol 2 to 5), the same
// gzip-compressed, or a RAPIDS RMM logging_resource_adaptor CSV log (plain or
// gzip). The format is recognised by content, never by file name: gzip by its
// magic bytes, a pickle by its PROTO opcode, an RMM log by its header line.
//
// A snapshot of a long run holds about a million trace entries, so the pickle
// decoder is not a general unpickler that builds map[string]any trees. It is
// a small stack machine that streams the (decompressed) input through a
// window of at most 1 MiB and builds the typed structs of package snapshot
// directly:
//
//   - Values on the stack and in the memo are 16-byte records without Go
//     pointers (a kind and a payload), so the garbage collector never scans
//     them; the memo grows in fixed chunks and is never copied. A string is
//     an offset and a length into an arena of string bytes; it becomes a Go
//     string (interned) only when it lands in a typed field, and action
//     names become constants without any copy.
//   - Every container the pickle opens (EMPTY_DICT, EMPTY_LIST) is given a
//     schema from its parent and its key: the top-level dict, "segments",
//     a segment, its "blocks", "device_traces", one device's trace, an entry,
//     "frames", a frame, "allocator_settings" (decoded generically into
//     map[string]any) or skip. Items are typed as they are added: SETITEMS on
//     an entry sets its fields, APPENDS on a device trace moves entries into
//     the trace. Skipped containers (frames unless ReadOptions.Frames,
//     compile_context, segment_pool_id, unknown keys) cost only their
//     opcodes.
//   - Entry dicts are filled in a small recycled pool, then kept as 40-byte
//     pointer-free records in chunks; the []Entry of a device is allocated
//     once, at its exact size, when its trace is complete. Touching fresh
//     memory is the largest cost of decoding a big snapshot, so each entry
//     is written to memory twice and never copied by slice growth.
//
// The parent of a new container is found from the open containers and the
// MARK stack, which is unambiguous for what Python's pickler and PyTorch's
// own pickler write. Whatever the guess, every typed item is checked against
// its real consumer when it is added, so a pickle of another shape is
// reported as an error rather than decoded wrongly. (One leniency: an object
// memoized in a skipped part of the snapshot and referenced again inside
// allocator_settings reads there as nil; so does a string of more than 256
// bytes skipped where its value is not kept.) The decoder never panics on bad
// input: it returns ErrTruncated, ErrUnsupportedOpcode, ErrMalformed,
// ErrNotSnapshot, ErrUnknownAction or ErrTooLarge, wrapped in a *DecodeError
// carrying the byte offset when there is one.
//
// A gzip input may hold several members, read as one stream as gzip -d
// reads them; the checksum of each is verified, and bytes after the last
// member that are not a gzip member are an error (ErrMalformed), as are
// a bad header, corrupt data and a bad checksum.
//
// Nothing may follow the pickle's STOP opcode: trailing bytes, junk or a
// second pickle, in a plain input or anywhere in the decompressed gzip
// stream, are ErrMalformed at the offset of the first of them. A bool
// (True, False) where a size, an address, a stream, a device or a time
// belongs is ErrMalformed naming the field: Python's bool is an int, but a
// snapshot never holds one there.
//
// # Limits
//
// Every input, however hostile, is read within a stated budget; past a
// limit Read fails with ErrTooLarge and a message naming the limit, and it
// never makes an allocation sized by a length read from the input before
// the bytes it describes have arrived:
//
//   - ReadOptions.MaxBytes (DefaultMaxBytes, 4 GiB) bounds the input after
//     decompression, and so the time a read takes. The largest trace in CI
//     decompresses to 65.6 MB.
//   - ReadOptions.MaxMemory (DefaultMaxMemory, 2 GiB) bounds the memory the
//     decoder keeps, as it estimates it: about 112 bytes per trace entry
//     while decoding (so about 15 million entries), a few hundred per
//     segment, block or frame, 16 per memo slot, and the bytes of the
//     strings it keeps. The Go heap may peak at up to about twice the
//     estimate. The 913,006-entry trace is estimated at 129 MiB.
//   - MaxStack (1<<20) bounds the values and MARKs on the pickle stack,
//     and so the nesting of containers (at most 16 MiB of stack).
//   - MaxDevices (1024) bounds the device traces.
//   - MaxString (1 MiB) bounds a string or bytes value that is kept; a
//     longer one where its value is not used (an unknown key, a skipped
//     stack, compile_context) is streamed past without being stored,
//     whatever its length. LONG1/LONG4 integers that are kept have at most
//     1 KiB.
//   - An RMM log is read line by line: its memory grows with its entries
//     (held to MaxMemory), never with blank lines, and a line has at most
//     MaxRMMLine (64 KiB) bytes.
//
// Skipped containers, tuples and strings cost nothing, so a read costs
// memory in proportion to the entries, segments, blocks and frames the
// snapshot really contains.
//
// # Replay
//
// BuildOps turns one device trace into Ops: dense allocation IDs instead of
// reused addresses, frees matched to their allocations, unmatched frees
// counted instead of fatal, and a Deferred flag on frees whose block was held
// by another stream until a later free_completed. workload.Replay replays them.
package trace
