// pools.c: checks the private pool exports (pools.go), which allocd_torch's
// CUDAAllocator answers torch's pool calls with (CUDA graph capture,
// torch.cuda.MemPool): allocd_torch_create_pool, allocd_torch_release_pool,
// allocd_torch_begin_pool, allocd_torch_end_pool, allocd_torch_malloc_pool,
// allocd_torch_empty_pool_cache, allocd_torch_pool_use_count, the checkpoints
// of torch.compile's CUDA graph trees (allocd_torch_checkpoint_pool,
// allocd_torch_restore_pool, allocd_torch_checkpoint_free), and the pool ids
// of allocd_snapshot_flat's segments. TestPools (lib_test.go) runs
// it with ALLOCD_DEVICE=sim:2 and ALLOCD_SIM_CAPACITY=1GiB.
//
// Usage: pools LIB. A failed check prints "FAIL ..." on stderr and exits 1;
// success prints "DONE".
#define _GNU_SOURCE
#include "harness.h"

typedef int (*pool_fn)(int, uint64_t, uint64_t);
static pool_fn create_pool, release_pool, begin_pool, end_pool, empty_pool_cache, pool_use_count;
static void *(*malloc_pool)(size_t, int, stream_t, uint64_t, uint64_t);
static uintptr_t (*checkpoint_pool)(int, uint64_t, uint64_t);
static void (*checkpoint_free)(uintptr_t);
static long long (*restore_pool)(int, uintptr_t, long long **);
static long long (*snapshot_flat)(int, long long *, size_t);

// has reports whether the last error contains part.
static int has(const char *part) { return strstr(err(), part) != NULL; }

// pool_of returns the pool id of the segment of device 0 that holds p, from
// allocd_snapshot_flat (format 2); it fails when no segment holds p.
static void pool_of(void *p, long long id[2]) {
	long long need = snapshot_flat(0, NULL, 0);
	CHECK(need > 3, "snapshot_flat: %lld: %s", need, err());
	long long *s = calloc((size_t)need, sizeof *s);
	CHECK(s != NULL && snapshot_flat(0, s, (size_t)need) == need, "snapshot size changed");
	CHECK(s[0] == 2, "snapshot format %lld, want 2", s[0]);
	long long pos = 3, a = (long long)(uintptr_t)p;
	int found = 0;
	for (long long i = 0; i < s[1]; i++) {
		long long *sg = s + pos;
		if (sg[0] == 0 && a >= sg[1] && a < sg[1] + sg[2]) {
			id[0] = sg[9];
			id[1] = sg[10];
			found = 1;
		}
		pos += 12 + 4 * sg[11];
	}
	CHECK(pos == need, "layout: %lld values read of %lld", pos, need);
	free(s);
	CHECK(found, "no segment holds %p", p);
}

