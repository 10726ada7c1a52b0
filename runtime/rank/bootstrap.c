/* bootstrap.c - the rank side of bootstrap.h: requests over the launcher's socket. */
#include "bootstrap.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "boot_proto.h"

struct am_boot {
    int fd;
    struct am_boot_info info;
    char err[512];
};

static int fail(struct am_boot *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(struct am_boot *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->err, sizeof(b->err), fmt, ap);
    va_end(ap);
    return -1;
}

/* Sends one request and reads its reply; the payload (if any) is malloc'd into *out. */
static int call(struct am_boot *b, const char *what, uint32_t op, const char *key, const void *val, size_t val_len,
                int32_t rank, double timeout_s, void **out, size_t *out_len)
{
    size_t key_len = key ? strlen(key) : 0;
    if (key_len > AM_BOOT_MAX_KEY)
        return fail(b, "bootstrap %s: key '%.64s...' is longer than %d bytes", what, key, AM_BOOT_MAX_KEY);
    if (val_len > AM_BOOT_MAX_VALUE)
        return fail(b, "bootstrap %s: value of %zu bytes is larger than %d", what, val_len, AM_BOOT_MAX_VALUE);
    struct am_boot_req req = {.op = op, .key_len = (uint32_t)key_len, .val_len = val_len, .rank = rank,
                              .timeout_s = timeout_s};
    if (am_io_write_full(b->fd, &req, sizeof(req)) < 0 || am_io_write_full(b->fd, key, key_len) < 0 ||
        am_io_write_full(b->fd, val, val_len) < 0)
        return fail(b, "bootstrap %s: the launcher is gone (%s)", what, strerror(errno));
    struct am_boot_rep rep;
    if (am_io_read_full(b->fd, &rep, sizeof(rep)) < 0)
        return fail(b, "bootstrap %s: the launcher closed the connection (it is stopping the job)", what);
    size_t max = op == AM_BOOT_ALLGATHER ? (size_t)b->info.size * val_len : 0;
    if (rep.len > (max > AM_BOOT_MAX_VALUE ? max : AM_BOOT_MAX_VALUE) + 4096)
        return fail(b, "bootstrap %s: reply of %llu bytes is too large", what, (unsigned long long)rep.len);
    char *payload = malloc(rep.len + 1);
    if (!payload)
        return fail(b, "bootstrap %s: out of memory", what);
    if (am_io_read_full(b->fd, payload, rep.len) < 0) {
        free(payload);
        return fail(b, "bootstrap %s: the launcher closed the connection", what);
    }
    payload[rep.len] = '\0';
    if (rep.status != 0) {
        fail(b, "bootstrap %s: %s", what, payload);
        free(payload);
        return -1;
    }
    if (out) {
        *out = payload;
        *out_len = rep.len;
    } else {
        free(payload);
    }
    return 0;
}

struct am_boot *am_boot_init(struct am_boot_info *info, char *err, size_t err_len)
{
    const char *fd_env = getenv("AM_BOOTSTRAP_FD");
    char *end;
    long fd = fd_env ? strtol(fd_env, &end, 10) : -1;
    if (!fd_env || !*fd_env || *end || fd < 0 || fd > 1 << 20 || fcntl((int)fd, F_GETFD) < 0) {
        snprintf(err, err_len, "no launcher: AM_BOOTSTRAP_FD is %s; start rank programs with am-launch "
                 "(`am-launch --nproc N RECIPE` on one machine, `srun --mpi=pmix am-launch RECIPE` under Slurm)",
                 fd_env ? "not an open descriptor" : "not set");
        return NULL;
    }
    return am_boot_connect((int)fd, info, err, err_len);
}

struct am_boot *am_boot_connect(int fd, struct am_boot_info *info, char *err, size_t err_len)
{
    struct am_boot *b = calloc(1, sizeof(*b));
    if (!b) {
        snprintf(err, err_len, "bootstrap: out of memory");
        return NULL;
    }
    b->fd = fd;
    void *p;
    size_t len;
    if (call(b, "hello", AM_BOOT_HELLO, NULL, NULL, 0, 0, 0, &p, &len) < 0 || len != sizeof(*info)) {
        snprintf(err, err_len, "%s", b->err[0] ? b->err : "bootstrap hello: malformed reply");
        if (!b->err[0])
            free(p);
        free(b);
        return NULL;
    }
    memcpy(&b->info, p, sizeof(b->info));
    free(p);
    *info = b->info;
    return b;
}

void am_boot_fini(struct am_boot *b)
{
    if (!b)
        return;
    close(b->fd);
    free(b);
}

/* The end of every public call: on -1, its message (b->err) goes to the caller's err. */
static int result(const struct am_boot *b, int rc, char *err, size_t err_len)
{
    if (rc < 0 && err && err_len)
        snprintf(err, err_len, "%s", b->err);
    return rc;
}

static int put(struct am_boot *b, const char *key, const void *value, size_t len)
{
    return call(b, "put", AM_BOOT_PUT, key, value, len, 0, 0, NULL, NULL);
}

static int fence(struct am_boot *b, double timeout_s)
{
    return call(b, "fence", AM_BOOT_FENCE, NULL, NULL, 0, 0, timeout_s, NULL, NULL);
}

static int get(struct am_boot *b, int rank, const char *key, void **value, size_t *len, double timeout_s)
{
    return call(b, "get", AM_BOOT_GET, key, NULL, 0, rank, timeout_s, value, len);
}

static int allgather(struct am_boot *b, const char *key, const void *mine, size_t len, void *all, double timeout_s)
{
    void *v;
    size_t n;
    if (call(b, "allgather", AM_BOOT_ALLGATHER, key, mine, len, 0, timeout_s, &v, &n) < 0)
        return -1;
    if (n != (size_t)b->info.size * len) { /* the launcher checks every rank's length */
        free(v);
        return fail(b, "bootstrap allgather '%s': %zu bytes came back, not %d ranks x %zu", key, n, b->info.size, len);
    }
    memcpy(all, v, n);
    free(v);
    return 0;
}

int am_boot_put(struct am_boot *b, const char *key, const void *value, size_t len, char *err, size_t err_len)
{
    return result(b, put(b, key, value, len), err, err_len);
}

int am_boot_fence(struct am_boot *b, double timeout_s, char *err, size_t err_len)
{
    return result(b, fence(b, timeout_s), err, err_len);
}

int am_boot_get(struct am_boot *b, int rank, const char *key, void **value, size_t *len, double timeout_s,
                char *err, size_t err_len)
{
    return result(b, get(b, rank, key, value, len, timeout_s), err, err_len);
}

int am_boot_allgather(struct am_boot *b, const char *key, const void *mine, size_t len, void *all, double timeout_s,
                      char *err, size_t err_len)
{
    return result(b, allgather(b, key, mine, len, all, timeout_s), err, err_len);
}

void am_boot_abort(struct am_boot *b, int status, const char *msg)
{
    call(b, "abort", AM_BOOT_ABORT, NULL, msg, msg ? strlen(msg) : 0, status, 0, NULL, NULL);
    _exit(status ? status : 1);
}
