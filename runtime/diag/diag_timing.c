/* diag_timing.c - a job's step and save times from its logs (diag.h: am_diag_timing), which
 * am-plan's advised signal lead reads. Linear in the ranks: each keeps its recent times in
 * rings of fixed size while its log is read. */
#include "diag.h"

#include <stdlib.h>

static int by_value(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The median of a rank's recent step times (the mean of the two middle ones for an even count). */
static double recent_median(const struct am_diag_rank *r)
{
    float v[AM_DIAG_RECENT_STEPS];
    int n = r->n_step_s < AM_DIAG_RECENT_STEPS ? (int)r->n_step_s : AM_DIAG_RECENT_STEPS;
    for (int i = 0; i < n; i++)
        v[i] = r->recent_step_s[i];
    qsort(v, (size_t)n, sizeof(v[0]), by_value);
    return n % 2 ? v[n / 2] : ((double)v[n / 2 - 1] + v[n / 2]) / 2;
}

void am_diag_timing(const struct am_diag *d, struct am_diag_timing *t)
{
    *t = (struct am_diag_timing){.step_s = -1, .save_s = -1, .step_rank = -1, .save_rank = -1};
    for (int i = 0; i < d->n_ranks; i++) {
        const struct am_diag_rank *r = &d->ranks[i];
        if (r->n_step_s > 0) {
            double m = recent_median(r);
            t->step_ranks++;
            if (m > t->step_s || (m == t->step_s && r->rank < t->step_rank)) {
                t->step_s = m;
                t->step_rank = r->rank;
            }
        }
        int n = r->n_save_s < AM_DIAG_RECENT_SAVES ? (int)r->n_save_s : AM_DIAG_RECENT_SAVES;
        t->save_ranks += n > 0;
        for (int k = 0; k < n; k++) {
            double s = r->recent_save_s[k];
            if (s > t->save_s || (s == t->save_s && r->rank < t->save_rank)) {
                t->save_s = s;
                t->save_rank = r->rank;
                t->save_step = r->recent_save_step[k];
            }
        }
    }
}
