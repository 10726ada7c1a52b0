/* test_diag_device.c - am-diag on hand-written logs of GPU ranks: the device's cause records
 * (oom with its bytes, phase and layer; cuda with the runtime's text; nccl with NCCL's) and
 * hangs in NCCL collectives, whose ranks never name the peer they wait for. The report's
 * first lines are asserted whole. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "diag.h"

struct log {
    char text[32768];
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

/* a GPU rank of a 2-rank data-parallel job, steps 1..done completed, allreduce #1..#calls
 * completed in its flight recorder */
static void gpu_rank(struct log *l, int rank, int done, int calls)
{
    l->len = 0;
    line(l, "{\"type\":\"start\",\"host\":\"g%d\",\"pid\":%d,\"rank\":%d,\"world\":2,\"job\":\"7.0\",\"local_rank\":0,"
            "\"coords\":{\"pp\":0,\"dp_replicate\":0,\"dp_shard\":%d,\"cp\":0,\"tp\":0,\"ep\":0},\"device\":\"cuda\","
            "\"device_name\":\"NVIDIA H200\",\"time\":%.6f,\"max_steps\":6}", rank, 100 + rank, rank, rank, T0);
    line(l, "{\"type\":\"groups\",\"rank\":%d,\"groups\":[{\"name\":\"dp\",\"gid\":0,\"ranks\":[0,1]}]}", rank);
    for (int s = 1; s <= done; s++)
        line(l, "{\"type\":\"step\",\"step\":%d,\"loss\":5.0,\"step_s\":1.0,\"comm_s\":0.01,\"time\":%.6f}", s, T0 + s);
    for (int s = 1; s <= calls; s++)
        line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":0,\"seq\":%d,\"op\":\"allreduce\","
                "\"dtype\":\"bf16\",\"count\":100,\"bytes\":200,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\","
                "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":null}", s, s, T0 + s, T0 + s,
             T0 + s + 0.01);
}

/* the other rank, stopped by its supervisor while it waited in allreduce #seq */
static void stopped_in(struct log *l, int rank, int seq, int because, double t)
{
    line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":0,\"seq\":%d,\"op\":\"allreduce\",\"dtype\":\"bf16\","
            "\"count\":100,\"bytes\":200,\"redop\":\"sum\",\"peer\":null,\"state\":\"started\",\"enqueued\":%.6f,"
            "\"started\":%.6f,\"ended\":null,\"waiting_for\":null}", seq, seq, t - 0.5, t - 0.5);
    line(l, "{\"type\":\"stop\",\"rank\":%d,\"host\":\"h\",\"signal\":\"SIGTERM\",\"by\":\"am-launch\",\"because_rank\":%d,"
            "\"because_host\":\"g%d\",\"because\":\"x\",\"because_time\":%.6f,\"time\":%.6f}", rank, because, because,
         t, t + 0.01);
    line(l, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":15,\"signal_name\":\"SIGTERM\",\"code\":0,"
            "\"code_name\":\"SI_USER\",\"addr\":null,\"sender_pid\":99,\"from\":\"supervisor\",\"rank\":%d,\"step\":3,"
            "\"time\":%.6f,\"backtrace\":[]}", rank, t + 0.02);
    line(l, "{\"type\":\"exit\",\"rank\":%d,\"host\":\"h\",\"pid\":1,\"status\":143,\"signal\":15,\"signal_name\":"
            "\"SIGTERM\",\"core_dumped\":false,\"oom_killed\":false,\"stop_signal\":\"SIGTERM\",\"time\":%.6f}", rank,
         t + 0.03);
}

static void exit_with(struct log *l, int rank, int status, const char *signame, double t)
{
    char sn[32];
    snprintf(sn, sizeof(sn), signame ? "\"%s\"" : "null", signame);
    line(l, "{\"type\":\"exit\",\"rank\":%d,\"host\":\"h\",\"pid\":1,\"status\":%d,\"signal\":0,\"signal_name\":%s,"
            "\"core_dumped\":false,\"oom_killed\":false,\"stop_signal\":null,\"time\":%.6f}", rank, status, sn, t);
}

