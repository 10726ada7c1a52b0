/* test_recipe.c - parsing recipes: YAML positions and limits, AutoModel's layout (used,
 * ignored and unknown keys), overrides, typed values, and finding model configs. */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "testrecipe.h"

static const char arch[] = "model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n"
                           "  intermediate_size: 128\n  vocab_size: 256\n"
                           "step_scheduler:\n  global_batch_size: 8\n  local_batch_size: 2\n";

static char tmp[256];

/* Shipped configs from the source tree; no Hugging Face cache. */
static void default_env(void)
{
    char dir[512];
    const char *src = getenv("AM_SRCDIR");
    snprintf(dir, sizeof(dir), "%s/runtime/recipe/models", src ? src : ".");
    setenv("AM_MODELS_DIR", dir, 1);
    setenv("HF_HUB_CACHE", "/nonexistent/hub", 1);
}

static int setup_tmp(void **state)
{
    (void)state;
    snprintf(tmp, sizeof(tmp), "/tmp/am-test-recipe-XXXXXX");
    assert_non_null(mkdtemp(tmp));
    default_env();
    return 0;
}

static int teardown_tmp(void **state)
{
    (void)state;
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
    return system(cmd);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void expect(const char *yaml, const char *const *sets, const char *const *want)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", yaml, sets, &err);
    assert_messages(&err, want);
    am_recipe_free(r);
    am_errors_free(&err);
}

#define MSGS(...) ((const char *const[]){__VA_ARGS__, NULL})
#define NONE ((const char *const[]){NULL})

static void test_positions_and_types(void **state)
{
    (void)state;
    char y[1024];
    snprintf(y, sizeof(y), "%sdistributed:\n  tp_size: abc\n  sequence_parallel: maybe\n  pp_size: 0\n"
             "optimizer:\n  lr: fast\n  betas: [0.9]\n", arch);
    expect(y, NULL, MSGS("r.yaml:11:12: distributed.tp_size: expected a whole number, got 'abc'",
                         "r.yaml:12:22: distributed.sequence_parallel: expected true or false, got 'maybe'",
                         "r.yaml:13:12: distributed.pp_size: 0 is out of range (must be 1 to 1048576)",
                         "r.yaml:15:7: optimizer.lr: expected a number, got 'fast'",
                         "r.yaml:16:10: optimizer.betas: expected two numbers, e.g. [0.9, 0.95]"));
    /* a long or binary value is cut and made printable, never echoed whole */
    snprintf(y, sizeof(y), "%sdistributed:\n  tp_size: \"\\x01\\x02%s\"\n", arch,
             "0123456789012345678901234567890123456789012345678901234567890123456789");
    expect(y, NULL, MSGS("r.yaml:11:12: distributed.tp_size: expected a whole number, got "
                         "'??01234567890123456789012345678901234567...'"));
}

static void test_yaml_errors(void **state)
{
    (void)state;
    expect("model:\n  hidden_size: [1, 2\n", NULL,
           MSGS("r.yaml:3:1: YAML syntax error: did not find expected ',' or ']' while parsing a flow sequence"));
    expect("distributed:\n  tp_size: 2\n  tp_size: 4\n", NULL,
           MSGS("r.yaml:3:3: key 'tp_size' appears twice in the same section (keep one)"));
    expect("- a\n- b\n", NULL, MSGS("r.yaml:1:1: a recipe is a YAML mapping of sections (model:, distributed:, ...); "
                                    "this file is not"));
    expect("a: 1\n---\nb: 2\n", NULL, MSGS("r.yaml:2:1: a recipe is one YAML document; remove the second '---'"));
    expect("? [a, b]\n: 1\n", NULL, MSGS("r.yaml:1:3: a key must be a plain name, not a list"));
    expect("x: *nope\n", NULL, MSGS("r.yaml:1:4: alias *nope names no anchor defined before it"));
}

static void test_yaml_limits(void **state)
{
    (void)state;
    /* nesting */
    char deep[512] = "a: ";
    for (int i = 0; i < 100; i++)
        strcat(deep, "[");
    expect(deep, NULL, MSGS("r.yaml:1:67: sections nest deeper than 64 levels"));
    /* an alias bomb: 10 levels of 10 copies would be 10^10 values */
    char bomb[4096] = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
    for (int i = 1; i < 10; i++) {
        char line[128];
        snprintf(line, sizeof(line), "a%d: &a%d [*a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d, *a%d]\n", i, i,
                 i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1, i - 1);
        strcat(bomb, line);
    }
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", bomb, NULL, &err);
    assert_null(r);
    assert_int_equal(err.n, 1);
    assert_non_null(strstr(err.msg[0], "more than 100000 values: a recipe is far smaller (is this the right file?)"));
    am_errors_free(&err);
}

static void test_aliases_resolve(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    char y[1024];
    snprintf(y, sizeof(y), "%ssizes: &two 2\ndistributed:\n  tp_size: *two\n  pp_size: *two\n", arch);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->dist.tp, 2);
    assert_int_equal(r->dist.pp, 2);
    am_recipe_free(r);
    am_errors_free(&err);
}

static void test_unknown_keys(void **state)
{
    (void)state;
    char y[1024];
    snprintf(y, sizeof(y), "%sdistributed:\n  tp_szie: 2\n  flux_capacitor: 1\ndistributd:\n  tp_size: 2\n"
             "step_schedular:\n  max_steps: 3\n", arch);
    expect(y, NULL, MSGS("r.yaml:13:1: distributd: unknown key (did you mean distributed?)",
                         "r.yaml:15:1: step_schedular: unknown key (did you mean step_scheduler?)",
                         "r.yaml:11:3: distributed.tp_szie: unknown key (did you mean tp_size?)",
                         "r.yaml:12:3: distributed.flux_capacitor: unknown key (docs/recipes.md lists the keys of "
                         "distributed)"));
    snprintf(y, sizeof(y), "%s  hiden_size: 64\n", "model:\n  num_hidden_layers: 2\n");
    expect(y, NULL, MSGS("r.yaml:3:3: model.hiden_size: unknown key (did you mean hidden_size?)"));
}

/* A recipe in NeMo AutoModel's layout, with the keys its recipes use: it must load, with
 * the keys am does not use listed as ignored. */
static const char automodel[] =
    "recipe: TrainFinetuneRecipeForNextTokenPrediction\n"
    "step_scheduler:\n  global_batch_size: 64\n  local_batch_size: 8\n  ckpt_every_steps: 500\n"
    "  val_every_steps: 100\n  num_epochs: 1\n  max_steps: 200\n"
    "dist_env:\n  backend: nccl\n  timeout_minutes: 5\n"
    "rng:\n  _target_: nemo_automodel.components.training.rng.StatefulRNG\n  seed: 4242\n  ranked: true\n"
    "model:\n  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained\n"
    "  pretrained_model_name_or_path: meta-llama/Llama-3.1-8B\n  torch_dtype: bfloat16\n"
    "  trust_remote_code: false\n  attn_implementation: sdpa\n"
    "checkpoint:\n  enabled: true\n  checkpoint_dir: ckpts/\n  model_save_format: safetensors\n"
    "  save_consolidated: true\n"
    "distributed:\n  _target_: nemo_automodel.components.distributed.fsdp2.FSDP2Manager\n  dp_size: none\n"
    "  dp_replicate_size: 1\n  tp_size: 2\n  cp_size: 1\n  pp_size: 2\n  ep_size: null\n"
    "  sequence_parallel: false\n  activation_checkpointing: true\n  defer_fsdp_grad_sync: false\n"
    "  mp_policy:\n    _target_: torch.distributed.fsdp.MixedPrecisionPolicy\n    param_dtype: bfloat16\n"
    "    reduce_dtype: float32\n    output_dtype: bfloat16\n    cast_forward_inputs: true\n"
    "  pipeline:\n    pp_schedule: interleaved1f1b\n    pp_microbatch_size: 2\n    layers_per_stage: 8\n"
    "    scale_grads_in_schedule: false\n    round_virtual_stages_to_pp_multiple: up\n"
    "loss_fn:\n  _target_: nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy\n"
    "dataset:\n  _target_: nemo_automodel.components.datasets.llm.megatron_dataset.MegatronPretraining\n"
    "  paths: [0.3, data/a_text_document, 0.7, data/b_text_document]\n  index_mapping_dir: mapping/\n"
    "  tokenizer:\n    _target_: transformers.AutoTokenizer.from_pretrained\n"
    "    pretrained_model_name_or_path: meta-llama/Llama-3.1-8B\n  seq_length: 4096\n  split: \"0.99, 0.01, 0.00\"\n"
    "packed_sequence:\n  packed_sequence_size: 0\n  split_across_pack: false\n"
    "dataloader:\n  _target_: torchdata.stateful_dataloader.StatefulDataLoader\n  shuffle: true\n"
    "validation_dataset:\n  _target_: x.HellaSwag\n  split: validation\n"
    "optimizer:\n  _target_: torch.optim.Adam\n  betas: [0.9, 0.95]\n  eps: 1e-8\n  lr: 1.0e-5\n"
    "  weight_decay: 0\n  foreach: false\n"
    "lr_scheduler:\n  lr_decay_style: cosine\n  lr_warmup_steps: 10\n  min_lr: 1.0e-6\n"
    "clip_grad_norm:\n  max_norm: 0.5\n"
    "wandb:\n  project: p\n  name: n\n"
    "ci:\n  time: \"00:30:00\"\n";

/* mp_policy: AutoModel's default policy (bf16 compute, fp32 reduction) when there is none; a
 * policy given leaves out a dtype as torch's None does (the compute dtype stays the model's
 * torch_dtype, the reduction follows the compute dtype). */
