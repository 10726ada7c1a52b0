/* test_rules.c - every layout rule, accepted and rejected, with its exact message.
 *
 * Each case takes a small recipe (dense or MoE, below; line numbers matter for positions),
 * applies --set overrides, validates against a world, and expects exactly these messages.
 */
#include "testrecipe.h"

/* line numbers:   1 */
static const char dense[] = "model:\n"
                            "  hidden_size: 256\n"          /* 2 */
                            "  num_hidden_layers: 8\n"      /* 3 */
                            "  num_attention_heads: 8\n"    /* 4 */
                            "  num_key_value_heads: 4\n"    /* 5 */
                            "  intermediate_size: 512\n"    /* 6 */
                            "  vocab_size: 1024\n"          /* 7 */
                            "distributed:\n"                /* 8 */
                            "  strategy: fsdp2\n"           /* 9 */
                            "  dp_size: none\n"             /* 10 */
                            "  tp_size: 1\n"                /* 11 */
                            "  pp_size: 1\n"                /* 12 */
                            "  cp_size: 1\n"                /* 13 */
                            "  ep_size: 1\n"                /* 14 */
                            "step_scheduler:\n"             /* 15 */
                            "  global_batch_size: 32\n"     /* 16 */
                            "  local_batch_size: 4\n"       /* 17 */
                            "dataset:\n"                    /* 18 */
                            "  seq_length: 128\n";          /* 19 */

static const char moe[] = "model:\n"
                          "  model_type: mixtral\n"
                          "  hidden_size: 128\n"
                          "  num_hidden_layers: 4\n"
                          "  num_attention_heads: 4\n"
                          "  num_key_value_heads: 2\n"
                          "  intermediate_size: 256\n"
                          "  vocab_size: 512\n"
                          "  num_local_experts: 12\n"
                          "  num_experts_per_tok: 2\n"
                          "distributed:\n"               /* 11 */
                          "  ep_size: 2\n"               /* 12 */
                          "step_scheduler:\n"
                          "  global_batch_size: 16\n"
                          "  local_batch_size: 2\n";

struct rule_case {
    const char *name;
    const char *yaml;
    const char *sets[8];
    struct am_world world; /* size 0: validate without a world (what sbatch can check) */
    const char *want[6];
};

#define W(n_, nodes_, gpn_, dom_) {.size = (n_), .nodes = (nodes_), .gpus_per_node = (gpn_), .nvlink_domain = (dom_)}

