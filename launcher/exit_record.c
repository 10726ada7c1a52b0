/* exit_record.c - exit records, the OOM counter and the log directory (exit_record.h). */
#include "exit_record.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sigrelay.h"
#include "util.h"

/* ---- the memory cgroup's oom_kill counter ---------------------------------------------- */

/* This process's cgroup path for the v1 memory controller (v1 = 1) or the v2 hierarchy. */
static int cgroup_path(int v1, char *out, size_t len)
{
    FILE *f = fopen("/proc/self/cgroup", "re");
    char line[4096];
    int found = -1;
    if (!f)
        return -1;
    while (found < 0 && fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c2 = '\0';
        const char *controllers = c1 + 1, *path = c2 + 1;
        int match = 0;
        if (v1) {
            char list[256];
            snprintf(list, sizeof(list), "%s", controllers);
            for (char *save, *t = strtok_r(list, ",", &save); t; t = strtok_r(NULL, ",", &save))
                match |= strcmp(t, "memory") == 0;
        } else {
            match = c1 - line == 1 && line[0] == '0' && controllers[0] == '\0';
        }
        if (match) {
            snprintf(out, len, "%s", path);
            found = 0;
        }
    }
    fclose(f);
    return found;
}

/* The mount point (and the cgroup root it shows) of the v1 memory hierarchy or of cgroup2. */
static int cgroup_mount(int v1, char *mnt, size_t mnt_len, char *root, size_t root_len)
{
    FILE *f = fopen("/proc/self/mountinfo", "re");
    char line[4096];
    int found = -1;
    if (!f)
        return -1;
    while (found < 0 && fgets(line, sizeof(line), f)) {
        char r[2048], m[2048], fstype[64], superopts[1024];
        char *dash = strstr(line, " - ");
        if (!dash || sscanf(line, "%*s %*s %*s %2047s %2047s", r, m) != 2 ||
            sscanf(dash + 3, "%63s %*s %1023s", fstype, superopts) != 2)
            continue;
        int match = v1 ? strcmp(fstype, "cgroup") == 0 && strstr(superopts, "memory") != NULL
                       : strcmp(fstype, "cgroup2") == 0;
        if (match) {
            snprintf(mnt, mnt_len, "%s", m);
            snprintf(root, root_len, "%s", r);
            found = 0;
        }
    }
    fclose(f);
    return found;
}

static long read_oom_kill(const char *path)
{
    FILE *f = fopen(path, "re");
    char line[256];
    long v = -1;
    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "oom_kill %ld", &v) == 1)
            break;
    fclose(f);
    return v;
}

void am_oom_watch_start(struct am_oom_watch *w)
{
    w->path[0] = '\0';
    w->before = -1;
    for (int v1 = 1; v1 >= 0; v1--) {
        char cg[2048], mnt[2048], root[2048], file[PATH_MAX + 64];
        if (cgroup_path(v1, cg, sizeof(cg)) < 0 || cgroup_mount(v1, mnt, sizeof(mnt), root, sizeof(root)) < 0)
            continue;
        const char *rel = cg;
        size_t rl = strlen(root);
        if (strcmp(root, "/") != 0 && strncmp(cg, root, rl) == 0)
            rel = cg + rl;
        snprintf(file, sizeof(file), "%s%s/%s", mnt, strcmp(rel, "/") == 0 ? "" : rel,
                 v1 ? "memory.oom_control" : "memory.events");
        long n = read_oom_kill(file);
        if (n >= 0 && strlen(file) < sizeof(w->path)) {
            snprintf(w->path, sizeof(w->path), "%s", file);
            w->before = n;
            return;
        }
    }
}

int am_oom_watch_killed(const struct am_oom_watch *w, int status)
{
    if (!w->path[0])
        return -1;
    long after = read_oom_kill(w->path);
    if (after < 0)
        return -1;
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL && after > w->before;
}

/* ---- describing an exit ---------------------------------------------------------------- */

int am_exit_code(int status)
{
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return 1;
}

int am_exit_failed(int status) { return am_exit_code(status) != 0 && am_exit_code(status) != AM_EXIT_REQUEUE; }

