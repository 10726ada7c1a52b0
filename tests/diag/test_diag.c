/* test_diag.c - am-diag's analysis (diag.h) on hand-written rank logs: the culprit and its
 * victims, hangs outside and inside a collective, missing ranks, a cut last line, mismatches,
 * stragglers, a job stopped from outside, exits without a cause, and the JSON fields; and
 * hostile or broken logs (each once a crash or a wrong answer): ranks named outside the job,
 * UTF-8 cut by truncation, absurd times, terminal escapes, unreadable files, oversized logs;
 * and am-plan's reading of the step and save times. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "diag.h"

/* ---- writing logs --------------------------------------------------------------------------- */

struct log {
    char text[65536];
    size_t len;
};

static void line(struct log *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(struct log *l, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    l->len += (size_t)vsnprintf(l->text + l->len, sizeof(l->text) - l->len, fmt, ap);
    va_end(ap);
    l->len += (size_t)snprintf(l->text + l->len, sizeof(l->text) - l->len, "\n");
}

#define T0 1767000000.0

static void start(struct log *l, int rank, int world, const char *host)
{
    l->len = 0;
    line(l, "{\"type\":\"start\",\"host\":\"%s\",\"pid\":%d,\"rank\":%d,\"world\":%d,\"job\":\"42.0\",\"local_rank\":%d,"
            "\"coords\":{\"pp\":0,\"dp_replicate\":0,\"dp_shard\":%d,\"cp\":0,\"tp\":0,\"ep\":0},\"device\":\"cpu\","
            "\"time\":%.6f,\"max_steps\":6}", host, 100 + rank, rank, world, rank % 2, rank, T0);
    char ranks[256] = "";
    for (int r = 0; r < world; r++)
        snprintf(ranks + strlen(ranks), sizeof(ranks) - strlen(ranks), "%s%d", r ? "," : "", r);
    line(l, "{\"type\":\"groups\",\"rank\":%d,\"groups\":[{\"name\":\"dp\",\"gid\":0,\"ranks\":[%s]}]}", rank, ranks);
}

/* steps 1..n, each 1 s, comm_s as given */
static void steps(struct log *l, int n, double comm_s)
{
    for (int s = 1; s <= n; s++)
        line(l, "{\"type\":\"step\",\"step\":%d,\"loss\":5.0,\"step_s\":1.0,\"comm_s\":%.3f,\"time\":%.6f}", s, comm_s,
             T0 + s);
}

/* flight entries: collectives #1..#done completed (allreduce of 100 fp32), then #done+1 in
 * state `state` (NULL: none) waiting for `waiting` (-1: null) */
static void flight(struct log *l, int done, const char *state, int waiting, uint64_t count)
{
    for (int s = 1; s <= done; s++)
        line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":0,\"seq\":%d,\"op\":\"allreduce\","
                "\"dtype\":\"fp32\",\"count\":100,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\","
                "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":null}", s, s, T0 + s, T0 + s,
             T0 + s + 0.01);
    if (!state)
        return;
    char w[16];
    snprintf(w, sizeof(w), waiting < 0 ? "null" : "%d", waiting);
    line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":0,\"seq\":%d,\"op\":\"allreduce\",\"dtype\":\"fp32\","
            "\"count\":%llu,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"%s\",\"enqueued\":%.6f,"
            "\"started\":%.6f,\"ended\":null,\"waiting_for\":%s}", done + 1, done + 1, (unsigned long long)count, state,
         T0 + done + 1, T0 + done + 1, w);
}

static void sigterm(struct log *l, int rank, int step, double t, const char *from)
{
    line(l, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":15,\"signal_name\":\"SIGTERM\",\"code\":0,"
            "\"code_name\":\"SI_USER\",\"addr\":null,\"sender_pid\":99,\"from\":\"%s\",\"rank\":%d,\"step\":%d,"
            "\"time\":%.6f,\"backtrace\":[]}", from, rank, step, t);
}

static void exit_rec(struct log *l, int rank, int status, int sig, const char *signame, const char *stop, double t)
{
    char sn[32], st[32];
    snprintf(sn, sizeof(sn), signame ? "\"%s\"" : "null", signame);
    snprintf(st, sizeof(st), stop ? "\"%s\"" : "null", stop);
    line(l, "{\"type\":\"exit\",\"rank\":%d,\"host\":\"h\",\"pid\":1,\"status\":%d,\"signal\":%d,\"signal_name\":%s,"
            "\"core_dumped\":false,\"oom_killed\":false,\"stop_signal\":%s,\"time\":%.6f}", rank, status, sig, sn, st, t);
}

static void timeout(struct log *l, int rank, int seq, int waiting, double t)
{
    char w[16];
    snprintf(w, sizeof(w), waiting < 0 ? "null" : "%d", waiting);
    line(l, "{\"type\":\"cause\",\"cause\":\"timeout\",\"by\":\"watchdog\",\"op\":\"allreduce\",\"group\":\"dp\","
            "\"gid\":0,\"seq\":%d,\"count\":100,\"bytes\":400,\"waited_s\":5.0,\"rank\":%d,\"time\":%.6f,"
            "\"timeout_s\":5.0,\"peer\":null,\"waiting_for\":%s,\"waiting_for_host\":null,\"step\":3,"
            "\"message\":\"x\"}", seq, rank, t, w);
}

static void add(struct am_diag *d, int rank, const struct log *l)
{
    assert_int_equal(am_diag_add_log(d, rank, l->text, l->len), 0);
}

static char *json_text(const struct am_diag *d)
{
    json_t *o = am_diag_json(d);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static void expect_in_json(const struct am_diag *d, const char *part)
{
    char *s = json_text(d);
    if (!strstr(s, part))
        fail_msg("no %s in %s", part, s);
    free(s);
}

/* ---- the cases ---------------------------------------------------------------------------------- */

/* rank 2 segfaults at step 3; the others wait in allreduce #5 and are stopped by am-launch */
static void test_crash_and_victims(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 4; r++) {
        start(&l, r, 4, r < 2 ? "n1" : "n2");
        steps(&l, 2, 0.01);
        if (r == 2) {
            flight(&l, 4, NULL, -1, 100);
            line(&l, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":11,\"signal_name\":\"SIGSEGV\",\"code\":1,"
                     "\"code_name\":\"SEGV_MAPERR\",\"addr\":\"0x10\",\"sender_pid\":null,\"from\":\"kernel\",\"rank\":2,"
                     "\"step\":3,\"time\":%.6f,\"backtrace\":[\"am-train(am_fault_segv+0x12) [0x1]\",\"am-train(main+0x5) "
                     "[0x2]\"]}", T0 + 5.5);
            exit_rec(&l, 2, 139, 11, "SIGSEGV", NULL, T0 + 5.51);
        } else {
            flight(&l, 4, "started", (r + 3) % 4, 100);
            line(&l, "{\"type\":\"stop\",\"rank\":%d,\"host\":\"h\",\"signal\":\"SIGTERM\",\"by\":\"am-launch\","
                     "\"because_rank\":2,\"because_host\":\"n2\",\"because\":\"x\",\"because_time\":%.6f,\"time\":%.6f}", r,
                 T0 + 5.51, T0 + 5.52);
            sigterm(&l, r, 3, T0 + 5.53, "supervisor");
            exit_rec(&l, r, 143, 15, "SIGTERM", "SIGTERM", T0 + 5.54);
        }
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.failed, 1);
    assert_int_equal(d.culprit, 2);
    assert_string_equal(d.ff_cause, "signal");
    assert_string_equal(d.ff_signal, "SIGSEGV");
    assert_int_equal(d.ff_step, 3);
    assert_int_equal(d.ranks[2].verdict, AM_VERDICT_FIRST);
    for (int r = 0; r < 4; r++)
        if (r != 2) {
            assert_int_equal(d.ranks[r].verdict, AM_VERDICT_VICTIM);
            assert_non_null(strstr(d.ranks[r].detail, "waited in allreduce #5 of group dp"));
            assert_non_null(strstr(d.ranks[r].detail, "whose missing member is rank 2"));
            assert_non_null(strstr(d.ranks[r].detail, "because rank 2 failed"));
        }
    assert_int_equal(d.n_mismatches, 0);
    expect_in_json(&d, "\"first_failure\":{\"rank\":2,\"host\":\"n2\",\"cause\":\"signal\",\"signal\":\"SIGSEGV\","
                       "\"step\":3,\"status\":139,\"local_rank\":0,");
    expect_in_json(&d, "\"backtrace\":[\"am-train(am_fault_segv+0x12) [0x1]\",\"am-train(main+0x5) [0x2]\"]");
    expect_in_json(&d, "{\"rank\":0,\"host\":\"n1\",\"verdict\":\"victim\",\"end\":\"stopped\",\"signal\":\"SIGTERM\","
                       "\"status\":143,\"step\":3,\"group\":\"dp\",\"seq\":5,\"op\":\"allreduce\",\"waiting_for\":3,"
                       "\"stopped_because\":2,");
    expect_in_json(&d, "\"missing_ranks\":[],\"mismatches\":[]");
    am_diag_free(&d);
}