static void test_mixed_precision_policy(void **state)
{
    (void)state;
    static const struct {
        const char *dist;
        enum am_dtype compute, reduce;
    } cases[] = {
        {"", AM_BF16, AM_F32},
        {"distributed:\n  strategy: ddp\n", AM_F32, AM_F32},
        {"distributed:\n  mp_policy:\n    param_dtype: bfloat16\n", AM_BF16, AM_BF16},
        {"distributed:\n  mp_policy:\n    param_dtype: float32\n", AM_F32, AM_F32},
        {"distributed:\n  mp_policy:\n    reduce_dtype: bfloat16\n", AM_F32, AM_BF16},
        {"distributed:\n  mp_policy:\n    param_dtype: bf16\n    reduce_dtype: fp32\n", AM_BF16,
         AM_F32},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char yaml[512];
        snprintf(yaml, sizeof(yaml),
                 "model:\n  model_type: llama\n  vocab_size: 256\n  hidden_size: 64\n  intermediate_size: 128\n"
                 "  num_hidden_layers: 2\n  num_attention_heads: 4\n  torch_dtype: float32\n%s",
                 cases[i].dist);
        struct am_errors err;
        am_errors_init(&err);
        struct am_recipe *r = parse_with("mp.yaml", yaml, NULL, &err);
        assert_messages(&err, NONE);
        if (r->compute_dtype != cases[i].compute || r->reduce_dtype != cases[i].reduce)
            print_error("case %zu: compute %d reduce %d\n", i, r->compute_dtype, r->reduce_dtype);
        assert_int_equal(r->compute_dtype, cases[i].compute);
        assert_int_equal(r->reduce_dtype, cases[i].reduce);
        am_recipe_free(r);
        am_errors_free(&err);
    }
}

static void test_automodel_recipe_loads(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("automodel.yaml", automodel, NULL, &err);
    assert_messages(&err, NONE);
    assert_int_equal(r->dist.strategy, AM_FSDP2);
    assert_int_equal(r->dist.tp, 2);
    assert_int_equal(r->dist.pp, 2);
    assert_int_equal(r->dist.ep, 1);
    assert_int_equal(r->dist.dp, 0);
    assert_true(r->dist.activation_checkpointing);
    assert_int_equal(r->dist.pipeline.schedule, AM_PP_INTERLEAVED_1F1B);
    assert_int_equal(r->dist.pipeline.microbatch_size, 2);
    assert_int_equal(r->dist.pipeline.layers_per_stage, 8);
    assert_int_equal(r->dist.pipeline.round_virtual, AM_ROUND_UP);
    assert_int_equal(r->model.hidden_size, 4096);
    assert_int_equal(r->model.num_hidden_layers, 32);
    assert_int_equal(r->data.n_paths, 2);
    assert_string_equal(r->data.paths[1], "data/b_text_document");
    assert_float_equal(r->data.weights[0], 0.3, 0);
    assert_int_equal(r->data.seq_length, 4096);
    assert_string_equal(r->optim.name, "adam");
    assert_float_equal(r->optim.beta2, 0.95, 0);
    assert_int_equal(r->lr.style, AM_LR_COSINE);
    assert_int_equal(r->seed, 4242);
    assert_float_equal(r->optim.max_grad_norm, 0.5, 0);
    assert_float_equal(r->dist_env.timeout_minutes, 5, 0);
    assert_int_equal(r->compute_dtype, AM_BF16);
    assert_int_equal(r->reduce_dtype, AM_F32);
    static const char *const ignored[] = {
        "recipe", "loss_fn", "dataloader", "validation_dataset", "wandb", "ci", "model._target_",
        "model.trust_remote_code", "model.attn_implementation", "distributed.dp_replicate_size" /* never */, NULL};
    (void)ignored;
    static const char *const want[] = {
        "recipe", "loss_fn", "dataloader", "validation_dataset", "wandb", "ci", "model._target_",
        "model.trust_remote_code", "model.attn_implementation", "distributed.defer_fsdp_grad_sync",
        "distributed.mp_policy._target_", "distributed.mp_policy.output_dtype",
        "distributed.mp_policy.cast_forward_inputs", "distributed.pipeline.scale_grads_in_schedule",
        "dataset._target_", "dataset.index_mapping_dir", "dataset.tokenizer", "dataset.split",
        "packed_sequence.split_across_pack", "optimizer.foreach", "rng._target_", NULL};
    size_t n = 0;
    while (want[n])
        n++;
    for (size_t i = 0; i < n; i++) {
        bool found = false;
        for (size_t j = 0; j < r->ignored.n; j++)
            found |= strcmp(r->ignored.v[j], want[i]) == 0;
        if (!found)
            print_error("not listed as ignored: %s\n", want[i]);
        assert_true(found);
    }
    assert_int_equal(r->ignored.n, n);
    /* a tracker's section: ignored, with a note of what am writes instead */
    bool noted = false;
    for (size_t j = 0; j < r->notes.n; j++)
        noted |= strcmp(r->notes.v[j], "wandb: am-train logs to no tracking service; rank 0 writes TensorBoard event "
                        "files in <log dir>/<job id>/tensorboard (docs/diagnostics.md, \"TensorBoard\"): import them "
                        "into W&B with wandb sync --sync-tensorboard DIR") == 0;
    assert_true(noted);
    am_recipe_free(r);
    am_errors_free(&err);
}

static void test_overrides(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    const char *sets[] = {"distributed.tp_size=2", "packed_sequence.packed_sequence_size=512",
                          "optimizer.betas=[0.8, 0.99]", "distributed.dp_size=none", NULL};
    struct am_recipe *r = parse_with("r.yaml", arch, sets, &err);
    assert_messages(&err, NONE);
    assert_int_equal(r->dist.tp, 2);
    assert_int_equal(r->packed_sequence_size, 512);
    assert_float_equal(r->optim.beta1, 0.8, 0);
    assert_int_equal(r->dist.dp, 0);
    struct am_pos pos = am_recipe_pos(r, "distributed.tp_size");
    assert_string_equal(pos.origin, "--set distributed.tp_size=2");
    am_recipe_free(r);
    am_errors_free(&err);

    expect(arch, (const char *[]){"model.hidden_size.x=1", NULL},
           MSGS("--set model.hidden_size.x=1: model.hidden_size.x: cannot set 'x' inside it: model.hidden_size is a "
                "value, not a section"));
    expect(arch, (const char *[]){"distributed..tp_size=1", NULL},
           MSGS("--set distributed..tp_size=1: 'distributed..tp_size' is not a valid key path (use section.key, e.g. "
                "distributed.tp_size)"));
    expect(arch, (const char *[]){"step_scheduler.max_steps=", NULL}, MSGS(NULL)); /* empty: not set */
    expect(arch, (const char *[]){"step_scheduler.max_steps=many", NULL},
           MSGS("--set step_scheduler.max_steps=many: step_scheduler.max_steps: expected a whole number, got 'many'"));
    expect(arch, (const char *[]){"distributed.tp_size=[1", NULL},
           MSGS("--set distributed.tp_size=[1: YAML syntax error: did not find expected ',' or ']' while parsing a "
                "flow sequence"));

    /* checkpoint.save_consolidated: AutoModel's modes (and its booleans) */
    const char *modes[][2] = {{"false", "00"}, {"true", "10"}, {"every", "10"}, {"final", "11"}, {"False", "00"}};
    for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
        char set[64];
        snprintf(set, sizeof(set), "checkpoint.save_consolidated=%s", modes[i][0]);
        am_errors_init(&err);
        r = parse_with("r.yaml", arch, (const char *[]){set, NULL}, &err);
        assert_messages(&err, NONE);
        assert_int_equal(r->ckpt.save_consolidated, modes[i][1][0] == '1');
        assert_int_equal(r->ckpt.consolidated_final, modes[i][1][1] == '1');
        am_recipe_free(r);
        am_errors_free(&err);
    }
    expect(arch, (const char *[]){"checkpoint.save_consolidated=last", NULL},
           MSGS("--set checkpoint.save_consolidated=last: checkpoint.save_consolidated: 'last' is not one of: false, "
                "False, FALSE, true, True, TRUE, every, final"));
}

static void test_strategy_from_target(void **state)
{
    (void)state;
    char y[1024];
    snprintf(y, sizeof(y), "%sdistributed:\n  _target_: nemo_automodel.components.distributed.ddp.DDPManager\n", arch);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->dist.strategy, AM_DDP);
    am_recipe_free(r);
    am_errors_free(&err);
    snprintf(y, sizeof(y), "%sdistributed:\n  strategy: fsdp2\n  _target_: x.DDPManager\n", arch);
    expect(y, NULL, MSGS("r.yaml:12:13: distributed._target_: DDPManager is strategy ddp, but distributed.strategy "
                         "says fsdp2 (keep one)"));
    snprintf(y, sizeof(y), "%sdistributed:\n  strategy: fsdp3\n", arch);
    expect(y, NULL, MSGS("r.yaml:11:13: distributed.strategy: 'fsdp3' is not one of: fsdp2, megatron_fsdp, ddp"));
    snprintf(y, sizeof(y), "%sdistributed:\n  pp_size: 2\n  pipeline:\n    pp_schedule: zero_bubble\n", arch);
    expect(y, NULL, MSGS("r.yaml:13:18: distributed.pipeline.pp_schedule: 'zero_bubble' is not a schedule am runs "
                         "(use 1f1b, gpipe or interleaved1f1b)"));
    /* with pp_size 1 the pipeline section is dropped, as AutoModel drops it */
    snprintf(y, sizeof(y), "%sdistributed:\n  pipeline:\n    pp_schedule: zero_bubble\n", arch);
    expect(y, NULL, MSGS(NULL));
    snprintf(y, sizeof(y), "%sclip_grad_norm:\n  max_norm: 0.5\n  norm_type: 1\n", arch);
    expect(y, NULL, MSGS("r.yaml:12:14: clip_grad_norm.norm_type: 1 is not supported by am (it clips by the L2 "
                         "norm: use 2)"));
    snprintf(y, sizeof(y), "%soptimizer:\n  _target_: torch.optim.SGD\n", arch);
    expect(y, NULL, MSGS("r.yaml:11:13: optimizer._target_: 'torch.optim.SGD' is not an optimizer am runs (use "
                         "torch.optim.AdamW or torch.optim.Adam)"));
}