void am_exit_describe(const struct am_exit *e, char *buf, size_t len)
{
    char name[32];
    if (WIFEXITED(e->status)) {
        snprintf(buf, len, "rank %d on %s exited with status %d", e->rank, e->host, WEXITSTATUS(e->status));
    } else if (WIFSIGNALED(e->status)) {
        int sig = WTERMSIG(e->status);
        if (e->oom_killed == 1)
            snprintf(buf, len, "rank %d on %s was killed by the OOM killer (signal %d, %s): it ran out of memory",
                     e->rank, e->host, sig, am_signal_name(sig, name, sizeof(name)));
        else
            snprintf(buf, len, "rank %d on %s was killed by signal %d (%s, %s)%s", e->rank, e->host, sig,
                     am_signal_name(sig, name, sizeof(name)), strsignal(sig),
                     WCOREDUMP(e->status) ? ", core dumped" : "");
    } else {
        snprintf(buf, len, "rank %d on %s ended with wait status 0x%x", e->rank, e->host, (unsigned)e->status);
    }
}

/* ---- the log directory and the record -------------------------------------------------- */

static int mkdir_p(char *path)
{
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        int rc = mkdir(path, 0755);
        *p = '/';
        if (rc < 0 && errno != EEXIST)
            return -1;
    }
    if (mkdir(path, 0755) < 0 && errno != EEXIST)
        return -1;
    struct stat st;
    if (stat(path, &st) < 0)
        return -1;
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
}

int am_log_dir_prepare(const char *option, const char *job_id, char *out, size_t out_len, char *err,
                       size_t err_len)
{
    const char *env = getenv("AM_LOG_DIR");
    const char *dir = option && *option ? option : env && *env ? env : "am-logs";
    const char *from = option && *option ? "--log-dir" : env && *env ? "AM_LOG_DIR" : "the default";
    char cwd[PATH_MAX], path[PATH_MAX + 128];
    if (dir[0] != '/' && !getcwd(cwd, sizeof(cwd))) {
        snprintf(err, err_len, "log directory %s (%s): cannot tell the current directory: %s", dir, from,
                 strerror(errno));
        return -1;
    }
    int n = dir[0] == '/' ? snprintf(out, out_len, "%s", dir) : snprintf(out, out_len, "%s/%s", cwd, dir);
    if (n < 0 || (size_t)n >= out_len) {
        snprintf(err, err_len, "log directory %s (%s): path too long", dir, from);
        return -1;
    }
    while (n > 1 && out[n - 1] == '/')
        out[--n] = '\0';
    snprintf(path, sizeof(path), "%s/%s", out, job_id);
    if (mkdir_p(path) < 0) {
        snprintf(err, err_len, "cannot create the log directory %s (%s): %s; set --log-dir or AM_LOG_DIR to a "
                 "writable directory", path, from, strerror(errno));
        return -1;
    }
    return 0;
}

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Appends o (released) as one line, in one write(), to <log_dir>/<job_id>/rank-<rank>.jsonl. */
static int append_record(const char *log_dir, const char *job_id, int rank, const char *what, json_t *o, char *err,
                         size_t err_len)
{
    char path[PATH_MAX + 128];
    char *text = o ? json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(16)) : NULL;
    json_decref(o);
    int rc = -1, fd = -1;
    size_t len = text ? strlen(text) : 0;
    char *line = text ? realloc(text, len + 2) : NULL;
    if (!line) {
        free(text);
        snprintf(err, err_len, "%s record of rank %d: out of memory", what, rank);
        return -1;
    }
    line[len] = '\n';
    line[len + 1] = '\0';
    snprintf(path, sizeof(path), "%s/%s/rank-%d.jsonl", log_dir, job_id, rank);
    fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, err_len, "cannot write the %s record of rank %d to %s: %s", what, rank, path, strerror(errno));
        goto out;
    }
    ssize_t w = write(fd, line, len + 1);
    if (w != (ssize_t)(len + 1)) {
        snprintf(err, err_len, "cannot write the %s record of rank %d to %s: %s", what, rank, path,
                 w < 0 ? strerror(errno) : "short write");
        goto out;
    }
    rc = 0;
out:
    if (fd >= 0)
        close(fd);
    free(line);
    return rc;
}

int am_exit_record(const char *log_dir, const char *job_id, const struct am_exit *e, char *err, size_t err_len)
{
    char name[32];
    int sig = WIFSIGNALED(e->status) ? WTERMSIG(e->status) : 0;
    json_t *o = json_pack("{s:s,s:i,s:s,s:I,s:i,s:i}", "type", "exit", "rank", e->rank, "host", e->host, "pid",
                          (json_int_t)e->pid, "status", am_exit_code(e->status), "signal", sig);
    if (o) {
        json_object_set_new(o, "signal_name", sig ? json_string(am_signal_name(sig, name, sizeof(name))) : json_null());
        json_object_set_new(o, "core_dumped", json_boolean(sig && WCOREDUMP(e->status)));
        json_object_set_new(o, "oom_killed", e->oom_killed < 0 ? json_null() : json_boolean(e->oom_killed));
        json_object_set_new(o, "stop_signal", e->stop_signal ? json_string(am_signal_name(e->stop_signal, name,
                                                                                          sizeof(name)))
                                                             : json_null());
        json_object_set_new(o, "time", json_real(wall_now()));
    }
    return append_record(log_dir, job_id, e->rank, "exit", o, err, err_len);
}

