// harness.h: what the C test programs (driver.c, queue.c) share: failing
// checks, the library's symbols, its last error and one key of its stats
// JSON. Each program includes it once, after defining _GNU_SOURCE.
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MiB (1ull << 20)
#define GiB (1ull << 30)

// CHECK exits 1 with "FAIL file:line: cond: message" when cond is false.
#define CHECK(cond, ...)                                                        \
	do {                                                                        \
		if (!(cond)) {                                                          \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);     \
			fprintf(stderr, __VA_ARGS__);                                       \
			fputc('\n', stderr);                                                \
			exit(1);                                                            \
		}                                                                       \
	} while (0)

#define UNUSED __attribute__((unused))

typedef void *stream_t; // cudaStream_t

// The exports both programs call; each program sets them with sym.
static UNUSED size_t (*last_error)(char *, size_t);
static UNUSED void *(*tmalloc)(size_t, int, stream_t);
static UNUSED void (*tfree)(void *, size_t, int, stream_t);
static UNUSED void (*record_stream)(void *, stream_t);
static UNUSED void (*empty_cache)(void);
static UNUSED size_t (*stats_json)(int, char *, size_t);
static UNUSED long long (*allocated)(int), (*reserved)(int);

// lib is the dlopened liballocd.so.
static void *lib;

// sym returns lib's symbol name, or fails.
static UNUSED void *sym(const char *name) {
	void *p = dlsym(lib, name);
	CHECK(p != NULL, "dlsym %s: %s", name, dlerror());
	return p;
}

// err returns the library's last error message.
static UNUSED const char *err(void) {
	static char buf[4096];
	last_error(buf, sizeof buf);
	return buf;
}

// stat reads one key of allocd_memory_stats_json for device dev.
static UNUSED long long stat(int dev, const char *key) {
	static char buf[1 << 16];
	char pat[256];
	size_t n = stats_json(dev, buf, sizeof buf);
	CHECK(n < sizeof buf, "stats JSON of %zu bytes", n);
	CHECK(n > 1 && buf[0] == '{' && buf[n - 1] == '}', "stats JSON %.40s...", buf);
	snprintf(pat, sizeof pat, "\"%s\":", key);
	char *p = strstr(buf, pat);
	CHECK(p != NULL, "no key %s in the stats JSON", key);
	return strtoll(p + strlen(pat), NULL, 10);
}
