// stream.c: checks allocd_release_stream from a separate process: a
// destroyed stream's cached segments go back to the device at once (after
// the frees queued before the call), or, while a block on it is live, as
// soon as that block is freed; bad device indexes fail with a message.
// TestReleaseStream (lib_test.go) runs it with ALLOCD_DEVICE=sim:2 and
// ALLOCD_SIM_CAPACITY=1GiB.
//
// Usage: stream LIB. A failed check prints "FAIL ..." on stderr and exits
// 1; success prints "DONE".
#define _GNU_SOURCE
#include "harness.h"

static int (*release_stream)(int, stream_t);

int main(int argc, char **argv) {
	CHECK(argc == 2, "usage: stream LIB");
	lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL, "dlopen: %s", dlerror());
	*(void **)&last_error = sym("allocd_last_error");
	*(void **)&tmalloc = sym("allocd_torch_malloc");
	*(void **)&tfree = sym("allocd_torch_free");
	*(void **)&reserved = sym("allocd_memory_reserved");
	*(void **)&allocated = sym("allocd_memory_allocated");
	*(void **)&release_stream = sym("allocd_release_stream");

	// 1. A block freed on stream 3 (queued), then the stream released:
	// its 2 MiB segment goes back; the default stream's stays.
	void *keep = tmalloc(4096, 0, (stream_t)0);
	CHECK(keep != NULL, "%s", err());
	void *p = tmalloc(MiB, 0, (stream_t)3);
	CHECK(p != NULL, "%s", err());
	tfree(p, MiB, 0, (stream_t)3);
	CHECK(reserved(0) == 4 * MiB, "reserved %lld before the release, want 4 MiB", reserved(0));
	CHECK(release_stream(0, (stream_t)3) == 0, "%s", err());
	CHECK(reserved(0) == 2 * MiB, "reserved %lld after releasing stream 3, want 2 MiB", reserved(0));
	printf("release: stream 3's cached segment went back\n");

	// 2. A stream with a live block: nothing goes back until it is freed,
	// then its segment goes at once.
	void *q = tmalloc(3 * MiB, 0, (stream_t)5);
	CHECK(q != NULL, "%s", err());
	long long with = reserved(0);
	CHECK(release_stream(0, (stream_t)5) == 0, "%s", err());
	CHECK(reserved(0) == with, "reserved %lld after releasing a stream with a live block, want %lld", reserved(0), with);
	tfree(q, 3 * MiB, 0, (stream_t)5);
	CHECK(reserved(0) == 2 * MiB, "reserved %lld after the live block's free, want 2 MiB", reserved(0));
	printf("release: stream 5's segment went back at its last free\n");

	// 3. A released stream's handle works again (a new stream may reuse it).
	void *r = tmalloc(MiB, 0, (stream_t)3);
	CHECK(r != NULL, "malloc on a released stream's handle: %s", err());
	tfree(r, MiB, 0, (stream_t)3);

	// 4. The default stream, a device with no allocator yet, bad indexes.
	CHECK(release_stream(0, (stream_t)0) == 0 && reserved(0) == 4 * MiB, "default stream: %s, reserved %lld", err(), reserved(0));
	CHECK(release_stream(1, (stream_t)3) == 0, "device 1, not created: %s", err());
	CHECK(release_stream(-1, (stream_t)3) == -1 && strstr(err(), "no such device"), "device -1: %s", err());
	CHECK(release_stream(128, (stream_t)3) == -1 && strstr(err(), "no such device"), "device 128: %s", err());
	tfree(keep, 4096, 0, (stream_t)0);
	CHECK(allocated(0) == 0, "allocated %lld at the end", allocated(0));
	printf("DONE\n");
	return 0;
}
