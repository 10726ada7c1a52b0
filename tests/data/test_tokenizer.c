/* test_tokenizer.c - byte-level BPE against the Hugging Face `tokenizers` library, without
 * Python: tests/data/tokenizer/ holds four tokenizers trained by that library in the styles
 * of GPT-2, Llama 3, Qwen 2 and Qwen 3.5, hostile texts (invalid UTF-8, long runs, samples
 * of every Unicode general category, emoji, CJK, combining marks, special tokens inside the
 * text) and the ids the library gave for each, with and without the post-processor's
 * special tokens (make_tokenizers.py made them). Every id must be equal. Also: UTF-8 repair
 * as Python does it, every refusal of a tokenizer am does not implement, by message, and
 * `am-data build --tokenizer`: the documents' ids, the same files from 1 and 3 threads, a
 * build killed between syncs and resumed equal to one never interrupted, instruction data's
 * loss mask (eos and the chat-template refusal from a tokenizer directory), and the messages
 * for bad input lines. */
#include <jansson.h>
#include <sys/wait.h>

#include "../ckpt/testio.h"
#include "dataset.h"
#include "tokenizer.h"
#include "unicode.h"

static const char *tokfile(const char *name) { return srcpath(pathf("tests/data/tokenizer/%s", name)); }

/* extra: a second file of texts, after texts.bin (the SentencePiece-style tokenizers') */
static void check_style(const char *style, const char *extra)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t;
    if (am_tokenizer_load(tokfile(pathf("%s.json", style)), &t, &err) < 0)
        expect_no_error(&err);
    size_t nt, ni;
    unsigned char *texts = slurp(tokfile("texts.bin"), &nt);
    if (extra) {
        size_t ne;
        unsigned char *more = slurp(tokfile(extra), &ne);
        texts = realloc(texts, nt + 1 + ne + 1);
        texts[nt] = '\0';
        memcpy(texts + nt + 1, more, ne);
        nt += 1 + ne;
        free(more);
    }
    char *ids = (char *)slurp(tokfile(pathf("%s.ids", style)), &ni);
    ids[ni] = '\0';
    /* the texts, NUL-separated */
    size_t n_texts = 1;
    for (size_t i = 0; i < nt; i++)
        n_texts += texts[i] == 0;
    struct am_tok_state *s = am_tok_state_new();
    struct am_tok_ids out = {0};
    char *line = ids;
    size_t checked = 0, tokens = 0;
    for (int special = 1; special >= 0; special--) {
        size_t start = 0;
        for (size_t k = 0; k < n_texts; k++) {
            size_t end = start;
            while (end < nt && texts[end])
                end++;
            out.n = 0;
            assert_int_equal(am_tokenizer_encode(t, s, (const char *)texts + start, end - start, special, &out, &err), 0);
            char *nl = strchr(line, '\n');
            assert_non_null(nl);
            *nl = '\0';
            size_t j = 0;
            for (char *p = line, *q; *p; p = q) {
                long v = strtol(p, &q, 10);
                if (j >= out.n || out.ids[j] != v)
                    fail_msg("%s, text %zu (bytes %zu..%zu), special %d: id %zu is %d, tokenizers gives %ld", style, k,
                             start, end, special, j, j < out.n ? out.ids[j] : -1, v);
                j++;
            }
            if (j != out.n)
                fail_msg("%s, text %zu, special %d: %zu ids, tokenizers gives %zu", style, k, special, out.n, j);
            tokens += j;
            line = nl + 1;
            start = end + 1;
            checked++;
        }
    }
    assert_int_equal(*line, '\0'); /* every expected line used */
    print_message("%s: %zu texts, %zu ids equal\n", style, checked, tokens);
    assert_true(checked > 600 && tokens > 50000);
    am_tok_ids_free(&out);
    am_tok_state_free(s);
    am_tokenizer_free(t);
    free(texts);
    free(ids);
}

static void test_gpt2(void **state) { (void)state; check_style("gpt2", NULL); }
static void test_llama3(void **state) { (void)state; check_style("llama3", NULL); }
static void test_qwen2(void **state) { (void)state; check_style("qwen2", NULL); }
static void test_qwen35(void **state) { (void)state; check_style("qwen35", NULL); }
/* SentencePiece-style BPE: Llama 2 (Prepend + Replace, the whole text one word), Mistral
 * (Metaspace "first"), and Metaspace "always" with split, NFC, half the byte tokens and
 * unfused <unk> */
