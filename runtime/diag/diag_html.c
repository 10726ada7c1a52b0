/* diag_html.c - am-diag's verdict as one self-contained HTML page (diag.h: am_diag_html).
 *
 * The page fetches nothing: CSS, SVG and a little JS are inline. Its sentences are the text
 * report's (am_diag_print_summary, am_diag_print_rank: already escaped for a terminal), escaped
 * again for HTML; the data the JS reads (each rank's line, the cause records) is JSON inside a
 * <script type="application/json"> whose <, > and & are written \u003c, \u003e, \u0026, so no
 * text from a log can close the element or start markup. */
#include "diag.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- escaping ------------------------------------------------------------------------------- */

/* Text already escaped for the terminal, as HTML text or an attribute value. */
static void html_text(FILE *f, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        switch (c) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default: fputc(c, f);
        }
    }
}

/* Untrusted text (a host, a detail): escaped as the text report escapes it, then for HTML. */
static void hput(FILE *f, const char *s)
{
    s = s ? s : "";
    size_t n = strlen(s) * 4 + 1;
    char small[1024], *buf = n <= sizeof(small) ? small : malloc(n);
    if (!buf)
        return;
    size_t len = am_diag_escape(s, buf, n);
    html_text(f, buf, len);
    if (buf != small)
        free(buf);
}

/* A JSON value inside <script type="application/json">: <, > and & as \u escapes (they occur
 * only inside strings, where the escape means the same character). */
static void json_put(FILE *f, const json_t *o)
{
    char *s = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(10));
    for (const char *p = s ? s : "null"; *p; p++) {
        if (*p == '<')
            fputs("\\u003c", f);
        else if (*p == '>')
            fputs("\\u003e", f);
        else if (*p == '&')
            fputs("\\u0026", f);
        else
            fputc(*p, f);
    }
    free(s);
}

/* A text written by the report's printers (into memory), as a string; NULL: no memory. */
static char *printed_rank(const struct am_diag *d, const struct am_diag_rank *r)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    if (!m)
        return NULL;
    am_diag_print_rank(d, r, m);
    fclose(m);
    return buf;
}

/* ---- figures -------------------------------------------------------------------------------- */

/* two decimals: a figure's axis and labels */
static const char *bytes_text(double n, char *buf, size_t len) { return am_diag_bytes_text(n, 2, buf, len); }