static void test_model_rules(void **state)
{
    (void)state;
    expect("model:\n  model_type: gpt2\n  hidden_size: 64\n", NULL,
           MSGS("r.yaml:2:15: model.model_type: 'gpt2' is not supported (supported: llama, mistral, mixtral, qwen2, "
                "qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss)"));
    /* the architecture first and alone, not the keys of a config am does not build */
    expect("model:\n  model_type: phi3\n  hidden_act: gelu\n  attention_bias: true\n  rope_scaling:\n"
           "    rope_type: yarn\n    factor: 4\n", NULL,
           MSGS("r.yaml:2:15: model.model_type: 'phi3' is not supported (supported: llama, mistral, mixtral, qwen2, "
                "qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss)"));
    expect("model:\n  architectures: [Phi3ForCausalLM]\n  first_k_dense_replace: 1\n", NULL,
           MSGS("r.yaml:2:19: model.architectures: 'Phi3ForCausalLM' is not an architecture am builds (supported: "
                "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss)"));
    expect("model:\n  config:\n    _target_: nemo_automodel.components.models.deepseek_v4.config.DeepseekV4Config\n"
           "    num_nextn_predict_layers: 0\n", NULL,
           MSGS("r.yaml:3:15: model.config._target_: 'DeepseekV4Config' is not an architecture am builds (supported: "
                "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss)"));
    expect("model:\n  config:\n    _target_: pkg.models.phi3.Phi3Config.from_pretrained\n", NULL,
           MSGS("r.yaml:3:15: model.config._target_: 'Phi3Config' is not an architecture am builds (supported: "
                "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, gemma2, gemma3_text, glm4_moe, deepseek_v3, gpt_oss)"));
    expect("model:\n  config:\n    _target_: transformers.Qwen3MoeConfig\n    hidden_size: 64\n"
           "    num_hidden_layers: 2\n    num_attention_heads: 2\n    intermediate_size: 128\n    vocab_size: 64\n",
           NULL, MSGS("r.yaml: model.config.num_experts: missing (a qwen3_moe model has experts)"));
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  quantization_config:\n    quant_method: bitsandbytes\n    load_in_4bit: true\n", NULL,
           MSGS("r.yaml:8:5: model.quantization_config: a quantized checkpoint (quant_method bitsandbytes) is not "
                "supported: am trains bf16 or fp32 weights and dequantizes only FP8 checkpoints (quant_method fp8, fmt e4m3, "
                "as DeepSeek-V3's); use the unquantized model"));
    /* FP8 checkpoints: e4m3 in blocks is dequantised at load (runtime/ckpt/quant.h); other forms are refused */
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  quantization_config:\n    quant_method: fp8\n    fmt: e5m2\n", NULL,
           MSGS("r.yaml:9:10: model.quantization_config.fmt: 'e5m2' is not supported: am dequantizes FP8 checkpoints "
                "in e4m3 (F8_E4M3 weights with one fp32 weight_scale_inv per block, as DeepSeek-V3 and Kimi ship "
                "them); use such a checkpoint or the unquantized model"));
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  quantization_config:\n    quant_method: fp8\n    weight_block_size: null\n", NULL,
           MSGS("r.yaml:9:24: model.quantization_config.weight_block_size: null (one scale per tensor) is not "
                "supported: am dequantizes FP8 weights with one scale per block, [rows, columns] (DeepSeek-V3's "
                "[128, 128])"));
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  quantization_config:\n    quant_method: fp8\n    weight_block_size: [128]\n", NULL,
           MSGS("r.yaml:9:24: model.quantization_config.weight_block_size: expected [rows, columns], the block of "
                "one scale (DeepSeek-V3's [128, 128])"));
    /* rope_scaling: llama3, linear and yarn; yarn needs original_max_position_embeddings and a factor > 0 */
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  rope_scaling:\n    rope_type: dynamic\n    factor: 2\n", NULL,
           MSGS("r.yaml:8:16: model.rope_scaling.rope_type: 'dynamic' is not supported by am (use llama3, linear or "
                "yarn)"));
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  rope_scaling:\n    rope_type: yarn\n    factor: 4\n", NULL,
           MSGS("r.yaml:8:5: model.rope_scaling.original_max_position_embeddings: missing (required for rope_type "
                "yarn)"));
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  rope_scaling:\n    rope_type: yarn\n    factor: 0\n"
           "    original_max_position_embeddings: 4096\n", NULL,
           MSGS("r.yaml:8:5: model.rope_scaling.factor: 0; yarn needs a factor > 0"));
    /* AutoModel's MoEConfig overrides: only what would leave transformers' MoE as it is */
    expect("model:\n  model_type: glm4_moe\n  moe_overrides:\n    gate_bias_update_factor: 0.001\n"
           "    aux_loss_coeff: 0.0\n    score_func: softmax\n", NULL,
           MSGS("r.yaml:4:30: model.moe_overrides.gate_bias_update_factor: 0.001 is not supported by am: it does not "
                "update the experts' selection bias (e_score_correction_bias) in training; AutoModel's glm4_moe does "
                "not either (its model has no update_moe_gate_bias, which the train loop calls) (set it to 0)",
                "r.yaml:6:5: model.moe_overrides.score_func: not read by am (it trains the MoE transformers' class "
                "computes; of AutoModel's MoEConfig it takes gate_bias_update_factor (deepseek_v3) and aux_loss_coeff): "
                "remove it"));
    /* model.backend: kernel choices are ignored, but FP8, MXFP8 and a fake router change what is computed */
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 2\n  intermediate_size: 128\n"
           "  vocab_size: 64\n  backend:\n    attn: te\n    te_fp8:\n      recipe: mxfp8\n    experts: torch_mm_mxfp8\n"
           "    fake_balanced_gate: true\n", NULL,
           MSGS("r.yaml:9:5: model.backend.te_fp8: Transformer Engine's FP8 matrix multiplications are not supported "
                "by am: it computes in bf16 or fp32 (remove te_fp8)",
                "r.yaml:11:14: model.backend.experts: torch_mm_mxfp8 computes the experts' GEMMs in MXFP8, which am "
                "does not: it computes in bf16 or fp32 (use experts: torch_mm)",
                "r.yaml:12:25: model.backend.fake_balanced_gate: true routes tokens without the learned router, a "
                "different model than the config's: am trains the router (remove it)"));
    /* deepseek_v3: AutoModel's selection-bias update, and what transformers' DeepseekV3 does not read */
    expect("model:\n  model_type: deepseek_v3\n  rope_scaling:\n    rope_type: yarn\n    factor: 40\n", NULL,
           MSGS("r.yaml:4:5: model.rope_scaling.original_max_position_embeddings: missing (required for rope_type yarn)"));
    expect("model:\n  model_type: deepseek_v3\n  moe_overrides:\n    gate_bias_update_factor: -0.001\n"
           "    aux_loss_coeff: 0.0001\n", NULL,
           MSGS("r.yaml:4:30: model.moe_overrides.gate_bias_update_factor: -0.001 is not supported by am: AutoModel "
                "updates the selection bias when the factor is above 0 and never otherwise (set it to 0 or above)"));
    /* AutoModel's load-balancing loss: computed for the MoEs AutoModel builds its own gate for */
    expect("model:\n  model_type: mixtral\n  num_local_experts: 4\n  moe_overrides:\n    aux_loss_coeff: 0.0001\n",
           NULL,
           MSGS("r.yaml:5:21: model.moe_overrides.aux_loss_coeff: 0.0001 is not supported by am: AutoModel's "
                "load-balancing loss is not computed by am for this model (AutoModel builds no gate of its own for it; "
                "am computes transformers' own: output_router_logits and router_aux_loss_coef) (set it to 0)"));
    expect("model:\n  model_type: deepseek_v3\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n"
           "  num_key_value_heads: 2\n  vocab_size: 64\n  moe_layer_freq: 2\n  topk_method: greedy\n"
           "  scoring_func: softmax\n", NULL,
           MSGS("r.yaml: model.num_key_value_heads: 2, but deepseek_v3's kv_b_proj gives every one of the 4 attention "
                "heads its own key and value (transformers would repeat them into more heads than it has queries): set "
                "it to num_attention_heads",
                "r.yaml:8:19: model.moe_layer_freq: 2 is not supported by am: transformers' DeepseekV3 ignores it (every "
                "layer from first_k_dense_replace on has experts) while DeepSeek's own code puts experts on every 2-th "
                "layer only; set it to 1",
                "r.yaml:9:16: model.topk_method: 'greedy' is not supported by am: transformers' DeepseekV3 computes "
                "noaux_tc (the grouped top-k on sigmoid scores plus e_score_correction_bias) whatever it says; set it to "
                "noaux_tc",
                "r.yaml:10:17: model.scoring_func: 'softmax' is not supported by am: transformers' DeepseekV3 computes "
                "sigmoid (sigmoid scores) whatever it says; set it to sigmoid"));
    expect("model:\n  hidden_act: gelu\n  attention_bias: true\n", NULL,
           MSGS("r.yaml:2:15: model.hidden_act: 'gelu' is not supported by am (Llama-style models use silu)",
                "r.yaml:3:19: model.attention_bias: true is not supported by am (its layers have no bias terms: train "
                "a model without them, attention_bias false)"));
    expect("model:\n  hidden_size: 64\n", NULL,
           MSGS("r.yaml: model.num_hidden_layers: missing (write it under model:, or set "
                "pretrained_model_name_or_path to a model directory or hub id)",
                "r.yaml: model.num_attention_heads: missing (write it under model:, or set "
                "pretrained_model_name_or_path to a model directory or hub id)",
                "r.yaml: model.vocab_size: missing (write it under model:, or set pretrained_model_name_or_path to "
                "a model directory or hub id)"));
    expect("model:\n  hidden_size: 60\n  num_hidden_layers: 2\n  num_attention_heads: 8\n  vocab_size: 10\n"
           "  intermediate_size: 8\n", NULL,
           MSGS("r.yaml: model.num_attention_heads: 8 does not divide hidden_size 60 (set head_dim, or use a divisor "
                "of 60)"));
    expect("model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 8\n  num_key_value_heads: 3\n"
           "  vocab_size: 10\n  intermediate_size: 8\n", NULL,
           MSGS("r.yaml: model.num_key_value_heads: 3 does not divide num_attention_heads 8 (grouped-query "
                "attention shares each kv head among whole groups of query heads)"));
    expect("model:\n  model_type: mixtral\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 8\n"
           "  vocab_size: 10\n  intermediate_size: 8\n", NULL,
           MSGS("r.yaml: model.num_local_experts: missing (a mixtral model has experts)"));
    /* what would change the computation and am does not implement: refused, with the reason */