static void test_llama2(void **state) { (void)state; check_style("llama2", "texts_spm.bin"); }
static void test_mistral(void **state) { (void)state; check_style("mistral", "texts_spm.bin"); }
static void test_spm_unk(void **state) { (void)state; check_style("spm_unk", "texts_spm.bin"); }
/* Llama 2's file as it was made: a model trained by `sentencepiece` with Llama 2's settings,
 * converted as transformers' LlamaConverter converts it (merges from the pieces' scores) */
static void test_llama2_sp(void **state) { (void)state; check_style("llama2_sp", "texts_spm.bin"); }

/* Python's bytes.decode("utf-8", "replace"): one U+FFFD per maximal invalid subpart. */
static void test_utf8_repair(void **state)
{
    (void)state;
    static const struct { const char *in; uint32_t want[8]; } cases[] = {
        {"\xe0\xa0", {0xfffd}},                      /* truncated at the end: one */
        {"\xe0\x80", {0xfffd, 0xfffd}},              /* overlong: E0 alone, then 80 */
        {"\xed\xa0\x80", {0xfffd, 0xfffd, 0xfffd}},  /* a surrogate */
        {"\xf4\x90\x80\x80", {0xfffd, 0xfffd, 0xfffd, 0xfffd}}, /* past U+10FFFF */
        {"\xf0\x9f\x91x", {0xfffd, 'x'}},
        {"\xc3\xa9\xe2\x82\xac", {0xe9, 0x20ac}},
        {"\xc0\xaf", {0xfffd, 0xfffd}},
        {"\xf0\x9f\x91\x8d", {0x1f44d}},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const unsigned char *s = (const unsigned char *)cases[c].in;
        size_t n = strlen(cases[c].in), k = 0;
        for (size_t i = 0; i < n; k++) {
            uint32_t cp;
            i += am_utf8_decode(s + i, n - i, &cp);
            assert_int_equal(cp, cases[c].want[k]);
        }
        assert_int_equal(cases[c].want[k], 0);
    }
    assert_true(am_utf8_valid((const unsigned char *)"\xef\xbf\xbd ok", 6));
    assert_false(am_utf8_valid((const unsigned char *)"\xed\xa0\x80", 3));
    /* the classes: Unicode 16.0 knows Garay (U+10D50, a letter) */
    assert_int_equal(am_uni_flags(0x10d50), AM_UNI_L);
    assert_int_equal(am_uni_flags(0x3000), AM_UNI_WS);
    assert_int_equal(am_uni_flags(0x0301), AM_UNI_M);
    assert_int_equal(am_uni_flags(0x0663), AM_UNI_N);
    assert_int_equal(am_uni_flags(0x180e), 0); /* not White_Space since Unicode 6.3 */
}

/* Writes BASE (a committed tokenizer) with `from` replaced by `to` (once) and loads it: the
 * message. */
