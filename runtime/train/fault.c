/* fault.c - AM_FAULT: parsing and the misbehaviours (fault.h). */
#include "fault.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define KINDS "segv, abort, exit:CODE, nan, hang, hang-in-collective, slow:SECONDS, kill, oom, device-oom, " \
              "kill-in-alltoall, expert-rows-oom or kill-in-save:PHASE"
#define SAVE_PHASES "shard, written, manifest, commit or latest"
#define FORM "AM_FAULT=rank=R,step=S,kind=K"

const char *am_fault_kind_name(enum am_fault_kind kind)
{
    switch (kind) {
    case AM_FAULT_NONE: return "none";
    case AM_FAULT_SEGV: return "segv";
    case AM_FAULT_ABORT: return "abort";
    case AM_FAULT_EXIT: return "exit";
    case AM_FAULT_NAN: return "nan";
    case AM_FAULT_HANG: return "hang";
    case AM_FAULT_HANG_IN_COLLECTIVE: return "hang-in-collective";
    case AM_FAULT_SLOW: return "slow";
    case AM_FAULT_KILL: return "kill";
    case AM_FAULT_OOM: return "oom";
    case AM_FAULT_DEVICE_OOM: return "device-oom";
    case AM_FAULT_KILL_IN_ALLTOALL: return "kill-in-alltoall";
    case AM_FAULT_KILL_IN_SAVE: return "kill-in-save";
    case AM_FAULT_EXPERT_ROWS_OOM: return "expert-rows-oom";
    }
    return "none";
}

