/* test_pp_schedule.c - the pipeline schedules: each is complete, runs to the end when every
 * rank follows its list with non-blocking sends and blocking receives (simulated), keeps the
 * messages between two ranks in the same order at both ends, and holds the activations the
 * papers say (1F1B: at most pp - rank micro-batches). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pp_schedule.h"

#define MAXA 512

struct sched {
    int pp, v, m, n_stages;
    struct am_pipe_action a[8][MAXA];
    int n[8];
};

static void build(struct sched *S, enum am_pp_schedule kind, int pp, int v, int m)
{
    memset(S, 0, sizeof(*S));
    S->pp = pp;
    S->v = v;
    S->m = m;
    S->n_stages = pp * v;
    for (int r = 0; r < pp; r++) {
        S->n[r] = am_pipe_schedule(kind, pp, v, m, r, S->a[r]);
        assert_int_equal(S->n[r], 2 * m * v);
    }
}

/* Every (chunk, micro-batch) forward once and backward once, backward after forward, and
 * backwards of a chunk in the order of its forwards. */
static void check_complete(const struct sched *S)
{
    for (int r = 0; r < S->pp; r++) {
        int fseen[16][64] = {{0}}, bseen[16][64] = {{0}}, next_b[16] = {0}, next_f[16] = {0};
        for (int i = 0; i < S->n[r]; i++) {
            const struct am_pipe_action *a = &S->a[r][i];
            assert_in_range(a->chunk, 0, S->v - 1);
            assert_in_range(a->micro, 0, S->m - 1);
            if (a->kind == AM_PIPE_FORWARD) {
                assert_int_equal(fseen[a->chunk][a->micro]++, 0);
                assert_int_equal(a->micro, next_f[a->chunk]++);
            } else {
                assert_int_equal(fseen[a->chunk][a->micro], 1);
                assert_int_equal(bseen[a->chunk][a->micro]++, 0);
                assert_int_equal(a->micro, next_b[a->chunk]++);
            }
        }
    }
}

/* A message: the hidden state of (stage, micro) going forward (from stage to stage + 1) or
 * backward (from stage to stage - 1). */
struct msg {
    int stage, micro;
};

/* Runs every rank's list: a forward of stage s > 0 waits for the forward of s - 1, a backward
 * of stage s < last for the backward of s + 1 (blocking receives); sends never wait, but with
 * `ring` (the executor's ring of send buffers, one chunk per rank: pipeline.c) a rank that is
 * about to reuse the buffer of micro-batch i - slots waits until that one was received (the
 * next stage ran its forward of it, or the previous stage its backward). Fails on a deadlock.
 * Records, per directed pair of ranks and direction, the order of sends and of receives,
 * which must agree (the p2p sequence numbers match them up). */
