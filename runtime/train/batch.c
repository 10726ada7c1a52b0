/* batch.c - the samples of each step: the dataset or the packs, the loss mask, the
 * micro-batches (trainer.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ring.h"
#include "trainer.h"

/* The loss mask of instruction data: PREFIX.mask beside every dataset of the blend (or none).
 * Its documents have the lengths of PREFIX's, so the same configuration gives the same
 * samples: mask sample i lines up with data sample i token for token. */
static int open_mask(struct trainer *t, const struct am_gpt_config *cfg, struct am_errors *err)
{
    int have = 0;
    if (!(t->mask_paths = calloc((size_t)cfg->n_paths, sizeof(char *))))
        return am_errors_fail(err, "out of memory");
    for (int i = 0; i < cfg->n_paths; i++) {
        size_t n = strlen(cfg->paths[i]) + 16;
        if (!(t->mask_paths[i] = malloc(n)))
            return am_errors_fail(err, "out of memory");
        snprintf(t->mask_paths[i], n, "%s.mask.idx", cfg->paths[i]);
        have += access(t->mask_paths[i], F_OK) == 0;
        snprintf(t->mask_paths[i], n, "%s.mask", cfg->paths[i]);
    }
    if (have == 0)
        return 0;
    if (have != cfg->n_paths)
        return am_errors_fail(err, "dataset.paths: %d of the %d datasets have a loss mask (PREFIX.mask.idx, from "
                              "am-data build --instruction) and the others none: blend instruction data with "
                              "instruction data only", have, cfg->n_paths);
    struct am_gpt_config mc = *cfg;
    mc.paths = (const char *const *)t->mask_paths;
    if (am_gpt_open(&mc, &t->mask, err) < 0)
        return -1;
    if (am_gpt_size(t->mask) != am_gpt_size(t->data))
        return am_errors_fail(err, "%s: its samples do not line up with %s's (was it built with them?)",
                              t->mask_paths[0], cfg->paths[0]);
    if (!(t->mask_sample = malloc((size_t)(cfg->seq_length + 1) * sizeof(int32_t))))
        return am_errors_fail(err, "out of memory");
    return 0;
}

/* The labels the loss counts in step `step` (0-based) over the whole global batch, every
 * rank's samples: what AutoModel normalises a masked loss by (its num_label_tokens). Every
 * rank computes it from the same files: nothing is exchanged. */
int am_train_count_labels(struct trainer *t, long step, int64_t *count, struct am_errors *err)
{
    int64_t G = t->p->global_batch, T = t->p->seq_length;
    *count = 0;
    for (int64_t i = step * G; t->packs && i < (step + 1) * G; i++) { /* a pack's targets >= 0 */
        int32_t *tgt = t->pack_rows + T;
        if (am_packs_read(t->packs, i, t->pack_rows, tgt, tgt + T, err) < 0)
            return -1;
        for (int64_t k = 0; k < T; k++)
            *count += tgt[k] >= 0;
    }
    for (int64_t i = step * G; !t->packs && i < (step + 1) * G; i++) {
        if (am_gpt_sample(t->mask, i, t->mask_sample, err) < 0)
            return -1;
        for (int64_t k = 1; k <= T; k++)
            *count += t->mask_sample[k] != 0;
    }
    return 0;
}