static void expect_refusal_in(const char *base, const char *from, const char *to, const char *want)
{
    char *dir = scratch_dir();
    size_t n;
    char *js = (char *)slurp(tokfile(base), &n);
    js[n] = '\0';
    char *at = strstr(js, from);
    if (!at)
        fail_msg("%s has no %s", base, from);
    const char *path = pathf("%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fwrite(js, 1, (size_t)(at - js), f);
    fputs(to, f);
    fputs(at + strlen(from), f);
    fclose(f);
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t = NULL;
    assert_int_equal(am_tokenizer_load(dir, &t, &err), -1); /* the directory: its tokenizer.json */
    assert_null(t);
    expect_error(&err, "%s: %s", path, want);
    free(js);
    rm_tree(dir);
}

static void expect_refusal(const char *from, const char *to, const char *want)
{
    expect_refusal_in("gpt2.json", from, to, want);
}

static void test_refusals(void **state)
{
    (void)state;
    expect_refusal("\"normalizer\": null", "\"normalizer\": {\"type\":\"NFKC\"}",
                   "normalizer \"NFKC\": am implements NFC (Qwen 2/3), Prepend and Replace with a string pattern "
                   "(Llama 2), a Sequence of those, or none; another normalizer would change the text and give other "
                   "ids");
    expect_refusal("\"normalizer\": null",
                   "\"normalizer\": {\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":"
                   "\"x\"},{\"type\":\"Replace\",\"pattern\":{\"Regex\":\" +\"},\"content\":\"_\"}]}",
                   "normalizer Replace: am implements a non-empty {\"String\": ...} pattern and a string content "
                   "(Llama 2's \" \" -> \"\u2581\"); a Regex pattern needs a regex engine, which am does not have");
    expect_refusal("\"type\": \"BPE\"", "\"type\": \"WordPiece\"",
                   "model type \"WordPiece\": am implements BPE only (WordPiece, Unigram and WordLevel are not "
                   "implemented)");
    expect_refusal("\"dropout\": null", "\"dropout\": 0.1",
                   "model.dropout: BPE dropout makes encoding random; am encodes deterministically");
    expect_refusal("\"pre_tokenizer\": {\n    \"type\": \"ByteLevel\"", "\"pre_tokenizer\": {\"type\": \"Whitespace\"",
                   "pre_tokenizer Whitespace: am implements ByteLevel, or a Split with a known pattern followed by "
                   "ByteLevel (GPT-2, Llama 3, Qwen 2/3), Metaspace alone (Mistral), or none (Llama 2)");
    expect_refusal("\"pre_tokenizer\": {\n    \"type\": \"ByteLevel\"",
                   "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Metaspace\","
                   "\"replacement\":\"_\"},{\"type\":\"Digits\"}]},\"x\":{\"type\":\"ByteLevel\"",
                   "pre_tokenizer Metaspace (in a Sequence): am implements ByteLevel, or a Split with a known pattern "
                   "followed by ByteLevel (GPT-2, Llama 3, Qwen 2/3), Metaspace alone (Mistral), or none (Llama 2)");
    expect_refusal("\"pre_tokenizer\": {\n    \"type\": \"ByteLevel\"",
                   "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":"
                   "{\"Regex\":\"\\\\w+\"},\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\","
                   "\"use_regex\":false}]},\"x\":{\"type\":\"ByteLevel\"",
                   "pre_tokenizer Split: pattern \\w+ is not one am implements (am has no regex engine: it implements "
                   "the patterns of GPT-2, Llama 3, Qwen 2 and Qwen 3.5 by hand)");
    expect_refusal("\"post_processor\": {\n    \"type\": \"ByteLevel\"", "\"post_processor\": {\"type\": \"RobertaProcessing\"",
                   "post_processor \"RobertaProcessing\": am implements TemplateProcessing and ByteLevel (the special "
                   "tokens of Llama 3, Qwen and GPT-2)");
    expect_refusal("\"single_word\": false", "\"single_word\": true",
                   "added_tokens[0] (<|endoftext|>): single_word true is not implemented (am splits added tokens out "
                   "exactly where they occur)");
    expect_refusal("\"Ā\": ", "\"no-such\": ",
                   "model.vocab has no token for byte 0x00 (\"Ā\"): a byte-level BPE vocabulary holds all 256 bytes "
                   "(the ByteLevel pre-tokenizer writes every byte as one of them)");
    /* SentencePiece-style */
    expect_refusal_in("spm_unk.json", "\"unk_token\": \"<unk>\"", "\"unk_token\": \"<nope>\"",
                      "model.unk_token \"<nope>\" is not in model.vocab: the tokenizers library fails on any text "
                      "with a character outside the vocabulary (and not written by byte_fallback); add the token or "
                      "set unk_token to null");
    expect_refusal_in("mistral.json", "\"prepend_scheme\": \"first\"", "\"prepend_scheme\": \"sometimes\"",
                      "pre_tokenizer Metaspace: prepend_scheme must be \"first\", \"always\" or \"never\"");
    expect_refusal_in("mistral.json", "\"prepend_scheme\": \"first\"", "\"add_prefix_space\": false",
                      "pre_tokenizer Metaspace: add_prefix_space false does not match prepend_scheme (the tokenizers "
                      "library refuses this file too)");
    expect_refusal_in("mistral.json", "\"replacement\": \"▁\"", "\"replacement\": \"▁▁\"",
                      "pre_tokenizer Metaspace: its replacement must be one character");
    expect_refusal_in("llama2.json", "\"continuing_subword_prefix\": null", "\"continuing_subword_prefix\": \"##\"",
                      "model.continuing_subword_prefix / end_of_word_suffix: not implemented (the BPE of GPT-2, "
                      "Llama 2 and 3, Mistral and Qwen does not use them)");
}

/* Llama 2 makes a whole line one word: a 4 MiB line (words, runs of spaces, CJK and emoji
 * outside the vocabulary) encodes in time only with a merge of O(n log n), and its tokens
 * spell the normalized line exactly ("\u2581" before it and for every space, byte tokens
 * for what the vocabulary lacks). */
static void test_long_line(void **state)
{
    (void)state;
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t;
    const char *path = tokfile("llama2.json");
    if (am_tokenizer_load(path, &t, &err) < 0)
        expect_no_error(&err);
    json_t *root = json_load_file(path, 0, NULL);
    json_t *vocab = json_object_get(json_object_get(root, "model"), "vocab");
    const char **str = calloc((size_t)am_tokenizer_vocab_size(t), sizeof(char *));
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v)
        str[json_integer_value(v)] = key;
    static const char *const parts[] = {"the ", "quick ", "brown fox", "  ", "    ", ". ", ", ", "jumps ", "中文",
                                        "\xf0\x9f\x91\x8d", "e ", "\n", "\xea\x99\xae", "tokenizer", "don't "};
    size_t cap = (size_t)4 << 20, len = 0;
    char *text = malloc(cap + 16);
    uint64_t x = 88172645463325252ull;
    while (len < cap) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        const char *p = parts[x % (sizeof(parts) / sizeof(parts[0]))];
        memcpy(text + len, p, strlen(p));
        len += strlen(p);
    }
    struct am_tok_state *s = am_tok_state_new();
    struct am_tok_ids out = {0};
    assert_int_equal(am_tokenizer_encode(t, s, text, len, false, &out, &err), 0);
    /* spell it back */
    char *spelt = malloc(4 * len + 16);
    size_t m = 0;
    for (size_t i = 0; i < out.n; i++) {
        int32_t id = out.ids[i];
        unsigned b;
        if (id == am_tokenizer_token_id(t, "tokenizer")) { /* the normalized added token: "\u2581tokenizer" */
            memcpy(spelt + m, "\xe2\x96\x81tokenizer", 12);
            m += 12;
        } else if (sscanf(str[id], "<0x%2X>", &b) == 1 && strlen(str[id]) == 6) {
            spelt[m++] = (char)b;
        } else {
            memcpy(spelt + m, str[id], strlen(str[id]));
            m += strlen(str[id]);
        }
    }
    char *want = malloc(4 * len + 16);
    size_t w = 0;
    memcpy(want, "\xe2\x96\x81", 3), w = 3;
    for (size_t i = 0; i < len; i++)
        if (text[i] == ' ')
            memcpy(want + w, "\xe2\x96\x81", 3), w += 3;
        else
            want[w++] = text[i];
    assert_int_equal(m, w);
    assert_memory_equal(spelt, want, w);
    assert_true(out.n < len / 2); /* merged, not left in characters */
    print_message("llama2: a line of %zu bytes in %zu tokens\n", len, out.n);
    free(spelt);
    free(want);
    free(text);
    free(str);
    json_decref(root);
    am_tok_ids_free(&out);
    am_tok_state_free(s);
    am_tokenizer_free(t);
}

