/* diag_report.c - am-diag's output: the human report and the JSON object (diag.h). */
#include "diag.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- untrusted text: escaped for the terminal, valid UTF-8 for JSON ----------------------- */

/* The length of the well-formed UTF-8 sequence at s (1-4), or 0 (not one: overlong, surrogate,
 * above U+10FFFF, cut short). */
static size_t utf8_len(const unsigned char *s)
{
    unsigned c = s[0];
    if (c < 0x80)
        return 1;
    size_t n = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 0;
    for (size_t i = 1; i < n; i++)
        if ((s[i] & 0xC0) != 0x80)
            return 0;
    if ((n == 3 && c == 0xE0 && s[1] < 0xA0) || (n == 3 && c == 0xED && s[1] >= 0xA0) ||
        (n == 4 && c == 0xF0 && s[1] < 0x90) || (n == 4 && c == 0xF4 && s[1] >= 0x90))
        return 0;
    return n;
}

size_t am_diag_escape(const char *s, char *out, size_t len)
{
    size_t at = 0;
    if (len == 0)
        return 0;
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        char unit[8];
        size_t n = 0, take = 1, u = utf8_len(p);
        if (*p == '\\' || *p == '\n' || *p == '\r' || *p == '\t') {
            unit[0] = '\\';
            unit[1] = *p == '\\' ? '\\' : *p == '\n' ? 'n' : *p == '\r' ? 'r' : 't';
            n = 2;
        } else if (*p >= 0x20 && *p < 0x7F) {
            unit[0] = (char)*p;
            n = 1;
        } else if (u > 1 && !(p[0] == 0xC2 && p[1] < 0xA0)) { /* UTF-8, but not the C1 controls */
            memcpy(unit, p, u);
            n = take = u;
        } else {
            n = (size_t)snprintf(unit, sizeof(unit), "\\x%02x", *p);
        }
        if (at + n + 1 > len)
            break;
        memcpy(out + at, unit, n);
        at += n;
        p += take;
    }
    out[at] = '\0';
    return at;
}

/* Prints untrusted text escaped. */
static void put(FILE *f, const char *s)
{
    size_t n = strlen(s ? s : "") * 4 + 1;
    char small[1024], *buf = n <= sizeof(small) ? small : malloc(n);
    if (!buf)
        return;
    am_diag_escape(s ? s : "", buf, n);
    fputs(buf, f);
    if (buf != small)
        free(buf);
}

/* A JSON string of any text: malformed UTF-8 bytes become U+FFFD, so that no key is dropped. */
static json_t *jstr(const char *s)
{
    json_t *j = json_string(s ? s : "");
    if (j)
        return j;
    size_t n = strlen(s), at = 0;
    char *b = malloc(3 * n + 1);
    if (!b)
        return json_string("");
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        size_t u = utf8_len(p);
        if (u == 0) {
            memcpy(b + at, "\xEF\xBF\xBD", 3);
            at += 3;
            p++;
        } else {
            memcpy(b + at, p, u);
            at += u;
            p += u;
        }
    }
    b[at] = '\0';
    j = json_string(b);
    free(b);
    return j ? j : json_string("");
}

static const char *const coord_names[6] = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"};

/* "2026-11-29 23:57:44.858 UTC", or "unknown time". */
static void when(double t, char *buf, size_t len)
{
    if (!(t > 0 && t < 253402300800.0)) { /* not a time from 1970 to 9999 (NaN included) */
        snprintf(buf, len, "unknown time");
        return;
    }
    time_t s = (time_t)t;
    struct tm tm;
    char day[32];
    gmtime_r(&s, &tm);
    strftime(day, sizeof(day), "%Y-%m-%d %H:%M:%S", &tm);
    snprintf(buf, len, "%s.%03d UTC", day, (int)((t - (double)s) * 1000));
}