#define DENSE "  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n  vocab_size: 10\n  intermediate_size: 8\n"
    expect("model:\n  model_type: qwen3\n" DENSE "  attention_bias: true\n", NULL,
           MSGS("r.yaml:8:19: model.attention_bias: true is not supported by am (its layers have no bias terms: train "
                "a model without them, attention_bias false)"));
    /* qwen2: Qwen2Config reads neither attention_bias nor mlp_bias (q, k, v always have biases) */
    expect("model:\n  model_type: qwen2\n" DENSE "  attention_bias: false\n  mlp_bias: true\n", NULL, NONE);
    expect("model:\n  architectures: [Qwen2ForCausalLM]\n" DENSE "  attention_bias: true\n  hidden_act: gelu\n", NULL,
           MSGS("r.yaml:9:15: model.hidden_act: 'gelu' is not supported by am (Llama-style models use silu)"));
    expect("model:\n" DENSE "  attention_dropout: 0.1\n", NULL,
           MSGS("r.yaml:7:22: model.attention_dropout: 0.1 is not supported by am (it trains without dropout: set it "
                "to 0.0)"));
    expect("model:\n  model_type: llama\n" DENSE "  sliding_window: 512\n", NULL,
           MSGS("r.yaml:8:19: model.sliding_window: 512, but a llama model has no sliding window (transformers would "
                "attend to every earlier token): remove it, or use model_type mistral for sliding-window attention"));
    expect("model:\n  model_type: mistral\n" DENSE "  sliding_window: 0\n", NULL,
           MSGS("r.yaml:8:19: model.sliding_window: 0 is out of range (must be 1 to 1099511627776)"));
    expect("model:\n  model_type: qwen3\n" DENSE "  layer_types: [full_attention, sliding_attention]\n", NULL,
           MSGS("r.yaml:8:33: model.layer_types[1]: sliding_attention, but no sliding window is set (transformers "
                "refuses it too): set use_sliding_window true and sliding_window, or make the layer full_attention"));
    expect("model:\n  model_type: qwen3\n" DENSE "  layer_types: [full_attention]\n", NULL,
           MSGS("r.yaml:8:16: model.layer_types: expected a list of 2 entries (one per layer: full_attention or "
                "sliding_attention)"));
    expect("model:\n  model_type: qwen3\n" DENSE "  use_sliding_window: true\n  layer_types: [full_attention, "
           "chunked_attention]\n", NULL,
           MSGS("r.yaml:9:33: model.layer_types[1]: 'chunked_attention' is not an attention am runs (use "
                "full_attention or sliding_attention)"));
#undef DENSE
#define QMOE "model:\n  model_type: qwen3_moe\n  hidden_size: 64\n  num_hidden_layers: 4\n  num_attention_heads: 4\n" \
             "  vocab_size: 10\n  intermediate_size: 8\n  num_experts: 4\n  num_experts_per_tok: 2\n" \
             "  moe_intermediate_size: 8\n"
    expect(QMOE "  mlp_only_layers: [1, 7]\n", NULL,
           MSGS("r.yaml:11:24: model.mlp_only_layers[1]: 7 is out of range (must be 0 to 3)"));
    expect(QMOE "  mlp_only_layers: 3\n", NULL,
           MSGS("r.yaml:11:20: model.mlp_only_layers: expected a list of layer indices"));
#undef QMOE
    expect("step_scheduler:\n  global_batch_size: 8\n", NULL,
           MSGS("r.yaml: model: missing (give pretrained_model_name_or_path, or the architecture with config.json "
                "keys such as hidden_size)"));
}

/* Sliding windows as transformers 5 resolves each model type's config: the window of each of
 * 3 layers, "W0 W1 W2", for the keys written after the architecture. */
static void expect_windows(const char *type, const char *keys, const char *want)
{
    char y[1024], got[64];
    snprintf(y, sizeof(y), "model:\n  model_type: %s\n  hidden_size: 64\n  num_hidden_layers: 3\n"
             "  num_attention_heads: 4\n  vocab_size: 10\n  intermediate_size: 8\n  num_experts: 4\n"
             "  num_experts_per_tok: 2\n  moe_intermediate_size: 8\n%s", type, keys);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(err.n, 0);
    snprintf(got, sizeof(got), "%ld %ld %ld", am_model_layer_window(&r->model, 0), am_model_layer_window(&r->model, 1),
             am_model_layer_window(&r->model, 2));
    if (strcmp(got, want) != 0)
        print_error("%s with '%s': windows %s, want %s\n", type, keys, got, want);
    assert_string_equal(got, want);
    am_recipe_free(r);
    am_errors_free(&err);
}

static void test_model_windows(void **state)
{
    (void)state;
    expect_windows("mistral", "", "4096 4096 4096"); /* MistralConfig's default */
    expect_windows("mistral", "  sliding_window: 7\n", "7 7 7");
    expect_windows("mistral", "  sliding_window: null\n", "0 0 0");
    expect_windows("mistral", "  sliding_window: 7\n  layer_types: [full_attention, full_attention, full_attention]\n",
                   "7 7 7"); /* MistralModel does not read layer_types */
    expect_windows("mixtral", "", "0 0 0"); /* MixtralConfig's default: null */
    expect_windows("qwen3", "  sliding_window: 7\n", "0 0 0"); /* only with use_sliding_window */
    expect_windows("qwen3", "  use_sliding_window: true\n  sliding_window: 7\n", "0 0 0"); /* max_window_layers 28 */
    expect_windows("qwen3", "  use_sliding_window: true\n  sliding_window: 7\n  max_window_layers: 1\n", "0 7 7");
    expect_windows("qwen3", "  use_sliding_window: true\n  max_window_layers: 2\n", "0 0 4096");
    expect_windows("qwen3", "  use_sliding_window: true\n  sliding_window: 7\n  max_window_layers: 0\n"
                   "  layer_types: [sliding_attention, full_attention, sliding_attention]\n", "7 0 7");
    expect_windows("qwen3_moe", "  use_sliding_window: true\n  sliding_window: 5\n", "5 5 5");
    /* qwen2 as qwen3 (Qwen2Config's keys and defaults) */
    expect_windows("qwen2", "  sliding_window: 7\n", "0 0 0");
    expect_windows("qwen2", "  use_sliding_window: true\n  sliding_window: 7\n", "0 0 0"); /* max_window_layers 28 */
    expect_windows("qwen2", "  use_sliding_window: true\n  sliding_window: 7\n  max_window_layers: 1\n", "0 7 7");
    expect_windows("qwen2", "  use_sliding_window: true\n  sliding_window: 7\n  max_window_layers: 0\n"
                   "  layer_types: [sliding_attention, full_attention, sliding_attention]\n", "7 0 7");
    expect_windows("llama", "  sliding_window: null\n", "0 0 0");
    /* Gemma: layer_types, by default every other layer (Gemma 2) or all but every sixth (Gemma 3) */
    expect_windows("gemma2", "", "4096 0 4096");
    expect_windows("gemma2", "  sliding_window: 7\n", "7 0 7");
    expect_windows("gemma3_text", "  sliding_window: 5\n", "5 5 5");
    expect_windows("gemma3_text", "  sliding_window: 5\n  sliding_window_pattern: 2\n", "5 0 5");
    expect_windows("gemma3_text", "  sliding_window: 3\n  layer_types: [full_attention, sliding_attention, "
                   "full_attention]\n", "0 3 0");
    /* gpt_oss: layer_types, by default every other layer from layer 0, window 128 (GptOssConfig's) */
    expect_windows("gpt_oss", "", "128 0 128");
    expect_windows("gpt_oss", "  sliding_window: 7\n  layer_types: [full_attention, sliding_attention, "
                   "full_attention]\n", "0 7 0");
}

/* Gemma's defaults (Gemma2Config, Gemma3TextConfig) and Gemma 3's two rope thetas, from the
 * legacy keys and from transformers 5's rope_parameters per attention type. */
static struct am_recipe *parse_model(const char *keys)
{
    char y[1024];
    snprintf(y, sizeof(y), "model:\n  hidden_size: 64\n  num_hidden_layers: 3\n  num_attention_heads: 4\n"
             "  vocab_size: 10\n  intermediate_size: 8\n%s", keys);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(err.n, 0);
    am_errors_free(&err);
    return r;
}

/* gpt_oss: GptOssConfig's defaults, its biases by attention_bias, and its keys refused elsewhere */
static void test_model_gpt_oss(void **state)
{
    (void)state;
    struct am_recipe *r = parse_model("  model_type: gpt_oss\n");
    const struct am_model_config *m = &r->model;
    assert_true(m->gpt_oss && m->qkv_bias && m->o_bias && m->norm_topk_prob && !m->mxfp4 && !m->tie_word_embeddings);
    assert_int_equal(m->head_dim, 64);
    assert_int_equal(m->num_experts, 128);
    assert_int_equal(m->num_experts_per_tok, 4);
    assert_int_equal(m->moe_intermediate_size, 8); /* each expert of intermediate_size */
    assert_true(m->swiglu_limit == 7.0 && m->swiglu_alpha == 1.702 && m->rope_theta == 150000.0);
    assert_string_equal(m->rope_scaling.type, "yarn"); /* GptOssConfig's default rope_parameters */
    assert_true(m->rope_scaling.factor == 32 && m->rope_scaling.beta_fast == 32 && m->rope_scaling.beta_slow == 1 &&
                m->rope_scaling.no_truncate && m->rope_scaling.original_max_position_embeddings == 4096);
    am_recipe_free(r);
    /* rope_scaling null is GptOssConfig's default yarn too (transformers' rope_parameters None); a default rope
     * is written as such */
    r = parse_model("  model_type: gpt_oss\n  rope_scaling: null\n");
    assert_string_equal(r->model.rope_scaling.type, "yarn");
    am_recipe_free(r);
    r = parse_model("  model_type: gpt_oss\n  attention_bias: false\n  rope_parameters: {rope_type: default, "
                    "rope_theta: 10000.0}\n  swiglu_limit: 5.0\n"
                    "  quantization_config:\n    quant_method: mxfp4\n");
    m = &r->model;
    assert_true(!m->qkv_bias && !m->o_bias && !m->rope_scaling.type && m->swiglu_limit == 5.0 && m->mxfp4);
    am_recipe_free(r);
    expect("model:\n  model_type: llama\n  swiglu_limit: 7.0\n", NULL,
           MSGS("r.yaml:3:17: model.swiglu_limit: gpt_oss's (its experts' clamped SwiGLU); a model of another type has "
                "none: remove it"));
    expect("model:\n  model_type: gpt_oss\n  swiglu_limit: 0\n", NULL,
           MSGS("r.yaml:3:17: model.swiglu_limit: 0; it must be > 0"));
    expect("model:\n  model_type: llama\n  quantization_config:\n    quant_method: mxfp4\n", NULL,
           MSGS("r.yaml:4:19: model.quantization_config.quant_method: mxfp4 is dequantized by am for gpt_oss's "
                "experts only (their *_blocks and *_scales): use the unquantized model"));
}

