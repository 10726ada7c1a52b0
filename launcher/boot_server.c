/* boot_server.c - the standalone bootstrap store (boot_server.h). */
#include "boot_server.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    if (!s->info || !s->fence_fd) {
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
    free(s);
}

static int reply(int fd, int status, const void *payload, size_t len)
{
    struct am_boot_rep rep = {.status = status, .len = len};
    if (am_io_write_full(fd, &rep, sizeof(rep)) < 0)
        return -1;
    return am_io_write_full(fd, payload, len);
}

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
    if (am_io_read_full(fd, &req, sizeof(req)) < 0)
        return AM_BOOT_CLOSED;
    if (req.key_len > AM_BOOT_MAX_KEY || req.val_len > AM_BOOT_MAX_VALUE) {
        snprintf(msg, msg_len, "rank %d sent a request with a %u-byte key and a %llu-byte value", rank,
                 req.key_len, (unsigned long long)req.val_len);
        return AM_BOOT_BAD;
    }
    char key[AM_BOOT_MAX_KEY + 1];
    void *value = malloc(req.val_len + 1);
    if (!value || am_io_read_full(fd, key, req.key_len) < 0 || am_io_read_full(fd, value, req.val_len) < 0) {
        free(value);
        return AM_BOOT_CLOSED;
    }
    key[req.key_len] = '\0';
    ((char *)value)[req.val_len] = '\0';

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
        return AM_BOOT_ABORTED;
    default:
        snprintf(msg, msg_len, "rank %d sent unknown request %u", rank, req.op);
        free(value);
        return AM_BOOT_BAD;
    }
    free(value);
    return rc < 0 ? AM_BOOT_CLOSED : AM_BOOT_OK;
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
