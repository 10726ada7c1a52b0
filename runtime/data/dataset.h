/* dataset.h - Megatron-style indexed datasets and the GPT samples built from them.
 *
 * An indexed dataset is PREFIX.bin (every token, back to back) and PREFIX.idx, Megatron's
 * MMIDIDX index (megatron/core/datasets/indexed_dataset.py), all little-endian:
 *
 *   offset 0   9 bytes  magic "MMIDIDX\0\0"
 *          9   u64      version, 1
 *         17   u8       token dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
 *                       6 float64, 7 float32, 8 uint16
 *         18   u64      S, the number of sequences
 *         26   u64      D, the number of document boundaries (documents + 1)
 *         34   S x i32  sequence lengths, in tokens
 *              S x i64  sequence byte offsets in PREFIX.bin
 *              D x i64  document boundaries: sequence indices, 0 first and S last
 *             [S x i8   sequence modes, multimodal datasets only]
 *
 * Both files are mapped read-only and the index is checked entirely when opened: a corrupt
 * or truncated index is rejected with the byte offset and what was expected there.
 *
 * GPT samples (am_gpt_*) are built exactly as Megatron's GPTDataset builds them, so that the
 * same data, seed and sample count give the same samples in the same order:
 *   - a document index: the sequence ids repeated for as many epochs as the requested
 *     samples need, shuffled with numpy.random.RandomState(seed) (the final epoch shuffled
 *     separately when it is used for less than 80%);
 *   - a sample index of (position in the document index, token offset) pairs: sample k is
 *     the seq_length + 1 tokens starting there, crossing documents as needed, and its last
 *     token is the first token of sample k + 1;
 *   - a shuffle index: a random permutation of the samples (the same RandomState);
 * and blends of several datasets follow Megatron's BlendedDataset: for each sample, the
 * dataset whose realised share lags its weight the most. With shuffle off the document and
 * sample orders are the files' own.
 *
 * Data parallelism is the caller's choice of which global sample to ask for:
 * am_gpt_global_index gives the convention the trainer uses.
 */
#ifndef AM_DATASET_H
#define AM_DATASET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "errors.h"

struct am_recipe;

/* ---- indexed datasets ------------------------------------------------------------------------ */

/* Megatron's token dtype codes: the numbers on disk (byte 17 above), which is why they are an
 * enum of their own rather than am's dtypes (enum am_dtype, dtype.h): most of them (uint8,
 * int16, uint16, ...) are storage for token ids that am never computes in. am_indexed_read is
 * the one place they are converted: every code to int32 token ids (the model's AM_I32). */
enum am_idx_dtype {
    AM_IDX_U8 = 1, AM_IDX_I8 = 2, AM_IDX_I16 = 3, AM_IDX_I32 = 4, AM_IDX_I64 = 5,
    AM_IDX_F64 = 6, AM_IDX_F32 = 7, AM_IDX_U16 = 8
};

#define AM_IDX_HEADER_BYTES 34

/* "uint8", "int32", ... (numpy's names, as Megatron's DType enum), or NULL for a bad code. */
const char *am_idx_dtype_name(int code);
int am_idx_dtype_size(int code);

struct am_indexed;

/* Opens PREFIX.idx and PREFIX.bin. Token dtypes must be integers (float64/float32 datasets
 * are rejected: they cannot hold token ids). */
int am_indexed_open(const char *prefix, struct am_indexed **out, struct am_errors *err);
void am_indexed_close(struct am_indexed *d);

const char *am_indexed_prefix(const struct am_indexed *d);
enum am_idx_dtype am_indexed_dtype(const struct am_indexed *d);
int64_t am_indexed_sequences(const struct am_indexed *d);
int64_t am_indexed_documents(const struct am_indexed *d); /* boundaries - 1 */
int64_t am_indexed_tokens(const struct am_indexed *d);
int32_t am_indexed_length(const struct am_indexed *d, int64_t seq);
/* The first sequence of document doc (doc in [0, documents]; doc == documents gives S). */
int64_t am_indexed_doc_start(const struct am_indexed *d, int64_t doc);

/* Copies tokens [offset, offset + count) of sequence seq into dst as int32. int64 tokens
 * outside int32 are an error naming the sequence. */
int am_indexed_read(const struct am_indexed *d, int64_t seq, int64_t offset, int64_t count, int32_t *dst,
                    struct am_errors *err);

/* Writes PREFIX.bin and PREFIX.idx as Megatron's IndexedDatasetBuilder does (one sequence per
 * document). Both are written to temporary files and renamed into place by finish. */