static const struct rule_case cases[] = {
    /* valid layouts: no message */
    {"dense valid 8", dense, {NULL}, W(8, 1, 8, 8), {NULL}},
    {"dense tp2 pp2 dp2", dense, {"distributed.tp_size=2", "distributed.pp_size=2", NULL}, W(8, 1, 8, 8), {NULL}},
    {"dense interleaved", dense, {"distributed.pp_size=2", "distributed.pipeline.pp_schedule=interleaved1f1b",
                                  "distributed.pipeline.layers_per_stage=2", NULL}, W(4, 1, 4, 4), {NULL}},
    {"dense sp cp", dense, {"distributed.tp_size=2", "distributed.cp_size=2", "distributed.sequence_parallel=true",
                            NULL}, W(8, 1, 8, 8), {NULL}},
    {"kv replicated", dense, {"distributed.tp_size=8", NULL}, W(8, 1, 8, 8), {NULL}},
    {"moe valid", moe, {NULL}, W(4, 1, 4, 4), {NULL}},
    {"hsdp valid", dense, {"distributed.dp_replicate_size=2", NULL}, W(8, 1, 8, 8), {NULL}},
    {"no world", dense, {"distributed.tp_size=2", NULL}, {.size = 0}, {NULL}},

    /* dp inference and dp_size */
    {"dp not integral", dense, {"distributed.tp_size=8", NULL}, W(12, 1, 12, 12),
     {"base.yaml:10:12: distributed.dp_size: none is inferred as world size / (tp_size*pp_size*cp_size) = 12 / 8, "
      "not a whole number (use a world size that is a multiple of 8, or change tp_size, pp_size or cp_size)", NULL}},
    {"dp explicit mismatch", dense, {"distributed.dp_size=3", NULL}, W(8, 1, 8, 8),
     {"--set distributed.dp_size=3: distributed.dp_size: 3 * tp_size*pp_size*cp_size 1 = 3 ranks, but the job has "
      "8 (set dp_size: none to infer it, or use the value it infers)", NULL}},
    /* expert parallel */
    {"ep does not divide dp*cp", moe, {"distributed.ep_size=3", NULL}, W(4, 1, 4, 4),
     {"--set distributed.ep_size=3: distributed.ep_size: 3 does not divide dp_size*cp_size = 4 (use 1, 2 or 4)",
      NULL}},
    {"ep does not divide experts", moe, {"distributed.ep_size=8", NULL}, W(8, 1, 8, 8),
     {"--set distributed.ep_size=8: distributed.ep_size: 8 does not divide the model's 12 experts (use 1, 2, 3, 4, "
      "6 or 12)", NULL}},
    {"ep on a dense model", dense, {"distributed.ep_size=2", NULL}, W(8, 1, 8, 8),
     {"--set distributed.ep_size=2: distributed.ep_size: 2 needs a mixture-of-experts model; llama has no experts "
      "(use ep_size: 1)", NULL}},
    /* strategies */
    {"megatron_fsdp pp", dense, {"distributed.strategy=megatron_fsdp", "distributed.pp_size=2", NULL}, W(8, 1, 8, 8),
     {"--set distributed.pp_size=2: distributed.pp_size: megatron_fsdp does not support pipeline parallelism (use "
      "strategy: fsdp2, or pp_size: 1)", NULL}},
    {"megatron_fsdp ep", moe, {"distributed.strategy=megatron_fsdp", NULL}, W(4, 1, 4, 4),
     {"base.yaml:12:12: distributed.ep_size: megatron_fsdp does not support expert parallelism (use strategy: fsdp2, "
      "or ep_size: 1)", NULL}},
    {"megatron_fsdp sp", dense, {"distributed.strategy=megatron_fsdp", "distributed.sequence_parallel=true",
                                 "distributed.tp_size=2", NULL}, W(8, 1, 8, 8),
     {"--set distributed.sequence_parallel=true: distributed.sequence_parallel: megatron_fsdp does not support "
      "sequence_parallel (use strategy: fsdp2, or sequence_parallel: false)", NULL}},
    {"megatron_fsdp hsdp", dense, {"distributed.strategy=megatron_fsdp", "distributed.dp_replicate_size=2", NULL},
     W(8, 1, 8, 8),
     {"--set distributed.dp_replicate_size=2: distributed.dp_replicate_size: only fsdp2 supports HSDP; megatron_fsdp "
      "does not (use strategy: fsdp2, or remove dp_replicate_size)", NULL}},
    {"ddp tp", dense, {"distributed.strategy=ddp", "distributed.tp_size=2", NULL}, W(8, 1, 8, 8),
     {"--set distributed.tp_size=2: distributed.tp_size: ddp does not support tensor parallelism (use strategy: "
      "fsdp2, or tp_size: 1)", NULL}},
    {"ddp pp", dense, {"distributed.strategy=ddp", "distributed.pp_size=2", NULL}, W(8, 1, 8, 8),
     {"--set distributed.pp_size=2: distributed.pp_size: ddp does not support pipeline parallelism (use strategy: "
      "fsdp2, or pp_size: 1)", NULL}},
    {"ddp cp", dense, {"distributed.strategy=ddp", "distributed.cp_size=2", NULL}, W(8, 1, 8, 8),
     {"--set distributed.cp_size=2: distributed.cp_size: ddp does not support context parallelism (use strategy: "
      "fsdp2, or cp_size: 1)", NULL}},
    {"ddp ep", moe, {"distributed.strategy=ddp", NULL}, W(4, 1, 4, 4),
     {"base.yaml:12:12: distributed.ep_size: ddp does not support expert parallelism (use strategy: fsdp2, or "
      "ep_size: 1)", NULL}},
    {"ddp hsdp", dense, {"distributed.strategy=ddp", "distributed.dp_replicate_size=2", NULL}, W(8, 1, 8, 8),
     {"--set distributed.dp_replicate_size=2: distributed.dp_replicate_size: ddp does not support HSDP (use "
      "strategy: fsdp2, or remove dp_replicate_size)", NULL}},
    {"hsdp does not divide dp", dense, {"distributed.dp_replicate_size=3", NULL}, W(8, 1, 8, 8),
     {"--set distributed.dp_replicate_size=3: distributed.dp_replicate_size: 3 does not divide dp_size = 8 (use 1, "
      "2, 4 or 8)", NULL}},
    /* model shape against tp, pp */
    {"tp does not divide heads", dense, {"distributed.tp_size=3", NULL}, W(3, 1, 3, 3),
     {"--set distributed.tp_size=3: distributed.tp_size: 3 does not divide num_attention_heads = 8 (use 1, 2, 4 or 8)",
      "--set distributed.tp_size=3: distributed.tp_size: 3 does not divide vocab_size = 1024 (the vocabulary is "
      "split across tp ranks; use 1, 2, 4, 8, 16, 32 or 64)",
      "--set distributed.tp_size=3: distributed.tp_size: 3 does not divide intermediate_size = 512 (the MLP is "
      "split across tp ranks; use 1, 2, 4, 8, 16, 32 or 64)", NULL}},
    {"tp against kv heads", dense, {"model.num_attention_heads=12", "model.head_dim=32", "model.vocab_size=1536",
                                    "model.intermediate_size=768", "distributed.tp_size=6", NULL}, W(6, 1, 6, 6),
     {"--set distributed.tp_size=6: distributed.tp_size: 6 is neither a divisor nor a multiple of "
      "num_key_value_heads = 4 (each tp rank holds whole kv heads, or one replicated kv head)", NULL}},
    {"pp does not divide layers", dense, {"distributed.pp_size=3", NULL}, W(6, 1, 6, 6),
     {"--set distributed.pp_size=3: distributed.pp_size: 3 does not divide num_hidden_layers = 8 (use 1, 2, 4 or 8)",
      NULL}},
    {"1f1b with layers_per_stage", dense, {"distributed.pp_size=2", "distributed.pipeline.layers_per_stage=2", NULL},
     W(2, 1, 2, 2),
     {"--set distributed.pipeline.layers_per_stage=2: distributed.pipeline.layers_per_stage: 2 makes 4 stages for "
      "pp_size = 2, but 1f1b runs one stage per rank (use interleaved1f1b, or layers_per_stage: 4)", NULL}},
    {"interleaved stages not a multiple of pp", dense,
     {"distributed.pp_size=4", "distributed.pipeline.pp_schedule=interleaved1f1b",
      "distributed.pipeline.layers_per_stage=3", NULL}, W(4, 1, 4, 4),
     {"--set distributed.pipeline.layers_per_stage=3: distributed.pipeline.layers_per_stage: 3 makes 3 stages from "
      "num_hidden_layers = 8, not a multiple of pp_size = 4 (set round_virtual_stages_to_pp_multiple: up, or choose "
      "layers_per_stage so that num_hidden_layers / layers_per_stage is a multiple of 4)", NULL}},
    /* NVLink domains */
    {"tp larger than the NVLink domain", dense, {"model.num_attention_heads=16", "distributed.tp_size=16", NULL},
     W(16, 2, 8, 8),
     {"--set distributed.tp_size=16: distributed.tp_size: 16 does not fit in one NVLink domain of 8 GPUs (use 1, 2, "
      "4 or 8)", NULL}},
    {"tp not dividing the NVLink domain", dense, {"distributed.tp_size=4", "step_scheduler.global_batch_size=24", NULL},
     W(12, 2, 6, 6),
     {"--set distributed.tp_size=4: distributed.tp_size: 4 does not divide the NVLink domain of 6 GPUs, so a "
      "tensor-parallel group would span two domains (use 1, 2, 3 or 6)", NULL}},
    /* batches and micro-batches */
    {"global batch not a multiple", dense, {"step_scheduler.global_batch_size=30", NULL}, W(2, 1, 2, 2),
     {"--set step_scheduler.global_batch_size=30: step_scheduler.global_batch_size: 30 is not a multiple of "
      "local_batch_size*dp_size = 4*2 = 8 (use a multiple of 8)", NULL}},
    {"micro-batch does not divide local batch", dense,
     {"distributed.pp_size=2", "distributed.pipeline.pp_microbatch_size=3", NULL}, W(2, 1, 2, 2),
     {"--set distributed.pipeline.pp_microbatch_size=3: distributed.pipeline.pp_microbatch_size: 3 does not divide "
      "step_scheduler.local_batch_size = 4 (use 1, 2 or 4)", NULL}},
    {"fewer micro-batches than stages", dense, {"distributed.pp_size=8", NULL}, W(8, 1, 8, 8),
     {"base.yaml:17:21: step_scheduler.local_batch_size: 4 gives 4 micro-batches, fewer than pp_size = 8 stages "
      "(1f1b needs at least one micro-batch per stage: use local_batch_size >= 8 * pp_microbatch_size, or "
      "interleaved1f1b)", NULL}},
    {"interleaved with fewer micro-batches than stages", dense,
     {"distributed.pp_size=4", "distributed.pipeline.pp_schedule=interleaved1f1b", "step_scheduler.local_batch_size=2",
      "step_scheduler.global_batch_size=2", NULL}, W(4, 1, 4, 4), {NULL}},
    {"interleaved with 6 micro-batches on 4 stages: one round", dense,
     {"distributed.pp_size=4", "distributed.pipeline.pp_schedule=interleaved1f1b", "step_scheduler.local_batch_size=6",
      "step_scheduler.global_batch_size=6", NULL}, W(4, 1, 4, 4), {NULL}},
    {"interleaved micro-batches", dense,
     {"distributed.pp_size=4", "distributed.pipeline.pp_schedule=interleaved1f1b", "step_scheduler.local_batch_size=9",
      "step_scheduler.global_batch_size=36", NULL}, W(4, 1, 4, 4),
     {"--set step_scheduler.local_batch_size=9: step_scheduler.local_batch_size: interleaved1f1b runs the 9 "
      "micro-batches (local_batch_size / pp_microbatch_size) in max(1, 9 / pp_size) = 2 rounds, which must divide "
      "them (use 8 or 10 micro-batches)", NULL}},
    {"missing batch sizes", "model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n"
                            "  intermediate_size: 128\n  vocab_size: 64\n", {NULL}, W(2, 1, 2, 2),
     {"base.yaml: step_scheduler.global_batch_size: missing (the number of sequences per optimizer step)",
      "base.yaml: step_scheduler.local_batch_size: missing (the number of sequences per rank per micro-step)", NULL}},
    /* sequence and context parallel */
    {"packed sequence and cp", dense, {"distributed.cp_size=2", "packed_sequence.packed_sequence_size=127", NULL},
     W(8, 1, 8, 8),
     {"--set packed_sequence.packed_sequence_size=127: packed_sequence.packed_sequence_size: 127 is not divisible by "
      "2*cp_size = 4 (context parallelism splits each sequence into 2*cp_size chunks for load balance)", NULL}},
    /* AutoModel's rule: the packed size divisible by 2 x cp (a multiple of cp alone is not enough) */
    {"packed sequence and cp, odd chunks", dense, {"distributed.cp_size=2", "packed_sequence.packed_sequence_size=130",
                                                   "dataset.seq_length=128", NULL},
     W(8, 1, 8, 8),
     {"--set packed_sequence.packed_sequence_size=130: packed_sequence.packed_sequence_size: 130 is not divisible by "
      "2*cp_size = 4 (context parallelism splits each sequence into 2*cp_size chunks for load balance)", NULL}},
    {"packed sequence and sequence parallel", dense,
     {"distributed.tp_size=4", "distributed.sequence_parallel=true", "packed_sequence.packed_sequence_size=130",
      NULL}, W(8, 1, 8, 8),
     {"--set packed_sequence.packed_sequence_size=130: packed_sequence.packed_sequence_size: 130 is not divisible by "
      "tp_size = 4 (sequence_parallel splits the sequence across tp ranks)", NULL}},
    {"seq_length and cp", dense, {"distributed.cp_size=2", "dataset.seq_length=130", NULL}, W(8, 1, 8, 8),
     {"--set dataset.seq_length=130: dataset.seq_length: 130 is not divisible by 2*cp_size = 4 (context parallelism "
      "splits each sequence into 2*cp_size chunks for load balance)", NULL}},
    {"seq_length and sequence parallel", dense,
     {"distributed.tp_size=4", "distributed.sequence_parallel=true", "dataset.seq_length=130", NULL}, W(8, 1, 8, 8),
     {"--set dataset.seq_length=130: dataset.seq_length: 130 is not divisible by tp_size = 4 (sequence_parallel "
      "splits the sequence across tp ranks)", NULL}},
    {"timeout", dense, {"dist_env.timeout_minutes=0", NULL}, W(8, 1, 8, 8),
     {"--set dist_env.timeout_minutes=0: dist_env.timeout_minutes: 0 must be positive", NULL}},
    /* sbatch-time checks: no world, dp given in the recipe */
    {"no world, ep against explicit dp", moe, {"distributed.dp_size=3", "distributed.ep_size=2",
                                               "model.num_local_experts=4", "step_scheduler.global_batch_size=12",
                                               NULL}, {.size = 0},
     {"--set distributed.ep_size=2: distributed.ep_size: 2 does not divide dp_size*cp_size = 3 (use 1 or 3)", NULL}},
    {"no world, heads", dense, {"distributed.tp_size=5", NULL}, {.size = 0},
     {"--set distributed.tp_size=5: distributed.tp_size: 5 does not divide num_attention_heads = 8 (use 1, 2, 4 or 8)",
      "--set distributed.tp_size=5: distributed.tp_size: 5 does not divide vocab_size = 1024 (the vocabulary is "
      "split across tp ranks; use 1, 2, 4, 8, 16, 32 or 64)",
      "--set distributed.tp_size=5: distributed.tp_size: 5 does not divide intermediate_size = 512 (the MLP is "
      "split across tp ranks; use 1, 2, 4, 8, 16, 32 or 64)", NULL}},
};

static void run_case(void **state)
{
    const struct rule_case *c = *state;
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("base.yaml", c->yaml, c->sets, &err);
    assert_non_null(r);
    if (err.n == 0) {
        if (c->world.size) {
            struct am_plan p;
            am_plan_build(r, &c->world, &p, &err);
            am_plan_free(&p);
        } else {
            am_validate(r, NULL, &err);
        }
    }
    assert_messages(&err, c->want);
    am_recipe_free(r);
    am_errors_free(&err);
}

int main(void)
{
    enum { N = sizeof(cases) / sizeof(cases[0]) };
    struct CMUnitTest tests[N];
    for (size_t i = 0; i < N; i++)
        tests[i] = (struct CMUnitTest){cases[i].name, run_case, NULL, NULL, (void *)&cases[i]};
    return cmocka_run_group_tests_name("rules", tests, NULL, NULL);
}