static void simulate(const struct sched *S, bool ring)
{
    int pos[8] = {0}, done_f[16][64] = {{0}}, done_b[16][64] = {{0}};
    static struct msg sent[2][8][8][MAXA], recvd[2][8][8][MAXA];
    int n_sent[2][8][8] = {{{0}}}, n_recvd[2][8][8] = {{{0}}};
    int last = S->n_stages - 1, remaining = 0;
    for (int r = 0; r < S->pp; r++)
        remaining += S->n[r];
    while (remaining > 0) {
        int progressed = 0;
        for (int r = 0; r < S->pp; r++) {
            while (pos[r] < S->n[r]) {
                const struct am_pipe_action *a = &S->a[r][pos[r]];
                int s = a->chunk * S->pp + r, i = a->micro;
                int fwd = a->kind == AM_PIPE_FORWARD;
                int from = fwd ? s - 1 : s + 1; /* the stage it receives from */
                int has_input = fwd ? s > 0 : s < last;
                if (has_input && !(fwd ? done_f[from][i] : done_b[from][i]))
                    break; /* blocked in the receive */
                int slots = am_pipe_slots(S->a[r], S->n[r], 0), to = fwd ? s + 1 : s - 1;
                if (ring && (fwd ? s < last : s > 0) && i >= slots &&
                    !(fwd ? done_f[to][i - slots] : done_b[to][i - slots]))
                    break; /* waiting for the send from the buffer it reuses */
                int d = fwd ? 0 : 1;
                if (has_input) {
                    int src = from % S->pp;
                    recvd[d][src][r][n_recvd[d][src][r]++] = (struct msg){from, i};
                }
                if (fwd ? s < last : s > 0) {
                    int dst = (fwd ? s + 1 : s - 1) % S->pp;
                    sent[d][r][dst][n_sent[d][r][dst]++] = (struct msg){s, i};
                }
                (fwd ? done_f : done_b)[s][i] = 1;
                pos[r]++;
                remaining--;
                progressed = 1;
            }
        }
        if (!progressed)
            fail_msg("deadlock: pp %d, v %d, %d micro-batches", S->pp, S->v, S->m);
    }
    for (int d = 0; d < 2; d++)
        for (int a = 0; a < S->pp; a++)
            for (int b = 0; b < S->pp; b++) {
                assert_int_equal(n_sent[d][a][b], n_recvd[d][a][b]);
                for (int k = 0; k < n_sent[d][a][b]; k++) {
                    assert_int_equal(sent[d][a][b][k].stage, recvd[d][a][b][k].stage);
                    assert_int_equal(sent[d][a][b][k].micro, recvd[d][a][b][k].micro);
                }
            }
}

static int min(int a, int b) { return a < b ? a : b; }

static void test_gpipe(void **state)
{
    (void)state;
    static struct sched S;
    for (int pp = 1; pp <= 8; pp++)
        for (int m = 1; m <= 12; m++) {
            build(&S, AM_PP_GPIPE, pp, 1, m);
            check_complete(&S);
            simulate(&S, false);
            simulate(&S, true);
            for (int r = 0; r < pp; r++) {
                assert_int_equal(am_pipe_peak(S.a[r], S.n[r]), m);
                assert_int_equal(am_pipe_slots(S.a[r], S.n[r], 0), m);
            }
        }
}

static void test_1f1b(void **state)
{
    (void)state;
    static struct sched S;
    for (int pp = 1; pp <= 8; pp++)
        for (int m = 1; m <= 12; m++) {
            build(&S, AM_PP_1F1B, pp, 1, m);
            check_complete(&S);
            simulate(&S, false);
            simulate(&S, true);
            for (int r = 0; r < pp; r++)
                assert_int_equal(am_pipe_peak(S.a[r], S.n[r]), min(m, pp - r));
        }
    /* the order itself, pp 4, rank 1, 6 micro-batches: 2 warm-up forwards */
    build(&S, AM_PP_1F1B, 4, 1, 6);
    const char *want = "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5 ";
    char got[128] = "";
    for (int i = 0; i < S.n[1]; i++) {
        char one[8];
        snprintf(one, sizeof(one), "%c%d ", S.a[1][i].kind == AM_PIPE_FORWARD ? 'F' : 'B', S.a[1][i].micro);
        strcat(got, one);
    }
    assert_string_equal(got, want);
}

static void order_of(const struct sched *S, int rank, char *got, size_t len)
{
    got[0] = '\0';
    for (int i = 0; i < S->n[rank]; i++) {
        char one[16];
        snprintf(one, sizeof(one), "%c%d.%d ", S->a[rank][i].kind == AM_PIPE_FORWARD ? 'F' : 'B', S->a[rank][i].chunk,
                 S->a[rank][i].micro);
        strncat(got, one, len - strlen(got) - 1);
    }
}

