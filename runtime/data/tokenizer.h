/* tokenizer.h - Hugging Face tokenizer.json files: byte-level BPE (GPT-2, Llama 3, Qwen 2/3)
 * and SentencePiece-style BPE (Llama 2, Mistral).
 *
 * am_tokenizer_load reads a tokenizer.json (or a directory holding one) and encodes text to
 * the same token ids as the `tokenizers` library's Tokenizer.encode(text).ids, byte for
 * byte. What is implemented, in the library's order:
 *
 *   1. added tokens (added_tokens): split out first, leftmost-longest, those with
 *      "normalized": false before those with "normalized": true (these searched for as the
 *      normalizer writes them), as tokenizers does; lstrip, rstrip and single_word are
 *      refused;
 *   2. normalizer, on each piece between the non-normalized added tokens: NFC (Qwen 2/3;
 *      with the characters of Unicode 9.0, as the library's), Prepend (when the piece is not
 *      empty) and Replace with a string pattern (Llama 2's Prepend "\u2581" and Replace " " by
 *      "\u2581", which is why it writes a "\u2581" after every special token), a Sequence of
 *      those, or none; others are refused;
 *   3. pre_tokenizer: ByteLevel (with use_regex: GPT-2's split pattern; add_prefix_space),
 *      or a Sequence of a Split with a known pattern (Llama 3's, Qwen 2's, Qwen 3.5's,
 *      GPT-2's), behavior Isolated, not inverted, then ByteLevel without use_regex. The
 *      patterns are implemented by hand as rules over Unicode classes (unicode.h), not by a
 *      regex engine; any other pattern is refused with its text. Or Metaspace (Mistral and
 *      Llama 2 converted without `legacy`: ' ' becomes the replacement, prepended by
 *      prepend_scheme always / first (the piece at the start of the text only) / never unless
 *      the piece starts with it, split or not before each replacement). Or none (Llama 2:
 *      each normalized piece is one word, however long);
 *   4. model: BPE, merges by rank (a heap over the word's symbols: O(n log n) in a word's
 *      length), ignore_merges. With ByteLevel a word's first symbols are its bytes (all 256
 *      must be in the vocabulary); otherwise its characters, and a character outside the
 *      vocabulary becomes its UTF-8 bytes as <0xNN> tokens with byte_fallback (when all are
 *      there), else unk_token (fused runs with fuse_unk), else nothing, as the library does;
 *      dropout, continuing_subword_prefix and end_of_word_suffix are refused;
 *   5. post_processor: TemplateProcessing (single sequence: its special tokens around the
 *      text), ByteLevel (no effect on ids), a Sequence of those, or none.
 *
 * Text is bytes: invalid UTF-8 is first repaired as Python's bytes.decode("utf-8",
 * "replace") repairs it (U+FFFD for each maximal invalid subpart), so the ids are those of
 * tokenizers on the repaired string.
 *
 * One am_tokenizer is read-only after loading and shared by threads; each thread encodes
 * with its own am_tok_state (a cache of words already encoded, scratch space).
 */
#ifndef AM_TOKENIZER_H
#define AM_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "errors.h"

struct am_tokenizer;
struct am_tok_state;

/* A growing list of token ids. */
struct am_tok_ids {
    int32_t *ids;
    size_t n, cap;
};

/* Loads PATH (a tokenizer.json, or a directory holding one). Anything not implemented is an
 * error naming the key, its value and why. */
int am_tokenizer_load(const char *path, struct am_tokenizer **out, struct am_errors *err);
void am_tokenizer_free(struct am_tokenizer *t);

/* One more than the largest id in the vocabulary and the added tokens. */
int64_t am_tokenizer_vocab_size(const struct am_tokenizer *t);
/* The id of a token by its content (a vocabulary entry as written in the file, or an added
 * token), or -1. */
int32_t am_tokenizer_token_id(const struct am_tokenizer *t, const char *content);
/* The file that was read (PATH itself or PATH/tokenizer.json). */
const char *am_tokenizer_path(const struct am_tokenizer *t);

struct am_tok_state *am_tok_state_new(void);
void am_tok_state_free(struct am_tok_state *s);

/* Appends the ids of text[0, len) to out. add_special: apply the post-processor (the
 * library's add_special_tokens=True, its default). -1 only when memory runs out. */
int am_tokenizer_encode(const struct am_tokenizer *t, struct am_tok_state *s, const char *text, size_t len,
                        bool add_special, struct am_tok_ids *out, struct am_errors *err);

void am_tok_ids_free(struct am_tok_ids *v);

#endif