/* Llama 2 with an unk_token outside the vocabulary: every byte has a token, so no character
 * needs unk_token and the library encodes (ids from tokenizers 0.23.3); so does am. And an
 * empty pre-tokenizer Sequence. */
static void test_unk_not_needed(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    size_t n;
    char *js = (char *)slurp(tokfile("llama2.json"), &n);
    js[n] = '\0';
    char *at = strstr(js, "\"unk_token\": \"<unk>\"");
    assert_non_null(at);
    memcpy(at + strlen("\"unk_token\": \"<"), "nop", 3); /* "<nop>" */
    spit(pathf("%s/tokenizer.json", dir), js, n);
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t;
    if (am_tokenizer_load(dir, &t, &err) < 0)
        expect_no_error(&err);
    struct am_tok_state *s = am_tok_state_new();
    struct am_tok_ids out = {0};
    const char *text = "hello \xea\x99\xae"; /* U+A66E, not in the vocabulary */
    assert_int_equal(am_tokenizer_encode(t, s, text, strlen(text), true, &out, &err), 0);
    const int32_t want[] = {1, 377, 418, 299, 299, 302, 377, 237, 156, 177};
    assert_int_equal(out.n, 10);
    assert_memory_equal(out.ids, want, sizeof(want));
    am_tokenizer_free(t);
    free(js);
    /* Mistral's with an empty Sequence for its pre-tokenizer: no pre-tokenization at all
     * (spaces stay spaces, byte tokens) */
    js = (char *)slurp(tokfile("mistral.json"), &n);
    js[n] = '\0';
    char *a = strstr(js, "\"pre_tokenizer\": {"), *b = strstr(a, "},") + 1;
    FILE *f = fopen(pathf("%s/tokenizer.json", dir), "wb");
    assert_non_null(f);
    fwrite(js, 1, (size_t)(a - js), f);
    fputs("\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": []}", f);
    fputs(b, f);
    fclose(f);
    if (am_tokenizer_load(dir, &t, &err) < 0)
        expect_no_error(&err);
    text = "The quick  fox, \xea\x99\xae!";
    out.n = 0;
    assert_int_equal(am_tokenizer_encode(t, s, text, strlen(text), true, &out, &err), 0);
    const int32_t want2[] = {1, 287, 418, 35, 575, 573, 35, 35, 293, 574, 268, 35, 237, 156, 177, 261};
    assert_int_equal(out.n, 16);
    assert_memory_equal(out.ids, want2, sizeof(want2));
    am_tok_ids_free(&out);
    am_tok_state_free(s);
    am_tokenizer_free(t);
    free(js);
    rm_tree(dir);
}