/* rank 1 stops making progress after allreduce #4; ranks 0, 2, 3 time out in #5 */
static void test_hang_outside(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 4; r++) {
        start(&l, r, 4, "n1");
        steps(&l, 2, 0.01);
        if (r == 1) {
            sigterm(&l, 1, 3, T0 + 11, "supervisor");
            flight(&l, 4, NULL, -1, 100);
            exit_rec(&l, 1, 143, 15, "SIGTERM", "SIGTERM", T0 + 11.01);
        } else {
            timeout(&l, r, 5, r == 2 ? 1 : (r + 3) % 4, T0 + 10 + 0.01 * r);
            flight(&l, 4, "timed_out", r == 2 ? 1 : (r + 3) % 4, 100);
            exit_rec(&l, r, 1, 0, NULL, NULL, T0 + 10.5);
        }
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 1);
    assert_string_equal(d.ff_cause, "hang");
    assert_int_equal(d.ff_step, 3);
    assert_non_null(strstr(d.ff_detail, "never issued allreduce #5 of group dp"));
    for (int r = 0; r < 4; r++)
        assert_int_equal(d.ranks[r].verdict, r == 1 ? AM_VERDICT_FIRST : AM_VERDICT_VICTIM);
    expect_in_json(&d, "\"first_failure\":{\"rank\":1,\"host\":\"n1\",\"cause\":\"hang\",\"signal\":null,\"step\":3,");
    expect_in_json(&d, "\"group\":\"dp\",\"seq\":5,\"op\":\"allreduce\"");
    am_diag_free(&d);
}

/* Pipeline: rank 1 (the last stage) hangs at step 3; rank 0 times out in recv #33 of group
 * pp_grad waiting for its gradient, with its own isend of activations still posted. Rank 0 is
 * a victim (a p2p wait is no collective it could have skipped), not a straggler. */
static void test_hang_in_recv(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 2; r++) {
        start(&l, r, 2, "n1");
        line(&l, "{\"type\":\"groups\",\"rank\":%d,\"groups\":[{\"name\":\"pp_grad\",\"gid\":3,\"ranks\":[0,1]}]}", r);
        steps(&l, 2, 0.01);
        if (r == 1) {
            sigterm(&l, 1, 3, T0 + 11, "supervisor");
            exit_rec(&l, 1, 143, 15, "SIGTERM", "SIGTERM", T0 + 11.01);
        } else {
            line(&l, "{\"type\":\"cause\",\"cause\":\"timeout\",\"by\":\"backend\",\"op\":\"recv\",\"group\":"
                     "\"pp_grad\",\"gid\":3,\"seq\":33,\"count\":100,\"bytes\":400,\"waited_s\":5.0,\"rank\":0,"
                     "\"time\":%.6f,\"timeout_s\":5.0,\"peer\":1,\"waiting_for\":1,\"waiting_for_host\":\"n1\","
                     "\"step\":3,\"message\":\"x\"}", T0 + 10);
            line(&l, "{\"type\":\"flight\",\"id\":1,\"group\":\"pp_grad\",\"gid\":3,\"seq\":33,\"op\":\"recv\","
                     "\"dtype\":\"fp32\",\"count\":100,\"bytes\":400,\"redop\":null,\"peer\":1,\"state\":\"timed_out\","
                     "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":1}", T0 + 5, T0 + 5, T0 + 10);
            line(&l, "{\"type\":\"flight\",\"id\":2,\"group\":\"pp\",\"gid\":2,\"seq\":34,\"op\":\"isend\","
                     "\"dtype\":\"fp32\",\"count\":100,\"bytes\":400,\"redop\":null,\"peer\":1,\"state\":\"posted\","
                     "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":null,\"waiting_for\":null}", T0 + 4, T0 + 4);
            exit_rec(&l, 0, 1, 0, NULL, NULL, T0 + 10.5);
        }
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 1);
    assert_string_equal(d.ff_cause, "hang");
    assert_non_null(strstr(d.ff_detail, "never completed the send matching rank 0's recv #33 on group pp_grad"));
    assert_int_equal(d.ranks[0].verdict, AM_VERDICT_VICTIM);
    assert_non_null(strstr(d.ranks[0].detail, "waited in recv #33 of group pp_grad"));
    am_diag_free(&d);
}

/* Pipeline x data parallelism: rank 0 waits longest, in recv #9 of group pp_grad for rank 1;
 * rank 1 was itself waiting (iallgather #45 of group dp, a prefetch) for rank 2, which hung
 * after #44. The blame follows the chain through rank 1's wait to rank 2. */
static void test_hang_recv_chain(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 3; r++) {
        start(&l, r, 3, "n1");
        l.len = (size_t)(strchr(l.text, '\n') + 1 - l.text); /* the start record only: this rank's own groups */
        line(&l, "{\"type\":\"groups\",\"rank\":%d,\"groups\":[%s]}", r,
             r == 0   ? "{\"name\":\"pp_grad\",\"gid\":3,\"ranks\":[0,1]}"
             : r == 1 ? "{\"name\":\"dp_shard\",\"gid\":1,\"ranks\":[1,2]},{\"name\":\"pp_grad\",\"gid\":3,\"ranks\":[0,1]}"
                      : "{\"name\":\"dp_shard\",\"gid\":1,\"ranks\":[1,2]}");
        steps(&l, 1, 0.01);
        if (r == 0) {
            line(&l, "{\"type\":\"cause\",\"cause\":\"timeout\",\"by\":\"watchdog\",\"op\":\"recv\",\"group\":"
                     "\"pp_grad\",\"gid\":3,\"seq\":9,\"count\":100,\"bytes\":400,\"waited_s\":4.3,\"rank\":0,"
                     "\"time\":%.6f,\"timeout_s\":4.0,\"peer\":1,\"waiting_for\":1,\"waiting_for_host\":\"n1\","
                     "\"step\":2,\"message\":\"x\"}", T0 + 9.3);
            line(&l, "{\"type\":\"flight\",\"id\":1,\"group\":\"pp_grad\",\"gid\":3,\"seq\":9,\"op\":\"recv\","
                     "\"dtype\":\"fp32\",\"count\":100,\"bytes\":400,\"redop\":null,\"peer\":1,\"state\":\"timed_out\","
                     "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":1}", T0 + 5, T0 + 5, T0 + 9.3);
            exit_rec(&l, 0, 1, 0, NULL, NULL, T0 + 9.5);
        } else if (r == 1) {
            sigterm(&l, 1, 2, T0 + 9.6, "supervisor");
            line(&l, "{\"type\":\"flight\",\"id\":1,\"group\":\"dp_shard\",\"gid\":1,\"seq\":44,\"op\":\"allreduce\","
                     "\"dtype\":\"fp32\",\"count\":1,\"bytes\":4,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\","
                     "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":null}", T0 + 4, T0 + 4, T0 + 4.1);
            line(&l, "{\"type\":\"flight\",\"id\":2,\"group\":\"dp_shard\",\"gid\":1,\"seq\":45,\"op\":\"iallgather\","
                     "\"dtype\":\"fp32\",\"count\":100,\"bytes\":800,\"redop\":null,\"peer\":null,\"state\":\"started\","
                     "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":null,\"waiting_for\":2}", T0 + 5.1, T0 + 5.1);
            exit_rec(&l, 1, 143, 15, "SIGTERM", "SIGTERM", T0 + 9.61);
        } else {
            sigterm(&l, 2, 2, T0 + 9.6, "supervisor");
            line(&l, "{\"type\":\"flight\",\"id\":1,\"group\":\"dp_shard\",\"gid\":1,\"seq\":44,\"op\":\"allreduce\","
                     "\"dtype\":\"fp32\",\"count\":1,\"bytes\":4,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\","
                     "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":null}", T0 + 4, T0 + 4, T0 + 4.1);
            exit_rec(&l, 2, 143, 15, "SIGTERM", "SIGTERM", T0 + 9.61);
        }
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 2);
    assert_string_equal(d.ff_cause, "hang");
    assert_non_null(strstr(d.ff_detail, "never issued iallgather #45 of group dp_shard"));
    assert_int_equal(d.ranks[0].verdict, AM_VERDICT_VICTIM);
    assert_int_equal(d.ranks[1].verdict, AM_VERDICT_VICTIM);
    assert_int_equal(d.ranks[2].verdict, AM_VERDICT_FIRST);
    am_diag_free(&d);
}