static void test_interleaved(void **state)
{
    (void)state;
    static struct sched S;
    for (int pp = 2; pp <= 4; pp++)
        for (int v = 2; v <= 4; v++)
            for (int m = 1; m <= 4 * pp; m++) {
                int per = am_pipe_round(pp, m);
                if (per < 0) { /* e.g. pp 4, 9 micro-batches: 2 rounds of 4.5 */
                    struct am_pipe_action a[MAXA];
                    assert_int_equal(am_pipe_schedule(AM_PP_INTERLEAVED_1F1B, pp, v, m, 0, a), -1);
                    continue;
                }
                build(&S, AM_PP_INTERLEAVED_1F1B, pp, v, m);
                check_complete(&S);
                simulate(&S, false);
                for (int r = 0; r < pp; r++) {
                    int warm = m == pp ? m * v : min((pp - r - 1) * 2 + (v - 1) * per, m * v);
                    assert_int_equal(am_pipe_peak(S.a[r], S.n[r]), min(warm + 1, m * v));
                }
            }
    /* the order itself, pp 2, v 2, 4 micro-batches, rank 0: chunk 0 takes micro-batches
     * 0,1, then chunk 1 takes them, then micro-batches 2,3 */
    char got[512];
    build(&S, AM_PP_INTERLEAVED_1F1B, 2, 2, 4);
    order_of(&S, 0, got, sizeof(got));
    assert_string_equal(got, "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3 ");
}

/* Fewer micro-batches than ranks, or not a multiple of pp: the orders
 * torch.distributed.pipelining's ScheduleInterleaved1F1B gives each rank (torch 2.15,
 * _get_1f1b_rank_ops with its idle slots dropped). */
static void test_interleaved_rounds_as_torch(void **state)
{
    (void)state;
    static struct sched S;
    static const struct {
        int pp, v, m, rank;
        const char *want;
    } cases[] = {
        {4, 2, 2, 0, "F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1 "},
        {4, 2, 2, 3, "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 B0.0 B0.1 "},
        {4, 2, 3, 0, "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B1.0 B1.1 B1.2 B0.0 B0.1 B0.2 "},
        {4, 2, 3, 3, "F0.0 F0.1 F0.2 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 B0.0 B0.1 B0.2 "},
        {4, 2, 6, 1, "F0.0 F0.1 F0.2 F0.3 F0.4 F0.5 F1.0 F1.1 F1.2 F1.3 F1.4 B1.0 F1.5 B1.1 B1.2 B1.3 B1.4 B1.5 "
                     "B0.0 B0.1 B0.2 B0.3 B0.4 B0.5 "},
        {4, 2, 6, 3, "F0.0 F0.1 F0.2 F0.3 F0.4 F0.5 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 F1.4 B1.4 F1.5 B1.5 "
                     "B0.0 B0.1 B0.2 B0.3 B0.4 B0.5 "},
        {2, 2, 1, 1, "F0.0 F1.0 B1.0 B0.0 "},
        {4, 3, 1, 3, "F0.0 F1.0 F2.0 B2.0 B1.0 B0.0 "},
    };
    char got[512];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        build(&S, AM_PP_INTERLEAVED_1F1B, cases[i].pp, cases[i].v, cases[i].m);
        order_of(&S, cases[i].rank, got, sizeof(got));
        assert_string_equal(got, cases[i].want);
    }
    assert_int_equal(am_pipe_round(4, 3), 3);
    assert_int_equal(am_pipe_round(4, 10), 5);
    assert_int_equal(am_pipe_round(4, 9), -1);
    assert_int_equal(am_pipe_round(4, 8), 4);
}

static void test_refused(void **state)
{
    (void)state;
    struct am_pipe_action a[64];
    assert_int_equal(am_pipe_schedule(AM_PP_INTERLEAVED_1F1B, 4, 2, 9, 0, a), -1); /* 2 rounds of 4.5 */
    assert_int_equal(am_pipe_schedule(AM_PP_1F1B, 2, 2, 4, 0, a), -1);             /* v > 1 without interleaving */
    assert_int_equal(am_pipe_schedule(AM_PP_GPIPE, 2, 1, 4, 2, a), -1);            /* rank outside pp */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gpipe),
        cmocka_unit_test(test_1f1b),
        cmocka_unit_test(test_interleaved),
        cmocka_unit_test(test_interleaved_rounds_as_torch),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
