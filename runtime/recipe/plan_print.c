/* plan_print.c - the plan as a table for people (plan.h: am_plan_print). */
#include <stdio.h>

#include "plan.h"

const char *am_format_count(double n, char *buf, size_t len)
{
    if (n >= 1e15)
        snprintf(buf, len, "%.2fP", n / 1e15);
    else if (n >= 1e12)
        snprintf(buf, len, "%.2fT", n / 1e12);
    else if (n >= 1e9)
        snprintf(buf, len, "%.2fB", n / 1e9);
    else if (n >= 1e6)
        snprintf(buf, len, "%.2fM", n / 1e6);
    else
        snprintf(buf, len, "%.0f", n);
    return buf;
}

void am_plan_print(FILE *f, const struct am_recipe *r, const struct am_world *w, const struct am_plan *p)
{
    char a[32], b[32], c[32], d[32], e[32];
    const struct am_memory *m = &p->mem;
    fprintf(f, "recipe       %s\n", r->file);
    fprintf(f, "model        %s, %s parameters, %ld layers, hidden %ld, %ld heads (%ld kv)%s\n", r->model.model_type,
            am_format_count(p->params.total, a, sizeof(a)), r->model.num_hidden_layers, r->model.hidden_size,
            r->model.num_attention_heads, r->model.num_key_value_heads,
            r->model.num_experts ? ", mixture of experts" : "");
    fprintf(f, "             from %s\n", r->model_source);
    if (r->model.fp8)
        fprintf(f, "             an FP8 checkpoint (e4m3, one scale per %ld x %ld block): dequantised at load\n",
                r->model.fp8_block[0], r->model.fp8_block[1]);
    if (r->model.mxfp4)
        fprintf(f, "             an MXFP4 checkpoint (the experts' e2m1 blocks, one e8m0 scale per 32 values): dequantised "
                "at load\n");
    fprintf(f, "world        %d rank%s on %d node%s", p->world, p->world == 1 ? "" : "s", w->nodes,
            w->nodes == 1 ? "" : "s");
    if (w->gpus_per_node)
        fprintf(f, " (%d per node)", w->gpus_per_node);
    if (w->nvlink_domain)
        fprintf(f, ", NVLink domains of %d GPUs\n", w->nvlink_domain);
    else
        fprintf(f, ", NVLink domains not known (tp is not checked against them)\n");
    fprintf(f, "layout       tp %d x pp %d x cp %d x dp %d (replicate %d x shard %d); ep %d (ep_shard %d); %s%s\n", p->tp,
            p->pp, p->cp, p->dp, p->dp_replicate, p->dp_shard, p->ep, p->ep_shard, am_strategy_name(r->dist.strategy),
            r->dist.sequence_parallel ? ", sequence parallel" : "");
    if (p->pp > 1 && p->stages[0].n_layers == p->stages[p->n_stages - 1].n_layers)
        fprintf(f, "pipeline     %s: %d stages of %d layers (%d per rank), %ld micro-batches of %ld\n",
                am_pp_schedule_name(r->dist.pipeline.schedule), p->n_stages, p->stages[0].n_layers, p->virtual_stages,
                p->n_microbatches, p->microbatch_size);
    else if (p->pp > 1) /* the first stages one layer more (plan.c) */
        fprintf(f, "pipeline     %s: %d stages of %d or %d layers (%d per rank), %ld micro-batches of %ld\n",
                am_pp_schedule_name(r->dist.pipeline.schedule), p->n_stages, p->stages[0].n_layers,
                p->stages[p->n_stages - 1].n_layers, p->virtual_stages, p->n_microbatches, p->microbatch_size);
    fprintf(f, "batch        global %ld = local %ld x dp %d x %ld accumulation steps; sequence %ld%s; %s tokens/step\n",
            p->global_batch, p->local_batch, p->dp, p->grad_accum, p->seq_length,
            p->seq_length_assumed ? " (assumed: set dataset.seq_len or seq_length)" : "",
            am_format_count(p->tokens_per_step, b, sizeof(b)));
    fprintf(f, "memory/GPU   %s on pp rank %d", am_format_bytes(m->total, a, sizeof(a)), m->pp_rank);
    if (w->gpu_mem > 0)
        fprintf(f, " of %s", am_format_bytes(w->gpu_mem, b, sizeof(b)));
    fprintf(f, "\n             weights %s, gradients %s, optimizer %s, gathered %s",
            am_format_bytes(m->weights, a, sizeof(a)), am_format_bytes(m->grads, b, sizeof(b)),
            am_format_bytes(m->optimizer, c, sizeof(c)), am_format_bytes(m->gathered, d, sizeof(d)));
    if (m->grad_buffers > 0)
        fprintf(f, ", gradient buffers %s", am_format_bytes(m->grad_buffers, a, sizeof(a)));
    fprintf(f, ", activations %s", am_format_bytes(m->activations, e, sizeof(e)));
    fprintf(f, ", scratch %s", am_format_bytes(m->scratch, a, sizeof(a)));
    if (m->kernel_scratch > 0)
        fprintf(f, ", kernels' scratch %s", am_format_bytes(m->kernel_scratch, a, sizeof(a)));
    if (p->pp > 1)
        fprintf(f, ", pipeline buffers %s", am_format_bytes(m->p2p, a, sizeof(a)));
    if (m->alltoall > 0)
        fprintf(f, ", all-to-all buffers %s", am_format_bytes(m->alltoall, a, sizeof(a)));
    fputc('\n', f);
    if (m->expert_rows > 0)
        fprintf(f, "             received expert rows %s at the balanced load (in the total; %s if every slot of "
                "the ep group chose this rank's experts)\n", am_format_bytes(m->expert_rows, a, sizeof(a)),
                am_format_bytes(m->expert_rows_worst, b, sizeof(b)));
    fprintf(f, "             %s parameters%s, %s compute%s\n", am_dtype_torch_name(r->param_dtype),
            r->param_dtype_assumed ? " (assumed: set model.torch_dtype)" : "", am_dtype_torch_name(r->compute_dtype),
            r->dist.activation_checkpointing ? ", activation checkpointing" : "");
    if (r->optim.te)
        fprintf(f, "optimizer    Transformer Engine's FusedAdam (%s): %s masters%s, %s exp_avg, %s exp_avg_sq\n",
                r->optim.adam_w_mode ? "adam_w_mode" : "L2 weight decay",
                r->optim.split_master ? "float32" : am_dtype_torch_name(r->optim.master_dtype),
                r->optim.split_master ? " (the bfloat16 parameters and their 16-bit remainders)" : "",
                am_dtype_torch_name(r->optim.moment_dtype[0]), am_dtype_torch_name(r->optim.moment_dtype[1]));
    if (r->peft.enabled) {
        fprintf(f, "lora         dim %ld, alpha %g on", r->peft.dim, r->peft.alpha);
        for (int t = 0; t < AM_LORA_NTARGETS; t++)
            if (r->peft.targets & (1u << t))
                fprintf(f, " %s", am_lora_target_name_of(&r->model, (enum am_lora_target)t));
        if (r->peft.experts && r->peft.rank_scaling) /* AutoModel's moe_rank_scaling */
            fprintf(f, " experts (gate, up, down of each, at rank %ld: dim / num_experts_per_tok)",
                    r->peft.experts_dim);
        else if (r->peft.experts)
            fprintf(f, " experts (gate, up, down of each)");
        fprintf(f, "; %s adapter parameters on pp rank %d (trained; the base frozen: no gradients or optimizer "
                "state)\n", am_format_count(m->adapter_params, a, sizeof(a)), m->pp_rank);
    }
    if (p->zero_stage == 0 && p->dp > 1 && r->dist.strategy == AM_MEGATRON_FSDP && r->peft.enabled)
        fprintf(f, "note         LoRA with zero_dp_strategy %d shards nothing: each data-parallel rank keeps the "
                "frozen base whole (zero_dp_strategy 3 shards it), and the memory above counts it\n",
                r->dist.zero_dp_strategy);
    else if (p->zero_stage == 0 && p->dp > 1 && r->dist.strategy == AM_MEGATRON_FSDP)
        fprintf(f, "note         %s does not shard yet: each data-parallel rank keeps full weights, gradients and "
                "optimizer state, as ddp does, and the memory above counts them\n", am_strategy_name(r->dist.strategy));

    fprintf(f, "compute      %s FLOP per step\n", am_format_count(p->flops_per_step, a, sizeof(a)));
}