static void add(struct am_diag *d, int rank, const struct log *l)
{
    assert_int_equal(am_diag_add_log(d, rank, l->text, l->len), 0);
}

/* The report's first `n` lines, as am-diag prints them. */
static char *report_head(const struct am_diag *d, int n)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    am_diag_print(d, f);
    fclose(f);
    char *p = buf;
    for (int i = 0; i < n && p; i++) {
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    if (p)
        *p = '\0';
    return buf;
}

static void expect_head(const struct am_diag *d, int n, const char *want)
{
    char *got = report_head(d, n);
    if (strcmp(got, want) != 0)
        fail_msg("report:\n%s\nwant:\n%s", got, want);
    free(got);
}

/* rank 1 ran out of GPU memory in the backward of layer 31 at step 3; rank 0 was stopped in
 * the gradient all-reduce */
static void test_oom(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    gpu_rank(&l, 0, 2, 4);
    stopped_in(&l, 0, 5, 1, T0 + 3.5);
    add(&d, 0, &l);
    gpu_rank(&l, 1, 2, 4);
    line(&l, "{\"type\":\"fault\",\"kind\":\"device-oom\",\"spec\":\"rank=1,step=3,kind=device-oom\",\"rank\":1,"
             "\"step\":3,\"time\":%.6f}", T0 + 3.4);
    line(&l, "{\"type\":\"cause\",\"cause\":\"oom\",\"device\":\"cuda\",\"ordinal\":0,\"where\":\"am_cuda_scratch\","
             "\"bytes_asked\":2147483648,\"bytes_held\":44560285696,\"bytes_in_use\":44023414784,"
             "\"bytes_total\":150109106995,\"plan_bytes\":41016937677,\"phase\":\"backward\",\"layer\":31,\"part\":"
             "\"layer\",\"step\":3,\"message\":\"am_cuda_scratch: out of GPU memory\",\"rank\":1,\"time\":%.6f}",
         T0 + 3.5);
    exit_with(&l, 1, 134, "SIGABRT", T0 + 3.51);
    add(&d, 1, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.failed, 1);
    assert_int_equal(d.culprit, 1);
    assert_string_equal(d.ff_cause, "oom");
    assert_string_equal(d.ff_signal, "");
    expect_head(&d, 3,
                "am-diag: job 7.0 (): 2 ranks, FAILED\n"
                "first failure: rank 1 on g1 (local rank 0; pp 0, dp_replicate 0, dp_shard 1, cp 0, tp 0, ep 0) at step "
                "3, 2025-12-29 09:20:03.500 UTC\n"
                "  cause: oom: rank 1 ran out of GPU memory in the backward of layer 31: 41.0 GiB in use, plan 38.2 GiB "
                "(asked for 2.0 GiB; the allocator holds 41.5 GiB of the device's 139.8 GiB)\n");
    am_diag_free(&d);
}

