/* shard_ckpt.h - sharded training checkpoints: every rank writes its own part of the
 * training state, one manifest says where each part of each tensor lies, and the whole is
 * committed atomically.
 *
 * On disk, under the checkpoint root (checkpoint.checkpoint_dir):
 *
 *   ROOT/step-N/manifest.json      the checkpoint's description (below)
 *   ROOT/step-N/rank-00000.bin     one rank's state: three sections of `elems` fp32 numbers
 *   ROOT/step-N/rank-00003.bin     (little-endian, one after the other): the master weights,
 *   ...                            AdamW's first moment, AdamW's second moment
 *   ROOT/latest                    "step-N\n": the last complete checkpoint
 *
 * A rank's sections hold its parameters as it keeps them: whole tensors, tensor-parallel
 * slices, pipeline stages, or fully sharded flat shards of padded groups. Each is described
 * by pieces: a rectangle rows [row0, row0 + rows) x cols [col0, col0 + cols) of the full
 * tensor (a vector has one column), stored row-major from element `offset` of each section.
 * The manifest maps every tensor to its pieces, so that any rank of any layout finds the
 * elements it holds (re-sharding) by intersecting rectangles.
 *
 * manifest.json: {"format": "am-sharded-checkpoint", "version": 1, "step", "time",
 * "model_hash" (FNV-1a of the config.json text am writes for the model), "meta" (the
 * trainer's: layout, strategy, optimizer step, data position, rng, lr scheduler, model
 * config), "files": [{"name", "bytes", "elems", "crc32c"}], "tensors": {NAME: {"shape":
 * [rows, cols] or [rows], "pieces": [[file, offset, row0, rows, col0, cols], ...]}}}. Beside
 * it, config.json: the model's Hugging Face config (am-ckpt export reads it).
 *
 * Commit: the ranks write into ROOT/step-N.tmp-TAG (each its rank-R.bin and a small
 * rank-R.json with its pieces and checksum, fsynced); once all have written, rank 0 merges
 * the rank lists into manifest.json, fsyncs it and the directory, renames the directory to
 * step-N, fsyncs ROOT, writes `latest` through a temporary file and a rename (fsynced), and
 * only then removes checkpoints beyond the last keep_last. A kill at any moment leaves
 * `latest` naming a complete checkpoint (or absent, before the first); a step-N.tmp-* left
 * behind is never read and is removed by a later save.
 *
 * Reading: am_sckpt_open parses and checks the manifest (format, version, every piece inside
 * its tensor and its file); am_sckpt_read copies a rectangle of a tensor from the pieces that
 * hold it, after checking the size and crc32c of each file it reads (once per file).
 */
#ifndef AM_SHARD_CKPT_H
#define AM_SHARD_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#define AM_SCKPT_FORMAT "am-sharded-checkpoint"
#define AM_SCKPT_VERSION 1
#define AM_SCKPT_SECTIONS 3 /* master weights, AdamW m, AdamW v */


/* One rectangle of a tensor held by a rank (see above). */
struct am_sckpt_piece {
    const char *name;       /* the tensor */
    int64_t full_rows, full_cols; /* its full shape (full_cols 0 for a vector, whose pieces have 1 column) */
    int64_t offset;         /* first element in each section */
    int64_t row0, rows, col0, cols;
};

/* Where a save is: the phases a fault can be injected at (AM_FAULT kill-in-save:PHASE). */
enum am_sckpt_phase {
    AM_SCKPT_PHASE_SHARD,    /* a rank has written half of its shard file */
    AM_SCKPT_PHASE_WRITTEN,  /* a rank's shard and list are on disk, before the others agree */
    AM_SCKPT_PHASE_MANIFEST, /* rank 0: the manifest written, the directory not renamed */
    AM_SCKPT_PHASE_COMMIT,   /* rank 0: step-N renamed into place, `latest` not updated */
    AM_SCKPT_PHASE_LATEST,   /* rank 0: `latest` updated, old checkpoints not yet removed */
    AM_SCKPT_N_PHASES
};
const char *am_sckpt_phase_name(enum am_sckpt_phase p);
/* Called at each phase (NULL: none); the fault injection's hook. */
typedef void (*am_sckpt_phase_fn)(void *arg, enum am_sckpt_phase p);

