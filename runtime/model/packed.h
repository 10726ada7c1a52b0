/* packed.h - packed sequences in the model: several documents back to back in one sequence,
 * none attending to another, each with its rotary positions from 0.
 *
 * A packed micro-batch comes with one more host array beside its tokens and targets: starts
 * [B, T] (int32), for each row of each sequence the position in the sequence where the row's
 * document starts (runtime/data/pack.h builds packs and their starts). A row at position p of a
 * document starting at s is rotated by rope at position p - s, and attends to the keys at
 * positions s .. p of its sequence (with a sliding window, to those within the window too):
 * block-diagonal causal attention, transformers' 4-d mask of a pack with position_ids reset per
 * document. The targets carry the rest (a document's last row predicts its last token, which
 * is no row's input; pads predict nothing: target -1), so nothing crosses a boundary.
 *
 * The attention is the kernels' attention_block_forward / _backward (kernels.h) with qstart,
 * over the rank's rows alone, or over the cp ring (ring.h) with the rows' starts: under context
 * parallelism the positions of a rank's rows are the zigzag's, and only the queries' starts are
 * needed (a key's position says which document it can belong to). fp32 or bf16 (those kernels':
 * bf16 storage, fp32 scores, softmax statistics and sums, each output rounded once). The
 * kernels compute each tile of query rows (a row, on the GPU) against the keys from its
 * documents' earliest start to its last row only, not the whole T x T square.
 *
 * The rotary tables: those of positions 0 .. T - 1 are built once; each forward of a
 * micro-batch uploads its starts and the rows' rotary positions into its slot, and each pass
 * over a slot (forward; backward, with its recompute) gathers the rows' tables from them
 * (embedding_forward as a row gather: nothing the host computes per pass).
 *
 * Gemma (attention_block_softcap: the scale and soft cap on the scores, the sliding window of
 * a layer within its document) and Gemma 3's sliding layers, whose tables (rope_local_base_freq)
 * are built and gathered beside the model's.
 *
 * Memory (in the model's act_bytes, and am-plan's activations): the tables of T positions, the
 * gathered tables of the micro-batch's tokens (for Gemma 3 two pairs of each), and two int32 per
 * token per slot.
 */
#ifndef AM_PACKED_H
#define AM_PACKED_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

struct am_packed {
    int64_t seq_len;               /* T: the whole sequence (the model holds T / cp rows of it) */
    struct am_tensor cos_all, sin_all; /* [T, D/2]: positions 0 .. T - 1 */
    struct am_tensor cos, sin;     /* [N, D/2]: the rows of the slot being run, gathered */
    struct am_tensor cos_local_all, sin_local_all, cos_local, sin_local; /* Gemma 3's sliding layers': the
                                      same pair of pairs at rope_local_base_freq (else no data) */
    struct am_tensor rows;         /* [T / cp] int32: the positions of the rank's rows in the sequence */
    struct am_tensor *starts;      /* per slot: [N] int32, each row's document start */
    struct am_tensor *rope_pos;    /* per slot: [N] int32, each row's rotary position */
    struct am_tensor cur;          /* the starts of the slot being run ([B, T / cp]) */
    int32_t *host_rows, *host_pos; /* host copies: the rows' positions, a micro-batch's rotary positions */
    int32_t *fill;                 /* per slot: [max_tokens / (T / cp)] host, the rows each sequence's documents
                                      fill before its pads (am_model_set_pack_fill; T: no pads) */
    int64_t *runs;                 /* am_packed_runs' answer */
    void *mem;
    size_t bytes;
};

/* Packed sequences for model m (built, and with cp > 1 given its ring by am_cp_init) whose
 * whole sequences are seq_len tokens. 0, or -1 with a message. */
int am_packed_init(struct am_model *m, int64_t seq_len, char *err, size_t err_len);
void am_packed_free(struct am_model *m);

/* The forward's part: slot (an index into m->slots) takes the documents of its B sequences
 * from starts (host [B, T / cp]: each row's document start, a position of the whole
 * sequence) and fill (host [B], the rows of each sequence its documents fill, the rest pads;
 * NULL: T each); -1 with a message naming the row when a start lies outside 0 .. the row's
 * position, or the sequence when a fill lies outside 0 .. T. */
int am_packed_load(struct am_model *m, int slot, int64_t B, const int32_t *starts, const int32_t *fill, char *err,
                   size_t err_len);

/* The pads of slot's micro-batch (B sequences of the rank's T / cp rows): the runs of the
 * rank's rows [runs[2 i], runs[2 i + 1]) that are no pad (a row at position p of sequence b
 * is one when p < its fill), in order, in *runs; returns their count (at most 2 B: under cp
 * a sequence's rows on a rank are two spans of positions, ring.h). What AutoModel's MoE gate
 * counts (the token_mask of its THD batch: the pads that end a pack are no tokens, moe.h). */
int64_t am_packed_runs(const struct am_model *m, int slot, int64_t B, const int64_t **runs);
/* The rows of slot's micro-batch that are no pad over the whole sequences (all cp ranks'). */
int64_t am_packed_filled(const struct am_model *m, int slot, int64_t B);

/* Before a pass over slot (forward, backward): its rotary tables and starts become the ones
 * the layers use. */
void am_packed_enter(struct am_model *m, int slot, int64_t B);

#endif
