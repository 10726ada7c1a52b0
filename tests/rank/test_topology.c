/* test_topology.c - the topology file (domains, ranges, clusters, every error with its
 * exact message), GPU binding from the Slurm/CUDA variables, and the no-NVML path. */
#include <stdlib.h>
#include <unistd.h>

#include "../testutil.h"
#include "topology.h"

/* Parses text as t.yaml and checks the messages (none expected: NULL first entry). */
static int parse(const char *text, struct am_topology *t, const char *const *expected)
{
    struct am_errors err;
    am_errors_init(&err);
    int rc = am_topology_parse("t.yaml", text, strlen(text), t, &err);
    assert_messages(&err, expected);
    am_errors_free(&err);
    return rc;
}

static const char *domain(const struct am_topology *t, const char *host, int gpu)
{
    static char buf[AM_DOMAIN_MAX];
    const struct am_topo_node *n = am_topology_node(t, host);
    assert_non_null(n);
    am_topology_domain(t, n, gpu, buf, sizeof(buf));
    return buf;
}

static void test_file_domains(void **state)
{
    (void)state;
    struct am_topology t;
    const char *none[] = {NULL};
    assert_int_equal(parse("# two NVLink pairs per node, listed high pair first\n"
                           "nodes:\n"
                           "  \"n[1-2]\": {gpus: 4, domains: [[3, 2], [1, 0]]}\n"
                           "  login: {gpus: 0}\n"
                           "  big: {gpus: 8}\n"
                           "  \"g[08-10]\": {gpus: 4}\n"
                           "clusters:\n"
                           "  - {name: rack-a, nodes: [\"g[08-09]\"]}\n"
                           "  - {nodes: [g10]}\n",
                           &t, none),
                     0);
    assert_int_equal(t.n_nodes, 7);
    assert_string_equal(domain(&t, "n1", 0), "n1:0"); /* numbered by lowest GPU */
    assert_string_equal(domain(&t, "n1", 1), "n1:0");
    assert_string_equal(domain(&t, "n2", 2), "n2:1");
    assert_string_equal(domain(&t, "n2", 3), "n2:1");
    assert_string_equal(domain(&t, "login", -1), "login");
    assert_string_equal(domain(&t, "big", 7), "big:0");
    assert_string_equal(domain(&t, "big", -1), "big");
    assert_string_equal(domain(&t, "g08", 0), "rack-a");
    assert_string_equal(domain(&t, "g09", 3), "rack-a");
    assert_string_equal(domain(&t, "g10", 1), "cluster1");
    assert_null(am_topology_node(&t, "n3"));
    assert_null(am_topology_node(&t, "g8"));
    am_topology_free(&t);
}

