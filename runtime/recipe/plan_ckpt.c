/* plan_ckpt.c - the bytes of a sharded checkpoint per rank and per node, the time of a save and
 * the lead of Slurm's warning before the time limit (plan.h). */
#include <math.h>

#include "plan.h"

/* Whether the rank at c writes a shard (the trainer's rule: train/dp.c, am_dp_state): sharded
 * state (ZeRO 1-3) is written by the first replica group (HSDP's others hold copies, but of
 * the experts with expert parallelism: sharded across the replicas, every rank writes); a full
 * replica (and LoRA's adapters, whose base alone is sharded) by data-parallel and
 * context-parallel rank 0 alone. */
static bool writes(const struct am_recipe *r, const struct am_plan *p, const struct am_coords *c)
{
    if (p->zero_stage >= 1 && !r->peft.enabled) /* LoRA's state, the adapters, is replicated */
        return c->dp_replicate == 0 || (p->ep > 1 && r->model.num_experts > 0);
    return c->dp_replicate == 0 && c->dp_shard == 0 && c->cp == 0;
}

void am_plan_ckpt_cost(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p,
                       struct am_ckpt_cost *c)
{
    *c = (struct am_ckpt_cost){0};
    int per_node = w->gpus_per_node > 0 ? w->gpus_per_node : p->world;
    double node = 0;
    for (int rank = 0; rank < p->world; rank++) {
        struct am_coords co;
        am_plan_coords(p, rank, &co);
        if (rank % per_node == 0)
            node = 0;
        if (!writes(r, p, &co))
            continue;
        /* the optimizer state is two moments an element the rank updates (4 bytes each in fp32,
         * 2 in bf16); its file holds them and the master, each fp32: 12 bytes */
        const struct am_memory *m = p->mem_pp && co.pp < p->pp ? &p->mem_pp[co.pp] : &p->mem;
        double b = 12 * m->optimizer /
                   (double)(am_dtype_size(r->optim.moment_dtype[0]) + am_dtype_size(r->optim.moment_dtype[1]));
        c->writers++;
        c->bytes += b;
        node += b;
        if (b > c->rank_bytes)
            c->rank_bytes = b;
        if (node > c->node_bytes)
            c->node_bytes = node;
    }
    /* save_consolidated: final writes the export with the last checkpoint only, never with a
     * save on Slurm's warning: a save costs it with every (or true) alone */
    c->hf_bytes = r->ckpt.save_consolidated && !r->ckpt.consolidated_final ? 4 * p->params.total : 0;
    if (r->peft.enabled) /* LoRA: the adapters as peft saves them (step-N/peft), always, in place of the export */
        c->hf_bytes = 4 * (am_lora_layers_params(r) + am_lora_head_params(r) +
                           am_lora_expert_params(r, true));
    c->bytes += c->hf_bytes;
}

double am_plan_save_s(const struct am_ckpt_cost *c, double bw)
{
    return bw > 0 ? (c->node_bytes + c->hf_bytes) / bw : 0;
}

long am_plan_lead_s(double step_s, double save_s)
{
    double s = AM_LEAD_FACTOR * ((step_s > 0 ? step_s : 0) + (save_s > 0 ? save_s : 0));
    double lead = ceil(s);
    return lead < AM_LEAD_MIN_S ? AM_LEAD_MIN_S : lead > 1e9 ? 1000000000L : (long)lead;
}
