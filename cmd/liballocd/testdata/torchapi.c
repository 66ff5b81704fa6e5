// torchapi.c: checks the exports allocd_torch's CUDAAllocator answers torch's
// own APIs with, from a separate process: allocd_device_stats (c10's
// DeviceStats as 122 values), allocd_reset_accumulated_stats,
// allocd_memory_fraction, allocd_largest_free_block, allocd_snapshot_flat
// (its layout, a buffer too small), and allocd_torch_free with device -1
// (the CUDAAllocator keeps no map of its pointers). TestTorchAPI
// (lib_test.go) runs it with ALLOCD_DEVICE=sim:2 and ALLOCD_SIM_CAPACITY=1GiB.
//
// Usage: torchapi LIB. A failed check prints "FAIL ..." on stderr and exits
// 1; success prints "DONE".
#define _GNU_SOURCE
#include "harness.h"

#define NSTATS 122
// Indexes into allocd_device_stats' values: array a (0 allocation ... 8
// requested_bytes), pool p (0 all, 1 small, 2 large), field f (0 current,
// 1 peak, 2 allocated, 3 freed).
#define STAT(a, p, f) ((a) * 12 + (p) * 4 + (f))
#define ALLOCATION 0
#define SEGMENT 1
#define ALLOCATED_BYTES 4
#define RESERVED_BYTES 5
#define REQUESTED_BYTES 8
#define NUM_DEVICE_ALLOC 119
#define MAX_SPLIT_SIZE 121

static long long (*device_stats)(int, long long *, size_t);
static int (*reset_accumulated)(int);
static double (*memory_fraction)(int);
static void (*set_fraction)(double, int);
static long long (*largest_free)(int);
static long long (*snapshot_flat)(int, long long *, size_t);

static long long v[NSTATS];

static void read_stats(int dev) {
	memset(v, 0xff, sizeof v);
	long long n = device_stats(dev, v, NSTATS);
	CHECK(n == NSTATS, "allocd_device_stats returned %lld: %s", n, err());
}