struct am_indexed_builder;
int am_indexed_builder_open(const char *prefix, enum am_idx_dtype dtype, struct am_indexed_builder **out,
                            struct am_errors *err);
/* Appends token ids to the current document (each must fit the dtype). */
int am_indexed_builder_add(struct am_indexed_builder *b, const int64_t *ids, size_t n, struct am_errors *err);
/* Appends n tokens already encoded in the dtype (n * dtype size bytes). */
int am_indexed_builder_add_raw(struct am_indexed_builder *b, const void *tokens, size_t n, struct am_errors *err);
/* Ends the current document (an empty one too). */
int am_indexed_builder_end_document(struct am_indexed_builder *b, struct am_errors *err);
/* Ends an unfinished document, writes the index, syncs, renames both files into place;
 * frees b in every case. */
int am_indexed_builder_finish(struct am_indexed_builder *b, struct am_errors *err);
/* Abandons the dataset: removes the temporary files (not those of a partial build), frees b. */
void am_indexed_builder_abort(struct am_indexed_builder *b);

/* Resumable building. A partial build writes PREFIX.bin.partial (the tokens so far) and
 * PREFIX.len.partial (the lengths of the documents synced so far, int32 each).
 * am_indexed_builder_sync, between documents, makes both durable and tells how many
 * documents and tokens they hold; am_indexed_builder_open_partial with such counts continues
 * from there (cutting off what was written after it), with 0, 0 it starts afresh. finish
 * renames the .bin into place, writes the .idx and removes the lengths file; abort keeps
 * both. */
int am_indexed_builder_open_partial(const char *prefix, enum am_idx_dtype dtype, int64_t docs, int64_t tokens,
                                    struct am_indexed_builder **out, struct am_errors *err);
int am_indexed_builder_sync(struct am_indexed_builder *b, int64_t *docs, int64_t *tokens, struct am_errors *err);

/* ---- GPT samples ------------------------------------------------------------------------------ */

struct am_gpt_config {
    const char *const *paths; /* dataset prefixes */
    const double *weights;    /* blend weights (positive), NULL for equal; unused for one path */
    int n_paths;
    int64_t seq_length; /* a sample is seq_length + 1 tokens */
    bool shuffle;
    uint32_t seed;        /* numpy.random.RandomState(seed) */
    int64_t num_samples;  /* samples the run will read (global batch x steps); 0: one epoch of
                             a single dataset (a blend needs it) */
};

struct am_gpt;

int am_gpt_open(const struct am_gpt_config *cfg, struct am_gpt **out, struct am_errors *err);
void am_gpt_close(struct am_gpt *g);

/* The number of samples available (at least num_samples). */
int64_t am_gpt_size(const struct am_gpt *g);
int64_t am_gpt_seq_length(const struct am_gpt *g);
/* Copies global sample i (seq_length + 1 tokens) into tokens. Safe to call from several
 * threads at once. */
int am_gpt_sample(const struct am_gpt *g, int64_t i, int32_t *tokens, struct am_errors *err);
/* Which dataset of the blend sample i comes from, and its sample index there. */
int am_gpt_source(const struct am_gpt *g, int64_t i, int *dataset, int64_t *dataset_sample);
/* Epochs and samples of dataset k of the blend (for messages and tests). */
int am_gpt_dataset_epochs(const struct am_gpt *g, int k);
int64_t am_gpt_dataset_samples(const struct am_gpt *g, int k);

/* The global sample that data-parallel rank `rank` of `world` reads as its k-th sample of
 * `step` (k in [0, global_batch / world)): step s consumes global samples
 * [s * global_batch, (s + 1) * global_batch), rank r taking every world-th one from r. So N
 * ranks with local batch b (and any gradient accumulation) see exactly the samples that one
 * rank with batch N * b sees in the same step. */
static inline int64_t am_gpt_global_index(int64_t step, int64_t global_batch, int rank, int world, int64_t k)
{
    return step * global_batch + k * world + rank;
}

/* numpy.random.RandomState(seed).shuffle(a) of an int64 array (the same permutation numpy
 * makes). -1 when out of memory. */
int am_np_shuffle_i64(uint32_t seed, int64_t *a, int64_t n);

/* Fills cfg from the recipe's dataset section (paths, weights, seq_length, shuffle, seed);
 * cfg->paths points into the recipe. -1 with a message for a seed numpy does not accept. */
int am_gpt_config_from_recipe(const struct am_recipe *r, int64_t num_samples, struct am_gpt_config *cfg,
                              struct am_errors *err);

#endif
