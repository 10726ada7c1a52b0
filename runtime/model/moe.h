/* moe.h - the mixture-of-experts block of a decoder layer (mixtral; qwen3_moe's sparse
 * layers), as transformers computes it, on one rank holding all the experts (ep 1) or with
 * the experts split over an expert-parallel group (below):
 *
 *   logits = h · Wgᵀ (the router, [E, C]); probs = softmax(logits) in fp32; the top-k
 *   experts of each token, their probabilities renormalised to sum to 1 (Mixtral always,
 *   Qwen3-MoE when norm_topk_prob); out = Σ_j w_j · down_e(silu(gate_e h) * up_e h).
 *
 * Dropless: every token goes to its k experts, however many choose one expert. The tokens are
 * sorted by expert (moe_plan, stable), the experts' three linear layers run as grouped GEMMs
 * over the sorted rows, and the results are combined back with the routing weights (kernels.h).
 * The per-expert counts are read by the host after the router (one wait for the device per
 * MoE layer and micro-batch): the grouped GEMMs are sized on the host, and the counts feed the
 * step's tokens-per-expert statistics.
 *
 * The load-balancing loss (transformers' load_balancing_loss_func, when the config has
 * output_router_logits): over the R = (MoE layers) x N rows of all the layers' router
 * probabilities of a micro-batch, aux = E Σ_e f_e P_e with f_e the share of the top-k slots
 * that chose e (Σ f = k) and P_e the mean probability of e. The micro-batch adds
 * router_aux_loss_coef * aux * (its tokens with a target) to the loss sum, so that with the
 * trainer's 1 / (tokens of the batch) scale the loss is transformers' loss_lm + coef * aux for
 * one micro-batch, and the token-weighted mean of the micro-batches' aux over several.
 * Context parallelism (m->cp: each cp rank holds T / cp rows of every sequence, ring.h): the
 * statistics are those of the whole sequences, as AutoModel's Gate computes them under cp (its
 * expert_load, expert_scores and context_length summed over the cp group): at the end of a
 * micro-batch's forward cnt and psum are summed over the cp ranks (in place, so the backward's
 * gradient uses the global counts), R counts the rows of all the cp ranks, and each rank adds
 * coef * aux * (its own tokens with a target), so that the loss summed over dp x cp is one
 * rank's; its gradient scale is that of coef * aux * (the whole micro-batch's tokens with a
 * target), whose derivative with respect to this rank's probabilities it is. Three small
 * all-reduces per micro-batch (cnt, psum, the targets' count).
 *
 * AutoModel's own load-balancing loss (cfg aux_loss_coeff > 0: AutoModel's Gate of the MoEs it
 * builds itself, deepseek_v3, glm4_moe, gpt_oss, qwen3_moe; model_config.h): per MoE layer and
 * micro-batch, over its T tokens (the whole sequences under cp), aux = Σ_e f_e P_e with
 * f_e = load_e E / (k T) (load_e: the top-k slots that chose e) and P_e = Σ_t q_te / T, q the
 * softmax over all the experts (softmax routers, gpt_oss's included) or the sigmoid scores,
 * divided by their sum + 1e-20 with norm_topk_prob and k > 1 (AutoModel's original_scores). Each
 * layer's forward counts load and Σ q (moe_aux_stats, in fp32) and sums them over the cp group
 * (one all-reduce of 2E floats per layer and micro-batch, as AutoModel's gate sums them), kept
 * with the layer's activations; a recomputation in the backward (activation checkpointing)
 * counts nothing again. Nothing is added to the loss (AutoModel's MoEAuxLossAutoScaler): the
 * router's backward adds the gradient of aux_loss_coeff x aux / (dp x micro-batches) with respect
 * to the rank's scores (moe_route_backward, moe_route_sigmoid_backward: aux_scale x load_e on
 * every score), which summed over dp x cp is aux_loss_coeff times the mean over the data-parallel
 * ranks and micro-batches of the step of each micro-batch's aux, AutoModel's gradient (its
 * backward scale cp / micro-batches, FSDP2's mean over dp x cp; with pp its token scale cancels):
 * a layer's gradient needs nothing from the other layers, so pipeline stages carry nothing for
 * it. The step record's aux is the sum over this rank's layers of the last micro-batch's.
 * Packed sequences (m->pk): AutoModel's gate counts the tokens of its token_mask, which leaves
 * out the pads that end a pack (its THD batch's padding_mask); load, Σ q and T count the rows
 * that are no pad (am_model_set_pack_fill, packed.h's am_packed_runs: the kernels run on each
 * run of them), and the router's backward adds the loss's gradient on those rows only.
 *
 * Parameters (Hugging Face names): Mixtral's block_sparse_moe.gate.weight [E, C] and
 * block_sparse_moe.experts.e.{w1 (gate), w3 (up)} [I, C], w2 (down) [C, I]; Qwen3-MoE's
 * mlp.gate.weight and mlp.experts.e.{gate_proj, up_proj, down_proj}. The router belongs to
 * the layer's parameter group; the experts form a group of their own right after it
 * ("layers.L.experts", AM_PG_EXPERTS, strategy AM_SHARD_EXPERT: reduced over the
 * expert-data-parallel group, which is the data-parallel group at ep 1). Each expert's
 * gate, up and down matrices are registered as E consecutive parameters, so that the E
 * experts' matrices of one kind are one [E, rows, cols] tensor for the grouped GEMMs.
 *
 * Tensor parallelism: the router and the experts are replicated over the tp ranks (each rank
 * computes the whole block on all the tokens; the parameters are AM_SPLIT_NONE, counted once in
 * the gradient norm); the block's output is added to the residual without a tp sum, and the
 * gradient of its input is divided by tp before the sum over tp that the norm's backward takes.
 * Pipeline stages: each stage runs its own MoE layers. The load-balancing loss spans all the
 * layers of the model (transformers concatenates every layer's router logits), so its sums
 * travel with the micro-batch: each stage adds its layers' cnt and psum to those received
 * after the hidden state and sends them on after its own; the last stage computes the loss
 * (added to its loss scalar, which the trainer sums over pp) and sends the whole model's cnt
 * and the gradient scale back after the hidden state's gradient, which each earlier stage's
 * router backward uses and passes on (am_moe_pipe_bytes: 4 (2 E + 1) bytes each way).
 * Expert parallelism (sh.ep > 1, the trainer's m->ep_comm): this rank holds experts
 * e0 = ep_rank * E/ep .. e0 + E/ep - 1 (their parameters named by global index; E % ep is
 * refused). The router and the load-balancing statistics see all E experts on the rank's own
 * tokens. moe_plan's order (by global expert) is grouped by destination rank, then local
 * expert (Megatron's all-to-all dispatcher); per layer and micro-batch an alltoallv of the
 * counts (i32 [ep, E/ep]), one of the permuted rows, a regrouping of the received rows by
 * local expert (pos2, the permute kernels with k = 1), the grouped GEMMs, the inverse
 * regrouping and an alltoallv back; the backward runs the two row all-to-alls in reverse.
 * The received rows are sized to the loads (dropless: every token is kept): after the counts'
 * all-to-all each rank knows the R rows its experts receive in a layer; the rows kept for the
 * backward (xp, g, u, act, and pos2: 4 + (C + 3 I) x dtype bytes a row) come from the slot's
 * pool, one allocation per micro-batch slot that holds the rows of every MoE layer of the
 * slot's micro-batch one after the other; the per-call work rows (t1, t2, dxp [., C], da, dg,
 * du [., I], LoRA's lt, ltd, ldt [., r]) from one buffer of the most rows of a layer. Both
 * start at the plan's balanced load (S rows a MoE layer: the slot's MoE layers x S, and S),
 * grow to what a micro-batch needs (the rows held so far copied over; a failed growth is an
 * error naming the layer, the rows and the plan's assumption) and are kept: their high-water
 * mark (am_moe_rows_bytes). The experts' groups are reduced
 * over the expert-data-parallel group (the trainer sets their comm; under fully sharded data
 * parallelism they are sharded, gathered and reduce-scattered over it: fsdp.h).
 * Not yet: experts split over tp, and sequence parallelism with experts, which am_moe_check
 * refuses.
 *
 * gpt-oss (gpt_oss; model_config.h): the router mlp.router with a bias (logits = h · Wgᵀ + b; the
 * top-k of the logits softmaxed over the k chosen is the renormalised top-k of the softmax, as
 * here), experts with biases and the clamped SwiGLU (kernels.h, swiglu_clamped_*):
 * g = x · W1ᵀ + b1, u = x · W3ᵀ + b3, y = ((clamp(u) + 1) * min(g, limit) * sigmoid(alpha ·
 * min(g, limit))) · W2ᵀ + b2, each expert's bias added to its own rows (the host knows the
 * counts); the load-balancing loss as Mixtral's (softmax of the biased logits). Checkpoints name
 * them as transformers' GptOssExperts' fused tensors (model_io.c): mlp.experts.gate_up_proj
 * [E, C, 2I] (gate at even, up at odd columns; x @ W), gate_up_proj_bias [E, 2I], down_proj
 * [E, I, C], down_proj_bias [E, C]; am holds them per expert as the other MoEs
 * (mlp.experts.e.{gate,up,down}_proj.{weight,bias}). LoRA on gpt_oss adapts its attention; no
 * adapters on its experts yet (am_moe_check).
 *
 * DeepSeekMoE (glm4_moe; model_config.h, sigmoid_router): the router's scores are sigmoids, the
 * experts chosen on the scores plus the layer's selection bias within the best groups, weighted
 * by the unbiased scores (renormalised when norm_topk_prob) times routed_scaling_factor
 * (kernels.h, moe_route_sigmoid_*); shared experts (mlp.shared_experts) are a dense MLP of the
 * layer (layer.c: w_gate, w_up, w_down, split over tp), added beside the routed ones. The
 * selection bias is updated in training only with gate_bias_update_factor > 0 (deepseek_v3 as
 * AutoModel builds it; model_config.h): each held MoE layer counts the tokens routed to each
 * expert over the step (every micro-batch's forward once, on the rank's own tokens; with packed
 * sequences its rows that are no pad only, AutoModel's token_mask: the choices downloaded and
 * counted on the host), the trainer sums the counts over dp x cp after the optimizer's step
 * (am_moe_bias_loads: one buffer for all the layers) and am_moe_bias_update adds factor x sign(mean - load) to each
 * bias, the same on every rank (docs/training.md). AutoModel's glm4_moe has no
 * update_moe_gate_bias (its gate_bias_update_factor 1e-3 never applies), and transformers' is a
 * buffer.
 *
 * LoRA on the experts (sh.lora_experts; AutoModel's GroupedExpertsLoRA): each expert e gains,
 * beside its frozen matrices, A_e [r, C] shared by gate and up, B of gate and B of up [I, r]
 * each, and A_d [r, I], B_d [C, r] on down, with s = lora_alpha / r (AutoModel's scale), r the experts' rank
 * (sh.lora_experts_r: with AutoModel's moe_rank_scaling lora_r / num_experts_per_tok, else lora_r):
 *     g = x · W1ᵀ + s · (x · A_eᵀ) · Bgᵀ,  u = x · W3ᵀ + s · (x · A_eᵀ) · Buᵀ,
 *     a = silu(g) * u,                    y = a · W2ᵀ + s · (a · A_dᵀ) · B_dᵀ
 * (AutoModel's gate_and_up B [r, 2I] is Bg and Bu side by side; it applies the routing weight
 * to a before down, am after: the same, down being linear). A starts as AutoModel's init of its
 * 3-D [E, in, r] tensor draws it (xavier normal std sqrt(2 / (r (in + E))), kaiming uniform
 * bound 1 / sqrt(in r)), B at zero; no dropout (AutoModel's has none). Backward: from dy
 * (rows of the expert), dd = s · dy: gB_d += ddᵀ · t_d, dt_d = dd · B_d, gA_d += dt_dᵀ · a,
 * da += dt_d · A_d; from dg, du: dt = s · (dg · Bg + du · Bu), gBg += s · dgᵀ · t,
 * gBu += s · duᵀ · t, gA += dtᵀ · x, dx += dt · A (t = x · Aᵀ and t_d = a · A_dᵀ recomputed in
 * the backward). Named as peft names per-expert adapters ("...experts.3.w1.lora_A.weight"; A
 * after gate's), registered as 5 runs of El consecutive parameters per layer (A, Bg, Bu, A_d,
 * B_d) in the group "lora.experts" after the "lora" group (model.h); held as their experts are:
 * this ep rank's experts' alone, whole on every tp rank (their gradients the same on each).
 */
