/* pp_schedule.c - pipeline schedules (pp_schedule.h). */
#include "pp_schedule.h"

static struct am_pipe_action act(enum am_pipe_kind k, int chunk, int micro)
{
    return (struct am_pipe_action){k, chunk, micro};
}

/* Megatron's interleaved order: the k-th forward (backward) of a rank runs chunk
 * (k mod pp*v) / pp (counted from the last chunk for backwards) on micro-batch
 * (k / (pp*v)) * pp + k mod pp. With v = 1 this is plain 1F1B. */
static struct am_pipe_action virtual_action(enum am_pipe_kind kind, int k, int pp, int v)
{
    int in_group = k % (pp * v), chunk = in_group / pp;
    if (kind == AM_PIPE_BACKWARD)
        chunk = v - 1 - chunk;
    return act(kind, chunk, k / (pp * v) * pp + in_group % pp);
}

int am_pipe_schedule(enum am_pp_schedule kind, int pp, int v, int n_micro, int rank, struct am_pipe_action *out)
{
    if (pp < 1 || v < 1 || n_micro < 1 || rank < 0 || rank >= pp)
        return -1;
    if (kind != AM_PP_INTERLEAVED_1F1B && v != 1)
        return -1;
    if (kind == AM_PP_INTERLEAVED_1F1B && n_micro % pp)
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
        warm = (pp - rank - 1) * (v > 1 ? 2 : 1) + (v - 1) * pp;
    if (warm > total)
        warm = total;
    for (int k = 0; k < warm; k++)
        out[n++] = virtual_action(AM_PIPE_FORWARD, k, pp, v);
    for (int k = 0; k < total - warm; k++) {
        out[n++] = virtual_action(AM_PIPE_FORWARD, k + warm, pp, v);
        out[n++] = virtual_action(AM_PIPE_BACKWARD, k, pp, v);
    }
    for (int k = total - warm; k < total; k++)
        out[n++] = virtual_action(AM_PIPE_BACKWARD, k, pp, v);
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

