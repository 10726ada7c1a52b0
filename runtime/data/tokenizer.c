/* tokenizer.c - BPE from a Hugging Face tokenizer.json, byte-level and SentencePiece-style
 * (see tokenizer.h).
 *
 * The order of work follows the `tokenizers` library (tokenizers/src/tokenizer/mod.rs,
 * added_vocabulary.rs, normalizers/, pre_tokenizers/byte_level.rs and metaspace.rs,
 * models/bpe/model.rs and word.rs):
 *   repair the UTF-8 -> split out added tokens -> normalize -> split by the pre-tokenizer ->
 *   BPE on each piece -> the post-processor's special tokens around the ids.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tokenizer.h"
#include "unicode.h"
#include "util.h"

/* ---- hash maps -------------------------------------------------------------------------------- */

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 1099511628211ull;
    return h | 1; /* 0 marks an empty slot */
}

/* strings (kept in a pool) -> int32 */
struct strmap {
    struct { uint64_t h; uint32_t off, len; int32_t val; } *e;
    size_t cap, n;
    char *pool;
    size_t pool_len, pool_cap;
};

static int strmap_find(const struct strmap *m, const char *s, size_t n)
{
    if (!m->cap)
        return -1;
    uint64_t h = hash_bytes(s, n);
    for (size_t i = h & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (!m->e[i].h)
            return -1;
        if (m->e[i].h == h && m->e[i].len == n && memcmp(m->pool + m->e[i].off, s, n) == 0)
            return m->e[i].val;
    }
}

static int strmap_grow(struct strmap *m)
{
    size_t cap = m->cap ? 2 * m->cap : 1024;
    void *e = calloc(cap, sizeof(*m->e));
    if (!e)
        return -1;
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->e[i].h)
            continue;
        size_t j = m->e[i].h & (cap - 1);
        while (((__typeof__(m->e))e)[j].h)
            j = (j + 1) & (cap - 1);
        ((__typeof__(m->e))e)[j] = m->e[i];
    }
    free(m->e);
    m->e = e;
    m->cap = cap;
    return 0;
}

/* Sets s -> val (a later value for the same key wins, as in the library's maps). */
static int strmap_put(struct strmap *m, const char *s, size_t n, int32_t val)
{
    if (2 * (m->n + 1) > m->cap && strmap_grow(m) < 0)
        return -1;
    uint64_t h = hash_bytes(s, n);
    size_t i = h & (m->cap - 1);
    for (; m->e[i].h; i = (i + 1) & (m->cap - 1))
        if (m->e[i].h == h && m->e[i].len == n && memcmp(m->pool + m->e[i].off, s, n) == 0) {
            m->e[i].val = val;
            return 0;
        }
    if (m->pool_len + n > m->pool_cap) {
        size_t cap = m->pool_cap ? m->pool_cap : 1 << 16;
        while (cap < m->pool_len + n)
            cap *= 2;
        char *p = realloc(m->pool, cap);
        if (!p)
            return -1;
        m->pool = p;
        m->pool_cap = cap;
    }
    memcpy(m->pool + m->pool_len, s, n);
    m->e[i].h = h;
    m->e[i].off = (uint32_t)m->pool_len;
    m->e[i].len = (uint32_t)n;
    m->e[i].val = val;
    m->pool_len += n;
    m->n++;
    return 0;
}

static void strmap_free(struct strmap *m)
{
    free(m->e);
    free(m->pool);
}

/* (left id, right id) -> (rank, merged id) */
struct merge {
    uint64_t key; /* UINT64_MAX: empty */
    uint32_t rank;
    int32_t id;
};

/* ---- the tokenizer ---------------------------------------------------------------------------- */

/* PRE_GPT2, PRE_LLAMA3: a split pattern then ByteLevel (words are bytes, mapped to the
 * ByteLevel alphabet); PRE_NONE: no pre-tokenizer (the whole normalized text is one word, as
 * in Llama 2); PRE_METASPACE: SentencePiece's meta space (Mistral). In the last two, words are
 * characters looked up in the vocabulary as they are. */
enum pre_kind { PRE_GPT2, PRE_LLAMA3, PRE_NONE, PRE_METASPACE };
enum prepend_scheme { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER };

struct added {
    char *s;     /* the content */
    char *match; /* what is searched for: the content, normalized when `normalized` */
    size_t len, match_len;
    int32_t id;
    bool normalized;
};

/* One normalizer of the sequence: NFC; Prepend a (when the text is not empty); Replace every
 * a by b (a string pattern, leftmost first, not overlapping). */
struct norm_step {
    enum { NORM_NFC, NORM_PREPEND, NORM_REPLACE } kind;
    char *a, *b;
    size_t la, lb;
};

struct am_tokenizer {
    char path[4200];
    struct strmap vocab;         /* keys as written in the file (ByteLevel characters) */
    int32_t byte_id[256];        /* the id of each single byte */
    unsigned char byte_utf8[256][2], byte_utf8_len[256];
    struct merge *merges;
    size_t merges_cap;
    bool ignore_merges;
    bool byte_fallback, fuse_unk;
    int32_t unk_id;        /* model.unk_token's id, or -1 */
    int32_t fb_id[256];    /* byte_fallback: the ids of <0x00> .. <0xFF> (-1: absent) */
    int32_t *bmp_id;       /* PRE_NONE, PRE_METASPACE: the id of each one-character token below U+10000 */
    enum pre_kind pre;
    int digits_max;   /* PRE_LLAMA3: \p{N}{1,digits_max} */
    bool marks;       /* PRE_LLAMA3: letters are [\p{L}\p{M}] (Qwen 3.5) */
    bool prefix_space; /* ByteLevel add_prefix_space */
    struct norm_step *norm; /* the normalizer, in order */
    size_t n_norm;
    char meta[5];           /* PRE_METASPACE: the replacement character (UTF-8) */
    size_t meta_len;
    enum prepend_scheme prepend;
    bool meta_split;
    struct added *added;
    size_t n_added;
    size_t *by_first[256]; /* added tokens by the first byte of their match, longest first */
    size_t n_first[256];
    int32_t prefix[16], suffix[16];
    size_t n_prefix, n_suffix;
    int64_t vocab_size;
};

static const struct merge *merge_find(const struct am_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint64_t h = key * 0x9e3779b97f4a7c15ull;
    for (size_t i = (h >> 20) & (t->merges_cap - 1);; i = (i + 1) & (t->merges_cap - 1)) {
        if (t->merges[i].key == key)
            return &t->merges[i];
        if (t->merges[i].key == UINT64_MAX)
            return NULL;
    }
}

static void merge_put(struct am_tokenizer *t, int32_t a, int32_t b, uint32_t rank, int32_t id)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint64_t h = key * 0x9e3779b97f4a7c15ull;
    size_t i = (h >> 20) & (t->merges_cap - 1);
    while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key)
        i = (i + 1) & (t->merges_cap - 1);
    t->merges[i] = (struct merge){key, rank, id}; /* a repeated pair: the later rank wins, as in the library */
}