#ifndef AM_MODEL_MOE_H
#define AM_MODEL_MOE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"

struct am_moe_layer {
    struct am_param *router;       /* [E, C] */
    struct am_param *w1, *w3, *w2; /* the first of E consecutive parameters each: gate, up [I, C]; down [C, I] */
    struct am_tensor W1, W3, W2;   /* the compute copies as [E, I, C], [E, I, C], [E, C, I] */
    struct am_tensor G1, G3, G2;   /* their gradients, same shapes */
    int experts_group;             /* the experts' parameter group */
    /* glm4_moe (sigmoid_router): the selection bias e_score_correction_bias [E] f32, a buffer of
     * the checkpoint (not a parameter: no gradient, no optimizer), under its Hugging Face name;
     * zero until loaded (transformers' initial value) */
    struct am_tensor bias;
    char bias_name[96];
    /* LoRA on the experts (sh.lora_experts; NULL without): the first of El consecutive
     * parameters each: A [r, C] of gate and up, B of gate and B of up [I, r], A of down [r, I],
     * B of down [C, r]; their compute copies and gradients as [El, rows, cols] */
    struct am_param *la, *lbg, *lbu, *lda, *ldb;
    struct am_tensor LA, LBG, LBU, LDA, LDB;
    struct am_tensor GLA, GLBG, GLBU, GLDA, GLDB;
    /* gpt_oss: the router's bias [E] (in the layer's group, after the router), and the experts'
     * biases, the first of El consecutive parameters each in the experts' group after their
     * matrices: gate's and up's [I], down's [C] (NULL for the other models) */
    struct am_param *router_b, *b1, *b3, *b2;
};