/* ---- am-data build --tokenizer --------------------------------------------------------------- */

static int run(const char *cmd)
{
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
}

static const char *am_data(void)
{
    const char *b = getenv("AM_BUILDDIR") ? getenv("AM_BUILDDIR") : ".";
    return pathf("%s/am-data", b);
}

/* The committed texts that are valid UTF-8, as JSONL rows {"text": ...} (repeated `times`),
 * and their expected ids (with special tokens) from IDS (llama3.ids, ...). Returns the number
 * of rows. */
static size_t write_jsonl(const char *path, const char *ids_file, int times, int32_t ***want, size_t **want_n)
{
    size_t nt, ni;
    unsigned char *texts = slurp(tokfile("texts.bin"), &nt);
    char *ids = (char *)slurp(tokfile(ids_file), &ni);
    ids[ni] = '\0';
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    size_t rows = 0, cap = 400 * (size_t)times;
    *want = calloc(cap, sizeof(**want));
    *want_n = calloc(cap, sizeof(**want_n));
    for (int r = 0; r < times; r++) {
        char *line = ids;
        for (size_t start = 0; start <= nt;) {
            size_t end = start;
            while (end < nt && texts[end])
                end++;
            char *nl = strchr(line, '\n');
            json_t *row = json_object();
            json_t *str = json_stringn((const char *)texts + start, end - start);
            if (str) { /* NULL: not valid UTF-8 */
                json_object_set_new(row, "text", str);
                json_object_set_new(row, "n", json_integer((json_int_t)rows));
                char *js = json_dumps(row, JSON_COMPACT | (rows % 2 ? JSON_ENSURE_ASCII : 0));
                fprintf(f, "%s\n%s", js, rows % 7 == 0 ? "\n" : ""); /* blank lines are skipped */
                free(js);
                assert_true(rows < cap);
                int32_t *v = malloc((end - start + 8) * 4 * sizeof(int32_t));
                size_t n = 0;
                for (char *p = line, *q; p < nl; p = q) {
                    long x = strtol(p, &q, 10);
                    if (q == p)
                        break;
                    v[n++] = (int32_t)x;
                }
                (*want)[rows] = v;
                (*want_n)[rows++] = n;
            }
            json_decref(row);
            line = nl + 1;
            start = end + 1;
        }
    }
    fclose(f);
    free(texts);
    free(ids);
    return rows;
}