/* GPT-2's printable stand-ins for bytes (bytes_to_unicode in openai/gpt-2's encoder.py, and
 * the ByteLevel pre-tokenizer's table): printable Latin-1 bytes stand for themselves, the
 * others for U+0100 onwards in byte order. */
static uint32_t byte_char(int b)
{
    if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff))
        return (uint32_t)b;
    int n = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || (c >= 0xae && c <= 0xff)))
            n++;
    return 0x100 + (uint32_t)n;
}

/* The split patterns am implements by hand (below, in match_gpt2 and match_llama3). */
static const char GPT2_PATTERN[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char LLAMA3_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                                     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                                    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN35_PATTERN[] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| "
                                     "?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static int refuse(struct am_errors *err, const struct am_tokenizer *t, const char *what, const char *why)
{
    am_errorf(err, NULL, "%s: %s: %s", t->path, what, why);
    return -1;
}

static bool is_null_or_false(const json_t *v) { return !v || json_is_null(v) || json_is_false(v); }
static bool is_null_or_empty(const json_t *v)
{
    return !v || json_is_null(v) || (json_is_string(v) && json_string_length(v) == 0);
}

/* ---- loading: the pieces ---------------------------------------------------------------------- */

static int add_norm(struct am_tokenizer *t, struct norm_step step, struct am_errors *err)
{
    struct norm_step *n = realloc(t->norm, (t->n_norm + 1) * sizeof(*n));
    if (!n) {
        free(step.a);
        free(step.b);
        return refuse(err, t, "normalizer", "out of memory");
    }
    t->norm = n;
    t->norm[t->n_norm++] = step;
    return 0;
}

static int load_normalizer(struct am_tokenizer *t, const json_t *n, struct am_errors *err)
{
    if (!n || json_is_null(n))
        return 0;
    const char *type = json_string_value(json_object_get(n, "type"));
    if (type && strcmp(type, "Sequence") == 0 && json_is_array(json_object_get(n, "normalizers"))) {
        size_t i;
        const json_t *s;
        json_array_foreach(json_object_get(n, "normalizers"), i, s)
            if (load_normalizer(t, s, err) < 0)
                return -1;
        return 0;
    }
    if (type && strcmp(type, "NFC") == 0)
        return add_norm(t, (struct norm_step){.kind = NORM_NFC}, err);
    if (type && strcmp(type, "Prepend") == 0) {
        const json_t *v = json_object_get(n, "prepend");
        if (!json_is_string(v))
            return refuse(err, t, "normalizer Prepend", "needs a string \"prepend\"");
        char *a = strdup(json_string_value(v));
        if (!a)
            return refuse(err, t, "normalizer", "out of memory");
        return add_norm(t, (struct norm_step){NORM_PREPEND, a, NULL, strlen(a), 0}, err);
    }
    if (type && strcmp(type, "Replace") == 0) {
        const json_t *pat = json_object_get(n, "pattern"), *content = json_object_get(n, "content");
        const char *str = json_string_value(json_object_get(pat, "String"));
        if (!str || !*str || !json_is_string(content)) {
            return refuse(err, t, "normalizer Replace", "am implements a non-empty {\"String\": ...} pattern and a "
                          "string content (Llama 2's \" \" -> \"\u2581\"); a Regex pattern needs a regex engine, "
                          "which am does not have");
        }
        char *a = strdup(str), *b = strdup(json_string_value(content));
        if (!a || !b) {
            free(a);
            free(b);
            return refuse(err, t, "normalizer", "out of memory");
        }
        return add_norm(t, (struct norm_step){NORM_REPLACE, a, b, strlen(a), strlen(b)}, err);
    }
    char what[160];
    snprintf(what, sizeof(what), "normalizer \"%s\"", type ? type : "?");
    return refuse(err, t, what, "am implements NFC (Qwen 2/3), Prepend and Replace with a string pattern (Llama 2), "
                  "a Sequence of those, or none; another normalizer would change the text and give other ids");
}

/* The normalizer on text[0, n): *out is NULL when it changes nothing, else a malloc'ed text of
 * *out_n bytes. -1 when memory runs out. */
static int normalize(const struct am_tokenizer *t, const unsigned char *text, size_t n, unsigned char **out,
                     size_t *out_n)
{
    unsigned char *cur = NULL; /* owned; NULL: still `text` */
    const unsigned char *in = text;
    for (size_t k = 0; k < t->n_norm; k++) {
        const struct norm_step *st = &t->norm[k];
        unsigned char *next = NULL;
        size_t m = 0;
        if (st->kind == NORM_NFC) {
            if (!am_nfc_needed(in, n))
                continue;
            if (!(next = am_nfc(in, n, &m)))
                goto oom;
        } else if (st->kind == NORM_PREPEND) {
            if (n == 0)
                continue;
            if (!(next = malloc(st->la + n)))
                goto oom;
            memcpy(next, st->a, st->la);
            memcpy(next + st->la, in, n);
            m = st->la + n;
        } else {
            size_t hits = 0;
            for (size_t i = 0; i + st->la <= n;)
                if (memcmp(in + i, st->a, st->la) == 0)
                    hits++, i += st->la;
                else
                    i++;
            if (!hits)
                continue;
            if (!(next = malloc(n + hits * st->lb + 1)))
                goto oom;
            for (size_t i = 0; i < n;)
                if (i + st->la <= n && memcmp(in + i, st->a, st->la) == 0) {
                    memcpy(next + m, st->b, st->lb);
                    m += st->lb, i += st->la;
                } else {
                    next[m++] = in[i++];
                }
        }
        free(cur);
        in = cur = next;
        n = m;
    }
    *out = cur;
    *out_n = n;
    return 0;
oom:
    free(cur);
    return -1;
}

static int load_split(struct am_tokenizer *t, const json_t *p, struct am_errors *err)
{
    const json_t *pat = json_object_get(p, "pattern");
    const char *re = json_string_value(json_object_get(pat, "Regex"));
    const char *behavior = json_string_value(json_object_get(p, "behavior"));
    if (!re) {
        return refuse(err, t, "pre_tokenizer Split", "its pattern is not a {\"Regex\": ...}: am implements the "
                      "regex patterns of GPT-2, Llama 3, Qwen 2 and Qwen 3.5 only");
    }
    if (!behavior || strcmp(behavior, "Isolated") != 0 || !is_null_or_false(json_object_get(p, "invert"))) {
        return refuse(err, t, "pre_tokenizer Split", "behavior must be \"Isolated\" and invert false (the pieces "
                      "are then the pattern's matches, which is all am implements)");
    }
    if (strcmp(re, GPT2_PATTERN) == 0) {
        t->pre = PRE_GPT2;
    } else if (strcmp(re, LLAMA3_PATTERN) == 0) {
        t->pre = PRE_LLAMA3, t->digits_max = 3;
    } else if (strcmp(re, QWEN2_PATTERN) == 0) {
        t->pre = PRE_LLAMA3, t->digits_max = 1;
    } else if (strcmp(re, QWEN35_PATTERN) == 0) {
        t->pre = PRE_LLAMA3, t->digits_max = 1, t->marks = true;
    } else {
        am_errorf(err, NULL, "%s: pre_tokenizer Split: pattern %s is not one am implements (am has no regex engine: "
                  "it implements the patterns of GPT-2, Llama 3, Qwen 2 and Qwen 3.5 by hand)", t->path, re);
        return -1;
    }
    return 0;
}

/* Metaspace (tokenizers/src/pre_tokenizers/metaspace.rs, with its reading of older files:
 * prepend_scheme "always" when absent, add_prefix_space false meaning "never", split true
 * when absent). */
static int load_metaspace(struct am_tokenizer *t, const json_t *p, struct am_errors *err)
{
    const char *rep = json_string_value(json_object_get(p, "replacement"));
    uint32_t cp;
    if (!rep || !*rep || am_utf8_decode((const unsigned char *)rep, strlen(rep), &cp) != strlen(rep))
        return refuse(err, t, "pre_tokenizer Metaspace", "its replacement must be one character");
    memcpy(t->meta, rep, strlen(rep));
    t->meta_len = strlen(rep);
    const json_t *scheme = json_object_get(p, "prepend_scheme"), *aps = json_object_get(p, "add_prefix_space");
    const char *sc = json_string_value(scheme);
    if (!scheme || json_is_null(scheme) || (sc && strcmp(sc, "always") == 0))
        t->prepend = PREPEND_ALWAYS;
    else if (sc && strcmp(sc, "first") == 0)
        t->prepend = PREPEND_FIRST;
    else if (sc && strcmp(sc, "never") == 0)
        t->prepend = PREPEND_NEVER;
    else
        return refuse(err, t, "pre_tokenizer Metaspace", "prepend_scheme must be \"first\", \"always\" or \"never\"");
    if (json_is_false(aps)) {
        if (t->prepend != PREPEND_NEVER)
            return refuse(err, t, "pre_tokenizer Metaspace", "add_prefix_space false does not match prepend_scheme "
                          "(the tokenizers library refuses this file too)");
    }
    t->meta_split = !json_is_false(json_object_get(p, "split"));
    t->pre = PRE_METASPACE;
    return 0;
}

static int load_pre_tokenizer(struct am_tokenizer *t, const json_t *p, struct am_errors *err)
{
    if (!p || json_is_null(p)) {
        t->pre = PRE_NONE; /* Llama 2: the normalized text is one word */
        return 0;
    }
    const char *type = json_string_value(json_object_get(p, "type"));
    const json_t *steps = p;
    size_t n = 1;
    bool seq = type && strcmp(type, "Sequence") == 0;
    if (seq) {
        steps = json_object_get(p, "pretokenizers");
        n = json_array_size(steps);
        if (n == 0) {
            t->pre = PRE_NONE; /* an empty Sequence splits nothing */
            return 0;
        }
    }
    if (!type)
        return refuse(err, t, "pre_tokenizer", "has no \"type\"");
    bool split = false;
    for (size_t i = 0; i < n; i++) {
        const json_t *s = seq ? json_array_get(steps, i) : steps;
        const char *st = json_string_value(json_object_get(s, "type"));
        if (st && strcmp(st, "Split") == 0 && i + 1 < n && !split) {
            if (load_split(t, s, err) < 0)
                return -1;
            split = true;
        } else if (st && strcmp(st, "Metaspace") == 0 && n == 1) {
            return load_metaspace(t, s, err);
        } else if (st && strcmp(st, "ByteLevel") == 0 && i + 1 == n) {
            bool use_regex = !json_is_false(json_object_get(s, "use_regex")); /* the library's default: true */
            t->prefix_space = json_is_true(json_object_get(s, "add_prefix_space"));
            if (use_regex && split) {
                return refuse(err, t, "pre_tokenizer ByteLevel", "use_regex true after a Split would split twice: "
                              "am implements one split pattern");
            }
            if (t->prefix_space && split) {
                return refuse(err, t, "pre_tokenizer ByteLevel", "add_prefix_space true after a Split (a space "
                              "before every piece) is not implemented");
            }
            if (use_regex)
                t->pre = PRE_GPT2;
            else if (!split)
                return refuse(err, t, "pre_tokenizer ByteLevel", "use_regex false without a Split before it is "
                              "not implemented (the whole text would be one word)");
            return 0;
        } else {
            char what[200];
            snprintf(what, sizeof(what), "pre_tokenizer %s%s", st ? st : "?", seq ? " (in a Sequence)" : "");
            return refuse(err, t, what, "am implements ByteLevel, or a Split with a known pattern followed by "
                          "ByteLevel (GPT-2, Llama 3, Qwen 2/3), Metaspace alone (Mistral), or none (Llama 2)");
        }
    }
    return refuse(err, t, "pre_tokenizer", "a Split must be followed by ByteLevel (am implements a Split only in "
                  "byte-level BPE)");
}

static int add_template(struct am_tokenizer *t, const json_t *pp, struct am_errors *err)
{
    const json_t *single = json_object_get(pp, "single"), *special = json_object_get(pp, "special_tokens");
    bool seen_a = false;
    size_t i;
    const json_t *item;
    json_array_foreach(single, i, item) {
        const json_t *sp = json_object_get(item, "SpecialToken"), *sq = json_object_get(item, "Sequence");
        if (sq) {
            const char *id = json_string_value(json_object_get(sq, "id"));
            if (!id || strcmp(id, "A") != 0 || seen_a)
                return refuse(err, t, "post_processor TemplateProcessing", "its single template must hold the "
                              "sequence $A once");
            seen_a = true;
            continue;
        }
        const char *name = json_string_value(json_object_get(sp, "id"));
        const json_t *ids = json_object_get(json_object_get(special, name ? name : ""), "ids");
        if (!name || !json_is_array(ids)) {
            return refuse(err, t, "post_processor TemplateProcessing", "a special token of its single template "
                          "has no entry in special_tokens");
        }
        size_t k;
        const json_t *v;
        json_array_foreach(ids, k, v) {
            int32_t *list = seen_a ? t->suffix : t->prefix;
            size_t *nl = seen_a ? &t->n_suffix : &t->n_prefix;
            if (*nl == 16 || !json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
                return refuse(err, t, "post_processor TemplateProcessing", "more than 16 special tokens, or an id "
                              "that is not a non-negative int32");
            list[(*nl)++] = (int32_t)json_integer_value(v);
        }
    }
    if (!seen_a)
        return refuse(err, t, "post_processor TemplateProcessing", "its single template has no $A");
    return 0;
}

static int load_post_processor(struct am_tokenizer *t, const json_t *p, struct am_errors *err)
{
    if (!p || json_is_null(p))
        return 0;
    const char *type = json_string_value(json_object_get(p, "type"));
    if (type && strcmp(type, "Sequence") == 0) {
        size_t i;
        const json_t *s;
        json_array_foreach(json_object_get(p, "processors"), i, s)
            if (load_post_processor(t, s, err) < 0)
                return -1;
        return 0;
    }
    if (type && strcmp(type, "ByteLevel") == 0)
        return 0; /* it changes offsets only */
    if (type && strcmp(type, "TemplateProcessing") == 0)
        return add_template(t, p, err);
    char what[160];
    snprintf(what, sizeof(what), "post_processor \"%s\"", type ? type : "?");
    return refuse(err, t, what, "am implements TemplateProcessing and ByteLevel (the special tokens of Llama 3, "
                  "Qwen and GPT-2)");
}

static int load_added(struct am_tokenizer *t, const json_t *list, struct am_errors *err)
{
    size_t n = json_array_size(list);
    if (n == 0)
        return 0;
    if (!(t->added = calloc(n, sizeof(*t->added))))
        return refuse(err, t, "added_tokens", "out of memory");
    size_t i;
    const json_t *a;
    json_array_foreach(list, i, a) {
        const char *content = json_string_value(json_object_get(a, "content"));
        const json_t *id = json_object_get(a, "id");
        if (!content || !json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) > INT32_MAX ||
            !*content) {
            am_errorf(err, NULL, "%s: added_tokens[%zu]: needs a non-empty \"content\" and an \"id\" in int32", t->path,
                      i);
            return -1;
        }
        const char *flags[] = {"lstrip", "rstrip", "single_word"};
        for (int f = 0; f < 3; f++)
            if (json_is_true(json_object_get(a, flags[f]))) {
                am_errorf(err, NULL, "%s: added_tokens[%zu] (%s): %s true is not implemented (am splits added tokens "
                          "out exactly where they occur)", t->path, i, content, flags[f]);
                return -1;
            }
        struct added *d = &t->added[t->n_added++];
        d->len = strlen(content);
        if (!(d->s = strdup(content)))
            return refuse(err, t, "added_tokens", "out of memory");
        d->id = (int32_t)json_integer_value(id);
        d->normalized = json_is_true(json_object_get(a, "normalized"));
        t->vocab_size = d->id + 1 > t->vocab_size ? d->id + 1 : t->vocab_size;
        /* a normalized token is searched for in the normalized text as the normalizer writes
         * it (Llama 2's "x" as "\u2581x"), as the library does */
        unsigned char *norm = NULL;
        size_t nn = 0;
        if (d->normalized && normalize(t, (const unsigned char *)d->s, d->len, &norm, &nn) < 0)
            return refuse(err, t, "added_tokens", "out of memory");
        d->match = norm ? (char *)norm : d->s;
        d->match_len = norm ? nn : d->len;
    }
    /* buckets by first byte, longest first: at a position, the first that matches is the
     * longest (the library matches leftmost-longest) */
    for (size_t k = 0; k < t->n_added; k++)
        if (t->added[k].match_len)
            t->n_first[(unsigned char)t->added[k].match[0]]++;
    for (int b = 0; b < 256; b++) {
        if (!t->n_first[b])
            continue;
        if (!(t->by_first[b] = malloc(t->n_first[b] * sizeof(size_t))))
            return refuse(err, t, "added_tokens", "out of memory");
        size_t m = 0;
        for (size_t k = 0; k < t->n_added; k++)
            if (t->added[k].match_len && (unsigned char)t->added[k].match[0] == b)
                t->by_first[b][m++] = k;
        for (size_t x = 1; x < m; x++) /* insertion sort by length, descending (stable) */
            for (size_t y = x; y > 0 && t->added[t->by_first[b][y]].match_len >
                                        t->added[t->by_first[b][y - 1]].match_len; y--) {
                size_t tmp = t->by_first[b][y];
                t->by_first[b][y] = t->by_first[b][y - 1];
                t->by_first[b][y - 1] = tmp;
            }
    }
    return 0;
}

static int load_model(struct am_tokenizer *t, const json_t *m, struct am_errors *err)
{
    const char *type = json_string_value(json_object_get(m, "type"));
    if (!type && json_object_get(m, "merges"))
        type = "BPE"; /* old files leave the type out */
    if (!type || strcmp(type, "BPE") != 0) {
        char what[160];
        snprintf(what, sizeof(what), "model type \"%s\"", type ? type : "?");
        return refuse(err, t, what, "am implements BPE only (WordPiece, Unigram and WordLevel are not implemented)");
    }
    if (!json_is_null(json_object_get(m, "dropout")) && json_object_get(m, "dropout"))
        return refuse(err, t, "model.dropout", "BPE dropout makes encoding random; am encodes deterministically");
    if (!is_null_or_empty(json_object_get(m, "continuing_subword_prefix")) ||
        !is_null_or_empty(json_object_get(m, "end_of_word_suffix")))
        return refuse(err, t, "model.continuing_subword_prefix / end_of_word_suffix", "not implemented (the BPE "
                      "of GPT-2, Llama 2 and 3, Mistral and Qwen does not use them)");
    t->ignore_merges = json_is_true(json_object_get(m, "ignore_merges"));
    t->byte_fallback = json_is_true(json_object_get(m, "byte_fallback"));
    t->fuse_unk = json_is_true(json_object_get(m, "fuse_unk"));
    const json_t *unk = json_object_get(m, "unk_token");
    if (unk && !json_is_null(unk) && !json_is_string(unk))
        return refuse(err, t, "model.unk_token", "must be a string or null");

    const json_t *vocab = json_object_get(m, "vocab"), *merges = json_object_get(m, "merges");
    if (!json_is_object(vocab) || !json_is_array(merges))
        return refuse(err, t, "model", "needs a \"vocab\" object and a \"merges\" array");
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            am_errorf(err, NULL, "%s: model.vocab[\"%s\"]: the id must be an integer in [0, 2^31)", t->path, key);
            return -1;
        }
        int32_t id = (int32_t)json_integer_value(v);
        if (strmap_put(&t->vocab, key, strlen(key), id) < 0)
            return refuse(err, t, "model.vocab", "out of memory");
        t->vocab_size = id + 1 > t->vocab_size ? id + 1 : t->vocab_size;
    }
    t->unk_id = -1;
    if (json_is_string(unk))
        t->unk_id = strmap_find(&t->vocab, json_string_value(unk), json_string_length(unk));
    for (int b = 0; b < 256; b++) {
        char code[8];
        snprintf(code, sizeof(code), "<0x%02X>", b); /* the library's format!("<{b:#04X}>") */
        t->fb_id[b] = t->byte_fallback ? strmap_find(&t->vocab, code, 6) : -1;
    }
    size_t nm = json_array_size(merges);
    t->merges_cap = 1024;
    while (t->merges_cap < 2 * nm + 2)
        t->merges_cap *= 2;
    if (!(t->merges = malloc(t->merges_cap * sizeof(*t->merges))))
        return refuse(err, t, "model.merges", "out of memory");
    memset(t->merges, 0xff, t->merges_cap * sizeof(*t->merges));
    char *buf = NULL;
    size_t buf_cap = 0;
    int rc = -1;
    for (size_t i = 0; i < nm; i++) {
        const json_t *e = json_array_get(merges, i);
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (json_is_string(e)) { /* "a b" (older files) */
            a = json_string_value(e);
            const char *sp = strchr(a, ' ');
            if (sp) {
                la = (size_t)(sp - a), b = sp + 1, lb = strlen(b);
                if (strchr(b, ' '))
                    b = NULL;
            }
        } else if (json_is_array(e) && json_array_size(e) == 2) { /* ["a", "b"] */
            a = json_string_value(json_array_get(e, 0));
            b = json_string_value(json_array_get(e, 1));
            la = a ? strlen(a) : 0, lb = b ? strlen(b) : 0;
        }
        if (!a || !b) {
            am_errorf(err, NULL, "%s: model.merges[%zu]: expected \"A B\" or [\"A\", \"B\"]", t->path, i);
            goto done;
        }
        if (la + lb > buf_cap) {
            buf_cap = 2 * (la + lb);
            free(buf);
            if (!(buf = malloc(buf_cap))) {
                refuse(err, t, "model.merges", "out of memory");
                goto done;
            }
        }
        memcpy(buf, a, la);
        memcpy(buf + la, b, lb);
        int ia = strmap_find(&t->vocab, a, la), ib = strmap_find(&t->vocab, b, lb);
        int im = strmap_find(&t->vocab, buf, la + lb);
        if (ia < 0 || ib < 0 || im < 0) {
            am_errorf(err, NULL, "%s: model.merges[%zu] (%.*s %.*s): %s is not in the vocabulary", t->path, i, (int)la,
                      a, (int)lb, b, ia < 0 ? "the left token" : ib < 0 ? "the right token" : "the merged token");
            goto done;
        }
        merge_put(t, ia, ib, (uint32_t)i, im);
    }
    rc = 0;
