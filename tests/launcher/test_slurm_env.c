/* test_slurm_env.c - the parsers of a Slurm task's environment without PMIx (slurm_env.h):
 * hostlists, tasks per node, the derived boot port, and a whole step's environment. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "slurm_env.h"

static void first(const char *list, const char *want)
{
    char out[64], err[256] = "";
    assert_int_equal(am_hostlist_first(list, out, sizeof(out), err, sizeof(err)), 0);
    assert_string_equal(out, want);
}

static void test_hostlist_first(void **state)
{
    (void)state;
    first("n1", "n1");
    first("n[1-4]", "n1");
    first("n[3,1-2]", "n3");
    first("gpu[007-012],cpu1", "gpu007");
    first("host7,n[1-2]", "host7");
    first("rack[2-3]-n[08-10]", "rack2-n08");
    first("a.b-c", "a.b-c");
}

static void test_hostlist_count(void **state)
{
    (void)state;
    char err[256];
    assert_int_equal(am_hostlist_count("n1", err, sizeof(err)), 1);
    assert_int_equal(am_hostlist_count("n[1-4]", err, sizeof(err)), 4);
    assert_int_equal(am_hostlist_count("n[1-4,7,09-10],x,y[1-2]", err, sizeof(err)), 10);
    assert_int_equal(am_hostlist_count("rack[2-3]-n[08-10]", err, sizeof(err)), 6);
}

static void test_hostlist_malformed(void **state)
{
    (void)state;
    const char *bad[] = {"", "n[1-", "n[4-1]", "n[]", "n[a]", "n1]", ",n1", "n1,,n2", "n[1-2"};
    char out[64], err[256];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(am_hostlist_count(bad[i], err, sizeof(err)), -1);
    assert_int_equal(am_hostlist_first("n[4-1]", out, sizeof(out), err, sizeof(err)), -1);
    assert_string_equal(err, "hostlist 'n[4-1]': cannot read its first host (expected names like n1 or "
                             "n[1-4],gpu07, each under 64 characters)");
    assert_int_equal(am_hostlist_count("n1,,n2", err, sizeof(err)), -1);
    assert_string_equal(err, "hostlist 'n1,,n2': malformed (expected names like n1 or n[1-4],gpu07)");
    char tiny[4];
    assert_int_equal(am_hostlist_first("node1", tiny, sizeof(tiny), err, sizeof(err)), -1);
}

static void test_tasks_on_node(void **state)
{
    (void)state;
    char err[256];
    assert_int_equal(am_tasks_on_node("2", 0, err, sizeof(err)), 2);
    assert_int_equal(am_tasks_on_node("2(x3),1", 0, err, sizeof(err)), 2);
    assert_int_equal(am_tasks_on_node("2(x3),1", 2, err, sizeof(err)), 2);
    assert_int_equal(am_tasks_on_node("2(x3),1", 3, err, sizeof(err)), 1);
    assert_int_equal(am_tasks_on_node("4,3,2", 1, err, sizeof(err)), 3);
    assert_int_equal(am_tasks_on_node("2(x3),1", 4, err, sizeof(err)), -1);
    assert_string_equal(err, "tasks per node '2(x3),1' names 4 nodes: no node 4");
    assert_int_equal(am_tasks_on_node("2(3)", 0, err, sizeof(err)), -1);
    assert_string_equal(err, "tasks per node '2(3)': malformed (expected counts like 2(x3),1)");
}

static void test_port(void **state)
{
    (void)state;
    assert_int_equal(am_boot_port_derive(0, 0), AM_BOOT_PORT_BASE);
    assert_int_equal(am_boot_port_derive(1234, 5), 20000 + (1234 * 64 + 5) % 12288);
    /* the steps of one job, and steps of nearby jobs, differ */
    for (int s = 0; s < 64; s++)
        for (int j = 1; j < AM_BOOT_PORT_SPAN / 64; j++)
            assert_int_not_equal(am_boot_port_derive(1000, (unsigned)s), am_boot_port_derive(1000 + (unsigned)j, 0));
    for (unsigned long long j = 0; j < 100000; j += 7) {
        int p = am_boot_port_derive(j, j % 5);
        assert_true(p >= AM_BOOT_PORT_BASE && p < AM_BOOT_PORT_BASE + AM_BOOT_PORT_SPAN && p < 32768);
    }
}

static void test_auth_socket(void **state)
{
    (void)state;
    char out[128];
    assert_int_equal(am_slurm_auth_socket_parse("ClusterName=c\nAuthType=auth/munge\nAuthInfo=socket=/run/m/munge.sock\n",
                                                out, sizeof(out)), 1);
    assert_string_equal(out, "/run/m/munge.sock");
    assert_int_equal(am_slurm_auth_socket_parse("  authinfo = ttl=60,SOCKET=/x/s # a comment\n", out, sizeof(out)), 1);
    assert_string_equal(out, "/x/s");
    assert_int_equal(am_slurm_auth_socket_parse("#AuthInfo=socket=/no\nAuthInfo=ttl=60\nAuthAltTypes=x\n", out,
                                                sizeof(out)), 0);
    assert_int_equal(am_slurm_auth_socket_parse("AuthInfoX=socket=/no", out, sizeof(out)), 0);
    assert_int_equal(am_slurm_auth_socket_parse("", out, sizeof(out)), 0);
}

