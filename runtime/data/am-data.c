/* am-data - builds and inspects Megatron-style indexed datasets (PREFIX.bin + PREFIX.idx).
 *
 *   am-data build --out PREFIX [--bytes] FILE...
 *   am-data build --out PREFIX --tokenizer DIR_OR_FILE [options] FILE...
 *       --tokenizer: JSONL or plain text through a Hugging Face tokenizer.json (textbuild.h,
 *                docs/data.md); the dtype is uint16 when every id fits, else int32.
 *       --bytes: each file's bytes are the tokens (vocabulary 256, dtype uint8), one document
 *                per paragraph: a paragraph ends after a blank line, and the blank lines
 *                belong to it, so the documents put back together are the files exactly.
 *       otherwise: each file holds token ids, decimal, separated by spaces or tabs, one
 *                document per line (empty lines are skipped); the dtype is the smallest of
 *                uint8, uint16 and int32 that holds the largest id.
 *   am-data encode --tokenizer DIR_OR_FILE [--no-special-tokens] [--nul] [FILE]
 *       prints the ids of each line of FILE (or standard input; --nul: of each NUL-separated
 *       text), one line of ids per text.
 *   am-data info PREFIX...
 *   am-data sample PREFIX... --seq-length L [--weights W1,W2,...] [--num-samples N]
 *                  [--seed S] [--no-shuffle] [--first I] [--count C] [--text]
 *       prints samples as the trainer reads them (one per line).
 *
 * Exit status: 0 on success, 1 on an error (the message names the file and the rule), 2 on
 * a usage error.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>
#include <unistd.h>

#include "dataset.h"
#include "errors.h"
#include "recipe.h" /* AM_MAX_DATA_PATHS */
#include "textbuild.h"
#include "progress.h"
#include "tokenizer.h"
#include "util.h"
#include "version.h"

static const char usage[] =
    "usage: am-data build --out PREFIX [--bytes] [--progress|--quiet] FILE...\n"
    "       am-data build --out PREFIX --tokenizer DIR_OR_FILE [--format jsonl|text] [--text-key KEY]\n"
    "                     [--no-special-tokens] [--eod TOKEN] [--threads N] [--resume] [--progress|--quiet]\n"
    "                     [--instruction [--prompt-key K --response-key K | --context-key K --question-key K\n"
    "                      --answer-key K] [--eos TOKEN] [--no-chat-template]] FILE...\n"
    "       am-data encode --tokenizer DIR_OR_FILE [--no-special-tokens] [--nul] [FILE]\n"
    "       am-data info PREFIX...\n"
    "       am-data sample PREFIX... --seq-length L [--weights W1,W2,...] [--num-samples N] [--seed S]\n"
    "                      [--no-shuffle] [--first I] [--count C] [--text]\n"
    "\n"
    "build   writes PREFIX.bin and PREFIX.idx (Megatron's MMIDIDX format) from text files:\n"
    "        --bytes  the files' bytes are the tokens (vocabulary 256), one document per paragraph\n"
    "        default  the files hold decimal token ids, one document per line\n"
    "        --tokenizer  JSONL (.jsonl/.json: the string under --text-key, default text) or plain text (one\n"
    "                 document per paragraph) through a Hugging Face tokenizer.json; --instruction: JSONL\n"
    "                 prompt/response rows, tokens plus a loss mask in PREFIX.mask.bin/.idx (docs/data.md)\n"
    "encode  prints the token ids of each line (--nul: NUL-separated text) of FILE or standard input\n"
    "info    prints the counts of a dataset\n"
    "sample  prints GPT samples (seq_length + 1 tokens) as the trainer builds them\n"
    "\n"
    "build shows its progress on a terminal (--progress: always; --quiet or --no-progress: never)\n";

static int report(struct am_errors *err)
{
    for (size_t i = 0; i < err->n; i++)
        fprintf(stderr, "am-data: %s\n", err->msg[i]);
    return 1;
}

/* ---- build --bytes ------------------------------------------------------------------------- */