static void utc(double t, char *buf, size_t len)
{
    if (!(t > 0 && t < 253402300800.0)) {
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

/* The CSS class of a verdict (its colour). */
static const char *vclass(enum am_diag_verdict v)
{
    switch (v) {
    case AM_VERDICT_FIRST: return "vf";
    case AM_VERDICT_FAILED: return "vx";
    case AM_VERDICT_VICTIM: return "vv";
    case AM_VERDICT_STRAGGLER: return "vs";
    case AM_VERDICT_CLEAN: return "vc";
    default: return "vo";
    }
}

/* Severity, to colour a node by its worst rank. */
static int severity(enum am_diag_verdict v)
{
    switch (v) {
    case AM_VERDICT_FIRST: return 6;
    case AM_VERDICT_FAILED: return 5;
    case AM_VERDICT_STRAGGLER: return 4;
    case AM_VERDICT_VICTIM: return 3;
    case AM_VERDICT_UNKNOWN: case AM_VERDICT_STOPPED: case AM_VERDICT_MISSING: return 2;
    case AM_VERDICT_CLEAN: return 1;
    default: return 0;
    }
}

/* ---- a rank's times ------------------------------------------------------------------------- */

struct span {
    double begin;      /* its (second) start record, 0 unknown */
    double steps_from; /* the first step's beginning, 0: no step */
    double steps_to;   /* the last step record's time */
    double end;        /* its last record */
    double stop;       /* where it stopped: its failure, else its end */
};

static void span_of(const struct am_diag_rank *r, struct span *s)
{
    memset(s, 0, sizeof(*s));
    s->begin = r->start_time;
    if (r->n_steps > 0 && r->step_t0 > 0) {
        const struct am_diag_step *a = &r->steps[0], *z = &r->steps[r->n_steps - 1];
        s->steps_from = r->step_t0 + a->end - (a->step == r->first_step ? r->first_step_s : 0);
        s->steps_to = r->step_t0 + z->end;
    }
    s->end = r->last_time > s->steps_to ? r->last_time : s->steps_to;
    s->stop = r->fail_time > 0 ? r->fail_time : s->end;
    if (s->begin <= 0 || (s->steps_from > 0 && s->begin > s->steps_from))
        s->begin = s->steps_from;
}

/* ---- the page ------------------------------------------------------------------------------- */

#define PAGE_W 1200 /* the SVGs' width: labels, then the plot */
#define LABEL_W 150
#define PLOT_W (PAGE_W - LABEL_W - 20)
#define LANE_H 14

struct html {
    const struct am_diag *d;
    FILE *f;
    double t0, t1;   /* the timeline's wall-clock range (the zoomed one's while it is drawn) */
    double origin;   /* the whole timeline's start: 0 s on both axes */
    int zoom;        /* drawing the end, zoomed: lanes without their titles */
    int *order;      /* rank entries by node (host), then rank */
    int n_order;
    int *runs;       /* order[runs[i]..runs[i+1]) is one node; n_runs nodes */
    int n_runs;
    int large;       /* more ranks than AM_DIAG_HTML_LANES: lanes per node */
    double *lane_y;  /* per entry: its lane's middle, -1 when it has none */
};

static double X(const struct html *h, double t)
{
    double x = LABEL_W + (t - h->t0) / (h->t1 - h->t0) * PLOT_W;
    return x < LABEL_W ? LABEL_W : x > LABEL_W + PLOT_W ? LABEL_W + PLOT_W : x;
}

static const struct am_diag *sort_d;
static int by_host(const void *a, const void *b)
{
    const struct am_diag_rank *x = &sort_d->ranks[*(const int *)a], *y = &sort_d->ranks[*(const int *)b];
    int c = strcmp(x->host[0] ? x->host : "\x7f", y->host[0] ? y->host : "\x7f");
    return c ? c : (x->rank > y->rank) - (x->rank < y->rank);
}

static int *sort_runs_order;
static int by_first_rank(const void *a, const void *b)
{
    int x = sort_d->ranks[sort_runs_order[((const int *)a)[0]]].rank;
    int y = sort_d->ranks[sort_runs_order[((const int *)b)[0]]].rank;
    return (x > y) - (x < y);
}

/* Orders the entries by node, nodes by their lowest rank. 0, or -1 (no memory). */
static int group_by_node(struct html *h)
{
    const struct am_diag *d = h->d;
    h->order = malloc(((size_t)d->n_ranks + 1) * sizeof(int));
    int *start = malloc(((size_t)d->n_ranks + 1) * 2 * sizeof(int));
    h->runs = malloc(((size_t)d->n_ranks + 2) * sizeof(int));
    if (!h->order || !start || !h->runs) {
        free(start);
        return -1;
    }
    for (int q = 0; q < d->n_ranks; q++)
        h->order[q] = q;
    h->n_order = d->n_ranks;
    sort_d = d;
    qsort(h->order, (size_t)d->n_ranks, sizeof(int), by_host);
    int n = 0; /* (start, length) pairs of each host's entries */
    for (int i = 0; i < d->n_ranks; i++)
        if (i == 0 || strcmp(d->ranks[h->order[i]].host, d->ranks[h->order[i - 1]].host) != 0) {
            start[2 * n] = i;
            start[2 * n + 1] = 0;
            n++;
        }
    for (int k = 0; k < n; k++)
        start[2 * k + 1] = (k + 1 < n ? start[2 * k + 2] : d->n_ranks) - start[2 * k];
    sort_runs_order = h->order;
    qsort(start, (size_t)n, 2 * sizeof(int), by_first_rank);
    int *o = malloc(((size_t)d->n_ranks + 1) * sizeof(int));
    if (!o) {
        free(start);
        return -1;
    }
    int at = 0;
    for (int k = 0; k < n; k++) {
        h->runs[k] = at;
        for (int j = 0; j < start[2 * k + 1]; j++)
            o[at++] = h->order[start[2 * k] + j];
    }
    h->runs[n] = at;
    h->n_runs = n;
    free(h->order);
    h->order = o;
    free(start);
    return 0;
}

static const char css[] =
    "body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fff}"
    "h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:22px 0 6px}"
    "#verdict{border-left:6px solid #c62828;background:#fff5f5;padding:8px 12px;font:13px/1.5 monospace}"
    "#verdict div{white-space:pre-wrap;overflow-wrap:anywhere}#verdict.clean{border-color:#2e7d32;background:#f3fbf3}"
    "#verdict .ff,#verdict .cause{font-weight:bold}#verdict .cause{color:#b71c1c}"
    ".legend span{display:inline-block;margin-right:14px}.legend i{display:inline-block;width:12px;height:10px;"
    "margin-right:4px;vertical-align:middle;border-radius:2px}"
    "svg{display:block;font:11px monospace}svg text{fill:#333}.node text{font-weight:bold}"
    ".su{fill:#d8d8d8}.st{fill:#90b4dc}.tk{stroke:#fff;stroke-width:1}.tl{fill:#f3c98b}.cw{fill:#e07b00}"
    ".sl{fill:#8e44ad}.ax{stroke:#bbb;stroke-width:.5}.ffl{stroke:#c62828;stroke-width:1.5;stroke-dasharray:4 3}"
    ".wf{stroke:#e07b00;stroke-width:.8;fill:none;opacity:.55}.sep{stroke:#999;stroke-width:.5}"
    ".vf{fill:#c62828}.vx{fill:#ef5350}.vv{fill:#e07b00}.vs{fill:#8e44ad}.vc{fill:#2e7d32}.vo{fill:#888}"
    "[data-r]{cursor:pointer}[data-r]:hover rect.st{fill:#6f9acb}"
    "table{border-collapse:collapse;font:12px monospace}td,th{border:1px solid #ddd;padding:2px 6px;"
    "text-align:left;vertical-align:top}tr.ffrow{background:#fff0e0}"
    "#panel{display:none;position:fixed;right:12px;bottom:12px;width:560px;max-height:45vh;overflow:auto;"
    "background:#fafafa;border:1px solid #999;box-shadow:0 2px 8px #0003;padding:6px 10px}#panel.on{display:block}"
    "#close{float:right;cursor:pointer;border:0;background:none;font-size:16px}#pd{font:12px monospace;white-space:pre-wrap}"
    "#pc{font:11px monospace;white-space:pre-wrap;margin:4px 0 0;color:#444}"
    ".mem .al{fill:#90b4dc}.mem .pk{fill:#1f5fa0}.mem .pl{stroke:#c62828;stroke-width:1.5}.mem .oo{fill:#c62828}"
    ".note{color:#666}";

static const char js[] =
    "(function(){var D=null;" /* parsed at the first look-up, not while the page loads */
    "var pd=document.getElementById('pd'),pc=document.getElementById('pc');"
    "var P=document.getElementById('panel');document.getElementById('close').onclick=function(){P.className='';};"
    "function show(r){D=D||JSON.parse(document.getElementById('am-data').textContent);"
    "r=String(r).trim();var l=D.lines[r];P.className='on';"
    "pd.textContent=l!==undefined?l:('rank '+r+': '+(D.cut?'not kept in this page (am-diag LOGDIR prints it)':'no log names it'));"
    "var c=D.causes[r];pc.textContent=c?'cause record: '+JSON.stringify(c,null,1):(l!==undefined?"
    "(D.cut?'(no cause record kept in this page)':'(no cause record)'):'');}"
    "document.addEventListener('click',function(e){var g=e.target.closest&&e.target.closest('[data-r]');"
    "if(g)show(g.getAttribute('data-r'));});"
    "document.getElementById('find').addEventListener('change',function(e){show(e.target.value);});"
    "document.documentElement.setAttribute('data-am','ready');})();"; /* the script ran: tests read it */

static void legend(FILE *f)
{
    static const struct {
        const char *color, *what;
    } items[] = {{"#d8d8d8", "setup"}, {"#90b4dc", "steps (ticks: step ends)"}, {"#8e44ad", "a straggler's slow step"},
                 {"#f3c98b", "the step it ended in"}, {"#e07b00", "waiting in its last call"},
                 {"#c62828", "first failure"}, {"#ef5350", "failed too"}, {"#2e7d32", "clean end"},
                 {"#888", "stopped / unknown"}};
    fputs("<div class=\"legend\">", f);
    for (size_t i = 0; i < sizeof(items) / sizeof(items[0]); i++)
        fprintf(f, "<span><i style=\"background:%s\"></i>%s</span>", items[i].color, items[i].what);
    fputs("</div>\n", f);
}

/* The steps of one rank as a bar with a tick at each step's end (at least gap px apart: the
 * path's moves relative, its numbers short). */
static void steps_bar(struct html *h, const struct am_diag_rank *r, const struct span *s, double y, double gap)
{
    FILE *f = h->f;
    if (s->steps_from <= 0)
        return;
    double a = X(h, s->steps_from), b = X(h, s->steps_to);
    fprintf(f, "<rect class=\"st\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%d\"/>", a, y - 5, b - a > 0.5 ? b - a : 0.5,
            10);
    double last = -10;
    int any = 0;
    for (size_t i = 0; i < r->n_steps; i++) {
        double x = X(h, r->step_t0 + r->steps[i].end);
        if (x - last < gap || x >= b - 1)
            continue;
        x = round(x * 10) / 10; /* where the path is: no rounding adds up over the moves */
        if (any)
            fprintf(f, "m%.1f-10v10", x - last);
        else
            fprintf(f, "<path class=\"tk\" d=\"M%.1f %.1fv10", x, y - 5);
        any = 1;
        last = x;
    }
    if (any)
        fputs("\"/>", f);
    if (r->verdict == AM_VERDICT_STRAGGLER && r->slow_step > 0) /* its slow step */
        for (size_t i = 0; i < r->n_steps; i++)
            if (r->steps[i].step == (uint32_t)r->slow_step) {
                double e = r->step_t0 + r->steps[i].end;
                double from = i > 0 ? r->step_t0 + r->steps[i - 1].end : s->steps_from;
                fprintf(f, "<rect class=\"sl\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"10\"/>", X(h, from), y - 5,
                        X(h, e) - X(h, from) > 1 ? X(h, e) - X(h, from) : 1);
                break;
            }
}

static void marker(FILE *f, enum am_diag_verdict v, double x, double y)
{
    if (v == AM_VERDICT_FIRST)
        fprintf(f, "<path class=\"vf\" d=\"M%.1f %.1fl6 6l-6 6l-6-6z\"/>", x, y - 6);
    else
        fprintf(f, "<circle class=\"%s\" cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\"/>", vclass(v), x, y);
}

/* One rank's lane at y (its middle). */
static void rank_lane(struct html *h, int q, double y)
{
    const struct am_diag *d = h->d;
    const struct am_diag_rank *r = &d->ranks[q];
    FILE *f = h->f;
    struct span s;
    span_of(r, &s);
    h->lane_y[q] = y;
    fprintf(f, "<g data-r=\"%d\">", r->rank);
    if (!h->zoom) { /* the zoomed view's lanes: the same ranks, no second copy of the titles */
        fputs("<title>", f);
        char *line = printed_rank(d, r);
        if (line)
            html_text(f, line, strlen(line));
        free(line);
        fputs("</title>", f);
    }
    fprintf(f, "<text x=\"8\" y=\"%.1f\">rank %d</text>", y + 4, r->rank);
    if (!r->have_log) {
        fprintf(f, "<text x=\"%d\" y=\"%.1f\" class=\"note\">no log</text></g>\n", LABEL_W + 4, y + 4);
        return;
    }
    if (s.begin > 0 && s.steps_from > s.begin)
        fprintf(f, "<rect class=\"su\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"10\"/>", X(h, s.begin), y - 5,
                X(h, s.steps_from) - X(h, s.begin));
    steps_bar(h, r, &s, y, 4);
    double from = s.steps_to > 0 ? s.steps_to : s.begin;
    if (from > 0 && s.stop > from && r->verdict != AM_VERDICT_CLEAN)
        fprintf(f, "<rect class=\"tl\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"10\"/>", X(h, from), y - 5,
                X(h, s.stop) - X(h, from));
    if (r->in && r->in->started > 0 && s.stop > r->in->started)
        fprintf(f, "<rect class=\"cw\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"4\"/>", X(h, r->in->started), y - 2,
                X(h, s.stop) - X(h, r->in->started) > 1 ? X(h, s.stop) - X(h, r->in->started) : 1);
    if (s.stop > 0)
        marker(f, r->verdict, X(h, s.stop), y);
    fputs("</g>\n", f);
}

/* One node's lane: its ranks together (their span, the first rank's steps, the worst end). */
static void node_lane(struct html *h, int k, double y)
{
    const struct am_diag *d = h->d;
    FILE *f = h->f;
    int a = h->runs[k], b = h->runs[k + 1], worst = h->order[a], counts[AM_VERDICT_MISSING + 1] = {0};
    int lo = d->ranks[h->order[a]].rank, hi = lo, stepper = -1;
    struct span all = {0};
    for (int i = a; i < b; i++) {
        int q = h->order[i];
        const struct am_diag_rank *r = &d->ranks[q];
        struct span s;
        span_of(r, &s);
        counts[r->verdict]++;
        lo = r->rank < lo ? r->rank : lo;
        hi = r->rank > hi ? r->rank : hi;
        if (severity(r->verdict) > severity(d->ranks[worst].verdict))
            worst = q;
        if (stepper < 0 && s.steps_from > 0)
            stepper = q;
        if (s.begin > 0 && (all.begin == 0 || s.begin < all.begin))
            all.begin = s.begin;
        if (s.steps_from > 0 && (all.steps_from == 0 || s.steps_from < all.steps_from))
            all.steps_from = s.steps_from;
        all.steps_to = s.steps_to > all.steps_to ? s.steps_to : all.steps_to;
        all.end = s.stop > all.end ? s.stop : all.end;
    }
    const struct am_diag_rank *w = &d->ranks[worst];
    struct span ws;
    span_of(w, &ws);
    h->lane_y[worst] = h->lane_y[worst] >= 0 ? h->lane_y[worst] : y;
    fprintf(f, "<g data-r=\"%d\">", w->rank);
    if (!h->zoom) {
        fputs("<title>node ", f);
        hput(f, w->host[0] ? w->host : "(unknown host)");
        fprintf(f, ": %d rank%s (%d to %d):", b - a, b - a == 1 ? "" : "s", lo, hi);
        for (int v = AM_VERDICT_FIRST; v <= AM_VERDICT_MISSING; v++)
            if (counts[v])
                fprintf(f, " %d %s", counts[v], am_diag_verdict_name((enum am_diag_verdict)v));
        fputs("; its worst: ", f);
        char *line = printed_rank(d, w);
        if (line)
            html_text(f, line, strlen(line));
        free(line);
        fputs("</title>", f);
    }
    fprintf(f, "<text x=\"8\" y=\"%.1f\">", y + 4);
    char host[24];
    size_t hn = strlen(w->host[0] ? w->host : "?");
    hn = hn < sizeof(host) - 1 ? hn : sizeof(host) - 1;
    memcpy(host, w->host[0] ? w->host : "?", hn);
    host[hn] = '\0';
    am_diag_utf8_trim(host);
    hput(f, host);
    fprintf(f, " x%d</text>", b - a);
    if (all.begin > 0 && all.steps_from > all.begin)
        fprintf(f, "<rect class=\"su\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"10\"/>", X(h, all.begin), y - 5,
                X(h, all.steps_from) - X(h, all.begin));
    if (stepper >= 0) {
        struct span s;
        span_of(&d->ranks[stepper], &s);
        s.steps_from = all.steps_from;
        steps_bar(h, &d->ranks[stepper], &s, y, 8);
    }
    double from = all.steps_to > 0 ? all.steps_to : all.begin;
    if (from > 0 && all.end > from && w->verdict != AM_VERDICT_CLEAN)
        fprintf(f, "<rect class=\"tl\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"10\"/>", X(h, from), y - 5,
                X(h, all.end) - X(h, from));
    if (ws.stop > 0)
        marker(f, w->verdict, X(h, ws.stop), y);
    fputs("</g>\n", f);
}

/* The ranks shown in lanes of their own in a large job: the first failure, the members of its
 * groups (at most 32 of each), the ranks it waited for, the failed and the stragglers. */
static void pick(char *keep, int q, int *n, int cap)
{
    if (q >= 0 && !keep[q] && *n < cap) {
        keep[q] = 1;
        ++*n;
    }
}

static int entry_of(const struct am_diag *d, int rank)
{
    const struct am_diag_rank *r = am_diag_rank_find(d, rank);
    return r ? (int)(r - d->ranks) : -1;
}

static void choose(const struct am_diag *d, char *keep)
{
    enum { CAP = 160 };
    int n = 0;
    const struct am_diag_rank *c = am_diag_rank_find(d, d->culprit);
    pick(keep, entry_of(d, d->culprit), &n, CAP);
    for (int q = 0; q < d->n_ranks; q++)
        if (d->ranks[q].verdict == AM_VERDICT_FAILED || d->ranks[q].verdict == AM_VERDICT_STRAGGLER)
            pick(keep, q, &n, CAP / 2);
    for (int g = 0; c && g < c->n_groups; g++)
        for (int i = 0; i < c->groups[g].n && i < 32; i++)
            pick(keep, entry_of(d, c->groups[g].ranks[i]), &n, CAP);
    for (int q = 0; q < d->n_ranks; q++)
        if (keep[q] && d->ranks[q].waiting_for >= 0)
            pick(keep, entry_of(d, d->ranks[q].waiting_for), &n, CAP);
}

static void nice_axis(struct html *h, double top, double bottom)
{
    FILE *f = h->f;
    double span = h->t1 - h->t0, step = pow(10, floor(log10(span / 8)));
    if (span / step > 40)
        step *= 5;
    else if (span / step > 16)
        step *= 2;
    /* ticks at multiples of step seconds after the origin (the zoomed view's too) */
    for (double k = ceil((h->t0 - h->origin) / step - 1e-9); h->origin + k * step <= h->t1 + 1e-9; k++) {
        double x = X(h, h->origin + k * step);
        fprintf(f, "<line class=\"ax\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>"
                   "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.10g s</text>", x, top, x, bottom, x, top - 4,
                k * step + 0.0); /* + 0.0: no "-0" */
    }
}

static void timeline(struct html *h)
{
    const struct am_diag *d = h->d;
    FILE *f = h->f;
    char *keep = calloc((size_t)d->n_ranks + 1, 1);
    if (!keep)
        return;
    if (h->large)
        choose(d, keep);
    /* lanes: (node header, ranks) per node; large: the chosen ranks by node, then a lane per node */
    int lanes = 0, headers = 0;
    for (int k = 0; k < h->n_runs; k++) {
        int any = 0;
        for (int i = h->runs[k]; i < h->runs[k + 1]; i++)
            if (!h->large || keep[h->order[i]]) {
                lanes++;
                any = 1;
            }
        headers += any;
    }
    if (h->large)
        lanes += h->n_runs + 1;
    double top = 30, height = top + (lanes + headers) * LANE_H + 20;
    char t[64];
    utc(h->t0, t, sizeof(t));
    if (h->zoom) {
        fprintf(f, "<h2>The end, zoomed</h2>\n<p class=\"note\">The same lanes from %.4g s to %.4g s: the last "
                   "steps, where each rank stopped and whom it waited for.</p>\n", h->t0 - h->origin, h->t1 - h->origin);
    } else {
        fprintf(f, "<h2>Timeline</h2>\n<p class=\"note\">Wall time from %s (0 s) to %.2f s later; one lane per rank, "
                   "grouped by node. Hover a lane for its verdict, click it for its cause record, or look a rank up: "
                   "<input id=\"find\" size=\"7\" placeholder=\"rank\">%s</p>\n", t, h->t1 - h->t0,
                h->large ? " This job is large: lanes of their own for the ranks that matter (the first failure, the "
                           "members of its groups, the ranks they waited for, the failed, the stragglers), then one "
                           "lane per node (its ranks together: their span, their worst end)." : "");
        legend(f);
    }
    fprintf(f, "<svg id=\"%s\" width=\"%d\" height=\"%.0f\" viewBox=\"0 0 %d %.0f\">\n"
               "<defs><marker id=\"ah%d\" viewBox=\"0 0 6 6\" refX=\"6\" refY=\"3\" markerWidth=\"6\" markerHeight=\"6\" "
               "orient=\"auto\"><path d=\"M0 0L6 3L0 6z\" fill=\"#e07b00\"/></marker></defs>\n",
            h->zoom ? "zoomed" : "timeline", PAGE_W, height, PAGE_W, height, h->zoom);
    nice_axis(h, top - 6, height - 10);
    double y = top;
    for (int pass = 0; pass < 1 + h->large; pass++) {
        if (pass == 1) {
            fprintf(f, "<text x=\"4\" y=\"%.1f\" class=\"note\">nodes (%d):</text>\n", y + 4 + LANE_H / 2.0, h->n_runs);
            y += LANE_H;
        }
        for (int k = 0; k < h->n_runs; k++) {
            if (pass == 1) {
                node_lane(h, k, y + LANE_H / 2.0);
                y += LANE_H;
                continue;
            }
            int any = 0;
            for (int i = h->runs[k]; i < h->runs[k + 1]; i++) {
                int q = h->order[i];
                if (h->large && !keep[q])
                    continue;
                if (!any) {
                    const char *host = d->ranks[q].host;
                    fprintf(f, "<g class=\"node\"><line class=\"sep\" x1=\"0\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\"/>"
                               "<text x=\"4\" y=\"%.1f\">", PAGE_W, y + 2, y + 2, y + LANE_H - 2);
                    hput(f, host[0] ? host : "(unknown host)");
                    fputs("</text></g>\n", f);
                    y += LANE_H;
                    any = 1;
                }
                rank_lane(h, q, y + LANE_H / 2.0);
                y += LANE_H;
            }
        }
    }
    /* who waited for whom: from where a rank stopped to the lane of the rank it waited for */
    int arrows = 0;
    for (int q = 0; q < d->n_ranks && arrows < 512; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        int to = r->waiting_for >= 0 ? entry_of(d, r->waiting_for) : -1;
        if (h->lane_y[q] < 0 || to < 0 || h->lane_y[to] < 0 || to == q)
            continue;
        struct span s;
        span_of(r, &s);
        double x = X(h, s.stop), y0 = h->lane_y[q], y1 = h->lane_y[to];
        fprintf(f, "<path class=\"wf\" marker-end=\"url(#ah%d)\" d=\"M%.1f %.1fC%.1f %.1f %.1f %.1f %.1f %.1f\"/>\n",
                h->zoom, x, y0, x + 25, y0, x + 25, y1, x + 4, y1 + (y1 > y0 ? -3 : 3));
        arrows++;
    }
    if (d->ff_time > 0) {
        double x = X(h, d->ff_time);
        fprintf(f, "<line class=\"ffl\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\"/>"
                   "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" style=\"fill:#c62828\">first failure</text>\n",
                x, top - 2, x, height - 10, x - 3, height - 1);
    }
    fputs("</svg>\n", f);
    free(keep);
}

/* ---- where the ranks stopped: ranks by the call in flight at their end ---------------------- */

struct stop_row {
    const char *group, *op;
    uint64_t seq;
    int q;
};

static int by_call(const void *a, const void *b)
{
    const struct stop_row *x = a, *y = b;
    int c = strcmp(x->group, y->group);
    if (!c)
        c = strcmp(x->op, y->op);
    if (!c)
        c = (x->seq > y->seq) - (x->seq < y->seq);
    return c ? c : (x->q > y->q) - (x->q < y->q);
}

struct call_sum {
    int a, b; /* rows[a..b) */
};

static const struct stop_row *rows_sorted;
static int by_size(const void *a, const void *b)
{
    const struct call_sum *x = a, *y = b;
    int n = x->b - x->a, m = y->b - y->a;
    return n != m ? (m > n) - (m < n) : by_call(&rows_sorted[x->a], &rows_sorted[y->a]);
}

static void ranks_list(FILE *f, const struct am_diag *d, const struct stop_row *rows, int a, int b)
{
    int shown = 0, i = a;
    while (i < b) {
        int lo = d->ranks[rows[i].q].rank, hi = lo, j = i + 1;
        while (j < b && d->ranks[rows[j].q].rank == hi + 1)
            hi = d->ranks[rows[j++].q].rank;
        if (shown++ == 12) {
            fputs(", ...", f);
            return;
        }
        fprintf(f, hi > lo ? "%s%d-%d" : "%s%d", i > a ? ", " : "", lo, hi);
        i = j;
    }
}

static void where_stopped(struct html *h)
{
    const struct am_diag *d = h->d;
    FILE *f = h->f;
    struct stop_row *rows = malloc(((size_t)d->n_ranks + 1) * sizeof(*rows));
    struct call_sum *sums = malloc(((size_t)d->n_ranks + 1) * sizeof(*sums));
    int *votes = malloc(((size_t)d->n_ranks + 1) * sizeof(int));
    if (!rows || !sums || !votes)
        goto out;
    int n = 0, ns = 0;
    for (int q = 0; q < d->n_ranks; q++)
        if (d->ranks[q].in)
            rows[n++] = (struct stop_row){d->ranks[q].in->group, d->ranks[q].in->op, d->ranks[q].in->seq, q};
    fputs("<h2>Where the ranks stopped</h2>\n", f);
    if (n == 0) {
        fputs("<p class=\"note\">No rank was inside a communication call when it ended.</p>\n", f);
        goto out;
    }
    qsort(rows, (size_t)n, sizeof(*rows), by_call);
    for (int i = 0; i < n; i++)
        if (i == 0 || by_call(&(struct stop_row){rows[i].group, rows[i].op, rows[i].seq, 0},
                              &(struct stop_row){rows[i - 1].group, rows[i - 1].op, rows[i - 1].seq, 0}) != 0)
            sums[ns++] = (struct call_sum){i, i + 1};
        else
            sums[ns - 1].b = i + 1;
    rows_sorted = rows;
    qsort(sums, (size_t)ns, sizeof(*sums), by_size);
    fprintf(f, "<p class=\"note\">The call each rank was in when it ended (from the flight records and cause records), "
               "and the ranks they waited for; %d rank%s in %d call%s.</p>\n"
               "<table><tr><th>call</th><th>ranks</th><th>which</th><th>waiting for (ranks waiting)</th></tr>\n",
            n, n == 1 ? "" : "s", ns, ns == 1 ? "" : "s");
    for (int k = 0; k < ns && k < 100; k++) {
        const struct stop_row *x = &rows[sums[k].a];
        int mark = d->ff_in && d->ff_in->seq == x->seq && strcmp(d->ff_in->group, x->group) == 0 &&
                   strcmp(d->ff_in->op, x->op) == 0;
        fprintf(f, "<tr%s><td>", mark ? " class=\"ffrow\"" : "");
        hput(f, x->op);
        fprintf(f, " #%llu of group ", (unsigned long long)x->seq);
        hput(f, x->group);
        fprintf(f, "%s</td><td>%d</td><td>", mark ? " (the call the others waited in)" : "", sums[k].b - sums[k].a);
        ranks_list(f, d, rows, sums[k].a, sums[k].b);
        fputs("</td><td>", f);
        /* the ranks waited for, most first (at most 5) */
        int nv = 0;
        for (int i = sums[k].a; i < sums[k].b; i++)
            if (d->ranks[rows[i].q].waiting_for >= 0)
                votes[nv++] = d->ranks[rows[i].q].waiting_for;
        if (nv == 0)
            fputs("(none named)", f);
        for (int shown = 0; shown < 5 && nv > 0; shown++) {
            int best = -1, count = 0;
            for (int i = 0; i < nv; i++) { /* the most named; quadratic only in one call's ranks */
                if (i > 64 && best >= 0)
                    break;
                int c = 0;
                for (int j = 0; j < nv; j++)
                    c += votes[j] == votes[i];
                if (c > count || (c == count && votes[i] < best)) {
                    best = votes[i];
                    count = c;
                }
            }
            fprintf(f, "%srank %d (%d)", shown ? ", " : "", best, count);
            int m = 0;
            for (int i = 0; i < nv; i++)
                if (votes[i] != best)
                    votes[m++] = votes[i];
            nv = m;
        }
        fputs("</td></tr>\n", f);
    }
    fputs("</table>\n", f);
    if (ns > 100)
        fprintf(f, "<p class=\"note\">(and %d more calls, not listed)</p>\n", ns - 100);
out:
    free(rows);
    free(sums);
    free(votes);
}

/* ---- memory against the plan ---------------------------------------------------------------- */

static double oom_in_use(const struct am_diag_rank *r)
{
    const json_t *c = r->cause;
    const char *cause = c ? json_string_value(json_object_get(c, "cause")) : NULL;
    const json_t *v = c ? json_object_get(c, "bytes_in_use") : NULL;
    return cause && strcmp(cause, "oom") == 0 && json_is_number(v) && json_number_value(v) > 0 &&
                   json_number_value(v) < 1e18 ? json_number_value(v) : 0;
}

static double oom_plan(const struct am_diag_rank *r)
{
    const json_t *v = r->cause ? json_object_get(r->cause, "plan_bytes") : NULL;
    return json_is_number(v) && json_number_value(v) > 0 && json_number_value(v) < 1e18 ? json_number_value(v) : 0;
}

static void memory(struct html *h)
{
    const struct am_diag *d = h->d;
    FILE *f = h->f;
    int cols = h->large ? h->n_runs : h->n_order;
    double top = 0;
    int any = 0, over = 0, worst = -1;
    double worst_ratio = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        double plan = r->plan_bytes > 0 ? r->plan_bytes : oom_plan(r);
        double used = fmax(fmax(r->mem_bytes, r->dev_peak), oom_in_use(r));
        top = fmax(top, fmax(used, plan));
        any |= used > 0 || plan > 0;
        if (plan > 0 && used > plan)
            over++;
        if (plan > 0 && used / plan > worst_ratio) {
            worst_ratio = used / plan;
            worst = q;
        }
    }
    fputs("<h2>Memory against the plan</h2>\n", f);
    if (!any || cols == 0) {
        fputs("<p class=\"note\">No memory record, plan or device peak in the logs.</p>\n", f);
        return;
    }
    char a[32], b[32];
    fprintf(f, "<p class=\"note\">Per %s: what it allocated as am-plan counts it (the memory record, light), the "
               "device allocator's peak (dark), the bytes in use when a device allocation failed (red bar), am-plan's "
               "estimate (red tick). %d rank%s above %s plan.",
            h->large ? "node (its largest rank)" : "rank", over, over == 1 ? "" : "s", over == 1 ? "its" : "their");
    if (worst >= 0)
        fprintf(f, " The fullest: rank %d, %s of %s (%.0f%%).", d->ranks[worst].rank,
                bytes_text(fmax(fmax(d->ranks[worst].mem_bytes, d->ranks[worst].dev_peak), oom_in_use(&d->ranks[worst])),
                           a, sizeof(a)),
                bytes_text(d->ranks[worst].plan_bytes > 0 ? d->ranks[worst].plan_bytes : oom_plan(&d->ranks[worst]), b,
                           sizeof(b)),
                100 * worst_ratio);
    fputs("</p>\n", f);
    const double H = 120, base = 130;
    double w = (double)PLOT_W / cols;
    fprintf(f, "<svg class=\"mem\" width=\"%d\" height=\"%.0f\" viewBox=\"0 0 %d %.0f\">\n", PAGE_W, base + 20, PAGE_W,
            base + 20);
    fprintf(f, "<text x=\"4\" y=\"%.1f\">%s</text><text x=\"4\" y=\"%.1f\">0</text>"
               "<line class=\"ax\" x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\"/>\n",
            base - H + 4, bytes_text(top, a, sizeof(a)), base, LABEL_W, LABEL_W + PLOT_W, base, base);
    for (int c = 0; c < cols; c++) {
        int a0 = h->large ? h->runs[c] : c, a1 = h->large ? h->runs[c + 1] : c + 1, pickq = h->order[a0];
        double m = 0, pk = 0, oo = 0, pl = 0;
        for (int i = a0; i < a1; i++) { /* a node: its fullest rank */
            const struct am_diag_rank *r = &d->ranks[h->order[i]];
            double u = fmax(fmax(r->mem_bytes, r->dev_peak), oom_in_use(r));
            if (u > fmax(fmax(m, pk), oo) || i == a0) {
                m = r->mem_bytes;
                pk = r->dev_peak;
                oo = oom_in_use(r);
                pl = r->plan_bytes > 0 ? r->plan_bytes : oom_plan(r);
                pickq = h->order[i];
            }
        }
        const struct am_diag_rank *r = &d->ranks[pickq];
        double x = LABEL_W + c * w, bw = w > 2 ? w - 1 : w;
        fprintf(f, "<g data-r=\"%d\"><title>", r->rank);
        if (h->large) {
            fputs("node ", f);
            hput(f, r->host);
            fprintf(f, ", its fullest rank %d: ", r->rank);
        } else {
            fprintf(f, "rank %d: ", r->rank);
        }
        fprintf(f, "allocated %s", m > 0 ? bytes_text(m, a, sizeof(a)) : "(no memory record)");
        if (pk > 0)
            fprintf(f, ", device peak %s", bytes_text(pk, a, sizeof(a)));
        if (oo > 0)
            fprintf(f, ", %s in use when its allocation failed", bytes_text(oo, a, sizeof(a)));
        if (pl > 0)
            fprintf(f, "; plan %s (%.0f%%)", bytes_text(pl, a, sizeof(a)), 100 * fmax(fmax(m, pk), oo) / pl);
        fputs("</title>", f);
        if (m > 0)
            fprintf(f, "<rect class=\"al\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\"/>", x, base - H * m / top,
                    bw, H * m / top);
        if (pk > 0)
            fprintf(f, "<rect class=\"pk\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"2\"/>", x, base - H * pk / top - 1,
                    bw);
        if (oo > 0)
            fprintf(f, "<rect class=\"oo\" x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\"/>", x + bw / 4,
                    base - H * oo / top, bw / 2 > 1 ? bw / 2 : 1, H * oo / top);
        if (pl > 0)
            fprintf(f, "<line class=\"pl\" x1=\"%.2f\" x2=\"%.2f\" y1=\"%.1f\" y2=\"%.1f\"/>", x, x + bw, base - H * pl / top,
                    base - H * pl / top);
        fputs("</g>\n", f);
    }
    fputs("</svg>\n", f);
}

/* ---- the data the JS reads: each rank's line and cause record ------------------------------ */

static void data(struct html *h)
{
    const struct am_diag *d = h->d;
    json_t *o = json_object(), *lines = json_object(), *causes = json_object();
    size_t line_bytes = 0, cause_bytes = 0;
    int cut = 0;
    /* causes: the first failure's, the failed, the stragglers, then the rest in rank order */
    for (int pass = 0; pass < 3; pass++)
        for (int q = 0; q < d->n_ranks; q++) {
            const struct am_diag_rank *r = &d->ranks[q];
            int first = r->rank == d->culprit,
                odd = r->verdict == AM_VERDICT_FAILED || r->verdict == AM_VERDICT_STRAGGLER;
            if ((pass == 0) != first || (pass == 1 && !odd) || (pass == 2 && odd))
                continue;
            char key[16];
            snprintf(key, sizeof(key), "%d", r->rank);
            if (pass < 2 || line_bytes < 2 * AM_DIAG_HTML_CAUSES) {
                char *line = printed_rank(d, r);
                json_t *s = line ? json_string(line) : NULL;
                if (s) {
                    line_bytes += strlen(line) + 16;
                    json_object_set_new(lines, key, s);
                } else {
                    cut = 1;
                }
                free(line);
            } else {
                cut = 1;
            }
            if (!r->cause)
                continue;
            char *c = json_dumps(r->cause, JSON_COMPACT);
            size_t n = c ? strlen(c) : 0;
            free(c);
            if (pass == 0 || cause_bytes + n <= AM_DIAG_HTML_CAUSES) {
                cause_bytes += n;
                json_object_set(causes, key, r->cause);
            } else {
                cut = 1;
            }
        }
    json_object_set_new(o, "first", d->culprit >= 0 ? json_integer(d->culprit) : json_null());
    json_object_set_new(o, "cut", json_boolean(cut));
    json_object_set_new(o, "lines", lines);
    json_object_set_new(o, "causes", causes);
    fputs("<script type=\"application/json\" id=\"am-data\">", h->f);
    json_put(h->f, o);
    fputs("</script>\n", h->f);
    json_decref(o);
}

/* ---- the page ------------------------------------------------------------------------------- */

/* The summary's lines, each a div whose class says what it is. */
static void verdict(struct html *h)
{
    FILE *f = h->f;
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    if (!m)
        return;
    am_diag_print_summary(h->d, m);
    fclose(m);
    fprintf(f, "<div id=\"verdict\"%s>\n", h->d->failed ? "" : " class=\"clean\"");
    for (char *p = buf; p && *p;) {
        char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        const char *cls = strncmp(p, "first failure:", 14) == 0 ? "ff" : strncmp(p, "  cause:", 8) == 0 ? "cause"
                        : strncmp(p, "others:", 7) == 0 ? "others" : "l";
        fprintf(f, "<div class=\"%s\">", cls);
        html_text(f, p, n);
        fputs("</div>\n", f);
        p += n + (nl ? 1 : 0);
    }
    fputs("</div>\n", f);
    free(buf);
}

int am_diag_html(const struct am_diag *d, FILE *f)
{
    struct html h = {.d = d, .f = f};
    if (group_by_node(&h) < 0)
        goto fail;
    h.lane_y = malloc(((size_t)d->n_ranks + 1) * sizeof(double));
    if (!h.lane_y)
        goto fail;
    for (int q = 0; q < d->n_ranks; q++)
        h.lane_y[q] = -1;
    h.large = d->n_ranks > AM_DIAG_HTML_LANES;
    for (int q = 0; q < d->n_ranks; q++) {
        struct span s;
        span_of(&d->ranks[q], &s);
        if (s.begin > 0 && (h.t0 == 0 || s.begin < h.t0))
            h.t0 = s.begin;
        h.t1 = fmax(h.t1, s.stop); /* where the ranks stopped (their supervisors' exit records come later) */
    }
    if (d->ff_time > 0) {
        h.t0 = h.t0 > 0 && h.t0 < d->ff_time ? h.t0 : d->ff_time;
        h.t1 = fmax(h.t1, d->ff_time);
    }
    if (!(h.t1 > h.t0)) /* no time known, or one instant */
        h.t1 = h.t0 + 1;
    h.origin = h.t0;
    /* the end, zoomed: from a step before the earliest end of a last step among the ranks that did
     * not end cleanly, when that is less than half the run */
    double w0 = h.t1, typical = 0;
    for (int q = 0; q < d->n_ranks; q++) {
        const struct am_diag_rank *r = &d->ranks[q];
        struct span s;
        span_of(r, &s);
        if (r->verdict == AM_VERDICT_CLEAN || s.stop <= 0)
            continue;
        w0 = fmin(w0, s.steps_to > 0 ? s.steps_to : s.begin > 0 ? s.begin : w0);
        if (r->n_steps > 1 && typical == 0)
            typical = (s.steps_to - s.steps_from) / (double)r->n_steps;
    }
    w0 -= fmax(typical, 0.2 * (h.t1 - w0));
    fputs("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
          "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
          "script-src 'unsafe-inline'; img-src data:\">\n<title>am-diag: job ", f);
    hput(f, d->job[0] ? d->job : "?");
    fprintf(f, ": %s</title>\n<style>%s</style></head><body>\n<h1>am-diag: job ", d->failed ? "FAILED" : "clean", css);
    hput(f, d->job[0] ? d->job : "?");
    fprintf(f, ", %d rank%s: %s</h1>\n", d->world, d->world == 1 ? "" : "s", d->failed ? "FAILED" : "clean");
    verdict(&h);
    timeline(&h);
    if (d->failed && w0 > h.t0 && h.t1 - w0 < 0.5 * (h.t1 - h.t0) && h.t1 > w0) {
        double t0 = h.t0;
        h.t0 = w0;
        h.zoom = 1;
        timeline(&h);
        h.t0 = t0;
        h.zoom = 0;
    }
    where_stopped(&h);
    memory(&h);
    fputs("<div id=\"panel\"><button id=\"close\" title=\"close\">&#215;</button><div id=\"pd\"></div>"
          "<pre id=\"pc\"></pre></div>\n", f);
    data(&h);
    fprintf(f, "<script>%s</script>\n</body></html>\n", js);
    free(h.order);
    free(h.runs);
    free(h.lane_y);
    return ferror(f) ? -1 : 0;
fail:
    free(h.order);
    free(h.runs);
    free(h.lane_y);
    return -1;
}