/* the optimizer and the head: the other places an oom names; no plan: no "plan" */
static void test_oom_places(void **state)
{
    (void)state;
    static const struct {
        const char *fields, *want;
    } cases[] = {
        {"\"phase\":\"optimizer\",\"layer\":null,\"part\":null,\"plan_bytes\":0",
         "  cause: oom: rank 1 ran out of GPU memory in the optimizer step: 1.5 KiB in use (asked for 512 B; the "
         "allocator holds 2.0 MiB of the device's 139.8 GiB)\n"},
        {"\"phase\":\"forward\",\"layer\":null,\"part\":\"head\",\"plan_bytes\":1048576",
         "  cause: oom: rank 1 ran out of GPU memory in the forward of the head: 1.5 KiB in use, plan 1.0 MiB (asked "
         "for 512 B; the allocator holds 2.0 MiB of the device's 139.8 GiB)\n"},
        {"\"phase\":\"setup\",\"layer\":null,\"part\":null,\"plan_bytes\":1048576",
         "  cause: oom: rank 1 ran out of GPU memory while setting up (before the first step): 1.5 KiB in use, plan "
         "1.0 MiB (asked for 512 B; the allocator holds 2.0 MiB of the device's 139.8 GiB)\n"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct am_diag d;
        struct log l;
        am_diag_init(&d);
        gpu_rank(&l, 0, 2, 4);
        stopped_in(&l, 0, 5, 1, T0 + 3.5);
        add(&d, 0, &l);
        gpu_rank(&l, 1, 2, 4);
        line(&l, "{\"type\":\"cause\",\"cause\":\"oom\",\"device\":\"cuda\",\"ordinal\":0,\"where\":\"am_cuda_alloc\","
                 "\"bytes_asked\":512,\"bytes_held\":2097152,\"bytes_in_use\":1536,\"bytes_total\":150109106995,%s,"
                 "\"step\":3,\"message\":\"m\",\"rank\":1,\"time\":%.6f}", cases[i].fields, T0 + 3.5);
        exit_with(&l, 1, 1, NULL, T0 + 3.51);
        add(&d, 1, &l);
        am_diag_analyze(&d);
        char *got = report_head(&d, 3);
        const char *third = strstr(strchr(got, '\n') + 1, "\n") + 1;
        if (strcmp(third, cases[i].want) != 0)
            fail_msg("case %zu: %s\nwant: %s", i, third, cases[i].want);
        free(got);
        am_diag_free(&d);
    }
}

/* a CUDA error in a kernel of layer 3's forward: the runtime's text; the rank died of SIGABRT */
static void test_cuda_error(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    gpu_rank(&l, 0, 2, 4);
    line(&l, "{\"type\":\"cause\",\"cause\":\"cuda\",\"device\":\"cuda\",\"ordinal\":0,\"where\":"
             "\"am_cuda_matmul_forward\",\"error\":\"an illegal memory access was encountered\",\"phase\":\"forward\","
             "\"layer\":3,\"part\":\"layer\",\"step\":3,\"message\":\"am_cuda_matmul_forward: CUDA error in "
             "cublasLtMatmul: an illegal memory access was encountered (cudaErrorIllegalAddress)\",\"rank\":0,"
             "\"time\":%.6f}", T0 + 3.2);
    exit_with(&l, 0, 134, "SIGABRT", T0 + 3.3);
    add(&d, 0, &l);
    gpu_rank(&l, 1, 2, 4);
    stopped_in(&l, 1, 5, 0, T0 + 3.3);
    add(&d, 1, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 0);
    assert_string_equal(d.ff_cause, "cuda");
    expect_head(&d, 3,
                "am-diag: job 7.0 (): 2 ranks, FAILED\n"
                "first failure: rank 0 on g0 (local rank 0; pp 0, dp_replicate 0, dp_shard 0, cp 0, tp 0, ep 0) at step "
                "3, 2025-12-29 09:20:03.200 UTC\n"
                "  cause: cuda: rank 0's GPU failed in the forward of layer 3: am_cuda_matmul_forward: CUDA error in "
                "cublasLtMatmul: an illegal memory access was encountered (cudaErrorIllegalAddress)\n");
    am_diag_free(&d);
}

/* an asynchronous NCCL error in the gradient all-reduce: NCCL's strings */
static void test_nccl_error(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    gpu_rank(&l, 0, 2, 4);
    stopped_in(&l, 0, 5, 1, T0 + 3.6);
    add(&d, 0, &l);
    gpu_rank(&l, 1, 2, 4);
    line(&l, "{\"type\":\"flight\",\"id\":5,\"group\":\"dp\",\"gid\":0,\"seq\":5,\"op\":\"iallreduce\",\"dtype\":\"bf16\","
             "\"count\":100,\"bytes\":200,\"redop\":\"sum\",\"peer\":null,\"state\":\"failed\",\"enqueued\":%.6f,"
             "\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":null}", T0 + 3.1, T0 + 3.1, T0 + 3.5);
    line(&l, "{\"type\":\"cause\",\"cause\":\"nccl\",\"by\":\"backend\",\"op\":\"iallreduce\",\"group\":\"dp\",\"gid\":0,"
             "\"seq\":5,\"count\":100,\"bytes\":200,\"waited_s\":0.4,\"rank\":1,\"time\":%.6f,\"timeout_s\":0,"
             "\"peer\":null,\"waiting_for\":null,\"waiting_for_host\":null,\"step\":3,\"message\":\"step 3: iallreduce "
             "#5 on group dp (2 ranks) failed: asynchronous NCCL error: remote process exited or there was a network "
             "error: NET/IB: connection closed by peer\"}", T0 + 3.5);
    exit_with(&l, 1, 1, NULL, T0 + 3.51);
    add(&d, 1, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 1);
    assert_string_equal(d.ff_cause, "nccl");
    expect_head(&d, 3,
                "am-diag: job 7.0 (): 2 ranks, FAILED\n"
                "first failure: rank 1 on g1 (local rank 0; pp 0, dp_replicate 0, dp_shard 1, cp 0, tp 0, ep 0) at step "
                "3, 2025-12-29 09:20:03.500 UTC\n"
                "  cause: nccl: NCCL failed in iallreduce #5 of group dp: step 3: iallreduce #5 on group dp (2 ranks) "
                "failed: asynchronous NCCL error: remote process exited or there was a network error: NET/IB: "
                "connection closed by peer\n");
    am_diag_free(&d);
}

/* NCCL could not make the communicators: no call, the message as it is */
static void test_nccl_init(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    gpu_rank(&l, 0, 0, 0);
    line(&l, "{\"type\":\"cause\",\"cause\":\"nccl\",\"message\":\"create groups: group dp (2 ranks: global 0, 1): "
             "NCCL initialisation timed out\",\"rank\":0,\"time\":%.6f}", T0 + 1);
    exit_with(&l, 0, 1, NULL, T0 + 1.1);
    add(&d, 0, &l);
    gpu_rank(&l, 1, 0, 0);
    exit_with(&l, 1, 143, "SIGTERM", T0 + 1.2);
    add(&d, 1, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 0);
    assert_string_equal(d.ff_cause, "nccl");
    assert_string_equal(d.ff_detail, "NCCL failed: create groups: group dp (2 ranks: global 0, 1): NCCL initialisation "
                        "timed out");
    am_diag_free(&d);
}

static void watchdog_timeout(struct log *l, int rank, int seq, double t)
{
    line(l, "{\"type\":\"flight\",\"id\":%d,\"group\":\"dp\",\"gid\":0,\"seq\":%d,\"op\":\"allreduce\",\"dtype\":\"bf16\","
            "\"count\":100,\"bytes\":200,\"redop\":\"sum\",\"peer\":null,\"state\":\"timed_out\",\"enqueued\":%.6f,"
            "\"started\":%.6f,\"ended\":null,\"waiting_for\":null}", seq, seq, t - 5, t - 5);
    line(l, "{\"type\":\"cause\",\"cause\":\"timeout\",\"by\":\"watchdog\",\"op\":\"allreduce\",\"group\":\"dp\","
            "\"gid\":0,\"seq\":%d,\"count\":100,\"bytes\":200,\"waited_s\":5.0,\"rank\":%d,\"time\":%.6f,"
            "\"timeout_s\":5.0,\"peer\":null,\"waiting_for\":null,\"waiting_for_host\":null,\"step\":3,"
            "\"message\":\"allreduce #%d on group dp: no progress for 5.00 s (timeout 5 s, AM_WATCHDOG_S); inside NCCL, "
            "which does not tell which peer it waits for; aborting its communicator (ncclCommAbort)\"}", seq, rank, t,
         seq);
    exit_with(l, rank, 1, NULL, t + 0.1);
}

/* both GPU ranks inside allreduce #5 when their watchdogs fire: NCCL names no peer, and the
 * flight recorders show both came: nobody to blame, and the report says why */
static void test_nccl_hang_all_inside(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 2; r++) {
        gpu_rank(&l, r, 2, 4);
        watchdog_timeout(&l, r, 5, T0 + 9 + 0.1 * r);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.failed, 1);
    assert_int_equal(d.culprit, -1);
    assert_string_equal(d.ff_cause, "hang");
    assert_string_equal(d.ff_detail, "every member of group dp was inside allreduce #5 when the ranks timed out: NCCL "
                        "does not tell which peer a rank waits for, so the logs cannot name the one that held it up (a "
                        "hung kernel, a GPU fault or a dead link on one of its ranks; the flight recorders show each "
                        "rank's last calls)");
    am_diag_free(&d);
}