static int build_bytes_file(struct am_indexed_builder *b, const char *path, int64_t *docs, struct am_errors *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        am_errorf(err, NULL, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    unsigned char buf[65536];
    int rc = -1, newlines = 0;
    int64_t in_doc = 0;
    size_t got;
    while ((got = fread(buf, 1, sizeof(buf), f)) > 0) {
        size_t start = 0;
        for (size_t i = 0; i < got; i++) {
            unsigned char c = buf[i];
            if (c == '\n') {
                newlines++;
            } else if (c != ' ' && c != '\t' && c != '\r' && c != '\f' && c != '\v') {
                if (newlines >= 2 && in_doc + (int64_t)(i - start) > 0) { /* a paragraph starts here */
                    if (am_indexed_builder_add_raw(b, buf + start, i - start, err) < 0 ||
                        am_indexed_builder_end_document(b, err) < 0)
                        goto done;
                    (*docs)++;
                    start = i;
                    in_doc = 0;
                }
                newlines = 0;
            }
        }
        if (am_indexed_builder_add_raw(b, buf + start, got - start, err) < 0)
            goto done;
        in_doc += (int64_t)(got - start);
    }
    if (ferror(f)) {
        am_errorf(err, NULL, "%s: read failed: %s", path, strerror(errno));
        goto done;
    }
    if (in_doc > 0) {
        if (am_indexed_builder_end_document(b, err) < 0)
            goto done;
        (*docs)++;
    }
    rc = 0;
done:
    fclose(f);
    return rc;
}

/* ---- build from token ids ------------------------------------------------------------------ */

/* The state of a token-id file being read. */
struct ids {
    const char *path;
    struct am_indexed_builder *b; /* NULL: the checking pass */
    int64_t ids[1024], value, line, col, max_id, docs;
    size_t n;
    bool in_number, line_has_tokens;
};

/* Feeds one byte (or '\n' at the end of the file). */
static int ids_byte(struct ids *s, int c, struct am_errors *err)
{
    s->col++;
    if (c >= '0' && c <= '9') {
        s->value = s->value * 10 + (c - '0');
        if (s->value > INT32_MAX) {
            am_errorf(err, NULL, "%s:%" PRId64 ":%" PRId64 ": token id too large (am's token ids are below 2^31)",
                      s->path, s->line, s->col);
            return -1;
        }
        s->in_number = true;
        return 0;
    }
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') {
        bool printable = c >= 0x20 && c < 0x7f;
        am_errorf(err, NULL, "%s:%" PRId64 ":%" PRId64 ": unexpected %s%c%s (a token file holds decimal token ids "
                  "separated by spaces, one document per line; use --bytes for text)", s->path, s->line, s->col,
                  printable ? "'" : "byte 0x", printable ? c : '?', printable ? "'" : "");
        return -1;
    }
    if (s->in_number) {
        s->max_id = s->value > s->max_id ? s->value : s->max_id;
        s->ids[s->n++] = s->value;
        s->line_has_tokens = true;
        s->in_number = false;
        s->value = 0;
    }
    if (s->n == 1024 || (c == '\n' && s->n > 0)) {
        if (s->b && am_indexed_builder_add(s->b, s->ids, s->n, err) < 0)
            return -1;
        s->n = 0;
    }
    if (c == '\n') {
        if (s->line_has_tokens) {
            if (s->b && am_indexed_builder_end_document(s->b, err) < 0)
                return -1;
            s->docs++;
        }
        s->line_has_tokens = false;
        s->line++;
        s->col = 0;
    }
    return 0;
}

/* Reads a token-id file: with b NULL only checks it and finds the largest id; with b writes
 * each non-empty line as a document. */
static int parse_ids(const char *path, struct am_indexed_builder *b, int64_t *max_id, int64_t *docs,
                     struct am_errors *err)
{
    FILE *f = fopen(path, "rb");
    struct stat st;
    if (!f || fstat(fileno(f), &st) < 0) {
        am_errorf(err, NULL, "%s: cannot open: %s", path, strerror(errno));
        if (f)
            fclose(f);
        return -1;
    }
    int rc = -1;
    struct ids *s = calloc(1, sizeof(*s));
    unsigned char buf[65536];
    size_t got;
    if (!s) {
        am_errorf(err, NULL, "out of memory");
        goto done;
    }
    if (!S_ISREG(st.st_mode)) {
        am_errorf(err, NULL, "%s: not a regular file (am-data reads token files twice: once to choose the dtype)",
                  path);
        goto done;
    }
    *s = (struct ids){.path = path, .b = b, .line = 1};
    while ((got = fread(buf, 1, sizeof(buf), f)) > 0)
        for (size_t i = 0; i < got; i++)
            if (ids_byte(s, buf[i], err) < 0)
                goto done;
    if (ferror(f)) {
        am_errorf(err, NULL, "%s: read failed: %s", path, strerror(errno));
        goto done;
    }
    if (ids_byte(s, '\n', err) < 0) /* a last line without a newline */
        goto done;
    *max_id = s->max_id > *max_id ? s->max_id : *max_id;
    *docs += s->docs;
    rc = 0;
done:
    free(s);
    fclose(f);
    return rc;
}

