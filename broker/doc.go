// Package broker is allocd's node broker: one process per node holds a
// cache of physical GPU memory and lends it, in chunks, to the processes
// that share the node's GPUs, each within its tenant's quota.
//
// # The model
//
// The broker creates physical memory with the driver's virtual memory
// calls (cudart.ShareableMemory: cuMemCreate with a POSIX
// file-descriptor handle type), and a client maps it into its own
// address space: the broker exports a chunk's descriptor, sends it over
// a Unix socket (SCM_RIGHTS), and the client imports it and maps it
// where its expandable segments grow (package allocator, WithBroker).
// A chunk a client gives back goes to the next client that asks for one
// of its size, without a cudaFree or a cudaMalloc. Memory one process
// has freed is therefore there for its neighbour, and no tenant takes
// more than its quota.
//
// A chunk is in exactly one place: a device's cache, or held by one
// client (Check walks this). It leaves a client when the client returns
// it or when the client's connection has closed and its process has
// exited: the broker watches the process through a pidfd opened when it
// connected, because a live process cut off for a protocol error may
// still have its chunks mapped, and a dead one has none. A crashed or
// killed client's memory is back in the cache as soon as its process is
// gone. Cached chunks that no client takes go back to the driver when
// Trim finds them idle, so that programs that do not use the broker can
// have the memory.
//
// # Tenants, quotas and identity
//
// A client names its tenant in its Hello; the broker knows its pid and
// uid from SO_PEERCRED. The tenants file (Tenants) lists each tenant,
// its quota on each GPU and, optionally, the uids that may use it;
// `allocd serve --broker` reads it again on SIGHUP and when its content
// changes (TenantsFile), and a file with any error leaves the policy in
// force (SetTenants, ReloadFailed). A grant that would take a tenant over its quota is refused
// with a message naming the tenant, the quota and its use; the client's
// allocator treats it as out of memory, empties its own caches (their
// chunks go back) and asks once more before it fails.
//
// # Scrubbing
//
// A chunk that passes from one tenant to another is zeroed first, on
// the broker's own stream, through a mapping of the broker's, before it
// is granted; within one tenant it moves as it is. Chunks the broker
// creates after it has released one some tenant wrote are zeroed too,
// since the driver may hand the same memory back. The time it takes is
// in the allocd_broker_scrub_seconds_total metric.
//
// # The protocol
//
// Frames are length-prefixed, bounded (MaxFrame) and versioned
// (ProtocolVersion); DecodeMessage checks every field. A client that
// sends garbage or a wrong version is cut off with a Fault; one that
// sends half a frame has FrameTimeout to finish it; one that stops
// reading its answers is cut off after WriteTimeout. Each connection has
// its own goroutine, and the broker's lock is never held across socket
// input or output nor across a scrub's memset, so one bad client, or one
// grant that needs zeroing, does not slow the others.
//
// # What it does not do
//
// It is cooperative. A process that calls cudaMalloc itself is not
// limited by any quota, and a client that keeps a chunk mapped after
// returning it could still read or write whatever the next tenant puts
// there: the broker relies on its clients (allocd's allocator) to
// release a chunk's mappings before returning it. Its security boundary
// is the socket's file mode and group and the tenants' uid lists: any
// process that can connect can take memory up to its tenant's quota.
package broker
