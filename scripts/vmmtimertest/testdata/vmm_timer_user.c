// Stands in for PyTorch in vmm_timer_test.go: it looks the driver's
// functions up through the runtime it links against, as
// c10/cuda/driver_api.cpp does, and calls cuMemCreate once and cuMemMap
// twice.
#include <stddef.h>

int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags, int *status);

int user_run(void) {
	int (*create)(unsigned long long *, unsigned long, const void *, unsigned long long);
	int (*map)(unsigned long long, unsigned long, unsigned long, unsigned long long, unsigned long long);
	int (*other)(void);
	int status;
	cudaGetDriverEntryPointByVersion("cuMemCreate", (void **)&create, 12050, 0, &status);
	cudaGetDriverEntryPointByVersion("cuMemMap", (void **)&map, 12050, 0, &status);
	cudaGetDriverEntryPointByVersion("cuGetErrorString", (void **)&other, 12050, 0, &status);
	unsigned long long h = 0;
	int r = create(&h, 1, NULL, 0) + map(0, 1, 0, h, 0) + map(0, 1, 0, h, 0);
	return r * 100 + other() + (int)h * 1000; // 7003 when every call went through
}