/* The model's state for its MoE layers (model.h: am_model.moe; NULL for a dense model). */
struct am_moe;

/* Tokens per expert over a step (summed over the MoE layers and micro-batches of the step on
 * this rank), for the step record. */
struct am_moe_stats {
    int64_t min, max;  /* the least and the most loaded expert's slots */
    double imbalance;  /* max / mean (1: balanced) */
    double aux;        /* the load-balancing loss of the last micro-batch (unscaled; 0 without it;
                          AutoModel's: the sum over this rank's MoE layers) */
    double alltoall_s; /* expert parallelism: seconds in the experts' all-to-alls (counts, tokens,
                          gradients; the host's time in the calls) */
    double experts_s;  /* seconds in the routed experts (their grouped matrix products, SwiGLU and
                          adapters, forward and backward) */
    double dispatch_s; /* seconds in the rest of the routed block: the router's product and its
                          gradient, the top-k and its backward, the plan, the permutes to and from
                          expert order, the weighted combine and, with ep > 1, the all-to-alls
                          (alltoall_s of it); not the shared experts (a dense MLP). Both the host's
                          time in the calls (the kernels' own on the CPU; on a GPU their launches
                          and the waits for the routing counts) */
    int64_t tokens_in; /* expert parallelism: the token rows this rank's experts received over the
                          step (after the counts' all-to-all, from every rank of its ep group; every
                          MoE layer and micro-batch, each forward once): its share of the routing */
    int64_t rows_max;       /* expert parallelism: the most rows one micro-batch slot's MoE layers
                               received for a micro-batch of the step (their sum) */
    int64_t layer_rows_max; /* expert parallelism: the most rows one MoE layer received in the step */
    size_t rows_bytes;      /* expert parallelism: the bytes of the buffers sized to the loads after the
                               step (am_moe_rows_bytes: their high-water mark so far) */
};