done:
    free(buf);
    return rc;
}

/* What a word's first symbols are: with ByteLevel, its bytes (each one in the vocabulary
 * through the ByteLevel alphabet); else its characters, looked up as they are (a table for
 * the Basic Multilingual Plane). */
static int load_alphabet(struct am_tokenizer *t, const json_t *unk, struct am_errors *err)
{
    if (t->pre == PRE_GPT2 || t->pre == PRE_LLAMA3) {
        for (int b = 0; b < 256; b++) {
            unsigned char u[4];
            size_t n = am_utf8_encode(byte_char(b), u);
            memcpy(t->byte_utf8[b], u, n);
            t->byte_utf8_len[b] = (unsigned char)n;
            if ((t->byte_id[b] = strmap_find(&t->vocab, (const char *)u, n)) < 0) {
                am_errorf(err, NULL, "%s: model.vocab has no token for byte 0x%02x (\"%.*s\"): a byte-level BPE "
                          "vocabulary holds all 256 bytes (the ByteLevel pre-tokenizer writes every byte as one of "
                          "them)", t->path, b, (int)n, u);
                return -1;
            }
        }
        return 0;
    }
    bool all_bytes = t->byte_fallback; /* then no character needs unk_token */
    for (int b = 0; b < 256; b++)
        all_bytes = all_bytes && t->fb_id[b] >= 0;
    if (json_is_string(unk) && t->unk_id < 0 && !all_bytes) {
        am_errorf(err, NULL, "%s: model.unk_token \"%s\" is not in model.vocab: the tokenizers library fails on any "
                  "text with a character outside the vocabulary (and not written by byte_fallback); add the token "
                  "or set unk_token to null", t->path, json_string_value(unk));
        return -1;
    }
    if (!(t->bmp_id = malloc(0x10000 * sizeof(int32_t))))
        return refuse(err, t, "model.vocab", "out of memory");
    for (uint32_t cp = 0; cp < 0x10000; cp++) {
        unsigned char u[4];
        size_t n = am_utf8_encode(cp, u);
        t->bmp_id[cp] = cp >= 0xd800 && cp < 0xe000 ? -1 : strmap_find(&t->vocab, (const char *)u, n);
    }
    return 0;
}

