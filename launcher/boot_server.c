/* boot_server.c - the standalone bootstrap store (boot_server.h). */
#include "boot_server.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "boot_proto.h"

struct entry {
    int rank;
    char key[AM_BOOT_MAX_KEY + 1];
    void *value;
    size_t len;
};

struct am_boot_server {
    int size;
    struct am_boot_info *info;
    int *fence_fd; /* -1: not waiting in a fence */
    double *fence_deadline; /* CLOCK_MONOTONIC seconds; 0: waits without a timeout */
    double *fence_timeout;
    int n_fenced;
    int dropped; /* a rank that left: no fence can complete any more */
    struct entry *entries;
    size_t n_entries, cap_entries;
};

struct am_boot_server *am_boot_server_new(int size, const struct am_boot_info *info)
{
    struct am_boot_server *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->size = size;
    s->info = malloc((size_t)size * sizeof(*info));
    s->fence_fd = malloc((size_t)size * sizeof(int));
    s->fence_deadline = calloc((size_t)size, sizeof(double));
    s->fence_timeout = calloc((size_t)size, sizeof(double));
    if (!s->info || !s->fence_fd || !s->fence_deadline || !s->fence_timeout) {
        am_boot_server_free(s);
        return NULL;
    }
    memcpy(s->info, info, (size_t)size * sizeof(*info));
    for (int r = 0; r < size; r++)
        s->fence_fd[r] = -1;
    s->dropped = -1;
    return s;
}

void am_boot_server_free(struct am_boot_server *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_entries; i++)
        free(s->entries[i].value);
    free(s->entries);
    free(s->info);
    free(s->fence_fd);
    free(s->fence_deadline);
    free(s->fence_timeout);
    free(s);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int reply(int fd, int status, const void *payload, size_t len) { return am_boot_reply(fd, status, payload, len); }

static int reply_error(int fd, const char *fmt, const char *a, int b)
{
    char text[256];
    snprintf(text, sizeof(text), fmt, a, b);
    return reply(fd, 1, text, strlen(text));
}

static struct entry *find(struct am_boot_server *s, int rank, const char *key)
{
    for (size_t i = 0; i < s->n_entries; i++)
        if (s->entries[i].rank == rank && strcmp(s->entries[i].key, key) == 0)
            return &s->entries[i];
    return NULL;
}

static int put(struct am_boot_server *s, int rank, const char *key, void *value, size_t len)
{
    struct entry *e = find(s, rank, key);
    if (!e) {
        if (s->n_entries == s->cap_entries) {
            size_t cap = s->cap_entries ? 2 * s->cap_entries : 64;
            struct entry *v = realloc(s->entries, cap * sizeof(*v));
            if (!v)
                return -1;
            s->entries = v;
            s->cap_entries = cap;
        }
        e = &s->entries[s->n_entries++];
        e->rank = rank;
        snprintf(e->key, sizeof(e->key), "%s", key);
    } else {
        free(e->value);
    }
    e->value = value;
    e->len = len;
    return 0;
}

static void release_fence(struct am_boot_server *s, int status, const char *why)
{
    for (int r = 0; r < s->size; r++) {
        if (s->fence_fd[r] < 0)
            continue;
        reply(s->fence_fd[r], status, why, why ? strlen(why) : 0);
        s->fence_fd[r] = -1;
    }
    s->n_fenced = 0;
}

