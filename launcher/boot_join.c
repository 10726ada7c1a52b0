/* boot_join.c - a rank's munge credential for the boot server, made and checked (boot_join.h). */
#include "boot_join.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef AM_HAVE_MUNGE
#include <munge.h>

#include "slurm_env.h"
#endif

void am_join_payload(const struct am_join_expect *x, int rank, char *out, size_t len)
{
    snprintf(out, len, "am-join job=%llu step=%llu rank=%d server=%s", x->job, x->step, rank, x->server);
}

int am_join_check(const struct am_join_expect *x, const char *payload, size_t len, uid_t uid, char *why,
                  size_t why_len)
{
    unsigned long long job, step;
    int rank, used = 0;
    char server[300];
    if (uid != x->uid) {
        snprintf(why, why_len, "the credential was made by uid %lu, not by the job's user (uid %lu)",
                 (unsigned long)uid, (unsigned long)x->uid);
        return -1;
    }
    if (!payload || strnlen(payload, len) != len || len > 400 ||
        sscanf(payload, "am-join job=%llu step=%llu rank=%d server=%299s%n", &job, &step, &rank, server, &used) != 4 ||
        (size_t)used != len) {
        snprintf(why, why_len, "the credential's payload is not an am-launch join (%zu bytes)", len);
        return -1;
    }
    if (job != x->job || step != x->step) {
        snprintf(why, why_len, "the credential is for step %llu.%llu, not this step %llu.%llu", job, step, x->job,
                 x->step);
        return -1;
    }
    if (strcmp(server, x->server) != 0) {
        snprintf(why, why_len, "the credential is for the boot server %s, not this one (%s)", server, x->server);
        return -1;
    }
    if (rank < 0 || rank >= x->size) {
        snprintf(why, why_len, "the credential names rank %d, but the step has ranks 0 to %d", rank, x->size - 1);
        return -1;
    }
    return rank;
}

#ifdef AM_HAVE_MUNGE
/* munged's socket: AM_MUNGE_SOCKET, else Slurm's AuthInfo socket=, else NULL: libmunge's
 * default. */
static const char *socket_path(void)
{
    static char from_slurm[4096];
    const char *sock = getenv("AM_MUNGE_SOCKET");
    if (sock && *sock)
        return sock;
    if (!from_slurm[0] && !am_slurm_auth_socket(from_slurm, sizeof(from_slurm)))
        return NULL;
    return from_slurm;
}

static munge_ctx_t context(char *err, size_t err_len)
{
    munge_ctx_t ctx = munge_ctx_create();
    const char *sock = socket_path();
    if (!ctx) {
        snprintf(err, err_len, "munge: out of memory");
        return NULL;
    }
    if (sock && *sock && munge_ctx_set(ctx, MUNGE_OPT_SOCKET, sock) != EMUNGE_SUCCESS) {
        snprintf(err, err_len, "munge: cannot use the socket %s: %s", sock, munge_ctx_strerror(ctx));
        munge_ctx_destroy(ctx);
        return NULL;
    }
    return ctx;
}

/* Which munged: for messages. */
static const char *socket_name(void)
{
    const char *sock = socket_path();
    return sock ? sock : "libmunge's default";
}

char *am_join_encode(const char *payload, char *err, size_t err_len)
{
    char *cred = NULL;
    munge_ctx_t ctx = context(err, err_len);
    if (!ctx)
        return NULL;
    munge_err_t rc = munge_encode(&cred, ctx, payload, (int)strlen(payload));
    if (rc != EMUNGE_SUCCESS) {
        snprintf(err, err_len, "munge cannot make a credential (munged's socket: %s; AM_MUNGE_SOCKET sets it): %s",
                 socket_name(), munge_ctx_strerror(ctx));
        free(cred);
        cred = NULL;
    }
    munge_ctx_destroy(ctx);
    return cred;
}

int am_join_verify(const struct am_join_expect *x, const char *cred, char *why, size_t why_len)
{
    void *payload = NULL;
    int len = 0, rank = -1;
    uid_t uid;
    gid_t gid;
    munge_ctx_t ctx = context(why, why_len);
    if (!ctx)
        return -1;
    munge_err_t rc = munge_decode(cred, ctx, &payload, &len, &uid, &gid);
    if (rc == EMUNGE_CRED_REPLAYED)
        snprintf(why, why_len, "the credential was used before (a replay)");
    else if (rc != EMUNGE_SUCCESS)
        snprintf(why, why_len, "munge refused the credential: %s", munge_ctx_strerror(ctx));
    else
        rank = am_join_check(x, payload, (size_t)len, uid, why, why_len);
    free(payload);
    munge_ctx_destroy(ctx);
    return rank;
}
#else
char *am_join_encode(const char *payload, char *err, size_t err_len)
{
    (void)payload;
    snprintf(err, err_len, "this am-launch was built without libmunge (install libmunge-dev and rebuild)");
    return NULL;
}

int am_join_verify(const struct am_join_expect *x, const char *cred, char *why, size_t why_len)
{
    (void)x;
    (void)cred;
    snprintf(why, why_len, "this am-launch was built without libmunge: it admits no rank");
    return -1;
}
#endif