/* rank 3 is stuck inside allreduce #5 waiting for no one; every rank times out */
static void test_hang_inside(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 4; r++) {
        int waiting = r == 3 ? -1 : r == 0 ? 3 : r - 1; /* a ring: 0 waits for 3, 1 for 0, 2 for 1 */
        start(&l, r, 4, "n1");
        steps(&l, 2, 0.01);
        timeout(&l, r, 5, waiting, T0 + 10 + 0.001 * r);
        flight(&l, 4, "timed_out", waiting, 100);
        exit_rec(&l, r, 1, 0, NULL, NULL, T0 + 10.5);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 3);
    assert_string_equal(d.ff_cause, "hang");
    assert_non_null(strstr(d.ff_detail, "stuck inside allreduce #5 of group dp"));
    for (int r = 0; r < 3; r++)
        assert_int_equal(d.ranks[r].verdict, AM_VERDICT_VICTIM);
    am_diag_free(&d);
}

/* tp 2 x dp 2: tp groups {0,1} {2,3} (gids 2, 3), dp groups {0,2} {1,3} (gids 0, 1). Rank 3
 * hangs at step 3; its tp partner 2 waits in tp allreduce #7 for it; ranks 0 and 1 wait in
 * their dp all-reduces #5, rank 0 for rank 2; rank 0's watchdog fires first. The blame
 * follows rank 2 into the tp group: rank 3. */
static void tp_rank(struct log *l, int r, int tp_gid, const char *tp_ranks, int dp_gid, const char *dp_ranks)
{
    l->len = 0;
    line(l, "{\"type\":\"start\",\"host\":\"n%d\",\"rank\":%d,\"world\":4,\"job\":\"7.0\",\"local_rank\":%d,"
            "\"time\":%.6f,\"max_steps\":6}", r / 2 + 1, r, r % 2, T0);
    line(l, "{\"type\":\"groups\",\"rank\":%d,\"groups\":[{\"name\":\"dp\",\"gid\":%d,\"ranks\":[%s]},"
            "{\"name\":\"tp\",\"gid\":%d,\"ranks\":[%s]}]}", r, dp_gid, dp_ranks, tp_gid, tp_ranks);
    steps(l, 2, 0.01);
}

static void tp_call(struct log *l, int id, const char *group, int gid, int seq, const char *state, int waiting,
                    double started)
{
    char w[16];
    snprintf(w, sizeof(w), waiting < 0 ? "null" : "%d", waiting);
    line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"%s\",\"gid\":%d,\"seq\":%d,\"op\":\"allreduce\","
            "\"dtype\":\"fp32\",\"count\":10,\"bytes\":40,\"redop\":\"sum\",\"peer\":null,\"state\":\"%s\","
            "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%s,\"waiting_for\":%s}", id, group, gid, seq, state,
         started, started, strcmp(state, "completed") == 0 ? "1767000004.5" : "null", w);
}

static void test_hang_chain_through_tp(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    static const char *tp[] = {"0,1", "0,1", "2,3", "2,3"}, *dp[] = {"0,2", "1,3", "0,2", "1,3"};
    for (int r = 0; r < 4; r++) {
        tp_rank(&l, r, 2 + r / 2, tp[r], r % 2, dp[r]);
        for (int s = 1; s <= 6; s++) /* tp calls #1-#6 completed, dp #1-#4 completed */
            tp_call(&l, s, "tp", 2 + r / 2, s, "completed", -1, T0 + 4);
        for (int s = 1; s <= 4; s++)
            tp_call(&l, 6 + s, "dp", r % 2, s, "completed", -1, T0 + 4);
        if (r == 3) {
            sigterm(&l, 3, 3, T0 + 9.6, "supervisor");
        } else if (r == 2) {
            tp_call(&l, 11, "tp", 3, 7, "started", 3, T0 + 5.0);
            sigterm(&l, 2, 3, T0 + 9.6, "supervisor");
        } else {
            tp_call(&l, 11, "dp", r % 2, 5, "timed_out", r == 0 ? 2 : 3, T0 + 5.1);
            line(&l, "{\"type\":\"cause\",\"cause\":\"timeout\",\"by\":\"watchdog\",\"op\":\"allreduce\","
                     "\"group\":\"dp\",\"gid\":%d,\"seq\":5,\"waited_s\":4.4,\"rank\":%d,\"time\":%.6f,"
                     "\"waiting_for\":%d,\"step\":3}", r % 2, r, T0 + 9.5 + 0.01 * r, r == 0 ? 2 : 3);
        }
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 3);
    assert_string_equal(d.ff_cause, "hang");
    assert_non_null(d.ff_in);
    assert_string_equal(d.ff_in->group, "tp");
    assert_int_equal(d.ff_in->seq, 7);
    assert_non_null(strstr(d.ff_detail, "never issued allreduce #7 of group tp"));
    for (int r = 0; r < 3; r++)
        assert_int_equal(d.ranks[r].verdict, AM_VERDICT_VICTIM);
    assert_non_null(strstr(d.ranks[2].detail, "waited in allreduce #7 of group tp"));
    assert_non_null(strstr(d.ranks[2].detail, "whose missing member is rank 3"));
    assert_int_equal(d.n_mismatches, 0);
    am_diag_free(&d);
}

/* Overlapped gradient reduction, tp 2 x dp 2 as above: rank 3's dp iallreduce #5 hangs inside
 * (a stalled transfer) while its backward goes on (tp #7 completes after it); its dp partner,
 * rank 1, waits for #5 after the backward; ranks 0 and 2 wait in tp #8 for their partners, who
 * are stuck in the dp wait. The non-blocking call waited for lies before completed calls in the
 * flight recorder; the blame follows it to rank 3. */
static void iallreduce(struct log *l, int id, int gid, int seq, const char *state, int waiting, double started)
{
    char w[16];
    snprintf(w, sizeof(w), waiting < 0 ? "null" : "%d", waiting);
    line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":%d,\"seq\":%d,\"op\":\"iallreduce\","
            "\"dtype\":\"fp32\",\"count\":10,\"bytes\":40,\"redop\":\"sum\",\"peer\":null,\"state\":\"%s\","
            "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":null,\"waiting_for\":%s}", id, gid, seq, state, started,
         started, w);
}

static void test_hang_in_nonblocking(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    static const char *tp[] = {"0,1", "0,1", "2,3", "2,3"}, *dp[] = {"0,2", "1,3", "0,2", "1,3"};
    for (int r = 0; r < 4; r++) {
        tp_rank(&l, r, 2 + r / 2, tp[r], r % 2, dp[r]);
        for (int s = 1; s <= 6; s++)
            tp_call(&l, s, "tp", 2 + r / 2, s, "completed", -1, T0 + 4);
        for (int s = 1; s <= 4; s++)
            tp_call(&l, 6 + s, "dp", r % 2, s, "completed", -1, T0 + 4);
        if (r % 2 == 1) { /* dp group {1,3}: #5 started in the backward, waited for after it */
            iallreduce(&l, 11, 1, 5, r == 3 ? "timed_out" : "started", r == 3 ? -1 : 3, T0 + 5.2);
            tp_call(&l, 12, "tp", 2 + r / 2, 7, "completed", -1, T0 + 5.1);
            line(&l, "{\"type\":\"cause\",\"cause\":\"timeout\",\"by\":\"watchdog\",\"op\":\"iallreduce\","
                     "\"group\":\"dp\",\"gid\":1,\"seq\":5,\"waited_s\":4.0,\"rank\":%d,\"time\":%.6f,"
                     "\"waiting_for\":%s,\"step\":3}", r, T0 + 9.2 + 0.01 * r, r == 3 ? "null" : "3");
        } else { /* dp group {0,2} finished; tp #8 (the gradient norm) waits for the partner */
            iallreduce(&l, 11, 0, 5, "completed", -1, T0 + 5.0);
            tp_call(&l, 12, "tp", 2 + r / 2, 7, "completed", -1, T0 + 5.1);
            tp_call(&l, 13, "tp", 2 + r / 2, 8, "started", r + 1, T0 + 5.3);
            sigterm(&l, r, 3, T0 + 9.6, "supervisor");
        }
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 3);
    assert_string_equal(d.ff_cause, "hang");
    assert_non_null(d.ff_in);
    assert_string_equal(d.ff_in->group, "dp");
    assert_string_equal(d.ff_in->op, "iallreduce");
    assert_int_equal(d.ff_in->seq, 5);
    assert_non_null(strstr(d.ff_detail, "stuck inside iallreduce #5 of group dp"));
    for (int r = 0; r < 3; r++)
        assert_int_equal(d.ranks[r].verdict, AM_VERDICT_VICTIM);
    assert_non_null(strstr(d.ranks[1].detail, "waited in iallreduce #5 of group dp"));
    am_diag_free(&d);
}