/* The configurations the MoE block runs in; -1 with a message naming what is not supported. */
int am_moe_check(const struct am_model_config *cfg, const struct am_model_shard *sh, char *err, size_t err_len);
/* Parameters the MoE layers add to the dense count of 11 per layer (for sizing params[]). */
int am_moe_extra_params(const struct am_model_config *cfg, int n_layers);
/* Registers layer l's router and experts (layer.c calls it for a MoE layer, after the MLP's
 * norm) through params.c: the router into the current group, the experts into a new group. */
void am_moe_layer_params(struct am_model *m, int l, struct am_layer *L);
/* With sh.lora_experts: registers layer l's experts' adapters (model.c, in the "lora.experts"
 * group; nothing for a dense layer). */
void am_moe_lora_params(struct am_model *m, int l, struct am_layer *L);
/* After the slabs are placed: the experts' views, and the activations of every slot's MoE
 * layers. Returns 0, or -1 (out of memory). */
int am_moe_init(struct am_model *m, char *err, size_t err_len);
void am_moe_free(struct am_model *m);

/* The block's forward for the layer's saved activations a (of the slot's micro-batch): in is
 * the normalised input [N, C], out [N, C] the block's output. */
int am_moe_forward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a, const struct am_tensor *in,
                   struct am_tensor *out, char *err, size_t err_len);
