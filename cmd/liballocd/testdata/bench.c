// bench.c: times cached malloc+free pairs through liballocd.so's C API, as
// PyTorch's pluggable allocator calls them. Run it on the simulated device:
//
//	go build -buildmode=c-shared -o liballocd.so ./cmd/liballocd
//	gcc -O2 -pthread -o bench cmd/liballocd/testdata/bench.c -ldl
//	ALLOCD_DEVICE=sim ./bench ./liballocd.so [PAIRS]
//
// For each size it runs PAIRS malloc+free pairs (default 200000) from one
// thread, then from 4 threads at once (each its own stream, PAIRS each), and
// prints the wall-clock ns per pair (for 4 threads: total wall time divided
// by all pairs, so it is throughput) and the process's CPU time per pair
// (steadier on a shared machine; it includes the library's Go runtime
// threads and, with 4 threads, time spent waiting in spin loops), each the
// median of 5 runs. Every size is malloced and freed once first, so that
// each timed malloc is served from the cache. TestBench (lib_test.go) runs
// it briefly as a smoke test.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void *stream_t;
static void *(*tmalloc)(size_t, int, stream_t);
static void (*tfree)(void *, size_t, int, stream_t);
static long long (*allocated)(int);

static long pairs = 200000;

enum { THREADS = 4, REPS = 5 };

static int cmp(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

// median sorts v[REPS] and returns its middle.
static double median(double *v) {
	qsort(v, REPS, sizeof v[0], cmp);
	return v[REPS / 2];
}

static double clock_ns(clockid_t c) {
	struct timespec ts;
	clock_gettime(c, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}
static double now(void) { return clock_ns(CLOCK_MONOTONIC); }
static double cpu(void) { return clock_ns(CLOCK_PROCESS_CPUTIME_ID); }

struct job {
	size_t size;
	stream_t stream;
	pthread_barrier_t *start;
	int failed;
};

static void *run(void *arg) {
	struct job *j = arg;
	void *p = tmalloc(j->size, 0, j->stream); // warm the cache for this stream
	tfree(p, j->size, 0, j->stream);
	if (j->start != NULL) {
		pthread_barrier_wait(j->start);
	}
	for (long i = 0; i < pairs; i++) {
		p = tmalloc(j->size, 0, j->stream);
		if (p == NULL) {
			j->failed = 1;
			return NULL;
		}
		tfree(p, j->size, 0, j->stream);
	}
	return NULL;
}

int main(int argc, char **argv) {
	if (argc < 2) {
		fprintf(stderr, "usage: bench LIB [PAIRS]\n");
		return 2;
	}
	if (argc > 2) {
		pairs = atol(argv[2]);
	}
	void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (lib == NULL) {
		fprintf(stderr, "dlopen: %s\n", dlerror());
		return 1;
	}
	*(void **)&tmalloc = dlsym(lib, "allocd_torch_malloc");
	*(void **)&tfree = dlsym(lib, "allocd_torch_free");
	*(void **)&allocated = dlsym(lib, "allocd_memory_allocated");
	if (!tmalloc || !tfree || !allocated) {
		fprintf(stderr, "dlsym: %s\n", dlerror());
		return 1;
	}
	static const size_t sizes[] = {512, 64 << 10, 4 << 20};
	for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
		double ns1[REPS], ns4[REPS], cpu1[REPS], cpu4[REPS];
		int failed = 0;
		for (int r = 0; r < REPS; r++) {
			struct job one = {sizes[s], (stream_t)1, NULL, 0};
			run(&one); // warm-up
			double t0 = now(), c0 = cpu();
			run(&one);
			ns1[r] = (now() - t0) / pairs;
			cpu1[r] = (cpu() - c0) / pairs;
			failed |= one.failed;

			pthread_barrier_t start;
			pthread_barrier_init(&start, NULL, THREADS + 1);
			pthread_t th[THREADS];
			struct job jobs[THREADS];
			for (int i = 0; i < THREADS; i++) {
				jobs[i] = (struct job){sizes[s], (stream_t)(uintptr_t)(i + 1), &start, 0};
				pthread_create(&th[i], NULL, run, &jobs[i]);
			}
			pthread_barrier_wait(&start);
			t0 = now();
			c0 = cpu();
			for (int i = 0; i < THREADS; i++) {
				pthread_join(th[i], NULL);
				failed |= jobs[i].failed;
			}
			ns4[r] = (now() - t0) / (pairs * THREADS);
			cpu4[r] = (cpu() - c0) / (pairs * THREADS);
			pthread_barrier_destroy(&start);
		}
		if (failed) {
			fprintf(stderr, "FAIL: malloc of %zu returned NULL\n", sizes[s]);
			return 1;
		}
		printf("size %8zu: 1 thread %6.1f ns/pair (cpu %6.1f), %d threads %6.1f ns/pair (cpu %6.1f), median of %d\n",
		       sizes[s], median(ns1), median(cpu1), THREADS, median(ns4), median(cpu4), REPS);
	}
	long long a = allocated(0);
	if (a != 0) {
		fprintf(stderr, "FAIL: %lld bytes allocated after every pair was freed\n", a);
		return 1;
	}
	printf("OK\n");
	return 0;
}
