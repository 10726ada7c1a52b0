/* diag.c - am-diag's analysis: how each rank ended, the first failure, verdicts, mismatches
 * (diag.h). */
#include "diag.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- small helpers ----------------------------------------------------------------------- */

static const char *str(const json_t *o, const char *key)
{
    return json_string_value(json_object_get(o, key));
}

static double num(const json_t *o, const char *key)
{
    const json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : 0;
}

static long integer(const json_t *o, const char *key, long def)
{
    const json_t *v = json_object_get(o, key);
    return json_is_integer(v) && json_integer_value(v) >= INT_MIN && json_integer_value(v) <= INT_MAX
               ? (long)json_integer_value(v) : def;
}

/* A wall-clock time: finite, after 1970 and before the year 10000; else 0 (unknown). */
static double time_of(const json_t *o, const char *key)
{
    double t = num(o, key);
    return isfinite(t) && t > 0 && t < 253402300800.0 ? t : 0;
}

/* A duration in seconds: finite and below 10^9; else 0. */
static double seconds_of(const json_t *o, const char *key)
{
    double s = num(o, key);
    return isfinite(s) && fabs(s) < 1e9 ? s : 0;
}

/* A rank of the job named in a log (0 <= rank < world), else -1. */
static int rank_in(const struct am_diag *d, long long v) { return v >= 0 && v < d->world ? (int)v : -1; }

static int streq(const char *a, const char *b) { return a && b && strcmp(a, b) == 0; }

static int is_crash_signal(const char *s)
{
    return streq(s, "SIGSEGV") || streq(s, "SIGBUS") || streq(s, "SIGFPE") || streq(s, "SIGILL") || streq(s, "SIGABRT");
}

/* Appends to a fixed buffer; a cut never splits a UTF-8 character. */
static void vadd(char *buf, size_t len, const char *fmt, va_list ap)
{
    size_t at = strlen(buf);
    if (at + 1 >= len)
        return;
    if (vsnprintf(buf + at, len - at, fmt, ap) >= (int)(len - at))
        am_diag_utf8_trim(buf);
}

