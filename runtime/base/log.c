/* log.c - the per-rank JSONL log (log.h). */
#include "log.h"


#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

int am_log_open(struct am_log *l, const char *dir, const char *job_id, int rank, char *err, size_t err_len)
{
    l->fd = -1;
    if (!dir || !*dir)
        dir = getenv("AM_LOG_DIR");
    if (!dir || !*dir)
        dir = "am-logs";
    char d[1024];
    snprintf(d, sizeof(d), "%s/%s", dir, job_id);
    if (am_mkdir_p(d) < 0) {
        snprintf(err, err_len, "log: cannot create %s: %s (set --am-log-dir or AM_LOG_DIR to a writable directory)",
                 d, strerror(errno));
        return -1;
    }
    snprintf(l->path, sizeof(l->path), "%s/rank-%d.jsonl", d, rank);
    l->fd = open(l->path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (l->fd < 0) {
        snprintf(err, err_len, "log: cannot open %s: %s", l->path, strerror(errno));
        return -1;
    }
    return 0;
}

void am_log_close(struct am_log *l)
{
    if (l->fd >= 0)
        close(l->fd);
    l->fd = -1;
}

int am_log_record(struct am_log *l, const char *type, json_t *obj)
{
    int rc = -1;
    json_t *rec = json_object();
    if (type)
        json_object_set_new(rec, "type", json_string(type));
    json_object_update(rec, obj);
    json_decref(obj);
    char *s = json_dumps(rec, JSON_COMPACT | JSON_REAL_PRECISION(16));
    json_decref(rec);
    if (!s || l->fd < 0)
        goto out;
    size_t n = strlen(s);
    s[n] = '\n'; /* json_dumps leaves room for the terminator: reuse it for the newline */
    rc = write(l->fd, s, n + 1) == (ssize_t)(n + 1) ? 0 : -1;
out:
    free(s);
    return rc;
}

double am_wall_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double am_mono_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double am_cpu_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