static void test_model_gemma(void **state)
{
    (void)state;
    bool scaled;
    struct am_recipe *r = parse_model("  model_type: gemma2\n");
    const struct am_model_config *m = &r->model;
    assert_true(m->gemma && !m->qk_norm && m->tie_word_embeddings);
    assert_int_equal(m->head_dim, 256);
    assert_true(m->query_pre_attn_scalar == 256 && m->attn_logit_softcapping == 50 && m->final_logit_softcapping == 30);
    assert_true(am_model_layer_rope_theta(m, 0, &scaled) == 10000.0 && !scaled);
    am_recipe_free(r);
    r = parse_model("  architectures: [Gemma3ForCausalLM]\n  sliding_window: 4\n  final_logit_softcapping: null\n"
                    "  rope_scaling: {rope_type: linear, factor: 8.0}\n  sliding_window_pattern: 2\n");
    m = &r->model;
    assert_string_equal(m->model_type, "gemma3_text");
    assert_true(m->gemma && m->qk_norm && m->attn_logit_softcapping == 0 && m->final_logit_softcapping == 0);
    assert_true(am_model_layer_rope_theta(m, 0, &scaled) == 10000.0 && !scaled); /* sliding: local, unscaled */
    assert_true(am_model_layer_rope_theta(m, 1, &scaled) == 1000000.0 && scaled); /* full: rope_theta, linear */
    assert_true(m->rope_scaling.factor == 8.0);
    am_recipe_free(r);
    r = parse_model("  model_type: gemma3_text\n  sliding_window: 4\n  layer_types: [full_attention, "
                    "sliding_attention, full_attention]\n  rope_parameters:\n    full_attention: {rope_type: default, "
                    "rope_theta: 500000.0}\n    sliding_attention: {rope_type: default, rope_theta: 20000.0}\n");
    m = &r->model;
    assert_true(am_model_layer_rope_theta(m, 0, &scaled) == 500000.0 && !scaled);
    assert_true(am_model_layer_rope_theta(m, 1, &scaled) == 20000.0 && !scaled);
    assert_null(m->rope_scaling.type);
    am_recipe_free(r);
    /* what Gemma needs and the other families refuse */
    expect("model:\n  model_type: gemma3_text\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n"
           "  vocab_size: 10\n  intermediate_size: 8\n  rope_parameters:\n    sliding_attention: {rope_type: linear, "
           "factor: 2.0}\n", NULL,
           MSGS("r.yaml:9:36: model.rope_parameters.sliding_attention.rope_type: 'linear' is not supported by am (the "
                "sliding layers' rope is unscaled in Gemma 3: use default)"));
    expect("model:\n  model_type: llama\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n"
           "  vocab_size: 10\n  intermediate_size: 8\n  final_logit_softcapping: 30.0\n", NULL,
           MSGS("r.yaml: model: attn_logit_softcapping, final_logit_softcapping and rope_local_base_freq are Gemma's "
                "(model_type gemma2 or gemma3_text); a llama model has none: remove them"));
}

/* qwen2 (from model_type or config.json's architectures): q, k, v biases counted, its
 * attention_bias (which Qwen2Config does not read) listed as ignored. */
static void test_model_qwen2(void **state)
{
    (void)state;
    static const char *const yamls[] = {
        "model:\n  model_type: qwen2\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n"
        "  num_key_value_heads: 2\n  vocab_size: 10\n  intermediate_size: 8\n  attention_bias: true\n",
        "model:\n  architectures: [Qwen2ForCausalLM]\n  hidden_size: 64\n  num_hidden_layers: 2\n"
        "  num_attention_heads: 4\n  num_key_value_heads: 2\n  vocab_size: 10\n  intermediate_size: 8\n"
        "  attention_bias: true\n"};
    for (int i = 0; i < 2; i++) {
        struct am_errors err;
        am_errors_init(&err);
        struct am_recipe *r = parse_with("r.yaml", yamls[i], NULL, &err);
        for (size_t k = 0; k < err.n; k++)
            print_error("%s\n", err.msg[k]);
        assert_int_equal(err.n, 0);
        assert_string_equal(r->model.model_type, "qwen2");
        assert_true(r->model.qkv_bias);
        assert_false(r->model.qk_norm);
        struct am_param_count pc;
        am_model_params(&r->model, &pc);
        /* q 64x64 + 64, k and v 32x64 + 32 each, o 64x64 */
        assert_int_equal((long)pc.attn_per_layer, 64 * 64 + 64 + 2 * (32 * 64 + 32) + 64 * 64);
        bool listed = false;
        for (size_t k = 0; k < r->ignored.n; k++)
            listed |= strcmp(r->ignored.v[k], "model.attention_bias") == 0;
        assert_true(listed);
        am_recipe_free(r);
        am_errors_free(&err);
    }
}

/* Which of 4 layers have experts ("1" each), as transformers builds them: Qwen3-MoE's
 * mlp_only_layers and decoder_sparse_step; Mixtral's every layer. */
static void expect_moe_layers(const char *type, const char *keys, const char *want)
{
    char y[1024], got[8] = "";
    snprintf(y, sizeof(y), "model:\n  model_type: %s\n  hidden_size: 64\n  num_hidden_layers: 4\n"
             "  num_attention_heads: 4\n  vocab_size: 10\n  intermediate_size: 8\n  num_experts: 4\n"
             "  num_local_experts: 4\n  num_experts_per_tok: 2\n  moe_intermediate_size: 8\n%s", type, keys);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(err.n, 0);
    for (long l = 0; l < 4; l++)
        got[l] = am_model_layer_is_moe(&r->model, l) ? '1' : '0';
    if (strcmp(got, want) != 0)
        print_error("%s with '%s': MoE layers %s, want %s\n", type, keys, got, want);
    assert_string_equal(got, want);
    am_recipe_free(r);
    am_errors_free(&err);
}

/* deepseek_v3's gate_bias_update_factor (model_config.h): AutoModel's own model 1e-3 unless
 * moe_overrides says otherwise, transformers' class (inline, force_hf) 0 */
static double bias_factor(const char *keys, bool *forced)
{
    char y[768];
    snprintf(y, sizeof(y), "model:\n  model_type: deepseek_v3\n  hidden_size: 64\n  num_hidden_layers: 2\n"
             "  num_attention_heads: 4\n  vocab_size: 64\n%s", keys);
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    for (size_t i = 0; i < err.n; i++)
        print_error("%s\n", err.msg[i]);
    assert_int_equal(err.n, 0);
    double f = r->model.gate_bias_update_factor;
    *forced = r->model.bias_forced;
    am_recipe_free(r);
    am_errors_free(&err);
    return f;
}

static void test_model_bias_update(void **state)
{
    (void)state;
    bool forced;
    const char *own = "  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained\n";
    char y[512];
    assert_true(bias_factor("", &forced) == 0.0);
    assert_true(bias_factor(own, &forced) == 1e-3);
    snprintf(y, sizeof(y), "%s  force_hf: true\n", own);
    assert_true(bias_factor(y, &forced) == 0.0);
    snprintf(y, sizeof(y), "%s  moe_overrides:\n    gate_bias_update_factor: 0.05\n", own);
    assert_true(bias_factor(y, &forced) == 0.05);
    assert_true(bias_factor("  moe_config:\n    gate_bias_update_factor: 0.002\n", &forced) == 0.002);
    snprintf(y, sizeof(y), "%s  moe_overrides:\n    gate_bias_update_factor: 0\n    force_e_score_correction_bias: true\n",
             own);
    assert_true(bias_factor(y, &forced) == 0.0 && forced);
    /* AutoModel's load-balancing loss (model_config.h): moe_overrides' aux_loss_coeff on the MoEs AutoModel
     * builds its own gate for; AutoModel's own gpt_oss and qwen3_moe take router_aux_loss_coef unless it is
     * given, and add no transformers' loss */
    struct {
        const char *keys;
        double coeff;
        bool logits;
    } aux[] = {
        {"  model_type: deepseek_v3\n  moe_overrides:\n    aux_loss_coeff: 0.0001\n", 0.0001, false},
        {"  model_type: glm4_moe\n  moe_overrides:\n    aux_loss_coeff: 0.001\n", 0.001, false},
        {"  model_type: gpt_oss\n  num_local_experts: 4\n  head_dim: 16\n  router_aux_loss_coef: 0.9\n"
         "  output_router_logits: true\n", 0.0, true},
        {"  model_type: gpt_oss\n  num_local_experts: 4\n  head_dim: 16\n  router_aux_loss_coef: 0.9\n"
         "  output_router_logits: true\n  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained\n", 0.9,
         false},
        {"  model_type: gpt_oss\n  num_local_experts: 4\n  head_dim: 16\n  router_aux_loss_coef: 0.9\n"
         "  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained\n  moe_overrides:\n"
         "    aux_loss_coeff: 0\n", 0.0, false},
        {"  model_type: qwen3_moe\n  num_experts: 4\n  router_aux_loss_coef: 0.001\n"
         "  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained\n", 0.001, false},
        {"  model_type: qwen3_moe\n  num_experts: 4\n  router_aux_loss_coef: 0.001\n"
         "  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained\n  force_hf: true\n", 0.0, false},
    };
    for (size_t i = 0; i < sizeof(aux) / sizeof(aux[0]); i++) {
        snprintf(y, sizeof(y), "model:\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n"
                 "  vocab_size: 64\n  num_experts_per_tok: 2\n  intermediate_size: 128\n  moe_intermediate_size: 32\n%s",
                 aux[i].keys);
        struct am_errors err;
        am_errors_init(&err);
        struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
        for (size_t j = 0; j < err.n; j++)
            print_error("%s\n", err.msg[j]);
        assert_int_equal(err.n, 0);
        if (r->model.aux_loss_coeff != aux[i].coeff || am_model_hf_aux(&r->model) != aux[i].logits)
            print_error("case %zu: aux_loss_coeff %g, transformers' loss %d\n", i, r->model.aux_loss_coeff,
                        am_model_hf_aux(&r->model));
        assert_true(r->model.aux_loss_coeff == aux[i].coeff && am_model_hf_aux(&r->model) == aux[i].logits);
        am_recipe_free(r);
        am_errors_free(&err);
    }
    /* glm4_moe's force_e_score_correction_bias is not read (AutoModel's glm4_moe always has its bias) */
    expect("model:\n  model_type: glm4_moe\n  moe_overrides:\n    force_e_score_correction_bias: true\n", NULL,
           MSGS("r.yaml:4:5: model.moe_overrides.force_e_score_correction_bias: not read by am (it trains the MoE "
                "transformers' class computes; of AutoModel's MoEConfig it takes gate_bias_update_factor (deepseek_v3) "
                "and aux_loss_coeff): remove it"));
}

