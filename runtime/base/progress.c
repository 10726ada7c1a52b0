/* progress.c - a progress line on a terminal (progress.h). */
#include "progress.h"

#include <string.h>

#include "log.h"

void am_progress_start(struct am_progress *p, const char *what, const char *items, uint64_t total, bool on)
{
    *p = (struct am_progress){.out = stderr, .what = what, .items = items, .total = total, .on = on,
                              .t0 = am_mono_time()};
    p->drawn = p->t0; /* the first line after a quarter second */
}

/* bytes in the unit a person reads at that size */
static void amount(char *out, size_t len, double bytes)
{
    if (bytes >= 1e9)
        snprintf(out, len, "%.2f GB", bytes / 1e9);
    else if (bytes >= 1e6)
        snprintf(out, len, "%.1f MB", bytes / 1e6);
    else
        snprintf(out, len, "%.0f kB", bytes / 1e3);
}

static void draw(struct am_progress *p, double now)
{
    double dt = now - p->t0, frac = p->total ? (double)p->done / (double)p->total : 0;
    char done[32], total[32], rate[32], left[32] = "", items[64] = "";
    amount(done, sizeof done, (double)p->done);
    amount(total, sizeof total, (double)p->total);
    amount(rate, sizeof rate, dt > 0 ? (double)(p->done - p->from) / dt : 0);
    if (p->total && p->done > p->from && frac < 1) {
        double s = dt * (double)(p->total - p->done) / (double)(p->done - p->from);
        snprintf(left, sizeof left, "  %d:%02d left", (int)(s / 60), (int)s % 60);
    }
    if (p->items)
        snprintf(items, sizeof items, "  %.2fM %s  %.2fM %s/s", (double)p->n_items / 1e6, p->items,
                 dt > 0 ? (double)(p->n_items - p->items_from) / dt / 1e6 : 0.0, p->items);
    if (p->total)
        fprintf(p->out, "\r%s: %5.1f%%  %s of %s  %s/s%s%s ", p->what, 100 * frac, done, total, rate, left, items);
    else
        fprintf(p->out, "\r%s: %s  %s/s%s ", p->what, done, rate, items);
    fflush(p->out);
    p->drawn = now;
    p->shown = true;
}

void am_progress_set(struct am_progress *p, uint64_t done, uint64_t n_items)
{
    if (!p->set) {
        p->from = done;
        p->items_from = n_items;
        p->set = true;
    }
    p->done = done;
    p->n_items = n_items;
    if (!p->on)
        return;
    double now = am_mono_time();
    if (now - p->drawn >= 0.25)
        draw(p, now);
}

void am_progress_end(struct am_progress *p, bool ok)
{
    if (!p->on)
        return;
    if (ok || p->shown) {
        draw(p, am_mono_time());
        fputc('\n', p->out);
    }
    p->on = false;
}

int am_progress_option(const char *arg)
{
    if (strcmp(arg, "--progress") == 0)
        return 1;
    if (strcmp(arg, "--quiet") == 0 || strcmp(arg, "--no-progress") == 0)
        return 0;
    return -1;
}
