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
// a small stack machine over the whole decompressed input held in one byte
// slice, and it builds the typed structs of this package directly:
//
//   - Values on the stack and in the memo are 16-byte records without Go
//     pointers (a kind and a payload), so the garbage collector never scans
//     them. A string is an offset and a length into the input; it is copied
//     (and interned) only when it lands in a typed field, and action names
//     become constants without any copy.
//   - Every container the pickle opens (EMPTY_DICT, EMPTY_LIST) is given a
//     schema from its parent and its key: the top-level dict, "segments",
//     a segment, its "blocks", "device_traces", one device's trace, an entry,
//     "frames", a frame, "allocator_settings" (decoded generically into
//     map[string]any) or skip. Items are typed as they are added: SETITEMS on
//     an entry sets Entry fields, APPENDS on a device trace copies entries
//     into the result slice. Skipped containers (frames unless
//     ReadOptions.Frames, compile_context, segment_pool_id, unknown keys)
//     cost only their opcodes.
//   - Entry dicts live in a small recycled pool until their list takes them,
//     so the decoder allocates nothing per entry beyond the result slice.
//
// The parent of a new container is found from the open containers and the
// MARK stack, which is unambiguous for what Python's pickler and PyTorch's
// own pickler write. Whatever the guess, every item is checked against its
// real consumer when it is added, so a pickle of another shape is reported as
// an error and never decoded wrongly. The decoder never panics on bad input:
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