static void test_model_moe_layers(void **state)
{
    (void)state;
    expect_moe_layers("qwen3_moe", "", "1111");
    expect_moe_layers("qwen3_moe", "  decoder_sparse_step: 2\n", "0101"); /* (l + 1) % 2 == 0 */
    expect_moe_layers("qwen3_moe", "  mlp_only_layers: [0, 2]\n", "0101");
    expect_moe_layers("qwen3_moe", "  decoder_sparse_step: 2\n  mlp_only_layers: [3]\n", "0100");
    expect_moe_layers("qwen3_moe", "  decoder_sparse_step: null\n  mlp_only_layers: null\n", "1111");
    expect_moe_layers("mixtral", "", "1111");
    expect_moe_layers("llama", "", "0000");
}

static const char config_json[] =
    "{\"model_type\": \"llama\", \"hidden_size\": 128, \"num_hidden_layers\": 4, \"num_attention_heads\": 4,\n"
    " \"num_key_value_heads\": 2, \"intermediate_size\": 256, \"vocab_size\": 512, \"rope_theta\": 500000.0,\n"
    " \"tie_word_embeddings\": true, \"torch_dtype\": \"float16\", \"some_future_key\": [1, 2]}\n";

static void test_model_from_hf_cache(void **state)
{
    (void)state;
    char path[512], y[1024];
    snprintf(path, sizeof(path), "%s/hub/models--acme--tiny/refs", tmp);
    char cmd[1200];
    snprintf(cmd, sizeof(cmd), "mkdir -p '%s' '%s/hub/models--acme--tiny/snapshots/abc123'", path, tmp);
    assert_int_equal(system(cmd), 0);
    snprintf(path, sizeof(path), "%s/hub/models--acme--tiny/refs/main", tmp);
    write_file(path, "abc123");
    snprintf(path, sizeof(path), "%s/hub/models--acme--tiny/snapshots/abc123/config.json", tmp);
    write_file(path, config_json);
    snprintf(path, sizeof(path), "%s/hub", tmp);
    setenv("HF_HUB_CACHE", path, 1);

    /* inline keys override config.json, as from_pretrained's kwargs do */
    snprintf(y, sizeof(y), "model:\n  pretrained_model_name_or_path: acme/tiny\n  num_hidden_layers: 2\n"
             "step_scheduler:\n  global_batch_size: 8\n  local_batch_size: 2\n");
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    assert_messages(&err, NONE);
    assert_int_equal(r->model.hidden_size, 128);
    assert_int_equal(r->model.num_hidden_layers, 2);
    assert_int_equal(r->model.num_key_value_heads, 2);
    assert_true(r->model.tie_word_embeddings);
    assert_float_equal(r->model.rope_theta, 500000.0, 0);
    assert_int_equal(r->param_dtype, AM_F16); /* torch_dtype absent: the checkpoint's */
    snprintf(path, sizeof(path), "%s/hub/models--acme--tiny/snapshots/abc123/config.json", tmp);
    assert_string_equal(r->model_source, path);
    am_recipe_free(r);
    am_errors_free(&err);

    /* a local directory */
    snprintf(y, sizeof(y), "model:\n  pretrained_model_name_or_path: %s/hub/models--acme--tiny/snapshots/abc123\n",
             tmp);
    am_errors_init(&err);
    r = parse_with("r.yaml", y, NULL, &err);
    assert_int_equal(r->model.num_hidden_layers, 4);
    am_recipe_free(r);
    am_errors_free(&err);

    /* not found anywhere: every place tried is named */
    setenv("AM_MODELS_DIR", "/nonexistent/models", 1);
    char want[1024];
    snprintf(want, sizeof(want), "r.yaml:2:34: model.pretrained_model_name_or_path: 'acme/huge' not found; looked in "
             "the Hugging Face cache (%s/hub/models--acme--huge), the configs shipped with am (/nonexistent/models). "
             "am needs only its config.json to plan: huggingface-cli download acme/huge config.json", tmp);
    expect("model:\n  pretrained_model_name_or_path: acme/huge\n", NULL, MSGS(want));
    /* close matches in the cache: the same name ignoring case, or one name containing the other */
    snprintf(want, sizeof(want), "r.yaml:2:34: model.pretrained_model_name_or_path: 'acme/Tiny-Instruct' not found; "
             "looked in the Hugging Face cache (%s/hub/models--acme--Tiny-Instruct), the configs shipped with am "
             "(/nonexistent/models). am needs only its config.json to plan: huggingface-cli download "
             "acme/Tiny-Instruct config.json (close matches: acme/tiny)", tmp);
    expect("model:\n  pretrained_model_name_or_path: acme/Tiny-Instruct\n", NULL, MSGS(want));
    snprintf(want, sizeof(want), "r.yaml:2:34: model.pretrained_model_name_or_path: './no/such/dir' not found; looked "
             "in a local directory (none exists at that path) (give a directory with config.json, a hub id ORG/NAME, "
             "or write the architecture under model:)");
    expect("model:\n  pretrained_model_name_or_path: ./no/such/dir\n", NULL, MSGS(want));

    /* a broken config.json */
    snprintf(path, sizeof(path), "%s/hub/models--acme--tiny/snapshots/abc123/config.json", tmp);
    write_file(path, "{\"hidden_size\": 12,,}");
    snprintf(want, sizeof(want), "%s:1:20: invalid JSON: string or '}' expected near ','", path);
    expect("model:\n  pretrained_model_name_or_path: acme/tiny\n", NULL, MSGS(want));
    default_env();
}

static void test_model_shipped_configs(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r =
        parse_with("r.yaml", "model:\n  pretrained_model_name_or_path: meta-llama/Llama-3.3-70B-Instruct\n", NULL, &err);
    assert_messages(&err, NONE);
    assert_int_equal(r->model.hidden_size, 8192);
    assert_int_equal(r->model.num_hidden_layers, 80);
    assert_int_equal(r->model.num_key_value_heads, 8);
    assert_int_equal(r->model.intermediate_size, 28672);
    assert_string_equal(r->model.rope_scaling.type, "llama3");
    assert_float_equal(r->model.rope_scaling.factor, 8.0, 0);
    struct am_param_count pc;
    am_model_params(&r->model, &pc);
    assert_float_equal(pc.total, 70553706496.0, 0); /* Llama 3 70B's published parameter count */
    am_recipe_free(r);

    /* AutoModel's from_config layout: model.config carries the source */
    r = parse_with("r.yaml", "model:\n  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_config\n  config:\n"
                   "    _target_: transformers.AutoConfig.from_pretrained\n"
                   "    pretrained_model_name_or_path: mistralai/Mixtral-8x7B-v0.1\n", NULL, &err);
    assert_messages(&err, NONE);
    assert_string_equal(r->model.model_type, "mixtral");
    assert_int_equal(r->model.num_experts, 8);
    assert_int_equal(r->model.moe_intermediate_size, 14336);
    am_model_params(&r->model, &pc);
    assert_float_equal(pc.total, 46702792704.0, 0); /* Mixtral 8x7B: 46.7B */
    am_recipe_free(r);

    r = parse_with("r.yaml", "model:\n  pretrained_model_name_or_path: Qwen/Qwen3-30B-A3B\n", NULL, &err);
    assert_messages(&err, NONE);
    am_model_params(&r->model, &pc);
    assert_float_equal(pc.total, 30532122624.0, 0); /* Qwen3-30B-A3B: 30.5B */
    am_recipe_free(r);

    /* Qwen2.5 (qwen2): the q, k, v biases counted, as transformers counts its parameters */
    static const struct {
        const char *id;
        double total;
    } qwen25[] = {{"Qwen/Qwen2.5-0.5B", 494032768.0},
                  {"Qwen/Qwen2.5-3B", 3085938688.0},
                  {"Qwen/Qwen2.5-7B", 7615616512.0}};
    for (size_t i = 0; i < sizeof(qwen25) / sizeof(qwen25[0]); i++) {
        char y[128];
        snprintf(y, sizeof(y), "model:\n  pretrained_model_name_or_path: %s\n", qwen25[i].id);
        r = parse_with("r.yaml", y, NULL, &err);
        assert_messages(&err, NONE);
        assert_string_equal(r->model.model_type, "qwen2");
        assert_true(r->model.qkv_bias);
        assert_int_equal(r->model.sliding_window, 0); /* sliding_window given, use_sliding_window false */
        am_model_params(&r->model, &pc);
        assert_float_equal(pc.total, qwen25[i].total, 0);
        am_recipe_free(r);
    }
    am_errors_free(&err);
    default_env();
}

/* ${VAR}, ${VAR,default} and $VAR from the environment, as AutoModel's resolve_yaml_env_vars:
 * braced first (stripped, oc.env: accepted, default after the first comma, a set empty variable
 * wins over the default), then $NAME and $NAME.dotted in the result; _target_ and *_fn values,
 * and sections am does not read, are left alone. */
