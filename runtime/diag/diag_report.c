/* diag_report.c - am-diag's output: the human report and the JSON object (diag.h). */
#include "diag.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

static const char *const coord_names[6] = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"};

/* "2026-11-29 23:57:44.858 UTC", or "unknown time". */
static void when(double t, char *buf, size_t len)
{
    if (t <= 0) {
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

/* "0-2, 4, 6-7" */
static void ranks_text(const int *ranks, int n, char *buf, size_t len)
{
    size_t at = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && at + 16 < len;) {
        int j = i;
        while (j + 1 < n && ranks[j + 1] == ranks[j] + 1)
            j++;
        if (j > i)
            at += (size_t)snprintf(buf + at, len - at, "%s%d-%d", at ? ", " : "", ranks[i], ranks[j]);
        else
            at += (size_t)snprintf(buf + at, len - at, "%s%d", at ? ", " : "", ranks[i]);
        i = j + 1;
    }
}

static const json_t *backtrace_of(const struct am_diag *d)
{
    if (d->culprit < 0 || d->culprit >= d->n_ranks || !d->ranks[d->culprit].cause)
        return NULL;
    const json_t *bt = json_object_get(d->ranks[d->culprit].cause, "backtrace");
    return json_is_array(bt) ? bt : NULL;
}

#define TOP_FRAMES 4

void am_diag_print(const struct am_diag *d, FILE *f)
{
    char t[64], c[160], list[512];
    int count[AM_VERDICT_MISSING + 1] = {0};
    for (int q = 0; q < d->n_ranks; q++)
        count[d->ranks[q].verdict]++;
    fprintf(f, "am-diag: job %s (%s): %d rank%s, %s\n", d->job[0] ? d->job : "?", d->dir, d->world,
            d->world == 1 ? "" : "s", d->failed ? "FAILED" : "clean");
    if (d->ff_cause && d->culprit >= 0) {
        const struct am_diag_rank *r = &d->ranks[d->culprit];
        when(r->have_log ? d->ff_time : 0, t, sizeof(t));
        coords_text(r, c, sizeof(c));
        fprintf(f, "first failure: rank %d on %s", d->culprit, r->host[0] ? r->host : "(unknown host)");
        if (r->local_rank >= 0)
            fprintf(f, " (local rank %d%s%s)", r->local_rank, c[0] ? "; " : "", c);
        if (d->ff_step > 0)
            fprintf(f, " at step %ld", d->ff_step);
        fprintf(f, ", %s\n  cause: %s: %s\n", t, d->ff_cause, d->ff_detail);
        const json_t *bt = backtrace_of(d);
        for (size_t i = 0; bt && i < json_array_size(bt) && i < TOP_FRAMES; i++)
            fprintf(f, "  %s %s\n", i ? "     " : "at:  ", json_string_value(json_array_get(bt, i)));
    } else if (d->ff_cause) {
        when(d->ff_time, t, sizeof(t));
        fprintf(f, "first failure: no rank (%s), %s\n  %s\n", d->ff_cause, t, d->ff_detail);
    } else {
        fprintf(f, "no failure: every rank with a log finished cleanly\n");
    }
    static const enum am_diag_verdict order[] = {AM_VERDICT_VICTIM, AM_VERDICT_FAILED, AM_VERDICT_STRAGGLER,
                                                 AM_VERDICT_STOPPED, AM_VERDICT_UNKNOWN, AM_VERDICT_CLEAN,
                                                 AM_VERDICT_MISSING};
    int ranks[4096];
    fprintf(f, "others:");
    int any = 0;
    for (size_t k = 0; k < sizeof(order) / sizeof(order[0]); k++) {
        int n = 0;
        for (int q = 0; q < d->n_ranks && n < 4096; q++)
            if (d->ranks[q].verdict == order[k])
                ranks[n++] = q;
        if (!n)
            continue;
        ranks_text(ranks, n, list, sizeof(list));
        int plural = n > 1 && (order[k] == AM_VERDICT_VICTIM || order[k] == AM_VERDICT_STRAGGLER);
        fprintf(f, "%s %d %s%s (rank%s %s)", any ? "," : "", n, am_diag_verdict_name(order[k]), plural ? "s" : "",
                n == 1 ? "" : "s", list);
        any = 1;
    }
    fprintf(f, "%s\n", any ? "" : " none");
    int n = 0;
    for (int q = 0; q < d->n_ranks && n < 4096; q++)
        if (!d->ranks[q].have_log)
            ranks[n++] = q;
    ranks_text(ranks, n, list, sizeof(list));
    fprintf(f, "missing logs: %s\n", n ? list : "none");
    fprintf(f, "mismatches: %s\n", d->n_mismatches ? "" : "none");
    for (int i = 0; i < d->n_mismatches; i++)
        fprintf(f, "  %s: %s\n", d->mismatches[i].what, d->mismatches[i].text);

    fprintf(f, "\ndetails:\n");
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        fprintf(f, "  rank %d", q);
        if (r->host[0])
            fprintf(f, " on %s", r->host);
        fprintf(f, ": %s: %s\n", am_diag_verdict_name(r->verdict), r->detail);
        if (r->fault)
            fprintf(f, "      (injected: AM_FAULT=%s)\n", json_string_value(json_object_get(r->fault, "spec")));
    }
    if (d->n_notes) {
        fprintf(f, "\nnotes:\n");
        for (int i = 0; i < d->n_notes; i++)
            fprintf(f, "  %s\n", d->notes[i]);
    }
}