static void expect_docs(const char *prefix, int32_t **want, const size_t *want_n, size_t rows)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed *d;
    assert_int_equal(am_indexed_open(prefix, &d, &err), 0);
    assert_int_equal(am_indexed_documents(d), (int64_t)rows);
    int32_t *buf = malloc(1 << 22);
    for (size_t r = 0; r < rows; r++) {
        assert_int_equal(am_indexed_length(d, (int64_t)r), (int32_t)want_n[r]);
        assert_int_equal(am_indexed_read(d, (int64_t)r, 0, (int64_t)want_n[r], buf, &err), 0);
        assert_memory_equal(buf, want[r], want_n[r] * sizeof(int32_t));
    }
    free(buf);
    am_indexed_close(d);
}

static void expect_same_files(const char *a, const char *b)
{
    size_t na, nb;
    unsigned char *x = slurp(a, &na), *y = slurp(b, &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(x, y, na);
    free(x);
    free(y);
}

static void test_build_jsonl(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    int32_t **want;
    size_t *want_n;
    const char *in = pathf("%s/in.jsonl", dir);
    size_t rows = write_jsonl(in, "llama3.ids", 100, &want, &want_n); /* about 5 chunks of 1 MiB */
    const char *tok = tokfile("llama3.json");
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/one' --threads 1 '%s' > '%s/out1'", am_data(), tok,
                               dir, in, dir)), 0);
    expect_docs(pathf("%s/one", dir), want, want_n, rows);
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/three' --threads 3 '%s' > /dev/null", am_data(),
                               tok, dir, in)), 0);
    expect_same_files(pathf("%s/one.bin", dir), pathf("%s/three.bin", dir));
    expect_same_files(pathf("%s/one.idx", dir), pathf("%s/three.idx", dir));
    /* killed after the 3rd chunk, the 2nd synced, then resumed: the same files */
    const char *env = "AM_DATA_SYNC_SECONDS=0 AM_DATA_KILL_AFTER=3";
    assert_int_equal(run(pathf("%s '%s' build --tokenizer '%s' --out '%s/res' --threads 2 --resume '%s' > /dev/null",
                               env, am_data(), tok, dir, in)), 128 + 9);
    assert_int_equal(count_entries(dir, "res.resume"), 1);
    assert_int_equal(count_entries(dir, "res.bin.partial"), 1);
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/res' --threads 2 --resume '%s' > '%s/out2'",
                               am_data(), tok, dir, in, dir)), 0);
    size_t n;
    char *out = (char *)slurp(pathf("%s/out2", dir), &n);
    out[n] = '\0';
    assert_non_null(strstr(out, "(resumed)"));
    free(out);
    expect_same_files(pathf("%s/one.bin", dir), pathf("%s/res.bin", dir));
    expect_same_files(pathf("%s/one.idx", dir), pathf("%s/res.idx", dir));
    assert_int_equal(count_entries(dir, "partial"), 0);
    assert_int_equal(count_entries(dir, "res.resume"), 0);
    /* a resume with other inputs is refused */
    assert_int_equal(run(pathf("AM_DATA_KILL_AFTER=1 '%s' build --tokenizer '%s' --out '%s/x' --resume '%s' >/dev/null",
                               am_data(), tok, dir, in)), 128 + 9);
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/x' --resume '%s' --eod '<|end_of_text|>' 2> "
                               "'%s/err'", am_data(), tok, dir, in, dir)), 1);
    out = (char *)slurp(pathf("%s/err", dir), &n);
    out[n] = '\0';
    assert_string_equal(out, pathf("am-data: %s/x.resume: written by a build with other inputs, input sizes, tokenizer "
                                   "or options: run the same command to resume it, or remove it and the .partial "
                                   "files beside it to start over\n", dir));
    free(out);
    for (size_t r = 0; r < rows; r++)
        free(want[r]);
    free(want);
    free(want_n);
    rm_tree(dir);
}

/* am-data build with SentencePiece-style tokenizers given as model directories: the
 * documents' ids are the library's */
