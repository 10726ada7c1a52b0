/* plan.h - the parallel plan: which rank does what, and what it costs.
 *
 * Given a recipe and a world (how many GPUs, how they sit in nodes and NVLink domains),
 * the planner checks every layout rule (validate.c), then computes:
 *   - the sizes: dp inferred as world / (tp*pp*cp), dp = dp_replicate * dp_shard, and the
 *     expert mesh ep_shard * ep = dp * cp;
 *   - the device mesh (pp, dp_replicate, dp_shard, cp, tp), tp innermost, so a rank is
 *       rank = (((pp * R + dp_replicate) * S + dp_shard) * C + cp) * T + tp;
 *     and each rank's expert coordinates: within a (pp, tp) slice the dp*cp ranks, in mesh
 *     order, form (ep_shard, ep) with ep innermost;
 *   - the pipeline: pp * v stages (v virtual stages per rank for interleaved schedules),
 *     stage s on pp rank s % pp, layers split evenly, embedding on the first stage and the
 *     output head on the last;
 *   - batches: micro-batches per step and gradient-accumulation steps;
 *   - a per-GPU memory estimate and the FLOPs of one step (docs/recipes.md gives the
 *     formulas and where they come from).
 */
#ifndef AM_PLAN_H
#define AM_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "errors.h"
#include "recipe.h"

/* The most micro-batches x virtual stages per rank and step the planner simulates. */
#define AM_PLAN_MAX_PIPE_PASSES (1 << 16)

struct am_world {
    int size;          /* ranks in the job */
    int nodes;         /* 0: unknown */
    int gpus_per_node; /* 0: unknown or uneven */
    int nvlink_domain; /* GPUs per NVLink domain; 0: unknown (not checked) */
    double gpu_mem;    /* bytes per GPU; 0: not checked */
};

enum am_group {
    AM_GROUP_TP,           /* tensor (+sequence) parallel */
    AM_GROUP_CP,           /* context parallel */
    AM_GROUP_PP,           /* pipeline: the pp ranks of one model replica */
    AM_GROUP_DP,           /* data parallel: dp_replicate x dp_shard */
    AM_GROUP_DP_SHARD,     /* FSDP sharding group: dp_shard x cp */
    AM_GROUP_DP_REPLICATE, /* HSDP replicas */
    AM_GROUP_DP_CP,        /* gradient reduction with cp: dp x cp */
    AM_GROUP_EP,           /* expert parallel */
    AM_GROUP_EP_SHARD,     /* the ranks holding the same experts (dp x cp / ep; with HSDP across the replicas) */
    AM_NGROUPS
};

struct am_coords {
    int pp, dp_replicate, dp_shard, cp, tp;
    int ep, ep_shard;
};

struct am_stage {
    int pp_rank;
    int first_layer, n_layers;
    bool embedding, head;
};

/* Bytes per GPU on the most loaded pipeline rank. */
struct am_memory {
    double params;          /* parameters held by the rank before data-parallel sharding */
    double weights, grads, optimizer; /* after data-parallel sharding (am_plan.zero_stage) */
    double gathered;        /* ZeRO-3: unsharded parameters of the layers in flight */
    double grad_buffers;    /* ZeRO-2/3: the per-group gradient buffers of the backward (each
                               with its reduce_dtype copy and receive shard) */
    double activations;     /* saved for backward, at the schedule's peak */
    double p2p;             /* pipeline: buffers of the hidden states sent to the neighbours
                               and one received (pipeline.h) */
    double scratch;         /* the model's buffers beside the saved tensors (work buffers,
                               the loss's, the rotary tables, the slots' token ids) */
    double kernel_scratch;  /* the CUDA kernels' device scratch at its largest (the head's
                               cross-entropy tiles, the attention backward's buffers:
                               kernels/cuda/cuda_impl.h); the model allocates none of it */
    double alltoall;        /* expert parallelism: the experts' all-to-all send buffer (the
                               rank's own slots; runtime/model/moe.c) */
    double expert_rows;     /* expert parallelism: the buffers sized to the loads (moe.h): each
                               slot's saved expert rows and the work rows, at the balanced load
                               (S = micro-batch tokens x top_k rows a MoE layer on every rank) */
    double expert_rows_worst; /* the same at the worst load, every slot of the ep group routed to
                               this rank's experts (ep x S rows a MoE layer); not in total */
    double adapter_params;  /* LoRA: the trainable adapter parameters the rank holds (their bytes are
                               in weights, grads and optimizer; the frozen base has none in the
                               last two) */
    double total;
    int pp_rank;            /* which pipeline rank this is */
};

struct am_plan {
    int world, tp, pp, cp, ep, dp, dp_replicate, dp_shard, ep_shard;
    int virtual_stages; /* per pp rank */
    int n_stages;       /* pp * virtual_stages */
    struct am_stage *stages;
    long global_batch, local_batch, microbatch_size, n_microbatches, grad_accum;
    long seq_length;
    bool seq_length_assumed;
    struct am_param_count params;
    /* what am-train shards over data parallelism (ZeRO stage): 1 the optimizer state, 2 also
     * the gradients, 3 also the weights; 0, a full replica on each data-parallel rank, for
     * every strategy until fully sharded data parallel lands */
    int zero_stage;
    struct am_memory mem;       /* the most loaded pipeline rank's */
    struct am_memory *mem_pp;   /* [pp]: each pipeline rank's */
    double tokens_per_step, flops_per_step;
};