/* rank 1 never issued allreduce #5 (its flight recorder ends at #4): the flight recorders
 * name it although NCCL did not */
static void test_nccl_hang_one_missing(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    gpu_rank(&l, 0, 2, 4);
    watchdog_timeout(&l, 0, 5, T0 + 9);
    add(&d, 0, &l);
    gpu_rank(&l, 1, 2, 4);
    line(&l, "{\"type\":\"stop\",\"rank\":1,\"host\":\"h\",\"signal\":\"SIGTERM\",\"by\":\"am-launch\",\"because_rank\":0,"
             "\"because_host\":\"g0\",\"because\":\"x\",\"because_time\":%.6f,\"time\":%.6f}", T0 + 9.1, T0 + 9.11);
    line(&l, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":15,\"signal_name\":\"SIGTERM\",\"code\":0,"
             "\"code_name\":\"SI_USER\",\"addr\":null,\"sender_pid\":99,\"from\":\"supervisor\",\"rank\":1,\"step\":3,"
             "\"time\":%.6f,\"backtrace\":[]}", T0 + 9.12);
    exit_with(&l, 1, 143, "SIGTERM", T0 + 9.13);
    add(&d, 1, &l);
    am_diag_analyze(&d);
    assert_int_equal(d.culprit, 1);
    assert_string_equal(d.ff_cause, "hang");
    assert_string_equal(d.ff_detail, "stopped making progress at step 3 and never issued allreduce #5 of group dp, in "
                        "which the others waited (its last call on the group: #4, completed)");
    am_diag_free(&d);
}