static void test_env_interpolation(void **state)
{
    (void)state;
    static const char model4[] = "model:\n  hidden_size: 64\n  num_hidden_layers: 4\n  num_attention_heads: 4\n"
                               "  intermediate_size: 128\n  vocab_size: 64\n";
    char y[2048];
    struct am_errors err;
    setenv("AM_T_TP", "2", 1);
    setenv("AM_T_EMPTY", "", 1);
    setenv("AM_T_DIR", "/scratch/ckpt", 1);
    setenv("AM_T_A.B", "8", 1);
    unsetenv("AM_T_UNSET");
    snprintf(y, sizeof(y), "%sdistributed:\n  tp_size: ${AM_T_TP}\n  pp_size: ${ oc.env:AM_T_UNSET , 2 }\n"
             "  dp_size: ${AM_T_UNSET,none}\n"
             "step_scheduler:\n  global_batch_size: $AM_T_A.B\n  local_batch_size: ${AM_T_UNSET,1}\n"
             "  max_steps: \"${AM_T_EMPTY,5}\"\n"
             "checkpoint:\n  checkpoint_dir: ${AM_T_DIR}/$AM_T_TP/run\n"
             "optimizer:\n  _target_: ${AM_T_UNSET}\n"
             "wandb:\n  name: ${AM_T_UNSET}\n", model4);
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    assert_non_null(r);
    /* the optimizer's _target_ is left as written (and refused as an optimizer) */
    assert_messages(&err, MSGS("r.yaml:18:13: optimizer._target_: '${AM_T_UNSET}' is not an optimizer am runs (use "
                               "torch.optim.AdamW or torch.optim.Adam)"));
    assert_int_equal(r->dist.tp, 2);
    assert_int_equal(r->dist.pp, 2);
    assert_int_equal(r->dist.dp, 0);
    assert_int_equal(r->steps.global_batch, 8);
    assert_int_equal(r->steps.max_steps, 0); /* "": set and empty, so not 5; empty is "not set" */
    assert_string_equal(r->ckpt.dir, "/scratch/ckpt/2/run");
    am_recipe_free(r);
    am_errors_free(&err);
    /* "1,2": the default is everything after the first comma */
    snprintf(y, sizeof(y), "%sstep_scheduler:\n  local_batch_size: ${AM_T_UNSET,1,2}\n", model4);
    expect(y, NULL, MSGS("r.yaml:8:21: step_scheduler.local_batch_size: expected a whole number, got '1,2'"));
    /* unset without a default: named, with where it was needed; each one reported */
    snprintf(y, sizeof(y), "%sdistributed:\n  tp_size: ${AM_T_UNSET}\ncheckpoint:\n  checkpoint_dir: $AM_T_UNSET/x\n",
             model4);
    expect(y, NULL,
           MSGS("r.yaml:8:12: distributed.tp_size: environment variable 'AM_T_UNSET' is not set (required by "
                "'${AM_T_UNSET}'; set it, or give a default: ${AM_T_UNSET,VALUE})",
                "r.yaml:10:19: checkpoint.checkpoint_dir: environment variable 'AM_T_UNSET' is not set (required by "
                "'$AM_T_UNSET'; set it, or give a default: ${AM_T_UNSET,VALUE})"));
    unsetenv("AM_T_TP");
    unsetenv("AM_T_EMPTY");
    unsetenv("AM_T_DIR");
    unsetenv("AM_T_A.B");
}

static void test_recipe_files(void **state)
{
    (void)state;
    char path[512], want[700];
    struct am_errors err;
    am_errors_init(&err);
    snprintf(path, sizeof(path), "%s/missing.yaml", tmp);
    assert_null(am_recipe_load(path, NULL, 0, &err));
    snprintf(want, sizeof(want), "%s: cannot open: No such file or directory", path);
    assert_messages(&err, MSGS(want));
    am_errors_free(&err);

    assert_null(am_recipe_load(tmp, NULL, 0, &err));
    snprintf(want, sizeof(want), "%s: is a directory, not a file", tmp);
    assert_messages(&err, MSGS(want));
    am_errors_free(&err);

    assert_null(am_recipe_load("/dev/null", NULL, 0, &err));
    assert_messages(&err, MSGS("/dev/null: is not a regular file"));
    am_errors_free(&err);

    snprintf(path, sizeof(path), "%s/big.yaml", tmp);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(ftruncate(fileno(f), AM_RECIPE_MAX_BYTES + 1), 0);
    fclose(f);
    assert_null(am_recipe_load(path, NULL, 0, &err));
    snprintf(want, sizeof(want), "%s: is 1048577 bytes, more than the 1048576 accepted (is this the right file?)", path);
    assert_messages(&err, MSGS(want));
    am_errors_free(&err);

    /* a file that is not a recipe: nothing of its content appears in the messages */
    snprintf(path, sizeof(path), "%s/shadow", tmp);
    write_file(path, "root:$6$s3cr3tsalt$hash:19000:0:99999:7:::\n");
    struct am_recipe *r = am_recipe_load(path, NULL, 0, &err);
    assert_int_equal(err.n, 1);
    assert_null(strstr(err.msg[0], "s3cr3t"));
    am_recipe_free(r);
    am_errors_free(&err);
}

/* Transformer Engine's FusedAdam: TE's defaults; the masters' and the moments' dtypes resolved
 * from master_weights, master_weight_dtype, the moments' dtypes and model.torch_dtype */
static void test_te_fused_adam(void **state)
{
    (void)state;
    struct am_errors err;
    char y[2048];
    am_errors_init(&err);
    snprintf(y, sizeof(y), "%soptimizer:\n  _target_: transformer_engine.pytorch.optimizers.FusedAdam\n", arch);
    struct am_recipe *r = parse_with("r.yaml", y, NULL, &err);
    assert_int_equal(err.n, 0);
    assert_true(r->optim.te);
    assert_float_equal(r->optim.lr, 1e-3, 0);
    assert_float_equal(r->optim.weight_decay, 0, 0);
    assert_float_equal(r->optim.beta2, 0.999, 0);
    assert_true(r->optim.adam_w_mode);
    assert_true(r->optim.bias_correction);
    assert_false(r->optim.master_weights);
    assert_int_equal(r->param_dtype, AM_BF16);
    assert_int_equal(r->optim.master_dtype, AM_BF16); /* no master_weights: the bf16 parameters */
    assert_int_equal(r->optim.moment_dtype[0], AM_F32);
    assert_int_equal(r->optim.moment_dtype[1], AM_F32);
    am_recipe_free(r);
    /* Pattern A: fp32 masters beside bf16 parameters; bf16 moments; L2 */
    snprintf(y, sizeof(y),
             "%soptimizer:\n  _target_: transformer_engine.pytorch.optimizers.fused_adam.FusedAdam\n"
             "  master_weights: true\n  store_param_remainders: true\n  exp_avg_dtype: torch.bfloat16\n"
             "  exp_avg_sq_dtype: torch.float32\n  adam_w_mode: false\n  bias_correction: false\n  capturable: true\n",
             arch);
    r = parse_with("r.yaml", y, NULL, &err);
    assert_int_equal(err.n, 0);
    /* store_param_remainders: the fp32 masters kept as the bf16 parameters and remainders */
    assert_true(r->optim.remainders);
    assert_true(r->optim.split_master);
    assert_int_equal(r->optim.master_dtype, AM_BF16);
    assert_int_equal(r->optim.moment_dtype[0], AM_BF16);
    assert_int_equal(r->optim.moment_dtype[1], AM_F32);
    assert_false(r->optim.adam_w_mode);
    assert_false(r->optim.bias_correction);
    am_recipe_free(r);
    /* without it, whole fp32 masters */
    snprintf(y, sizeof(y),
             "%soptimizer:\n  _target_: transformer_engine.pytorch.optimizers.fused_adam.FusedAdam\n"
             "  master_weights: true\n  store_param_remainders: false\n",
             arch);
    r = parse_with("r.yaml", y, NULL, &err);
    assert_int_equal(err.n, 0);
    assert_false(r->optim.split_master);
    assert_int_equal(r->optim.master_dtype, AM_F32);
    am_recipe_free(r);
    /* torch's AdamW keeps everything in the parameters' dtype */
    r = parse_with("r.yaml", arch, NULL, &err);
    assert_false(r->optim.te);
    assert_int_equal(r->optim.master_dtype, r->param_dtype);
    assert_int_equal(r->optim.moment_dtype[0], r->param_dtype);
    am_recipe_free(r);
    /* another FusedAdam (apex's) and FlashAdamW keep their refusal */
    snprintf(y, sizeof(y), "%soptimizer:\n  _target_: apex.optimizers.FusedAdam\n", arch);
    r = parse_with("r.yaml", y, NULL, &err);
    assert_int_equal(err.n, 1);
    assert_non_null(strstr(err.msg[0], "'apex.optimizers.FusedAdam' is not an optimizer am runs: its update is AdamW's"));
    am_recipe_free(r);
    am_errors_free(&err);
}

