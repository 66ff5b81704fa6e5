// queue.c: checks liballocd.so's free queue (freequeue.c) from a separate
// process: allocd_torch_free only queues, and every other call must see
// each free that has returned as applied. TestFreeQueue (lib_test.go) runs
// it with ALLOCD_DEVICE=sim, ALLOCD_SIM_CAPACITY=1GiB and
// ALLOCD_SIM_MANUAL_EVENTS=1.
//
// Usage: queue LIB. A failed check prints "FAIL ..." on stderr and exits 1;
// success prints "DONE".
#define _GNU_SOURCE
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

enum { THREADS = 8, PER_THREAD = 300, QUEUE_CAP = 256 };

// Each thread frees its share of blocks (more than the queue holds in all,
// so some frees find it full and enter Go), interleaved with the others.
struct share {
	void **ptrs;
	int n;
	pthread_barrier_t *start;
};

static void *free_share(void *arg) {
	struct share *s = arg;
	pthread_barrier_wait(s->start);
	for (int i = 0; i < s->n; i++) {
		tfree(s->ptrs[i], 100 * MiB / PER_THREAD, 0, (stream_t)0);
	}
	return NULL;
}

static volatile int hammer_stop;

static void *hammer(void *arg) {
	(void)arg;
	while (!hammer_stop) {
		void *p = tmalloc(4096, 0, (stream_t)3);
		tfree(p, 4096, 0, (stream_t)3);
	}
	return NULL;
}

