/* errors.h - a list of user-facing messages, collected rather than printed.
 *
 * Every check in the recipe library appends to a list instead of stopping at the first
 * problem, so a user sees all of them at once. A message names where the value came from
 * (FILE:LINE:COL for a recipe value, the option text for an override), the key, the rule,
 * and what would be valid:
 *
 *   llama.yaml:12:12: distributed.ep_size: 6 does not divide dp_size*cp_size = 4 (use 1, 2 or 4)
 *
 * The list never fails: when memory runs out it keeps what it has and sets `truncated`.
 * It is for user input only; runtime failures use one message in a caller's buffer (util.h).
 */
#ifndef AM_ERRORS_H
#define AM_ERRORS_H

#include <stddef.h>

/* Where a value came from. `origin`, when set, names an override (for example
 * "--set distributed.tp_size=6" or "--am-tp=6") and wins over file:line:col. A line of 0
 * means "somewhere in the file" (a default, or a key that is missing). */
struct am_pos {
    const char *file;
    const char *origin;
    int line, col;
};

struct am_errors {
    char **msg;
    size_t n, cap;
    int truncated;
};

#define AM_ERRORS_MAX 256 /* more than this is noise; the rest are counted, not kept */

void am_errors_init(struct am_errors *e);
void am_errors_free(struct am_errors *e);

/* Appends "POS: " + the formatted text. pos may be NULL (no prefix). */
void am_errorf(struct am_errors *e, const struct am_pos *pos, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Appends the formatted text (no position) and returns -1: for functions that fail with it. */
int am_errors_fail(struct am_errors *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Writes "POS: " into buf (empty for a NULL pos). */
void am_pos_format(const struct am_pos *pos, char *buf, size_t len);

#endif