/* a node's logs are missing: ranks 2 and 3; the others waited for rank 2 */
static void test_missing_ranks(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 2; r++) {
        start(&l, r, 4, "n1");
        steps(&l, 2, 0.01);
        timeout(&l, r, 5, 2, T0 + 10);
        flight(&l, 4, "timed_out", 2, 100);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.world, 4);
    assert_int_equal(d.culprit, 2);
    assert_string_equal(d.ff_cause, "hang");
    assert_non_null(strstr(d.ff_detail, "left no log"));
    assert_int_equal(d.ranks[3].verdict, AM_VERDICT_MISSING);
    assert_int_equal(d.ranks[2].verdict, AM_VERDICT_FIRST);
    expect_in_json(&d, "\"missing_ranks\":[2,3]");
    expect_in_json(&d, "{\"rank\":3,\"host\":null,\"verdict\":\"missing\"");
    am_diag_free(&d);
}

/* the culprit's log ends in the middle of a line; a line in the middle is garbage */
static void test_truncated_log(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    start(&l, 0, 2, "n1");
    steps(&l, 2, 0.01);
    flight(&l, 4, "started", 1, 100);
    sigterm(&l, 0, 3, T0 + 6, "supervisor");
    exit_rec(&l, 0, 143, 15, "SIGTERM", "SIGTERM", T0 + 6.01);
    add(&d, 0, &l);
    start(&l, 1, 2, "n1");
    line(&l, "this is not json");
    steps(&l, 2, 0.01);
    exit_rec(&l, 1, 134, 6, "SIGABRT", NULL, T0 + 5.9);
    line(&l, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":6,\"signal_name\":\"SIGABRT\",\"code\":-6,\"code_na");
    l.len--; /* no newline at the end */
    add(&d, 1, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.ranks[1].truncated, 1);
    assert_int_equal(d.ranks[1].bad_lines, 1);
    assert_int_equal(d.culprit, 1);
    assert_string_equal(d.ff_cause, "signal"); /* from the exit record */
    assert_string_equal(d.ff_signal, "SIGABRT");
    assert_int_equal(d.ranks[0].verdict, AM_VERDICT_VICTIM);
    int cut = 0, bad = 0;
    for (int i = 0; i < d.n_notes; i++) {
        cut |= strstr(d.notes[i], "rank 1: the last line is cut short") != NULL;
        bad |= strstr(d.notes[i], "rank 1: line 3 is not a JSON object") != NULL;
    }
    assert_true(cut);
    assert_true(bad);
    am_diag_free(&d);
}

/* ranks disagree: allreduce #3 with different counts, #4 with different ops, stuck in #5 and #7
 * (one apart, #5 and #6, would be the ordinary race: no mismatch) */
static void test_mismatches(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    start(&l, 0, 2, "n1");
    flight(&l, 4, "timed_out", 1, 100);
    timeout(&l, 0, 5, 1, T0 + 10);
    add(&d, 0, &l);
    start(&l, 1, 2, "n2");
    flight(&l, 2, NULL, -1, 100);
    line(&l, "{\"type\":\"flight\",\"id\":3,\"group\":\"dp\",\"gid\":0,\"seq\":3,\"op\":\"allreduce\",\"dtype\":\"fp32\","
             "\"count\":200,\"bytes\":800,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\",\"enqueued\":1,"
             "\"started\":1,\"ended\":1,\"waiting_for\":null}");
    line(&l, "{\"type\":\"flight\",\"id\":4,\"group\":\"dp\",\"gid\":0,\"seq\":4,\"op\":\"allgather\",\"dtype\":\"fp32\","
             "\"count\":100,\"bytes\":800,\"redop\":null,\"peer\":null,\"state\":\"completed\",\"enqueued\":1,"
             "\"started\":1,\"ended\":1,\"waiting_for\":null}");
    line(&l, "{\"type\":\"flight\",\"id\":5,\"group\":\"dp\",\"gid\":0,\"seq\":5,\"op\":\"allreduce\",\"dtype\":\"fp32\","
             "\"count\":100,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\",\"enqueued\":1,"
             "\"started\":1,\"ended\":1,\"waiting_for\":null}");
    line(&l, "{\"type\":\"flight\",\"id\":6,\"group\":\"dp\",\"gid\":0,\"seq\":6,\"op\":\"allreduce\",\"dtype\":\"fp32\","
             "\"count\":100,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\",\"enqueued\":1,"
             "\"started\":1,\"ended\":1,\"waiting_for\":null}");
    line(&l, "{\"type\":\"flight\",\"id\":7,\"group\":\"dp\",\"gid\":0,\"seq\":7,\"op\":\"allreduce\",\"dtype\":\"fp32\","
             "\"count\":100,\"bytes\":400,\"redop\":\"sum\",\"peer\":null,\"state\":\"timed_out\",\"enqueued\":1,"
             "\"started\":1,\"ended\":null,\"waiting_for\":0}");
    timeout(&l, 1, 7, 0, T0 + 10.2);
    add(&d, 1, &l);
    am_diag_analyze(&d);
    int size = 0, op = 0, seq = 0;
    for (int i = 0; i < d.n_mismatches; i++) {
        const struct am_diag_mismatch *m = &d.mismatches[i];
        if (strcmp(m->what, "size") == 0 && m->seq == 3) {
            size = 1;
            assert_string_equal(m->text, "allreduce #3 of group dp: rank 0 passed 100 fp32, rank 1 passed 200 fp32");
        }
        if (strcmp(m->what, "op") == 0 && m->seq == 4) {
            op = 1;
            assert_string_equal(m->text, "allreduce #4 of group dp: rank 0 called allreduce, rank 1 called allgather");
        }
        if (strcmp(m->what, "sequence") == 0) {
            seq = 1;
            assert_string_equal(m->text, "group dp: rank 0 is stuck in allreduce #5, rank 1 in allreduce #7");
        }
    }
    assert_true(size && op && seq);
    assert_int_equal(d.failed, 1);
    expect_in_json(&d, "{\"group\":\"dp\",\"gid\":0,\"seq\":3,\"what\":\"size\",");
    am_diag_free(&d);
}

/* Non-blocking collectives: rank 0 waits in iallgather #5 with #6 and #7 already issued
 * (posted), rank 1 waits in #7: rank 0 is behind in its data, not counting its calls
 * differently, so there is no sequence mismatch; one apart beyond what rank 0 issued (#9) is. */