enum am_boot_event am_boot_server_serve(struct am_boot_server *s, int rank, int fd, int *status, char *msg,
                                        size_t msg_len)
{
    struct am_boot_req req;
    char key[AM_BOOT_MAX_KEY + 1];
    void *value;
    int got = am_boot_read_request(fd, &req, key, &value);
    if (got == -2) {
        snprintf(msg, msg_len, "rank %d sent a request with a %u-byte key and a %llu-byte value", rank,
                 req.key_len, (unsigned long long)req.val_len);
        return AM_BOOT_BAD;
    }
    if (got < 0)
        return AM_BOOT_CLOSED;

    int rc = 0;
    switch (req.op) {
    case AM_BOOT_HELLO:
        rc = reply(fd, 0, &s->info[rank], sizeof(s->info[rank]));
        break;
    case AM_BOOT_PUT:
        if (put(s, rank, key, value, req.val_len) < 0) {
            rc = reply_error(fd, "launcher out of memory storing '%s' (%d)", key, 0);
            break;
        }
        value = NULL;
        rc = reply(fd, 0, NULL, 0);
        break;
    case AM_BOOT_FENCE:
        if (s->dropped >= 0) {
            rc = reply_error(fd, "rank %2$d exited before reaching this fence%1$s", "", s->dropped);
            break;
        }
        if (s->fence_fd[rank] < 0) {
            s->fence_fd[rank] = fd;
            s->fence_timeout[rank] = req.timeout_s;
            s->fence_deadline[rank] = req.timeout_s > 0 ? now() + req.timeout_s : 0;
            s->n_fenced++;
        }
        if (s->n_fenced == s->size)
            release_fence(s, 0, NULL);
        break;
    case AM_BOOT_GET: {
        struct entry *e = req.rank >= 0 && req.rank < s->size ? find(s, req.rank, key) : NULL;
        if (e)
            rc = reply(fd, 0, e->value, e->len);
        else if (req.rank < 0 || req.rank >= s->size)
            rc = reply_error(fd, "no rank %2$d in this job (key '%1$s')", key, req.rank);
        else
            rc = reply_error(fd, "rank %2$d has published no value for '%1$s'", key, req.rank);
        break;
    }
    case AM_BOOT_ABORT:
        *status = req.rank;
        snprintf(msg, msg_len, "%s", (char *)value);
        free(value);
        reply(fd, 0, NULL, 0);
        return AM_BOOT_ABORTED;
    default:
        snprintf(msg, msg_len, "rank %d sent unknown request %u", rank, req.op);
        free(value);
        return AM_BOOT_BAD;
    }
    free(value);
    return rc < 0 ? AM_BOOT_CLOSED : AM_BOOT_OK;
}

double am_boot_server_deadline(const struct am_boot_server *s)
{
    double first = 0;
    for (int r = 0; r < s->size; r++)
        if (s->fence_fd[r] >= 0 && s->fence_deadline[r] > 0 && (first == 0 || s->fence_deadline[r] < first))
            first = s->fence_deadline[r];
    return first;
}

void am_boot_server_expire(struct am_boot_server *s)
{
    double t = now(), timeout = 0;
    for (int r = 0; r < s->size; r++)
        if (s->fence_fd[r] >= 0 && s->fence_deadline[r] > 0 && s->fence_deadline[r] <= t)
            timeout = s->fence_timeout[r];
    if (timeout == 0)
        return;
    char list[256] = "", why[512];
    int missing = 0;
    for (int r = 0; r < s->size; r++) {
        if (s->fence_fd[r] >= 0)
            continue;
        size_t l = strlen(list);
        if (l < sizeof(list) - 16)
            snprintf(list + l, sizeof(list) - l, "%s%d", missing ? ", " : "", r);
        else if (l < sizeof(list) - 4 && !strstr(list, "..."))
            snprintf(list + l, sizeof(list) - l, ", ...");
        missing++;
    }
    snprintf(why, sizeof(why), "timed out after %g s: %s %s did not reach it (stuck or slow: see %s log)", timeout,
             missing > 1 ? "ranks" : "rank", list, missing > 1 ? "their" : "its");
    release_fence(s, 1, why);
}

void am_boot_server_drop(struct am_boot_server *s, int rank)
{
    if (s->fence_fd[rank] >= 0) {
        s->fence_fd[rank] = -1;
        s->n_fenced--;
    }
    if (s->dropped < 0)
        s->dropped = rank;
    if (s->n_fenced > 0) {
        char why[128];
        snprintf(why, sizeof(why), "rank %d exited before reaching this fence", rank);
        release_fence(s, 1, why);
    }
}