static void coords_text(const struct am_diag_rank *r, char *buf, size_t len)
{
    buf[0] = '\0';
    if (!r->have_coords)
        return;
    size_t at = 0;
    for (int i = 0; i < 6 && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s %d", i ? ", " : "", coord_names[i], r->coords[i]);
}

/* "0-2, 4, 6-7": the runs, cut with ", ..." when the buffer is full. */
static void runs_text(const struct am_diag_range *runs, int n, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (at + 32 >= len) {
            snprintf(buf + at, len - at, ", ...");
            return;
        }
        if (runs[i].hi > runs[i].lo)
            at += (size_t)snprintf(buf + at, len - at, "%s%d-%d", at ? ", " : "", runs[i].lo, runs[i].hi);
        else
            at += (size_t)snprintf(buf + at, len - at, "%s%d", at ? ", " : "", runs[i].lo);
    }
}

/* The runs of the entries (sorted by rank) that satisfy keep(); returns their count. */
static int entry_runs(const struct am_diag *d, struct am_diag_range *runs, int (*keep)(const struct am_diag *,
                      const struct am_diag_rank *, int), int arg, long *count)
{
    int n = 0;
    *count = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        if (!keep(d, &d->ranks[q], arg))
            continue;
        int r = d->ranks[q].rank;
        ++*count;
        if (n > 0 && runs[n - 1].hi == r - 1)
            runs[n - 1].hi = r;
        else
            runs[n++] = (struct am_diag_range){r, r};
    }
    return n;
}

static int has_verdict(const struct am_diag *d, const struct am_diag_rank *r, int v)
{
    (void)d;
    return r->verdict == (enum am_diag_verdict)v;
}

static const json_t *backtrace_of(const struct am_diag *d)
{
    const struct am_diag_rank *r = am_diag_rank_find(d, d->culprit);
    if (!r || !r->cause)
        return NULL;
    const json_t *bt = json_object_get(r->cause, "backtrace");
    return json_is_array(bt) ? bt : NULL;
}

#define TOP_FRAMES 4

/* The missing ranks (no log) but the culprit: the runs of d->missing with it cut out. */
static int missing_runs(const struct am_diag *d, struct am_diag_range *runs, long *count)
{
    int n = 0;
    *count = 0;
    for (int i = 0; i < d->n_missing_ranges; i++) {
        struct am_diag_range m = d->missing[i];
        *count += (long)m.hi - m.lo + 1;
        if (d->culprit >= m.lo && d->culprit <= m.hi) {
            --*count;
            if (d->culprit > m.lo)
                runs[n++] = (struct am_diag_range){m.lo, d->culprit - 1};
            if (d->culprit < m.hi)
                runs[n++] = (struct am_diag_range){d->culprit + 1, m.hi};
        } else {
            runs[n++] = m;
        }
    }
    return n;
}

/* The last committed checkpoint any rank logged (NULL: none), and the highest step whose save
 * began after it without a record of its end (0: none) on rank *who. */
static const json_t *last_checkpoint(const struct am_diag *d, long *interrupted, int *who, int *any)
{
    const json_t *best = NULL;
    long best_step = 0;
    *interrupted = 0;
    *who = -1;
    *any = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        long s = r->ckpt ? (long)json_integer_value(json_object_get(r->ckpt, "step")) : 0;
        *any |= r->ckpt || r->ckpt_started;
        if (r->ckpt && (!best || s > best_step)) {
            best = r->ckpt;
            best_step = s;
        }
    }
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        if (r->ckpt_started > best_step && r->ckpt_started > *interrupted) {
            *interrupted = r->ckpt_started;
            *who = r->rank;
        }
    }
    return best;
}