int main(int argc, char **argv) {
	CHECK(argc == 2, "usage: torchapi LIB");
	lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	CHECK(lib != NULL, "dlopen: %s", dlerror());
	*(void **)&last_error = sym("allocd_last_error");
	*(void **)&tmalloc = sym("allocd_torch_malloc");
	*(void **)&tfree = sym("allocd_torch_free");
	*(void **)&stats_json = sym("allocd_memory_stats_json");
	*(void **)&device_stats = sym("allocd_device_stats");
	*(void **)&reset_accumulated = sym("allocd_reset_accumulated_stats");
	*(void **)&memory_fraction = sym("allocd_memory_fraction");
	*(void **)&set_fraction = sym("allocd_torch_set_memory_fraction");
	*(void **)&largest_free = sym("allocd_largest_free_block");
	*(void **)&snapshot_flat = sym("allocd_snapshot_flat");

	// 1. A device not created: zeros, max_split_size as PyTorch reports it
	// unset (-1), fraction 1, largest free block 0.
	read_stats(1);
	CHECK(v[STAT(ALLOCATED_BYTES, 0, 0)] == 0 && v[STAT(SEGMENT, 0, 2)] == 0, "device 1 not created has stats");
	CHECK(memory_fraction(1) == 1.0, "fraction %g of a device not created, want 1", memory_fraction(1));
	CHECK(largest_free(1) == 0, "largest free %lld of a device not created", largest_free(1));
	// A buffer too small is left alone; the count comes back.
	long long small[4] = {7, 7, 7, 7};
	CHECK(device_stats(0, small, 4) == NSTATS && small[0] == 7, "a short buffer was written");

	// 2. Stats follow malloc and free, in c10's layout, and agree with the
	// JSON view.
	void *a = tmalloc(3 * MiB, 0, (stream_t)0);
	CHECK(a != NULL, "%s", err());
	void *b = tmalloc(1000, 0, (stream_t)0);
	CHECK(b != NULL, "%s", err());
	read_stats(0);
	CHECK(v[STAT(ALLOCATION, 0, 0)] == 2, "allocation.all.current %lld, want 2", v[STAT(ALLOCATION, 0, 0)]);
	CHECK(v[STAT(ALLOCATION, 1, 0)] == 1 && v[STAT(ALLOCATION, 2, 0)] == 1, "allocations by pool %lld small, %lld large",
	      v[STAT(ALLOCATION, 1, 0)], v[STAT(ALLOCATION, 2, 0)]);
	CHECK(v[STAT(ALLOCATED_BYTES, 0, 0)] == (long long)(3 * MiB + 1024), "allocated_bytes.all.current %lld",
	      v[STAT(ALLOCATED_BYTES, 0, 0)]);
	CHECK(v[STAT(REQUESTED_BYTES, 0, 0)] == (long long)(3 * MiB + 1000), "requested_bytes.all.current %lld",
	      v[STAT(REQUESTED_BYTES, 0, 0)]);
	CHECK(v[STAT(RESERVED_BYTES, 0, 0)] == stat(0, "reserved_bytes.all.current"), "reserved %lld, JSON says %lld",
	      v[STAT(RESERVED_BYTES, 0, 0)], stat(0, "reserved_bytes.all.current"));
	CHECK(v[NUM_DEVICE_ALLOC] == stat(0, "num_device_alloc") && v[NUM_DEVICE_ALLOC] == 2, "num_device_alloc %lld",
	      v[NUM_DEVICE_ALLOC]);
	CHECK(v[MAX_SPLIT_SIZE] == stat(0, "max_split_size"), "max_split_size %lld", v[MAX_SPLIT_SIZE]);
	printf("device_stats: 2 live blocks in c10's layout\n");

	// 3. A free with device -1 finds the block's device.
	tfree(a, 0, -1, NULL);
	read_stats(0);
	CHECK(v[STAT(ALLOCATION, 0, 0)] == 1 && v[STAT(ALLOCATION, 0, 3)] == 1, "after a free of unknown device: current %lld, freed %lld",
	      v[STAT(ALLOCATION, 0, 0)], v[STAT(ALLOCATION, 0, 3)]);
	CHECK(stat(0, "num_bad_frees") == 0, "num_bad_frees %lld", stat(0, "num_bad_frees"));
	CHECK(largest_free(0) >= (long long)(3 * MiB), "largest free block %lld, want the freed 3 MiB's", largest_free(0));
	printf("free with device -1: applied on device 0\n");

	// 4. reset_accumulated: allocated/freed and num_* from zero, currents and
	// peaks kept; the JSON view agrees.
	long long peak = v[STAT(ALLOCATED_BYTES, 0, 1)];
	CHECK(reset_accumulated(0) == 0, "%s", err());
	read_stats(0);
	CHECK(v[STAT(ALLOCATION, 0, 2)] == 0 && v[STAT(ALLOCATION, 0, 3)] == 0, "after reset: allocated %lld, freed %lld",
	      v[STAT(ALLOCATION, 0, 2)], v[STAT(ALLOCATION, 0, 3)]);
	CHECK(v[NUM_DEVICE_ALLOC] == 0, "num_device_alloc %lld after reset", v[NUM_DEVICE_ALLOC]);
	CHECK(v[STAT(ALLOCATION, 0, 0)] == 1, "current %lld after reset, want 1", v[STAT(ALLOCATION, 0, 0)]);
	CHECK(v[STAT(ALLOCATED_BYTES, 0, 1)] == peak, "peak %lld after reset, want %lld", v[STAT(ALLOCATED_BYTES, 0, 1)], peak);
	CHECK(stat(0, "allocation.all.allocated") == 0, "JSON allocation.all.allocated %lld after reset",
	      stat(0, "allocation.all.allocated"));
	void *c = tmalloc(4096, 0, (stream_t)0);
	CHECK(c != NULL, "%s", err());
	read_stats(0);
	CHECK(v[STAT(ALLOCATION, 0, 2)] == 1, "allocated %lld after one malloc since reset", v[STAT(ALLOCATION, 0, 2)]);
	CHECK(reset_accumulated(200) == -1 && strstr(err(), "device 200") != NULL, "device 200: %s", err());
	printf("reset_accumulated: totals from zero, currents and peaks kept\n");

	// 5. The memory fraction set is the one read.
	set_fraction(0.25, 0);
	CHECK(memory_fraction(0) == 0.25, "fraction %g, want 0.25", memory_fraction(0));

	// 6. The snapshot's layout: header, then segments with their blocks.
	long long need = snapshot_flat(0, NULL, 0);
	CHECK(need > 3, "snapshot_flat(NULL) returned %lld: %s", need, err());
	long long *s = calloc((size_t)need, sizeof *s);
	CHECK(snapshot_flat(0, s, (size_t)need) == need, "snapshot size changed");
	CHECK(s[0] == 2, "format %lld, want 2", s[0]);
	CHECK(s[2] == 0, "%lld traces without traces asked for", s[2]);
	long long nseg = s[1], pos = 3, live = 0, bytes = 0;
	for (long long i = 0; i < nseg; i++) {
		long long *sg = s + pos;
		CHECK(sg[0] == 0, "segment %lld on device %lld", i, sg[0]);
		CHECK(sg[9] == 0 && sg[10] == 0, "segment %lld in pool (%lld, %lld), want the general cache", i, sg[9], sg[10]);
		long long nb = sg[11], addr = sg[1], total = 0;
		pos += 12;
		for (long long j = 0; j < nb; j++, pos += 4) {
			CHECK(s[pos] == addr + total, "block %lld of segment %lld at %#llx, want %#llx (blocks tile the segment)", j, i,
			      s[pos], addr + total);
			CHECK(s[pos + 3] >= 0 && s[pos + 3] <= 2, "block state %lld", s[pos + 3]);
			total += s[pos + 1];
			if (s[pos + 3] == 1) {
				live++;
				bytes += s[pos + 1];
			}
		}
		CHECK(total == sg[2], "segment %lld: blocks cover %lld of %lld bytes", i, total, sg[2]);
	}
	CHECK(pos == need, "layout: %lld values read of %lld", pos, need);
	CHECK(live == 2 && bytes == 1024 + 4096, "%lld live blocks of %lld bytes, want b and c", live, bytes);
	free(s);
	// With traces: one (empty) trace per device created so far.
	need = snapshot_flat(1, NULL, 0);
	s = calloc((size_t)need, sizeof *s);
	CHECK(snapshot_flat(1, s, (size_t)need) == need, "snapshot size changed");
	CHECK(s[2] >= 1, "%lld device traces", s[2]);
	free(s);
	printf("snapshot_flat: %lld segments, blocks tile them\n", nseg);

	tfree(b, 1000, 0, NULL);
	tfree(c, 4096, -1, NULL);
	read_stats(0);
	CHECK(v[STAT(ALLOCATION, 0, 0)] == 0, "allocation.all.current %lld at the end", v[STAT(ALLOCATION, 0, 0)]);
	printf("DONE\n");
	return 0;
}