int am_tokenizer_load(const char *path, struct am_tokenizer **out, struct am_errors *err)
{
    *out = NULL;
    struct am_tokenizer *t = calloc(1, sizeof(*t));
    if (!t) {
        am_errorf(err, NULL, "%s: out of memory", path);
        return -1;
    }
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        snprintf(t->path, sizeof(t->path), "%s/tokenizer.json", path);
    else
        snprintf(t->path, sizeof(t->path), "%s", path);
    json_error_t jerr;
    json_t *root = json_load_file(t->path, 0, &jerr);
    if (!root) {
        if (stat(t->path, &st) < 0)
            am_errorf(err, NULL, "%s: cannot open: %s (give a tokenizer.json or the directory that holds it)", t->path,
                      strerror(errno));
        else
            am_errorf(err, NULL, "%s:%d:%d: not valid JSON: %s", t->path, jerr.line, jerr.column, jerr.text);
        free(t);
        return -1;
    }
    int rc = -1;
    if (!json_is_object(root)) {
        refuse(err, t, "the file", "is not a JSON object (a Hugging Face tokenizer.json is)");
        goto done;
    }
    const json_t *trunc = json_object_get(root, "truncation"), *pad = json_object_get(root, "padding");
    if ((trunc && !json_is_null(trunc)) || (pad && !json_is_null(pad))) {
        refuse(err, t, "truncation / padding", "set in the file: am does not truncate or pad while building a "
               "dataset (save the tokenizer with both null)");
        goto done;
    }
    if (load_model(t, json_object_get(root, "model"), err) < 0 ||
        load_normalizer(t, json_object_get(root, "normalizer"), err) < 0 ||
        load_pre_tokenizer(t, json_object_get(root, "pre_tokenizer"), err) < 0 ||
        load_alphabet(t, json_object_get(json_object_get(root, "model"), "unk_token"), err) < 0 ||
        load_post_processor(t, json_object_get(root, "post_processor"), err) < 0 ||
        load_added(t, json_object_get(root, "added_tokens"), err) < 0)
        goto done;
    rc = 0;
done:
    json_decref(root);
    if (rc < 0)
        am_tokenizer_free(t);
    else
        *out = t;
    return rc;
}

