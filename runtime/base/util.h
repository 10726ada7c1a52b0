/* util.h - small helpers shared by the recipe library and the runtime: bounded file reads, files
 * and directories (mkdir -p, copies, removal, temporary files and directories written beside
 * a path then renamed over it, the fsync that makes a rename durable), the "unknown key, did
 * you mean ..." message, and the runtime's error convention (am_fail). */
#ifndef AM_UTIL_H
#define AM_UTIL_H

#include <stdbool.h>
#include <stddef.h>

#include "errors.h"

#define AM_JSON_MAX_BYTES (16 * 1024 * 1024)

/* The exit status of a rank that saved a checkpoint on Slurm's warning before the time limit
 * and stopped (train/preempt.h): not a failure; am-launch passes it on as its own status, and
 * the job script requeues the job on it. */
#define AM_EXIT_REQUEUE 85

/* Reads a regular file of at most max bytes into a malloc'd, NUL-terminated buffer.
 * Returns NULL on success, else a short reason ("no such file", "is a directory", ...)
 * that never quotes the file's content. Never blocks on a FIFO or device. */
const char *am_read_file(const char *path, size_t max, char **buf, size_t *len);

/* mkdir -p: creates path and the directories above it (mode 0755). 0, or -1 with errno. */
int am_mkdir_p(const char *path);

/* Copies the regular file `from` to the new file `to` (created with mode, never over an
 * existing one) and fsyncs it. 0, or -1 with errno (a partial `to` may be left: the caller
 * writes into a temporary directory it removes on failure). */
int am_copy_file(const char *from, const char *to, unsigned mode);

/* rm -r: removes path and everything below it, without following links; errors ignored (for
 * temporary directories and what a failed write left). */
void am_remove_tree(const char *path);

/* buf = a + sep + b; -1 (errno ENAMETOOLONG) when it does not fit in len bytes. */
int am_path_cat(char *buf, size_t len, const char *a, const char *sep, const char *b);

/* Creates a new file "PATH.tmp-XXXXXX" (mode 0666 less the umask) beside path, for writing
 * then renaming over path; the name goes to tmp. Returns the descriptor, or -1 with errno. */
int am_open_temp(const char *path, char *tmp, size_t len);

/* Creates a new directory "PATH.tmp-XXXXXX" (mode 0755, readable like any directory) beside
 * path, to fill then rename to path; its name goes to tmp (empty on failure). 0, or -1 after
 * writing the message into err. */
int am_temp_dir(const char *path, char *tmp, size_t len, struct am_errors *err);

/* fsyncs the directory holding `path` (or `path` itself when it is a directory): makes a
 * rename or a new file durable. 0 or -1 with errno set. */
int am_fsync_dir_of(const char *path, bool is_dir);

/* True when key is one of the NULL-terminated names. */
bool am_key_in(const char *key, const char *const *names);

/* "SECTION.KEY: unknown key (did you mean NAME?)": the suggestion is the closest name of
 * either list within a small edit distance; either list may be NULL. */
void am_error_unknown_key(struct am_errors *err, const struct am_pos *pos, const char *section,
                          const char *key, const char *const *known, const char *const *also);

/* Grows *p (an array of *cap elements of elem bytes, realloc'd) to hold at least need
 * elements, doubling from *cap (or `first`). 0, or -1 when memory runs out (*p left as it was). */
int am_grow(void **p, size_t *cap, size_t need, size_t elem, size_t first);

/* Levenshtein distance, capped: returns cap+1 when larger (keys are short). */
int am_edit_distance(const char *a, const char *b, int cap);

/* Errors: two conventions, each for its kind of failure.
 *
 * Runtime failures (a collective that timed out, a kernel's device, a file the trainer cannot
 * write, memory): a function that can fail takes `char *err, size_t err_len` as its last two
 * parameters and returns 0, or -1 after writing ONE message into err that names the
 * operation, the input and the rule broken or the cause:
 *
 *   allreduce #17 on group dp (4 ranks) timed out after 600 s waiting for rank 3 (global 7 on n2)
 *
 * am_fail below writes it and returns the -1. A caller passes its own err down, adds its
 * context where the message lacks it (a message of its own, built around the callee's from
 * a buffer of its own) and returns -1 in turn; the top (the rank program) prints it or puts
 * it in the rank log. Nothing is printed deep inside a library, and no message is kept in a
 * handle for the caller to fetch after the call (the communicators and the bootstrap
 * included: comm.h, bootstrap.h).
 *
 * User input (recipes, --am-* options and overrides, config.json, the checkpoints and
 * datasets a user names, and rank_setup, which gathers those from every rank) uses
 * `struct am_errors` (errors.h) instead: a check appends every problem it finds, each with
 * FILE:LINE:COL (or the option it came from), and goes on, so that the user fixes them all
 * in one round rather than one per submission. */

/* Formats a message into err (err_len bytes) and returns -1: for functions that report their
 * failure in a caller's buffer (above). */
int am_fail(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