/* The dataset (or the packs) and the host buffers of one pipeline run's micro-batches. */
int am_train_build_data(struct trainer *t, struct am_errors *err)
{
    const struct am_recipe *r = t->r;
    struct am_gpt_config cfg;
    if (am_gpt_config_from_recipe(r, t->p->global_batch * r->steps.max_steps, &cfg, err) < 0)
        return -1;
    cfg.seq_length = t->p->seq_length;
    size_t n = (size_t)(t->p->n_microbatches * t->p->microbatch_size * t->p->seq_length);
    if (r->packed_sequence_size > 0) { /* whole documents packed into sequences (pack.h) */
        struct am_pack_config pc = {.path = cfg.paths[0], .size = t->p->seq_length,
                                    .neat = r->packing_strategy && !strcmp(r->packing_strategy, "neat"),
                                    .drop_long = r->drop_long_samples, .shuffle = cfg.shuffle, .seed = cfg.seed,
                                    .max_packs = r->max_packs};
        if (am_packs_open(&pc, &t->packs, err) < 0)
            return -1;
        am_log_record(t->log, "packs", json_pack("{s:I,s:I,s:s,s:b}", "packs", (json_int_t)am_packs_count(t->packs),
                                                 "dropped", (json_int_t)am_packs_dropped(t->packs), "strategy",
                                                 pc.neat ? "neat" : "thd", "masked", am_packs_masked(t->packs)));
        t->starts = malloc(n * sizeof(int32_t));
        t->pack_rows = malloc((size_t)(3 * t->p->seq_length) * sizeof(int32_t));
        t->pack_fill = malloc((size_t)(t->p->microbatch_size * t->p->n_microbatches) * sizeof(int32_t));
        if (!t->starts || !t->pack_rows || !t->pack_fill)
            return am_errors_fail(err, "out of memory for the batch");
    } else if (am_gpt_open(&cfg, &t->data, err) < 0 || open_mask(t, &cfg, err) < 0) {
        return -1;
    }
    t->sample = malloc((size_t)(t->p->seq_length + 1) * sizeof(int32_t));
    if (t->p->cp > 1) { /* this cp rank's positions of every sequence (ring.h) */
        t->cp_pos = malloc((size_t)(t->p->seq_length / t->p->cp) * sizeof(int32_t));
        if (!t->cp_pos)
            return am_errors_fail(err, "out of memory for the batch");
        am_cp_positions(t->p->seq_length, t->p->cp, am_comm_rank(t->g.cp), t->cp_pos);
    }
    t->tokens = malloc(n * sizeof(int32_t));
    t->targets = malloc(n * sizeof(int32_t));
    if (!t->sample || !t->tokens || !t->targets)
        return am_errors_fail(err, "out of memory for the batch");
    return 0;
}

/* Fills tokens/targets with the samples of accumulation step `accum` (its n_microbatches
 * micro-batches, one after the other): input = sample[0..T), target = sample[1..T] (a masked
 * label: -1), or with packed sequences a pack's rows, targets and document starts (pack.h) and the
 * rows its documents fill (pack_fill); with
 * context parallelism this rank's T / cp rows of each (cp_pos: the zigzag of ring.h). */
int am_train_read_microbatches(struct trainer *t, long step, int64_t accum, struct am_errors *err)
{
    int64_t T = t->p->seq_length, b = t->p->microbatch_size * t->p->n_microbatches, Tl = T / t->p->cp;
    for (int64_t j = 0; j < b; j++) {
        int64_t k = accum * b + j;
        int64_t idx = am_gpt_global_index(step, t->p->global_batch, t->dp_rank, t->p->dp, k);
        int32_t *tok = t->tokens + j * Tl, *tgt = t->targets + j * Tl, *st = t->starts ? t->starts + j * Tl : NULL;
        const int32_t *rows, *rtgt, *rst = NULL; /* the whole sequence's tokens, targets, starts */
        if (t->packs) {
            if (am_packs_read(t->packs, idx, t->pack_rows, t->pack_rows + T, t->pack_rows + 2 * T, err) < 0)
                return -1;
            t->pack_fill[j] = (int32_t)am_packs_rows(t->packs, idx);
            rows = t->pack_rows;
            rtgt = rows + T;
            rst = rows + 2 * T;
        } else {
            if (am_gpt_sample(t->data, idx, t->sample, err) < 0)
                return -1;
            if (t->mask && am_gpt_sample(t->mask, idx, t->mask_sample, err) < 0)
                return -1;
            rows = t->sample;
            rtgt = t->sample + 1;
        }
        for (int64_t i = 0; i < Tl; i++) {
            int64_t at = t->cp_pos ? t->cp_pos[i] : i;
            tok[i] = rows[at];
            /* a masked label: target -1, no loss and no gradient (kernels.h) */
            tgt[i] = t->mask && !t->mask_sample[at + 1] ? -1 : rtgt[at];
            if (st)
                st[i] = rst[at];
        }
    }
    return 0;
}

/* The dataset, the mask, the packs and the batch's buffers freed. */
void am_train_free_data(struct trainer *t)
{
    am_gpt_close(t->data);
    am_gpt_close(t->mask);
    am_packs_close(t->packs);
    free(t->starts);
    free(t->pack_fill);
    free(t->pack_rows);
    for (int i = 0; t->mask_paths && i < t->r->data.n_paths; i++)
        free(t->mask_paths[i]);
    free(t->mask_paths);
    free(t->mask_sample);
    free(t->sample);
    free(t->tokens);
    free(t->targets);
    free(t->cp_pos);
}