/* A whole number in [lo, hi]; the whole text must be the number. */
static int whole(const char *s, long lo, long hi, long *out)
{
    char *end;
    if (!*s || *s == '+' || *s == ' ')
        return -1;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static int parse_kind(const char *v, struct am_fault *f, const char *spec, char *err, size_t err_len)
{
    static const struct {
        const char *name;
        enum am_fault_kind kind;
    } plain[] = {{"segv", AM_FAULT_SEGV}, {"abort", AM_FAULT_ABORT}, {"nan", AM_FAULT_NAN}, {"hang", AM_FAULT_HANG},
                 {"hang-in-collective", AM_FAULT_HANG_IN_COLLECTIVE}, {"kill", AM_FAULT_KILL}, {"oom", AM_FAULT_OOM},
                 {"device-oom", AM_FAULT_DEVICE_OOM}, {"kill-in-alltoall", AM_FAULT_KILL_IN_ALLTOALL},
                 {"expert-rows-oom", AM_FAULT_EXPERT_ROWS_OOM}};
    for (size_t i = 0; i < sizeof(plain) / sizeof(plain[0]); i++)
        if (strcmp(v, plain[i].name) == 0) {
            f->kind = plain[i].kind;
            return 0;
        }
    if (strcmp(v, "exit") == 0 || strncmp(v, "exit:", 5) == 0) {
        long code;
        if (v[4] != ':' || whole(v + 5, 0, 255, &code) < 0) {
            snprintf(err, err_len, "AM_FAULT=%s: kind=%s: the exit code must be a whole number from 0 to 255 "
                     "(for example kind=exit:3)", spec, v);
            return -1;
        }
        f->kind = AM_FAULT_EXIT;
        f->code = (int)code;
        return 0;
    }
    if (strcmp(v, "slow") == 0 || strncmp(v, "slow:", 5) == 0) {
        char *end;
        errno = 0;
        double s = v[4] == ':' && v[5] ? strtod(v + 5, &end) : -1;
        if (v[4] != ':' || !v[5] || errno || *end || !(s > 0) || s > 1e6) {
            snprintf(err, err_len, "AM_FAULT=%s: kind=%s: the delay must be a positive number of seconds, at most "
                     "1000000 (for example kind=slow:2.5)", spec, v);
            return -1;
        }
        f->kind = AM_FAULT_SLOW;
        f->seconds = s;
        return 0;
    }
    if (strcmp(v, "kill-in-save") == 0 || strncmp(v, "kill-in-save:", 13) == 0) {
        static const char *const phases[] = {"shard", "written", "manifest", "commit", "latest"}; /* fault.h's order */
        for (int i = 0; v[12] == ':' && i < (int)(sizeof(phases) / sizeof(phases[0])); i++)
            if (strcmp(v + 13, phases[i]) == 0) {
                f->kind = AM_FAULT_KILL_IN_SAVE;
                f->code = i;
                return 0;
            }
        snprintf(err, err_len, "AM_FAULT=%s: kind=%s: the phase of the save must be one of " SAVE_PHASES
                 " (for example kind=kill-in-save:shard)", spec, v);
        return -1;
    }
    snprintf(err, err_len, "AM_FAULT=%s: kind=%s: unknown kind (use " KINDS ")", spec, v);
    return -1;
}

static int parse(const char *spec, struct am_fault *f, char *err, size_t err_len);

int am_fault_parse(const char *spec, struct am_fault *f, char *err, size_t err_len)
{
    int rc = parse(spec, f, err, err_len);
    if (rc < 0)
        f->kind = AM_FAULT_NONE; /* nothing half-parsed is ever injected */
    return rc;
}

static int parse(const char *spec, struct am_fault *f, char *err, size_t err_len)
{
    memset(f, 0, sizeof(*f));
    f->kind = AM_FAULT_NONE;
    if (!spec || !*spec)
        return 0;
    char text[sizeof(f->spec)];
    const char *shown = spec;
    if (strlen(spec) >= sizeof(text)) {
        snprintf(err, err_len, "AM_FAULT: %zu characters is too long for " FORM " (at most %zu)", strlen(spec),
                 sizeof(text) - 1);
        return -1;
    }
    snprintf(text, sizeof(text), "%s", spec);
    snprintf(f->spec, sizeof(f->spec), "%s", spec);
    int have_rank = 0, have_step = 0, have_kind = 0;
    char *save = NULL;
    for (char *item = strtok_r(text, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq || eq == item) {
            snprintf(err, err_len, "AM_FAULT=%s: '%s' is not key=value (" FORM ")", shown, item);
            return -1;
        }
        *eq = '\0';
        const char *key = item, *v = eq + 1;
        int *seen = strcmp(key, "rank") == 0 ? &have_rank : strcmp(key, "step") == 0 ? &have_step
                  : strcmp(key, "kind") == 0 ? &have_kind : NULL;
        if (!seen) {
            snprintf(err, err_len, "AM_FAULT=%s: %s: unknown key (the keys are rank, step and kind: " FORM ")", shown,
                     key);
            return -1;
        }
        if (*seen) {
            snprintf(err, err_len, "AM_FAULT=%s: %s is given twice (give each of rank, step and kind once)", shown, key);
            return -1;
        }
        *seen = 1;
        long n;
        if (seen == &have_rank) {
            if (whole(v, 0, 1 << 24, &n) < 0) {
                snprintf(err, err_len, "AM_FAULT=%s: rank=%s: the rank must be a whole number from 0 (the global rank "
                         "that misbehaves, for example rank=1)", shown, v);
                return -1;
            }
            f->rank = (int)n;
        } else if (seen == &have_step) {
            if (whole(v, 1, 1L << 40, &n) < 0) {
                snprintf(err, err_len, "AM_FAULT=%s: step=%s: the step must be a whole number from 1 (the 1-based "
                         "training step at which the rank misbehaves, for example step=3)", shown, v);
                return -1;
            }
            f->step = n;
        } else if (parse_kind(v, f, shown, err, err_len) < 0) {
            return -1;
        }
    }
    const char *missing = !have_rank ? "rank" : !have_step ? "step" : !have_kind ? "kind" : NULL;
    if (missing) {
        snprintf(err, err_len, "AM_FAULT=%s: %s is missing (" FORM "; kinds: " KINDS ")", shown, missing);
        return -1;
    }
    return 0;
}

int am_fault_check(const struct am_fault *f, int world, int dp, char *err, size_t err_len)
{
    if (f->kind == AM_FAULT_NONE)
        return 0;
    if (f->rank >= world) {
        snprintf(err, err_len, "AM_FAULT=%s: rank %d is not a rank of this job (ranks 0 to %d)", f->spec, f->rank,
                 world - 1);
        return -1;
    }
    if (f->kind == AM_FAULT_HANG_IN_COLLECTIVE && dp < 2) {
        snprintf(err, err_len, "AM_FAULT=%s: kind=hang-in-collective blocks the gradient all-reduce, and this job "
                 "has none (dp 1): run 2 or more data-parallel ranks, or use kind=hang", f->spec);
        return -1;
    }
    if (f->kind == AM_FAULT_KILL_IN_SAVE && f->code >= 2 && f->rank != 0) {
        snprintf(err, err_len, "AM_FAULT=%s: rank 0 alone writes the manifest, renames the checkpoint and updates "
                 "`latest`: use rank=0 for those phases, or the phases shard and written on rank %d", f->spec, f->rank);
        return -1;
    }
    return 0;
}

int am_fault_check_ep(const struct am_fault *f, int ep, char *err, size_t err_len)
{
    if (f->kind == AM_FAULT_KILL_IN_ALLTOALL && ep < 2) {
        snprintf(err, err_len, "AM_FAULT=%s: kind=kill-in-alltoall dies in the experts' all-to-all, and this job "
                 "has none (ep 1): run a mixture-of-experts model with ep_size 2 or more, or use kind=kill", f->spec);
        return -1;
    }
    if (f->kind == AM_FAULT_EXPERT_ROWS_OOM && ep < 2) {
        snprintf(err, err_len, "AM_FAULT=%s: kind=expert-rows-oom fails the growth of the rows this rank's experts "
                 "receive from their ep group, and this job has none (ep 1): run a mixture-of-experts model with "
                 "ep_size 2 or more, or use kind=device-oom", f->spec);
        return -1;
    }
    return 0;
}

int am_fault_due(const struct am_fault *f, int rank, long step, enum am_fault_kind kind)
{
    return f->kind == kind && f->rank == rank && f->step == step;
}

/* ---- the misbehaviours -------------------------------------------------------------------- */

void am_fault_segv(void)
{
    volatile uintptr_t addr = 0x10;
    *(volatile int *)addr = 1;
    abort(); /* not reached */
}

void am_fault_abort(void)
{
    abort();
}

void am_fault_exit(int code)
{
    exit(code);
}

void am_fault_kill(void)
{
    kill(getpid(), SIGKILL);
    for (;;)
        pause();
}

void am_fault_oom(void)
{
    /* be the OOM killer's choice in a cgroup shared with the other ranks */
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        (void)!write(fd, "1000", 4);
        close(fd);
    }
    const size_t chunk = 16u << 20;
    void *volatile held = NULL; /* every chunk stays reachable */
    for (;;) {
        volatile char *p = malloc(chunk);
        if (!p) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        for (size_t i = sizeof(void *); i < chunk; i += 4096)
            p[i] = 1; /* touch every page: the memory is really used */
        *(void *volatile *)p = held;
        held = (void *)p;
    }
}

void am_fault_hang(void)
{
    for (;;)
        pause();
}

void am_fault_sleep(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - floor(seconds)) * 1e9)};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}