static json_t *opt_int(long v, int present) { return present ? json_integer(v) : json_null(); }
static json_t *opt_str(const char *s) { return s && *s ? json_string(s) : json_null(); }

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
    json_object_set_new(o, "dir", json_string(d->dir));
    json_object_set_new(o, "world", json_integer(d->world));
    json_object_set_new(o, "status", json_string(d->failed ? "failed" : "clean"));
    if (d->ff_cause) {
        const struct am_diag_rank *r = d->culprit >= 0 ? &d->ranks[d->culprit] : NULL;
        json_t *ff = json_object();
        json_object_set_new(ff, "rank", opt_int(d->culprit, d->culprit >= 0));
        json_object_set_new(ff, "host", opt_str(r ? r->host : NULL));
        json_object_set_new(ff, "cause", json_string(d->ff_cause));
        json_object_set_new(ff, "signal", opt_str(d->ff_signal));
        json_object_set_new(ff, "step", opt_int(d->ff_step, d->ff_step > 0));
        json_object_set_new(ff, "status", opt_int(d->ff_status, d->ff_status >= 0));
        json_object_set_new(ff, "local_rank", opt_int(r ? r->local_rank : -1, r && r->local_rank >= 0));
        json_object_set_new(ff, "coords", r ? coords_json(r) : json_null());
        json_object_set_new(ff, "time", d->ff_time > 0 ? json_real(d->ff_time) : json_null());
        json_object_set_new(ff, "detail", json_string(d->ff_detail));
        const json_t *bt = backtrace_of(d);
        json_t *top = json_array();
        for (size_t i = 0; bt && i < json_array_size(bt) && i < TOP_FRAMES; i++)
            json_array_append(top, json_array_get(bt, i));
        json_object_set_new(ff, "backtrace", top);
        if (d->ff_in) {
            json_object_set_new(ff, "group", json_string(d->ff_in->group));
            json_object_set_new(ff, "seq", json_integer((json_int_t)d->ff_in->seq));
            json_object_set_new(ff, "op", json_string(d->ff_in->op));
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
        json_object_set_new(e, "rank", json_integer(q));
        json_object_set_new(e, "host", opt_str(r->host));
        json_object_set_new(e, "verdict", json_string(am_diag_verdict_name(r->verdict)));
        json_object_set_new(e, "end", opt_str(r->have_log ? r->kind ? r->kind : "clean" : NULL));
        json_object_set_new(e, "signal", opt_str(r->signal));
        json_object_set_new(e, "status", opt_int(r->status, r->status >= 0));
        json_object_set_new(e, "step", opt_int(r->step, r->step > 0));
        json_object_set_new(e, "group", r->in ? json_string(r->in->group) : json_null());
        json_object_set_new(e, "seq", r->in ? json_integer((json_int_t)r->in->seq) : json_null());
        json_object_set_new(e, "op", r->in ? json_string(r->in->op) : json_null());
        json_object_set_new(e, "waiting_for", opt_int(r->waiting_for, r->waiting_for >= 0));
        json_object_set_new(e, "stopped_because", r->stop && json_is_integer(json_object_get(r->stop, "because_rank"))
                                                      ? json_incref(json_object_get(r->stop, "because_rank"))
                                                      : json_null());
        json_object_set_new(e, "detail", json_string(r->detail));
        json_array_append_new(ranks, e);
        if (!r->have_log)
            json_array_append_new(missing, json_integer(q));
    }
    json_object_set_new(o, "ranks", ranks);
    json_object_set_new(o, "missing_ranks", missing);
    json_t *mm = json_array();
    for (int i = 0; i < d->n_mismatches; i++)
        json_array_append_new(mm, json_pack("{s:s,s:i,s:I,s:s,s:s}", "group", d->mismatches[i].group, "gid",
                                             d->mismatches[i].gid, "seq", (json_int_t)d->mismatches[i].seq, "what",
                                             d->mismatches[i].what, "detail", d->mismatches[i].text));
    json_object_set_new(o, "mismatches", mm);
    json_t *notes = json_array();
    for (int i = 0; i < d->n_notes; i++)
        json_array_append_new(notes, json_string(d->notes[i]));
    json_object_set_new(o, "notes", notes);
    return o;
}
