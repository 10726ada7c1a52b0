/* diag.c - am-diag's analysis: how each rank ended, the first failure, verdicts, mismatches
 * (diag.h). */
#include "diag.h"

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
    return json_is_integer(v) ? (long)json_integer_value(v) : def;
}

static int streq(const char *a, const char *b) { return a && b && strcmp(a, b) == 0; }

static int is_crash_signal(const char *s)
{
    return streq(s, "SIGSEGV") || streq(s, "SIGBUS") || streq(s, "SIGFPE") || streq(s, "SIGILL") || streq(s, "SIGABRT");
}

/* Appends to a fixed buffer. */
static void add(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void add(char *buf, size_t len, const char *fmt, ...)
{
    size_t at = strlen(buf);
    if (at + 1 >= len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + at, len - at, fmt, ap);
    va_end(ap);
}

static const struct am_diag_group *group_of(const struct am_diag *d, int gid)
{
    for (int r = 0; r < d->n_ranks; r++)
        for (int g = 0; g < d->ranks[r].n_groups; g++)
            if (d->ranks[r].groups[g].gid == gid)
                return &d->ranks[r].groups[g];
    return NULL;
}

static int in_group(const struct am_diag_group *g, int rank)
{
    if (!g)
        return 1; /* unknown membership: every rank */
    for (int i = 0; i < g->n; i++)
        if (g->ranks[i] == rank)
            return 1;
    return 0;
}

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

static long last_step(const struct am_diag_rank *r)
{
    long s = 0;
    for (size_t i = 0; i < r->n_steps; i++)
        if (r->steps[i].step > s)
            s = r->steps[i].step;
    return s;
}

/* When the rank last made progress: the end of its last completed call, or its last step. */
static double last_progress(const struct am_diag_rank *r)
{
    double t = r->start_time;
    for (size_t i = 0; i < r->n_flight; i++)
        if (strcmp(r->flight[i].state, "completed") == 0 && r->flight[i].ended > t)
            t = r->flight[i].ended;
    for (size_t i = 0; i < r->n_steps; i++)
        if (r->steps[i].time > t)
            t = r->steps[i].time;
    return t;
}


/* ---- 1. how each rank ended --------------------------------------------------------------------- */

static void classify(struct am_diag_rank *r)
{
    const json_t *c = r->cause, *e = r->exit;
    long done = last_step(r);
    int completed_all = r->max_steps > 0 && done >= r->max_steps;
    r->status = e ? (int)integer(e, "status", -1) : -1;
    r->in = in_flight(r);
    r->waiting_for = r->in ? r->in->waiting_for : -1;
    if (r->in)
        r->waited_s = r->last_time - (r->in->started > 0 ? r->in->started : r->in->enqueued);
    if (c) {
        const char *kind = str(c, "cause");
        r->fail_time = num(c, "time");
        if (streq(kind, "signal")) {
            snprintf(r->signal, sizeof(r->signal), "%s", str(c, "signal_name") ? str(c, "signal_name") : "");
            r->end = is_crash_signal(r->signal) ? AM_END_FAILED : AM_END_STOPPED;
            r->kind = r->end == AM_END_FAILED ? "signal" : "stopped";
        } else if (streq(kind, "timeout") || streq(kind, "comm")) {
            r->end = AM_END_WAITING;
            r->kind = streq(kind, "timeout") ? "timeout" : "comm";
            const json_t *w = json_object_get(c, "waiting_for");
            r->waiting_for = json_is_integer(w) ? (int)json_integer_value(w) : -1;
            r->waited_s = num(c, "waited_s");
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
        r->step = integer(c, "step", 0);
    } else if (e) {
        const char *sig = str(e, "signal_name");
        const json_t *stop = json_object_get(e, "stop_signal"), *oom = json_object_get(e, "oom_killed");
        r->fail_time = num(e, "time");
        snprintf(r->signal, sizeof(r->signal), "%s", sig ? sig : "");
        if (r->status == 0) {
            r->end = completed_all || r->max_steps <= 0 ? AM_END_CLEAN : AM_END_FAILED;
            r->kind = r->end == AM_END_CLEAN ? NULL : "exit";
        } else if (json_is_string(stop) || r->stop) {
            r->end = AM_END_STOPPED;
            r->kind = "stopped";
            if (!sig)
                snprintf(r->signal, sizeof(r->signal), "%s", json_is_string(stop) ? json_string_value(stop) : "");
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
            snprintf(r->signal, sizeof(r->signal), "%s", str(r->stop, "signal") ? str(r->stop, "signal") : "");
    }
    if (r->step == 0 && r->end != AM_END_CLEAN && (done > 0 || r->n_flight > 0))
        r->step = r->max_steps > 0 && done >= r->max_steps ? done : done + 1;
}

/* ---- 2. the first failure ------------------------------------------------------------------------ */

/* "41.0 GiB" (binary units, one decimal; bytes below 1 KiB as they are). */
static const char *bytes_text(double n, char *buf, size_t len)
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
    snprintf(buf, len, "%.1f %s", n, units[u]);
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
        snprintf(ls, sizeof(ls), "%s", json_is_string(l) ? json_string_value(l) : "");
        if (json_is_number(l))
            snprintf(ls, sizeof(ls), "%g", json_number_value(l));
        snprintf(gs, sizeof(gs), "%s", json_is_string(g) ? json_string_value(g) : "");
        if (json_is_number(g))
            snprintf(gs, sizeof(gs), "%g", json_number_value(g));
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
            bytes_text(num(c, "bytes_in_use"), used, sizeof(used)));
        if (num(c, "plan_bytes") > 0)
            add(buf, len, ", plan %s", bytes_text(num(c, "plan_bytes"), plan, sizeof(plan)));
        add(buf, len, " (asked for %s; the allocator holds %s", bytes_text(num(c, "bytes_asked"), asked, sizeof(asked)),
            bytes_text(num(c, "bytes_held"), held, sizeof(held)));
        if (num(c, "bytes_total") > 0)
            add(buf, len, " of the device's %s", bytes_text(num(c, "bytes_total"), total, sizeof(total)));
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
        add(buf, len, "error: %s", str(c, "message") ? str(c, "message") : "(no message)");
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

static int waited_for_count(const struct am_diag *d, int rank, int gid, uint64_t seq)
{
    int n = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        if (r->waiting_for == rank && r->in && r->in->gid == gid && r->in->seq == seq)
            n++;
    }
    return n;
}

/* Every member of the group (every rank without one) ran NCCL. */
static int nccl_group(struct am_diag *d, const struct am_diag_group *g, int n_members)
{
    for (int i = 0; i < n_members; i++) {
        const struct am_diag_rank *r = am_diag_rank_get(d, g ? g->ranks[i] : i);
        if (!r || !r->nccl)
            return 0;
    }
    return n_members > 0;
}

/* In collective k: the member to blame (class 0: it never came: no log, it exited, or its
 * flight recorder ends before #k; 1: it is stuck inside #k waiting for no peer; 2: no flight
 * recorder to tell; 3: everyone came, the member most waited for); -1 when none. */
static int blame(struct am_diag *d, const struct am_diag_flight *k, int *klass_out, int *votes_out)
{
    const struct am_diag_group *g = group_of(d, k->gid);
    int best = -1, best_class = 9, best_votes = -1;
    double best_t = 0;
    int n_members = g ? g->n : d->n_ranks;
    for (int i = 0; i < n_members; i++) {
        int m = g ? g->ranks[i] : i;
        struct am_diag_rank *r = am_diag_rank_get(d, m);
        if (!r)
            continue;
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
        double t = last_progress(r);
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
            int m = g ? g->ranks[i] : i, votes = waited_for_count(d, m, k->gid, k->seq);
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
 * blame moves on to that one. */
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
    if (!is_collective(k)) { /* point-to-point: the peer it waited for */
        d->ff_in = k;
        d->culprit = first->waiting_for >= 0 ? first->waiting_for : k->peer;
        if (d->culprit >= 0) {
            struct am_diag_rank *c = am_diag_rank_get(d, d->culprit);
            snprintf(d->ff_detail, sizeof(d->ff_detail), "never completed the %s matching rank %d's %s #%llu on group "
                     "%s, in which rank %d waited for %.2f s", strcmp(k->op, "send") == 0 ? "recv" : "send",
                     first->rank, k->op, (unsigned long long)k->seq, k->group, first->rank, first->waited_s);
            if (c)
                d->ff_step = c->step;
        }
        return 1;
    }
    int best = -1, klass = 9, votes = 0;
    for (int depth = 0; depth <= d->n_ranks; depth++) {
        best = blame(d, k, &klass, &votes);
        if (best < 0 || klass != 0)
            break;
        const struct am_diag_rank *b = &d->ranks[best];
        if (!b->in || !is_collective(b->in) || (b->in->gid == k->gid && b->in->seq == k->seq))
            break;
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
        snprintf(d->ff_detail, sizeof(d->ff_detail), "ranks timed out in %s #%llu of group %s, but no member is to "
                 "blame from the logs", k->op, (unsigned long long)k->seq, k->group);
        return 1;
    }
    struct am_diag_rank *c = am_diag_rank_get(d, best);
    d->ff_time = klass == 0 || klass == 2 ? last_progress(c) : c->in ? c->in->started : c->fail_time;
    d->ff_step = c->step;
    d->ff_status = c->status;
    char *why = d->ff_detail;
    size_t len = sizeof(d->ff_detail);
    unsigned long long seq = (unsigned long long)k->seq;
    if (!c->have_log)
        snprintf(why, len, "left no log (rank-%d.jsonl is missing); the others waited in %s #%llu of group %s for it",
                 best, k->op, seq, k->group);
    else if (klass == 0 && c->end == AM_END_CLEAN)
        snprintf(why, len, "exited (status %d) without joining %s #%llu of group %s, in which the others waited",
                 c->status, k->op, seq, k->group);
    else if (klass == 0 && streq(c->kind, "exit"))
        snprintf(why, len, "exited (status %d) at step %ld without joining %s #%llu of group %s, in which the others "
                 "waited", c->status, c->step, k->op, seq, k->group);
    else if (klass == 0)
        snprintf(why, len, "stopped making progress at step %ld and never issued %s #%llu of group %s, in which the "
                 "others waited (its last call on the group: #%llu, completed)", c->step, k->op, seq, k->group,
                 (unsigned long long)last_seq(c, k->gid));
    else if (klass == 1)
        snprintf(why, len, "stuck inside %s #%llu of group %s at step %ld for %.2f s, waiting for no peer, while %d "
                 "rank%s waited for it", k->op, seq, k->group, c->step, c->waited_s, votes, votes == 1 ? "" : "s");
    else
        snprintf(why, len, "the member of group %s that %d rank%s waited for in %s #%llu (its own log cannot tell "
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
        snprintf(d->ff_signal, sizeof(d->ff_signal), "%s", best->signal);
        if ((streq(best->kind, "oom") && !best->cause) || streq(best->kind, "killed"))
            snprintf(d->ff_signal, sizeof(d->ff_signal), "SIGKILL");
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
        snprintf(d->ff_signal, sizeof(d->ff_signal), "%s", stopped->signal);
        d->ff_time = stopped->fail_time;
        const char *sender = by ? by : from ? from : "an unknown sender";
        snprintf(d->ff_detail, sizeof(d->ff_detail), "no rank failed: the job was stopped from outside by %s (first "
                 "seen by rank %d, from %s): the time limit, scancel, preemption or a user",
                 stopped->signal[0] ? stopped->signal : "a signal", stopped->rank,
                 streq(sender, "slurm") ? "Slurm" : streq(sender, "other") ? "another process" : sender);
    } else if (unknown) {
        d->ff_cause = "unknown";
        snprintf(d->ff_detail, sizeof(d->ff_detail), "no rank recorded a failure, but %d rank log%s end%s without a "
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
        if (d->culprit >= 0 && d->culprit != r->rank && in_group(group_of(d, in->gid), d->culprit))
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
        long because = stop ? integer(stop, "because_rank", -1) : -1;
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

static void straggler_check(struct am_diag *d)
{
    /* per step: compute = step_s - comm_s (the time outside collectives). A rank whose
     * compute exceeds the median rank's by AM_DIAG_STRAGGLER_S and by twice the median held
     * the others back: they waited for it in their collectives. */
    long max_step = 0;
    for (int q = 0; q < d->n_ranks; q++)
        max_step = last_step(&d->ranks[q]) > max_step ? last_step(&d->ranks[q]) : max_step;
    double *vals = calloc((size_t)d->n_ranks + 1, sizeof(double)), *worst = calloc((size_t)d->n_ranks + 1, sizeof(double));
    long *worst_step = calloc((size_t)d->n_ranks + 1, sizeof(long));
    if (!vals || !worst || !worst_step || max_step > 1000000)
        goto out;
    for (long s = 1; s <= max_step; s++) {
        int n = 0;
        for (int q = 0; q < d->n_ranks; q++)
            for (size_t i = 0; i < d->ranks[q].n_steps; i++)
                if (d->ranks[q].steps[i].step == s) {
                    vals[n++] = d->ranks[q].steps[i].step_s - d->ranks[q].steps[i].comm_s;
                    break;
                }
        if (n < 2)
            continue;
        for (int i = 1; i < n; i++) /* the median, by insertion sort (few ranks) */
            for (int j = i; j > 0 && vals[j - 1] > vals[j]; j--) {
                double tmp = vals[j];
                vals[j] = vals[j - 1];
                vals[j - 1] = tmp;
            }
        double med = vals[n / 2];
        for (int q = 0; q < d->n_ranks; q++)
            for (size_t i = 0; i < d->ranks[q].n_steps; i++)
                if (d->ranks[q].steps[i].step == s) {
                    double excess = d->ranks[q].steps[i].step_s - d->ranks[q].steps[i].comm_s - med;
                    if (excess >= AM_DIAG_STRAGGLER_S && excess >= 2 * med && excess > worst[q]) {
                        worst[q] = excess;
                        worst_step[q] = s;
                    }
                    break;
                }
    }
    for (int q = 0; q < d->n_ranks; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        if (worst[q] <= 0 || r->verdict != AM_VERDICT_CLEAN)
            continue;
        r->verdict = AM_VERDICT_STRAGGLER;
        snprintf(r->detail, sizeof(r->detail), "finished cleanly, but held the others back: at step %ld it spent "
                 "%.2f s longer outside collectives than the median rank, while the others waited for it",
                 worst_step[q], worst[q]);
    }
out:
    free(vals);
    free(worst);
    free(worst_step);
}

static void verdicts(struct am_diag *d)
{
    const struct am_diag_group *hang_group = d->ff_in ? group_of(d, d->ff_in->gid) : NULL;
    for (int q = 0; q < d->n_ranks; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        if (!r->have_log) {
            r->verdict = AM_VERDICT_MISSING;
            snprintf(r->detail, sizeof(r->detail), "no log (rank-%d.jsonl): its node's logs are missing, or the rank "
                     "never started", q);
            if (q == d->culprit) {
                r->verdict = AM_VERDICT_FIRST;
                snprintf(r->detail, sizeof(r->detail), "%s", d->ff_detail);
            }
            continue;
        }
        if (q == d->culprit) {
            r->verdict = AM_VERDICT_FIRST;
            snprintf(r->detail, sizeof(r->detail), "%s", d->ff_detail);
            continue;
        }
        switch (r->end) {
        case AM_END_CLEAN:
            r->verdict = AM_VERDICT_CLEAN;
            snprintf(r->detail, sizeof(r->detail), "finished all %ld steps and exited with status %d", last_step(r),
                     r->status < 0 ? 0 : r->status);
            if (d->ff_in && is_collective(d->ff_in) && in_group(hang_group, q) &&
                !find_call(r, d->ff_in->gid, d->ff_in->seq) && streq(d->ff_cause, "hang")) {
                r->verdict = AM_VERDICT_STRAGGLER;
                snprintf(r->detail, sizeof(r->detail), "exited (status %d) without joining %s #%llu of group %s either",
                         r->status, d->ff_in->op, (unsigned long long)d->ff_in->seq, d->ff_in->group);
            }
            break;
        case AM_END_FAILED: {
            char what[512];
            describe_failure(r, what, sizeof(what));
            r->verdict = AM_VERDICT_FAILED;
            snprintf(r->detail, sizeof(r->detail), "failed too: %s", what);
            if (d->ff_time > 0 && r->fail_time > 0)
                add(r->detail, sizeof(r->detail), " (%.2f s after the first failure)", r->fail_time - d->ff_time);
            break;
        }
        default: /* waiting, stopped, unknown */
            if (d->ff_in && is_collective(d->ff_in) && streq(d->ff_cause, "hang") && in_group(hang_group, q) &&
                r->n_flight > 0 && last_seq(r, d->ff_in->gid) < d->ff_in->seq && d->culprit >= 0) {
                r->verdict = AM_VERDICT_STRAGGLER;
                snprintf(r->detail, sizeof(r->detail), "never issued %s #%llu of group %s either (stopped at step %ld)",
                         d->ff_in->op, (unsigned long long)d->ff_in->seq, d->ff_in->group, r->step);
                break;
            }
            if (d->culprit >= 0 || streq(d->ff_cause, "hang")) {
                r->verdict = AM_VERDICT_VICTIM;
                victim_detail(d, r, r->detail, sizeof(r->detail));
            } else if (r->end == AM_END_UNKNOWN) {
                r->verdict = AM_VERDICT_UNKNOWN;
                snprintf(r->detail, sizeof(r->detail), "its log ends without a record of its end (last record at "
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
    for (int i = 0; i < d->n_mismatches; i++) /* one per group, sequence number and kind */
        if (d->mismatches[i].gid == f->gid && d->mismatches[i].seq == f->seq && strcmp(d->mismatches[i].what, what) == 0)
            return;
    struct am_diag_mismatch *m = realloc(d->mismatches, (size_t)(d->n_mismatches + 1) * sizeof(*m));
    if (!m)
        return;
    d->mismatches = m;
    m = &d->mismatches[d->n_mismatches++];
    memset(m, 0, sizeof(*m));
    snprintf(m->group, sizeof(m->group), "%s", f->group);
    snprintf(m->what, sizeof(m->what), "%s", what);
    m->gid = f->gid;
    m->seq = f->seq;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m->text, sizeof(m->text), fmt, ap);
    va_end(ap);
}

static void mismatches(struct am_diag *d)
{
    for (int a = 0; a < d->n_ranks; a++) {
        const struct am_diag_rank *ra = &d->ranks[a];
        for (size_t i = 0; i < ra->n_flight; i++) {
            const struct am_diag_flight *fa = &ra->flight[i];
            if (!is_collective(fa))
                continue;
            for (int b = a + 1; b < d->n_ranks; b++) {
                const struct am_diag_flight *fb = find_call(&d->ranks[b], fa->gid, fa->seq);
                if (!fb)
                    continue;
                if (strcmp(fa->op, fb->op) != 0)
                    mismatch(d, "op", fa, "%s #%llu of group %s: rank %d called %s, rank %d called %s", fa->op,
                             (unsigned long long)fa->seq, fa->group, a, fa->op, b, fb->op);
                else if (strcmp(fa->dtype, fb->dtype) != 0 || fa->count != fb->count)
                    mismatch(d, "size", fa, "%s #%llu of group %s: rank %d passed %llu %s, rank %d passed %llu %s",
                             fa->op, (unsigned long long)fa->seq, fa->group, a, (unsigned long long)fa->count,
                             fa->dtype, b, (unsigned long long)fb->count, fb->dtype);
            }
        }
    }
    /* stuck in collectives of one group two or more apart: a rank cannot complete #k without
     * every member, so one of them counted its calls differently (one apart is the ordinary
     * race of ranks that finished #k while a peer had not yet seen it finish) */
    for (int a = 0; a < d->n_ranks; a++) {
        const struct am_diag_flight *ia = d->ranks[a].in;
        if (!ia || !is_collective(ia))
            continue;
        for (int b = a + 1; b < d->n_ranks; b++) {
            const struct am_diag_flight *ib = d->ranks[b].in;
            if (ib && is_collective(ib) && ib->gid == ia->gid && (ib->seq >= ia->seq + 2 || ia->seq >= ib->seq + 2))
                mismatch(d, "sequence", ia, "group %s: rank %d is stuck in %s #%llu, rank %d in %s #%llu", ia->group,
                         a, ia->op, (unsigned long long)ia->seq, b, ib->op, (unsigned long long)ib->seq);
        }
    }
}

void am_diag_analyze(struct am_diag *d)
{
    if (d->world < 0) {
        d->world = d->n_ranks;
        am_diag_note(d, "no start record in any log: the job's size is unknown; assuming %d ranks (the highest rank "
                     "with a log, plus one)", d->world);
    }
    if (d->world > d->n_ranks)
        am_diag_rank_get(d, d->world - 1);
    for (int q = 0; q < d->n_ranks; q++) {
        struct am_diag_rank *r = &d->ranks[q];
        if (r->have_log && !r->have_start)
            am_diag_note(d, "rank %d: its log has no start record (it failed before training began?)", q);
        if (r->have_log)
            classify(r);
    }
    first_failure(d);
    verdicts(d);
    mismatches(d);
    if (d->n_mismatches && !d->ff_cause) {
        d->ff_cause = "mismatch";
        snprintf(d->ff_detail, sizeof(d->ff_detail), "%s", d->mismatches[0].text);
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