void am_tokenizer_free(struct am_tokenizer *t)
{
    if (!t)
        return;
    strmap_free(&t->vocab);
    free(t->merges);
    for (size_t i = 0; i < t->n_added; i++) {
        if (t->added[i].match != t->added[i].s)
            free(t->added[i].match);
        free(t->added[i].s);
    }
    for (size_t i = 0; i < t->n_norm; i++) {
        free(t->norm[i].a);
        free(t->norm[i].b);
    }
    free(t->norm);
    free(t->bmp_id);
    free(t->added);
    for (int b = 0; b < 256; b++)
        free(t->by_first[b]);
    free(t);
}

int64_t am_tokenizer_vocab_size(const struct am_tokenizer *t) { return t->vocab_size; }
const char *am_tokenizer_path(const struct am_tokenizer *t) { return t->path; }

int32_t am_tokenizer_token_id(const struct am_tokenizer *t, const char *content)
{
    for (size_t i = 0; i < t->n_added; i++)
        if (strcmp(t->added[i].s, content) == 0)
            return t->added[i].id;
    return strmap_find(&t->vocab, content, strlen(content));
}

/* ---- per-thread state -------------------------------------------------------------------------- */

struct heap_item {
    uint32_t rank, pos;
    int32_t id;
};

#define CACHE_WORD_MAX 64 /* longer words are encoded every time */
#define CACHE_SLOTS (1 << 16)

