// fork.c: forks a process whose other threads are inside liballocd.so (in
// Go: malloc, free, stats, empty_cache), and checks that each child's
// calls into every export fail at once with an error that names the fork,
// instead of hanging on the Go runtime, which the child has only one thread
// of. TestFork (lib_test.go) runs it with ALLOCD_DEVICE=sim and
// ALLOCD_SIM_CAPACITY=1GiB.
//
// Usage: fork LIB. A failed check prints "FAIL ..." on stderr and exits 1;
// success prints "DONE". A child that has not finished after 3 s is killed
// by SIGALRM and counted as hung.
#define _GNU_SOURCE
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

enum { CHILDREN = 20, HAMMERS = 4 };

static int (*init_)(const char *, const char *, const char *);
static void (*set_fraction)(double, int);
static int (*release_stream)(int, stream_t);
static size_t (*summary)(int, int, char *, size_t);
static int (*reset_peak)(int);
static int (*record_history)(int, long long, int);
static int (*dump_snapshot)(const char *);
static size_t (*metrics_address)(char *, size_t);
static long long (*max_allocated)(int), (*max_reserved)(int);
static void *(*malloc_pool)(size_t, int, stream_t, uint64_t, uint64_t);
static int (*create_pool)(int, uint64_t, uint64_t), (*release_pool)(int, uint64_t, uint64_t),
	(*begin_pool)(int, uint64_t, uint64_t), (*end_pool)(int, uint64_t, uint64_t),
	(*empty_pool_cache)(int, uint64_t, uint64_t), (*pool_use_count)(int, uint64_t, uint64_t);
static uintptr_t (*checkpoint_pool)(int, uint64_t, uint64_t);
static void (*checkpoint_free)(uintptr_t);
static long long (*restore_pool)(int, uintptr_t, long long **);

static volatile int hammer_stop;

// hammer keeps a thread inside the library: pairs on its own stream, and
// every few the calls that take the allocator's world lock.
static void *hammer(void *arg) {
	uintptr_t stream = (uintptr_t)arg;
	char buf[1 << 14];
	for (int i = 0; !hammer_stop; i++) {
		void *p = tmalloc(4096 + 512 * (i % 8), 0, (stream_t)stream);
		tfree(p, 4096, 0, (stream_t)stream);
		if (i % 64 == 0) {
			stats_json(0, buf, sizeof buf);
			empty_cache();
		}
	}
	return NULL;
}

