/* test_fault_spec.c - AM_FAULT's parser and checks (fault.h): every kind, and the exact
 * message for every kind of mistake. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "fault.h"

static void test_kinds(void **state)
{
    (void)state;
    struct am_fault f;
    char err[512];
    assert_int_equal(am_fault_parse(NULL, &f, err, sizeof(err)), 0);
    assert_int_equal(f.kind, AM_FAULT_NONE);
    assert_int_equal(am_fault_parse("", &f, err, sizeof(err)), 0);
    assert_int_equal(f.kind, AM_FAULT_NONE);
    static const struct {
        const char *spec;
        enum am_fault_kind kind;
    } ok[] = {{"rank=5,step=3,kind=segv", AM_FAULT_SEGV},
              {"kind=abort,rank=0,step=1", AM_FAULT_ABORT},
              {"rank=1,step=2,kind=nan", AM_FAULT_NAN},
              {"rank=1,step=2,kind=hang", AM_FAULT_HANG},
              {"rank=1,step=2,kind=hang-in-collective", AM_FAULT_HANG_IN_COLLECTIVE},
              {"rank=1,step=2,kind=kill", AM_FAULT_KILL},
              {"rank=1,step=2,kind=oom", AM_FAULT_OOM}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        assert_int_equal(am_fault_parse(ok[i].spec, &f, err, sizeof(err)), 0);
        assert_int_equal(f.kind, ok[i].kind);
        assert_string_equal(f.spec, ok[i].spec);
    }
    assert_int_equal(am_fault_parse("rank=5,step=3,kind=segv", &f, err, sizeof(err)), 0);
    assert_int_equal(f.rank, 5);
    assert_int_equal(f.step, 3);
    assert_true(am_fault_due(&f, 5, 3, AM_FAULT_SEGV));
    assert_false(am_fault_due(&f, 4, 3, AM_FAULT_SEGV));
    assert_false(am_fault_due(&f, 5, 2, AM_FAULT_SEGV));
    assert_false(am_fault_due(&f, 5, 3, AM_FAULT_ABORT));
    assert_int_equal(am_fault_parse("rank=2,step=7,kind=exit:42", &f, err, sizeof(err)), 0);
    assert_int_equal(f.kind, AM_FAULT_EXIT);
    assert_int_equal(f.code, 42);
    assert_int_equal(am_fault_parse("rank=2,step=7,kind=exit:0", &f, err, sizeof(err)), 0);
    assert_int_equal(f.code, 0);
    assert_int_equal(am_fault_parse("rank=2,step=7,kind=slow:2.5", &f, err, sizeof(err)), 0);
    assert_int_equal(f.kind, AM_FAULT_SLOW);
    assert_true(f.seconds == 2.5);
    assert_string_equal(am_fault_kind_name(AM_FAULT_HANG_IN_COLLECTIVE), "hang-in-collective");
    static const char *const phases[] = {"shard", "written", "manifest", "commit", "latest"};
    for (int i = 0; i < 5; i++) {
        char spec[96];
        snprintf(spec, sizeof(spec), "rank=0,step=4,kind=kill-in-save:%s", phases[i]);
        assert_int_equal(am_fault_parse(spec, &f, err, sizeof(err)), 0);
        assert_int_equal(f.kind, AM_FAULT_KILL_IN_SAVE);
        assert_int_equal(f.code, i);
    }
    assert_string_equal(am_fault_kind_name(AM_FAULT_KILL_IN_SAVE), "kill-in-save");
}

static void expect_error(const char *spec, const char *message)
{
    struct am_fault f;
    char err[512] = "";
    assert_int_equal(am_fault_parse(spec, &f, err, sizeof(err)), -1);
    assert_string_equal(err, message);
    assert_int_equal(f.kind, AM_FAULT_NONE);
}

static void test_errors(void **state)
{
    (void)state;
    expect_error("rank=1,step=2", "AM_FAULT=rank=1,step=2: kind is missing (AM_FAULT=rank=R,step=S,kind=K; kinds: segv, "
                 "abort, exit:CODE, nan, hang, hang-in-collective, slow:SECONDS, kill, oom, device-oom, kill-in-alltoall, "
                 "expert-rows-oom or kill-in-save:PHASE)");
    expect_error("step=2,kind=segv", "AM_FAULT=step=2,kind=segv: rank is missing (AM_FAULT=rank=R,step=S,kind=K; kinds: "
                 "segv, abort, exit:CODE, nan, hang, hang-in-collective, slow:SECONDS, kill, oom, device-oom, kill-in-alltoall, "
                 "expert-rows-oom or kill-in-save:PHASE)");
    expect_error("rank=1,kind=segv", "AM_FAULT=rank=1,kind=segv: step is missing (AM_FAULT=rank=R,step=S,kind=K; kinds: "
                 "segv, abort, exit:CODE, nan, hang, hang-in-collective, slow:SECONDS, kill, oom, device-oom, kill-in-alltoall, "
                 "expert-rows-oom or kill-in-save:PHASE)");
    expect_error("rank=x,step=2,kind=segv", "AM_FAULT=rank=x,step=2,kind=segv: rank=x: the rank must be a whole number "
                 "from 0 (the global rank that misbehaves, for example rank=1)");
    expect_error("rank=-1,step=2,kind=segv", "AM_FAULT=rank=-1,step=2,kind=segv: rank=-1: the rank must be a whole "
                 "number from 0 (the global rank that misbehaves, for example rank=1)");
    expect_error("rank=1,step=0,kind=segv", "AM_FAULT=rank=1,step=0,kind=segv: step=0: the step must be a whole number "
                 "from 1 (the 1-based training step at which the rank misbehaves, for example step=3)");
    expect_error("rank=1,step=,kind=segv", "AM_FAULT=rank=1,step=,kind=segv: step=: the step must be a whole number "
                 "from 1 (the 1-based training step at which the rank misbehaves, for example step=3)");
    expect_error("rank=1,step=2,kind=boom", "AM_FAULT=rank=1,step=2,kind=boom: kind=boom: unknown kind (use segv, "
                 "abort, exit:CODE, nan, hang, hang-in-collective, slow:SECONDS, kill, oom, device-oom, kill-in-alltoall, "
                 "expert-rows-oom or kill-in-save:PHASE)");
    expect_error("rank=1,step=2,kind=exit", "AM_FAULT=rank=1,step=2,kind=exit: kind=exit: the exit code must be a whole "
                 "number from 0 to 255 (for example kind=exit:3)");
    expect_error("rank=1,step=2,kind=exit:256", "AM_FAULT=rank=1,step=2,kind=exit:256: kind=exit:256: the exit code "
                 "must be a whole number from 0 to 255 (for example kind=exit:3)");
    expect_error("rank=1,step=2,kind=slow:0", "AM_FAULT=rank=1,step=2,kind=slow:0: kind=slow:0: the delay must be a "
                 "positive number of seconds, at most 1000000 (for example kind=slow:2.5)");
    expect_error("rank=1,step=2,kind=slow:abc", "AM_FAULT=rank=1,step=2,kind=slow:abc: kind=slow:abc: the delay must be "
                 "a positive number of seconds, at most 1000000 (for example kind=slow:2.5)");
    expect_error("rank=1,step=2,kind=segv,color=red", "AM_FAULT=rank=1,step=2,kind=segv,color=red: color: unknown key "
                 "(the keys are rank, step and kind: AM_FAULT=rank=R,step=S,kind=K)");
    expect_error("rank=1,rank=2,step=2,kind=segv", "AM_FAULT=rank=1,rank=2,step=2,kind=segv: rank is given twice (give "
                 "each of rank, step and kind once)");
    expect_error("rank=1,segv,step=2", "AM_FAULT=rank=1,segv,step=2: 'segv' is not key=value "
                 "(AM_FAULT=rank=R,step=S,kind=K)");
    expect_error("rank=1,step=2,kind=kill-in-save", "AM_FAULT=rank=1,step=2,kind=kill-in-save: kind=kill-in-save: the "
                 "phase of the save must be one of shard, written, manifest, commit or latest (for example "
                 "kind=kill-in-save:shard)");
    expect_error("rank=1,step=2,kind=kill-in-save:rename", "AM_FAULT=rank=1,step=2,kind=kill-in-save:rename: "
                 "kind=kill-in-save:rename: the phase of the save must be one of shard, written, manifest, commit or "
                 "latest (for example kind=kill-in-save:shard)");
    char longspec[200];
    memset(longspec, 'x', sizeof(longspec) - 1);
    longspec[sizeof(longspec) - 1] = '\0';
    expect_error(longspec, "AM_FAULT: 199 characters is too long for AM_FAULT=rank=R,step=S,kind=K (at most 127)");
}

static void test_checks(void **state)
{
    (void)state;
    struct am_fault f;
    char err[512];
    assert_int_equal(am_fault_parse("rank=8,step=1,kind=segv", &f, err, sizeof(err)), 0);
    assert_int_equal(am_fault_check(&f, 8, 8, err, sizeof(err)), -1);
    assert_string_equal(err, "AM_FAULT=rank=8,step=1,kind=segv: rank 8 is not a rank of this job (ranks 0 to 7)");
    assert_int_equal(am_fault_check(&f, 9, 9, err, sizeof(err)), 0);
    assert_int_equal(am_fault_parse("rank=0,step=1,kind=hang-in-collective", &f, err, sizeof(err)), 0);
    assert_int_equal(am_fault_check(&f, 1, 1, err, sizeof(err)), -1);
    assert_string_equal(err, "AM_FAULT=rank=0,step=1,kind=hang-in-collective: kind=hang-in-collective blocks the "
                             "gradient all-reduce, and this job has none (dp 1): run 2 or more data-parallel ranks, or "
                             "use kind=hang");
    assert_int_equal(am_fault_check(&f, 2, 2, err, sizeof(err)), 0);
    assert_int_equal(am_fault_parse("rank=1,step=2,kind=kill-in-alltoall", &f, err, sizeof(err)), 0);
    assert_int_equal(f.kind, AM_FAULT_KILL_IN_ALLTOALL);
    assert_string_equal(am_fault_kind_name(f.kind), "kill-in-alltoall");
    assert_int_equal(am_fault_check_ep(&f, 1, err, sizeof(err)), -1);
    assert_string_equal(err, "AM_FAULT=rank=1,step=2,kind=kill-in-alltoall: kind=kill-in-alltoall dies in the "
                             "experts' all-to-all, and this job has none (ep 1): run a mixture-of-experts model with "
                             "ep_size 2 or more, or use kind=kill");
    assert_int_equal(am_fault_check_ep(&f, 2, err, sizeof(err)), 0);
    assert_int_equal(am_fault_parse("rank=1,step=2,kind=expert-rows-oom", &f, err, sizeof(err)), 0);
    assert_int_equal(f.kind, AM_FAULT_EXPERT_ROWS_OOM);
    assert_string_equal(am_fault_kind_name(f.kind), "expert-rows-oom");
    assert_int_equal(am_fault_check(&f, 2, 2, err, sizeof(err)), 0);
    assert_int_equal(am_fault_check_ep(&f, 1, err, sizeof(err)), -1);
    assert_string_equal(err, "AM_FAULT=rank=1,step=2,kind=expert-rows-oom: kind=expert-rows-oom fails the growth of "
                             "the rows this rank's experts receive from their ep group, and this job has none (ep 1): "
                             "run a mixture-of-experts model with ep_size 2 or more, or use kind=device-oom");
    assert_int_equal(am_fault_check_ep(&f, 2, err, sizeof(err)), 0);
    assert_int_equal(am_fault_parse("rank=1,step=2,kind=kill-in-save:commit", &f, err, sizeof(err)), 0);
    assert_int_equal(am_fault_check(&f, 2, 2, err, sizeof(err)), -1);
    assert_string_equal(err, "AM_FAULT=rank=1,step=2,kind=kill-in-save:commit: rank 0 alone writes the manifest, "
                             "renames the checkpoint and updates `latest`: use rank=0 for those phases, or the phases "
                             "shard and written on rank 1");
    assert_int_equal(am_fault_parse("rank=1,step=2,kind=kill-in-save:written", &f, err, sizeof(err)), 0);
    assert_int_equal(am_fault_check(&f, 2, 2, err, sizeof(err)), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kinds),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_checks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