static void add(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void add(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vadd(buf, len, fmt, ap);
    va_end(ap);
}

/* Writes a fixed buffer (as snprintf, cut on a character boundary). */
static void set(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set(char *buf, size_t len, const char *fmt, ...)
{
    va_list ap;
    buf[0] = '\0';
    va_start(ap, fmt);
    vadd(buf, len, fmt, ap);
    va_end(ap);
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

static const struct am_diag_gref *gref_of(const struct am_diag *d, int gid)
{
    int lo = 0, hi = d->n_gref - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (d->gref[mid].gid == gid)
            return &d->gref[mid];
        if (d->gref[mid].gid < gid)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

static const struct am_diag_group *group_of(const struct am_diag *d, int gid)
{
    const struct am_diag_gref *g = gref_of(d, gid);
    return g ? g->g : NULL;
}

/* Membership of a group known by its id; unknown groups hold every rank. */
static int in_group(const struct am_diag *d, int gid, int rank)
{
    const struct am_diag_gref *g = gref_of(d, gid);
    if (!g)
        return 1;
    return g->sorted && bsearch(&rank, g->sorted, (size_t)g->g->n, sizeof(int), cmp_int) != NULL;
}

static int is_state(const struct am_diag_flight *f, const char *state) { return strcmp(f->state, state) == 0; }

static int is_collective(const struct am_diag_flight *f)
{
    return strcmp(f->op, "send") != 0 && strcmp(f->op, "recv") != 0 && strcmp(f->op, "isend") != 0 &&
           strcmp(f->op, "stream_wait") != 0;
}

/* A non-blocking collective (iallreduce, ...): its entry is written when it is posted and may
 * be waited for after later calls completed. */
static int is_nonblocking(const struct am_diag_flight *f)
{
    return f->op[0] == 'i' && strcmp(f->op, "isend") != 0;
}

/* The call in flight when the rank's log ended: the oldest of the calls at the end of its
 * flight recorder that did not complete (isends and non-blocking collectives still posted in
 * the background passed over); else the oldest non-blocking collective that the rank was
 * waiting for (started, not completed: a gradient reduction waited for after the calls of
 * the backward that completed meanwhile); NULL when nothing was in flight. */
static const struct am_diag_flight *in_flight(const struct am_diag_rank *r)
{
    const struct am_diag_flight *in = NULL;
    for (size_t i = r->n_flight; i > 0; i--) {
        if (strcmp(r->flight[i - 1].state, "posted") == 0)
            continue;
        if (strcmp(r->flight[i - 1].state, "completed") == 0)
            break;
        in = &r->flight[i - 1];
    }
    for (size_t i = r->n_flight; !in && i > 0; i--) {
        const struct am_diag_flight *f = &r->flight[i - 1];
        if (is_nonblocking(f) && strcmp(f->state, "posted") != 0 && strcmp(f->state, "completed") != 0)
            in = f;
    }
    for (size_t i = r->n_flight; in && is_nonblocking(in) && i > 0; i--) {
        const struct am_diag_flight *f = &r->flight[i - 1];
        if (is_nonblocking(f) && strcmp(f->state, "posted") != 0 && strcmp(f->state, "completed") != 0)
            in = f; /* the oldest one waited for */
    }
    return in;
}

/* The rank's entry for collective #seq of group gid, or NULL. */
static const struct am_diag_flight *find_call(const struct am_diag_rank *r, int gid, uint64_t seq)
{
    for (size_t i = 0; i < r->n_flight; i++)
        if (r->flight[i].gid == gid && r->flight[i].seq == seq && is_collective(&r->flight[i]))
            return &r->flight[i];
    return NULL;
}

/* The highest collective sequence number of group gid in the rank's recorder (0: none). */
static uint64_t last_seq(const struct am_diag_rank *r, int gid)
{
    uint64_t s = 0;
    for (size_t i = 0; i < r->n_flight; i++)
        if (r->flight[i].gid == gid && is_collective(&r->flight[i]) && r->flight[i].seq > s)
            s = r->flight[i].seq;
    return s;
}

static long last_step(const struct am_diag_rank *r) { return r->last_step; }

/* When the rank last made progress: the end of its last completed call, or its last step. */
static double last_progress(const struct am_diag_rank *r)
{
    double t = r->start_time > r->last_step_time ? r->start_time : r->last_step_time;
    for (size_t i = 0; i < r->n_flight; i++)
        if (is_state(&r->flight[i], "completed") && r->flight[i].ended > t)
            t = r->flight[i].ended;
    return t;
}


/* ---- 1. how each rank ended --------------------------------------------------------------------- */

static void classify(const struct am_diag *d, struct am_diag_rank *r)
{
    const json_t *c = r->cause, *e = r->exit;
    long done = last_step(r);
    int completed_all = r->max_steps > 0 && done >= r->max_steps;
    r->status = e ? (int)integer(e, "status", -1) : -1;
    r->in = in_flight(r);
    r->progress = last_progress(r);
    r->waiting_for = r->in ? r->in->waiting_for : -1;
    if (r->in) {
        double since = r->in->started > 0 ? r->in->started : r->in->enqueued;
        r->waited_s = since > 0 ? r->last_time - since : 0;
    }
    if (c) {
        const char *kind = str(c, "cause");
        r->fail_time = time_of(c, "time");
        if (streq(kind, "signal")) {
            set(r->signal, sizeof(r->signal), "%s", str(c, "signal_name") ? str(c, "signal_name") : "");
            r->end = is_crash_signal(r->signal) ? AM_END_FAILED : AM_END_STOPPED;
            r->kind = r->end == AM_END_FAILED ? "signal" : "stopped";
        } else if (streq(kind, "timeout") || streq(kind, "comm")) {
            r->end = AM_END_WAITING;
            r->kind = streq(kind, "timeout") ? "timeout" : "comm";
            const json_t *w = json_object_get(c, "waiting_for");
            r->waiting_for = json_is_integer(w) ? rank_in(d, json_integer_value(w)) : -1;
            if (json_is_number(json_object_get(c, "waited_s")))
                r->waited_s = seconds_of(c, "waited_s");
        } else if (streq(kind, "nonfinite")) {
            r->end = AM_END_FAILED;
            r->kind = "nonfinite";
        } else if (streq(kind, "oom") || streq(kind, "cuda") || streq(kind, "nccl")) {
            r->end = AM_END_FAILED; /* the rank's device or its NCCL communicator failed */
            r->kind = streq(kind, "oom") ? "oom" : streq(kind, "cuda") ? "cuda" : "nccl";
        } else {
            r->end = AM_END_FAILED;
            r->kind = "error";
        }
        r->step = integer(c, "step", 0) > 0 ? integer(c, "step", 0) : 0;
    } else if (e) {
        const char *sig = str(e, "signal_name");
        const json_t *stop = json_object_get(e, "stop_signal"), *oom = json_object_get(e, "oom_killed");
        r->fail_time = time_of(e, "time");
        set(r->signal, sizeof(r->signal), "%s", sig ? sig : "");
        if (r->status == 0) {
            r->end = completed_all || r->max_steps <= 0 ? AM_END_CLEAN : AM_END_FAILED;
            r->kind = r->end == AM_END_CLEAN ? NULL : "exit";
        } else if (json_is_string(stop) || r->stop) {
            r->end = AM_END_STOPPED;
            r->kind = "stopped";
            if (!sig)
                set(r->signal, sizeof(r->signal), "%s", json_is_string(stop) ? json_string_value(stop) : "");
        } else if (json_is_true(oom)) {
            r->end = AM_END_FAILED;
            r->kind = "oom";
        } else if (streq(sig, "SIGKILL")) {
            r->end = AM_END_FAILED;
            r->kind = "killed";
        } else if (sig) {
            r->end = AM_END_FAILED;
            r->kind = "signal";
        } else {
            r->end = AM_END_FAILED;
            r->kind = "exit";
        }
    } else if (completed_all) {
        r->end = AM_END_CLEAN;
    } else {
        r->end = r->stop ? AM_END_STOPPED : AM_END_UNKNOWN;
        r->kind = r->stop ? "stopped" : "unknown";
        r->fail_time = r->last_time;
        if (r->stop)
            set(r->signal, sizeof(r->signal), "%s", str(r->stop, "signal") ? str(r->stop, "signal") : "");
    }
    if (r->step == 0 && r->end != AM_END_CLEAN && (done > 0 || r->n_flight > 0))
        r->step = r->max_steps > 0 && done >= r->max_steps ? done : done + 1;
}

/* ---- 2. the first failure ------------------------------------------------------------------------ */

const char *am_diag_bytes_text(double n, int decimals, char *buf, size_t len)
{
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (n < 1024) {
        snprintf(buf, len, "%.0f B", n);
        return buf;
    }
    int u = -1;
    while (n >= 1024 && u < 5) {
        n /= 1024;
        u++;
    }
    snprintf(buf, len, "%.*f %s", decimals, n, units[u]);
    return buf;
}

/* Where a device failure happened, from its cause record: " in the backward of layer 31",
 * " in the forward of the head", " in the optimizer step", ... ("" when not said). */
static void where_text(const json_t *c, char *buf, size_t len)
{
    const char *phase = str(c, "phase"), *part = str(c, "part");
    const json_t *layer = json_object_get(c, "layer");
    buf[0] = '\0';
    if (streq(phase, "forward") || streq(phase, "backward")) {
        if (json_is_integer(layer))
            snprintf(buf, len, " in the %s of layer %lld", phase, (long long)json_integer_value(layer));
        else
            snprintf(buf, len, " in the %s of the %s", phase, part ? part : "model");
    } else if (streq(phase, "optimizer")) {
        snprintf(buf, len, " in the optimizer step");
    } else if (streq(phase, "grad_sync")) {
        snprintf(buf, len, " in the gradient synchronisation");
    } else if (streq(phase, "setup")) {
        snprintf(buf, len, " while setting up (before the first step)");
    }
}

static void describe_failure(const struct am_diag_rank *r, char *buf, size_t len)
{
    const json_t *c = r->cause;
    buf[0] = '\0';
    if (streq(r->kind, "signal") && c) {
        const char *code = str(c, "code_name"), *addr = str(c, "addr");
        add(buf, len, "%s", r->signal);
        if (code)
            add(buf, len, " (%s)", code);
        if (addr)
            add(buf, len, " at address %s", addr);
        const char *from = str(c, "from");
        if (streq(from, "self"))
            add(buf, len, ", raised by the rank itself");
    } else if (streq(r->kind, "signal")) {
        add(buf, len, "killed by %s (no cause record: the rank could not write one)", r->signal);
    } else if (streq(r->kind, "nonfinite")) {
        const json_t *l = json_object_get(c, "loss"), *g = json_object_get(c, "grad_norm");
        char ls[32], gs[32];
        set(ls, sizeof(ls), "%s", json_is_string(l) ? json_string_value(l) : "");
        if (json_is_number(l))
            set(ls, sizeof(ls), "%g", json_number_value(l));
        set(gs, sizeof(gs), "%s", json_is_string(g) ? json_string_value(g) : "");
        if (json_is_number(g))
            set(gs, sizeof(gs), "%g", json_number_value(g));
        add(buf, len, "non-finite %s loss or gradient norm (loss %s, grad norm %s); first non-finite gradient: %s",
            str(c, "origin") ? str(c, "origin") : "", ls, gs, str(c, "tensor") ? str(c, "tensor") : "?");
    } else if (streq(r->kind, "oom") && c) {
        /* "rank 12 ran out of GPU memory in the backward of layer 31: 41.0 GiB in use, plan
         * 38.2 GiB (asked for 2.0 GiB; the allocator holds 41.5 GiB of the device's 141.0 GiB)" */
        char where[96], used[32], plan[32], asked[32], held[32], total[32];
        const char *dev = str(c, "device");
        where_text(c, where, sizeof(where));
        add(buf, len, "rank %d ran out of %s memory%s: %s in use", r->rank,
            streq(dev, "cuda") ? "GPU" : streq(dev, "cpu") ? "host (CPU device)" : "device", where,
            am_diag_bytes_text(num(c, "bytes_in_use"), 1, used, sizeof(used)));
        if (num(c, "plan_bytes") > 0)
            add(buf, len, ", plan %s", am_diag_bytes_text(num(c, "plan_bytes"), 1, plan, sizeof(plan)));
        add(buf, len, " (asked for %s; the allocator holds %s",
            am_diag_bytes_text(num(c, "bytes_asked"), 1, asked, sizeof(asked)),
            am_diag_bytes_text(num(c, "bytes_held"), 1, held, sizeof(held)));
        if (num(c, "bytes_total") > 0)
            add(buf, len, " of the device's %s", am_diag_bytes_text(num(c, "bytes_total"), 1, total, sizeof(total)));
        add(buf, len, ")");
    } else if (streq(r->kind, "cuda")) {
        char where[96];
        where_text(c, where, sizeof(where));
        add(buf, len, "rank %d's GPU failed%s: %s", r->rank, where, str(c, "message") ? str(c, "message") : "?");
    } else if (streq(r->kind, "nccl")) {
        const char *op = str(c, "op"), *group = str(c, "group");
        if (op && group)
            add(buf, len, "NCCL failed in %s #%lld of group %s: %s", op, (long long)integer(c, "seq", 0), group,
                str(c, "message") ? str(c, "message") : "?");
        else /* before any call: making the communicators */
            add(buf, len, "NCCL failed: %s", str(c, "message") ? str(c, "message") : "?");
    } else if (streq(r->kind, "error")) {
        add(buf, len, "%s", str(c, "message") ? str(c, "message") : "(no message)");
    } else if (streq(r->kind, "exit") && r->status == 0) {
        add(buf, len, "exited with status 0 after step %ld of %ld, without a cause record", last_step(r), r->max_steps);
    } else if (streq(r->kind, "exit")) {
        add(buf, len, "exited with status %d without a cause record", r->status);
    } else if (streq(r->kind, "killed")) {
        add(buf, len, "killed by SIGKILL, not by its supervisor nor the OOM killer (another process or a user)");
    } else if (streq(r->kind, "oom")) {
        add(buf, len, "killed by the kernel's OOM killer (SIGKILL): it ran out of memory");
    } else {
        add(buf, len, "%s", r->kind ? r->kind : "unknown");
    }
}

static int cmp_vote(const void *a, const void *b)
{
    const struct am_diag_vote *x = a, *y = b;
    if (x->rank != y->rank)
        return (x->rank > y->rank) - (x->rank < y->rank);
    if (x->gid != y->gid)
        return (x->gid > y->gid) - (x->gid < y->gid);
    return (x->seq > y->seq) - (x->seq < y->seq);
}

/* The votes: for each (rank, collective) the number of ranks whose call in flight at their
 * end was that collective, waiting for that rank. Sorted, so one lookup is a binary search. */
static void count_votes(struct am_diag *d)
{
    d->votes = calloc((size_t)d->n_ranks + 1, sizeof(*d->votes));
    if (!d->votes)
        return;
    int n = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        if (r->in && r->waiting_for >= 0)
            d->votes[n++] = (struct am_diag_vote){.rank = r->waiting_for, .gid = r->in->gid, .seq = r->in->seq, .n = 1};
    }
    qsort(d->votes, (size_t)n, sizeof(*d->votes), cmp_vote);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m > 0 && cmp_vote(&d->votes[m - 1], &d->votes[i]) == 0)
            d->votes[m - 1].n++;
        else
            d->votes[m++] = d->votes[i];
    }
    d->n_votes = m;
}

static int waited_for_count(const struct am_diag *d, int rank, int gid, uint64_t seq)
{
    struct am_diag_vote key = {.rank = rank, .gid = gid, .seq = seq};
    const struct am_diag_vote *v = d->n_votes ? bsearch(&key, d->votes, (size_t)d->n_votes, sizeof(key), cmp_vote)
                                              : NULL;
    return v ? v->n : 0;
}

/* Every member of the group (every rank without one) ran NCCL. */
static int nccl_group(const struct am_diag *d, const struct am_diag_group *g, int n_members)
{
    for (int i = 0; i < n_members; i++) {
        const struct am_diag_rank *r = g ? am_diag_rank_find(d, g->ranks[i]) : &d->ranks[i];
        if (!r || !r->nccl)
            return 0;
    }
    return n_members > 0;
}

/* In collective k: the member to blame (class 0: it never came: no log, it exited, or its
 * flight recorder ends before #k; 1: it is stuck inside #k waiting for no peer; 2: no flight
 * recorder to tell; 3: everyone came, the member most waited for); -1 when none. Every
 * member has an entry (am_diag_analyze made one for each rank named in a log). */
static int blame(const struct am_diag *d, const struct am_diag_flight *k, int *klass_out, int *votes_out)
{
    const struct am_diag_group *g = group_of(d, k->gid);
    int best = -1, best_class = 9, best_votes = -1;
    double best_t = 0;
    int n_members = g ? g->n : d->n_ranks;
    for (int i = 0; i < n_members; i++) {
        const struct am_diag_rank *r = g ? am_diag_rank_find(d, g->ranks[i]) : &d->ranks[i];
        if (!r)
            continue;
        int m = r->rank;
        const struct am_diag_flight *mine = find_call(r, k->gid, k->seq);
        int klass;
        if (!r->have_log)
            klass = 0;
        else if (r->end == AM_END_CLEAN || (r->end == AM_END_FAILED && streq(r->kind, "exit")))
            klass = 0;
        else if (!mine && r->n_flight > 0 && last_seq(r, k->gid) < k->seq)
            klass = 0;
        else if (mine && r->in == mine && r->waiting_for < 0 && !r->nccl)
            klass = 1; /* (NCCL never names the peer: a rank inside a NCCL call tells nothing) */
        else if (!mine && r->n_flight == 0)
            klass = 2;
        else
            continue;
        int votes = waited_for_count(d, m, k->gid, k->seq);
        double t = r->progress;
        if (klass < best_class || (klass == best_class && (votes > best_votes || (votes == best_votes && t < best_t)))) {
            best = m;
            best_class = klass;
            best_votes = votes;
            best_t = t;
        }
    }
    if (best < 0 && nccl_group(d, g, n_members)) {
        /* everyone came, and NCCL names no peer: nobody to blame from the logs */
        *klass_out = 4;
        *votes_out = 0;
        return -1;
    }
    if (best < 0) { /* everyone came: the member most waited for */
        for (int i = 0; i < n_members; i++) {
            int m = g ? g->ranks[i] : d->ranks[i].rank, votes = waited_for_count(d, m, k->gid, k->seq);
            if (votes > best_votes) {
                best = m;
                best_votes = votes;
                best_class = 3;
            }
        }
    }
    *klass_out = best_class;
    *votes_out = best_votes;
    return best;
}

/* The hang analysis (diag.h, step 2): returns 1 when it named a culprit or a collective.
 * It starts at the call that has been waiting longest (the earliest start among the calls
 * in flight when the ranks ended) and follows the chain: when the member to blame there is
 * itself waiting in another collective (a tensor-parallel rank held up by its partner), the
 * blame moves on to that one (at most AM_DIAG_MAX_HOPS times, never twice through a rank); a
 * point-to-point wait moves on the same way when its peer was itself waiting in another call
 * (a pipeline stage held up by a prefetch of its data-parallel group). */
static int hang(struct am_diag *d)
{
    const struct am_diag_rank *first = NULL;
    int waiting = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        waiting |= r->end == AM_END_WAITING;
        if (!r->in || r->end == AM_END_CLEAN || r->end == AM_END_FAILED)
            continue;
        double t = r->in->started > 0 ? r->in->started : r->in->enqueued;
        double ft = first ? (first->in->started > 0 ? first->in->started : first->in->enqueued) : 0;
        if (!first || t < ft)
            first = r;
    }
    if (!waiting || !first)
        return 0;
    const struct am_diag_flight *k = first->in;
    d->ff_cause = "hang";
    if (strcmp(k->op, "stream_wait") == 0) { /* a GPU rank waiting for its own stream (NCCL) */
        d->ff_in = k;
        d->culprit = -1;
        snprintf(d->ff_detail, sizeof(d->ff_detail), "rank %d waited %.2f s for its GPU to finish the work of group "
                 "%s enqueued after collective #%llu (stream_wait): a collective of the group did not complete on "
                 "the device (its cause record names it); NCCL does not tell which peer it waits for, so the logs "
                 "cannot name the rank that held it up", first->rank, first->waited_s, k->group,
                 (unsigned long long)k->seq);
        return 1;
    }
    /* point-to-point: the peer it waited for, unless that peer was itself waiting in another
     * call (not the matching one): then the blame moves on to that call, as for a collective */
    for (int hop = 0; hop <= AM_DIAG_MAX_HOPS && !is_collective(k); hop++) {
        struct am_diag_rank *c = am_diag_rank_find(d, first->waiting_for >= 0 ? first->waiting_for : k->peer);
        if (!c || c->visited || !c->in || c->end == AM_END_CLEAN || c->end == AM_END_FAILED ||
            (!is_collective(c->in) && c->in->gid == k->gid && c->in->peer == first->rank))
            break;
        c->visited = 1;
        first = c;
        k = c->in;
    }
    if (!is_collective(k)) { /* point-to-point: the peer it waited for */
        d->ff_in = k;
        d->culprit = first->waiting_for >= 0 ? first->waiting_for : k->peer;
        const struct am_diag_rank *c = am_diag_rank_find(d, d->culprit);
        if (c) {
            set(d->ff_detail, sizeof(d->ff_detail), "never completed the %s matching rank %d's %s #%llu on group "
                     "%s, in which rank %d waited for %.2f s", strcmp(k->op, "send") == 0 ? "recv" : "send",
                     first->rank, k->op, (unsigned long long)k->seq, k->group, first->rank, first->waited_s);
            d->ff_step = c->step;
        } else {
            d->culprit = -1;
            d->ff_time = k->started > 0 ? k->started : k->enqueued;
            set(d->ff_detail, sizeof(d->ff_detail), "rank %d waited in %s #%llu on group %s for %.2f s, for a peer "
                "that its log does not name (or names outside the job)", first->rank, k->op,
                (unsigned long long)k->seq, k->group, first->waited_s);
        }
        return 1;
    }
    int best = -1, klass = 9, votes = 0;
    for (int hop = 0; hop <= AM_DIAG_MAX_HOPS; hop++) {
        best = blame(d, k, &klass, &votes);
        if (best < 0 || klass != 0)
            break;
        struct am_diag_rank *b = am_diag_rank_find(d, best);
        if (!b || b->visited || !b->in || !is_collective(b->in) || (b->in->gid == k->gid && b->in->seq == k->seq))
            break;
        b->visited = 1;
        k = b->in; /* it waited elsewhere: blame moves on */
    }
    d->ff_in = k;
    d->culprit = best;
    if (best < 0 && klass == 4) {
        snprintf(d->ff_detail, sizeof(d->ff_detail), "every member of group %s was inside %s #%llu when the ranks "
                 "timed out: NCCL does not tell which peer a rank waits for, so the logs cannot name the one that held "
                 "it up (a hung kernel, a GPU fault or a dead link on one of its ranks; the flight recorders show "
                 "each rank's last calls)", k->group, k->op, (unsigned long long)k->seq);
        return 1;
    }
    if (best < 0) {
        set(d->ff_detail, sizeof(d->ff_detail), "ranks timed out in %s #%llu of group %s, but no member is to "
                 "blame from the logs", k->op, (unsigned long long)k->seq, k->group);
        return 1;
    }
    const struct am_diag_rank *c = am_diag_rank_find(d, best);
    if (!c) { /* cannot happen: every member has an entry */
        d->culprit = -1;
        return 1;
    }
    d->ff_time = klass == 0 || klass == 2 ? c->progress : c->in ? c->in->started : c->fail_time;
    d->ff_step = c->step;
    d->ff_status = c->status;
    char *why = d->ff_detail;
    size_t len = sizeof(d->ff_detail);
    unsigned long long seq = (unsigned long long)k->seq;
    if (!c->have_log)
        set(why, len, "left no log (rank-%d.jsonl is missing); the others waited in %s #%llu of group %s for it",
                 best, k->op, seq, k->group);
    else if (klass == 0 && c->end == AM_END_CLEAN)
        set(why, len, "exited (status %d) without joining %s #%llu of group %s, in which the others waited",
                 c->status, k->op, seq, k->group);
    else if (klass == 0 && streq(c->kind, "exit"))
        set(why, len, "exited (status %d) at step %ld without joining %s #%llu of group %s, in which the others "
                 "waited", c->status, c->step, k->op, seq, k->group);
    else if (klass == 0)
        set(why, len, "stopped making progress at step %ld and never issued %s #%llu of group %s, in which the "
                 "others waited (its last call on the group: #%llu, completed)", c->step, k->op, seq, k->group,
                 (unsigned long long)last_seq(c, k->gid));
    else if (klass == 1)
        set(why, len, "stuck inside %s #%llu of group %s at step %ld for %.2f s, waiting for no peer, while %d "
                 "rank%s waited for it", k->op, seq, k->group, c->step, c->waited_s, votes, votes == 1 ? "" : "s");
    else
        set(why, len, "the member of group %s that %d rank%s waited for in %s #%llu (its own log cannot tell "
                 "why)", k->group, votes, votes == 1 ? "" : "s", k->op, seq);
    return 1;
}

