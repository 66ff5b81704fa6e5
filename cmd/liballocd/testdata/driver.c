// driver.c: drives liballocd.so's C API from a separate process, as PyTorch
// would, on the simulated device. TestDriver (lib_test.go) builds it and
// runs it with ALLOCD_DEVICE=sim:2, ALLOCD_SIM_CAPACITY=1GiB and
// ALLOCD_SIM_MANUAL_EVENTS=1 (stream events stay pending until a
// synchronising call waits for them, like a slow consumer stream).
//
// Usage: driver LIB SNAPSHOT. Every check that fails prints "FAIL ..." on
// stderr and exits 1. Near the end it prints "METRICS host:port" and waits
// for a line on stdin, so that the test can scrape the metrics server; then
// it prints "DONE" and exits 0.
#define _GNU_SOURCE
#include "harness.h"

static int (*init_)(const char *, const char *, const char *);
static void (*set_fraction)(double, int);
static size_t (*summary)(int, int, char *, size_t);
static int (*reset_peak)(int);
static int (*record_history)(int, long long, int);
static int (*dump_snapshot)(const char *);
static size_t (*metrics_address)(char *, size_t);
static long long (*max_allocated)(int), (*max_reserved)(int);

// cudart_mappings counts the /proc/self/maps lines of a libcudart.
static int cudart_mappings(void) {
	FILE *f = fopen("/proc/self/maps", "r");
	char line[4096];
	int n = 0;
	CHECK(f != NULL, "open /proc/self/maps");
	while (fgets(line, sizeof line, f)) {
		if (strstr(line, "libcudart") != NULL) {
			n++;
		}
	}
	fclose(f);
	return n;
}

static void *other_thread(void *arg) {
	(void)arg;
	char buf[64];
	return (void *)(uintptr_t)last_error(buf, sizeof buf);
}

