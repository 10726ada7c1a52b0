/* test_plan.c - the mesh, the groups, the pipeline stages, the memory estimate and the
 * FLOPs, each against values computed by hand. */
#include "testrecipe.h"

static const char model8[] = "model:\n"
                             "  hidden_size: 256\n"
                             "  num_hidden_layers: 8\n"
                             "  num_attention_heads: 8\n"
                             "  num_key_value_heads: 4\n"
                             "  intermediate_size: 512\n"
                             "  vocab_size: 1024\n"
                             "  torch_dtype: float32\n"
                             "step_scheduler:\n"
                             "  global_batch_size: 32\n"
                             "  local_batch_size: 4\n"
                             "dataset:\n"
                             "  seq_length: 128\n";

static struct am_recipe *plan_of(const char *yaml, const char *const *sets, int world, struct am_plan *p)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("plan.yaml", yaml, sets, &err);
    assert_non_null(r);
    struct am_world w = {.size = world, .nodes = 1, .gpus_per_node = world, .nvlink_domain = world};
    int rc = am_plan_build(r, &w, p, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(rc, 0);
    am_errors_free(&err);
    return r;
}

/* world 16 = pp 2 x dp_replicate 2 x dp_shard 2 x cp 1 x tp 2 */
static void test_mesh_coordinates(void **state)
{
    (void)state;
    const char *sets[] = {"distributed.tp_size=2", "distributed.pp_size=2", "distributed.dp_replicate_size=2", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, sets, 16, &p);
    assert_int_equal(p.dp, 4);
    assert_int_equal(p.dp_replicate, 2);
    assert_int_equal(p.dp_shard, 2);
    /* rank = ((pp*2 + rep)*2 + shard)*2 + tp  (cp = 1) */
    static const int want[16][4] = {/* pp rep shard tp */
                                    {0, 0, 0, 0}, {0, 0, 0, 1}, {0, 0, 1, 0}, {0, 0, 1, 1},
                                    {0, 1, 0, 0}, {0, 1, 0, 1}, {0, 1, 1, 0}, {0, 1, 1, 1},
                                    {1, 0, 0, 0}, {1, 0, 0, 1}, {1, 0, 1, 0}, {1, 0, 1, 1},
                                    {1, 1, 0, 0}, {1, 1, 0, 1}, {1, 1, 1, 0}, {1, 1, 1, 1}};
    for (int rank = 0; rank < 16; rank++) {
        struct am_coords c;
        am_plan_coords(&p, rank, &c);
        assert_int_equal(c.pp, want[rank][0]);
        assert_int_equal(c.dp_replicate, want[rank][1]);
        assert_int_equal(c.dp_shard, want[rank][2]);
        assert_int_equal(c.tp, want[rank][3]);
        assert_int_equal(c.cp, 0);
        assert_int_equal(am_plan_rank(&p, &c), rank);
    }
    am_plan_free(&p);
    am_recipe_free(r);
}

static void assert_group(const struct am_plan *p, enum am_group g, int rank, const int *want, int n)
{
    int members[64];
    int got = am_plan_group(p, g, rank, members);
    assert_int_equal(got, n);
    for (int i = 0; i < n; i++)
        assert_int_equal(members[i], want[i]);
}

static void test_groups(void **state)
{
    (void)state;
    const char *sets[] = {"distributed.tp_size=2", "distributed.pp_size=2", "distributed.dp_replicate_size=2", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, sets, 16, &p);
    /* rank 5 = pp 0, rep 1, shard 0, tp 1 */
    assert_group(&p, AM_GROUP_TP, 5, (int[]){4, 5}, 2);
    assert_group(&p, AM_GROUP_PP, 5, (int[]){5, 13}, 2);
    assert_group(&p, AM_GROUP_DP, 5, (int[]){1, 3, 5, 7}, 4);
    assert_group(&p, AM_GROUP_DP_SHARD, 5, (int[]){5, 7}, 2);
    assert_group(&p, AM_GROUP_DP_REPLICATE, 5, (int[]){1, 5}, 2);
    assert_group(&p, AM_GROUP_CP, 5, (int[]){5}, 1);
    am_plan_free(&p);
    am_recipe_free(r);
    /* HSDP with cp 2 (and ep 2): the shard group is dp_shard x cp within a replica group (AutoModel's
     * dp_shard_cp), the replicas vary dp_replicate alone; the experts' shard group (the ranks
     * holding the same experts) spans the replica groups. Rank 5 = rep 1, shard 0, cp 1. */
    const char *cp[] = {"distributed.cp_size=2", "distributed.dp_replicate_size=2", NULL};
    r = plan_of(model8, cp, 8, &p);
    assert_group(&p, AM_GROUP_DP_SHARD, 5, (int[]){4, 5, 6, 7}, 4);
    assert_group(&p, AM_GROUP_DP_REPLICATE, 5, (int[]){1, 5}, 2);
    assert_group(&p, AM_GROUP_DP_CP, 5, (int[]){0, 1, 2, 3, 4, 5, 6, 7}, 8);
    am_plan_free(&p);
    am_recipe_free(r);
    r = plan_of(model8, sets, 16, &p);
    /* every rank is in exactly one group of each kind: group sizes add up */
    for (int g = 0; g < AM_NGROUPS; g++) {
        int seen[16] = {0}, members[16];
        for (int rank = 0; rank < 16; rank++) {
            int n = am_plan_group(&p, (enum am_group)g, rank, members);
            int self = 0;
            for (int i = 0; i < n; i++)
                self += members[i] == rank;
            assert_int_equal(self, 1);
            seen[rank] = n;
        }
        int expect = seen[0];
        for (int rank = 0; rank < 16; rank++)
            assert_int_equal(seen[rank], expect);
    }
    am_plan_free(&p);
    am_recipe_free(r);
}