struct am_tok_state {
    unsigned char *text; /* repaired text, or a segment with a prefix space */
    size_t text_cap;
    uint32_t *cps, *offs; /* a segment's code points and their byte offsets (one more offset) */
    size_t cps_cap;
    int32_t *c, *prev, *next; /* BPE symbols */
    struct heap_item *heap;
    size_t sym_cap, heap_cap;
    char *mapped; /* a word in ByteLevel characters */
    size_t mapped_cap;
    unsigned char *meta; /* a segment after Metaspace */
    size_t meta_cap;
    struct { uint64_t h; uint32_t key_off, ids_off; uint16_t key_len, n_ids; } *cache;
    size_t cache_n;
    unsigned char *ckeys;
    size_t ckeys_len, ckeys_cap;
    int32_t *cids;
    size_t cids_len, cids_cap;
};

struct am_tok_state *am_tok_state_new(void) { return calloc(1, sizeof(struct am_tok_state)); }

void am_tok_state_free(struct am_tok_state *s)
{
    if (!s)
        return;
    free(s->text);
    free(s->cps);
    free(s->offs);
    free(s->c);
    free(s->prev);
    free(s->next);
    free(s->heap);
    free(s->mapped);
    free(s->meta);
    free(s->cache);
    free(s->ckeys);
    free(s->cids);
    free(s);
}

void am_tok_ids_free(struct am_tok_ids *v)
{
    free(v->ids);
    *v = (struct am_tok_ids){0};
}

static int push_ids(struct am_tok_ids *out, const int32_t *ids, size_t n)
{
    if (am_grow((void **)&out->ids, &out->cap, out->n + n, sizeof(int32_t), 64) < 0)
        return -1;
    memcpy(out->ids + out->n, ids, n * sizeof(int32_t));
    out->n += n;
    return 0;
}

/* ---- BPE ---------------------------------------------------------------------------------------- */