static void test_build_spm(void **state)
{
    (void)state;
    static const char *const styles[] = {"llama2", "mistral"};
    for (int k = 0; k < 2; k++) {
        char *dir = scratch_dir();
        int32_t **want;
        size_t *want_n;
        const char *in = pathf("%s/in.jsonl", dir);
        size_t rows = write_jsonl(in, pathf("%s.ids", styles[k]), 3, &want, &want_n);
        size_t n;
        unsigned char *js = slurp(tokfile(pathf("%s.json", styles[k])), &n);
        assert_int_equal(mkdir(pathf("%s/model", dir), 0700), 0);
        spit(pathf("%s/model/tokenizer.json", dir), js, n);
        free(js);
        assert_int_equal(run(pathf("'%s' build --tokenizer '%s/model' --out '%s/ds' --threads 2 '%s' > /dev/null",
                                   am_data(), dir, dir, in)), 0);
        expect_docs(pathf("%s/ds", dir), want, want_n, rows);
        for (size_t r = 0; r < rows; r++)
            free(want[r]);
        free(want);
        free(want_n);
        rm_tree(dir);
    }
}

static void test_build_text_and_errors(void **state)
{
    (void)state;
    char *dir = scratch_dir();
    const char *tok = tokfile("gpt2.json");
    /* plain text: one document per paragraph, each ending with --eod */
    const char *text = "First paragraph,\nstill first.\n\n\nSecond: it's 1234.\n  \n\tThird\n";
    spit(pathf("%s/in.txt", dir), text, strlen(text));
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/t' --eod '<|endoftext|>' '%s/in.txt' >/dev/null",
                               am_data(), tok, dir, dir)), 0);
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t;
    assert_int_equal(am_tokenizer_load(tok, &t, &err), 0);
    struct am_tok_state *s = am_tok_state_new();
    const char *para[] = {"First paragraph,\nstill first.\n\n\n", "Second: it's 1234.\n  \n\t", "Third\n"};
    struct am_indexed *d;
    assert_int_equal(am_indexed_open(pathf("%s/t", dir), &d, &err), 0);
    assert_int_equal(am_indexed_documents(d), 3);
    for (int p = 0; p < 3; p++) {
        struct am_tok_ids ids = {0};
        assert_int_equal(am_tokenizer_encode(t, s, para[p], strlen(para[p]), true, &ids, &err), 0);
        int32_t buf[64];
        assert_int_equal(am_indexed_length(d, p), (int32_t)ids.n + 1);
        assert_int_equal(am_indexed_read(d, p, 0, (int64_t)ids.n + 1, buf, &err), 0);
        assert_memory_equal(buf, ids.ids, ids.n * sizeof(int32_t));
        assert_int_equal(buf[ids.n], am_tokenizer_token_id(t, "<|endoftext|>"));
        am_tok_ids_free(&ids);
    }
    am_indexed_close(d);
    /* instruction data: prompt = question + " ", mask 0 over encode(prompt), eos added */
    const char *rows = "{\"prompt\": \"Where is Paris?\", \"response\": \"In France.\"}\n"
                       "{\"prompt\": \"2+2\", \"response\": \"4<|endoftext|>\"}\n";
    spit(pathf("%s/sft.jsonl", dir), rows, strlen(rows));
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/sft' --instruction --eos '<|endoftext|>' "
                               "'%s/sft.jsonl' >/dev/null", am_data(), tok, dir, dir)), 0);
    struct am_indexed *m;
    assert_int_equal(am_indexed_open(pathf("%s/sft", dir), &d, &err), 0);
    assert_int_equal(am_indexed_open(pathf("%s/sft.mask", dir), &m, &err), 0);
    assert_int_equal(am_indexed_dtype(m), AM_IDX_U8);
    const char *prompt[] = {"Where is Paris? ", "2+2 "}, *full[] = {"Where is Paris? In France.", "2+2 4<|endoftext|>"};
    for (int r = 0; r < 2; r++) {
        struct am_tok_ids p = {0}, f = {0};
        assert_int_equal(am_tokenizer_encode(t, s, prompt[r], strlen(prompt[r]), true, &p, &err), 0);
        assert_int_equal(am_tokenizer_encode(t, s, full[r], strlen(full[r]), true, &f, &err), 0);
        size_t n = f.n + (r == 0); /* the second ends with eos already */
        int32_t buf[64], mask[64];
        assert_int_equal(am_indexed_length(d, r), (int32_t)n);
        assert_int_equal(am_indexed_length(m, r), (int32_t)n);
        assert_int_equal(am_indexed_read(d, r, 0, (int64_t)n, buf, &err), 0);
        assert_int_equal(am_indexed_read(m, r, 0, (int64_t)n, mask, &err), 0);
        assert_memory_equal(buf, f.ids, f.n * sizeof(int32_t));
        assert_int_equal(buf[n - 1], am_tokenizer_token_id(t, "<|endoftext|>"));
        for (size_t i = 0; i < n; i++)
            assert_int_equal(mask[i], i >= p.n);
        am_tok_ids_free(&p);
        am_tok_ids_free(&f);
    }
    am_indexed_close(d);
    am_indexed_close(m);
    /* a tokenizer directory: eos from tokenizer_config.json; its chat template refused unless
     * --no-chat-template */
    size_t nj;
    unsigned char *js = slurp(tok, &nj);
    assert_int_equal(mkdir(pathf("%s/tokdir", dir), 0700), 0);
    spit(pathf("%s/tokdir/tokenizer.json", dir), js, nj);
    free(js);
    const char *cfg = "{\"eos_token\": {\"content\": \"<|endoftext|>\"}, \"chat_template\": \"{{ messages }}\"}";
    spit(pathf("%s/tokdir/tokenizer_config.json", dir), cfg, strlen(cfg));
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s/tokdir' --out '%s/sft2' --instruction '%s/sft.jsonl' 2> "
                               "'%s/err'", am_data(), dir, dir, dir, dir)), 1);
    size_t ne;
    char *e0 = (char *)slurp(pathf("%s/err", dir), &ne);
    e0[ne] = '\0';
    assert_string_equal(e0, pathf("am-data: %s/tokdir/tokenizer_config.json: the tokenizer has a chat template, which "
                                  "AutoModel formats instruction data with; am does not render chat templates (Jinja): "
                                  "pass --no-chat-template to format prompt + answer as AutoModel does without one\n",
                                  dir));
    free(e0);
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s/tokdir' --out '%s/sft2' --instruction --no-chat-template "
                               "'%s/sft.jsonl' > /dev/null", am_data(), dir, dir, dir)), 0);
    expect_same_files(pathf("%s/sft.bin", dir), pathf("%s/sft2.bin", dir));
    expect_same_files(pathf("%s/sft.mask.bin", dir), pathf("%s/sft2.mask.bin", dir));
    /* bad lines: the first in input order is named, with its line */
    const char *bad = "{\"text\": \"ok\"}\n\n{\"txt\": \"no text\"}\n{bad\n";
    spit(pathf("%s/bad.jsonl", dir), bad, strlen(bad));
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/b' '%s/bad.jsonl' 2> '%s/err'", am_data(), tok, dir,
                               dir, dir)), 1);
    size_t n;
    char *e = (char *)slurp(pathf("%s/err", dir), &n);
    e[n] = '\0';
    assert_string_equal(e, pathf("am-data: %s/bad.jsonl:3: \"text\" is missing (a string is needed; name the column "
                                 "with the --*-key options)\n", dir));
    free(e);
    assert_int_equal(run(pathf("'%s' build --tokenizer '%s' --out '%s/b' --text-key txt '%s/bad.jsonl' 2> '%s/err'",
                               am_data(), tok, dir, dir, dir)), 1);
    e = (char *)slurp(pathf("%s/err", dir), &n);
    e[n] = '\0';
    assert_string_equal(e, pathf("am-data: %s/bad.jsonl:1: \"txt\" is missing (a string is needed; name the column "
                                 "with the --*-key options)\n", dir));
    free(e);
    assert_int_equal(count_entries(dir, "b."), 0); /* nothing left behind */
    am_tok_state_free(s);
    am_tokenizer_free(t);
    rm_tree(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_repair), cmocka_unit_test(test_gpt2),   cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_qwen2),       cmocka_unit_test(test_qwen35), cmocka_unit_test(test_llama2),
        cmocka_unit_test(test_mistral),     cmocka_unit_test(test_spm_unk), cmocka_unit_test(test_llama2_sp),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_unk_not_needed), cmocka_unit_test(test_long_line),
        cmocka_unit_test(test_build_jsonl), cmocka_unit_test(test_build_spm),
        cmocka_unit_test(test_build_text_and_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