/* A file's size in bytes (0 when it cannot be read: its build step then says why). */
static uint64_t file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (uint64_t)st.st_size : 0;
}

/* Creates the directories above PREFIX (mkdir -p of its dirname), as a user expects of --out. */
static int make_parent_dirs(const char *prefix, struct am_errors *err)
{
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", prefix);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return 0;
    *slash = '\0';
    if (am_mkdir_p(dir) < 0) {
        am_errorf(err, NULL, "%s: cannot create the directory %s: %s", prefix, dir, strerror(errno));
        return -1;
    }
    return 0;
}

static int cmd_build_text(int argc, char **argv);

static int cmd_build(int argc, char **argv)
{
    for (int i = 0; i < argc && strcmp(argv[i], "--") != 0; i++)
        if (strcmp(argv[i], "--tokenizer") == 0 || strncmp(argv[i], "--tokenizer=", 12) == 0)
            return cmd_build_text(argc, argv);
    const char *out = NULL;
    bool bytes = false, options = true;
    int n_files = 0, show = isatty(2);
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (options && strcmp(a, "--") == 0) {
            options = false;
        } else if (options && am_progress_option(a) >= 0) {
            show = am_progress_option(a);
        } else if (options && strcmp(a, "--out") == 0 && i + 1 < argc) {
            out = argv[++i];
        } else if (options && strncmp(a, "--out=", 6) == 0) {
            out = a + 6;
        } else if (options && strcmp(a, "--bytes") == 0) {
            bytes = true;
        } else if (options && a[0] == '-' && a[1]) {
            fprintf(stderr, "am-data build: unknown option %s\n%s", a, usage);
            return 2;
        } else {
            argv[n_files++] = argv[i]; /* n_files <= i: the list is compacted in place */
        }
    }
    if (!out || n_files == 0) {
        fprintf(stderr, "am-data build: %s\n%s", out ? "no input files" : "--out PREFIX is required", usage);
        return 2;
    }
    struct am_errors err;
    am_errors_init(&err);
    struct am_indexed_builder *b = NULL;
    struct am_progress bar = {0}; /* off until the build starts */
    int64_t max_id = 0, docs = 0, ignored = 0;
    int rc = 1;
    enum am_idx_dtype dtype = AM_IDX_U8;
    if (!bytes) {
        for (int i = 0; i < n_files; i++)
            if (parse_ids(argv[i], NULL, &max_id, &ignored, &err) < 0)
                goto done;
        dtype = max_id <= UINT8_MAX ? AM_IDX_U8 : max_id <= UINT16_MAX ? AM_IDX_U16 : AM_IDX_I32;
    }
    if (make_parent_dirs(out, &err) < 0 || am_indexed_builder_open(out, dtype, &b, &err) < 0)
        goto done;
    uint64_t total = 0, done_bytes = 0;
    for (int i = 0; i < n_files; i++)
        total += file_size(argv[i]);
    am_progress_start(&bar, "am-data build", NULL, total, show);
    for (int i = 0; i < n_files; i++) {
        if ((bytes ? build_bytes_file(b, argv[i], &docs, &err) : parse_ids(argv[i], b, &max_id, &docs, &err)) < 0)
            goto done;
        done_bytes += file_size(argv[i]);
        am_progress_set(&bar, done_bytes, 0);
    }
    if (docs == 0) {
        am_errorf(&err, NULL, "%s: the input files hold no tokens", out);
        goto done;
    }
    struct am_indexed_builder *done_b = b;
    b = NULL;
    if (am_indexed_builder_finish(done_b, &err) < 0)
        goto done;
    am_progress_end(&bar, true);
    printf("%s.bin, %s.idx: %" PRId64 " documents, dtype %s\n", out, out, docs, am_idx_dtype_name(dtype));
    rc = 0;