static void test_file_errors(void **state)
{
    (void)state;
    struct am_topology t;
    {
        const char *want[] = {"t.yaml:1:1: node: unknown key (did you mean nodes?)",
                              "t.yaml: nodes: expected a section with one entry per node, like nodes: {n1: {gpus: 4, "
                              "domains: [[0, 1], [2, 3]]}}",
                              NULL};
        assert_int_equal(parse("node: {n1: {gpus: 4}}\n", &t, want), -1);
        am_topology_free(&t);
    }
    {
        const char *want[] = {"t.yaml:2:8: nodes.n1.gpu: unknown key (did you mean gpus?)",
                              "t.yaml:2:7: nodes.n1: gpus is missing (how many GPUs the node has; 0 for none)", NULL};
        assert_int_equal(parse("nodes:\n  n1: {gpu: 4}\n", &t, want), -1);
        am_topology_free(&t);
    }
    {
        const char *want[] = {"t.yaml:2:39: nodes.n1.domains[1][1]: 4 is out of range (must be 0 to 3)",
                              "t.yaml:3:36: nodes.n2.domains[1][0]: GPU 1 is already in domains[0]: a GPU belongs "
                              "to one domain",
                              "t.yaml:4:26: nodes.n3.domains: GPUs 2, 3 are in no domain: list every GPU 0..3 exactly "
                              "once",
                              "t.yaml:5:14: nodes.n4.gpus: expected a whole number, got 'four'",
                              "t.yaml:6:26: nodes.n5.domains: the node has no GPUs (gpus: 0): remove domains", NULL};
        assert_int_equal(parse("nodes:\n"
                               "  n1: {gpus: 4, domains: [[0, 1], [2, 4]]}\n"
                               "  n2: {gpus: 4, domains: [[0, 1], [1, 2, 3]]}\n"
                               "  n3: {gpus: 4, domains: [[0, 1]]}\n"
                               "  n4: {gpus: four}\n"
                               "  n5: {gpus: 0, domains: [[0]]}\n",
                               &t, want),
                         -1);
        am_topology_free(&t);
    }
    {
        const char *want[] = {"t.yaml:3:3: nodes: n2 is listed twice (also at t.yaml:2:3): give each node once",
                              "t.yaml:4:3: nodes: 'n[3-1]' has a bad range: write n[1-4], n[1,3,5] or n[01-16]", NULL};
        assert_int_equal(parse("nodes:\n"
                               "  \"n[1-2]\": {gpus: 4}\n"
                               "  n2: {gpus: 4}\n"
                               "  \"n[3-1]\": {gpus: 4}\n",
                               &t, want),
                         -1);
        am_topology_free(&t);
    }
    {
        const char *want[] = {"t.yaml:6:27: clusters[0].nodes[1]: node n9 is not listed under nodes: add it there (with "
                              "its gpus)",
                              "t.yaml:7:23: clusters[1].nodes[0]: node n1 is already in cluster a: a node is in at "
                              "most one cluster",
                              "t.yaml:4:26: nodes.n3.domains: node n3 is in cluster b, whose NVLink domain spans all "
                              "its GPUs: remove domains",
                              "t.yaml:8:6: clusters[2].nome: unknown key (did you mean name?)",
                              "t.yaml:8:5: clusters[2].nodes: expected a non-empty list of node names, like [n1, n2] or "
                              "[\"n[1-18]\"]",
                              NULL};
        assert_int_equal(parse("nodes:\n"
                               "  n1: {gpus: 4}\n"
                               "  n2: {gpus: 4}\n"
                               "  n3: {gpus: 4, domains: [[0, 1], [2, 3]]}\n"
                               "clusters:\n"
                               "  - {name: a, nodes: [n1, n9]}\n"
                               "  - {name: b, nodes: [n1, n3]}\n"
                               "  - {nome: c}\n",
                               &t, want),
                         -1);
        am_topology_free(&t);
    }
}

static void test_file_load(void **state)
{
    (void)state;
    struct am_topology t;
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_topology_load("/nonexistent/topo.yaml", &t, &err), -1);
    const char *want[] = {"topology file /nonexistent/topo.yaml: cannot open: No such file or directory (set --topology or AM_TOPOLOGY_FILE to a "
                          "readable file)",
                          NULL};
    assert_messages(&err, want);
    am_topology_free(&t);
    am_errors_free(&err);
}

struct bind_case {
    const char *visible, *step;
    int local_rank, node_gpus;
    int gpu, device, n;
    const char *error;
};

