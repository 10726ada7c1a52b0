/* textbuild.h - Megatron indexed datasets from text: JSONL or plain text through a Hugging
 * Face tokenizer (tokenizer.h), on N threads, the documents in input order.
 *
 * Inputs. A file whose name ends in .jsonl or .json (or any file with format JSONL) holds one
 * JSON object per line (blank lines skipped); otherwise it is plain text, one document per
 * paragraph: a paragraph ends after a blank line and the blank lines belong to it (the rule of
 * `am-data build --bytes`, so the documents put back together are the file).
 *
 * Pretraining data: a document is the string under text_key; its ids are the tokenizer's
 * (with the post-processor's special tokens when add_special), then eod when set.
 *
 * Instruction data (instruction = true), as NeMo AutoModel's ColumnMappedTextInstructionDataset
 * formats it for a tokenizer without a chat template (format_prompt_completion with
 * answer_only_loss_mask): from the columns context_key, question_key (either may be missing in
 * a row) and answer_key,
 *     prompt = " ".join(c for c in (context, question, "") if c is not None)
 *     ids    = encode(prompt + answer), then eos if the last id is not eos already
 *     mask   = 0 for the first len(encode(prompt)) ids, 1 for the rest (eos included)
 * (both encodes with the post-processor, as the library's default). The mask goes to a second
 * indexed dataset, PREFIX.mask.bin/.idx: dtype uint8, one value per token, the same
 * documents and lengths as PREFIX. Token t of a document is a label the loss counts iff its
 * mask is 1 (AutoModel's labels are ids[1:] with -100 where the mask is 0).
 *
 * Resuming (resume = true): the build writes PREFIX.bin.partial, PREFIX.len.partial (and the
 * mask's) and, every few seconds, PREFIX.resume: how far the inputs were read when the
 * partial files were last made durable. Run the same command again after an interruption
 * (kill, node failure, full disk): it continues from there; a different command (other
 * inputs, sizes, tokenizer or options) is refused. A finished build removes them.
 */
#ifndef AM_TEXTBUILD_H
#define AM_TEXTBUILD_H

#include <stdbool.h>
#include <stdint.h>

#include "errors.h"

struct am_tokenizer;

enum am_text_format { AM_TEXT_AUTO, AM_TEXT_JSONL, AM_TEXT_PLAIN };

struct am_text_build {
    const char *out;                 /* PREFIX */
    const char *const *inputs;
    int n_inputs;
    const struct am_tokenizer *tok;
    const char *tok_desc;            /* what identifies the tokenizer for resuming (path, size, time) */
    enum am_text_format format;
    const char *text_key;            /* "text" */
    bool add_special;                /* apply the post-processor */
    int32_t eod;                     /* appended to every pretraining document; -1: none */
    bool instruction;
    const char *context_key, *question_key, *answer_key; /* NULL: that column is not used */
    int32_t eos;                     /* instruction data: required */
    int threads;                     /* workers; 0: one per online CPU */
    bool progress;                   /* a progress line on stderr */
    bool resume;
};

struct am_text_stats {
    int64_t documents, tokens, bytes;
    double seconds;
    bool resumed;
};

int am_text_build_run(const struct am_text_build *o, struct am_text_stats *st, struct am_errors *err);

#endif
