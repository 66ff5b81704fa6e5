//go:build cgo

// lasterror.c: allocd_last_error's storage, one message per OS thread.
// Hidden: nothing here is part of liballocd.so's API.

#include <stdlib.h>
#include <string.h>

#include "lasterror.h"

static __thread char *msg;
static __thread size_t msg_len;

void liballocd_set_error(const char *s, size_t n) {
	char *m = realloc(msg, n + 1);
	if (m == NULL) {
		return; // keep the previous message rather than none
	}
	memcpy(m, s, n);
	m[n] = '\0';
	msg = m;
	msg_len = n;
}

size_t liballocd_get_error(char *buf, size_t n) {
	if (buf != NULL && n > 0) {
		size_t k = msg_len < n - 1 ? msg_len : n - 1;
		if (k > 0) {
			memcpy(buf, msg, k);
		}
		buf[k] = '\0';
	}
	return msg_len;
}