static void test_gpu_binding(void **state)
{
    (void)state;
    static const struct bind_case cases[] = {
        /* nothing from Slurm: all the node's GPUs, round-robin over local ranks */
        {NULL, NULL, 5, 4, 1, 1, 4, NULL},
        {NULL, NULL, 0, 0, -1, -1, 0, NULL},
        /* Slurm without device cgroups: CUDA_VISIBLE_DEVICES holds Slurm's indices */
        {"0,1,2,3", "0,1,2,3", 2, 4, 2, 2, 4, NULL},
        {"3", "0,1,2,3", 0, 4, 3, 0, 1, NULL}, /* --gpu-bind gave this task GPU 3 */
        {"2,3", "2,3", 1, 4, 3, 1, 2, NULL},
        /* with device cgroups CUDA renumbers from 0: translate through SLURM_STEP_GPUS */
        {"0,1", "2,3", 1, 4, 3, 1, 2, NULL},
        {"0", "6", 0, 8, 6, 0, 1, NULL},
        /* only SLURM_STEP_GPUS */
        {NULL, "4,5,6,7", 1, 8, 5, 5, 4, NULL},
        /* UUIDs: CUDA's order, Slurm's index only when the counts match */
        {"GPU-aa,GPU-bb", "5,6", 1, 8, 6, 1, 2, NULL},
        {"GPU-aa", NULL, 3, 8, -1, 0, 1, NULL},
        /* errors */
        {"0,5", "0,1", 0, 4, 0, 0, 0,
         "CUDA_VISIBLE_DEVICES='0,5' names device 5, but the step has 2 GPUs (SLURM_STEP_GPUS='0,1')"},
        {"7", NULL, 0, 4, 0, 0, 0, "GPU 7 (from CUDA_VISIBLE_DEVICES) does not exist: the node has 4 GPUs (0..3)"},
        {NULL, "0,x", 0, 4, 0, 0, 0, "SLURM_STEP_GPUS='0,x' is not a list of GPU numbers"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct bind_case *c = &cases[i];
        struct am_gpu_binding b;
        char err[256] = "";
        int rc = am_gpu_bind(c->visible, c->step, c->local_rank, c->node_gpus, &b, err, sizeof(err));
        if (c->error) {
            if (rc != -1 || strcmp(err, c->error) != 0) {
                print_error("case %zu: rc %d, error\n  got:  %s\n  want: %s\n", i, rc, err, c->error);
                fail();
            }
            continue;
        }
        if (rc != 0 || b.gpu != c->gpu || b.device != c->device || b.n != c->n) {
            print_error("case %zu (visible %s, step %s, local rank %d): got rc %d gpu %d device %d n %d (%s), want gpu "
                        "%d device %d n %d\n", i, c->visible ? c->visible : "-", c->step ? c->step : "-",
                        c->local_rank, rc, b.gpu, b.device, b.n, err, c->gpu, c->device, c->n);
            fail();
        }
    }
}

/* No libnvidia-ml.so.1 here (CI has no GPU): NVML reports "not there" and a rank without
 * a topology file is placed in its node's domain. */
static void test_no_nvml(void **state)
{
    (void)state;
    char out[AM_DOMAIN_MAX] = "", why[256] = "";
    int n = -1;
    if (getenv("LD_LIBRARY_PATH") && strstr(getenv("LD_LIBRARY_PATH"), "fake-nvml"))
        skip();
    assert_int_equal(am_nvml_domain("n1", 0, &n, out, sizeof(out), why, sizeof(why)), 0);
    assert_string_equal(why, "libnvidia-ml.so.1 not found (no NVIDIA driver)");

    struct am_rank_topo topo;
    struct am_errors err;
    am_errors_init(&err);
    unsetenv("AM_TOPOLOGY_FILE");
    unsetenv("CUDA_VISIBLE_DEVICES");
    unsetenv("SLURM_STEP_GPUS");
    unsetenv("SLURM_JOB_GPUS");
    assert_int_equal(am_rank_topology("n7", 3, &topo, &err), 0);
    assert_string_equal(topo.domain, "n7");
    assert_string_equal(topo.source, "no GPU information");
    assert_int_equal(topo.gpu.gpu, -1);

    /* a bound GPU without topology information: still the node's domain */
    setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3", 1);
    assert_int_equal(am_rank_topology("n7", 3, &topo, &err), 0);
    assert_string_equal(topo.domain, "n7");
    assert_int_equal(topo.gpu.gpu, 3);
    unsetenv("CUDA_VISIBLE_DEVICES");
    am_errors_free(&err);
}

static void test_rank_topology_file(void **state)
{
    (void)state;
    char path[] = "/tmp/am-test-topo-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char text[] = "nodes:\n  \"n[1-2]\": {gpus: 4, domains: [[0, 1], [2, 3]]}\n";
    assert_int_equal(write(fd, text, sizeof(text) - 1), (ssize_t)sizeof(text) - 1);
    close(fd);
    setenv("AM_TOPOLOGY_FILE", path, 1);
    unsetenv("CUDA_VISIBLE_DEVICES");
    setenv("SLURM_STEP_GPUS", "0,1,2,3", 1);

    struct am_rank_topo topo;
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_rank_topology("n2", 2, &topo, &err), 0);
    assert_string_equal(topo.domain, "n2:1");
    assert_int_equal(topo.gpu.gpu, 2);
    assert_string_equal(topo.source, "topology file");

    assert_int_equal(am_rank_topology("n3", 0, &topo, &err), -1);
    char want[512];
    snprintf(want, sizeof(want), "topology file %s: node n3 (this rank's host) is not listed: add it under nodes: "
             "(with its gpus)", path);
    const char *expected[] = {want, NULL};
    assert_messages(&err, expected);
    am_errors_free(&err);
    unlink(path);
    unsetenv("AM_TOPOLOGY_FILE");
    unsetenv("SLURM_STEP_GPUS");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_file_domains), cmocka_unit_test(test_file_errors),
        cmocka_unit_test(test_file_load),    cmocka_unit_test(test_gpu_binding),
        cmocka_unit_test(test_no_nvml),      cmocka_unit_test(test_rank_topology_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