int am_stop_record(const char *log_dir, const char *job_id, const struct am_stop *s, char *err, size_t err_len)
{
    char name[32];
    json_t *o = json_pack("{s:s,s:i,s:s,s:s,s:s}", "type", "stop", "rank", s->rank, "host", s->host, "signal",
                          am_signal_name(s->signal, name, sizeof(name)), "by", s->by);
    if (o) {
        json_object_set_new(o, "because_rank", s->because_rank >= 0 ? json_integer(s->because_rank) : json_null());
        json_object_set_new(o, "because_host", s->because_host ? json_string(s->because_host) : json_null());
        json_object_set_new(o, "because", s->because ? json_string(s->because) : json_null());
        json_object_set_new(o, "because_time", s->because_time > 0 ? json_real(s->because_time) : json_null());
        json_object_set_new(o, "time", json_real(wall_now()));
    }
    return append_record(log_dir, job_id, s->rank, "stop", o, err, err_len);
}

int am_failure_mark(const char *log_dir, const char *job_id, int rank, int status, const char *host,
                    const char *what)
{
    char path[PATH_MAX + 128], tmp[PATH_MAX + 160];
    snprintf(path, sizeof(path), "%s/%s/first-failure.json", log_dir, job_id);
    snprintf(tmp, sizeof(tmp), "%s/%s/.first-failure.%d.%d", log_dir, job_id, rank, (int)getpid());
    json_t *o = json_pack("{s:i,s:i,s:s,s:s,s:f}", "rank", rank, "status", status, "host", host, "what", what, "time",
                          wall_now());
    char *text = o ? json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(16)) : NULL;
    json_decref(o);
    if (!text) {
        errno = ENOMEM;
        return -1;
    }
    /* written whole under a private name, then linked to the shared one: link() fails when
     * the name exists (another supervisor was first) and never shows a half-written file */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        free(text);
        return -1;
    }
    size_t len = strlen(text);
    text[len] = '\n'; /* json_dumps leaves room for the terminator */
    ssize_t w = write(fd, text, len + 1);
    close(fd);
    free(text);
    int rc = w == (ssize_t)(len + 1) ? link(tmp, path) : -1;
    int saved = errno;
    unlink(tmp);
    if (rc == 0)
        return 1;
    errno = saved;
    return errno == EEXIST ? 0 : -1;
}

int am_failure_read(const char *log_dir, const char *job_id, int *rank, int *status, char *host, size_t host_len,
                    char *what, size_t what_len, double *time)
{
    char path[PATH_MAX + 128];
    snprintf(path, sizeof(path), "%s/%s/first-failure.json", log_dir, job_id);
    json_error_t je;
    json_t *o = json_load_file(path, 0, &je);
    json_t *r = json_object_get(o, "rank");
    if (!json_is_integer(r)) {
        json_decref(o);
        return -1;
    }
    *rank = (int)json_integer_value(r);
    *status = (int)json_integer_value(json_object_get(o, "status"));
    const char *h = json_string_value(json_object_get(o, "host")), *w = json_string_value(json_object_get(o, "what"));
    snprintf(host, host_len, "%s", h ? h : "");
    snprintf(what, what_len, "%s", w ? w : "");
    *time = json_number_value(json_object_get(o, "time"));
    json_decref(o);
    return 0;
}

int am_log_has_exit(const char *log_dir, const char *job_id, int rank)
{
    char path[PATH_MAX + 128], tail[4097];
    snprintf(path, sizeof(path), "%s/%s/rank-%d.jsonl", log_dir, job_id, rank);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    struct stat st;
    ssize_t n = -1;
    if (fstat(fd, &st) == 0 && st.st_size > 0) {
        off_t at = st.st_size > 4096 ? st.st_size - 4096 : 0;
        n = pread(fd, tail, (size_t)(st.st_size - at), at);
    }
    close(fd);
    if (n <= 1 || tail[n - 1] != '\n')
        return 0;
    tail[n - 1] = '\0';
    const char *last = strrchr(tail, '\n');
    last = last ? last + 1 : tail;
    static const char exit_prefix[] = "{\"type\":\"exit\"";
    return strncmp(last, exit_prefix, sizeof(exit_prefix) - 1) == 0;
}