static void test_sequence_nonblocking(void **state)
{
    (void)state;
    for (int far = 0; far < 2; far++) {
        struct am_diag d;
        struct log l;
        am_diag_init(&d);
        start(&l, 0, 2, "n1");
        flight(&l, 4, NULL, -1, 100);
        for (int s = 5; s <= 7; s++)
            line(&l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":0,\"seq\":%d,\"op\":\"iallgather\","
                     "\"dtype\":\"fp32\",\"count\":100,\"bytes\":800,\"redop\":null,\"peer\":null,\"state\":\"%s\","
                     "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":null,\"waiting_for\":%s}", s, s,
                 s == 5 ? "timed_out" : "posted", T0 + s, T0 + s, s == 5 ? "1" : "null");
        timeout(&l, 0, 5, 1, T0 + 10);
        add(&d, 0, &l);
        start(&l, 1, 2, "n2");
        flight(&l, far ? 8 : 6, "timed_out", 0, 100);
        timeout(&l, 1, far ? 9 : 7, 0, T0 + 10.2);
        add(&d, 1, &l);
        am_diag_analyze(&d);
        int seq = 0;
        for (int i = 0; i < d.n_mismatches; i++)
            if (strcmp(d.mismatches[i].what, "sequence") == 0) {
                seq = 1;
                assert_string_equal(d.mismatches[i].text, "group dp: rank 0 is stuck in iallgather #5, rank 1 in allreduce #9");
            }
        assert_int_equal(seq, far);
        am_diag_free(&d);
    }
}

/* a clean job where rank 1 was 2 s late at step 3 */
static void test_straggler(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 3; r++) {
        start(&l, r, 3, "n1");
        for (int s = 1; s <= 6; s++)
            line(&l, "{\"type\":\"step\",\"step\":%d,\"step_s\":%s,\"comm_s\":%s,\"time\":%.6f}", s,
                 s == 3 ? "2.1" : "0.1", s == 3 && r != 1 ? "2.05" : "0.05", T0 + s);
        exit_rec(&l, r, 0, 0, NULL, NULL, T0 + 7);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.failed, 0);
    assert_null(d.ff_cause);
    assert_int_equal(d.culprit, -1);
    assert_int_equal(d.ranks[0].verdict, AM_VERDICT_CLEAN);
    assert_int_equal(d.ranks[1].verdict, AM_VERDICT_STRAGGLER);
    assert_int_equal(d.ranks[2].verdict, AM_VERDICT_CLEAN);
    assert_non_null(strstr(d.ranks[1].detail, "at step 3"));
    expect_in_json(&d, "\"status\":\"clean\",\"first_failure\":null");
    char *text = json_text(&d);
    assert_null(strstr(text, "expert_load")); /* no ep_tokens_in in the records */
    free(text);
    am_diag_free(&d);

    /* the same with steps numbered far apart (merged through the heap, not walked by number),
     * rank 2's records out of order */
    am_diag_init(&d);
    for (int r = 0; r < 3; r++) {
        l.len = 0;
        line(&l, "{\"type\":\"start\",\"world\":3,\"time\":%.6f,\"max_steps\":6000000}", T0);
        for (int i = 1; i <= 6; i++) {
            int s = r == 2 ? 7 - i : i;
            line(&l, "{\"type\":\"step\",\"step\":%d,\"step_s\":%s,\"comm_s\":%s,\"time\":%.6f}", s * 1000000,
                 s == 3 ? "2.1" : "0.1", s == 3 && r != 1 ? "2.05" : "0.05", T0 + s);
        }
        exit_rec(&l, r, 0, 0, NULL, NULL, T0 + 7);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.ranks[0].verdict, AM_VERDICT_CLEAN);
    assert_int_equal(d.ranks[1].verdict, AM_VERDICT_STRAGGLER);
    assert_int_equal(d.ranks[2].verdict, AM_VERDICT_CLEAN);
    assert_string_equal(d.ranks[1].detail, "finished cleanly, but held the others back: at step 3000000 it spent 2.00 s "
                                           "longer outside collectives than the median rank, while the others waited for it");
    am_diag_free(&d);
}

/* Expert parallelism: 4 ranks whose step records carry ep_tokens_in; rank 3 is the straggler
 * of step 3 (at step `scale` x 3: scale 1 walks the steps by number, a large scale merges them
 * through the heap) and its experts received `load` tokens there, the others 2000. */
static char *report(const struct am_diag *d);

static void ep_job(struct am_diag *d, int scale, int load)
{
    struct log l;
    am_diag_init(d);
    for (int r = 0; r < 4; r++) {
        start(&l, r, 4, "n1");
        for (int s = 1; s <= 6; s++)
            line(&l, "{\"type\":\"step\",\"step\":%d,\"step_s\":%s,\"comm_s\":%s,\"time\":%.6f,\"expert_tokens_min\":400,"
                     "\"expert_tokens_max\":900,\"expert_imbalance\":1.3,\"alltoall_s\":0.01,\"ep_tokens_in\":%d%s}",
                 s * scale, s == 3 ? "2.1" : "0.1", s == 3 && r != 3 ? "2.05" : "0.05", T0 + s,
                 s == 3 && r == 3 ? load : 2000,
                 s == 3 && r == 3 ? ",\"nested\":{\"a\":1}" : ""); /* jansson reads that one */
        exit_rec(&l, r, 0, 0, NULL, NULL, T0 + 7);
        add(d, r, &l);
    }
    am_diag_analyze(d);
}

static void test_straggler_expert_load(void **state)
{
    (void)state;
    struct am_diag d;
    ep_job(&d, 1, 5000); /* 2.5x the median: routing overloaded it */
    assert_int_equal(d.failed, 0);
    for (int r = 0; r < 3; r++)
        assert_int_equal(d.ranks[r].verdict, AM_VERDICT_CLEAN);
    assert_int_equal(d.ranks[3].verdict, AM_VERDICT_STRAGGLER);
    assert_string_equal(d.ranks[3].detail,
                        "finished cleanly, but held the others back: at step 3 it spent 2.00 s longer outside "
                        "collectives than the median rank, while the others waited for it; its experts received "
                        "2.50x the median rank's expert tokens at step 3 (5000 against 2000): an overloaded "
                        "expert-parallel rank (routing imbalance), not a slow node");
    char *text = report(&d);
    if (!strstr(text, "\n  rank 3 on n1: straggler: finished cleanly, but held the others back: at step 3 it spent "
                      "2.00 s longer outside collectives than the median rank, while the others waited for it; its "
                      "experts received 2.50x the median rank's expert tokens at step 3 (5000 against 2000): an "
                      "overloaded expert-parallel rank (routing imbalance), not a slow node\n"))
        fail_msg("report:\n%s", text);
    free(text);
    expect_in_json(&d, "\"expert_load\":{\"step\":3,\"tokens_in\":5000,\"median_tokens_in\":2000,\"ratio\":2.5,"
                       "\"overloaded\":true}");
    am_diag_free(&d);

    /* exactly 1.5x: overloaded (the rule is >= 1.5) */
    ep_job(&d, 1, 3000);
    assert_non_null(strstr(d.ranks[3].detail, "; its experts received 1.50x the median rank's expert tokens at step 3 "
                                               "(3000 against 2000): an overloaded expert-parallel rank"));
    am_diag_free(&d);

    /* 1.05x the median, steps far apart (the heap): slow by itself */
    ep_job(&d, 1000000, 2100);
    assert_int_equal(d.ranks[3].verdict, AM_VERDICT_STRAGGLER);
    assert_string_equal(d.ranks[3].detail,
                        "finished cleanly, but held the others back: at step 3000000 it spent 2.00 s longer outside "
                        "collectives than the median rank, while the others waited for it; its experts received "
                        "1.05x the median rank's expert tokens at step 3000000 (2100 against 2000): not overloaded "
                        "by the routing (a slow node or device)");
    expect_in_json(&d, "\"expert_load\":{\"step\":3000000,\"tokens_in\":2100,\"median_tokens_in\":2000,");
    expect_in_json(&d, "\"overloaded\":false}");
    am_diag_free(&d);
}

/* scancel: every rank got SIGTERM from Slurm; no rank failed */
static void test_stopped_from_outside(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 2; r++) {
        start(&l, r, 2, "n1");
        steps(&l, 2, 0.01);
        sigterm(&l, r, 3, T0 + 3 + 0.01 * r, "other");
        flight(&l, 4, NULL, -1, 100);
        exit_rec(&l, r, 143, 15, "SIGTERM", "SIGTERM", T0 + 3.1);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.failed, 1);
    assert_int_equal(d.culprit, -1);
    assert_string_equal(d.ff_cause, "stopped");
    assert_string_equal(d.ff_signal, "SIGTERM");
    assert_int_equal(d.ranks[0].verdict, AM_VERDICT_STOPPED);
    expect_in_json(&d, "\"first_failure\":{\"rank\":null,\"host\":null,\"cause\":\"stopped\",\"signal\":\"SIGTERM\",");
    am_diag_free(&d);
}

