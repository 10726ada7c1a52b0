/* ring.h - context parallelism in the model: each sequence split over the cp ranks, and ring
 * attention over that split.
 *
 * The split (zigzag, as Megatron and Transformer Engine lay it out): a sequence of T tokens is
 * cut into 2 cp chunks of T / (2 cp); cp rank r holds chunks r and 2 cp - 1 - r, in that order,
 * so that under the causal mask every rank does the same attention work. The model on a cp
 * rank is built for sequences of T / cp tokens (am_model_init's seq_len) and knows nothing of
 * the split but in two places: the rotary tables hold each of its rows' real positions
 * (am_cp_init rebuilds them, and Gemma 3's sliding layers' second pair), and attention (am_cp_attention_forward, _backward) runs over the
 * ring instead of the rank's rows alone. Everything else (norms, projections, the MLP, the
 * loss over the rank's tokens) is per token and runs as it is. The trainer hands each rank its
 * rows of every sequence (am_cp_positions), sums the loss over dp x cp, and reduces the
 * replicated weights' gradients over dp x cp.
 *
 * Ring attention. Each rank's keys and values pass around the cp group's ring in cp - 1 steps
 * (am_ishift: to rank + 1, from rank - 1): at step s a rank holds the block of rank r - s, and
 * the shift of that block onward is started before the attention of its queries against it
 * (kernels.h, attention_block_forward: masked by the rows' positions, the partial outputs
 * merged by their log-sum-exp), then waited for. The backward walks the same ring: each step's
 * dk, dv terms for the block held are added to the running sums that arrived with it from the
 * left (started onward after the step's compute, waited for after the next step's), and after
 * cp steps the sums of a rank's own block come back to it (cp shifts of dk and dv, cp - 1 of k
 * and v). Grouped-query attention as attention_forward's; a sliding window by position, and
 * Gemma's scale and soft cap on the scores. A block none of whose keys lies within the
 * window of any of the rank's queries (zigzag chunks further apart than the window) is not
 * computed: it is still passed on, its terms are none. The
 * rows' saved out and lse are the merged ones, as a full attention saves them, so activation
 * checkpointing's recompute runs the ring again.
 *
 * Precision: fp32 or bf16 (the compute dtype). In bf16, k and v travel in bf16, everything
 * summed over the ring in fp32, rounded once (FlashAttention's semantics, kernels.h): the
 * running out and lse of the forward's merge (out rounded to bf16 after the last block), dq's
 * sum over the blocks (added to dq once at the end), and the travelling dk and dv sums (fp32
 * on the wire, added to dk and dv once when they come home).
 *
 * Memory (counted in the model's act_bytes, and by am-plan): the positions of every rank's
 * rows (int32), two buffers for the k and v block that arrives next (2 x tokens x (k width + v
 * width) elements of the compute dtype), two for the travelling dk and dv sums and one for a
 * step's own terms (3 x tokens x (k width + v width) fp32), and in bf16 the fp32 running out /
 * dq sum, one buffer for both (tokens x heads x the wider of a q head and an output head,
 * fp32). k and dk are kv heads x qk wide, v and dv kv heads x v wide: with multi-head latent
 * attention qk_nope + qk_rope and v_head_dim a head (am_model_qk_head_dim, _v_head_dim),
 * otherwise both head_dim.
 */
#ifndef AM_RING_H
#define AM_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "model.h"

struct am_cp {
    struct am_comm *comm;      /* the cp group */
    int size, rank;
    int64_t seq_len;           /* the whole sequence (T); the model holds seq_len / size rows */
    void *mem;                 /* everything below, one allocation of `bytes` */
    size_t bytes;
    int32_t *pos;              /* [size][T / size]: each rank's positions (device memory) */
    void *kv[2][2];            /* [buffer][k, v]: the block that arrives next */
    void *dkv[2][2];           /* backward: the running dk, dv sums that travel with a block */
    void *part[2];             /* backward: this rank's dk, dv terms for the block it holds */
    void *acc;                 /* bf16 compute: the fp32 running out (forward) and dq sum (backward), or NULL */
    bool overlap;              /* AM_RING_OVERLAP=0: each shift waited for as soon as it is started (the
                                  ring's time alone, for bench/cp_small.sh) */
    double wait_s, block_s;    /* seconds waiting for the ring and in the block kernels (host clock) */
};

/* The positions of cp rank `rank`'s T / cp rows of a sequence of T tokens (the zigzag). */
void am_cp_positions(int64_t T, int cp, int rank, int32_t *pos);

/* Context parallelism for model m (built with seq_len T / cp): the ring buffers, the
 * positions, and the rotary tables at the rows' positions. cp: the cp group (its size and
 * rank). 0, or -1 with a message (the sequence must split into 2 cp chunks). */
int am_cp_init(struct am_model *m, struct am_comm *cp, int64_t seq_len, char *err, size_t err_len);
void am_cp_free(struct am_model *m);

/* attention_forward over the ring: q, out [B, T/cp, H, D], k, v [B, T/cp, KVH, D], lse
 * [B, H, T/cp] of this rank's rows. qstart: NULL, or with packed sequences [B, T/cp] int32,
 * where each row's document starts (a position in the whole sequence): a row sees no key
 * before it, whichever rank's block the key arrives in (kernels.h, attention_block_forward).
 * Only the queries' starts are needed: a key's position says everything about it. window:
 * the layer's sliding window (positions of the whole sequence, so it reaches across the
 * blocks); scale, softcap: the scores' (kernels.h, attention_block_softcap: Gemma's
 * query_pre_attn_scalar ** -0.5 and attn_logit_softcapping; 0, 0: 1 / sqrt(D), no cap).
 * Collective over the cp group. */
int am_cp_attention_forward(struct am_model *m, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                            const struct am_tensor *k, const struct am_tensor *v, const struct am_tensor *qstart,
                            int64_t window, float scale, float softcap, char *err, size_t err_len);
/* Its backward: adds this rank's rows' gradients to dq, dk and dv. Collective over the cp group. */
int am_cp_attention_backward(struct am_model *m, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                             const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                             const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                             const struct am_tensor *qstart, int64_t window, float scale, float softcap, char *err,
                             size_t err_len);

#endif