int main(int argc, char **argv) {
	CHECK(argc == 2, "usage: queue LIB");
	lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL, "dlopen: %s", dlerror());
	*(void **)&last_error = sym("allocd_last_error");
	*(void **)&tmalloc = sym("allocd_torch_malloc");
	*(void **)&tfree = sym("allocd_torch_free");
	*(void **)&record_stream = sym("allocd_torch_record_stream");
	*(void **)&empty_cache = sym("allocd_torch_empty_cache");
	*(void **)&stats_json = sym("allocd_memory_stats_json");
	*(void **)&allocated = sym("allocd_memory_allocated");
	*(void **)&reserved = sym("allocd_memory_reserved");

	// 1. Queued frees, then the stats: exact at once.
	void *p[10];
	for (int i = 0; i < 10; i++) {
		p[i] = tmalloc(MiB, 0, (stream_t)1);
		CHECK(p[i] != NULL, "%s", err());
	}
	long long freed0 = stat(0, "allocation.all.freed");
	for (int i = 0; i < 10; i++) {
		tfree(p[i], MiB, 0, (stream_t)1);
	}
	CHECK(stat(0, "allocation.all.freed") == freed0 + 10, "freed %lld, want %lld", stat(0, "allocation.all.freed"),
	      freed0 + 10);
	CHECK(stat(0, "allocation.all.current") == 0 && allocated(0) == 0, "allocated %lld after freeing all", allocated(0));
	printf("queued frees: stats exact\n");

	// 2. A full queue: more frees in a row than it holds.
	enum { MANY = 3 * QUEUE_CAP + 7 };
	static void *q[MANY];
	for (int i = 0; i < MANY; i++) {
		q[i] = tmalloc(512, 0, (stream_t)1);
		CHECK(q[i] != NULL, "%s", err());
	}
	CHECK(stat(0, "allocation.all.current") == MANY, "allocations %lld", stat(0, "allocation.all.current"));
	for (int i = 0; i < MANY; i++) {
		tfree(q[i], 512, 0, (stream_t)1);
	}
	CHECK(stat(0, "allocation.all.current") == 0 && stat(0, "allocation.all.freed") == freed0 + 10 + MANY,
	      "after %d frees: current %lld freed %lld", MANY, stat(0, "allocation.all.current"),
	      stat(0, "allocation.all.freed"));
	printf("full queue: %d frees applied\n", MANY);

	// 3. Bad frees through the queue: counted, logged, the message readable
	// by the freeing thread, nothing changed; also amid a full queue.
	long long bad0 = stat(0, "num_bad_frees");
	void *keep = tmalloc(MiB, 0, (stream_t)1);
	CHECK(keep != NULL, "%s", err());
	tfree((void *)(uintptr_t)0xdead000, 512, 0, (stream_t)0);
	CHECK(strstr(err(), "unknown pointer") != NULL, "last error after an unknown free: %s", err());
	void *d = tmalloc(MiB, 0, (stream_t)1);
	tfree(d, MiB, 0, (stream_t)1);
	tfree(d, MiB, 0, (stream_t)1);
	CHECK(strstr(err(), "double free") != NULL, "last error after a double free: %s", err());
	for (int i = 0; i < MANY; i++) {
		q[i] = tmalloc(512, 0, (stream_t)1);
	}
	for (int i = 0; i < MANY; i++) {
		tfree(q[i], 512, 0, (stream_t)1);
		if (i == QUEUE_CAP / 2 || i == QUEUE_CAP + 3) {
			tfree((void *)(uintptr_t)(0xbad0000 + i), 512, 0, (stream_t)0);
		}
	}
	CHECK(stat(0, "num_bad_frees") == bad0 + 4, "num_bad_frees %lld, want %lld", stat(0, "num_bad_frees"), bad0 + 4);
	CHECK(allocated(0) == (long long)MiB, "allocated %lld: a bad free changed something", allocated(0));
	tfree(keep, MiB, 0, (stream_t)1);
	CHECK(allocated(0) == 0, "allocated %lld", allocated(0));
	printf("bad frees: counted through the queue\n");

	// 4. record_stream after a queued free: the malloc that reuses the
	// freed block sees the free applied, and so does record_stream.
	void *a = tmalloc(MiB, 0, (stream_t)1);
	tfree(a, MiB, 0, (stream_t)1);
	void *b = tmalloc(MiB, 0, (stream_t)1);
	CHECK(b == a, "the queued free of %p was not applied before the malloc (got %p)", a, b);
	record_stream(b, (stream_t)2);
	tfree(b, MiB, 0, (stream_t)1);
	CHECK(stat(0, "active_bytes.all.current") - allocated(0) == (long long)MiB,
	      "active %lld allocated %lld: the recorded block is not pending", stat(0, "active_bytes.all.current"),
	      allocated(0));
	empty_cache();
	CHECK(reserved(0) == 0 && stat(0, "active_bytes.all.current") == 0, "reserved %lld after empty_cache", reserved(0));
	printf("record_stream: ordered after the queued free\n");

	// 5. Many threads free at once, then one malloc needs their memory: it
	// must see every free applied (its OOM path frees the cached segments).
	static void *blocks[THREADS][PER_THREAD];
	size_t bs = 100 * MiB / PER_THREAD;
	for (int t = 0; t < THREADS; t++) {
		for (int i = 0; i < PER_THREAD; i++) {
			blocks[t][i] = tmalloc(bs, 0, (stream_t)0);
			CHECK(blocks[t][i] != NULL, "%s", err());
		}
	}
	pthread_barrier_t start;
	pthread_barrier_init(&start, NULL, THREADS);
	pthread_t th[THREADS];
	struct share shares[THREADS];
	for (int t = 0; t < THREADS; t++) {
		shares[t] = (struct share){blocks[t], PER_THREAD, &start};
		CHECK(pthread_create(&th[t], NULL, free_share, &shares[t]) == 0, "pthread_create");
	}
	for (int t = 0; t < THREADS; t++) {
		pthread_join(th[t], NULL);
	}
	CHECK(stat(0, "allocation.all.current") == 0, "%lld allocations left", stat(0, "allocation.all.current"));
	void *big = tmalloc(900 * MiB, 0, (stream_t)0);
	CHECK(big != NULL, "900 MiB after %d threads freed 800 MiB: %s", THREADS, err());
	tfree(big, 900 * MiB, 0, (stream_t)0);
	CHECK(allocated(0) == 0, "allocated %lld", allocated(0));
	printf("concurrent frees: all applied before the malloc\n");

	// 6. fork while other threads free: the child's frees return at once
	// (the fork guard: they touch neither the queue nor Go) and it exits.
	pthread_t hm[2];
	for (int i = 0; i < 2; i++) {
		CHECK(pthread_create(&hm[i], NULL, hammer, NULL) == 0, "pthread_create");
	}
	for (int i = 0; i < 50; i++) {
		pid_t pid = fork();
		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			alarm(5);
			for (int j = 0; j < 4; j++) {
				tfree((void *)(uintptr_t)(0xc0de000 + j), 512, 0, (stream_t)0);
			}
			_exit(0);
		}
		int status;
		CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
		CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child %d: status %#x", i, status);
	}
	hammer_stop = 1;
	for (int i = 0; i < 2; i++) {
		pthread_join(hm[i], NULL);
	}
	CHECK(allocated(0) == 0, "allocated %lld after the hammering threads", allocated(0));
	printf("fork: 50 children freed and exited\n");

	printf("DONE\n");
	return 0;
}