/* exits without a cause record: a status, the OOM killer, an early exit 0 */
static void test_exits_without_cause(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    start(&l, 0, 2, "n1");
    steps(&l, 2, 0.01);
    line(&l, "{\"type\":\"exit\",\"rank\":0,\"host\":\"n1\",\"pid\":1,\"status\":137,\"signal\":9,\"signal_name\":"
             "\"SIGKILL\",\"core_dumped\":false,\"oom_killed\":true,\"stop_signal\":null,\"time\":%.6f}", T0 + 3);
    add(&d, 0, &l);
    start(&l, 1, 2, "n1");
    steps(&l, 2, 0.01);
    exit_rec(&l, 1, 7, 0, NULL, NULL, T0 + 4);
    add(&d, 1, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 0);
    assert_string_equal(d.ff_cause, "oom");
    assert_string_equal(d.ff_signal, "SIGKILL");
    assert_int_equal(d.ff_step, 3);
    assert_int_equal(d.ranks[1].verdict, AM_VERDICT_FAILED);
    assert_non_null(strstr(d.ranks[1].detail, "exited with status 7"));
    am_diag_free(&d);

    am_diag_init(&d);
    start(&l, 0, 1, "n1");
    steps(&l, 2, 0.01);
    exit_rec(&l, 0, 0, 0, NULL, NULL, T0 + 3);
    add(&d, 0, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 0);
    assert_string_equal(d.ff_cause, "exit");
    assert_int_equal(d.ff_status, 0);
    assert_non_null(strstr(d.ff_detail, "exited with status 0 after step 2 of 6"));
    am_diag_free(&d);
}

static void test_clean(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 2; r++) {
        start(&l, r, 2, "n1");
        steps(&l, 6, 0.01);
        exit_rec(&l, r, 0, 0, NULL, NULL, T0 + 7);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.failed, 0);
    assert_int_equal(d.ranks[0].verdict, AM_VERDICT_CLEAN);
    assert_int_equal(d.ranks[1].verdict, AM_VERDICT_CLEAN);
    char buf[8192];
    FILE *f = fmemopen(buf, sizeof(buf), "w");
    am_diag_print(&d, f);
    fclose(f);
    assert_non_null(strstr(buf, "no failure: every rank with a log finished cleanly\n"));
    assert_non_null(strstr(buf, "others: 2 clean (ranks 0-1)\n"));
    am_diag_free(&d);
}


/* ---- hostile and broken logs ------------------------------------------------------------------ */

static char *report(const struct am_diag *d)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    am_diag_print(d, f);
    fclose(f);
    return buf;
}

static void expect_report(const struct am_diag *d, const char *want)
{
    char *got = report(d);
    if (strcmp(got, want) != 0)
        fail_msg("report:\n%s\n---- want:\n%s", got, want);
    free(got);
}

static void expect_json(const struct am_diag *d, const char *want)
{
    char *got = json_text(d);
    if (strcmp(got, want) != 0)
        fail_msg("json:\n%s\n---- want:\n%s", got, want);
    free(got);
}

static void add_text(struct am_diag *d, int rank, const char *text)
{
    assert_int_equal(am_diag_add_log(d, rank, text, strlen(text)), 0);
}

#define TIMEOUT_LOG(flight) \
    "{\"type\":\"start\",\"world\":1,\"time\":1.0}\n" flight \
    "{\"type\":\"cause\",\"cause\":\"timeout\",\"time\":2.0}\n"

/* A recv from a peer the job does not have (world 1, peer 5): the peer was created after a
 * pointer to the waiting rank was taken, which then pointed into freed memory; a release build
 * reported "1 rank" and "first failure: rank 5". The peer is no rank of the job: no one to
 * blame, a note, and the hang named with its call. */
static void test_peer_outside_the_job(void **state)
{
    (void)state;
    struct am_diag d;
    am_diag_init(&d);
    add_text(&d, 0, TIMEOUT_LOG("{\"type\":\"flight\",\"op\":\"recv\",\"group\":\"pp\",\"state\":\"started\",\"gid\":0,"
                                "\"seq\":1,\"peer\":5,\"started\":1.5}\n"));
    am_diag_analyze(&d);
    assert_int_equal(d.n_ranks, 1);
    assert_int_equal(d.culprit, -1);
    expect_report(&d, "am-diag: job ? (): 1 rank, FAILED\n"
                  "first failure: no rank (hang), 1970-01-01 00:00:01.500 UTC\n"
                  "  rank 0 waited in recv #1 on group pp for 0.50 s, for a peer that its log does not name (or names outside the job)\n"
                  "others: 1 victim (rank 0)\n"
                  "missing logs: none\n"
                  "mismatches: none\n"
                  "\n"
                  "details:\n"
                  "  rank 0: victim: waited in recv #1 of group pp for 0.50 s; timed out (?) and ended\n"
                  "\n"
                  "notes:\n"
                  "  rank 0: 1 rank number in its log is not a rank of the job (the first: 5; the job has 1 rank); ignored\n");
    am_diag_free(&d);
    /* the same with peer 20000000: the report indexed the rank array with it */
    am_diag_init(&d);
    add_text(&d, 0, TIMEOUT_LOG("{\"type\":\"flight\",\"op\":\"recv\",\"group\":\"pp\",\"state\":\"started\",\"gid\":0,"
                                "\"seq\":1,\"peer\":20000000,\"started\":1.5}\n"));
    am_diag_analyze(&d);
    assert_int_equal(d.n_ranks, 1);
    expect_report(&d, "am-diag: job ? (): 1 rank, FAILED\n"
                  "first failure: no rank (hang), 1970-01-01 00:00:01.500 UTC\n"
                  "  rank 0 waited in recv #1 on group pp for 0.50 s, for a peer that its log does not name (or names outside the job)\n"
                  "others: 1 victim (rank 0)\n"
                  "missing logs: none\n"
                  "mismatches: none\n"
                  "\n"
                  "details:\n"
                  "  rank 0: victim: waited in recv #1 of group pp for 0.50 s; timed out (?) and ended\n"
                  "\n"
                  "notes:\n"
                  "  rank 0: 1 rank number in its log is not a rank of the job (the first: 20000000; the job has 1 rank); ignored\n");
    expect_json(&d, "{\"job\":null,\"dir\":\"\",\"world\":1,\"status\":\"failed\",\"first_failure\":{\"rank\":null,\"host\":null,\"cause\":\"hang\",\"signal\":null,\"step\":null,\"status\":null,\"local_rank\":null,\"coords\":null,\"time\":1.5,\"detail\":\"rank 0 waited in recv #1 on group pp for 0.50 s, for a peer that its log does not name (or names outside the job)\",\"backtrace\":[],\"group\":\"pp\",\"seq\":1,\"op\":\"recv\"},\"ranks\":[{\"rank\":0,\"host\":null,\"verdict\":\"victim\",\"end\":\"timeout\",\"signal\":null,\"status\":null,\"step\":1,\"group\":\"pp\",\"seq\":1,\"op\":\"recv\",\"waiting_for\":null,\"stopped_because\":null,\"detail\":\"waited in recv #1 of group pp for 0.50 s; timed out (?) and ended\"}],\"missing_count\":0,\"missing_ranks\":[],\"mismatches\":[],\"notes\":[\"rank 0: 1 rank number in its log is not a rank of the job (the first: 20000000; the job has 1 rank); ignored\"]}");
    am_diag_free(&d);
}

/* A group naming rank 20000000 and a collective on it: the blame fell on a rank the rank table
 * refused (NULL dereference). Members outside the job are dropped (noted). */
static void test_member_outside_the_job(void **state)
{
    (void)state;
    struct am_diag d;
    am_diag_init(&d);
    add_text(&d, 0, TIMEOUT_LOG("{\"type\":\"groups\",\"groups\":[{\"name\":\"pp\",\"gid\":0,\"ranks\":[0,20000000]}]}\n"
                                "{\"type\":\"flight\",\"op\":\"allreduce\",\"group\":\"pp\",\"state\":\"started\","
                                "\"gid\":0,\"seq\":1,\"peer\":5,\"started\":1.5}\n"));
    am_diag_analyze(&d);
    assert_int_equal(d.n_ranks, 1);
    assert_int_equal(d.culprit, 0);
    expect_report(&d, "am-diag: job ? (): 1 rank, FAILED\n"
                  "first failure: rank 0 on (unknown host) at step 1, 1970-01-01 00:00:01.500 UTC\n"
                  "  cause: hang: stuck inside allreduce #1 of group pp at step 1 for 0.50 s, waiting for no peer, while 0 ranks waited for it\n"
                  "others: none\n"
                  "missing logs: none\n"
                  "mismatches: none\n"
                  "\n"
                  "details:\n"
                  "  rank 0: first_failure: stuck inside allreduce #1 of group pp at step 1 for 0.50 s, waiting for no peer, while 0 ranks waited for it\n"
                  "\n"
                  "notes:\n"
                  "  rank 0: 2 rank numbers in its log are not ranks of the job (the first: 5; the job has 1 rank); ignored\n");
    am_diag_free(&d);
}