done:
    am_progress_end(&bar, false);
    am_indexed_builder_abort(b);
    if (rc)
        report(&err);
    am_errors_free(&err);
    return rc;
}

/* ---- build --tokenizer, encode ------------------------------------------------------------------ */

/* tokenizer_config.json beside a tokenizer directory's tokenizer.json: its eos_token (a string
 * or {"content": ...}) and whether it has a chat template. */
static void tokenizer_config(const char *tok, char *eos, size_t eos_len, bool *chat_template)
{
    struct stat st;
    *chat_template = false;
    if (stat(tok, &st) < 0 || !S_ISDIR(st.st_mode))
        return;
    char path[4200];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", tok);
    json_t *j = json_load_file(path, 0, NULL);
    const json_t *e = json_object_get(j, "eos_token");
    const char *v = json_is_string(e) ? json_string_value(e) : json_string_value(json_object_get(e, "content"));
    if (v)
        snprintf(eos, eos_len, "%s", v);
    const json_t *ct = json_object_get(j, "chat_template");
    *chat_template = ct && !json_is_null(ct);
    json_decref(j);
}

static int token_option(const struct am_tokenizer *t, const char *opt, const char *content, int32_t *id)
{
    if ((*id = am_tokenizer_token_id(t, content)) < 0) {
        fprintf(stderr, "am-data: %s %s: no such token in %s (give a token as it is written in the file, e.g. "
                "<|endoftext|>)\n", opt, content, am_tokenizer_path(t));
        return -1;
    }
    return 0;
}