/* Checks all rules for this world and fills the plan. Returns 0, or -1 with every
 * violation in err (or why it could not be planned: a pipeline schedule of more than
 * AM_PLAN_MAX_PIPE_PASSES forward passes per rank, or no memory). The plan is freed with
 * am_plan_free in either case. */
int am_plan_build(const struct am_recipe *r, const struct am_world *w, struct am_plan *p, struct am_errors *err);
void am_plan_free(struct am_plan *p);

/* When w->gpu_mem is set and the estimate exceeds it: appends an error saying by how much
 * and which settings would fit (each tried on a copy of the recipe). Returns -1 then. */
int am_plan_check_memory(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p,
                         struct am_errors *err);

void am_plan_coords(const struct am_plan *p, int rank, struct am_coords *c);
int am_plan_rank(const struct am_plan *p, const struct am_coords *c);
/* The members of rank's group of kind g, ascending; returns how many (members must hold
 * p->world entries). */
int am_plan_group(const struct am_plan *p, enum am_group g, int rank, int *members);
const char *am_group_name(enum am_group g);

/* The plan as the table am-plan prints (plan_print.c). */
void am_plan_print(FILE *f, const struct am_recipe *r, const struct am_world *w, const struct am_plan *p);
/* "70.55B", "2.10M", "1024": counts for people. */
const char *am_format_count(double n, char *buf, size_t len);
/* "93.1 GiB", or "512.0 MiB" below one GiB. */
const char *am_format_bytes(double bytes, char *buf, size_t len);

/* ---- plan_ckpt.c: what a sharded checkpoint costs, and the lead of Slurm's warning ---- */

/* A save as am-train writes it (docs/checkpoints.md): each writing rank's shard file holds 12
 * bytes a parameter it keeps optimizer state for (fp32 master, AdamW's two moments: 1.5 times
 * the plan's optimizer bytes); with checkpoint.save_consolidated one rank then writes the
 * Hugging Face export, 4 bytes a parameter. With LoRA the state is the adapters' and the export
 * their peft files (4 bytes an adapter parameter, written with or without save_consolidated). Ranks sit on nodes in rank order, w->gpus_per_node
 * to a node. */
struct am_ckpt_cost {
    double bytes;      /* the whole checkpoint: every shard and the export */
    double rank_bytes; /* the largest shard file */
    double node_bytes; /* the most shard bytes the writing ranks of one node write */
    double hf_bytes;   /* the Hugging Face export a save writes; 0 without save_consolidated or with final */
    long writers;      /* ranks that write a shard */
};
void am_plan_ckpt_cost(const struct am_recipe *r, const struct am_world *w, const struct am_plan *p,
                       struct am_ckpt_cost *c);

/* The lead of `#SBATCH --signal=B:USR1@LEAD`: the warned ranks finish their step, save and
 * exit before the time limit, so LEAD covers one step and one save with a margin:
 *   LEAD = ceil(AM_LEAD_FACTOR * (step_s + save_s)), at least AM_LEAD_MIN_S
 * (step_s < 0: not known, left out). AM_CKPT_BW is the write bandwidth per node assumed
 * without a measured one (bytes/s). */
#define AM_LEAD_FACTOR 1.5
#define AM_LEAD_MIN_S 60
#define AM_CKPT_BW (1024.0 * 1024 * 1024)
/* A save's time at bw bytes/s per node: the busiest node's shards, then the export. */
double am_plan_save_s(const struct am_ckpt_cost *c, double bw);
long am_plan_lead_s(double step_s, double save_s);

/* ---- validate.c ---- */

/* The layout rules. With w NULL, only the rules that need no knowledge of the job's size
 * (what sbatch can check before an allocation exists). Returns the number of errors added. */
int am_validate(const struct am_recipe *r, const struct am_world *w, struct am_errors *err);

/* Whether am-train runs r at w: the layout rules (am_validate) and what the trainer runs of the
 * recipe (combinations of dtypes, parallelisms, models and adapters it does not run yet, a
 * dataset it cannot read), each refused with the reason and what to use instead. The one
 * validation that sbatch (w NULL), srun, am-plan and every rank at its start call, so a recipe
 * that passes it is one am-train runs. Returns the number of errors added. */
int am_validate_run(const struct am_recipe *r, const struct am_world *w, struct am_errors *err);

/* Sequence length for planning (and am-train's samples): a Megatron dataset's seq_length; else
 * packed_sequence_size (AutoModel packs the samples of its other datasets into sequences of that
 * many tokens), else dataset.seq_length or seq_len, else distributed.pipeline.pp_seq_len (with
 * pp > 1), else 2048 (*assumed set). */
long am_recipe_seq_length(const struct am_recipe *r, bool *assumed);

#endif
