/* test_tokenizer.c - byte-level BPE against the Hugging Face `tokenizers` library, without
 * Python: tests/data/tokenizer/ holds four tokenizers trained by that library in the styles
 * of GPT-2, Llama 3, Qwen 2 and Qwen 3.5, hostile texts (invalid UTF-8, long runs, samples
 * of every Unicode general category, emoji, CJK, combining marks, special tokens inside the
 * text) and the ids the library gave for each, with and without the post-processor's
 * special tokens (make_tokenizers.py made them). Every id must be equal. Also: UTF-8 repair
 * as Python does it, and every refusal of a tokenizer am does not implement, by message. */
#include "../ckpt/testio.h"
#include "tokenizer.h"
#include "unicode.h"

static const char *tokfile(const char *name) { return srcpath(pathf("tests/data/tokenizer/%s", name)); }

static void check_style(const char *style)
{
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t;
    if (am_tokenizer_load(tokfile(pathf("%s.json", style)), &t, &err) < 0)
        expect_no_error(&err);
    size_t nt, ni;
    unsigned char *texts = slurp(tokfile("texts.bin"), &nt);
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

static void test_gpt2(void **state) { (void)state; check_style("gpt2"); }
static void test_llama3(void **state) { (void)state; check_style("llama3"); }
static void test_qwen2(void **state) { (void)state; check_style("qwen2"); }
static void test_qwen35(void **state) { (void)state; check_style("qwen35"); }

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

/* Writes gpt2.json with `from` replaced by `to` (once) and loads it: the message. */
static void expect_refusal(const char *from, const char *to, const char *want)
{
    char *dir = scratch_dir();
    size_t n;
    char *js = (char *)slurp(tokfile("gpt2.json"), &n);
    js[n] = '\0';
    char *at = strstr(js, from);
    if (!at)
        fail_msg("gpt2.json has no %s", from);
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

static void test_refusals(void **state)
{
    (void)state;
    expect_refusal("\"normalizer\": null", "\"normalizer\": {\"type\":\"NFC\"}",
                   "normalizer \"NFC\": am implements no normalizer (the text is encoded as it is); a tokenizer whose "
                   "normalizer changes the text would give other ids");
    expect_refusal("\"type\": \"BPE\"", "\"type\": \"WordPiece\"",
                   "model type \"WordPiece\": am implements BPE only (WordPiece, Unigram and WordLevel are not "
                   "implemented)");
    expect_refusal("\"byte_fallback\": false", "\"byte_fallback\": true",
                   "model.byte_fallback true: SentencePiece-style BPE (Llama 2, Mistral) is not implemented; am "
                   "implements byte-level BPE");
    expect_refusal("\"dropout\": null", "\"dropout\": 0.1",
                   "model.dropout: BPE dropout makes encoding random; am encodes deterministically");
    expect_refusal("\"pre_tokenizer\": {\n    \"type\": \"ByteLevel\"", "\"pre_tokenizer\": {\"type\": \"Whitespace\"",
                   "pre_tokenizer Whitespace: am implements ByteLevel, or a Split with a known pattern followed by "
                   "ByteLevel (GPT-2, Llama 3, Qwen 2/3)");
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
                   "(am implements byte-level BPE only)");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_repair), cmocka_unit_test(test_gpt2),   cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_qwen2),       cmocka_unit_test(test_qwen35), cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
