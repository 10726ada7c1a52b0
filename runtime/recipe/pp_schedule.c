/* pp_schedule.c - pipeline schedules (pp_schedule.h). */
#include "pp_schedule.h"

static struct am_pipe_action act(enum am_pipe_kind k, int chunk, int micro)
{
    return (struct am_pipe_action){k, chunk, micro};
}

/* The interleaved order, in rounds of `per` micro-batches (pp when n_micro is a multiple of
 * pp; see am_pipe_round): the k-th forward (backward) of a rank runs chunk (k mod per*v) / per
 * (counted from the last chunk for backwards) on micro-batch (k / (per*v)) * per + k mod per.
 * With v = 1 this is plain 1F1B. */
static struct am_pipe_action virtual_action(enum am_pipe_kind kind, int k, int per, int v)
{
    int in_group = k % (per * v), chunk = in_group / per;
    if (kind == AM_PIPE_BACKWARD)
        chunk = v - 1 - chunk;
    return act(kind, chunk, k / (per * v) * per + in_group % per);
}

int am_pipe_round(int pp, int n_micro)
{
    if (pp < 1 || n_micro < 1)
        return -1;
    int rounds = n_micro / pp > 1 ? n_micro / pp : 1;
    return n_micro % rounds ? -1 : n_micro / rounds;
}

int am_pipe_schedule(enum am_pp_schedule kind, int pp, int v, int n_micro, int rank, struct am_pipe_action *out)
{
    if (pp < 1 || v < 1 || n_micro < 1 || rank < 0 || rank >= pp)
        return -1;
    if (kind != AM_PP_INTERLEAVED_1F1B && v != 1)
        return -1;
    int per = kind == AM_PP_INTERLEAVED_1F1B ? am_pipe_round(pp, n_micro) : pp;
    if (per < 0)
        return -1;
    int n = 0;
    if (kind == AM_PP_GPIPE) {
        for (int i = 0; i < n_micro; i++)
            out[n++] = act(AM_PIPE_FORWARD, 0, i);
        for (int i = 0; i < n_micro; i++)
            out[n++] = act(AM_PIPE_BACKWARD, 0, i);
        return n;
    }
    int total = n_micro * v, warm;
    if (v > 1 && n_micro == pp)
        warm = total;
    else
        warm = (pp - rank - 1) * (v > 1 ? 2 : 1) + (v - 1) * per;
    if (warm > total)
        warm = total;
    for (int k = 0; k < warm; k++)
        out[n++] = virtual_action(AM_PIPE_FORWARD, k, per, v);
    for (int k = 0; k < total - warm; k++) {
        out[n++] = virtual_action(AM_PIPE_FORWARD, k + warm, per, v);
        out[n++] = virtual_action(AM_PIPE_BACKWARD, k, per, v);
    }
    for (int k = total - warm; k < total; k++)
        out[n++] = virtual_action(AM_PIPE_BACKWARD, k, per, v);
    return n;
}

int am_pipe_slots(const struct am_pipe_action *a, int n, int chunk)
{
    int held = 0, most = 0;
    for (int i = 0; i < n; i++) {
        if (a[i].chunk != chunk)
            continue;
        held += a[i].kind == AM_PIPE_FORWARD ? 1 : -1;
        if (held > most)
            most = held;
    }
    return most;
}

int am_pipe_peak(const struct am_pipe_action *a, int n)
{
    int held = 0, most = 0;
    for (int i = 0; i < n; i++) {
        held += a[i].kind == AM_PIPE_FORWARD ? 1 : -1;
        if (held > most)
            most = held;
    }
    return most;
}