static bool heap_less(const struct heap_item *a, const struct heap_item *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct heap_item *h, size_t *n, struct heap_item x)
{
    size_t i = (*n)++;
    while (i > 0 && heap_less(&x, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = x;
}

static struct heap_item heap_pop(struct heap_item *h, size_t *n)
{
    struct heap_item top = h[0], x = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        if (l < *n && heap_less(&h[l], &x))
            m = l;
        if (l + 1 < *n && heap_less(&h[l + 1], m == i ? &x : &h[l]))
            m = l + 1;
        if (m == i)
            break;
        h[i] = h[m];
        i = m;
    }
    if (*n)
        h[i] = x;
    return top;
}

/* The first symbols of a word of characters (PRE_NONE, PRE_METASPACE), as the library's
 * BPE::merge_word makes them: a character in the vocabulary is its token; else, with
 * byte_fallback, its UTF-8 bytes as <0xNN> when all of them are tokens; else unk_token (runs
 * of unknown characters fused into one when fuse_unk), or nothing when there is no
 * unk_token. As in the library, a pending unk is written only before the next character
 * found in the vocabulary (or at the end), so it follows byte tokens that came after it. */
static size_t char_symbols(const struct am_tokenizer *t, const unsigned char *w, size_t n, int32_t *c)
{
    size_t k = 0;
    bool unk = false;
    for (size_t i = 0, l; i < n; i += l) {
        uint32_t cp;
        l = am_utf8_decode(w + i, n - i, &cp);
        int32_t id = cp < 0x10000 ? t->bmp_id[cp] : strmap_find(&t->vocab, (const char *)w + i, l);
        if (id >= 0) {
            if (unk)
                c[k++] = t->unk_id, unk = false;
            c[k++] = id;
            continue;
        }
        if (t->byte_fallback) {
            size_t j = 0;
            while (j < l && t->fb_id[w[i + j]] >= 0)
                j++;
            if (j == l) {
                for (j = 0; j < l; j++)
                    c[k++] = t->fb_id[w[i + j]];
                continue;
            }
        }
        if (t->unk_id >= 0) {
            if (unk && !t->fuse_unk)
                c[k++] = t->unk_id;
            unk = true;
        }
    }
    if (unk)
        c[k++] = t->unk_id;
    return k;
}

/* The BPE of one pre-tokenized word (raw bytes): the library's Word::merge_all, the lowest
 * rank first and, for equal ranks, the leftmost; O(n log n) in the word's length (a heap of
 * candidate pairs over a linked list of symbols), so that a whole line as one word (Llama 2)
 * costs little more than its pieces would. */
static int bpe_word(const struct am_tokenizer *t, struct am_tok_state *s, const unsigned char *w, size_t n,
                    struct am_tok_ids *out)
{
    bool bytes = t->pre == PRE_GPT2 || t->pre == PRE_LLAMA3;
    if (t->ignore_merges) { /* a word that is a token is that token */
        const char *key = (const char *)w;
        size_t m = n;
        if (bytes) {
            if (am_grow((void **)&s->mapped, &s->mapped_cap, 2 * n, 1, 64) < 0)
                return -1;
            m = 0;
            for (size_t i = 0; i < n; i++) {
                memcpy(s->mapped + m, t->byte_utf8[w[i]], t->byte_utf8_len[w[i]]);
                m += t->byte_utf8_len[w[i]];
            }
            key = s->mapped;
        }
        int32_t id = strmap_find(&t->vocab, key, m);
        if (id >= 0)
            return push_ids(out, &id, 1);
    }
    size_t cap = s->sym_cap, hcap = s->heap_cap;
    if (am_grow((void **)&s->c, &cap, n, sizeof(int32_t), 64) < 0 ||
        (cap = s->sym_cap, am_grow((void **)&s->prev, &cap, n, sizeof(int32_t), 64)) < 0 ||
        (cap = s->sym_cap, am_grow((void **)&s->next, &cap, n, sizeof(int32_t), 64)) < 0 ||
        am_grow((void **)&s->heap, &hcap, 3 * n + 1, sizeof(struct heap_item), 64) < 0)
        return -1;
    s->sym_cap = cap;
    s->heap_cap = hcap;
    int32_t *c = s->c, *prev = s->prev, *next = s->next;
    struct heap_item *h = s->heap;
    size_t nh = 0, ns = n;
    if (bytes)
        for (size_t i = 0; i < n; i++)
            c[i] = t->byte_id[w[i]];
    else
        ns = char_symbols(t, w, n, c); /* at most one symbol per byte */
    if (ns == 0)
        return 0;
    for (size_t i = 0; i < ns; i++) {
        prev[i] = (int32_t)i - 1;
        next[i] = i + 1 < ns ? (int32_t)i + 1 : -1;
    }
    for (size_t i = 0; i + 1 < ns; i++) {
        const struct merge *m = merge_find(t, c[i], c[i + 1]);
        if (m)
            heap_push(h, &nh, (struct heap_item){m->rank, (uint32_t)i, m->id});
    }
    while (nh) {
        struct heap_item top = heap_pop(h, &nh);
        int32_t p = (int32_t)top.pos, q = next[p];
        if (c[p] < 0 || q < 0)
            continue;
        const struct merge *m = merge_find(t, c[p], c[q]);
        if (!m || m->id != top.id)
            continue; /* stale: one of the two symbols changed since (the library compares the new id only) */
        c[p] = top.id;
        c[q] = -1;
        next[p] = next[q];
        if (next[q] >= 0)
            prev[next[q]] = p;
        /* each merge adds at most two candidates: the heap holds fewer than 3n */
        if (prev[p] >= 0 && (m = merge_find(t, c[prev[p]], c[p])))
            heap_push(h, &nh, (struct heap_item){m->rank, (uint32_t)prev[p], m->id});
        if (next[p] >= 0 && (m = merge_find(t, c[p], c[next[p]])))
            heap_push(h, &nh, (struct heap_item){m->rank, (uint32_t)p, m->id});
    }
    for (int32_t i = 0; i >= 0; i = next[i])
        if (push_ids(out, &c[i], 1) < 0)
            return -1;
    return 0;
}

/* bpe_word through the state's cache of short words. */
static int encode_word(const struct am_tokenizer *t, struct am_tok_state *s, const unsigned char *w, size_t n,
                       struct am_tok_ids *out)
{
    if (n > CACHE_WORD_MAX)
        return bpe_word(t, s, w, n, out);
    if (!s->cache && !(s->cache = calloc(CACHE_SLOTS, sizeof(*s->cache))))
        return -1;
    uint64_t h = hash_bytes(w, n);
    size_t i = h & (CACHE_SLOTS - 1);
    for (; s->cache[i].h; i = (i + 1) & (CACHE_SLOTS - 1))
        if (s->cache[i].h == h && s->cache[i].key_len == n && memcmp(s->ckeys + s->cache[i].key_off, w, n) == 0)
            return push_ids(out, s->cids + s->cache[i].ids_off, s->cache[i].n_ids);
    size_t before = out->n;
    if (bpe_word(t, s, w, n, out) < 0)
        return -1;
    size_t k = out->n - before;
    if (s->cache_n >= CACHE_SLOTS / 2 || s->ckeys_len + n > UINT32_MAX || s->cids_len + k > UINT32_MAX) {
        memset(s->cache, 0, CACHE_SLOTS * sizeof(*s->cache)); /* full: start over */
        s->cache_n = s->ckeys_len = s->cids_len = 0;
        i = h & (CACHE_SLOTS - 1);
    }
    if (am_grow((void **)&s->ckeys, &s->ckeys_cap, s->ckeys_len + n, 1, 64) < 0 ||
        am_grow((void **)&s->cids, &s->cids_cap, s->cids_len + k, sizeof(int32_t), 64) < 0)
        return 0; /* not cached: no harm */
    memcpy(s->ckeys + s->ckeys_len, w, n);
    memcpy(s->cids + s->cids_len, out->ids + before, k * sizeof(int32_t));
    s->cache[i].h = h;
    s->cache[i].key_off = (uint32_t)s->ckeys_len;
    s->cache[i].key_len = (uint16_t)n;
    s->cache[i].ids_off = (uint32_t)s->cids_len;
    s->cache[i].n_ids = (uint16_t)k;
    s->ckeys_len += n;
    s->cids_len += k;
    s->cache_n++;
    return 0;
}

/* ---- the split patterns, by hand ---------------------------------------------------------------- */

#define F(cp) am_uni_flags(cp)

/* The length of the run of code points from i with a flag in `mask` (0 when cps[i] has none). */
static size_t run(const uint32_t *cps, size_t n, size_t i, unsigned mask)
{
    size_t j = i;
    while (j < n && (F(cps[j]) & mask))
        j++;
    return j - i;
}

/* \s+(?!\S)|\s+ at a white-space code point: the whole run at the end of the text, else all
 * but its last code point (which then goes with what follows), else the one. */
static size_t match_space(const uint32_t *cps, size_t n, size_t i)
{
    size_t k = run(cps, n, i, AM_UNI_WS);
    return i + k == n ? k : k >= 2 ? k - 1 : 1;
}

/* 's|'t|'re|'ve|'m|'ll|'d, case-insensitive when fold (Oniguruma folds U+017F LONG S to s). */
static size_t match_contraction(const uint32_t *cps, size_t n, size_t i, bool fold)
{
    if (cps[i] != '\'' || i + 1 >= n)
        return 0;
    uint32_t d = cps[i + 1], e = i + 2 < n ? cps[i + 2] : 0;
    if (fold) {
        d = d == 0x17f ? 's' : (d >= 'A' && d <= 'Z') ? d + 32 : d;
        e = e == 0x17f ? 's' : (e >= 'A' && e <= 'Z') ? e + 32 : e;
    }
    if (d == 's' || d == 't' || d == 'm' || d == 'd')
        return 2;
    if ((d == 'r' && e == 'e') || (d == 'v' && e == 'e') || (d == 'l' && e == 'l'))
        return 3;
    return 0;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t match_gpt2(const uint32_t *cps, size_t n, size_t i)
{
    size_t k = match_contraction(cps, n, i, false);
    if (k)
        return k;
    size_t j = i + (cps[i] == ' ');
    if (j < n) {
        unsigned f = F(cps[j]);
        if (f & AM_UNI_L)
            return j - i + run(cps, n, j, AM_UNI_L);
        if (f & AM_UNI_N)
            return j - i + run(cps, n, j, AM_UNI_N);
        if (!(f & (AM_UNI_WS | AM_UNI_L | AM_UNI_N))) {
            size_t e = j;
            while (e < n && !(F(cps[e]) & (AM_UNI_WS | AM_UNI_L | AM_UNI_N)))
                e++;
            return e - i;
        }
    }
    return match_space(cps, n, i);
}

/* Llama 3 (digits 3), Qwen 2 (digits 1), Qwen 3.5 (digits 1, letters with marks):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
 * \s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t match_llama3(const struct am_tokenizer *t, const uint32_t *cps, size_t n, size_t i)
{
    size_t k = match_contraction(cps, n, i, true);
    if (k)
        return k;
    unsigned letter = AM_UNI_L | (t->marks ? AM_UNI_M : 0), other_not = AM_UNI_WS | AM_UNI_N | letter;
    uint32_t c = cps[i];
    unsigned f = F(c);
    if (c != '\r' && c != '\n' && !(f & (AM_UNI_L | AM_UNI_N)) && i + 1 < n && (F(cps[i + 1]) & letter))
        return 1 + run(cps, n, i + 1, letter);
    if (f & letter)
        return run(cps, n, i, letter);
    if (f & AM_UNI_N) {
        k = run(cps, n, i, AM_UNI_N);
        return k < (size_t)t->digits_max ? k : (size_t)t->digits_max;
    }
    size_t j = i + (c == ' ');
    if (j < n && !(F(cps[j]) & other_not)) {
        while (j < n && !(F(cps[j]) & other_not))
            j++;
        while (j < n && (cps[j] == '\r' || cps[j] == '\n'))
            j++;
        return j - i;
    }
    /* white space: \s*[\r\n]+ takes the run up to its last line break */
    k = run(cps, n, i, AM_UNI_WS);
    for (size_t p = i + k; p > i; p--)
        if (cps[p - 1] == '\r' || cps[p - 1] == '\n')
            return p - i;
    return match_space(cps, n, i);
}

/* ---- encoding ------------------------------------------------------------------------------------ */

/* Metaspace on one segment (metaspace.rs): every ' ' becomes the replacement; the
 * replacement is put in front unless the segment starts with it (prepend_scheme "always",
 * or "first" for the segment at the start of the text); with split, a new word starts at
 * every replacement character. */
static int encode_metaspace(const struct am_tokenizer *t, struct am_tok_state *s, const unsigned char *text,
                            size_t len, bool at_start, struct am_tok_ids *out)
{
    const char *r = t->meta;
    size_t rl = t->meta_len, spaces = 0;
    for (size_t i = 0; i < len; i++)
        spaces += text[i] == ' ';
    if (am_grow((void **)&s->meta, &s->meta_cap, len + (spaces + 1) * rl, 1, 64) < 0)
        return -1;
    unsigned char *w = s->meta;
    size_t n = 0;
    bool starts = text[0] == ' ' || (len >= rl && memcmp(text, r, rl) == 0); /* after the replacement */
    if (!starts && (t->prepend == PREPEND_ALWAYS || (t->prepend == PREPEND_FIRST && at_start))) {
        memcpy(w, r, rl);
        n = rl;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(w + n, r, rl);
            n += rl;
        } else {
            w[n++] = text[i];
        }
    }
    if (!t->meta_split)
        return encode_word(t, s, w, n, out);
    size_t start = 0;
    for (size_t i = 1; i + rl <= n; i++) /* UTF-8: a match is always at a character's start */
        if (memcmp(w + i, r, rl) == 0) {
            if (encode_word(t, s, w + start, i - start, out) < 0)
                return -1;
            start = i;
        }
    return encode_word(t, s, w + start, n - start, out);
}