static int cmd_build_text(int argc, char **argv)
{
    struct am_text_build o = {.text_key = "text", .add_special = true, .eod = -1, .eos = -1};
    const char *tok_path = NULL, *eod = NULL, *eos = NULL, *format = NULL, *prompt_key = NULL, *response_key = NULL;
    bool no_chat_template = false, progress_set = false, options = true;
    int n_files = 0;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        const char **val = NULL;
        char opt[64];
        bool inline_value = false; /* --key=value */
        if (options && strcmp(a, "--") == 0) {
            options = false;
            continue;
        }
        if (!options || a[0] != '-' || !a[1]) {
            argv[n_files++] = argv[i];
            continue;
        }
        const char *eq = strchr(a, '=');
        if (eq && eq - a < (long)sizeof(opt)) {
            snprintf(opt, sizeof opt, "%.*s", (int)(eq - a), a);
            v = eq + 1;
            a = opt;
            inline_value = true;
        }
        if (strcmp(a, "--no-special-tokens") == 0) {
            o.add_special = false;
        } else if (strcmp(a, "--resume") == 0) {
            o.resume = true;
        } else if (am_progress_option(a) >= 0) {
            o.progress = am_progress_option(a);
            progress_set = true;
        } else if (strcmp(a, "--instruction") == 0) {
            o.instruction = true;
        } else if (strcmp(a, "--no-chat-template") == 0) {
            no_chat_template = true;
        } else if (strcmp(a, "--out") == 0) {
            val = &o.out;
        } else if (strcmp(a, "--tokenizer") == 0) {
            val = &tok_path;
        } else if (strcmp(a, "--format") == 0) {
            val = &format;
        } else if (strcmp(a, "--text-key") == 0) {
            val = &o.text_key;
        } else if (strcmp(a, "--eod") == 0) {
            val = &eod;
        } else if (strcmp(a, "--eos") == 0) {
            val = &eos;
        } else if (strcmp(a, "--prompt-key") == 0) {
            val = &prompt_key;
        } else if (strcmp(a, "--response-key") == 0) {
            val = &response_key;
        } else if (strcmp(a, "--context-key") == 0) {
            val = &o.context_key;
        } else if (strcmp(a, "--question-key") == 0) {
            val = &o.question_key;
        } else if (strcmp(a, "--answer-key") == 0) {
            val = &o.answer_key;
        } else if (strcmp(a, "--threads") == 0 && v) {
            char *end;
            long n = strtol(v, &end, 10);
            if (*end || n < 1 || n > 256) {
                fprintf(stderr, "am-data build: --threads %s: expected 1 to 256\n", v);
                return 2;
            }
            o.threads = (int)n;
            i += !inline_value;
        } else {
            fprintf(stderr, "am-data build: unknown option %s\n%s", a, usage);
            return 2;
        }
        if (val) {
            if (!v) {
                fprintf(stderr, "am-data build: %s needs a value\n", a);
                return 2;
            }
            *val = v;
            i += !inline_value;
        } else if (inline_value && strcmp(a, "--threads") != 0) {
            fprintf(stderr, "am-data build: %s takes no value\n", a);
            return 2;
        }
    }
    if (!o.out || n_files == 0) {
        fprintf(stderr, "am-data build: %s\n%s", o.out ? "no input files" : "--out PREFIX is required", usage);
        return 2;
    }
    if (format && strcmp(format, "jsonl") != 0 && strcmp(format, "text") != 0) {
        fprintf(stderr, "am-data build: --format %s: expected jsonl or text\n", format);
        return 2;
    }
    o.format = !format ? AM_TEXT_AUTO : format[0] == 'j' ? AM_TEXT_JSONL : AM_TEXT_PLAIN;
    if (prompt_key)
        o.question_key = prompt_key;
    if (response_key)
        o.answer_key = response_key;
    if (o.instruction && !o.context_key && !o.question_key && !o.answer_key)
        o.question_key = "prompt", o.answer_key = "response";
    if (o.instruction && (!o.answer_key || (!o.context_key && !o.question_key))) {
        fprintf(stderr, "am-data build: --instruction needs an answer column (--response-key or --answer-key) and a "
                "prompt column (--prompt-key, --context-key or --question-key)\n");
        return 2;
    }
    if (!o.instruction && (prompt_key || response_key || o.context_key || o.question_key || o.answer_key || eos)) {
        fprintf(stderr, "am-data build: the column and --eos options are for --instruction data\n");
        return 2;
    }
    o.inputs = (const char *const *)argv;
    o.n_inputs = n_files;
    if (!progress_set)
        o.progress = isatty(2);
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t = NULL;
    int rc = 1;
    char desc[4400], eos_cfg[256] = "";
    bool chat = false;
    struct stat st;
    if (am_tokenizer_load(tok_path, &t, &err) < 0 || make_parent_dirs(o.out, &err) < 0)
        goto done;
    if (stat(am_tokenizer_path(t), &st) == 0)
        snprintf(desc, sizeof(desc), "%s:%lld:%lld", am_tokenizer_path(t), (long long)st.st_size,
                 (long long)st.st_mtime);
    o.tok = t;
    o.tok_desc = desc;
    tokenizer_config(tok_path, eos_cfg, sizeof(eos_cfg), &chat);
    if (eod && token_option(t, "--eod", eod, &o.eod) < 0)
        goto done_quiet;
    if (o.instruction) {
        if (chat && !no_chat_template) {
            am_errorf(&err, NULL, "%s/tokenizer_config.json: the tokenizer has a chat template, which AutoModel "
                      "formats instruction data with; am does not render chat templates (Jinja): pass "
                      "--no-chat-template to format prompt + answer as AutoModel does without one", tok_path);
            goto done;
        }
        if (!eos && !eos_cfg[0]) {
            am_errorf(&err, NULL, "%s: instruction data ends with the eos token: name it with --eos TOKEN (the "
                      "tokenizer directory's tokenizer_config.json has no eos_token)", tok_path);
            goto done;
        }
        if (token_option(t, "--eos", eos ? eos : eos_cfg, &o.eos) < 0)
            goto done_quiet;
    }
    struct am_text_stats s;
    if (am_text_build_run(&o, &s, &err) < 0)
        goto done;
    printf("%s.bin, %s.idx: %" PRId64 " documents, %" PRId64 " tokens, dtype %s%s%s%s; %.1f s, %.0f tokens/s%s\n",
           o.out, o.out, s.documents, s.tokens, am_tokenizer_vocab_size(t) <= 65536 ? "uint16" : "int32",
           o.instruction ? "; loss mask in " : "", o.instruction ? o.out : "", o.instruction ? ".mask.bin/.idx" : "",
           s.seconds, s.seconds > 0 ? (double)s.tokens / s.seconds : 0.0, s.resumed ? " (resumed)" : "");
    rc = 0;
done:
    if (rc)
        report(&err);
done_quiet:
    am_tokenizer_free(t);
    am_errors_free(&err);
    return rc;
}