/* both GPU ranks stuck in stream_wait after collective #4: a collective left to the device
 * never completed; nobody to blame, the report says so and names the wait */
static void test_stream_wait_hang(void **state)
{
    (void)state;
    struct am_diag d;
    struct log l;
    am_diag_init(&d);
    for (int r = 0; r < 2; r++) {
        gpu_rank(&l, r, 2, 4);
        line(&l, "{\"type\":\"flight\",\"id\":5,\"group\":\"dp\",\"gid\":0,\"seq\":4,\"op\":\"stream_wait\","
                 "\"dtype\":null,\"count\":0,\"bytes\":0,\"redop\":null,\"peer\":null,\"state\":\"timed_out\","
                 "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":null,\"waiting_for\":null}", T0 + 4, T0 + 4);
        line(&l, "{\"type\":\"cause\",\"cause\":\"timeout\",\"by\":\"watchdog\",\"op\":\"stream_wait\","
                 "\"group\":\"dp\",\"gid\":0,\"seq\":4,\"count\":0,\"bytes\":0,\"waited_s\":5.0,\"rank\":%d,"
                 "\"time\":%.6f,\"timeout_s\":5.0,\"peer\":null,\"waiting_for\":null,\"waiting_for_host\":null,"
                 "\"step\":3,\"message\":\"x\"}", r, T0 + 9 + 0.1 * r);
        exit_with(&l, r, 1, NULL, T0 + 9.2 + 0.1 * r);
        add(&d, r, &l);
    }
    am_diag_analyze(&d);
    assert_int_equal(d.failed, 1);
    assert_int_equal(d.culprit, -1);
    assert_string_equal(d.ff_cause, "hang");
    assert_string_equal(d.ff_detail, "rank 0 waited 5.00 s for its GPU to finish the work of group dp enqueued after "
                        "collective #4 (stream_wait): a collective of the group did not complete on the device (its "
                        "cause record names it); NCCL does not tell which peer it waits for, so the logs cannot name "
                        "the rank that held it up");
    am_diag_free(&d);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_oom),
        cmocka_unit_test(test_oom_places),
        cmocka_unit_test(test_cuda_error),
        cmocka_unit_test(test_nccl_error),
        cmocka_unit_test(test_nccl_init),
        cmocka_unit_test(test_nccl_hang_all_inside),
        cmocka_unit_test(test_nccl_hang_one_missing),
        cmocka_unit_test(test_stream_wait_hang),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