/* Pre-tokenizes and encodes text[0, len) (valid UTF-8, no added token in it); at_start: the
 * segment begins the text (Metaspace's "first"). */
static int encode_plain(const struct am_tokenizer *t, struct am_tok_state *s, const unsigned char *text, size_t len,
                        bool at_start, struct am_tok_ids *out)
{
    if (len == 0)
        return 0;
    if (t->pre == PRE_NONE)
        return encode_word(t, s, text, len, out);
    if (t->pre == PRE_METASPACE)
        return encode_metaspace(t, s, text, len, at_start, out);
    size_t n = 0, cap = s->cps_cap;
    if (am_grow((void **)&s->cps, &cap, len + 2, sizeof(uint32_t), 64) < 0 ||
        (cap = s->cps_cap, am_grow((void **)&s->offs, &cap, len + 2, sizeof(uint32_t), 64)) < 0)
        return -1;
    s->cps_cap = cap;
    const unsigned char *w = text;
    unsigned char *spaced = NULL;
    if (t->prefix_space && text[0] != ' ') { /* ByteLevel's add_prefix_space */
        if (!(spaced = malloc(len + 1)))
            return -1;
        spaced[0] = ' ';
        memcpy(spaced + 1, text, len);
        w = spaced;
        len++;
    }
    for (size_t i = 0; i < len; n++) {
        s->offs[n] = (uint32_t)i;
        i += am_utf8_decode(w + i, len - i, &s->cps[n]);
    }
    s->offs[n] = (uint32_t)len;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0;) {
        size_t k = t->pre == PRE_GPT2 ? match_gpt2(s->cps, n, i) : match_llama3(t, s->cps, n, i);
        rc = encode_word(t, s, w + s->offs[i], s->offs[i + k] - s->offs[i], out);
        i += k;
    }
    free(spaced);
    return rc;
}

/* Splits text[0, len) on the added tokens with normalized == pass (0: the non-normalized
 * ones, first; 1: the normalized ones, inside what pass 0 left, after the normalizer; 2: as 1,
 * normalized already), leftmost-longest. at_start: text begins the whole text. */
static int encode_added(const struct am_tokenizer *t, struct am_tok_state *s, const unsigned char *text, size_t len,
                        int pass, bool at_start, struct am_tok_ids *out)
{
    if (pass == 1 && t->n_norm) { /* the normalizer, between the non-normalized added tokens */
        size_t n;
        unsigned char *norm;
        if (normalize(t, text, len, &norm, &n) < 0)
            return -1;
        if (norm) {
            int rc = encode_added(t, s, norm, n, 2, at_start, out);
            free(norm);
            return rc;
        }
    }
    pass = pass == 2 ? 1 : pass;
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
        size_t nb = t->n_first[text[i]];
        if (!nb)
            continue;
        const struct added *hit = NULL;
        for (size_t k = 0; k < nb; k++) {
            const struct added *a = &t->added[t->by_first[text[i]][k]];
            if (a->normalized == (pass == 1) && a->match_len <= len - i && memcmp(text + i, a->match, a->match_len) == 0) {
                hit = a;
                break;
            }
        }
        if (!hit)
            continue;
        bool first = at_start && start == 0;
        if ((pass == 0 ? encode_added(t, s, text + start, i - start, 1, first, out)
                       : encode_plain(t, s, text + start, i - start, first, out)) < 0 ||
            push_ids(out, &hit->id, 1) < 0)
            return -1;
        i += hit->match_len - 1;
        start = i + 1;
    }
    bool first = at_start && start == 0;
    return pass == 0 ? encode_added(t, s, text + start, len - start, 1, first, out)
                     : encode_plain(t, s, text + start, len - start, first, out);
}

int am_tokenizer_encode(const struct am_tokenizer *t, struct am_tok_state *s, const char *text, size_t len,
                        bool add_special, struct am_tok_ids *out, struct am_errors *err)
{
    const unsigned char *u = (const unsigned char *)text;
    /* offsets are 32-bit; a SentencePiece-style word may grow 3 times (spaces to "\u2581") and
     * its symbols are int32 */
    size_t max = t->pre == PRE_GPT2 || t->pre == PRE_LLAMA3 ? UINT32_MAX / 4 : INT32_MAX / 4;
    if (len > max) {
        am_errorf(err, NULL, "a text of %zu bytes: am encodes texts below %s (split it)", len,
                  max == UINT32_MAX / 4 ? "1 GiB" : "512 MiB");
        return -1;
    }
    if (!am_utf8_valid(u, len)) { /* repair: U+FFFD for every maximal invalid subpart */
        if (am_grow((void **)&s->text, &s->text_cap, 3 * len, 1, 64) < 0)
            goto oom;
        size_t m = 0;
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            i += am_utf8_decode(u + i, len - i, &cp);
            m += am_utf8_encode(cp, s->text + m);
        }
        u = s->text;
        len = m;
    }
    if ((add_special && push_ids(out, t->prefix, t->n_prefix) < 0) || encode_added(t, s, u, len, 0, true, out) < 0 ||
        (add_special && push_ids(out, t->suffix, t->n_suffix) < 0))
        goto oom;
    return 0;
oom:
    am_errorf(err, NULL, "out of memory encoding a text of %zu bytes", len);
    return -1;
}