static void first_failure(struct am_diag *d)
{
    struct am_diag_rank *best = NULL;
    for (int q = 0; q < d->n_ranks; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        if (r->have_log && r->end == AM_END_FAILED && (!best || r->fail_time < best->fail_time))
            best = r;
    }
    if (best) {
        d->culprit = best->rank;
        d->ff_cause = best->kind;
        set(d->ff_signal, sizeof(d->ff_signal), "%s", best->signal);
        if ((streq(best->kind, "oom") && !best->cause) || streq(best->kind, "killed"))
            set(d->ff_signal, sizeof(d->ff_signal), "SIGKILL");
        d->ff_status = best->status;
        d->ff_step = best->step;
        d->ff_time = best->fail_time;
        describe_failure(best, d->ff_detail, sizeof(d->ff_detail));
        return;
    }
    if (hang(d))
        return;
    const struct am_diag_rank *stopped = NULL;
    int unknown = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        if (r->end == AM_END_STOPPED && (!stopped || r->fail_time < stopped->fail_time))
            stopped = r;
        unknown += r->have_log && r->end == AM_END_UNKNOWN;
    }
    if (stopped) {
        const char *from = stopped->cause ? str(stopped->cause, "from") : NULL;
        const char *by = stopped->stop ? str(stopped->stop, "by") : NULL;
        d->ff_cause = "stopped";
        set(d->ff_signal, sizeof(d->ff_signal), "%s", stopped->signal);
        d->ff_time = stopped->fail_time;
        const char *sender = by ? by : from ? from : "an unknown sender";
        set(d->ff_detail, sizeof(d->ff_detail), "no rank failed: the job was stopped from outside by %s (first "
                 "seen by rank %d, from %s): the time limit, scancel, preemption or a user",
                 stopped->signal[0] ? stopped->signal : "a signal", stopped->rank,
                 streq(sender, "slurm") ? "Slurm" : streq(sender, "other") ? "another process" : sender);
    } else if (unknown) {
        d->ff_cause = "unknown";
        set(d->ff_detail, sizeof(d->ff_detail), "no rank recorded a failure, but %d rank log%s end%s without a "
                 "record of the end (the job is still running, or was killed with its supervisors)", unknown,
                 unknown == 1 ? "" : "s", unknown == 1 ? "s" : "");
    }
}

