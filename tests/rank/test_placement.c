/* test_placement.c - physical -> mesh rank mappings computed by hand for block, cyclic and
 * arbitrary task distributions, multi-node domains, the world handed to the planner, the
 * groups in physical ranks, and the impossible cases with their exact messages. */
#include "../testutil.h"
#include "placement.h"
#include "recipe.h"

static struct am_place_rank at(int node, int local_rank, int gpu, const char *domain)
{
    struct am_place_rank r;
    memset(&r, 0, sizeof(r));
    snprintf(r.host, sizeof(r.host), "n%d", node + 1);
    snprintf(r.domain, sizeof(r.domain), "%s", domain);
    r.node_id = node;
    r.local_rank = local_rank;
    r.gpu = gpu;
    return r;
}

/* A node of 4 GPUs in two NVLink pairs, as the tests' topology file describes it. */
static struct am_place_rank paired(int node, int local_rank, int gpu)
{
    char d[32];
    snprintf(d, sizeof(d), "n%d:%d", node + 1, gpu / 2);
    return at(node, local_rank, gpu, d);
}

static void place(const struct am_place_rank *ranks, int n, int tp, struct am_placement *pl)
{
    struct am_errors err;
    am_errors_init(&err);
    int rc = am_place_build(ranks, n, tp, pl, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(rc, 0);
    am_errors_free(&err);
}

static void assert_mapping(const struct am_placement *pl, const int *physical_of, int n)
{
    for (int m = 0; m < n; m++) {
        if (pl->physical_of[m] != physical_of[m]) {
            print_error("mesh rank %d: physical %d, want %d\n", m, pl->physical_of[m], physical_of[m]);
            fail();
        }
        assert_int_equal(pl->mesh_of[physical_of[m]], m);
    }
}

/* srun -N4 -n8 --ntasks-per-node=2 --distribution=block: rank r on node r/2, local r%2,
 * GPU = local rank: each node's two ranks share its first pair. Already node-major, so
 * mesh rank = physical rank. */
static void test_block(void **state)
{
    (void)state;
    struct am_place_rank r[8];
    for (int i = 0; i < 8; i++)
        r[i] = paired(i / 2, i % 2, i % 2);
    struct am_placement pl;
    place(r, 8, 2, &pl);
    const int want[] = {0, 1, 2, 3, 4, 5, 6, 7};
    assert_mapping(&pl, want, 8);
    assert_int_equal(pl.n_domains, 4);
    am_place_free(&pl);
}

/* srun -N2 -n8 --distribution=cyclic: rank r on node r%2, local rank r/2, GPU = local rank.
 * Domains: n1:0 {0, 2}, n1:1 {4, 6}, n2:0 {1, 3}, n2:1 {5, 7}. */
static void test_cyclic(void **state)
{
    (void)state;
    struct am_place_rank r[8];
    for (int i = 0; i < 8; i++)
        r[i] = paired(i % 2, i / 2, i / 2);
    struct am_placement pl;
    place(r, 8, 2, &pl);
    const int want[] = {0, 2, 4, 6, 1, 3, 5, 7};
    assert_mapping(&pl, want, 8);
    am_place_free(&pl);

    /* tp 4 does not fit pairs; with one domain per node it does: node-major runs of 4 */
    for (int i = 0; i < 8; i++)
        r[i] = at(i % 2, i / 2, i / 2, i % 2 ? "n2" : "n1");
    place(r, 8, 4, &pl);
    assert_mapping(&pl, want, 8);
    am_place_free(&pl);
}

/* srun --distribution=arbitrary with a host list n2,n1,n2,n1,n1,n2,n1,n2 and GPUs bound
 * out of order on n1 (local ranks 0..3 -> GPUs 2, 0, 3, 1):
 *   rank: 0  1  2  3  4  5  6  7
 *   node: n2 n1 n2 n1 n1 n2 n1 n2
 *   lr:   0  0  1  1  2  2  3  3
 *   gpu:  0  2  1  0  3  2  1  3     (n2 in order)
 * n1 in (node, local rank) order: 1 (n1:1), 3 (n1:0), 4 (n1:1), 6 (n1:0): domain n1:1
 * comes first with {1, 4}, then n1:0 with {3, 6}; then n2:0 {0, 2}, n2:1 {5, 7}. */
static void test_arbitrary(void **state)
{
    (void)state;
    const int node[] = {1, 0, 1, 0, 0, 1, 0, 1}, lr[] = {0, 0, 1, 1, 2, 2, 3, 3}, gpu[] = {0, 2, 1, 0, 3, 2, 1, 3};
    struct am_place_rank r[8];
    for (int i = 0; i < 8; i++)
        r[i] = paired(node[i], lr[i], gpu[i]);
    struct am_placement pl;
    place(r, 8, 2, &pl);
    const int want[] = {1, 4, 3, 6, 0, 2, 5, 7};
    assert_mapping(&pl, want, 8);
    am_place_free(&pl);
}

/* A multi-node NVLink domain (a rack): tp 8 over two nodes of 4, node-major. */
static void test_rack(void **state)
{
    (void)state;
    struct am_place_rank r[8];
    for (int i = 0; i < 8; i++)
        r[i] = at(i % 2, i / 2, i / 2, "rack-a");
    struct am_placement pl;
    place(r, 8, 8, &pl);
    const int want[] = {0, 2, 4, 6, 1, 3, 5, 7};
    assert_mapping(&pl, want, 8);
    assert_int_equal(pl.n_domains, 1);
    am_place_free(&pl);
}

static void test_world(void **state)
{
    (void)state;
    struct am_place_rank r[8];
    struct am_world w;
    for (int i = 0; i < 8; i++)
        r[i] = paired(i % 2, i / 2, i / 2);
    am_place_world(r, 8, &w);
    assert_int_equal(w.size, 8);
    assert_int_equal(w.nodes, 2);
    assert_int_equal(w.gpus_per_node, 4);
    assert_int_equal(w.nvlink_domain, 2);
    /* Slurm's default for -N4 -n8 on 4-CPU nodes: 4, 2, 1, 1 ranks */
    const int node[] = {0, 0, 0, 0, 1, 1, 2, 3}, lr[] = {0, 1, 2, 3, 0, 1, 0, 0};
    for (int i = 0; i < 8; i++)
        r[i] = paired(node[i], lr[i], lr[i]);
    am_place_world(r, 8, &w);
    assert_int_equal(w.nodes, 4);
    assert_int_equal(w.gpus_per_node, 0);
    assert_int_equal(w.nvlink_domain, 1); /* gcd of 2, 2, 2, 1, 1 */
    /* one domain of 8 ranks on one node */
    for (int i = 0; i < 8; i++)
        r[i] = at(0, i, i, "n1:0");
    am_place_world(r, 8, &w);
    assert_int_equal(w.nvlink_domain, 8);
}

static void test_impossible(void **state)
{
    (void)state;
    struct am_place_rank r[16];
    struct am_placement pl;
    struct am_errors err;
    am_errors_init(&err);

    /* -N4 -n8 without --ntasks-per-node: 4, 2, 1, 1 ranks per node */
    const int node[] = {0, 0, 0, 0, 1, 1, 2, 3}, lr[] = {0, 1, 2, 3, 0, 1, 0, 0};
    for (int i = 0; i < 8; i++)
        r[i] = paired(node[i], lr[i], lr[i]);
    assert_int_equal(am_place_build(r, 8, 2, &pl, &err), -1);
    const char *want1[] = {
        "placement: tp_size 2 cannot be placed: NVLink domain n3:0 has 1 rank (6); n4:0 has 1 rank (7). A "
        "tensor-parallel group must lie inside one domain, so every domain needs a multiple of 2 ranks: use tp_size 1 "
        "(dividing every domain's rank count), or start a multiple of 2 ranks in every domain (for example one rank "
        "per GPU: srun --ntasks-per-node=<GPUs per node>)",
        NULL};
    assert_messages(&err, want1);
    am_place_free(&pl);
    am_errors_free(&err);

    /* tp larger than every domain */
    for (int i = 0; i < 8; i++)
        r[i] = paired(i / 4, i % 4, i % 4);
    assert_int_equal(am_place_build(r, 8, 4, &pl, &err), -1);
    const char *want2[] = {
        "placement: tp_size 4 cannot be placed: NVLink domain n1:0 has 2 ranks (0, 1); n1:1 has 2 ranks (2, 3); n2:0 "
        "has 2 ranks (4, 5); n2:1 has 2 ranks (6, 7). A tensor-parallel group must lie inside one domain, so every "
        "domain needs a multiple of 4 ranks: use tp_size 1 or 2 (dividing every domain's rank count), or start a "
        "multiple of 4 ranks in every domain (for example one rank per GPU: srun --ntasks-per-node=<GPUs per node>)",
        NULL};
    assert_messages(&err, want2);
    am_place_free(&pl);
    am_errors_free(&err);

    /* many domains at fault: four are named, the rest counted */
    for (int i = 0; i < 12; i++)
        r[i] = paired(i / 2, i % 2, i % 2);
    assert_int_equal(am_place_build(r, 12, 4, &pl, &err), -1);
    const char *want3[] = {
        "placement: tp_size 4 cannot be placed: NVLink domain n1:0 has 2 ranks (0, 1); n2:0 has 2 ranks (2, 3); n3:0 "
        "has 2 ranks (4, 5); n4:0 has 2 ranks (6, 7); and 2 more domains. A tensor-parallel group must lie inside one "
        "domain, so every domain needs a multiple of 4 ranks: use tp_size 1 or 2 (dividing every domain's rank "
        "count), or start a multiple of 4 ranks in every domain (for example one rank per GPU: srun "
        "--ntasks-per-node=<GPUs per node>)",
        NULL};
    assert_messages(&err, want3);
    am_place_free(&pl);
    am_errors_free(&err);
}

static const char recipe[] = "model:\n"
                             "  hidden_size: 64\n"
                             "  num_hidden_layers: 4\n"
                             "  num_attention_heads: 4\n"
                             "  num_key_value_heads: 2\n"
                             "  intermediate_size: 128\n"
                             "  vocab_size: 256\n"
                             "  torch_dtype: float32\n"
                             "distributed:\n"
                             "  tp_size: 2\n"
                             "  pp_size: 2\n"
                             "step_scheduler:\n"
                             "  global_batch_size: 8\n"
                             "  local_batch_size: 4\n"
                             "dataset:\n"
                             "  seq_length: 64\n";

/* The cyclic case above with pp 2: mesh = (pp, dp_shard, tp), physical_of = {0, 2, 4, 6,
 * 1, 3, 5, 7}. */
static void test_groups(void **state)
{
    (void)state;
    struct am_place_rank r[8];
    for (int i = 0; i < 8; i++)
        r[i] = paired(i % 2, i / 2, i / 2);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *rec = am_recipe_parse("g.yaml", recipe, strlen(recipe), NULL, 0, &err);
    assert_non_null(rec);
    struct am_world w;
    am_place_world(r, 8, &w);
    struct am_plan p;
    assert_int_equal(am_plan_build(rec, &w, &p, &err), 0);
    struct am_placement pl;
    place(r, 8, 2, &pl);

    /* physical 3: mesh 5 = pp 1, dp_shard 0, tp 1 */
    struct am_coords c;
    am_place_coords(&p, &pl, 3, &c);
    assert_int_equal(c.pp, 1);
    assert_int_equal(c.dp_shard, 0);
    assert_int_equal(c.tp, 1);
    int m[8];
    assert_int_equal(am_place_group(&p, &pl, AM_GROUP_TP, 3, m), 2);
    assert_int_equal(m[0], 1); /* mesh 4, 5 */
    assert_int_equal(m[1], 3);
    assert_int_equal(am_place_group(&p, &pl, AM_GROUP_PP, 3, m), 2);
    assert_int_equal(m[0], 2); /* mesh 1, 5 */
    assert_int_equal(m[1], 3);
    assert_int_equal(am_place_group(&p, &pl, AM_GROUP_DP, 3, m), 2);
    assert_int_equal(m[0], 3); /* mesh 5, 7 */
    assert_int_equal(m[1], 7);

    const enum am_group kinds[] = {AM_GROUP_TP, AM_GROUP_PP};
    struct am_group_set set;
    assert_int_equal(am_place_groups(&p, &pl, kinds, 2, &set, &err), 0);
    assert_int_equal(set.n, 8); /* 4 tp groups, 4 pp groups */
    const int want[8][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}, {0, 1}, {2, 3}, {4, 5}, {6, 7}};
    for (int i = 0; i < 8; i++) {
        assert_int_equal(set.sizes[i], 2);
        assert_string_equal(set.names[i], i < 4 ? "tp" : "pp");
        assert_int_equal(set.kinds[i], i < 4 ? AM_GROUP_TP : AM_GROUP_PP);
        assert_int_equal(set.groups[i][0], want[i][0]);
        assert_int_equal(set.groups[i][1], want[i][1]);
    }
    am_group_set_free(&set);
    am_place_free(&pl);
    am_plan_free(&p);
    am_recipe_free(rec);
    am_errors_free(&err);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_block), cmocka_unit_test(test_cyclic),     cmocka_unit_test(test_arbitrary),
        cmocka_unit_test(test_rack),  cmocka_unit_test(test_world),      cmocka_unit_test(test_impossible),
        cmocka_unit_test(test_groups),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
