/* log.h - the per-rank log: one JSON object per line in <log dir>/<job id>/rank-<R>.jsonl.
 *
 * Records (DESIGN.md, "Per-rank log"): a start record, one record per step, and on failure
 * a cause record followed by the flight recorder; the supervisor (am-launch) appends the
 * exit record to the same file. Each record is written with a single write() to a file
 * opened with O_APPEND, so records of the rank and its supervisor never interleave.
 */
#ifndef AM_LOG_H
#define AM_LOG_H

#include <jansson.h>

struct am_log {
    int fd;
    char path[1100];
};

/* Log directory: explicit dir, else AM_LOG_DIR, else ./am-logs. Creates <dir>/<job id>/. */
int am_log_open(struct am_log *l, const char *dir, const char *job_id, int rank, char *err, size_t err_len);
void am_log_close(struct am_log *l);
/* Writes obj as one line (and releases it). Adds "type" first when given. */
int am_log_record(struct am_log *l, const char *type, json_t *obj);
/* Seconds since the epoch (wall clock) and since an arbitrary start (monotonic). */
double am_wall_time(void);
double am_mono_time(void);
/* the process's CPU time (user and system, all its threads), in seconds */
double am_cpu_time(void);

#endif
