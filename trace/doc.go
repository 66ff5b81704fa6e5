// Package trace reads and writes PyTorch CUDA memory snapshots, the pickles
// that torch.cuda.memory._dump_snapshot() writes, and turns their device
// traces into replayable operations.
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
// window of at most 1 MiB and builds the typed structs of this package
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
// allocator_settings reads there as nil.) The decoder never panics on bad input:
// it returns ErrTruncated, ErrUnsupportedOpcode, ErrMalformed, ErrNotSnapshot
// or ErrUnknownAction, wrapped in a *DecodeError carrying the byte offset
// when there is one.
//
// # Writing
//
// WritePickle writes a Snapshot with the dict layout and key names PyTorch
// uses, using only opcodes that Python's pickle and the memory_viz web page's
// own unpickler (torch/utils/viz/MemoryViz.js) understand, so that
// torch.cuda._memory_viz and https://pytorch.org/memory_viz read it.
//
// # Replay
//
// BuildOps turns one device trace into Ops: dense allocation IDs instead of
// reused addresses, frees matched to their allocations, unmatched frees
// counted instead of fatal, and a Deferred flag on frees whose block was held
// by another stream until a later free_completed (DESIGN §6).
package trace