int main(int argc, char **argv) {
	CHECK(argc == 2, "usage: pools LIB");
	lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL, "dlopen: %s", dlerror());
	*(void **)&last_error = sym("allocd_last_error");
	*(void **)&tmalloc = sym("allocd_torch_malloc");
	*(void **)&tfree = sym("allocd_torch_free");
	*(void **)&empty_cache = sym("allocd_torch_empty_cache");
	*(void **)&stats_json = sym("allocd_memory_stats_json");
	*(void **)&create_pool = sym("allocd_torch_create_pool");
	*(void **)&release_pool = sym("allocd_torch_release_pool");
	*(void **)&begin_pool = sym("allocd_torch_begin_pool");
	*(void **)&end_pool = sym("allocd_torch_end_pool");
	*(void **)&empty_pool_cache = sym("allocd_torch_empty_pool_cache");
	*(void **)&pool_use_count = sym("allocd_torch_pool_use_count");
	*(void **)&malloc_pool = sym("allocd_torch_malloc_pool");
	*(void **)&snapshot_flat = sym("allocd_snapshot_flat");
	*(void **)&checkpoint_pool = sym("allocd_torch_checkpoint_pool");
	*(void **)&checkpoint_free = sym("allocd_torch_checkpoint_free");
	*(void **)&restore_pool = sym("allocd_torch_restore_pool");
	long long id[2];

	// 1. Nothing exists yet: a device not created has no pool; calls that
	// need a pool with users fail; indexes outside 0..127 and the general
	// cache's (0, 0) are refused.
	CHECK(pool_use_count(0, 1, 0) == 0, "use count of a pool of a device not created: %s", err());
	CHECK(release_pool(0, 1, 0) == -1 && has("unknown memory pool"), "release of no pool: %s", err());
	CHECK(end_pool(0, 1, 0) == -1 && has("unknown memory pool"), "end of no pool: %s", err());
	CHECK(malloc_pool(4096, 0, (stream_t)0, 1, 0) == NULL && has("unknown memory pool"), "malloc in no pool: %s", err());
	CHECK(create_pool(200, 0, 1) == -1 && has("device 200"), "device 200: %s", err());
	CHECK(pool_use_count(-1, 0, 1) == -1 && has("device -1"), "use count on device -1: %s", err());
	CHECK(create_pool(0, 0, 0) == -1 && has("general cache"), "create (0, 0): %s", err());
	CHECK(empty_pool_cache(-1, 0, 0) == -1 && has("general cache"), "empty (0, 0): %s", err());
	printf("no pool: refused\n");

	// 2. A MemPool's pool (0, 1): users counted; allocations routed to it
	// by name are private, in segments of its own, and its freed blocks
	// serve it alone.
	CHECK(create_pool(0, 0, 1) == 0, "%s", err());
	CHECK(pool_use_count(0, 0, 1) == 1, "use count %d, want 1", pool_use_count(0, 0, 1));
	CHECK(create_pool(0, 0, 1) == 0 && pool_use_count(0, 0, 1) == 2, "a second user: %d", pool_use_count(0, 0, 1));
	CHECK(release_pool(0, 0, 1) == 0 && pool_use_count(0, 0, 1) == 1, "a user released: %d", pool_use_count(0, 0, 1));
	CHECK(pool_use_count(1, 0, 1) == 0, "the pool is device 0's, device 1 has none");
	void *p = malloc_pool(4 * MiB, 0, (stream_t)0, 0, 1);
	CHECK(p != NULL, "malloc in pool: %s", err());
	void *q = tmalloc(4 * MiB, 0, (stream_t)0);
	CHECK(q != NULL, "%s", err());
	CHECK(stat(0, "private_allocated_bytes") == (long long)(4 * MiB), "private_allocated_bytes %lld",
	      stat(0, "private_allocated_bytes"));
	CHECK(stat(0, "private_reserved_bytes") >= (long long)(4 * MiB), "private_reserved_bytes %lld",
	      stat(0, "private_reserved_bytes"));
	CHECK(stat(0, "allocated_bytes.all.current") == (long long)(8 * MiB), "allocated_bytes %lld: pool blocks count too",
	      stat(0, "allocated_bytes.all.current"));
	pool_of(p, id);
	CHECK(id[0] == 0 && id[1] == 1, "p's segment in pool (%lld, %lld), want (0, 1)", id[0], id[1]);
	pool_of(q, id);
	CHECK(id[0] == 0 && id[1] == 0, "q's segment in pool (%lld, %lld), want (0, 0)", id[0], id[1]);
	tfree(p, 0, -1, NULL);
	void *r = tmalloc(4 * MiB, 0, (stream_t)0);
	CHECK(r != NULL && r != p, "a general malloc got the pool's freed block %p", r);
	void *p2 = malloc_pool(4 * MiB, 0, (stream_t)0, 0, 1);
	CHECK(p2 == p, "the pool's freed block %p was not reused in the pool (got %p)", p, p2);
	tfree(r, 0, -1, NULL);
	tfree(q, 0, -1, NULL);
	// empty_cache leaves a pool with users alone; so does emptyCache(pool).
	long long held = stat(0, "private_reserved_bytes");
	empty_cache();
	CHECK(empty_pool_cache(-1, 0, 1) == 0 && empty_pool_cache(0, 0, 1) == 0, "%s", err());
	CHECK(stat(0, "private_reserved_bytes") == held, "private_reserved_bytes %lld after empty_cache, want %lld",
	      stat(0, "private_reserved_bytes"), held);
	CHECK(stat(0, "reserved_bytes.all.current") == held, "reserved %lld: the general cache should be empty, the pool %lld",
	      stat(0, "reserved_bytes.all.current"), held);
	printf("pool (0, 1): %lld bytes private, kept by empty_cache\n", held);

	// 3. A CUDA graph's capture to pool (1, 0): begin adds a user; during the
	// capture a plain malloc stays in the general cache (the C++ class
	// routes), malloc_pool goes to the pool, empty_cache fails, the capture's
	// own use cannot be released; end and release let it go.
	CHECK(begin_pool(0, 1, 0) == 0, "%s", err());
	CHECK(pool_use_count(0, 1, 0) == 1, "use count %d after begin", pool_use_count(0, 1, 0));
	void *g = malloc_pool(MiB, 0, (stream_t)1, 1, 0);
	CHECK(g != NULL, "malloc in the capture's pool: %s", err());
	void *plain = tmalloc(MiB, 0, (stream_t)1);
	CHECK(plain != NULL, "%s", err());
	pool_of(g, id);
	CHECK(id[0] == 1 && id[1] == 0, "g's segment in pool (%lld, %lld)", id[0], id[1]);
	pool_of(plain, id);
	CHECK(id[0] == 0 && id[1] == 0, "a plain malloc during the capture went to pool (%lld, %lld)", id[0], id[1]);
	tfree(plain, 0, -1, NULL);
	empty_cache();
	CHECK(has("under way"), "empty_cache during a capture: last error %s", err());
	CHECK(release_pool(0, 1, 0) == -1 && has("under way"), "release during the capture: %s", err());
	CHECK(end_pool(0, 1, 0) == 0, "%s", err());
	CHECK(end_pool(0, 1, 0) == -1 && has("unknown memory pool"), "a second end: %s", err());
	CHECK(pool_use_count(0, 1, 0) == 1, "use count %d after end", pool_use_count(0, 1, 0));
	// A graph's pool shared by a second capture (pool=g1.pool()).
	CHECK(begin_pool(0, 1, 0) == 0 && end_pool(0, 1, 0) == 0, "%s", err());
	CHECK(pool_use_count(0, 1, 0) == 2, "use count %d with two graphs", pool_use_count(0, 1, 0));
	CHECK(release_pool(0, 1, 0) == 0 && release_pool(0, 1, 0) == 0, "%s", err());
	CHECK(pool_use_count(0, 1, 0) == 0, "use count %d after both released", pool_use_count(0, 1, 0));
	// Released with g live: its memory goes back when g is freed.
	long long before = stat(0, "private_reserved_bytes");
	CHECK(before > held, "private_reserved_bytes %lld with g live, the MemPool's alone %lld", before, held);
	tfree(g, 0, -1, NULL);
	CHECK(stat(0, "private_reserved_bytes") == held, "private_reserved_bytes %lld after g's free, want %lld",
	      stat(0, "private_reserved_bytes"), held);
	CHECK(malloc_pool(MiB, 0, (stream_t)0, 1, 0) == NULL && has("unknown memory pool"), "malloc in a released pool: %s", err());
	CHECK(empty_pool_cache(-1, 1, 0) == 0, "emptyCache of a pool gone: %s", err());
	printf("pool (1, 0): captured, shared, released, returned\n");

	// 4. The MemPool's destructor: release, then emptyCache(pool). Its free
	// memory goes back at the release; p, still live, returns at its free.
	CHECK(release_pool(0, 0, 1) == 0 && empty_pool_cache(-1, 0, 1) == 0, "%s", err());
	CHECK(pool_use_count(0, 0, 1) == 0, "use count %d", pool_use_count(0, 0, 1));
	tfree(p2, 0, -1, NULL);
	CHECK(stat(0, "private_reserved_bytes") == 0, "private_reserved_bytes %lld at the end", stat(0, "private_reserved_bytes"));
	CHECK(stat(0, "allocated_bytes.all.current") == 0, "allocated_bytes %lld at the end", stat(0, "allocated_bytes.all.current"));
	CHECK(stat(0, "num_bad_frees") == 0, "num_bad_frees %lld", stat(0, "num_bad_frees"));
	printf("pool (0, 1): released, its memory returned\n");

	// 5. A graph tree's pool (3, 0): a checkpoint after a "recording" with a
	// and b live; then b dies and c is made; restoring frees what is
	// allocated now (a, c) and allocates the checkpoint's blocks (a, b) at
	// their addresses, the caller's to free.
	CHECK(checkpoint_pool(0, 3, 0) == 0 && has("unknown memory pool"), "checkpoint of no pool: %s", err());
	CHECK(create_pool(0, 3, 0) == 0, "%s", err());
	void *a = malloc_pool(512 * 1024, 0, (stream_t)0, 3, 0);
	void *b = malloc_pool(512 * 1024, 0, (stream_t)0, 3, 0);
	CHECK(a != NULL && b != NULL, "%s", err());
	uintptr_t ck = checkpoint_pool(0, 3, 0);
	CHECK(ck != 0, "checkpoint: %s", err());
	tfree(b, 0, -1, NULL);
	void *c = malloc_pool(256 * 1024, 0, (stream_t)0, 3, 0);
	CHECK(c != NULL, "%s", err());
	long long *out = (long long *)1;
	CHECK(restore_pool(1, ck, &out) == -1 && out == NULL && has("of device 0"), "restore on device 1: %s", err());
	// Not during a capture.
	CHECK(begin_pool(0, 4, 0) == 0, "%s", err());
	CHECK(restore_pool(0, ck, &out) == -1 && out == NULL && has("under way"), "restore during a capture: %s", err());
	CHECK(end_pool(0, 4, 0) == 0 && release_pool(0, 4, 0) == 0, "%s", err());
	long long n = restore_pool(0, ck, &out);
	CHECK(n >= 2 && out != NULL, "restore: %lld: %s", n, err());
	CHECK(out[0] == 2 && out[1] == 2 && n == 6, "restore freed %lld, allocated %lld, %lld values", out[0], out[1], n);
	long long fa = out[2], fb = out[3], aa = out[4], ab = out[5];
	CHECK((fa == (long long)(uintptr_t)a && fb == (long long)(uintptr_t)c) || (fa == (long long)(uintptr_t)c && fb == (long long)(uintptr_t)a),
	      "freed %#llx %#llx, want a %p and c %p", fa, fb, a, c);
	CHECK((aa == (long long)(uintptr_t)a && ab == (long long)(uintptr_t)b) || (aa == (long long)(uintptr_t)b && ab == (long long)(uintptr_t)a),
	      "allocated %#llx %#llx, want a %p and b %p", aa, ab, a, b);
	free(out);
	CHECK(stat(0, "private_allocated_bytes") == 1024 * 1024, "private_allocated_bytes %lld after the restore",
	      stat(0, "private_allocated_bytes"));
	// The checkpoint can be restored again; then dropped.
	n = restore_pool(0, ck, &out);
	CHECK(n == 6 && out[0] == 2 && out[1] == 2, "a second restore: %lld: %s", n, err());
	free(out);
	checkpoint_free(ck);
	tfree(a, 0, -1, NULL);
	tfree(b, 0, -1, NULL);
	CHECK(release_pool(0, 3, 0) == 0, "%s", err());
	CHECK(stat(0, "private_reserved_bytes") == 0 && stat(0, "allocated_bytes.all.current") == 0,
	      "private_reserved_bytes %lld, allocated %lld at the end", stat(0, "private_reserved_bytes"),
	      stat(0, "allocated_bytes.all.current"));
	CHECK(stat(0, "num_bad_frees") == 0, "num_bad_frees %lld", stat(0, "num_bad_frees"));
	printf("pool (3, 0): checkpointed, restored twice, released\n");
	printf("DONE\n");
	return 0;
}