/* ---- 3. verdicts --------------------------------------------------------------------------------- */

static void victim_detail(const struct am_diag *d, const struct am_diag_rank *r, char *buf, size_t len)
{
    const struct am_diag_flight *in = r->in;
    buf[0] = '\0';
    if (in) {
        add(buf, len, "waited in %s #%llu of group %s for %.2f s", in->op, (unsigned long long)in->seq, in->group,
            r->waited_s);
        if (r->waiting_for >= 0)
            add(buf, len, " (waiting for rank %d)", r->waiting_for);
        if (d->culprit >= 0 && d->culprit != r->rank && in_group(d, in->gid, d->culprit))
            add(buf, len, ", whose missing member is rank %d", d->culprit);
    } else if (r->have_log && (r->cause || r->n_flight)) {
        add(buf, len, "was outside any collective");
        if (r->step > 0)
            add(buf, len, " at step %ld", r->step);
    } else if (r->have_log) {
        add(buf, len, "left no flight recorder (its last record: step %ld)", last_step(r));
    }
    const json_t *stop = r->stop;
    if (r->end == AM_END_WAITING) {
        const char *by = str(r->cause, "by");
        if (streq(r->kind, "timeout"))
            add(buf, len, "; timed out (%s) and ended", by ? by : "?");
        else
            add(buf, len, "; its communication failed: %s", str(r->cause, "message") ? str(r->cause, "message") : "?");
    } else if (r->end == AM_END_STOPPED) {
        const char *from = r->cause ? str(r->cause, "from") : NULL;
        const char *by = stop ? str(stop, "by") : NULL;
        add(buf, len, "; stopped by %s", r->signal[0] ? r->signal : "a signal");
        const char *sender = by ? by : from;
        if (streq(sender, "slurm"))
            sender = "Slurm";
        else if (streq(sender, "supervisor"))
            sender = "its supervisor";
        else if (streq(sender, "other"))
            sender = "another process";
        if (sender)
            add(buf, len, " from %s", sender);
        long because = stop ? rank_in(d, integer(stop, "because_rank", -1)) : -1;
        if (because >= 0 && (because == d->culprit || d->culprit < 0))
            add(buf, len, " because rank %ld failed", because);
        else if (because >= 0) /* the launcher's view: the rank that ended first, a victim itself */
            add(buf, len, " after rank %ld ended the job", because);
        if (d->ff_time > 0 && r->fail_time > 0)
            add(buf, len, ", %.2f s after the first %s", r->fail_time - d->ff_time,
                streq(d->ff_cause, "stopped") ? "stop" : "failure");
    } else if (r->end == AM_END_UNKNOWN) {
        add(buf, len, "; its log ends without a record of its end (killed together with its supervisor after the "
            "first failure, e.g. by Slurm's abort)");
    }
}