/* Its backward: dout the gradient of out; dh (+=) the gradient of in. */
int am_moe_backward(struct am_model *m, const struct am_layer *L, const struct am_layer_acts *a, const struct am_tensor *dout,
                    const struct am_tensor *in, struct am_tensor *dh, char *err, size_t err_len);
/* Around a micro-batch's forward of a chunk's layers (slot: the model's slot index): begin
 * zeroes its load-balancing statistics, or with in (a stage after the first: the trailer of
 * the hidden state received, below) takes the earlier stages' sums; end, on the last stage
 * (out NULL), adds the load-balancing loss to the loss scalar for the targets' tokens and
 * keeps its gradient's scale (dloss_scale as am_model_forward's), and on an earlier stage
 * writes the sums to out (the trailer of the hidden state sent). Under context parallelism
 * end is collective over the cp group on the last stage (its statistics summed): 0, or -1
 * with the message of a failed all-reduce. */
void am_moe_forward_begin(struct am_model *m, int slot, const void *in);
int am_moe_forward_end(struct am_model *m, int slot, int64_t N, const int32_t *targets, float dloss_scale, void *out,
                       char *err, size_t err_len);
/* Pipeline stages with the load-balancing loss: the bytes that travel after a micro-batch's
 * hidden state and after its gradient (0 without the loss): f32 [cnt E | psum E | scale],
 * forward the sums so far, backward the whole model's counts and the gradient scale. Around a
 * chunk's backward: begin takes them from in (the gradient received; NULL on the last stage),
 * end writes them to out (the gradient sent; NULL on the first stage). */
size_t am_moe_pipe_bytes(const struct am_model *m);
void am_moe_backward_begin(struct am_model *m, int slot, const void *in);
void am_moe_backward_end(struct am_model *m, int slot, void *out);
/* Expert parallelism: the bytes of the all-to-all's fixed buffer (within the activations' bytes,
 * m->act_bytes): the send rows [S, C] for S = the micro-batch's tokens x top_k; 0 at ep 1. */
size_t am_moe_alltoall_bytes(const struct am_model *m);
/* Expert parallelism: the bytes of the buffers sized to the loads (not in m->act_bytes): every
 * slot's saved expert rows and the work rows, as allocated now (they grow to the high-water
 * mark and are kept); 0 at ep 1. */
size_t am_moe_rows_bytes(const struct am_model *m);
/* Fault injection (the trainer's AM_FAULT kind=expert-rows-oom): the next MoE layer whose
 * experts receive rows here grows its slot's pool of saved rows whether or not they fit (as
 * when the routing sends this rank's experts more than the pool holds) and asks the device for
 * 2^62 bytes, which no device has: the allocation fails for real (the device's fault hook is
 * told) and the layer's forward fails with the growth's error (the layer, the rows, the plan's
 * balanced load). Once; nothing at ep 1. */
void am_moe_fail_growth(struct am_model *m);
/* Whether p is one of the experts' matrices (not the router), or one of their adapters. */
bool am_moe_is_expert_param(const struct am_model *m, const struct am_param *p);
/* The selection-bias update (gate_bias_update_factor > 0; above): the step's loads of this
 * rank's MoE layers (in layer order, E i64 each) in a device buffer of *n elements, for the
 * caller's in-place sum over dp x cp; NULL (*n 0) without the update or without MoE layers here.
 * am_moe_bias_update then adds factor x sign(mean load - load) to each layer's bias (fp32). */
void *am_moe_bias_loads(struct am_model *m, size_t *n);
void am_moe_bias_update(struct am_model *m);
/* AutoModel's load-balancing loss (above): the data-parallel ranks times the micro-batches of a
 * step on each (grad accumulation x pipeline micro-batches), which its gradient is divided by
 * (the trainer sets it after am_model_init; 1 until then). */
void am_moe_set_aux_div(struct am_model *m, double div);
/* The step's statistics: reset by am_model_begin_step, read by the trainer. */
void am_moe_stats_reset(struct am_model *m);
void am_moe_stats(struct am_model *m, struct am_moe_stats *out);

#endif
