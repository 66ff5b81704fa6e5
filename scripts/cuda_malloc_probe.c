// cuda_malloc_probe: what cudaMalloc costs a plain C program for a list of
// sizes, so that a caching allocator's measured device mallocs can be held
// against the driver's own cost on the same machine.
//
//   nvcc -O2 -o cuda_malloc_probe scripts/cuda_malloc_probe.c
//   cuda_malloc_probe SIZES_FILE [PASSES]
//
// SIZES_FILE holds one size in bytes per line, in the order a replay makes
// its device mallocs (a trace's segment_alloc entries). Each pass
// allocates every size in turn, timing each call, then frees them all; the
// first pass runs in a process whose context has made no allocation yet
// (cudaFree(0) creates the context first, untimed). It prints, per pass,
// the calls, their mean and median microseconds, and the total.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_us(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

int main(int argc, char **argv) {
	if (argc < 2) {
		fprintf(stderr, "usage: %s SIZES_FILE [PASSES]\n", argv[0]);
		return 2;
	}
	int passes = argc > 2 ? atoi(argv[2]) : 3;
	FILE *f = fopen(argv[1], "r");
	if (!f) {
		perror(argv[1]);
		return 2;
	}
	size_t cap = 1024, n = 0;
	size_t *sizes = malloc(cap * sizeof *sizes);
	unsigned long long s;
	while (fscanf(f, "%llu", &s) == 1) {
		if (n == cap) sizes = realloc(sizes, (cap *= 2) * sizeof *sizes);
		sizes[n++] = s;
	}
	fclose(f);
	void **ptrs = calloc(n, sizeof *ptrs);
	double *us = calloc(n, sizeof *us);
	cudaError_t err = cudaFree(0);
	if (err != cudaSuccess) {
		fprintf(stderr, "cudaFree(0): %s\n", cudaGetErrorString(err));
		return 1;
	}
	for (int p = 1; p <= passes; p++) {
		double total = 0, bytes = 0;
		for (size_t i = 0; i < n; i++) {
			double t0 = now_us();
			err = cudaMalloc(&ptrs[i], sizes[i]);
			us[i] = now_us() - t0;
			if (err != cudaSuccess) {
				fprintf(stderr, "cudaMalloc(%zu): %s\n", sizes[i], cudaGetErrorString(err));
				return 1;
			}
			total += us[i];
			bytes += sizes[i];
		}
		for (size_t i = 0; i < n; i++) cudaFree(ptrs[i]);
		qsort(us, n, sizeof *us, cmp);
		printf("pass %d: %zu cudaMalloc calls, %.0f MiB: mean %.1f us, median %.1f us, total %.2f ms\n", p, n,
		       bytes / (1 << 20), total / n, us[n / 2], total / 1e3);
	}
	return 0;
}