void am_diag_print_summary(const struct am_diag *d, FILE *f)
{
    char t[64], c[160], list[512];
    struct am_diag_range *runs = calloc((size_t)(d->n_ranks > d->n_missing_ranges ? d->n_ranks : d->n_missing_ranges)
                                        + 2, sizeof(*runs));
    if (!runs)
        return;
    fputs("am-diag: job ", f);
    put(f, d->job[0] ? d->job : "?");
    fputs(" (", f);
    put(f, d->dir);
    fprintf(f, "): %d rank%s, %s\n", d->world, d->world == 1 ? "" : "s", d->failed ? "FAILED" : "clean");
    const struct am_diag_rank *cr = am_diag_rank_find(d, d->culprit);
    if (d->ff_cause && cr) {
        when(cr->have_log ? d->ff_time : 0, t, sizeof(t));
        coords_text(cr, c, sizeof(c));
        fprintf(f, "first failure: rank %d on ", d->culprit);
        put(f, cr->host[0] ? cr->host : "(unknown host)");
        if (cr->local_rank >= 0)
            fprintf(f, " (local rank %d%s%s)", cr->local_rank, c[0] ? "; " : "", c);
        if (d->ff_step > 0)
            fprintf(f, " at step %ld", d->ff_step);
        fprintf(f, ", %s\n  cause: %s: ", t, d->ff_cause);
        put(f, d->ff_detail);
        fputs("\n", f);
        const json_t *bt = backtrace_of(d);
        for (size_t i = 0; bt && i < json_array_size(bt) && i < TOP_FRAMES; i++) {
            fprintf(f, "  %s ", i ? "     " : "at:  ");
            put(f, json_string_value(json_array_get(bt, i)));
            fputs("\n", f);
        }
    } else if (d->ff_cause) {
        when(d->ff_time, t, sizeof(t));
        fprintf(f, "first failure: no rank (%s), %s\n  ", d->ff_cause, t);
        put(f, d->ff_detail);
        fputs("\n", f);
    } else {
        fprintf(f, "no failure: every rank with a log finished cleanly\n");
    }
    static const enum am_diag_verdict order[] = {AM_VERDICT_VICTIM, AM_VERDICT_FAILED, AM_VERDICT_STRAGGLER,
                                                 AM_VERDICT_STOPPED, AM_VERDICT_UNKNOWN, AM_VERDICT_CLEAN,
                                                 AM_VERDICT_MISSING};
    fprintf(f, "others:");
    int any = 0;
    for (size_t k = 0; k < sizeof(order) / sizeof(order[0]); k++) {
        long n = 0;
        int nr = order[k] == AM_VERDICT_MISSING ? missing_runs(d, runs, &n)
                                                : entry_runs(d, runs, has_verdict, (int)order[k], &n);
        if (!n)
            continue;
        runs_text(runs, nr, list, sizeof(list));
        int plural = n > 1 && (order[k] == AM_VERDICT_VICTIM || order[k] == AM_VERDICT_STRAGGLER);
        fprintf(f, "%s %ld %s%s (rank%s %s)", any ? "," : "", n, am_diag_verdict_name(order[k]), plural ? "s" : "",
                n == 1 ? "" : "s", list);
        any = 1;
    }
    fprintf(f, "%s\n", any ? "" : " none");
    runs_text(d->missing, d->n_missing_ranges, list, sizeof(list));
    fprintf(f, "missing logs: %s\n", d->n_missing ? list : "none");
    fprintf(f, "mismatches: %s\n", d->n_mismatches ? "" : "none");
    for (int i = 0; i < d->n_mismatches; i++) {
        fprintf(f, "  %s: ", d->mismatches[i].what);
        put(f, d->mismatches[i].text);
        fputs("\n", f);
    }
    if (d->more_mismatches)
        fprintf(f, "  (and %d more, not listed)\n", d->more_mismatches);
    long interrupted;
    int who, saves;
    const json_t *ck = last_checkpoint(d, &interrupted, &who, &saves);
    if (saves) { /* only for jobs that save checkpoints */
        if (ck) {
            when(json_number_value(json_object_get(ck, "time")), t, sizeof(t));
            fprintf(f, "last checkpoint: step %lld, %s, ", (long long)json_integer_value(json_object_get(ck, "step")), t);
            put(f, json_string_value(json_object_get(ck, "dir")) ? json_string_value(json_object_get(ck, "dir")) : "?");
            fputs("\n", f);
        } else {
            fprintf(f, "last checkpoint: none completed\n");
        }
        if (interrupted)
            fprintf(f, "  the save of step %ld did not complete (rank %d began it): a restore takes %s\n", interrupted,
                    who, ck ? "the checkpoint above" : "nothing (the run starts again)");
    }
    free(runs);
}

void am_diag_print_rank(const struct am_diag *d, const struct am_diag_rank *r, FILE *f)
{
    (void)d;
    fprintf(f, "rank %d", r->rank);
    if (r->host[0]) {
        fputs(" on ", f);
        put(f, r->host);
    }
    fprintf(f, ": %s: ", am_diag_verdict_name(r->verdict));
    put(f, r->detail);
}

