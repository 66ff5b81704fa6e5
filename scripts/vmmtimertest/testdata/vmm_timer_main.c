// The process in vmm_timer_test.go: it loads vmm_timer.so (argv[1]) into
// the global scope first, as paired_replays.py --vmm-timer does before
// torch; then, with a third argument, that library (the runtime) into the
// global scope too, as torch loads its CUDA libraries; then the user
// library (argv[2]), whose runtime comes after the timer in either scope.
// It runs it and prints what the timer counted: the result, the hooked
// lookups, then the five calls' counts and their nanoseconds.
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
	if (argc != 3 && argc != 4) {
		return 2;
	}
	void *timer = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
	if (timer != NULL && argc == 4 && dlopen(argv[3], RTLD_NOW | RTLD_GLOBAL) == NULL) {
		timer = NULL;
	}
	void *user = timer ? dlopen(argv[2], RTLD_NOW | RTLD_LOCAL) : NULL;
	if (user == NULL) {
		fprintf(stderr, "%s\n", dlerror());
		return 1;
	}
	int (*run)(void) = (int (*)(void))dlsym(user, "user_run");
	void (*read)(long long *) = (void (*)(long long *))dlsym(timer, "vmm_timer_read");
	int (*hooked)(void) = (int (*)(void))dlsym(timer, "vmm_timer_hooked");
	if (!run || !read || !hooked) {
		return 1;
	}
	int r = run();
	long long out[10];
	read(out);
	printf("%d %d", r, hooked());
	for (int i = 0; i < 10; i++) {
		printf(" %lld", out[i]);
	}
	printf("\n");
	return 0;
}
