/* util.h - small helpers shared by the recipe library: bounded file reads and the
 * "unknown key, did you mean ..." message. */
#ifndef AM_UTIL_H
#define AM_UTIL_H

#include <stdbool.h>
#include <stddef.h>

#include "errors.h"

#define AM_JSON_MAX_BYTES (16 * 1024 * 1024)

/* Reads a regular file of at most max bytes into a malloc'd, NUL-terminated buffer.
 * Returns NULL on success, else a short reason ("no such file", "is a directory", ...)
 * that never quotes the file's content. Never blocks on a FIFO or device. */
const char *am_read_file(const char *path, size_t max, char **buf, size_t *len);

/* mkdir -p: creates path and the directories above it (mode 0755). 0, or -1 with errno. */
int am_mkdir_p(const char *path);

/* True when key is one of the NULL-terminated names. */
bool am_key_in(const char *key, const char *const *names);

/* "SECTION.KEY: unknown key (did you mean NAME?)": the suggestion is the closest name of
 * either list within a small edit distance; either list may be NULL. */
void am_error_unknown_key(struct am_errors *err, const struct am_pos *pos, const char *section,
                          const char *key, const char *const *known, const char *const *also);

/* Levenshtein distance, capped: returns cap+1 when larger (keys are short). */
int am_edit_distance(const char *a, const char *b, int cap);

/* Formats a message into err (err_len bytes) and returns -1: for functions that report their
 * failure in a caller's buffer. */
int am_fail(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