void am_diag_print(const struct am_diag *d, FILE *f)
{
    am_diag_print_summary(d, f);
    fprintf(f, "\ndetails:\n");
    int next = 0; /* ranks below it are printed */
    for (int q = 0; q <= d->n_ranks; q++) {
        int upto = q < d->n_ranks ? d->ranks[q].rank : d->world;
        if (upto > d->world)
            upto = d->world;
        if (upto - next == 1) /* ranks of the job that no log names: missing, in one line */
            fprintf(f, "  rank %d: missing: no log, and no other log names it\n", next);
        else if (upto > next)
            fprintf(f, "  ranks %d-%d: missing: no log, and no other log names them\n", next, upto - 1);
        if (q == d->n_ranks)
            break;
        const struct am_diag_rank *r = &d->ranks[q];
        next = r->rank + 1 > next ? r->rank + 1 : next;
        fputs("  ", f);
        am_diag_print_rank(d, r, f);
        fputs("\n", f);
        if (r->fault) {
            fputs("      (injected: AM_FAULT=", f);
            put(f, json_string_value(json_object_get(r->fault, "spec")));
            fputs(")\n", f);
        }
    }
    if (d->n_notes) {
        fprintf(f, "\nnotes:\n");
        for (int i = 0; i < d->n_notes; i++) {
            fputs("  ", f);
            put(f, d->notes[i]);
            fputs("\n", f);
        }
    }
}

static json_t *opt_int(long v, int present) { return present ? json_integer(v) : json_null(); }
static json_t *opt_str(const char *s) { return s && *s ? jstr(s) : json_null(); }

static json_t *coords_json(const struct am_diag_rank *r)
{
    if (!r->have_coords)
        return json_null();
    json_t *o = json_object();
    for (int i = 0; i < 6; i++)
        json_object_set_new(o, coord_names[i], json_integer(r->coords[i]));
    return o;
}