// CCHECK is CHECK for a forked child: it leaves with _exit, running no
// handler of the parent's.
#define CCHECK(cond, ...)                                                       \
	do {                                                                        \
		if (!(cond)) {                                                          \
			fprintf(stderr, "FAIL child %s:%d: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                                       \
			fputc('\n', stderr);                                                \
			fflush(stderr);                                                     \
			_exit(1);                                                           \
		}                                                                       \
	} while (0)

// forked reports whether the calling thread's last error names the fork.
static int forked(void) { return strstr(err(), "forked child") != NULL; }

// child calls every export once; each must return at once with the fork's
// error.
static void child(void) {
	char buf[256];
	alarm(3);
	CCHECK(tmalloc(4096, 0, (stream_t)0) == NULL, "malloc in the child returned memory");
	CCHECK(forked(), "malloc: last error %s", err());
	tfree((void *)(uintptr_t)0xc0de000, 512, 0, (stream_t)0);
	record_stream((void *)(uintptr_t)0xc0de000, (stream_t)1);
	empty_cache();
	set_fraction(0.5, 0);
	CCHECK(stats_json(0, buf, sizeof buf) == 2 && strcmp(buf, "{}") == 0, "stats_json: %s", buf);
	CCHECK(summary(0, 0, buf, sizeof buf) == 0, "summary: %s", buf);
	CCHECK(allocated(0) == 0 && reserved(0) == 0 && max_allocated(0) == 0 && max_reserved(0) == 0, "counters");
	CCHECK(reset_peak(0) == -1, "reset_peak_stats succeeded");
	CCHECK(release_stream(0, (stream_t)1) == -1, "release_stream succeeded");
	CCHECK(record_history(1, 0, 0) == -1, "record_history succeeded");
	CCHECK(dump_snapshot("/nonexistent/snap.pickle") == -1, "dump_snapshot succeeded");
	CCHECK(init_(NULL, NULL, NULL) == -1, "init succeeded");
	CCHECK(metrics_address(buf, sizeof buf) == 0, "metrics_address: %s", buf);
	CCHECK(malloc_pool(4096, 0, (stream_t)0, 0, 1) == NULL, "malloc_pool in the child returned memory");
	CCHECK(create_pool(0, 0, 1) == -1 && release_pool(0, 0, 1) == -1 && begin_pool(0, 1, 0) == -1 &&
	           end_pool(0, 1, 0) == -1 && empty_pool_cache(-1, 0, 1) == -1 && pool_use_count(0, 0, 1) == -1,
	       "a pool call succeeded");
	long long *out = (long long *)1;
	CCHECK(checkpoint_pool(0, 0, 1) == 0 && restore_pool(0, 1, &out) == -1 && out == NULL, "a checkpoint call succeeded");
	checkpoint_free(1);
	CCHECK(forked(), "last error %s", err());
	_exit(0);
}

int main(int argc, char **argv) {
	CHECK(argc == 2, "usage: fork LIB");
	lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL, "dlopen: %s", dlerror());
	*(void **)&init_ = sym("allocd_init");
	*(void **)&last_error = sym("allocd_last_error");
	*(void **)&tmalloc = sym("allocd_torch_malloc");
	*(void **)&tfree = sym("allocd_torch_free");
	*(void **)&record_stream = sym("allocd_torch_record_stream");
	*(void **)&empty_cache = sym("allocd_torch_empty_cache");
	*(void **)&set_fraction = sym("allocd_torch_set_memory_fraction");
	*(void **)&release_stream = sym("allocd_release_stream");
	*(void **)&stats_json = sym("allocd_memory_stats_json");
	*(void **)&summary = sym("allocd_memory_summary");
	*(void **)&allocated = sym("allocd_memory_allocated");
	*(void **)&reserved = sym("allocd_memory_reserved");
	*(void **)&max_allocated = sym("allocd_max_memory_allocated");
	*(void **)&max_reserved = sym("allocd_max_memory_reserved");
	*(void **)&reset_peak = sym("allocd_reset_peak_stats");
	*(void **)&record_history = sym("allocd_record_history");
	*(void **)&dump_snapshot = sym("allocd_dump_snapshot");
	*(void **)&metrics_address = sym("allocd_metrics_address");
	*(void **)&malloc_pool = sym("allocd_torch_malloc_pool");
	*(void **)&create_pool = sym("allocd_torch_create_pool");
	*(void **)&release_pool = sym("allocd_torch_release_pool");
	*(void **)&begin_pool = sym("allocd_torch_begin_pool");
	*(void **)&end_pool = sym("allocd_torch_end_pool");
	*(void **)&empty_pool_cache = sym("allocd_torch_empty_pool_cache");
	*(void **)&pool_use_count = sym("allocd_torch_pool_use_count");
	*(void **)&checkpoint_pool = sym("allocd_torch_checkpoint_pool");
	*(void **)&checkpoint_free = sym("allocd_torch_checkpoint_free");
	*(void **)&restore_pool = sym("allocd_torch_restore_pool");

	void *p = tmalloc(MiB, 0, (stream_t)0);
	CHECK(p != NULL, "malloc before the fork: %s", err());

	pthread_t th[HAMMERS];
	for (int i = 0; i < HAMMERS; i++) {
		CHECK(pthread_create(&th[i], NULL, hammer, (void *)(uintptr_t)(i + 1)) == 0, "pthread_create");
	}
	usleep(50 * 1000);
	int hung = 0, failed = 0;
	for (int i = 0; i < CHILDREN; i++) {
		usleep(2000);
		pid_t pid = fork();
		CHECK(pid >= 0, "fork");
		if (pid == 0) {
			child();
		}
		int status;
		CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
		if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
			hung++;
		} else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
			failed++;
		}
	}
	hammer_stop = 1;
	for (int i = 0; i < HAMMERS; i++) {
		pthread_join(th[i], NULL);
	}
	printf("fork: %d children, %d hung, %d failed\n", CHILDREN, hung, failed);
	CHECK(hung == 0 && failed == 0, "%d of %d children hung, %d failed", hung, CHILDREN, failed);

	// The parent's library works on.
	tfree(p, MiB, 0, (stream_t)0);
	CHECK(allocated(0) == 0, "allocated %lld after the hammering threads", allocated(0));
	void *q = tmalloc(MiB, 0, (stream_t)0);
	CHECK(q != NULL, "malloc after the forks: %s", err());
	tfree(q, MiB, 0, (stream_t)0);
	printf("DONE\n");
	return 0;
}