/* ROOT/step-N.tmp-TAG and ROOT/step-N. */
void am_sckpt_tmp_dir(const char *root, long step, const char *tag, char *out, size_t len);
void am_sckpt_step_dir(const char *root, long step, char *out, size_t len);

/* Rank 0, first: creates ROOT and an empty ROOT/step-N.tmp-TAG (removing one left by an
 * earlier attempt). */
int am_sckpt_begin(const char *root, long step, const char *tag, char *err, size_t err_len);

/* A small file (config.json) into a checkpoint's temporary directory, fsynced. */
int am_sckpt_write_text(const char *dir, const char *name, const char *text, char *err, size_t err_len);

/* Every writing rank: its three sections of elems numbers (host memory) and its pieces, into
 * tmp_dir as rank-R.bin and rank-R.json, both fsynced. */
int am_sckpt_write_rank(const char *tmp_dir, int rank, const float *const sections[AM_SCKPT_SECTIONS], int64_t elems,
                        const struct am_sckpt_piece *pieces, size_t n_pieces, am_sckpt_phase_fn hook, void *hook_arg,
                        char *err, size_t err_len);

/* Rank 0, once every rank has written: the manifest from the rank lists of `ranks` (the
 * writing ranks, ascending), with meta (the trainer's object, taken) and model_hash; the
 * commit and `latest`; then the checkpoints beyond the last keep_last (0: keep all) removed,
 * never the one `latest` names. When ROOT/step-N exists (saved before: by the killed run this
 * one resumes, or by a run restored from an older checkpoint), the new one takes its place in
 * one rename (RENAME_EXCHANGE) and the old one is removed; where the filesystem cannot swap,
 * the complete one there is kept, the new copy removed, and *already is set. */
int am_sckpt_commit(const char *root, long step, const char *tag, const int *ranks, int n_ranks, json_t *meta,
                    const char *model_hash, long keep_last, am_sckpt_phase_fn hook, void *hook_arg, bool *already,
                    char *err, size_t err_len);

/* The checkpoint directory a restore_from value names: "latest" (or "LATEST") is the one
 * ROOT/latest names (*found false, 0 returned, when there is none yet); a directory with
 * a manifest.json is itself; a directory with a `latest` file is the one that names. */
int am_sckpt_resolve(const char *root, const char *restore_from, char *out, size_t len, bool *found, char *err,
                     size_t err_len);

struct am_sckpt_tensor_info {
    const char *name;
    int ndim;              /* 1: a vector of rows (cols 1), 2: a matrix */
    int64_t rows, cols;
    size_t n_pieces;
};

struct am_sckpt;
int am_sckpt_open(const char *dir, struct am_sckpt **out, char *err, size_t err_len);
void am_sckpt_close(struct am_sckpt *c);
const char *am_sckpt_dir(const struct am_sckpt *c);
long am_sckpt_step(const struct am_sckpt *c);
const char *am_sckpt_model_hash(const struct am_sckpt *c);
json_t *am_sckpt_meta(const struct am_sckpt *c);  /* borrowed */
json_t *am_sckpt_json(const struct am_sckpt *c);  /* the whole manifest, borrowed */
size_t am_sckpt_n_tensors(const struct am_sckpt *c);
void am_sckpt_tensor(const struct am_sckpt *c, size_t i, struct am_sckpt_tensor_info *out);
/* The tensor's index, or -1. */
int am_sckpt_find(const struct am_sckpt *c, const char *name);

/* Copies rows [row0, row0 + rows) x cols [col0, col0 + cols) of tensor i's section `section`
 * into dst (row-major, ld elements between rows) where a piece holds them, setting mask
 * (same layout as dst, may be NULL) to 1 for each element written. */
int am_sckpt_read(struct am_sckpt *c, size_t i, int section, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                  float *dst, int64_t ld, unsigned char *mask, char *err, size_t err_len);

/* Checks every file's size and checksum. */
int am_sckpt_verify(struct am_sckpt *c, char *err, size_t err_len);

/* FNV-1a (64 bits) of a text, as 16 hex digits. */
void am_sckpt_hash_text(const char *text, char out[17]);

#endif