json_t *am_diag_json(const struct am_diag *d)
{
    json_t *o = json_object();
    json_object_set_new(o, "job", opt_str(d->job));
    json_object_set_new(o, "dir", jstr(d->dir));
    json_object_set_new(o, "world", json_integer(d->world));
    json_object_set_new(o, "status", json_string(d->failed ? "failed" : "clean"));
    if (d->ff_cause) {
        const struct am_diag_rank *r = am_diag_rank_find(d, d->culprit);
        json_t *ff = json_object();
        json_object_set_new(ff, "rank", opt_int(d->culprit, d->culprit >= 0));
        json_object_set_new(ff, "host", opt_str(r ? r->host : NULL));
        json_object_set_new(ff, "cause", jstr(d->ff_cause));
        json_object_set_new(ff, "signal", opt_str(d->ff_signal));
        json_object_set_new(ff, "step", opt_int(d->ff_step, d->ff_step > 0));
        json_object_set_new(ff, "status", opt_int(d->ff_status, d->ff_status >= 0));
        json_object_set_new(ff, "local_rank", opt_int(r ? r->local_rank : -1, r && r->local_rank >= 0));
        json_object_set_new(ff, "coords", r ? coords_json(r) : json_null());
        json_object_set_new(ff, "time", d->ff_time > 0 ? json_real(d->ff_time) : json_null());
        json_object_set_new(ff, "detail", jstr(d->ff_detail));
        const json_t *bt = backtrace_of(d);
        json_t *top = json_array();
        for (size_t i = 0; bt && i < json_array_size(bt) && i < TOP_FRAMES; i++)
            json_array_append(top, json_array_get(bt, i));
        json_object_set_new(ff, "backtrace", top);
        if (d->ff_in) {
            json_object_set_new(ff, "group", jstr(d->ff_in->group));
            json_object_set_new(ff, "seq", json_integer((json_int_t)d->ff_in->seq));
            json_object_set_new(ff, "op", jstr(d->ff_in->op));
        }
        if (r && r->cause && json_object_get(r->cause, "tensor"))
            json_object_set(ff, "tensor", json_object_get(r->cause, "tensor"));
        json_object_set_new(o, "first_failure", ff);
    } else {
        json_object_set_new(o, "first_failure", json_null());
    }
    json_t *ranks = json_array(), *missing = json_array();
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        json_t *e = json_object();
        json_object_set_new(e, "rank", json_integer(r->rank));
        json_object_set_new(e, "host", opt_str(r->host));
        json_object_set_new(e, "verdict", json_string(am_diag_verdict_name(r->verdict)));
        json_object_set_new(e, "end", opt_str(r->have_log ? r->kind ? r->kind : "clean" : NULL));
        json_object_set_new(e, "signal", opt_str(r->signal));
        json_object_set_new(e, "status", opt_int(r->status, r->status >= 0));
        json_object_set_new(e, "step", opt_int(r->step, r->step > 0));
        json_object_set_new(e, "group", r->in ? jstr(r->in->group) : json_null());
        json_object_set_new(e, "seq", r->in ? json_integer((json_int_t)r->in->seq) : json_null());
        json_object_set_new(e, "op", r->in ? jstr(r->in->op) : json_null());
        json_object_set_new(e, "waiting_for", opt_int(r->waiting_for, r->waiting_for >= 0));
        const json_t *because = r->stop ? json_object_get(r->stop, "because_rank") : NULL;
        json_object_set_new(e, "stopped_because", json_is_integer(because) && json_integer_value(because) >= 0 &&
                                                      json_integer_value(because) < d->world
                                                      ? json_integer(json_integer_value(because)) : json_null());
        json_object_set_new(e, "detail", jstr(r->detail));
        if (r->ep_step > 0) { /* a straggler whose step records carry its expert load */
            json_t *x = json_object();
            json_object_set_new(x, "step", json_integer(r->ep_step));
            json_object_set_new(x, "tokens_in", json_integer((json_int_t)r->ep_in));
            json_object_set_new(x, "median_tokens_in", json_integer((json_int_t)r->ep_median));
            json_object_set_new(x, "ratio", json_real(r->ep_in / r->ep_median));
            json_object_set_new(x, "overloaded", json_boolean(r->ep_in / r->ep_median >= AM_DIAG_EP_OVERLOAD));
            json_object_set_new(e, "expert_load", x);
        }
        json_array_append_new(ranks, e);
    }
    long listed = 0;
    for (int i = 0; i < d->n_missing_ranges; i++)
        for (long q = d->missing[i].lo; q <= d->missing[i].hi && listed < d->max_listed; q++, listed++)
            json_array_append_new(missing, json_integer(q));
    json_object_set_new(o, "ranks", ranks);
    json_object_set_new(o, "missing_count", json_integer(d->n_missing));
    json_object_set_new(o, "missing_ranks", missing);
    json_t *mm = json_array();
    for (int i = 0; i < d->n_mismatches; i++) {
        json_t *m = json_object();
        json_object_set_new(m, "group", jstr(d->mismatches[i].group));
        json_object_set_new(m, "gid", json_integer(d->mismatches[i].gid));
        json_object_set_new(m, "seq", json_integer((json_int_t)d->mismatches[i].seq));
        json_object_set_new(m, "what", jstr(d->mismatches[i].what));
        json_object_set_new(m, "detail", jstr(d->mismatches[i].text));
        json_array_append_new(mm, m);
    }
    json_object_set_new(o, "mismatches", mm);
    long interrupted;
    int who, any;
    const json_t *ck = last_checkpoint(d, &interrupted, &who, &any);
    json_t *cj = json_pack("{s:o,s:o,s:o,s:o}", "step", ck ? json_integer(json_integer_value(json_object_get(ck, "step"))) : json_null(),
                           "time", ck && json_is_number(json_object_get(ck, "time")) ? json_real(json_number_value(json_object_get(ck, "time"))) : json_null(),
                           "dir", opt_str(ck ? json_string_value(json_object_get(ck, "dir")) : NULL),
                           "interrupted_step", opt_int(interrupted, interrupted > 0));
    if (any) /* only for jobs that save checkpoints */
        json_object_set_new(o, "checkpoint", cj);
    else
        json_decref(cj);
    json_t *notes = json_array();
    for (int i = 0; i < d->n_notes; i++)
        json_array_append_new(notes, jstr(d->notes[i]));
    json_object_set_new(o, "notes", notes);
    return o;
}
