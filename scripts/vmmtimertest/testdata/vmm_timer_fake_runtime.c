// A stand-in for the CUDA runtime in vmm_timer_test.go: its
// cudaGetDriverEntryPointByVersion hands out functions that take a known
// time (cuMemCreate 1 ms, cuMemMap 2 ms) and a third, for any other
// symbol, that returns 3 at once.
#include <string.h>
#include <unistd.h>

static int create(unsigned long long *h, unsigned long size, const void *prop, unsigned long long flags) {
	(void)size, (void)prop, (void)flags;
	usleep(1000);
	*h = 7;
	return 0;
}

static int map(unsigned long long ptr, unsigned long size, unsigned long offset, unsigned long long h, unsigned long long flags) {
	(void)ptr, (void)size, (void)offset, (void)h, (void)flags;
	usleep(2000);
	return 0;
}

static int other(void) { return 3; }

int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags, int *status) {
	(void)version, (void)flags;
	if (strcmp(symbol, "cuMemCreate") == 0) {
		*fn = (void *)create;
	} else if (strcmp(symbol, "cuMemMap") == 0) {
		*fn = (void *)map;
	} else {
		*fn = (void *)other;
	}
	if (status != NULL) {
		*status = 0;
	}
	return 0;
}