/* Without a start record the ranks named in the logs are taken (sparsely: no entry for the
 * ranks between), and the job's size is the highest known + 1, only compared. */
static void test_huge_numbers_allocate_nothing(void **state)
{
    (void)state;
    struct am_diag d;
    am_diag_init(&d);
    add_text(&d, 0, "{\"type\":\"groups\",\"groups\":[{\"name\":\"dp\",\"gid\":0,\"ranks\":[0,2000000]}]}\n"
                    "{\"type\":\"exit\",\"status\":1,\"time\":5.0}\n");
    am_diag_analyze(&d);
    assert_int_equal(d.world, 2000001);
    assert_int_equal(d.n_ranks, 2);
    assert_int_equal(d.n_missing, 2000000);
    expect_report(&d, "am-diag: job ? (): 2000001 ranks, FAILED\n"
                  "first failure: rank 0 on (unknown host), 1970-01-01 00:00:05.000 UTC\n"
                  "  cause: exit: exited with status 1 without a cause record\n"
                  "others: 2000000 missing (ranks 1-2000000)\n"
                  "missing logs: 1-2000000\n"
                  "mismatches: none\n"
                  "\n"
                  "details:\n"
                  "  rank 0: first_failure: exited with status 1 without a cause record\n"
                  "  ranks 1-1999999: missing: no log, and no other log names them\n"
                  "  rank 2000000: missing: no log (rank-2000000.jsonl): its node's logs are missing, or the rank never started\n"
                  "\n"
                  "notes:\n"
                  "  no start record in any log: the job's size is unknown; assuming 2000001 ranks (the highest rank known, plus one)\n"
                  "  rank 0: its log has no start record (it failed before training began?)\n");
    char *j = json_text(&d);
    assert_non_null(strstr(j, "\"missing_count\":2000000,\"missing_ranks\":[1,2,3,"));
    free(j);
    am_diag_free(&d);
}

/* Truncation into fixed buffers split a UTF-8 character, and --json then dropped the key:
 * host is cut to 127 bytes, detail to 767, each on a character boundary. */
static void test_utf8_truncation_keeps_keys(void **state)
{
    (void)state;
    struct am_diag d;
    char host[200], msg[1000], text[2048];
    memset(host, 'a', 126);
    strcpy(host + 126, "\u00e9\u00e9"); /* bytes 127-130: the first é straddles the 127-byte cut */
    msg[0] = '\0';
    for (int i = 0; i < 450; i++)
        strcat(msg, "\u00e9");
    am_diag_init(&d);
    snprintf(text, sizeof(text), "{\"type\":\"start\",\"host\":\"%s\",\"world\":1,\"time\":10.0,\"max_steps\":1}\n"
             "{\"type\":\"cause\",\"cause\":\"error\",\"message\":\"%s\",\"time\":11.0}\n", host, msg);
    add_text(&d, 0, text);
    am_diag_analyze(&d);
    assert_int_equal(strlen(d.ranks[0].host), 126);
    char want_detail[1000] = "";
    for (int i = 0; i < 383; i++) /* 766 bytes: the most that fit in 767 */
        strcat(want_detail, "\u00e9");
    assert_string_equal(d.ff_detail, want_detail);
    char *j = json_text(&d);
    char want[2200];
    snprintf(want, sizeof(want), "\"first_failure\":{\"rank\":0,\"host\":\"%.126s\",\"cause\":\"error\"", host);
    if (!strstr(j, want))
        fail_msg("no %s in %s", want, j);
    snprintf(want, sizeof(want), "\"detail\":\"%s\",\"backtrace\":[]}", want_detail);
    if (!strstr(j, want))
        fail_msg("no %s in %s", want, j);
    free(j);
    am_diag_free(&d);
}

/* Times out of range ("time":1e300 was undefined behaviour and printed a nonsense date) are
 * unknown; so are durations out of range. */
static void test_absurd_times(void **state)
{
    (void)state;
    struct am_diag d;
    am_diag_init(&d);
    add_text(&d, 0, "{\"type\":\"start\",\"host\":\"n1\",\"world\":2,\"time\":-1e300,\"max_steps\":9}\n"
                    "{\"type\":\"step\",\"step\":1,\"step_s\":1e300,\"comm_s\":-1e300,\"time\":1e300}\n"
                    "{\"type\":\"cause\",\"cause\":\"signal\",\"signal_name\":\"SIGSEGV\",\"step\":2,\"time\":1e300}\n");
    add_text(&d, 1, "{\"type\":\"start\",\"host\":\"n1\",\"world\":2,\"time\":10.0,\"max_steps\":9}\n"
                    "{\"type\":\"step\",\"step\":1,\"step_s\":1.0,\"comm_s\":0.5,\"time\":11.0}\n"
                    "{\"type\":\"exit\",\"status\":1,\"time\":1e19}\n");
    am_diag_analyze(&d);
    expect_report(&d, "am-diag: job ? (): 2 ranks, FAILED\n"
                  "first failure: rank 0 on n1 at step 2, unknown time\n"
                  "  cause: signal: SIGSEGV\n"
                  "others: 1 failed (rank 1)\n"
                  "missing logs: none\n"
                  "mismatches: none\n"
                  "\n"
                  "details:\n"
                  "  rank 0 on n1: first_failure: SIGSEGV\n"
                  "  rank 1 on n1: failed: failed too: exited with status 1 without a cause record\n");
    expect_in_json(&d, "\"step\":2,\"status\":null,\"local_rank\":null,\"coords\":null,\"time\":null,");
    am_diag_free(&d);
}

/* Hosts and messages are the logs' text: escape sequences and newlines are shown escaped, so
 * that a log cannot colour the terminal or forge a line of the report. */
static void test_terminal_escapes(void **state)
{
    (void)state;
    struct am_diag d;
    am_diag_init(&d);
    add_text(&d, 0, "{\"type\":\"start\",\"host\":\"n1\\u001b[2J\\u009b\",\"world\":1,\"time\":10.0,\"max_steps\":1}\n"
                    "{\"type\":\"cause\",\"cause\":\"error\",\"message\":\"boom\\nrank 7 failed first\\\\n\\ttab \\u00e9\","
                    "\"time\":11.0}\n");
    am_diag_analyze(&d);
    expect_report(&d, "am-diag: job ? (): 1 rank, FAILED\n"
                  "first failure: rank 0 on n1\\x1b[2J\\xc2\\x9b, 1970-01-01 00:00:11.000 UTC\n"
                  "  cause: error: boom\\nrank 7 failed first\\\\n\\ttab é\n"
                  "others: none\n"
                  "missing logs: none\n"
                  "mismatches: none\n"
                  "\n"
                  "details:\n"
                  "  rank 0 on n1\\x1b[2J\\xc2\\x9b: first_failure: boom\\nrank 7 failed first\\\\n\\ttab é\n");
    char *r = report(&d);
    assert_null(strchr(r, '\x1b'));
    assert_null(strstr(r, "\nrank 7"));
    free(r);
    am_diag_free(&d);
}

/* Bad lines: one note per log, with the count and the first (10 MB of them printed one note
 * each, 5 million lines). */