static int cmp_step(const void *a, const void *b)
{
    uint32_t x = ((const struct am_diag_step *)a)->step, y = ((const struct am_diag_step *)b)->step;
    return (x > y) - (x < y);
}

/* The k-th smallest of v[0..n) (quickselect; reorders v). */
static float kth(float *v, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = v[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] < pivot)
                i++;
            while (v[j] > pivot)
                j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            break;
    }
    return v[k];
}

/* A min-heap of ranks' cursors into their (sorted) steps, by the step each points at. */
struct cursor {
    uint32_t step;
    int q;
    size_t at;
};

static void sift_down(struct cursor *h, int n, int i)
{
    for (;;) {
        int m = i, l = 2 * i + 1, r = l + 1;
        if (l < n && h[l].step < h[m].step)
            m = l;
        if (r < n && h[r].step < h[m].step)
            m = r;
        if (m == i)
            return;
        struct cursor t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* The median of v[0..m) (the upper one, as the steps' compute median), -1 when m is 0: the
 * ranks' expert tokens at one step, of those whose step record carries them. */
#define EP_UNSEEN (-2.0f)
static float ep_median(float *v, int m)
{
    return m > 0 ? kth(v, m, m / 2) : -1.0f;
}

static void straggler_check(struct am_diag *d)
{
    /* per step: compute = step_s - comm_s (the time outside collectives). A rank whose
     * compute exceeds the median rank's by AM_DIAG_STRAGGLER_S and by twice the median held
     * the others back: they waited for it in their collectives. Each rank's steps are sorted
     * (the first record of a step counts) and merged through a heap: n log n in the records. */
    int n = d->n_ranks;
    float *vals = calloc((size_t)n + 1, sizeof(float)), *worst = calloc((size_t)n + 1, sizeof(float));
    long *worst_step = calloc((size_t)n + 1, sizeof(long));
    struct cursor *heap = calloc((size_t)n + 1, sizeof(*heap)), *now = calloc((size_t)n + 1, sizeof(*now));
    /* expert parallelism: each rank's expert tokens at its worst step, the median rank's then */
    float *evals = calloc((size_t)n + 1, sizeof(float)), *worst_in = calloc((size_t)n + 1, sizeof(float));
    float *worst_med = calloc((size_t)n + 1, sizeof(float));
    int nh = 0;
    if (!vals || !worst || !worst_step || !heap || !now || !evals || !worst_in || !worst_med)
        goto out;
    for (int q = 0; q < n; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        if (r->n_steps == 0)
            continue;
        int sorted = 1;
        for (size_t i = 1; i < r->n_steps && sorted; i++)
            sorted = r->steps[i - 1].step <= r->steps[i].step;
        if (!sorted) /* stable enough: equal steps keep one of theirs, as the loader wrote them */
            qsort(r->steps, r->n_steps, sizeof(*r->steps), cmp_step);
        heap[nh++] = (struct cursor){.step = r->steps[0].step, .q = q, .at = 0};
    }
    /* steps numbered densely (the usual case: every rank 1..S): walk the numbers and take the
     * ranks at each, linear; else merge through the heap, n log n */
    size_t total = 0;
    uint32_t lo = UINT32_MAX, hi = 0;
    for (int i = 0; i < nh; i++) {
        const struct am_diag_rank *r = &d->ranks[heap[i].q];
        total += r->n_steps;
        lo = r->steps[0].step < lo ? r->steps[0].step : lo;
        hi = r->steps[r->n_steps - 1].step > hi ? r->steps[r->n_steps - 1].step : hi;
    }
    int dense = nh > 0 && ((double)hi - lo + 1) * nh <= 4.0 * (double)total;
    for (int i = nh / 2 - 1; i >= 0 && !dense; i--)
        sift_down(heap, nh, i);
    /* the dense walk by blocks of STEP_BLOCK step numbers: each rank's records of the block are
     * read in one pass (sequential in its array), then each step of the block judged */
    enum { STEP_BLOCK = 64 };
    struct at_step {
        int q;
        float compute, ep_in;
    } *slot = dense && nh > 0 ? malloc((size_t)STEP_BLOCK * (size_t)nh * sizeof(*slot)) : NULL;
    int cnt[STEP_BLOCK];
    if (dense && nh > 0 && !slot)
        goto out;
    for (uint64_t base = lo; dense && nh > 0 && base <= hi; base += STEP_BLOCK) {
        uint64_t top = base + STEP_BLOCK - 1 < hi ? base + STEP_BLOCK - 1 : hi;
        memset(cnt, 0, sizeof(cnt));
        for (int i = 0; i < nh; i++) {
            struct cursor *c = &heap[i];
            const struct am_diag_rank *r = &d->ranks[c->q];
            while (c->at < r->n_steps && r->steps[c->at].step <= top) {
                uint32_t s = r->steps[c->at].step;
                int j = (int)(s - base);
                slot[(size_t)j * (size_t)nh + (size_t)cnt[j]++] =
                    (struct at_step){c->q, r->steps[c->at].compute, r->steps[c->at].ep_in};
                while (c->at < r->n_steps && r->steps[c->at].step == s) /* its first record counts */
                    c->at++;
            }
        }
        for (int j = 0; j <= (int)(top - base); j++) {
            int k = cnt[j];
            const struct at_step *at = &slot[(size_t)j * (size_t)nh];
            if (k < 2)
                continue;
            for (int i = 0; i < k; i++)
                vals[i] = at[i].compute;
            float med = kth(vals, k, k / 2), emed = EP_UNSEEN;
            for (int i = 0; i < k; i++) {
                double excess = (double)at[i].compute - med;
                if (excess >= AM_DIAG_STRAGGLER_S && excess >= 2 * (double)med && excess > worst[at[i].q]) {
                    worst[at[i].q] = (float)excess;
                    worst_step[at[i].q] = (long)(base + (uint64_t)j);
                    if (emed == EP_UNSEEN) { /* once per step that names a straggler */
                        int m = 0;
                        for (int x = 0; x < k; x++)
                            if (at[x].ep_in >= 0)
                                evals[m++] = at[x].ep_in;
                        emed = ep_median(evals, m);
                    }
                    worst_in[at[i].q] = at[i].ep_in;
                    worst_med[at[i].q] = emed;
                }
            }
        }
    }
    free(slot);
    while (!dense && nh > 0) {
        uint32_t s = heap[0].step;
        int k = 0;
        while (nh > 0 && heap[0].step == s) { /* every rank at step s */
            struct cursor c = heap[0];
            const struct am_diag_rank *r = &d->ranks[c.q];
            now[k] = c;
            vals[k++] = r->steps[c.at].compute;
            while (c.at < r->n_steps && r->steps[c.at].step == s) /* duplicates of the step */
                c.at++;
            if (c.at < r->n_steps) {
                c.step = r->steps[c.at].step;
                heap[0] = c;
            } else {
                heap[0] = heap[--nh];
            }
            sift_down(heap, nh, 0);
        }
        if (k < 2)
            continue;
        float med = kth(vals, k, k / 2), emed = EP_UNSEEN; /* reorders vals: each rank's own value is read again */
        for (int i = 0; i < k; i++) {
            const struct am_diag_rank *r = &d->ranks[now[i].q];
            double excess = (double)r->steps[now[i].at].compute - med;
            if (excess >= AM_DIAG_STRAGGLER_S && excess >= 2 * (double)med && excess > worst[now[i].q]) {
                worst[now[i].q] = (float)excess;
                worst_step[now[i].q] = s;
                if (emed == EP_UNSEEN) {
                    int m = 0;
                    for (int x = 0; x < k; x++) {
                        float e = d->ranks[now[x].q].steps[now[x].at].ep_in;
                        if (e >= 0)
                            evals[m++] = e;
                    }
                    emed = ep_median(evals, m);
                }
                worst_in[now[i].q] = r->steps[now[i].at].ep_in;
                worst_med[now[i].q] = emed;
            }
        }
    }
    for (int q = 0; q < n; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        if (worst[q] <= 0 || r->verdict != AM_VERDICT_CLEAN)
            continue;
        r->verdict = AM_VERDICT_STRAGGLER;
        r->slow_step = worst_step[q];
        set(r->detail, sizeof(r->detail), "finished cleanly, but held the others back: at step %ld it spent "
            "%.2f s longer outside collectives than the median rank, while the others waited for it",
            worst_step[q], (double)worst[q]);
        if (worst_in[q] >= 0 && worst_med[q] > 0) { /* its step record carries its expert load */
            r->ep_step = worst_step[q];
            r->ep_in = worst_in[q];
            r->ep_median = worst_med[q];
            double ratio = r->ep_in / r->ep_median;
            add(r->detail, sizeof(r->detail), "; its experts received %.2fx the median rank's expert tokens at step "
                "%ld (%.0f against %.0f): %s", ratio, r->ep_step, r->ep_in, r->ep_median,
                ratio >= AM_DIAG_EP_OVERLOAD ? "an overloaded expert-parallel rank (routing imbalance), not a slow node"
                                             : "not overloaded by the routing (a slow node or device)");
        }
    }
out:
    free(evals);
    free(worst_in);
    free(worst_med);
    free(vals);
    free(worst);
    free(worst_step);
    free(heap);
    free(now);
}

static void verdicts(struct am_diag *d)
{
    for (int q = 0; q < d->n_ranks; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        int me = r->rank;
        if (!r->have_log) {
            r->verdict = AM_VERDICT_MISSING;
            set(r->detail, sizeof(r->detail), "no log (rank-%d.jsonl): its node's logs are missing, or the rank "
                     "never started", me);
            if (me == d->culprit) {
                r->verdict = AM_VERDICT_FIRST;
                set(r->detail, sizeof(r->detail), "%s", d->ff_detail);
            }
            continue;
        }
        if (me == d->culprit) {
            r->verdict = AM_VERDICT_FIRST;
            set(r->detail, sizeof(r->detail), "%s", d->ff_detail);
            continue;
        }
        switch (r->end) {
        case AM_END_CLEAN:
            r->verdict = AM_VERDICT_CLEAN;
            set(r->detail, sizeof(r->detail), "finished all %ld steps and exited with status %d", last_step(r),
                     r->status < 0 ? 0 : r->status);
            if (d->ff_in && is_collective(d->ff_in) && in_group(d, d->ff_in->gid, me) &&
                !find_call(r, d->ff_in->gid, d->ff_in->seq) && streq(d->ff_cause, "hang")) {
                r->verdict = AM_VERDICT_STRAGGLER;
                set(r->detail, sizeof(r->detail), "exited (status %d) without joining %s #%llu of group %s either",
                         r->status, d->ff_in->op, (unsigned long long)d->ff_in->seq, d->ff_in->group);
            }
            break;
        case AM_END_FAILED: {
            char what[512];
            describe_failure(r, what, sizeof(what));
            r->verdict = AM_VERDICT_FAILED;
            set(r->detail, sizeof(r->detail), "failed too: %s", what);
            if (d->ff_time > 0 && r->fail_time > 0)
                add(r->detail, sizeof(r->detail), " (%.2f s after the first failure)", r->fail_time - d->ff_time);
            break;
        }
        default: /* waiting, stopped, unknown */
            if (d->ff_in && is_collective(d->ff_in) && streq(d->ff_cause, "hang") && in_group(d, d->ff_in->gid, me) &&
                r->n_flight > 0 && last_seq(r, d->ff_in->gid) < d->ff_in->seq && d->culprit >= 0) {
                r->verdict = AM_VERDICT_STRAGGLER;
                set(r->detail, sizeof(r->detail), "never issued %s #%llu of group %s either (stopped at step %ld)",
                         d->ff_in->op, (unsigned long long)d->ff_in->seq, d->ff_in->group, r->step);
                break;
            }
            if (d->culprit >= 0 || streq(d->ff_cause, "hang")) {
                r->verdict = AM_VERDICT_VICTIM;
                victim_detail(d, r, r->detail, sizeof(r->detail));
            } else if (r->end == AM_END_UNKNOWN) {
                r->verdict = AM_VERDICT_UNKNOWN;
                set(r->detail, sizeof(r->detail), "its log ends without a record of its end (last record at "
                         "step %ld)", last_step(r));
            } else {
                r->verdict = AM_VERDICT_STOPPED;
                victim_detail(d, r, r->detail, sizeof(r->detail));
            }
            break;
        }
    }
    straggler_check(d);
}

/* ---- 4. mismatches --------------------------------------------------------------------------- */

static void mismatch(struct am_diag *d, const char *what, const struct am_diag_flight *f, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void mismatch(struct am_diag *d, const char *what, const struct am_diag_flight *f, const char *fmt, ...)
{
    if (d->n_mismatches >= AM_DIAG_MAX_MISMATCHES) {
        d->more_mismatches++;
        return;
    }
    if (d->n_mismatches % 64 == 0) {
        struct am_diag_mismatch *m = realloc(d->mismatches, (size_t)(d->n_mismatches + 64) * sizeof(*m));
        if (!m)
            return;
        d->mismatches = m;
    }
    struct am_diag_mismatch *m = &d->mismatches[d->n_mismatches++];
    memset(m, 0, sizeof(*m));
    m->group = f->group;
    set(m->what, sizeof(m->what), "%s", what);
    m->gid = f->gid;
    m->seq = f->seq;
    va_list ap;
    va_start(ap, fmt);
    vadd(m->text, sizeof(m->text), fmt, ap);
    va_end(ap);
}

/* One collective call of one rank, for the search across ranks. */
struct call {
    int gid, rank;
    uint64_t seq;
    size_t at; /* its place in the rank's flight recorder: the first of duplicates wins */
    const struct am_diag_flight *f;
};

static int cmp_call(const void *a, const void *b)
{
    const struct call *x = a, *y = b;
    if (x->gid != y->gid)
        return (x->gid > y->gid) - (x->gid < y->gid);
    if (x->seq != y->seq)
        return (x->seq > y->seq) - (x->seq < y->seq);
    if (x->rank != y->rank)
        return (x->rank > y->rank) - (x->rank < y->rank);
    return (x->at > y->at) - (x->at < y->at);
}

static void mismatches(struct am_diag *d)
{
    /* every collective call of every rank, sorted by (group, sequence number, rank): the calls
     * of one collective lie together, and each is compared with its lowest rank's */
    size_t n = 0, k = 0;
    for (int a = 0; a < d->n_ranks; a++)
        n += d->ranks[a].n_flight;
    struct call *calls = malloc((n ? n : 1) * sizeof(*calls));
    if (!calls)
        return;
    for (int a = 0; a < d->n_ranks; a++)
        for (size_t i = 0; i < d->ranks[a].n_flight; i++) {
            const struct am_diag_flight *f = &d->ranks[a].flight[i];
            if (is_collective(f))
                calls[k++] = (struct call){.gid = f->gid, .rank = d->ranks[a].rank, .seq = f->seq, .at = i, .f = f};
        }
    qsort(calls, k, sizeof(*calls), cmp_call);
    for (size_t i = 0; i < k;) {
        size_t j = i + 1;
        int op = 0, size = 0;
        const struct am_diag_flight *fa = calls[i].f;
        for (; j < k && calls[j].gid == calls[i].gid && calls[j].seq == calls[i].seq; j++) {
            const struct am_diag_flight *fb = calls[j].f;
            if (calls[j].rank == calls[j - 1].rank)
                continue; /* a rank's second entry with this number: its first counts */
            if (!op && strcmp(fa->op, fb->op) != 0) {
                op = 1;
                mismatch(d, "op", fa, "%s #%llu of group %s: rank %d called %s, rank %d called %s", fa->op,
                         (unsigned long long)fa->seq, fa->group, calls[i].rank, fa->op, calls[j].rank, fb->op);
            } else if (!op && !size &&
                       (strcmp(fa->dtype, fb->dtype) != 0 ||
                        (fa->count != fb->count && strcmp(fa->op, "alltoallv") != 0))) {
                /* an alltoallv's count is what the rank sends, which differs between ranks */
                size = 1;
                mismatch(d, "size", fa, "%s #%llu of group %s: rank %d passed %llu %s, rank %d passed %llu %s",
                         fa->op, (unsigned long long)fa->seq, fa->group, calls[i].rank, (unsigned long long)fa->count,
                         fa->dtype, calls[j].rank, (unsigned long long)fb->count, fb->dtype);
            }
        }
        i = j;
    }
    /* stuck in collectives of one group two or more apart: a rank cannot complete #k without
     * every member, so one of them counted its calls differently (one apart is the ordinary
     * race of ranks that finished #k while a peer had not yet seen it finish); per group, the
     * lowest and the highest. The lowest counts from the last call it issued on the group, not
     * the one it waits in: with non-blocking collectives in flight (fsdp2's prefetched
     * all-gathers) it may wait in #k having issued #k+1 and #k+2, which its peers then reach. */
    k = 0;
    for (int a = 0; a < d->n_ranks; a++) {
        const struct am_diag_flight *f = d->ranks[a].in;
        if (f && is_collective(f))
            calls[k++] = (struct call){.gid = f->gid, .rank = d->ranks[a].rank, .seq = f->seq, .f = f};
    }
    qsort(calls, k, sizeof(*calls), cmp_call);
    for (size_t i = 0; i < k;) {
        size_t j = i;
        while (j + 1 < k && calls[j + 1].gid == calls[i].gid)
            j++;
        const struct am_diag_rank *lo = am_diag_rank_find(d, calls[i].rank);
        uint64_t issued = lo ? last_seq(lo, calls[i].gid) : 0;
        issued = issued > calls[i].seq ? issued : calls[i].seq;
        if (calls[j].seq >= issued + 2)
            mismatch(d, "sequence", calls[i].f, "group %s: rank %d is stuck in %s #%llu, rank %d in %s #%llu",
                     calls[i].f->group, calls[i].rank, calls[i].f->op, (unsigned long long)calls[i].seq,
                     calls[j].rank, calls[j].f->op, (unsigned long long)calls[j].seq);
        i = j + 1;
    }
    free(calls);
}

/* ---- 0. the ranks of the job ----------------------------------------------------------------- */

/* "0-2, 4, 6-7" of sorted ranks, cut with ", ..." when the buffer is full. */
static void ranks_text(const int *ranks, int n, char *buf, size_t len)
{
    buf[0] = '\0';
    for (int i = 0; i < n;) {
        int j = i;
        while (j + 1 < n && ranks[j + 1] == ranks[j] + 1)
            j++;
        if (strlen(buf) + 32 >= len) {
            add(buf, len, ", ...");
            return;
        }
        if (j > i)
            add(buf, len, "%s%d-%d", i ? ", " : "", ranks[i], ranks[j]);
        else
            add(buf, len, "%s%d", i ? ", " : "", ranks[i]);
        i = j + 1;
    }
}

static void push(int **a, size_t *n, size_t *cap, int v)
{
    if (*n == *cap) {
        size_t c = *cap ? 2 * *cap : 256;
        int *m = realloc(*a, c * sizeof(int));
        if (!m)
            return;
        *a = m;
        *cap = c;
    }
    (*a)[(*n)++] = v;
}

/* A rank number read from rank r's log: kept (and remembered as named) when below bound. */
static int check_rank(struct am_diag_rank *r, long long v, long long bound, int **named, size_t *n, size_t *cap)
{
    if (v < 0)
        return -1;
    if (v >= bound) {
        if (r->bad_ranks++ == 0)
            r->first_bad_rank = v > LONG_MAX ? LONG_MAX : (long)v;
        return -1;
    }
    push(named, n, cap, (int)v);
    return (int)v;
}

/* Checks every rank number that a log names against the job: a group member, a peer, a rank
 * waited for must be below the start records' world (without one, any rank is taken and the
 * world is the highest rank known + 1). Numbers outside are dropped, with one note per log.
 * Each rank named gets an entry (so that it can be blamed or reported missing): the entries
 * are those with a log and those named, however large "world" is. Then the entries are sorted
 * and the ranks of 0..world-1 without a log gathered as runs. */
static void resolve(struct am_diag *d)
{
    int known = d->world > 0;
    long long bound = known ? d->world : INT_MAX; /* world = the highest rank + 1 must be an int */
    int *named = NULL;
    size_t n_named = 0, cap = 0;
    int n0 = d->n_ranks; /* entries are added below: no pointer is kept across that */
    for (int q = 0; q < n0; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        for (size_t i = 0; i < r->n_flight; i++) {
            struct am_diag_flight *f = &r->flight[i];
            f->peer = check_rank(r, f->peer, bound, &named, &n_named, &cap);
            f->waiting_for = check_rank(r, f->waiting_for, bound, &named, &n_named, &cap);
        }
        for (int g = 0; g < r->n_groups; g++) {
            struct am_diag_group *dg = &r->groups[g];
            int m = 0;
            for (int i = 0; i < dg->n; i++)
                if (check_rank(r, dg->ranks[i], bound, &named, &n_named, &cap) >= 0)
                    dg->ranks[m++] = dg->ranks[i];
            dg->n = m;
        }
        const json_t *w = r->cause ? json_object_get(r->cause, "waiting_for") : NULL;
        if (json_is_integer(w))
            check_rank(r, json_integer_value(w), bound, &named, &n_named, &cap);
        if (r->bad_ranks)
            am_diag_note(d, "rank %d: %d rank number%s in its log %s not %s of the job (the first: %ld; the job "
                         "has %s%d rank%s); ignored", r->rank, r->bad_ranks, r->bad_ranks == 1 ? "" : "s",
                         r->bad_ranks == 1 ? "is" : "are", r->bad_ranks == 1 ? "a rank" : "ranks", r->first_bad_rank, known ? "" : "at most ",
                         known ? d->world : INT_MAX, known && d->world == 1 ? "" : "s");
        if (known && r->have_log && r->rank >= d->world)
            am_diag_note(d, "rank %d: its log (rank-%d.jsonl) is of a rank outside the job, which has %d rank%s "
                         "(the start records' world)", r->rank, r->rank, d->world, d->world == 1 ? "" : "s");
    }
    if (n_named)
        qsort(named, n_named, sizeof(int), cmp_int);
    for (size_t i = 0; i < n_named; i++)
        if (i == 0 || named[i] != named[i - 1])
            am_diag_rank_get(d, named[i]);
    free(named);
    am_diag_sort_ranks(d);
    if (!known) {
        d->world = d->n_ranks ? d->ranks[d->n_ranks - 1].rank + 1 : 0;
        am_diag_note(d, "no start record in any log: the job's size is unknown; assuming %d ranks (the highest rank "
                     "known, plus one)", d->world);
    }
    /* logs without a start record: one note */
    int *list = malloc(((size_t)d->n_ranks + 1) * sizeof(int)), n = 0;
    for (int q = 0; list && q < d->n_ranks; q++)
        if (d->ranks[q].have_log && !d->ranks[q].have_start)
            list[n++] = d->ranks[q].rank;
    if (n) {
        char text[640];
        ranks_text(list, n, text, sizeof(text));
        if (n == 1)
            am_diag_note(d, "rank %s: its log has no start record (it failed before training began?)", text);
        else
            am_diag_note(d, "ranks %s: their logs have no start record (they failed before training began?)", text);
    }
    free(list);
    /* the ranks of the job without a log, as runs */
    d->missing = calloc((size_t)d->n_ranks + 1, sizeof(*d->missing));
    d->n_missing = 0;
    int next = 0;
    for (int q = 0; d->missing && q <= d->n_ranks; q++) {
        int upto = q < d->n_ranks ? d->ranks[q].rank : d->world; /* ranks next..upto-1 have no log */
        if (q < d->n_ranks && !d->ranks[q].have_log)
            continue;
        if (upto > d->world)
            upto = d->world;
        if (upto > next) {
            d->missing[d->n_missing_ranges++] = (struct am_diag_range){next, upto - 1};
            d->n_missing += upto - next;
        }
        if (q < d->n_ranks && d->ranks[q].rank + 1 > next)
            next = d->ranks[q].rank + 1;
    }
}

/* The groups by id (the first rank's record of each, members sorted) and the votes. */
static int cmp_gref(const void *a, const void *b)
{
    int x = ((const struct am_diag_gref *)a)->gid, y = ((const struct am_diag_gref *)b)->gid;
    return (x > y) - (x < y);
}

static void build_lookups(struct am_diag *d)
{
    size_t n = 0;
    for (int q = 0; q < d->n_ranks; q++)
        n += (size_t)d->ranks[q].n_groups;
    d->gref = calloc(n + 1, sizeof(*d->gref));
    if (d->gref) {
        int k = 0;
        for (int q = 0; q < d->n_ranks; q++) /* in rank order; the sort below is stable by hand */
            for (int g = 0; g < d->ranks[q].n_groups; g++)
                d->gref[k++] = (struct am_diag_gref){.gid = d->ranks[q].groups[g].gid, .g = &d->ranks[q].groups[g],
                                                     .sorted = NULL};
        /* stable: qsort by gid then keep, per gid, the entry of the lowest rank (smallest address
         * in ranks[], which is sorted by rank) */
        qsort(d->gref, (size_t)k, sizeof(*d->gref), cmp_gref);
        int m = 0;
        for (int i = 0; i < k; i++) {
            if (m > 0 && d->gref[m - 1].gid == d->gref[i].gid) {
                if (d->gref[i].g < d->gref[m - 1].g)
                    d->gref[m - 1] = d->gref[i];
                continue;
            }
            d->gref[m++] = d->gref[i];
        }
        d->n_gref = m;
        for (int i = 0; i < m; i++) {
            const struct am_diag_group *g = d->gref[i].g;
            d->gref[i].sorted = malloc(((size_t)g->n + 1) * sizeof(int));
            if (d->gref[i].sorted) {
                memcpy(d->gref[i].sorted, g->ranks, (size_t)g->n * sizeof(int));
                qsort(d->gref[i].sorted, (size_t)g->n, sizeof(int), cmp_int);
            }
        }
    }
    count_votes(d);
}

void am_diag_analyze(struct am_diag *d)
{
    resolve(d);
    for (int q = 0; q < d->n_ranks; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        if (r->have_log)
            classify(d, r);
    }
    build_lookups(d);
    first_failure(d);
    verdicts(d);
    mismatches(d);
    if (d->n_mismatches && !d->ff_cause) {
        d->ff_cause = "mismatch";
        set(d->ff_detail, sizeof(d->ff_detail), "%s", d->mismatches[0].text);
    }
    d->failed = d->ff_cause != NULL;
}

const char *am_diag_verdict_name(enum am_diag_verdict v)
{
    switch (v) {
    case AM_VERDICT_NONE: return "none";
    case AM_VERDICT_FIRST: return "first_failure";
    case AM_VERDICT_VICTIM: return "victim";
    case AM_VERDICT_FAILED: return "failed";
    case AM_VERDICT_STRAGGLER: return "straggler";
    case AM_VERDICT_CLEAN: return "clean";
    case AM_VERDICT_STOPPED: return "stopped";
    case AM_VERDICT_UNKNOWN: return "unknown";
    case AM_VERDICT_MISSING: return "missing";
    }
    return "none";
}