static int cmd_encode(int argc, char **argv)
{
    const char *tok_path = NULL, *file = NULL;
    bool special = true, nul = false;
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc)
            tok_path = argv[++i];
        else if (strcmp(argv[i], "--no-special-tokens") == 0)
            special = false;
        else if (strcmp(argv[i], "--nul") == 0)
            nul = true;
        else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "am-data encode: unknown option %s\n%s", argv[i], usage);
            return 2;
        } else
            file = argv[i];
    }
    if (!tok_path) {
        fprintf(stderr, "am-data encode: --tokenizer is required\n%s", usage);
        return 2;
    }
    struct am_errors err;
    am_errors_init(&err);
    struct am_tokenizer *t = NULL;
    struct am_tok_state *s = am_tok_state_new();
    struct am_tok_ids ids = {0};
    FILE *f = file ? fopen(file, "rb") : stdin;
    char *line = NULL;
    size_t cap = 0;
    int rc = 1;
    if (!f) {
        am_errorf(&err, NULL, "%s: cannot open: %s", file, strerror(errno));
        goto done;
    }
    if (am_tokenizer_load(tok_path, &t, &err) < 0)
        goto done;
    for (ssize_t n; (n = getdelim(&line, &cap, nul ? '\0' : '\n', f)) >= 0;) {
        if (n > 0 && line[n - 1] == (nul ? '\0' : '\n'))
            n--;
        ids.n = 0;
        if (am_tokenizer_encode(t, s, line, (size_t)n, special, &ids, &err) < 0)
            goto done;
        for (size_t i = 0; i < ids.n; i++)
            printf(i ? " %" PRId32 : "%" PRId32, ids.ids[i]);
        putchar('\n');
    }
    rc = 0;
done:
    if (rc)
        report(&err);
    if (f && f != stdin)
        fclose(f);
    free(line);
    am_tok_ids_free(&ids);
    am_tok_state_free(s);
    am_tokenizer_free(t);
    am_errors_free(&err);
    return rc;
}

/* ---- info ----------------------------------------------------------------------------------- */

static int cmd_info(int argc, char **argv)
{
    if (argc == 0) {
        fprintf(stderr, "am-data info: no dataset prefix\n%s", usage);
        return 2;
    }
    struct am_errors err;
    am_errors_init(&err);
    int rc = 0;
    int32_t *buf = malloc(65536 * sizeof(*buf));
    for (int a = 0; a < argc && buf; a++) {
        struct am_indexed *d;
        if (am_indexed_open(argv[a], &d, &err) < 0) {
            rc = 1;
            continue;
        }
        int64_t lo = INT64_MAX, hi = INT64_MIN, longest = 0;
        for (int64_t s = 0; s < am_indexed_sequences(d) && rc == 0; s++) {
            int64_t len = am_indexed_length(d, s);
            longest = len > longest ? len : longest;
            for (int64_t o = 0; o < len; o += 65536) {
                int64_t k = len - o < 65536 ? len - o : 65536;
                if (am_indexed_read(d, s, o, k, buf, &err) < 0) {
                    rc = 1;
                    break;
                }
                for (int64_t i = 0; i < k; i++) {
                    lo = buf[i] < lo ? buf[i] : lo;
                    hi = buf[i] > hi ? buf[i] : hi;
                }
            }
        }
        printf("%s: dtype %s, %" PRId64 " documents, %" PRId64 " sequences, %" PRId64 " tokens", argv[a],
               am_idx_dtype_name(am_indexed_dtype(d)), am_indexed_documents(d), am_indexed_sequences(d),
               am_indexed_tokens(d));
        if (am_indexed_tokens(d) > 0)
            printf(", token ids %" PRId64 " to %" PRId64 ", longest sequence %" PRId64, lo, hi, longest);
        printf("\n");
        am_indexed_close(d);
    }
    if (!buf)
        am_errorf(&err, NULL, "out of memory");
    free(buf);
    if (err.n)
        rc = report(&err);
    am_errors_free(&err);
    return rc;
}

/* ---- sample --------------------------------------------------------------------------------- */

static int parse_i64(const char *opt, const char *s, int64_t lo, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo) {
        fprintf(stderr, "am-data sample: %s %s: expected an integer >= %" PRId64 "\n", opt, s, lo);
        return -1;
    }
    *out = v;
    return 0;
}