static void test_one_note_per_log(void **state)
{
    (void)state;
    struct am_diag d;
    size_t n = 200000;
    char *text = malloc(2 * n + 200);
    int at = sprintf(text, "{\"type\":\"start\",\"world\":1,\"time\":1.0}\n");
    for (size_t i = 0; i < n; i++) {
        text[at++] = 'x';
        text[at++] = '\n';
    }
    at += sprintf(text + at, "{\"type\":\"step\",\"step\":0}\n{\"type\":\"step\",\"step\":-3}\n{\"type\":\"exit\",\"status\":0,\"time\":2.0}\n");
    am_diag_init(&d);
    assert_int_equal(am_diag_add_log(&d, 0, text, (size_t)at), 0);
    free(text);
    am_diag_analyze(&d);
    assert_int_equal(d.n_notes, 2);
    assert_string_equal(d.notes[0], "rank 0: 200000 lines are not JSON objects (the first: line 2, '[' or '{' expected near "
                                    "'x'); skipped");
    assert_string_equal(d.notes[1], "rank 0: 2 step records without a step number from 1 to 2147483647; skipped");
    am_diag_free(&d);
}

/* Only regular files are read: a FIFO (which blocked am-diag forever) and a link to /dev/zero
 * (read until memory ran out) are refused with a note; a log over the size cap is read as its
 * head and tail. */
static void test_unreadable_files(void **state)
{
    (void)state;
    char dir[] = "/tmp/test_diag_XXXXXX", path[256], err[512];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/rank-0.jsonl", dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    snprintf(path, sizeof(path), "%s/rank-1.jsonl", dir);
    assert_int_equal(symlink("/dev/zero", path), 0);
    snprintf(path, sizeof(path), "%s/rank-2.jsonl", dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"type\":\"start\",\"host\":\"n1\",\"world\":3,\"time\":10.0,\"max_steps\":2000}\n");
    for (int s = 1; s <= 2000; s++) /* about 60 KB */
        fprintf(f, "{\"type\":\"step\",\"step\":%d,\"time\":%d.5}\n", s, 10 + s);
    fprintf(f, "{\"type\":\"exit\",\"status\":0,\"time\":2100.0}\n");
    fclose(f);
    struct am_diag d;
    am_diag_init(&d);
    d.max_file = 4096; /* head 1024 bytes, tail 3072 */
    assert_int_equal(am_diag_load_dir(&d, dir, err, sizeof(err)), 0);
    am_diag_analyze(&d);
    struct am_diag_rank *r2 = am_diag_rank_find(&d, 2);
    assert_non_null(r2);
    assert_int_equal(r2->have_start, 1);
    assert_int_equal(r2->last_step, 2000);
    assert_int_equal(r2->verdict, AM_VERDICT_CLEAN);
    int fifo = 0, zero = 0, big = 0;
    for (int i = 0; i < d.n_notes; i++) {
        fifo |= strcmp(d.notes[i], "rank 0: rank-0.jsonl is a FIFO, not a regular file; skipped") == 0;
        zero |= strcmp(d.notes[i], "rank 1: rank-1.jsonl is a character device, not a regular file; skipped") == 0;
        big |= strncmp(d.notes[i], "rank 2: rank-2.jsonl holds ", 27) == 0 &&
               strstr(d.notes[i], " bytes, more than am-diag reads of one log (4096 bytes): read its first 1009 and "
                      "last 3065 bytes of whole lines, skipped the ") != NULL;
    }
    if (!fifo || !zero || !big)
        fail_msg("notes: %s | %s | %s", d.n_notes > 0 ? d.notes[0] : "", d.n_notes > 1 ? d.notes[1] : "",
                 d.n_notes > 2 ? d.notes[2] : "");
    am_diag_free(&d);
    snprintf(path, sizeof(path), "rm -rf %s", dir);
    assert_int_equal(system(path), 0);
}

/* am-plan's reading (diag_timing.c): with d.timing, step records leave their times in the
 * rank's ring only (none stored), flight and groups records are skipped; the step time is the
 * slowest rank's median of its last AM_DIAG_RECENT_STEPS, the save the longest of each rank's
 * last AM_DIAG_RECENT_SAVES. */
static void test_timing(void **state)
{
    (void)state;
    static struct log l;
    struct am_diag d;
    am_diag_init(&d);
    d.timing = 1;
    /* rank 0: 100 steps of 7 s, then AM_DIAG_RECENT_STEPS of 1 s (median 1); saves of 50 s
     * (step 10: older than its last 4), then 3, 4, 5 and 6 s (step 50) */
    start(&l, 0, 2, "h0");
    for (int s = 1; s <= 100 + AM_DIAG_RECENT_STEPS; s++)
        line(&l, "{\"type\":\"step\",\"step\":%d,\"loss\":5.0,\"step_s\":%.1f,\"comm_s\":0.5,\"time\":%.6f}", s,
             s <= 100 ? 7.0 : 1.0, T0 + s);
    static const double saves[] = {50, 3, 4, 5, 6};
    for (int i = 0; i < 5; i++)
        line(&l, "{\"type\":\"checkpoint\",\"step\":%d,\"dir\":\"/c/step-%d\",\"seconds\":%.1f,\"format\":\"sharded\","
                 "\"writes\":true,\"time\":%.6f}", 10 * (i + 1), 10 * (i + 1), saves[i], T0 + 10 * (i + 1));
    flight(&l, 3, NULL, -1, 100);
    add(&d, 0, &l);
    /* rank 1: 4 steps of 1.5, 2.5, 2.0 and 3.0 s (median 2.25: the slowest), one save of 5.5 s */
    start(&l, 1, 2, "h1");
    static const double st[] = {1.5, 2.5, 2.0, 3.0};
    for (int s = 0; s < 4; s++)
        line(&l, "{\"type\":\"step\",\"step\":%d,\"loss\":5.0,\"step_s\":%.1f,\"comm_s\":0.5,\"time\":%.6f}", s + 1,
             st[s], T0 + s + 1);
    line(&l, "{\"type\":\"checkpoint\",\"step\":2,\"dir\":\"/c/step-2\",\"seconds\":5.5,\"time\":%.6f}", T0 + 2);
    add(&d, 1, &l);
    const struct am_diag_rank *r0 = am_diag_rank_find(&d, 0);
    assert_non_null(r0);
    assert_int_equal(r0->n_steps, 0);
    assert_int_equal(r0->n_flight, 0);
    assert_int_equal(r0->n_groups, 0);
    assert_int_equal(r0->n_step_s, 100 + AM_DIAG_RECENT_STEPS);
    assert_int_equal(r0->n_save_s, 5);
    struct am_diag_timing t;
    am_diag_timing(&d, &t);
    assert_float_equal(t.step_s, 2.25, 0);
    assert_int_equal(t.step_rank, 1);
    assert_int_equal(t.step_ranks, 2);
    assert_float_equal(t.save_s, 6.0, 0);
    assert_int_equal(t.save_rank, 0);
    assert_int_equal(t.save_step, 50);
    assert_int_equal(t.save_ranks, 2);
    am_diag_free(&d);
    /* a log without steps or saves: both unknown */
    am_diag_init(&d);
    d.timing = 1;
    start(&l, 0, 1, "h0");
    add(&d, 0, &l);
    am_diag_timing(&d, &t);
    assert_true(t.step_s < 0 && t.save_s < 0);
    assert_int_equal(t.step_rank, -1);
    assert_int_equal(t.save_rank, -1);
    assert_int_equal(t.step_ranks + t.save_ranks, 0);
    am_diag_free(&d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crash_and_victims),
        cmocka_unit_test(test_hang_outside),
        cmocka_unit_test(test_hang_inside),
        cmocka_unit_test(test_hang_chain_through_tp),
        cmocka_unit_test(test_hang_in_nonblocking),
        cmocka_unit_test(test_hang_in_recv), cmocka_unit_test(test_hang_recv_chain), cmocka_unit_test(test_sequence_nonblocking),
        cmocka_unit_test(test_missing_ranks),
        cmocka_unit_test(test_truncated_log),
        cmocka_unit_test(test_mismatches),
        cmocka_unit_test(test_straggler),
        cmocka_unit_test(test_straggler_expert_load),
        cmocka_unit_test(test_stopped_from_outside),
        cmocka_unit_test(test_exits_without_cause),
        cmocka_unit_test(test_clean),
        cmocka_unit_test(test_peer_outside_the_job),
        cmocka_unit_test(test_member_outside_the_job),
        cmocka_unit_test(test_huge_numbers_allocate_nothing),
        cmocka_unit_test(test_utf8_truncation_keeps_keys),
        cmocka_unit_test(test_absurd_times),
        cmocka_unit_test(test_terminal_escapes),
        cmocka_unit_test(test_one_note_per_log),
        cmocka_unit_test(test_unreadable_files),
        cmocka_unit_test(test_timing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