/* MoE: world 8, tp 2, ep 2: dp 4; within each tp slice the 4 dp ranks form ep_shard 2 x ep 2 */
static void test_expert_groups(void **state)
{
    (void)state;
    static const char moe[] = "model:\n  model_type: mixtral\n  hidden_size: 64\n  num_hidden_layers: 2\n"
                              "  num_attention_heads: 4\n  num_key_value_heads: 2\n  intermediate_size: 128\n"
                              "  vocab_size: 256\n  num_local_experts: 4\n  num_experts_per_tok: 2\n"
                              "step_scheduler:\n  global_batch_size: 8\n  local_batch_size: 2\n";
    const char *sets[] = {"distributed.tp_size=2", "distributed.ep_size=2", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(moe, sets, 8, &p);
    assert_int_equal(p.ep_shard, 2);
    /* dp index d = rank / 2 (tp innermost); ep = d % 2, ep_shard = d / 2 */
    assert_group(&p, AM_GROUP_EP, 0, (int[]){0, 2}, 2);
    assert_group(&p, AM_GROUP_EP, 5, (int[]){5, 7}, 2);
    assert_group(&p, AM_GROUP_EP_SHARD, 0, (int[]){0, 4}, 2);
    assert_group(&p, AM_GROUP_EP_SHARD, 3, (int[]){3, 7}, 2);
    struct am_coords c;
    am_plan_coords(&p, 6, &c); /* d = 3 */
    assert_int_equal(c.ep, 1);
    assert_int_equal(c.ep_shard, 1);
    am_plan_free(&p);
    am_recipe_free(r);
    /* HSDP (2 replicas of 2 shards) with ep 2, world 4: the ranks holding the same experts
     * span the replica groups (AutoModel's ep_shard), and every rank writes a checkpoint
     * shard (the other replica group its experts' pieces) */
    const char *hsdp[] = {"distributed.ep_size=2", "distributed.dp_replicate_size=2", "checkpoint.enabled=true",
                          "checkpoint.save_consolidated=false", NULL};
    r = plan_of(moe, hsdp, 4, &p);
    assert_int_equal(p.zero_stage, 3);
    assert_group(&p, AM_GROUP_DP_SHARD, 2, (int[]){2, 3}, 2);
    assert_group(&p, AM_GROUP_EP, 2, (int[]){2, 3}, 2);
    assert_group(&p, AM_GROUP_EP_SHARD, 2, (int[]){0, 2}, 2);
    struct am_world w = {.size = 4, .nodes = 1, .gpus_per_node = 4};
    struct am_ckpt_cost cost;
    am_plan_ckpt_cost(r, &w, &p, &cost);
    assert_int_equal(cost.writers, 4);
    am_plan_free(&p);
    am_recipe_free(r);
}

static void test_interleaved_stages(void **state)
{
    (void)state;
    const char *sets[] = {"distributed.pp_size=2", "distributed.pipeline.pp_schedule=interleaved1f1b",
                          "distributed.pipeline.layers_per_stage=2", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, sets, 2, &p);
    assert_int_equal(p.virtual_stages, 2);
    assert_int_equal(p.n_stages, 4);
    for (int s = 0; s < 4; s++) {
        assert_int_equal(p.stages[s].pp_rank, s % 2);
        assert_int_equal(p.stages[s].first_layer, 2 * s);
        assert_int_equal(p.stages[s].n_layers, 2);
        assert_int_equal(p.stages[s].embedding, s == 0);
        assert_int_equal(p.stages[s].head, s == 3);
    }
    assert_int_equal(p.n_microbatches, 4); /* local 4 / micro-batch 1 */
    assert_int_equal(p.grad_accum, 8);     /* 32 / (local 4 * dp 1) */
    am_plan_free(&p);
    am_recipe_free(r);
}

/* 8 layers in 6 stages (layers_per_stage 1 makes 8, rounded down to a multiple of pp 3): split as
 * AutoModel splits them, the first 8 % 6 = 2 stages of 2 layers, the other 4 of 1; each rank's
 * activations count its own chunks' layers (rank 0: stages 0 and 3, 3 layers). */
static void test_interleaved_stages_uneven(void **state)
{
    (void)state;
    const char *sets[] = {"distributed.pp_size=3", "distributed.pipeline.pp_schedule=interleaved1f1b",
                          "distributed.pipeline.layers_per_stage=1",
                          "distributed.pipeline.round_virtual_stages_to_pp_multiple=down", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, sets, 3, &p);
    assert_int_equal(p.virtual_stages, 2);
    assert_int_equal(p.n_stages, 6);
    static const int first[6] = {0, 2, 4, 5, 6, 7}, n[6] = {2, 2, 1, 1, 1, 1};
    for (int s = 0; s < 6; s++) {
        assert_int_equal(p.stages[s].pp_rank, s % 3);
        assert_int_equal(p.stages[s].first_layer, first[s]);
        assert_int_equal(p.stages[s].n_layers, n[s]);
        assert_int_equal(p.stages[s].embedding, s == 0);
        assert_int_equal(p.stages[s].head, s == 5);
    }
    am_plan_free(&p);
    am_recipe_free(r);
    /* more stages than layers: refused, naming the key */
    struct am_errors err;
    am_errors_init(&err);
    const char *many[] = {"distributed.pp_size=3", "distributed.pipeline.pp_schedule=interleaved1f1b",
                          "distributed.pipeline.layers_per_stage=1",
                          "distributed.pipeline.round_virtual_stages_to_pp_multiple=up", NULL};
    r = parse_with("plan.yaml", model8, many, &err);
    assert_non_null(r);
    struct am_world w = {.size = 3, .nodes = 1, .gpus_per_node = 3, .nvlink_domain = 3};
    assert_int_not_equal(am_plan_build(r, &w, &p, &err), 0);
    bool found = false;
    for (size_t i = 0; i < err.n; i++)
        found |= strstr(err.msg[i], "distributed.pipeline.layers_per_stage: 1 makes 9 stages (3 ranks x 3 virtual "
                                    "stages) for num_hidden_layers = 8: a stage needs a layer at least") != NULL;
    assert_true(found);
    am_errors_free(&err);
    am_recipe_free(r);
}

/* Parameters of model8 by hand:
 *   embedding 1024*256 = 262144, lm_head 262144 (untied), final norm 256
 *   per layer: q 256*256 + k,v 2*256*128 + o 256*256 = 196608; norms 512; mlp 3*256*512 = 393216
 *   per layer total 590336; 8 layers 4722688; total 5247232 */
static void test_param_count(void **state)
{
    (void)state;
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, NULL, 1, &p);
    assert_float_equal(p.params.embedding, 262144, 0);
    assert_float_equal(p.params.per_layer, 590336, 0);
    assert_float_equal(p.params.total, 5247232, 0);
    /* active: 8 * (196608 + 393216) + lm_head 262144 */
    assert_float_equal(p.params.active_per_token, 8 * (196608.0 + 393216) + 262144, 0);
    /* FLOPs (PaLM): tokens * (6N + 12 * L * H * Q * T); tokens = 32 * 128 */
    double tokens = 32 * 128;
    assert_float_equal(p.flops_per_step, tokens * (6 * (8 * (196608.0 + 393216) + 262144) + 12.0 * 8 * 256 * 128), 1);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* Expert parallelism: the rows the experts receive (runtime/model/moe.h) planned at the
 * balanced load, S = micro-batch tokens x top_k rows a MoE layer: each of the 2 MoE layers'
 * saved rows (an i32, the permuted input C and gate, up, product 3 I in the compute dtype) and
 * one layer's work rows (3 C + 3 I); the worst case at ep x S; in the total at the balanced load
 * only, and nothing of it at ep 1. */
static void test_memory_expert_rows(void **state)
{
    (void)state;
    static const char moe[] = "model:\n  model_type: mixtral\n  hidden_size: 64\n  num_hidden_layers: 2\n"
                              "  num_attention_heads: 4\n  num_key_value_heads: 2\n  intermediate_size: 128\n"
                              "  vocab_size: 256\n  num_local_experts: 4\n  num_experts_per_tok: 2\n"
                              "step_scheduler:\n  global_batch_size: 8\n  local_batch_size: 2\n";
    const char *sets[] = {"distributed.ep_size=2", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(moe, sets, 4, &p);
    double cs = am_dtype_size(r->compute_dtype), S = (double)p.microbatch_size * (double)p.seq_length * 2;
    double saved = 4 + (64 + 3 * 128) * cs, work = (3 * 64 + 3 * 128) * cs;
    assert_float_equal(p.mem.expert_rows, 2 * S * saved + S * work, 0);
    assert_float_equal(p.mem.expert_rows_worst, 2 * 2 * S * saved + 2 * S * work, 0);
    const struct am_memory *m = &p.mem;
    assert_float_equal(m->total, m->weights + m->grads + m->grad_buffers + m->optimizer + m->gathered +
                                     m->activations + m->scratch + m->kernel_scratch + m->p2p + m->alltoall +
                                     m->expert_rows, 0);
    am_plan_free(&p);
    am_recipe_free(r);
    r = plan_of(moe, NULL, 4, &p);
    assert_float_equal(p.mem.expert_rows, 0, 0);
    assert_float_equal(p.mem.expert_rows_worst, 0, 0);
    assert_float_equal(p.mem.alltoall, 0, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* fsdp2's gradient buffers with expert parallelism on 4 ranks (the Mixtral above: the
 * embedding 16384, each layer 12288 + 128 + the router 256 = 12672, the final norm with the
 * head 16448, each layer's 4 experts 4 * 3 * 64 * 128 = 98304, E / ep on a rank; dp_shard 4).
 * ep 4 = dp: the experts' groups are sharded over one rank (ep_shard 1) and, reduced in fp32,
 * accumulate in their shards (train/grad_sync.h): two buffers of the largest other group (the
 * head, 16448) with their receive shards over 4 ranks, in fp32; the recipe's bf16 parameters
 * (torch_dtype assumed bfloat16) keep bf16 shards, so those experts' fp32 gradients are staged
 * in one buffer of a layer's experts' span on the rank (one expert: 24576) with its bf16 copy
 * (6 B each), and float32 parameters need none. ep 2 (ep_shard 2): four
 * buffers of the experts' span (49152) with their receive shards over 2 ranks. A bf16
 * reduce_dtype keeps the ep 4 experts in buffers too: four of their span (fp32 and bf16) with
 * bf16 receive shards of all of it. */
static void test_memory_grad_buffers_ep(void **state)
{
    (void)state;
    static const char moe[] = "model:\n  model_type: mixtral\n  hidden_size: 64\n  num_hidden_layers: 2\n"
                              "  num_attention_heads: 4\n  num_key_value_heads: 2\n  intermediate_size: 128\n"
                              "  vocab_size: 256\n  num_local_experts: 4\n  num_experts_per_tok: 2\n"
                              "step_scheduler:\n  global_batch_size: 8\n  local_batch_size: 2\n";
    const char *ep4[] = {"distributed.ep_size=4", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(moe, ep4, 4, &p);
    assert_int_equal(p.ep_shard, 1);
    assert_int_equal(p.zero_stage, 3);
    assert_float_equal(p.mem.grad_buffers, 2 * 4 * 16448.0 + 2 * 4 * 16448.0 / 4 + 6 * 24576.0, 0);
    am_plan_free(&p);
    am_recipe_free(r);
    const char *ep4_f32[] = {"distributed.ep_size=4", "model.torch_dtype=float32", NULL};
    r = plan_of(moe, ep4_f32, 4, &p);
    assert_float_equal(p.mem.grad_buffers, 2 * 4 * 16448.0 + 2 * 4 * 16448.0 / 4, 0);
    am_plan_free(&p);
    am_recipe_free(r);
    const char *ep2[] = {"distributed.ep_size=2", NULL};
    r = plan_of(moe, ep2, 4, &p);
    assert_int_equal(p.ep_shard, 2);
    assert_float_equal(p.mem.grad_buffers, 4 * 4 * 49152.0 + 4 * 4 * 49152.0 / 2, 0);
    am_plan_free(&p);
    am_recipe_free(r);
    const char *ep4_bf16[] = {"distributed.ep_size=4", "distributed.mp_policy.param_dtype=bfloat16",
                              "distributed.mp_policy.reduce_dtype=bfloat16", NULL};
    r = plan_of(moe, ep4_bf16, 4, &p);
    assert_float_equal(p.mem.grad_buffers, 4 * 6 * 24576.0 + 4 * 2 * 24576.0, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* fsdp2 with bf16 parameters (model.torch_dtype bfloat16; under FusedAdam with fp32 master
 * weights too) keeps the gradient shards in bf16, as FSDP2 keeps a sharded gradient in the
 * parameter's dtype (train/grad_sync.h): model8 over dp 4, 2 B a parameter of the shard
 * instead of 4, the buffers as before (no group accumulates in its shard: no staging); with
 * HSDP too (each backward's shard all-reduced over the replicas before it is rounded), where
 * a bf16 reduction then needs no copy of the shards. megatron_fsdp (fp32 main gradients) and
 * float32 parameters keep fp32 shards, and HSDP's fp32 shards with a bf16 reduction their bf16
 * copy (2 B). */
static void test_memory_grad_shards_bf16(void **state)
{
    (void)state;
    double params = 5247232, layer = 590336;
    struct {
        const char *sets[4];
        double grad_bytes;
    } cases[] = {
        {{"model.torch_dtype=bfloat16", NULL}, 2},
        {{"model.torch_dtype=bfloat16", "optimizer._target_=transformer_engine.pytorch.optimizers.FusedAdam",
          "optimizer.master_weights=true", NULL},
         2},
        {{NULL}, 4},
        {{"model.torch_dtype=bfloat16", "distributed.strategy=megatron_fsdp", "distributed.zero_dp_strategy=3", NULL},
         4},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        struct am_plan p;
        struct am_recipe *r = plan_of(model8, cases[c].sets, 4, &p);
        assert_int_equal(p.zero_stage, 3);
        assert_float_equal(p.mem.grads, cases[c].grad_bytes * params / 4, 0);
        assert_float_equal(p.mem.grad_buffers, 2 * 4 * layer + 2 * 4 * layer / 4, 0);
        am_plan_free(&p);
        am_recipe_free(r);
    }
    struct {
        const char *sets[4];
        double grad_bytes;
    } hsdp[] = {
        {{"model.torch_dtype=bfloat16", "distributed.dp_replicate_size=2", NULL}, 2},
        {{"model.torch_dtype=bfloat16", "distributed.dp_replicate_size=2", "distributed.mp_policy.reduce_dtype=bfloat16",
          NULL},
         2},
        {{"distributed.dp_replicate_size=2", "distributed.mp_policy.reduce_dtype=bfloat16", NULL}, 4 + 2},
    };
    for (size_t c = 0; c < sizeof hsdp / sizeof *hsdp; c++) {
        struct am_plan p;
        struct am_recipe *r = plan_of(model8, hsdp[c].sets, 4, &p);
        assert_int_equal(p.dp_shard, 2);
        assert_float_equal(p.mem.grads, hsdp[c].grad_bytes * params / 2, 0);
        am_plan_free(&p);
        am_recipe_free(r);
    }
}

/* Qwen3-MoE's dense layers by hand: 4 layers, hidden 64, heads 4 x head_dim 16 (kv 2),
 * 8 experts of 32, top 2, intermediate 128 for the dense MLP; decoder_sparse_step 2 makes
 * layers 0 and 2 dense ((l + 1) % 2 != 0), mlp_only_layers [3] makes layer 3 dense too:
 * only layer 1 has experts.
 *   attention per layer: q 64*64 + k,v 2*64*32 + o 64*64 + q/k norms 2*16 = 12320; norms 128
 *   MoE layer: router 8*64 = 512, experts 8 * 3*64*32 = 49152; dense layer: 3*64*128 = 24576
 *   total: embedding 256*64 = 16384 twice (untied) + final norm 64
 *          + 4 * (12320 + 128) + 512 + 49152 + 3 * 24576 */
static void test_param_count_moe_dense_layers(void **state)
{
    (void)state;
    static const char moe[] = "model:\n  model_type: qwen3_moe\n  hidden_size: 64\n  num_hidden_layers: 4\n"
                              "  num_attention_heads: 4\n  num_key_value_heads: 2\n  head_dim: 16\n"
                              "  intermediate_size: 128\n  moe_intermediate_size: 32\n  vocab_size: 256\n"
                              "  num_experts: 8\n  num_experts_per_tok: 2\n  decoder_sparse_step: 2\n"
                              "  mlp_only_layers: [3]\n  torch_dtype: float32\n"
                              "step_scheduler:\n  global_batch_size: 8\n  local_batch_size: 2\n";
    struct am_plan p;
    struct am_recipe *r = plan_of(moe, NULL, 1, &p);
    for (long l = 0; l < 4; l++)
        assert_int_equal(am_model_layer_is_moe(&r->model, l), l == 1);
    assert_int_equal(am_model_moe_layers(&r->model), 1);
    double total = 2 * 16384.0 + 64 + 4 * (12320.0 + 128) + 512 + 49152 + 3 * 24576;
    assert_float_equal(p.params.total, total, 0);
    /* active per token: attention (without the q/k norms) of 4 layers, the router and 2 of 8
     * experts on layer 1, the dense MLP on the other 3, the head */
    double active = 4 * 12288.0 + 512 + 2 * 3 * 64 * 32 + 3 * 24576 + 16384;
    assert_float_equal(p.params.active_per_token, active, 1e-6);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* Adam under ddp (fp32 compute: ddp computes in the model's dtype, model8's float32): 16 bytes
 * per parameter (ZeRO's accounting: fp32 weights 4 + gradients 4 + two moments 8). */
static void test_memory_ddp_16_bytes_per_parameter(void **state)
{
    (void)state;
    const char *sets[] = {"distributed.strategy=ddp", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, sets, 4, &p);
    double params = 5247232;
    assert_float_equal(p.mem.params, params, 0);
    assert_float_equal(p.mem.weights + p.mem.grads + p.mem.optimizer, 16 * params, 0);
    assert_float_equal(p.mem.gathered, 0, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* fsdp2 shards over the dp 4 ranks (ZeRO-3, train/fsdp.h): each group of model8 (the embedding
 * 262144, each layer 590336, the final norm with the head 262400 elements) divides by 4, so
 * each rank's shard is a quarter of the parameters, no padding. Its default mixed precision
 * (bf16 compute, fp32 reduction): the master shard and its bf16 copy (6 B / 4), Adam's moments
 * of the shard (8 B / 4), the reduced fp32 gradient shard (4 B / 4); two layers gathered in
 * bf16; two gradient buffers of the largest group (a layer: fp32, 4 B each) with their
 * receive shards (4 B / 4). A bf16 reduce_dtype adds each buffer's bf16 copy (2 B) and
 * receives in bf16 (2 B / 4). */
static void test_memory_fsdp_shards(void **state)
{
    (void)state;
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, NULL, 4, &p);
    double params = 5247232, layer = 590336;
    assert_int_equal(p.dp_shard, 4);
    assert_int_equal(p.zero_stage, 3);
    assert_float_equal(p.mem.params, params, 0);
    assert_float_equal(p.mem.weights, 6 * params / 4, 0);
    assert_float_equal(p.mem.grads, 4 * params / 4, 0);
    assert_float_equal(p.mem.grad_buffers, 2 * 4 * layer + 2 * 4 * layer / 4, 0);
    assert_float_equal(p.mem.optimizer, 8 * params / 4, 0);
    assert_float_equal(p.mem.gathered, 2 * 2 * layer, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    const char *reduce_bf16[] = {"distributed.mp_policy.param_dtype=bfloat16",
                                 "distributed.mp_policy.reduce_dtype=bfloat16", NULL};
    r = plan_of(model8, reduce_bf16, 4, &p);
    assert_float_equal(p.mem.grads, 4 * params / 4, 0);
    assert_float_equal(p.mem.grad_buffers, 2 * 6 * layer + 2 * 2 * layer / 4, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* reshard_after_forward false: a gathered buffer for each of the 10 groups */
    const char *keep[] = {"distributed.reshard_after_forward=false", NULL};
    r = plan_of(model8, keep, 4, &p);
    assert_float_equal(p.mem.gathered, 10 * 2 * layer, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* dp 3 does not divide the groups: each padded to a multiple of 3 */
    const char *dp3[] = {"step_scheduler.global_batch_size=36", NULL};
    r = plan_of(model8, dp3, 3, &p);
    double shard = (262144.0 + 2) / 3 + 8 * (590336.0 + 1) / 3 + (262400.0 + 1) / 3;
    assert_int_equal(p.zero_stage, 3);
    assert_float_equal(p.mem.optimizer, 8 * shard, 0);
    assert_float_equal(p.mem.grads, 4 * shard, 0);
    assert_float_equal(p.mem.grad_buffers, 2 * 4 * (layer + 1) + 2 * 4 * (layer + 1) / 3, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* one data-parallel rank: nothing to shard; HSDP (dp_replicate 2 x dp_shard 2) shards in halves */
    r = plan_of(model8, NULL, 1, &p);
    assert_int_equal(p.zero_stage, 0);
    assert_float_equal(p.mem.weights + p.mem.grads + p.mem.optimizer, 18 * params, 1e-6);
    am_plan_free(&p);
    am_recipe_free(r);
    const char *hsdp[] = {"distributed.dp_replicate_size=2", NULL};
    r = plan_of(model8, hsdp, 4, &p);
    assert_int_equal(p.zero_stage, 3);
    assert_float_equal(p.mem.optimizer, 8 * params / 2, 0);
    assert_float_equal(p.mem.grads, 4 * params / 2, 0);
    assert_float_equal(p.mem.gathered, 2 * 2 * layer, 0);
    am_plan_free(&p);
    am_recipe_free(r);
    const char *replicas[] = {"distributed.dp_replicate_size=4", NULL}; /* dp_shard 1: replicas only */
    r = plan_of(model8, replicas, 4, &p);
    assert_int_equal(p.zero_stage, 0);
    assert_float_equal(p.mem.gathered, 0, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* ddp keeps a full replica on each of the dp 4 ranks (ZeRO stage 0), so nothing is gathered. With
 * fp32 masters (model.torch_dtype float32) and bf16 compute the weights' bf16 copy adds to the
 * 16 bytes: 18 B per parameter; model.torch_dtype bfloat16 keeps bf16 masters (no copy) and bf16
 * moments beside fp32 gradients: 2 + 4 + 4 = 10 B; a bf16 reduce_dtype adds the gradients' bf16
 * copy (20 B); fp32 compute leaves 16 B. */
static void test_memory_full_replicas(void **state)
{
    (void)state;
    struct am_plan p;
    const char *ddp[] = {"distributed.strategy=ddp", "distributed.mp_policy.param_dtype=bfloat16",
                         "distributed.mp_policy.reduce_dtype=float32", NULL};
    struct am_recipe *r = plan_of(model8, ddp, 4, &p);
    double params = 5247232;
    assert_int_equal(p.dp_shard, 4);
    assert_int_equal(p.zero_stage, 0);
    assert_float_equal(p.mem.weights, 6 * params, 1e-6);
    assert_float_equal(p.mem.grads, 4 * params, 1e-6);
    assert_float_equal(p.mem.optimizer, 8 * params, 1e-6);
    assert_float_equal(p.mem.gathered, 0, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    const char *bf16[] = {"distributed.strategy=ddp", "distributed.mp_policy.param_dtype=bfloat16",
                          "distributed.mp_policy.reduce_dtype=float32", "model.torch_dtype=bfloat16", NULL};
    r = plan_of(model8, bf16, 4, &p);
    assert_float_equal(p.mem.weights, 2 * params, 1e-6); /* the bf16 masters are the compute weights */
    assert_float_equal(p.mem.grads, 4 * params, 1e-6);
    assert_float_equal(p.mem.optimizer, 4 * params, 1e-6);
    am_plan_free(&p);
    am_recipe_free(r);

    const char *reduce_bf16[] = {"distributed.strategy=ddp", "distributed.mp_policy.param_dtype=bfloat16",
                                 "distributed.mp_policy.reduce_dtype=bfloat16", NULL};
    r = plan_of(model8, reduce_bf16, 4, &p);
    assert_float_equal(p.mem.grads, 6 * params, 1e-6);
    am_plan_free(&p);
    am_recipe_free(r);
    r = plan_of(model8, reduce_bf16, 1, &p); /* one data-parallel rank: nothing reduced, no copy */
    assert_float_equal(p.mem.grads, 4 * params, 1e-6);
    am_plan_free(&p);
    am_recipe_free(r);

    const char *fp32[] = {"distributed.strategy=ddp", "distributed.mp_policy.param_dtype=float32", NULL};
    r = plan_of(model8, fp32, 4, &p);
    assert_float_equal(p.mem.weights + p.mem.grads + p.mem.optimizer, 16 * params, 1e-6);
    am_plan_free(&p);
    am_recipe_free(r);

    /* one rank: megatron_fsdp has nothing to shard */
    const char *one[] = {"distributed.strategy=megatron_fsdp", NULL};
    r = plan_of(model8, one, 1, &p);
    assert_int_equal(p.zero_stage, 0);
    assert_float_equal(p.mem.gathered, 0, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* megatron_fsdp's zero_dp_strategy over the dp 4 ranks (bf16 compute, bf16 reduction here):
 * stage 3 as fsdp2; stages 2 and 1 keep the full masters and their bf16 copy (6 B) beside the
 * master shard (4 B / 4) and Adam's moments of the shard (8 B / 4); from stage 2 the
 * gradient shard (4 B / 4) and two gradient buffers of a layer (fp32 and bf16, 6 B each, and
 * a bf16 receive shard, 2 B / 4); stage 1 the gradients' full-size accumulation and its bf16
 * copy (6 B) and the shard copied from the all-reduced gradients (4 B / 4). */
static void test_memory_megatron_zero_stages(void **state)
{
    (void)state;
    struct am_plan p;
    double params = 5247232, layer = 590336;
    for (int stage = 1; stage <= 3; stage++) {
        char z[64];
        snprintf(z, sizeof(z), "distributed.zero_dp_strategy=%d", stage);
        const char *sets[] = {"distributed.strategy=megatron_fsdp", "distributed.mp_policy.param_dtype=bfloat16",
                              "distributed.mp_policy.reduce_dtype=bfloat16", z, NULL};
        struct am_recipe *r = plan_of(model8, sets, 4, &p);
        assert_int_equal(p.zero_stage, stage);
        assert_float_equal(p.mem.optimizer, 8 * params / 4, 0);
        assert_float_equal(p.mem.weights, stage == 3 ? 6 * params / 4 : 6 * params + 4 * params / 4, 0);
        assert_float_equal(p.mem.grads, stage >= 2 ? 4 * params / 4 : 6 * params + 4 * params / 4, 0);
        assert_float_equal(p.mem.grad_buffers, stage >= 2 ? 2 * 6 * layer + 2 * 2 * layer / 4 : 0, 0);
        assert_float_equal(p.mem.gathered, stage == 3 ? 2 * 2 * layer : 0, 0);
        am_plan_free(&p);
        am_recipe_free(r);
    }
}

/* A sharded checkpoint's bytes (plan.h: am_plan_ckpt_cost): 12 B per parameter whose optimizer
 * state a writing rank keeps, 4 B per parameter of the Hugging Face export; model8 has 5247232
 * parameters, its groups divide evenly over 2 and 4 ranks. */
static void test_ckpt_cost(void **state)
{
    (void)state;
    double params = 5247232;
    struct am_plan p;
    struct am_ckpt_cost c;
    /* ddp on 4 ranks: data-parallel rank 0 alone writes the whole model */
    const char *ddp[] = {"distributed.strategy=ddp", NULL};
    struct am_recipe *r = plan_of(model8, ddp, 4, &p);
    struct am_world w = {.size = 4, .nodes = 1, .gpus_per_node = 4};
    am_plan_ckpt_cost(r, &w, &p, &c);
    assert_int_equal(c.writers, 1);
    assert_float_equal(c.rank_bytes, 12 * params, 0);
    assert_float_equal(c.node_bytes, 12 * params, 0);
    assert_float_equal(c.hf_bytes, 4 * params, 0); /* save_consolidated: true by default */
    assert_float_equal(c.bytes, 16 * params, 0);
    /* 12 + 4 bytes a parameter at 1 GiB/s per node */
    assert_float_equal(am_plan_save_s(&c, 1024.0 * 1024 * 1024), 16 * params / (1024.0 * 1024 * 1024), 1e-12);
    am_plan_free(&p);
    am_recipe_free(r);
    /* save_consolidated: final: no save but the last writes the export (never one on Slurm's warning) */
    const char *final[] = {"distributed.strategy=ddp", "checkpoint.save_consolidated=final", NULL};
    r = plan_of(model8, final, 4, &p);
    am_plan_ckpt_cost(r, &w, &p, &c);
    assert_float_equal(c.hf_bytes, 0, 0);
    assert_float_equal(c.bytes, 12 * params, 0);
    am_plan_free(&p);
    am_recipe_free(r);
    /* megatron_fsdp ZeRO 1 on 4 ranks: each writes a quarter; on 2 nodes of 2, a node writes half */
    const char *z1[] = {"distributed.strategy=megatron_fsdp", "distributed.zero_dp_strategy=1",
                        "checkpoint.save_consolidated=false", NULL};
    r = plan_of(model8, z1, 4, &p);
    am_plan_ckpt_cost(r, &w, &p, &c);
    assert_int_equal(c.writers, 4);
    assert_float_equal(c.rank_bytes, 3 * params, 0);
    assert_float_equal(c.node_bytes, 12 * params, 0);
    assert_float_equal(c.hf_bytes, 0, 0);
    assert_float_equal(c.bytes, 12 * params, 0);
    struct am_world w2 = {.size = 4, .nodes = 2, .gpus_per_node = 2};
    am_plan_ckpt_cost(r, &w2, &p, &c);
    assert_float_equal(c.node_bytes, 6 * params, 0);
    assert_float_equal(am_plan_save_s(&c, 6 * params), 1, 1e-12);
    am_plan_free(&p);
    am_recipe_free(r);
    /* HSDP, 2 replicas of 2 shards: the first replica group writes (ranks 0 and 1) */
    const char *hsdp[] = {"distributed.dp_replicate_size=2", "checkpoint.save_consolidated=false", NULL};
    r = plan_of(model8, hsdp, 4, &p);
    am_plan_ckpt_cost(r, &w2, &p, &c);
    assert_int_equal(c.writers, 2);
    assert_float_equal(c.rank_bytes, 6 * params, 0);
    assert_float_equal(c.node_bytes, 12 * params, 0); /* both on node 0 */
    assert_float_equal(c.bytes, 12 * params, 0);
    am_plan_free(&p);
    am_recipe_free(r);
    /* pp 2 x tp 2 (fsdp2 at dp 1: nothing sharded): every rank writes its stage's tp slice */
    const char *pp[] = {"distributed.pp_size=2", "distributed.tp_size=2", NULL};
    r = plan_of(model8, pp, 4, &p);
    assert_int_equal(p.zero_stage, 0);
    am_plan_ckpt_cost(r, &w, &p, &c);
    assert_int_equal(c.writers, 4);
    assert_float_equal(c.rank_bytes, 1.5 * (p.mem_pp[0].optimizer > p.mem_pp[1].optimizer ? p.mem_pp[0].optimizer
                                                                                            : p.mem_pp[1].optimizer), 0);
    /* each tp rank holds its slices and a copy of the norms (8 layers' 2 x 256, the final 256) */
    assert_float_equal(c.bytes - c.hf_bytes, 12 * (params + 17 * 256), 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* The lead of --signal: ceil(1.5 x (step + save)), at least 60 s; an unknown step (< 0) counts 0. */
static void test_signal_lead(void **state)
{
    (void)state;
    assert_int_equal(am_plan_lead_s(-1, 10), 60);
    assert_int_equal(am_plan_lead_s(-1, 50), 75);
    assert_int_equal(am_plan_lead_s(2.5, 41.5), 66);
    assert_int_equal(am_plan_lead_s(10, 50.1), 91);
    assert_int_equal(am_plan_lead_s(0.1, 0.1), 60);
    assert_int_equal(am_plan_lead_s(-1, 0), 60);
}

/* Activations of model8 per token and layer, in elements (docs/recipes.md):
 *   4h (norm inputs/outputs) + 2 (their inverse rms) + 2q (attention in/out) + 2kv + 8 (the
 *   log-sum-exp of 8 heads) + 3I = 1024 + 2 + 512 + 256 + 8 + 1536 = 3338
 * ddp with fp32 compute, local batch 4 x 128 tokens, 8 layers: 3338 * 512 * 4 B * 8 */
static void test_memory_activations(void **state)
{
    (void)state;
    const char *sets[] = {"distributed.strategy=ddp", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, sets, 1, &p);
    double layer = 3338.0 * 512 * 4;
    assert_float_equal(p.mem.activations, 8 * layer, 0);
    /* the model's scratch (N = R = 512 tokens, h 256, head_dim 32, q 256, kv 128, I 512, fp32):
     * the first stage's token ids 4N; the last stage's targets 4N, final norm input and output
     * 2 * 4Nh, inverse rms 4N, loss max and sum 8N; the stream and its gradient 2 * 4Nh, the
     * head's input gradient 4Nh, the rotary tables 2 * 128 * 16 * 4, the target logits 4N; the
     * work buffers 4N(h + 2q + 2kv + 3I) */
    double N = 512, h = 256;
    double scratch = 4 * N + (4 * N + 2 * 4 * N * h + 4 * N + 8 * N) + (3 * 4 * N * h + 2 * 128 * 16 * 4 + 4 * N) +
                     4 * N * (h + 2 * 256 + 2 * 128 + 3 * 512);
    assert_float_equal(p.mem.scratch, scratch, 0);
    /* the CUDA kernels' scratch: the cross-entropy's fp32 logits tile of the 512 rows by the
     * 1024 ids (test_memory_kernel_scratch) */
    double kernels = 4.0 * 512 * 1024;
    assert_float_equal(p.mem.kernel_scratch, kernels, 0);
    assert_float_equal(p.mem.total,
                       p.mem.weights + p.mem.grads + p.mem.optimizer + p.mem.activations + scratch + kernels, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* checkpointing: each layer keeps its input (h per token), plus one layer's others recomputed */
    const char *ckpt[] = {"distributed.strategy=ddp", "distributed.activation_checkpointing=true", NULL};
    r = plan_of(model8, ckpt, 1, &p);
    assert_float_equal(p.mem.activations, 7 * 256.0 * 512 * 4 + layer, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* tp 2 with sequence parallel: every term divided by 2 (kv 4 heads / 2) */
    const char *sp[] = {"distributed.tp_size=2", "distributed.sequence_parallel=true",
                        "distributed.mp_policy.param_dtype=float32", NULL};
    r = plan_of(model8, sp, 2, &p);
    assert_float_equal(p.mem.activations, 8 * (3338.0 / 2) * 512 * 4, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* Each layer's saved tensors are its kind's (runtime/model/model.c, carve_layer): the MLP's
 * gate, up and product at intermediate_size in a dense layer, nothing in a MoE layer without
 * shared experts, so intermediate_size counts 3 x (intermediate_size / tp) per token once per
 * dense layer (and in the MLP's backward scratch); with activation checkpointing once, in the
 * recomputed layer (the widest of the rank's); a model of MoE layers alone does not count it.
 * Multi-head latent attention keeps v and the output at v_head_dim (head_dim is
 * max(qk_nope + qk_rope, v_head_dim)): 2 x heads x v_head_dim per token and layer. */
static void test_memory_activations_by_layer_kind(void **state)
{
    (void)state;
    /* layers 0, 2, 3 dense, 1 MoE (test_param_count_moe_dense_layers); 2 x 64 tokens, ddp (fp32) */
    char yaml[1024];
    const char *fmt = "model:\n  model_type: qwen3_moe\n  hidden_size: 64\n  num_hidden_layers: 4\n"
                      "  num_attention_heads: 4\n  num_key_value_heads: 2\n  head_dim: 16\n"
                      "  intermediate_size: %d\n  moe_intermediate_size: 32\n  vocab_size: 256\n"
                      "  num_experts: 8\n  num_experts_per_tok: 2\n  %s\n  torch_dtype: float32\n"
                      "step_scheduler:\n  global_batch_size: 2\n  local_batch_size: 2\n"
                      "dataset:\n  seq_length: 64\n";
    const char *ddp[] = {"distributed.strategy=ddp", NULL};
    const char *ddp_ac[] = {"distributed.strategy=ddp", "distributed.activation_checkpointing=true", NULL};
    const char *const *sets[] = {ddp, ddp_ac};
    for (int ac = 0; ac < 2; ac++) {
        double act[2], scratch[2], cs = 0;
        for (int i = 0; i < 2; i++) {
            struct am_plan p;
            snprintf(yaml, sizeof(yaml), fmt, i ? 256 : 128, "decoder_sparse_step: 2\n  mlp_only_layers: [3]");
            struct am_recipe *r = plan_of(yaml, sets[ac], 1, &p);
            cs = am_dtype_size(r->compute_dtype);
            act[i] = p.mem.activations, scratch[i] = p.mem.scratch;
            am_plan_free(&p);
            am_recipe_free(r);
        }
        assert_float_equal(act[1] - act[0], (ac ? 1 : 3) * 128.0 * 3 * 128 * cs, 0);
        assert_float_equal(scratch[1] - scratch[0], 128.0 * 3 * 128 * cs, 0);
        for (int i = 0; i < 2; i++) { /* every layer MoE: intermediate_size is no tensor's */
            struct am_plan p;
            snprintf(yaml, sizeof(yaml), fmt, i ? 256 : 128, "decoder_sparse_step: 1");
            struct am_recipe *r = plan_of(yaml, sets[ac], 1, &p);
            act[i] = p.mem.activations, scratch[i] = p.mem.scratch;
            am_plan_free(&p);
            am_recipe_free(r);
        }
        assert_float_equal(act[1], act[0], 0);
        assert_float_equal(scratch[1], scratch[0], 0);
    }
    /* deepseek_v3, 2 layers (layer 0 dense), q and k 8 + 8 = 16 a head: v_head_dim 8 against 12 */
    const char *mla = "model:\n  model_type: deepseek_v3\n  hidden_size: 64\n  num_hidden_layers: 2\n"
                      "  num_attention_heads: 4\n  num_key_value_heads: 4\n  intermediate_size: 128\n"
                      "  q_lora_rank: 24\n  kv_lora_rank: 16\n  qk_nope_head_dim: 8\n  qk_rope_head_dim: 8\n"
                      "  v_head_dim: %d\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n  n_group: 4\n"
                      "  topk_group: 2\n  moe_intermediate_size: 32\n  n_shared_experts: 2\n"
                      "  first_k_dense_replace: 1\n  norm_topk_prob: true\n  vocab_size: 256\n  torch_dtype: float32\n"
                      "step_scheduler:\n  global_batch_size: 2\n  local_batch_size: 2\n"
                      "dataset:\n  seq_length: 64\n";
    double act[2], cs = 0;
    for (int i = 0; i < 2; i++) {
        struct am_plan p;
        snprintf(yaml, sizeof(yaml), mla, i ? 12 : 8);
        struct am_recipe *r = plan_of(yaml, ddp, 1, &p);
        assert_int_equal(r->model.head_dim, 16);
        cs = am_dtype_size(r->compute_dtype);
        act[i] = p.mem.activations;
        am_plan_free(&p);
        am_recipe_free(r);
    }
    assert_float_equal(act[1] - act[0], 2 * 128.0 * 2 * 4 * 4 * cs, 0);
}

/* The scratch of a deepseek_v3 of 4 heads, q and k 8 + 8 = 16 a head, v_head_dim vd, on cp ranks
 * of a local batch of cp sequences of 64 (N = 64 tokens a rank at any cp); dtype the compute's. */
static double mla_scratch(int vd, int cp, const char *dtype)
{
    char yaml[1024], cps[64], dts[96];
    snprintf(yaml, sizeof(yaml),
             "model:\n  model_type: deepseek_v3\n  hidden_size: 64\n  num_hidden_layers: 2\n"
             "  num_attention_heads: 4\n  num_key_value_heads: 4\n  intermediate_size: 128\n"
             "  q_lora_rank: 24\n  kv_lora_rank: 16\n  qk_nope_head_dim: 8\n  qk_rope_head_dim: 8\n"
             "  v_head_dim: %d\n  n_routed_experts: 8\n  num_experts_per_tok: 2\n  n_group: 4\n"
             "  topk_group: 2\n  moe_intermediate_size: 32\n  n_shared_experts: 2\n"
             "  first_k_dense_replace: 1\n  norm_topk_prob: true\n  vocab_size: 256\n  torch_dtype: float32\n"
             "step_scheduler:\n  global_batch_size: %d\n  local_batch_size: %d\n"
             "dataset:\n  seq_length: 64\n",
             vd, cp, cp);
    snprintf(cps, sizeof(cps), "distributed.cp_size=%d", cp);
    snprintf(dts, sizeof(dts), "distributed.mp_policy.param_dtype=%s", dtype);
    const char *sets[] = {cps, dts, NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(yaml, sets, cp, &p);
    assert_int_equal(p.cp, cp);
    double s = p.mem.scratch;
    am_plan_free(&p);
    am_recipe_free(r);
    return s;
}

/* Context parallelism's ring buffers (runtime/model/ring.h) at k's and v's own widths: with
 * multi-head latent attention k and the dk sums kv heads x (qk_nope + qk_rope), v and the dv
 * sums kv heads x v_head_dim, the bf16 running out / dq sum heads x the wider of the two. The
 * ring's bytes are cp 2's scratch less cp 1's at the same N = 64 tokens; v_head_dim moves v's
 * buffers alone (2 blocks of the compute dtype, 3 fp32 sums: 4 heads x dv x N each) while it
 * stays within q's and k's 16 (head_dim 16 throughout), the running out with it beyond. */
static void test_memory_ring_mla(void **state)
{
    (void)state;
    double N = 64, H = 4;
    const char *dts[] = {"float32", "bfloat16"};
    for (int i = 0; i < 2; i++) {
        double cs = i ? 2 : 4, ring[3];
        int vds[] = {8, 12, 24};
        for (int j = 0; j < 3; j++)
            ring[j] = mla_scratch(vds[j], 2, dts[i]) - mla_scratch(vds[j], 1, dts[i]);
        /* v_head_dim 8 to 12: 4 more elements a head in v's 2 blocks and 3 sums */
        assert_float_equal(ring[1] - ring[0], N * H * 4 * (2 * cs + 3 * 4), 0);
        /* 12 to 24: v's 12 more, and in bf16 the fp32 running out 24 wide a head, not q's 16 */
        assert_float_equal(ring[2] - ring[1], N * H * 12 * (2 * cs + 3 * 4) + (i ? N * H * 8 * 4 : 0), 0);
    }
}

/* The CUDA kernels' scratch (kernels/cuda/cuda_impl.h, plan.c): the largest of the head's
 * cross-entropy tiles (crossentropy.cu) and the attention backward's buffers, each piece 256-byte
 * aligned. bf16 compute, tp 2, 64 sequences of 128: N = 8192 tokens a micro-batch, 4 query and
 * 2 kv heads a rank, C = 256. The cross-entropy takes row chunks of min(N, 4096, 2^24 / C) =
 * 4096 and vocabulary tiles of min(V / tp, 2^24 / 4096 = 4096): the fp32 logits tile, the
 * bf16 dlogits tile and the fp32 dx tile [4096, C]. cuDNN's attention backward (head size 64):
 * the fp32 row sums 4NH, the fp32 dQ accumulator 4NHD, bf16 dq 2NHD, dk and dv 2 x 2N KV D. */
static void test_memory_kernel_scratch(void **state)
{
    (void)state;
    double N = 8192, rows = 4096;
    double attn64 = 4 * N * 4 + 4 * N * 4 * 64 + 2 * N * 4 * 64 + 2 * (2 * N * 2 * 64);
    const char *base[] = {"distributed.tp_size=2", "distributed.mp_policy.param_dtype=bfloat16",
                          "step_scheduler.local_batch_size=64", "step_scheduler.global_batch_size=64",
                          "model.head_dim=64", "model.vocab_size=131072", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, base, 2, &p);
    assert_int_equal(p.microbatch_size, 64);
    /* a vocabulary shard of 65536: tiles of 4096 ids, 100 MiB of tiles */
    assert_float_equal(p.mem.kernel_scratch, rows * 4096 * (4 + 2) + rows * 256 * 4, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* a vocabulary of 512 (256 a rank): 10 MiB of tiles, less than cuDNN's 16.1 MiB */
    const char *small_vocab[] = {"distributed.tp_size=2", "distributed.mp_policy.param_dtype=bfloat16",
                                 "step_scheduler.local_batch_size=64", "step_scheduler.global_batch_size=64",
                                 "model.head_dim=64", "model.vocab_size=512", NULL};
    r = plan_of(model8, small_vocab, 2, &p);
    assert_float_equal(p.mem.kernel_scratch, attn64, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* head size 32: no cuDNN, the own kernels' row sums alone; the tiles again */
    const char *own[] = {"distributed.tp_size=2", "distributed.mp_policy.param_dtype=bfloat16",
                         "step_scheduler.local_batch_size=64", "step_scheduler.global_batch_size=64",
                         "model.vocab_size=512", NULL};
    r = plan_of(model8, own, 2, &p);
    assert_float_equal(p.mem.kernel_scratch, rows * 256 * (4 + 2) + rows * 256 * 4, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* pp 2 (one sequence a micro-batch, N = 128): the first stage has no head, only the attention's
     * row sums (fp32, 4 x 128 x 8 heads); the last the logits tile of 128 rows x 1024 ids */
    const char *pp[] = {"distributed.pp_size=2", "distributed.mp_policy.param_dtype=float32", NULL};
    r = plan_of(model8, pp, 2, &p);
    assert_float_equal(p.mem_pp[0].kernel_scratch, 4.0 * 128 * 8, 0);
    assert_float_equal(p.mem_pp[1].kernel_scratch, 4.0 * 128 * 1024, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* Activations in flight are the peak of each rank's schedule (pp_schedule.h). 1F1B: pp rank k
 * holds min(pp - k, m) micro-batches; the first rank is the peak. GPipe holds all m. */
static void test_memory_pipeline_schedules(void **state)
{
    (void)state;
    /* pp 4, local batch 8 -> 8 micro-batches of 1 sequence (128 tokens), 2 layers per rank */
    const char *f1b[] = {"distributed.pp_size=4", "step_scheduler.local_batch_size=8",
                         "distributed.mp_policy.param_dtype=float32", NULL};
    struct am_plan p;
    struct am_recipe *r = plan_of(model8, f1b, 4, &p);
    double layer_mb = 3338.0 * 128 * 4;
    assert_int_equal(p.mem.pp_rank, 0);
    assert_float_equal(p.mem.activations, 4 * 2 * layer_mb, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    const char *gpipe[] = {"distributed.pp_size=4", "step_scheduler.local_batch_size=8",
                           "distributed.mp_policy.param_dtype=float32", "distributed.pipeline.pp_schedule=gpipe", NULL};
    r = plan_of(model8, gpipe, 4, &p);
    assert_float_equal(p.mem.activations, 8 * 2 * layer_mb, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* interleaved, v = 2 (default), pp 2, m = 8: rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4
     * forwards (micro-batches 0,1 on chunk 0, then on chunk 1), then alternates a forward and a
     * backward: chunk 0 holds at most 4 micro-batches (0-3 before the backward of 0 reaches
     * it), chunk 1 at most 2, and the executor keeps that many slots of each chunk's 2 layers:
     * 12 layer-micro-batches (the schedule's own peak, 5 chunks at once, would be 10) */
    const char *il[] = {"distributed.pp_size=2", "step_scheduler.local_batch_size=8",
                        "distributed.mp_policy.param_dtype=float32", "distributed.pipeline.pp_schedule=interleaved1f1b",
                        NULL};
    r = plan_of(model8, il, 2, &p);
    assert_int_equal(p.virtual_stages, 2);
    assert_int_equal(p.mem.pp_rank, 0);
    assert_float_equal(p.mem.activations, (4 + 2) * 2 * layer_mb, 0);
    am_plan_free(&p);
    am_recipe_free(r);

    /* interleaved with m = pp = 2: every forward is warm-up, so each rank holds all m * v = 4
     * chunks (8 layer-micro-batches) before its first backward. The activations tie, and the last
     * rank holds 256 more parameters (the final norm; the head and the embedding are both
     * 1024 x 256), so it is the peak. */
    const char *il_m2[] = {"distributed.pp_size=2", "step_scheduler.local_batch_size=2",
                           "distributed.mp_policy.param_dtype=float32",
                           "distributed.pipeline.pp_schedule=interleaved1f1b", NULL};
    r = plan_of(model8, il_m2, 2, &p);
    assert_int_equal(p.n_microbatches, 2);
    assert_int_equal(p.mem.pp_rank, 1);
    assert_float_equal(p.mem.activations, 4 * 2 * layer_mb, 0);
    am_plan_free(&p);
    am_recipe_free(r);
}

/* The planner simulates at most AM_PLAN_MAX_PIPE_PASSES forwards per rank: 131072
 * micro-batches of one sequence are too many. */
static void test_pipeline_schedule_too_long(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    const char *sets[] = {"distributed.pp_size=2", "step_scheduler.local_batch_size=131072",
                          "step_scheduler.global_batch_size=131072", NULL};
    struct am_recipe *r = parse_with("plan.yaml", model8, sets, &err);
    assert_non_null(r);
    struct am_world w = {.size = 2, .nodes = 1, .gpus_per_node = 2, .nvlink_domain = 2};
    struct am_plan p;
    assert_int_equal(am_plan_build(r, &w, &p, &err), -1);
    assert_messages(&err, (const char *const[]){
        "plan.yaml: the pipeline schedule runs 131072 forward passes per rank and step (micro-batches 131072 x "
        "virtual stages 1), more than the 65536 am can plan (use a larger distributed.pipeline.pp_microbatch_size "
        "or a smaller step_scheduler.local_batch_size)", NULL});
    am_plan_free(&p);
    am_recipe_free(r);
    am_errors_free(&err);
}

static void test_memory_over_budget_names_the_fix(void **state)
{
    (void)state;
    struct am_plan p;
    const char *sets[] = {"distributed.strategy=ddp", NULL};
    struct am_recipe *r = plan_of(model8, sets, 4, &p);
    /* 16 B * 5247232 = 80.1 MiB of state + 52.2 MiB of activations (3338 * 512 * 4 B * 8 layers)
     * + 7.5 MiB of scratch + 2.0 MiB of the kernels' (test_memory_activations) = 141.8 MiB; in
     * 110 MiB it fits with fsdp2 (sharded over the 4 ranks: 4/4 + 4/4 + 8/4 B = 20.0 MiB of
     * state, 4.5 MiB of two gathered layers, 5.6 MiB of two gradient buffers of a layer with
     * their receive shards, the same activations and scratch) and with checkpointing (80.1 + 3.5
     * saved + 6.5 recomputed + 7.5 + 2.0). Not tp and pp, which ddp does not run. */
    struct am_world w = {.size = 4, .nodes = 1, .gpus_per_node = 4, .nvlink_domain = 4, .gpu_mem = 110 << 20};
    struct am_errors err;
    am_errors_init(&err);
    assert_int_equal(am_plan_check_memory(r, &w, &p, &err), -1);
    assert_messages(&err, (const char *const[]){
        "plan.yaml: estimated memory per GPU 141.8 MiB exceeds the GPU's 110.0 MiB by 31.8 MiB; it fits with "
        "distributed.strategy=fsdp2 (91.8 MiB), distributed.activation_checkpointing=true (99.6 MiB)", NULL});
    am_errors_free(&err);
    am_plan_free(&p);
    am_recipe_free(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mesh_coordinates),
        cmocka_unit_test(test_groups),
        cmocka_unit_test(test_expert_groups),
        cmocka_unit_test(test_memory_expert_rows),
        cmocka_unit_test(test_memory_grad_buffers_ep),
        cmocka_unit_test(test_memory_grad_shards_bf16),
        cmocka_unit_test(test_interleaved_stages),
        cmocka_unit_test(test_interleaved_stages_uneven),
        cmocka_unit_test(test_param_count),
        cmocka_unit_test(test_param_count_moe_dense_layers),
        cmocka_unit_test(test_memory_ddp_16_bytes_per_parameter),
        cmocka_unit_test(test_memory_fsdp_shards),
        cmocka_unit_test(test_memory_full_replicas),
        cmocka_unit_test(test_memory_megatron_zero_stages),
        cmocka_unit_test(test_memory_activations), cmocka_unit_test(test_memory_activations_by_layer_kind),
        cmocka_unit_test(test_memory_ring_mla), cmocka_unit_test(test_memory_kernel_scratch),
        cmocka_unit_test(test_ckpt_cost),
        cmocka_unit_test(test_signal_lead),
        cmocka_unit_test(test_memory_pipeline_schedules),
        cmocka_unit_test(test_pipeline_schedule_too_long),
        cmocka_unit_test(test_memory_over_budget_names_the_fix),
    };
    return cmocka_run_group_tests_name("plan", tests, NULL, NULL);
}