/* ---- a whole step's environment ---- */
static const char *const *env_now;
static const char *fake_getenv(const char *name)
{
    for (const char *const *e = env_now; *e; e += 2)
        if (strcmp(e[0], name) == 0)
            return e[1];
    return NULL;
}

static void test_step(void **state)
{
    (void)state;
    static const char *const env[] = {"SLURM_JOB_ID", "42", "SLURM_STEP_ID", "3", "SLURM_NTASKS", "6",
                                      "SLURM_PROCID", "4", "SLURM_STEP_NUM_NODES", "3", "SLURM_NODEID", "2",
                                      "SLURM_LOCALID", "0", "SLURM_STEP_TASKS_PER_NODE", "2(x2),2",
                                      "SLURM_STEP_NODELIST", "gpu[07-08],big1", "SLURMD_NODENAME", "big1", NULL};
    struct am_slurm_step s;
    char err[256] = "";
    env_now = env;
    assert_int_equal(am_slurm_step_read(&s, fake_getenv, err, sizeof(err)), 0);
    assert_int_equal(s.info.rank, 4);
    assert_int_equal(s.info.size, 6);
    assert_int_equal(s.info.local_rank, 0);
    assert_int_equal(s.info.local_size, 2);
    assert_int_equal(s.info.node_id, 2);
    assert_int_equal(s.info.n_nodes, 3);
    assert_string_equal(s.info.host, "big1");
    assert_string_equal(s.info.job_id, "42.3");
    assert_string_equal(s.first_host, "gpu07");
    assert_string_equal(s.server_host, "gpu07");
    assert_int_equal(s.port, am_boot_port_derive(42, 3));
    assert_int_equal(s.serves, 0);

    static const char *const over[] = {"SLURM_JOB_ID", "42", "SLURM_STEPID", "0", "SLURM_NTASKS", "2",
                                       "SLURM_PROCID", "0", "SLURM_NNODES", "1", "SLURM_NODEID", "0",
                                       "SLURM_LOCALID", "0", "SLURM_TASKS_PER_NODE", "2",
                                       "SLURM_NODELIST", "n1", "AM_BOOT_HOST", "10.0.0.1", "AM_BOOT_PORT", "4321",
                                       NULL};
    env_now = over;
    assert_int_equal(am_slurm_step_read(&s, fake_getenv, err, sizeof(err)), 0);
    assert_string_equal(s.server_host, "10.0.0.1");
    assert_int_equal(s.port, 4321);
    assert_int_equal(s.serves, 1);
}

static void refused(const char *const *env, const char *want)
{
    struct am_slurm_step s;
    char err[256] = "";
    env_now = env;
    assert_int_equal(am_slurm_step_read(&s, fake_getenv, err, sizeof(err)), -1);
    assert_string_equal(err, want);
}

static void test_step_refused(void **state)
{
    (void)state;
    static const char *const no_job[] = {"SLURM_PROCID", "0", NULL};
    refused(no_job, "SLURM_JOB_ID is not set: is this a task of a Slurm step (srun)?");
    static const char *const bad_rank[] = {"SLURM_JOB_ID", "42", "SLURM_STEP_ID", "0", "SLURM_NTASKS", "2",
                                           "SLURM_PROCID", "2", NULL};
    refused(bad_rank, "SLURM_PROCID='2': not a whole number from 0 to 1");
    static const char *const hosts[] = {"SLURM_JOB_ID", "42", "SLURM_STEP_ID", "0", "SLURM_NTASKS", "2",
                                        "SLURM_PROCID", "1", "SLURM_STEP_NUM_NODES", "2", "SLURM_NODEID", "1",
                                        "SLURM_LOCALID", "0", "SLURM_STEP_TASKS_PER_NODE", "1(x2)",
                                        "SLURM_STEP_NODELIST", "n[1-3]", NULL};
    refused(hosts, "SLURM_STEP_NODELIST='n[1-3]' names 3 nodes, but the step has 2 (SLURM_STEP_NUM_NODES)");
    static const char *const port[] = {"SLURM_JOB_ID", "42", "SLURM_STEP_ID", "0", "SLURM_NTASKS", "1",
                                       "SLURM_PROCID", "0", "SLURM_STEP_NUM_NODES", "1", "SLURM_NODEID", "0",
                                       "SLURM_LOCALID", "0", "SLURM_STEP_TASKS_PER_NODE", "1",
                                       "SLURM_STEP_NODELIST", "n1", "AM_BOOT_PORT", "70000", NULL};
    refused(port, "AM_BOOT_PORT='70000': not a TCP port (1 to 65535)");
    static const char *const local[] = {"SLURM_JOB_ID", "42", "SLURM_STEP_ID", "0", "SLURM_NTASKS", "4",
                                        "SLURM_PROCID", "3", "SLURM_STEP_NUM_NODES", "2", "SLURM_NODEID", "1",
                                        "SLURM_LOCALID", "2", "SLURM_STEP_TASKS_PER_NODE", "2(x2)",
                                        "SLURM_STEP_NODELIST", "n[1-2]", NULL};
    refused(local, "SLURM_LOCALID=2, but SLURM_STEP_TASKS_PER_NODE='2(x2)' gives node 1 2 tasks");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hostlist_first), cmocka_unit_test(test_hostlist_count),
        cmocka_unit_test(test_hostlist_malformed), cmocka_unit_test(test_tasks_on_node),
        cmocka_unit_test(test_port), cmocka_unit_test(test_auth_socket), cmocka_unit_test(test_step), cmocka_unit_test(test_step_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