static int cmd_sample(int argc, char **argv)
{
    const char *paths[AM_MAX_DATA_PATHS];
    double weights[AM_MAX_DATA_PATHS];
    int n_paths = 0, n_weights = 0;
    int64_t seq = 0, num = 0, seed = 1234, first = 0, count = 1;
    bool shuffle = true, text = false;
    for (int i = 0; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (strcmp(o, "--no-shuffle") == 0) {
            shuffle = false;
        } else if (strcmp(o, "--text") == 0) {
            text = true;
        } else if (o[0] == '-' && !v) {
            fprintf(stderr, "am-data sample: %s needs a value\n", o);
            return 2;
        } else if (strcmp(o, "--seq-length") == 0) {
            rc = parse_i64(o, v, 1, &seq), i++;
        } else if (strcmp(o, "--num-samples") == 0) {
            rc = parse_i64(o, v, 0, &num), i++;
        } else if (strcmp(o, "--seed") == 0) {
            rc = parse_i64(o, v, 0, &seed), i++;
        } else if (strcmp(o, "--first") == 0) {
            rc = parse_i64(o, v, 0, &first), i++;
        } else if (strcmp(o, "--count") == 0) {
            rc = parse_i64(o, v, 0, &count), i++;
        } else if (strcmp(o, "--weights") == 0) {
            for (char *s = argv[++i], *end; *s && n_weights < AM_MAX_DATA_PATHS; s = *end ? end + 1 : end) {
                weights[n_weights++] = strtod(s, &end);
                if (end == s || (*end && *end != ',')) {
                    fprintf(stderr, "am-data sample: --weights %s: expected numbers separated by commas\n", v);
                    return 2;
                }
            }
        } else if (o[0] == '-') {
            fprintf(stderr, "am-data sample: unknown option %s\n%s", o, usage);
            return 2;
        } else if (n_paths < AM_MAX_DATA_PATHS) {
            paths[n_paths++] = o;
        }
        if (rc < 0)
            return 2;
    }
    if (n_paths == 0 || seq == 0 || seed > (int64_t)UINT32_MAX || (n_weights && n_weights != n_paths)) {
        fprintf(stderr, "am-data sample: %s\n%s",
                n_paths == 0 ? "no dataset prefix" : seq == 0 ? "--seq-length is required"
                : seed > (int64_t)UINT32_MAX ? "--seed must be below 2^32" : "give one weight per dataset", usage);
        return 2;
    }
    struct am_gpt_config cfg = {.paths = paths, .weights = n_weights ? weights : NULL, .n_paths = n_paths,
                                .seq_length = seq, .shuffle = shuffle, .seed = (uint32_t)seed,
                                .num_samples = num ? num : (n_paths > 1 ? first + count : 0)};
    struct am_errors err;
    am_errors_init(&err);
    struct am_gpt *g = NULL;
    int32_t *tok = malloc((size_t)(seq + 1) * sizeof(*tok));
    int rc = 1;
    if (!tok) {
        am_errorf(&err, NULL, "out of memory");
        goto done;
    }
    if (am_gpt_open(&cfg, &g, &err) < 0)
        goto done;
    for (int64_t i = first; i < first + count; i++) {
        if (am_gpt_sample(g, i, tok, &err) < 0)
            goto done;
        printf("%" PRId64 ":", i);
        for (int64_t t = 0; t <= seq; t++) {
            if (!text)
                printf(" %" PRId32, tok[t]);
            else if (tok[t] >= 0x20 && tok[t] < 0x7f && tok[t] != '\\')
                printf("%s%c", t ? "" : " ", (char)tok[t]);
            else
                printf("%s\\x%02x", t ? "" : " ", (unsigned)tok[t] & 0xff);
        }
        printf("\n");
    }
    rc = 0;
done:
    if (rc)
        report(&err);
    am_gpt_close(g);
    free(tok);
    am_errors_free(&err);
    return rc;
}

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-data"))
        return 0;
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (strcmp(argv[1], "build") == 0)
        return cmd_build(argc - 2, argv + 2);
    if (strcmp(argv[1], "info") == 0)
        return cmd_info(argc - 2, argv + 2);
    if (strcmp(argv[1], "encode") == 0)
        return cmd_encode(argc - 2, argv + 2);
    if (strcmp(argv[1], "sample") == 0)
        return cmd_sample(argc - 2, argv + 2);
    fprintf(stderr, "am-data: unknown command '%s'\n%s", argv[1], usage);
    return 2;
}