int main(int argc, char **argv) {
	CHECK(argc == 3, "usage: driver LIB SNAPSHOT");
	lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL, "dlopen: %s", dlerror());
	*(void **)&init_ = sym("allocd_init");
	*(void **)&last_error = sym("allocd_last_error");
	*(void **)&tmalloc = sym("allocd_torch_malloc");
	*(void **)&tfree = sym("allocd_torch_free");
	*(void **)&record_stream = sym("allocd_torch_record_stream");
	*(void **)&empty_cache = sym("allocd_torch_empty_cache");
	*(void **)&set_fraction = sym("allocd_torch_set_memory_fraction");
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
	CHECK(dlsym(lib, "allocd_malloc") == NULL, "the cudart shim's allocd_malloc is exported");

	// Lifecycle: idempotent for the same arguments, refused for others.
	CHECK(init_(NULL, "127.0.0.1:0", NULL) == 0, "%s", err());
	CHECK(init_(NULL, "127.0.0.1:0", NULL) == 0, "%s", err());
	CHECK(init_("expandable_segments:True", "127.0.0.1:0", NULL) == -1, "a second init with another conf succeeded");
	CHECK(strstr(err(), "already initialised") != NULL, "%s", err());
	char addr[256];
	size_t an = metrics_address(addr, sizeof addr);
	CHECK(an > 0 && an < sizeof addr && strncmp(addr, "127.0.0.1:", 10) == 0 && strcmp(addr, "127.0.0.1:0") != 0,
	      "metrics address %s", addr);

	// Malloc on two streams.
	stream_t s1 = (stream_t)1, s2 = (stream_t)2;
	void *p1 = tmalloc(MiB, 0, s1), *p2 = tmalloc(MiB, 0, s2);
	CHECK(p1 != NULL && p2 != NULL && p1 != p2, "p1 %p p2 %p: %s", p1, p2, err());
	CHECK(allocated(0) == 2 * MiB, "allocated %lld", allocated(0));
	CHECK(stat(0, "allocation.all.current") == 2, "allocations %lld", stat(0, "allocation.all.current"));

	// record_stream: p3, used by s2 and freed, stays pending (active, not
	// allocated) and is not handed to the next malloc on s1.
	void *p3 = tmalloc(MiB, 0, s1);
	CHECK(p3 != NULL, "%s", err());
	record_stream(p3, s2);
	tfree(p3, MiB, 0, s1);
	CHECK(stat(0, "active_bytes.all.current") - stat(0, "allocated_bytes.all.current") == (long long)MiB,
	      "active %lld allocated %lld: the recorded block is not pending", stat(0, "active_bytes.all.current"),
	      stat(0, "allocated_bytes.all.current"));
	void *p4 = tmalloc(MiB, 0, s1);
	CHECK(p4 != NULL && p4 != p3, "p4 %p reuses the pending block p3 %p", p4, p3);
	// The control: without record_stream a freed block is reused at once.
	void *p5 = tmalloc(MiB, 0, s1);
	tfree(p5, MiB, 0, s1);
	void *p6 = tmalloc(MiB, 0, s1);
	CHECK(p6 == p5, "without record_stream the freed block %p was not reused (got %p)", p5, p6);
	printf("record_stream: pending block %p kept from the next malloc (%p); without it %p reused\n", p3, p4, p5);

	// empty_cache: with nothing live, reserved drops to 0 (pending events
	// are waited for first).
	tfree(p1, MiB, 0, s1);
	tfree(p2, MiB, 0, s2);
	tfree(p4, MiB, 0, s1);
	tfree(p6, MiB, 0, s1);
	CHECK(allocated(0) == 0 && reserved(0) > 0, "allocated %lld reserved %lld", allocated(0), reserved(0));
	long long peak_reserved = max_reserved(0);
	empty_cache();
	CHECK(reserved(0) == 0, "reserved %lld after empty_cache", reserved(0));
	CHECK(stat(0, "active_bytes.all.current") == 0, "active %lld", stat(0, "active_bytes.all.current"));
	CHECK(max_reserved(0) == peak_reserved && peak_reserved >= (long long)(4 * MiB), "peak reserved %lld", max_reserved(0));

	// Summary and peaks.
	char text[1 << 16];
	size_t full = summary(0, 0, text, sizeof text);
	CHECK(full < sizeof text && strstr(text, "Allocated memory") && strstr(text, "GPU reserved memory"), "summary:\n%s", text);
	size_t abbr = summary(0, 1, text, sizeof text);
	CHECK(abbr > 0 && abbr < full, "abbreviated summary %zu bytes, full %zu", abbr, full);
	CHECK(summary(0, 0, text, 8) == full && strlen(text) == 7, "truncated summary");
	CHECK(max_allocated(0) >= (long long)(3 * MiB), "peak allocated %lld", max_allocated(0));
	CHECK(reset_peak(0) == 0, "%s", err());
	CHECK(max_allocated(0) == 0, "peak allocated %lld after reset", max_allocated(0));
	CHECK(stat(5, "allocated_bytes.all.current") == 0 && stat(5, "num_bad_frees") == 0, "a device never used");

	// Bad frees: unknown, double, another device's. None changes anything.
	tfree((void *)(uintptr_t)0xdead000, 512, 0, 0);
	void *q = tmalloc(MiB, 0, 0);
	CHECK(q != NULL, "%s", err());
	tfree(q, MiB, 0, 0);
	tfree(q, MiB, 0, 0);
	CHECK(strstr(err(), "double free") != NULL, "%s", err());
	void *r = tmalloc(3 * MiB, 1, 0);
	CHECK(r != NULL, "%s", err());
	tfree(r, 3 * MiB, 0, 0);
	CHECK(strstr(err(), "device 1") != NULL, "wrong-device free: %s", err());
	CHECK(allocated(1) == 3 * MiB, "the wrong-device free changed device 1: allocated %lld", allocated(1));
	CHECK(stat(0, "num_bad_frees") == 3 && stat(1, "num_bad_frees") == 0, "num_bad_frees %lld, %lld",
	      stat(0, "num_bad_frees"), stat(1, "num_bad_frees"));
	record_stream((void *)(uintptr_t)0xdead000, s1);
	CHECK(strstr(err(), "unknown pointer") != NULL, "%s", err());
	CHECK(allocated(0) == 0, "allocated %lld", allocated(0));

	// OOM: NULL, and allocd's message in allocd_last_error, of this thread only.
	void *big = tmalloc(2 * GiB, 0, 0);
	CHECK(big == NULL, "a 2 GiB malloc on a 1 GiB device returned %p", big);
	CHECK(strstr(err(), "out of memory") && strstr(err(), "tried to allocate"), "%s", err());
	printf("OOM: %s\n", err());
	CHECK(stat(0, "num_ooms") == 1, "num_ooms %lld after an OOM", stat(0, "num_ooms"));
	pthread_t th;
	void *other_len = NULL;
	CHECK(pthread_create(&th, NULL, other_thread, NULL) == 0 && pthread_join(th, &other_len) == 0, "thread");
	CHECK(other_len == NULL, "another thread sees a last error of %zu bytes", (size_t)(uintptr_t)other_len);
	CHECK(tmalloc(MiB, 7, 0) == NULL && strstr(err(), "no such device"), "device 7 of 2: %s", err());
	void *after = tmalloc(MiB, 0, 0);
	CHECK(after != NULL, "malloc after the OOM: %s", err());

	// History, switched on at run time: the snapshot written below holds
	// the malloc and free recorded from here on. Out-of-range options fail.
	CHECK(record_history(1, 99999999999LL, 0) == -1 && strstr(err(), "history"), "record_history: %s", err());
	CHECK(record_history(1, 1000, 4) == 0, "record_history: %s", err());
	void *h = tmalloc(MiB, 0, s1);
	CHECK(h != NULL, "%s", err());
	tfree(h, MiB, 0, s1);

	// The memory fraction, set at run time, caps what device 0 may reserve.
	set_fraction(0.25, 0);
	void *capped = tmalloc(512 * MiB, 0, 0);
	CHECK(capped == NULL && strstr(err(), "out of memory"), "a 512 MiB malloc under a 0.25 cap of 1 GiB: %p %s", capped, err());
	CHECK(stat(0, "num_ooms") == 2, "num_ooms %lld after the capped OOM", stat(0, "num_ooms"));
	set_fraction(2.0, 0);
	CHECK(strstr(err(), "fraction") != NULL, "a fraction of 2 was accepted: %s", err());
	set_fraction(0, 0);
	capped = tmalloc(512 * MiB, 0, 0);
	CHECK(capped != NULL, "the cap was not lifted: %s", err());
	tfree(capped, 512 * MiB, 0, 0);

	CHECK(dump_snapshot(argv[2]) == 0, "%s", err());
	CHECK(dump_snapshot("/nonexistent-dir/x.pickle") == -1 && strstr(err(), "dump snapshot"), "%s", err());

	// The simulated device never loads a CUDA runtime.
	CHECK(cudart_mappings() == 0, "libcudart is mapped on the simulated device");

	// Queued frees the scrape must see applied (the metrics server drains
	// the free queue): a 1 MiB block of device 1 and an unknown pointer.
	void *x = tmalloc(MiB, 1, 0);
	CHECK(x != NULL, "%s", err());
	tfree(x, MiB, 1, 0);
	tfree((void *)(uintptr_t)0xbeef000, 512, 1, 0);

	printf("METRICS %s\n", addr);
	fflush(stdout);
	char line[16];
	CHECK(fgets(line, sizeof line, stdin) != NULL, "no go-ahead on stdin");
	tfree(after, MiB, 0, 0);
	tfree(r, 3 * MiB, 1, 0);
	CHECK(allocated(0) == 0 && allocated(1) == 0, "live blocks left");
	CHECK(stat(1, "num_bad_frees") == 1, "device 1's num_bad_frees %lld", stat(1, "num_bad_frees"));
	printf("DONE\n");
	return 0;
}
