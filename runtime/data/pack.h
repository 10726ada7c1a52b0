/* pack.h - packed sequences: whole documents of an indexed dataset placed back to back in
 * sequences of a fixed size, as NeMo AutoModel packs its samples (packed_sequence.py,
 * neat_packing.py).
 *
 * A document (a sequence of the indexed dataset, as Megatron's GPTDataset counts them) of n
 * tokens is the sample AutoModel's datasets make of it, shifted for next-token prediction: its
 * rows are its tokens but the last (n - 1 inputs) and their targets the tokens after them (the
 * last row predicts the document's last token, which is no row's input); with a loss mask
 * (PREFIX.mask beside the data, docs/data.md) a target whose mask token is 0 is -1 (no loss). A
 * document of fewer than 2 tokens has no row and is skipped. The documents are taken in the
 * dataset's order, or shuffled first with numpy's RandomState(seed) (AutoModel shuffles its
 * dataset before packing it); then, for a pack of S rows:
 *   thd  (AutoModel's pack_dataset): in that order, each document into the current pack while
 *        it fits, else into a new one (the current pack is closed);
 *   neat (AutoModel's greedy knapsack): the documents sorted by length, longest first (ties in
 *        order), each into the least filled pack that still has room (ties: the first pack),
 *        else into a new one; packs in the order they were opened.
 * A document longer than S rows is dropped (drop_long_samples true, AutoModel's default) or
 * refused with its number and length. max_packs keeps the first packs only. Each pack is
 * padded to S rows: token 0, no target, the pads a document of their own (nothing reads them).
 *
 * starts: each row's document start (the row where its document begins in the pack), what the
 * model masks attention and resets rotary positions with (runtime/model/packed.h). AutoModel
 * also pads each document to a multiple of 2 cp under context parallelism, because Transformer
 * Engine splits each document of a THD batch over the ranks; am splits the whole pack (the
 * zigzag of runtime/model/ring.h), so its packs are the same at every cp.
 *
 * Training reads pack i % count as its i-th global sample (epochs repeat the packs in order).
 */
#ifndef AM_PACK_H
#define AM_PACK_H

#include <stdbool.h>
#include <stdint.h>

#include "errors.h"

struct am_pack_config {
    const char *path;  /* the dataset prefix (PREFIX.idx, PREFIX.bin; PREFIX.mask.* when present) */
    int64_t size;      /* rows of a pack: packed_sequence_size */
    bool neat;         /* packing_strategy neat; else thd */
    bool drop_long;    /* drop_long_samples */
    bool shuffle;      /* the documents shuffled before packing, with RandomState(seed) */
    uint32_t seed;
    int64_t max_packs; /* 0: no cap */
};

struct am_packs;

/* Reads the documents' lengths and packs them. Errors name the dataset and, for a document
 * too long with drop_long false, the document. */
int am_packs_open(const struct am_pack_config *cfg, struct am_packs **out, struct am_errors *err);
void am_packs_close(struct am_packs *p);

int64_t am_packs_count(const struct am_packs *p);   /* packs built */
int64_t am_packs_dropped(const struct am_packs *p); /* documents longer than a pack, dropped */
bool am_packs_masked(const struct am_packs *p);     /* a loss mask was found beside the data */
/* The documents of pack i (their sequence numbers in the dataset, in the pack's order). */
int64_t am_packs_docs(const struct am_packs *p, int64_t i, const int64_t **docs);

/* The rows of pack i % count that its documents fill (the first ones; the rest of its size rows
 * are pads): AutoModel's sum of the pack's seq_lens, what its THD batch's padding_mask leaves
 * valid (thd_utils' _thd_padding_mask: a pack's trailing pad is no token of the MoE gate's
 * token_mask, runtime/model/moe.h). */
int64_t am_packs_rows(const struct am_packs *p, int64_t i);

/* Pack i % count: tokens, targets (-1: none) and starts, size rows each. */
int am_packs_read(const struct am_packs *p, int64_t i, int32_t *tokens, int32_t *targets, int32_t *starts,
                  struct am_errors *err);

#endif