/* AutoModel's defaults, each from its key's row: a recipe that leaves every key out */
static void test_defaults(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    struct am_recipe *r = parse_with("r.yaml", arch, NULL, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->dist.strategy, AM_FSDP2);
    assert_int_equal(r->dist.zero_dp_strategy, 3);
    assert_true(r->dist.reshard_after_forward);
    assert_int_equal(r->dist.pipeline.schedule, AM_PP_1F1B);
    assert_int_equal(r->dist.pipeline.microbatch_size, 1);
    assert_int_equal(r->steps.num_epochs, 1);
    assert_true(r->data.shuffle);
    assert_true(r->drop_long_samples);
    assert_string_equal(r->optim.name, "adamw");
    assert_float_equal(r->optim.lr, 1e-4, 0);
    assert_float_equal(r->optim.beta1, 0.9, 0);
    assert_float_equal(r->optim.beta2, 0.999, 0);
    assert_float_equal(r->optim.eps, 1e-8, 0);
    assert_float_equal(r->optim.weight_decay, 0.01, 0);
    assert_float_equal(r->optim.max_grad_norm, 1.0, 0);
    assert_int_equal(r->lr.style, AM_LR_CONSTANT);
    assert_true(r->ckpt.save_consolidated);
    assert_false(r->ckpt.consolidated_final);
    assert_float_equal(r->dist_env.timeout_minutes, 10, 0);
    assert_int_equal(r->seed, 42);
    assert_int_equal(r->param_dtype, AM_BF16);
    assert_false(r->peft.enabled);
    assert_int_equal(r->peft.dim, 0); /* no peft section: no adapters' defaults */
    am_recipe_free(r);
    /* max_norm: null turns clipping off; a peft section takes its dim and alpha defaults */
    r = parse_with("r.yaml", arch, (const char *[]){"clip_grad_norm.max_norm=null", "peft.target_modules=['*_proj']", NULL},
                   &err);
    assert_int_equal(err.n, 0);
    assert_float_equal(r->optim.max_grad_norm, 0, 0);
    assert_true(r->peft.enabled);
    assert_int_equal(r->peft.dim, 8);
    assert_float_equal(r->peft.alpha, 32, 0);
    assert_float_equal(r->peft.dropout, 0, 0); /* AutoModel's defaults: no dropout, "post" */
    assert_false(r->peft.dropout_pre);
    am_recipe_free(r);
    /* adapter dropout: its probability and position */
    r = parse_with("r.yaml", arch,
                   (const char *[]){"peft.target_modules=['*_proj']", "peft.dropout=0.1", "peft.dropout_position=pre",
                                    NULL},
                   &err);
    assert_int_equal(err.n, 0);
    assert_float_equal(r->peft.dropout, 0.1, 0);
    assert_true(r->peft.dropout_pre);
    am_recipe_free(r);
    am_errors_free(&err);
    expect(arch, (const char *[]){"peft.target_modules=['*_proj']", "peft.dropout_position=middle", NULL},
           MSGS("--set peft.dropout_position=middle: peft.dropout_position: 'middle' is not one of: post, pre"));
    expect(arch, (const char *[]){"peft.target_modules=['*_proj']", "peft.dropout=1.0", NULL},
           MSGS("--set peft.dropout=1.0: peft.dropout: 1.0: the adapters' dropout probability must be in [0, 1) (0.0: "
                "no dropout)"));

    /* a mixture of experts: the attention adapted ('*_proj' matches no module of the expert
     * layers' MLP), the experts too when a pattern matches them ('*', '*.experts': AutoModel's
     * GroupedExpertsLoRA); the experts of some layers only and a dense layer's MLP refused */
#define MOE "model:\n  model_type: qwen3_moe\n  hidden_size: 64\n  num_hidden_layers: 2\n  num_attention_heads: 4\n" \
            "  vocab_size: 64\n  intermediate_size: 128\n  moe_intermediate_size: 32\n  num_experts: 4\n" \
            "  num_experts_per_tok: 2\n"
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.target_modules=['*_proj']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, 1u << AM_LORA_Q | 1u << AM_LORA_K | 1u << AM_LORA_V | 1u << AM_LORA_O);
    assert_false(r->peft.experts);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.target_modules=['*']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets,
                     1u << AM_LORA_Q | 1u << AM_LORA_K | 1u << AM_LORA_V | 1u << AM_LORA_O | 1u << AM_LORA_HEAD);
    assert_true(r->peft.experts);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.target_modules=['*.experts']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, 0);
    assert_true(r->peft.experts);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.match_all_linear=true", NULL}, &err); /* linear layers only */
    assert_int_equal(err.n, 0);
    assert_false(r->peft.experts);
    am_recipe_free(r);
    am_errors_free(&err);
    expect(MOE, (const char *[]){"peft.target_modules=['model.layers.0.mlp.experts']", NULL},
           MSGS("--set peft.target_modules=['model.layers.0.mlp.experts']: peft: the patterns select the experts in 1 "
                "of the 2 mixture-of-experts layers; am adapts the experts in every such layer or in none (select "
                "them in all layers, as '*.experts')"));
    /* moe_rank_scaling (AutoModel's): the experts' adapters of rank dim // num_experts_per_tok,
     * rounded down with a note; below 1 refused by am_validate_run (tests/recipe/refusals.tsv) */
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.target_modules=['*_proj', '*.experts']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_false(r->peft.rank_scaling);
    assert_int_equal(r->peft.experts_dim, 8);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.target_modules=['*_proj', '*.experts']",
                                                   "peft.moe_rank_scaling=true", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_true(r->peft.experts && r->peft.rank_scaling);
    assert_int_equal(r->peft.dim, 8);
    assert_int_equal(r->peft.experts_dim, 4);
    for (size_t j = 0; j < r->notes.n; j++) /* no note of the rank's scaling (that of bf16 storage: MOE has no torch_dtype) */
        assert_null(strstr(r->notes.v[j], "moe_rank_scaling"));
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.target_modules=['*.experts']", "peft.moe_rank_scaling=true",
                                                   "peft.dim=7", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.experts_dim, 3);
    bool floored = false;
    for (size_t j = 0; j < r->notes.n; j++)
        floored |= strcmp(r->notes.v[j], "peft.moe_rank_scaling: dim 7 is not a multiple of num_experts_per_tok 2: "
                          "the experts' adapters take rank 7 // 2 = 3, rounded down as AutoModel does") == 0;
    assert_true(floored);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", MOE, (const char *[]){"peft.target_modules=['*_proj']", "peft.moe_rank_scaling=true",
                                                   NULL}, &err); /* no expert adapted: nothing changes */
    assert_int_equal(err.n, 0);
    assert_false(r->peft.experts);
    assert_int_equal(r->peft.experts_dim, 8);
    am_recipe_free(r);
    am_errors_free(&err);
    static const char moe_fix[] = "on a mixture-of-experts model am adapts the attention projections (target_modules: "
                                  "['*.q_proj', '*.k_proj', '*.v_proj', '*.o_proj'])";
    char want[512];
    snprintf(want, sizeof(want), "--set peft.target_modules=['*_proj']: peft: the patterns select "
             "model.layers.1.mlp.gate_proj of dense layer 1: adapters on the MLP of a mixture-of-experts model's dense "
             "layers are not supported by am yet; %s", moe_fix);
    expect(MOE "  mlp_only_layers: [1]\n", (const char *[]){"peft.target_modules=['*_proj']", NULL}, MSGS(want));
#undef MOE
    /* DeepSeekMoE (glm4_moe): the dense layers' MLP (mlp.gate_proj) and the shared experts'
     * (mlp.shared_experts.gate_proj) are one target each: '*_proj', '*.gate_proj' and
     * match_all_linear select both; a pattern that selects one kind alone is refused */
#define GLM "model:\n  model_type: glm4_moe\n  hidden_size: 64\n  num_hidden_layers: 3\n  num_attention_heads: 4\n" \
            "  vocab_size: 64\n  intermediate_size: 128\n  moe_intermediate_size: 32\n  n_routed_experts: 4\n" \
            "  num_experts_per_tok: 2\n  first_k_dense_replace: 1\n"
    unsigned all = (1u << (AM_LORA_DOWN + 1)) - 1;
    r = parse_with("r.yaml", GLM, (const char *[]){"peft.target_modules=['*_proj']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, all);
    assert_false(r->peft.experts);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", GLM, (const char *[]){"peft.match_all_linear=true", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, all | 1u << AM_LORA_HEAD);
    assert_false(r->peft.experts);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", GLM, (const char *[]){"peft.target_modules=['*.down_proj', '*.experts']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, 1u << AM_LORA_DOWN);
    assert_true(r->peft.experts);
    am_recipe_free(r);
    am_errors_free(&err);
    expect(GLM, (const char *[]){"peft.target_modules=['*.mlp.gate_proj']", NULL},
           MSGS("--set peft.target_modules=['*.mlp.gate_proj']: peft: the patterns select gate_proj in 1 of the 3 "
                "layers with an MLP (the dense layers' mlp.gate_proj, the shared experts' "
                "mlp.shared_experts.gate_proj); am adapts a projection in every such layer or in none (select it "
                "in all, as '*.gate_proj')"));
    expect(GLM, (const char *[]){"peft.target_modules=['*.shared_experts.up_proj']", NULL},
           MSGS("--set peft.target_modules=['*.shared_experts.up_proj']: peft: the patterns select up_proj in 2 of "
                "the 3 layers with an MLP (the dense layers' mlp.up_proj, the shared experts' "
                "mlp.shared_experts.up_proj); am adapts a projection in every such layer or in none (select it in "
                "all, as '*.up_proj')"));
#undef GLM
    /* deepseek_v3: multi-head latent attention's q_a_proj, q_b_proj, kv_a_proj_with_mqa (which
     * '*_proj' does not match), kv_b_proj and o_proj */
#define DSV3_BASE "model:\n  model_type: deepseek_v3\n  hidden_size: 64\n  num_hidden_layers: 3\n" \
             "  num_attention_heads: 4\n  num_key_value_heads: 4\n  vocab_size: 64\n  intermediate_size: 128\n" \
             "  moe_intermediate_size: 32\n  n_routed_experts: 4\n  num_experts_per_tok: 2\n  n_group: 1\n" \
             "  topk_group: 1\n  first_k_dense_replace: 1\n  kv_lora_rank: 16\n" \
             "  qk_nope_head_dim: 8\n  qk_rope_head_dim: 8\n  v_head_dim: 12\n"
#define DSV3 DSV3_BASE "  q_lora_rank: 24\n"
    unsigned mlp = 1u << AM_LORA_GATE | 1u << AM_LORA_UP | 1u << AM_LORA_DOWN;
    r = parse_with("r.yaml", DSV3, (const char *[]){"peft.target_modules=['*_proj']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, 1u << AM_LORA_Q | 1u << AM_LORA_O | 1u << AM_LORA_Q_A | 1u << AM_LORA_KV_B | mlp);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", DSV3, (const char *[]){"peft.match_all_linear=true", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, 1u << AM_LORA_Q | 1u << AM_LORA_O | 1u << AM_LORA_Q_A | 1u << AM_LORA_KV_A |
                                          1u << AM_LORA_KV_B | mlp | 1u << AM_LORA_HEAD);
    am_recipe_free(r);
    am_errors_free(&err);
    r = parse_with("r.yaml", DSV3_BASE "  q_lora_rank: null\n", /* q_lora_rank null: q_proj */
                   (const char *[]){"peft.target_modules=['*.q_proj']", NULL}, &err);
    assert_int_equal(err.n, 0);
    assert_int_equal(r->peft.targets, 1u << AM_LORA_Q);
    am_recipe_free(r);
    am_errors_free(&err);
    expect(DSV3, (const char *[]){"peft.target_modules=['*.k_proj']", NULL},
           MSGS("--set peft.target_modules=['*.k_proj']: peft.target_modules: '*.k_proj' matches none of the linear "
                "layers am adapts (model.layers.N.self_attn.{q_a,q_b,kv_a,kv_b,o}_proj (kv_a_proj_with_mqa), "
                "model.layers.N.mlp.{gate,up,down}_proj, lm_head)"));
#undef DSV3
#undef DSV3_BASE
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_positions_and_types),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_te_fused_adam),
        cmocka_unit_test(test_yaml_errors),
        cmocka_unit_test(test_yaml_limits),
        cmocka_unit_test(test_aliases_resolve),
        cmocka_unit_test(test_unknown_keys),
        cmocka_unit_test(test_automodel_recipe_loads),
        cmocka_unit_test(test_mixed_precision_policy),
        cmocka_unit_test(test_overrides),
        cmocka_unit_test(test_strategy_from_target),
        cmocka_unit_test(test_model_rules),
        cmocka_unit_test(test_model_windows), cmocka_unit_test(test_model_qwen2), cmocka_unit_test(test_model_gemma), cmocka_unit_test(test_model_gpt_oss),
        cmocka_unit_test(test_model_moe_layers), cmocka_unit_test(test_model_bias_update),
        cmocka_unit_test(test_model_from_hf_cache),
        cmocka_unit_test(test_model_shipped_configs),
        cmocka_unit_test(test_env_interpolation),
        cmocka_unit_test(test_recipe_files),
    };
    return cmocka_run_group_tests_name("recipe", tests, setup_tmp, teardown_tmp);
}
