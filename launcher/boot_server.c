/* boot_server.c - the standalone bootstrap store (boot_server.h). */
#include "boot_server.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "boot_proto.h"

/* One key's values, indexed by rank (a job publishes a few keys, each from every rank). */
struct slot {
    char key[AM_BOOT_MAX_KEY + 1];
    void **value; /* [size]; NULL: not published */
    size_t *len;
};

struct am_boot_server {
    int size;
    struct am_boot_info *info;
    int *fence_fd; /* -1: not waiting in a fence */
    double *fence_deadline; /* CLOCK_MONOTONIC seconds; 0: waits without a timeout */
    double *fence_timeout;
    int *fence_slot; /* an allgather's key (slot index); -1: a plain fence */
    int n_fenced;
    int dropped; /* a rank that left: no fence can complete any more */
    struct slot *slots;
    size_t n_slots, cap_slots;
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
    s->fence_slot = malloc((size_t)size * sizeof(int));
    if (!s->info || !s->fence_fd || !s->fence_deadline || !s->fence_timeout || !s->fence_slot) {
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
    for (size_t i = 0; i < s->n_slots; i++) {
        for (int r = 0; r < s->size; r++)
            free(s->slots[i].value[r]);
        free(s->slots[i].value);
        free(s->slots[i].len);
    }
    free(s->slots);
    free(s->info);
    free(s->fence_fd);
    free(s->fence_slot);
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

/* The slot of key, made when `make` (-1: not there, or out of memory). */
static int slot_of(struct am_boot_server *s, const char *key, bool make)
{
    for (size_t i = 0; i < s->n_slots; i++)
        if (strcmp(s->slots[i].key, key) == 0)
            return (int)i;
    if (!make)
        return -1;
    if (s->n_slots == s->cap_slots) {
        size_t cap = s->cap_slots ? 2 * s->cap_slots : 8;
        struct slot *v = realloc(s->slots, cap * sizeof(*v));
        if (!v)
            return -1;
        s->slots = v;
        s->cap_slots = cap;
    }
    struct slot *sl = &s->slots[s->n_slots];
    sl->value = calloc((size_t)s->size, sizeof(void *));
    sl->len = calloc((size_t)s->size, sizeof(size_t));
    if (!sl->value || !sl->len) {
        free(sl->value);
        free(sl->len);
        return -1;
    }
    snprintf(sl->key, sizeof(sl->key), "%s", key);
    return (int)s->n_slots++;
}

static int put(struct am_boot_server *s, int rank, const char *key, void *value, size_t len)
{
    int k = slot_of(s, key, true);
    if (k < 0)
        return -1;
    free(s->slots[k].value[rank]);
    s->slots[k].value[rank] = value;
    s->slots[k].len[rank] = len;
    return 0;
}

/* The answer of an allgather of slot k: every rank's value in rank order (malloc'd), or
 * NULL with the reason in why (a rank's value missing or of another length). */
static char *gathered(const struct am_boot_server *s, int k, size_t *len, char *why, size_t why_len)
{
    const struct slot *sl = &s->slots[k];
    size_t each = sl->len[0];
    for (int r = 0; r < s->size; r++) {
        if (!sl->value[r]) {
            snprintf(why, why_len, "allgather '%s': rank %d sent no value (it waits in a plain fence)", sl->key, r);
            return NULL;
        }
        if (sl->len[r] != each) {
            snprintf(why, why_len, "allgather '%s': rank %d sent %zu bytes, rank 0 %zu (every rank sends as many)",
                     sl->key, r, sl->len[r], each);
            return NULL;
        }
    }
    char *all = malloc((size_t)s->size * each + 1);
    if (!all) {
        snprintf(why, why_len, "allgather '%s': the launcher is out of memory for %d x %zu bytes", sl->key, s->size,
                 each);
        return NULL;
    }
    for (int r = 0; r < s->size; r++)
        memcpy(all + (size_t)r * each, sl->value[r], each);
    *len = (size_t)s->size * each;
    return all;
}

/* Answers every rank waiting in the fence: status and why, or (status 0) nothing for a plain
 * fence and the gathered values for an allgather (each key's built once). */
static void release_fence(struct am_boot_server *s, int status, const char *why)
{
    int built = -1;
    char *all = NULL, err[256];
    size_t len = 0;
    for (int r = 0; r < s->size; r++) {
        int fd = s->fence_fd[r], k = s->fence_slot[r];
        if (fd < 0)
            continue;
        s->fence_fd[r] = -1;
        if (status != 0 || k < 0) {
            reply(fd, status, why, why ? strlen(why) : 0);
            continue;
        }
        if (k != built) {
            free(all);
            all = gathered(s, k, &len, err, sizeof(err));
            built = k;
        }
        if (all)
            reply(fd, 0, all, len);
        else
            reply(fd, 1, err, strlen(err));
    }
    free(all);
    s->n_fenced = 0;
}

/* rank waits in the fence (k: its allgather's slot, -1: a plain fence), released with the
 * last rank's arrival. */
static int wait_fence(struct am_boot_server *s, int rank, int fd, int k, double timeout_s)
{
    if (s->dropped >= 0)
        return reply_error(fd, "rank %2$d exited before reaching this fence%1$s", "", s->dropped);
    if (s->fence_fd[rank] < 0) {
        s->fence_fd[rank] = fd;
        s->fence_slot[rank] = k;
        s->fence_timeout[rank] = timeout_s;
        s->fence_deadline[rank] = timeout_s > 0 ? now() + timeout_s : 0;
        s->n_fenced++;
    }
    if (s->n_fenced == s->size)
        release_fence(s, 0, NULL);
    return 0;
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
        rc = wait_fence(s, rank, fd, -1, req.timeout_s);
        break;
    case AM_BOOT_ALLGATHER: {
        if (put(s, rank, key, value, req.val_len) < 0) {
            rc = reply_error(fd, "launcher out of memory storing '%s' (%d)", key, 0);
            break;
        }
        value = NULL;
        rc = wait_fence(s, rank, fd, slot_of(s, key, false), req.timeout_s);
        break;
    }
    case AM_BOOT_GET: {
        int k = req.rank >= 0 && req.rank < s->size ? slot_of(s, key, false) : -1;
        if (k >= 0 && s->slots[k].value[req.rank])
            rc = reply(fd, 0, s->slots[k].value[req.rank], s->slots[k].len[req.rank]);
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
