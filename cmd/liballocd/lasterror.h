// lasterror.h: the per-thread message of allocd_last_error (lasterror.c).
#ifndef LIBALLOCD_LASTERROR_H
#define LIBALLOCD_LASTERROR_H

#include <stddef.h>

#pragma GCC visibility push(hidden)
// liballocd_set_error stores n bytes of s as the calling thread's message.
void liballocd_set_error(const char *s, size_t n);
// liballocd_get_error copies the message into buf (NUL-terminated,
// truncated to n) and returns its full length.
size_t liballocd_get_error(char *buf, size_t n);
#pragma GCC visibility pop

#endif
