/* textbuild.c - text through a tokenizer into indexed datasets, on N threads (see textbuild.h).
 *
 * The main thread reads the inputs into chunks (about 1 MiB, cut at a document boundary,
 * never across files) and puts them in a ring of slots; workers take the slots in order,
 * parse and encode them; the main thread writes the slots back in the order they were read,
 * so the output does not depend on the number of threads. A worker's error stays in its slot
 * and is reported when the slot's turn comes: the first error in input order.
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dataset.h"
#include "log.h"
#include "progress.h"
#include "textbuild.h"
#include "tokenizer.h"
#include "util.h"

#define CHUNK_TARGET (1u << 20)
#define SYNC_SECONDS 5.0

enum { SLOT_FREE, SLOT_READY, SLOT_DONE };

struct chunk {
    int state;
    char *buf;
    size_t len, cap;
    int file;
    int64_t line0;              /* the line number of buf[0] */
    int end_file;               /* where the inputs stand after this chunk */
    int64_t end_offset, end_line;
    struct am_tok_ids ids;      /* results */
    uint8_t *mask;
    size_t mask_cap;
    int64_t *doc_len;
    size_t n_docs, docs_cap;
    struct am_errors err;
};

struct ctx {
    const struct am_text_build *o;
    bool *jsonl; /* per input */
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    struct chunk *slots;
    int n_slots;
    int64_t produced, taken;
    bool quit;
};

/* ---- the paragraph rule (am-data build --bytes's) ------------------------------------------- */

static bool blank(unsigned char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v'; }

/* The last paragraph start p > 0 of s[0, n) (s[0] is a document start), or 0. */
static size_t last_paragraph_start(const char *s, size_t n)
{
    int newlines = 0;
    size_t last = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n') {
            newlines++;
        } else if (!blank(c)) {
            if (newlines >= 2 && i > 0)
                last = i;
            newlines = 0;
        }
    }
    return last;
}

/* ---- one chunk, on a worker ----------------------------------------------------------------- */

static int end_doc(struct chunk *k, size_t start)
{
    if (am_grow((void **)&k->doc_len, &k->docs_cap, k->n_docs + 1, sizeof(int64_t), 1024) < 0)
        return -1;
    k->doc_len[k->n_docs++] = (int64_t)(k->ids.n - start);
    return 0;
}

static int push_id(struct am_tok_ids *v, int32_t id)
{
    if (am_grow((void **)&v->ids, &v->cap, v->n + 1, sizeof(int32_t), 1024) < 0)
        return -1;
    v->ids[v->n++] = id;
    return 0;
}

/* A string column of a row: *s NULL when missing or null (allowed for optional columns). */
static int column(const json_t *row, const char *key, bool required, const char **s, size_t *n, const char *where,
                  struct am_errors *err)
{
    const json_t *v = json_object_get(row, key);
    *s = NULL;
    *n = 0;
    if ((!v || json_is_null(v)) && !required)
        return 0;
    if (!json_is_string(v)) {
        am_errorf(err, NULL, "%s: \"%s\" is %s (a string is needed%s)", where, key, v ? "not a string" : "missing",
                  required ? "; name the column with the --*-key options" : "");
        return -1;
    }
    *s = json_string_value(v);
    *n = json_string_length(v);
    return 0;
}

/* Instruction row -> ids and mask (textbuild.h gives the rule). */
static int encode_instruction(const struct am_text_build *o, struct am_tok_state *s, const json_t *row,
                              struct chunk *k, const char *where, struct am_tok_ids *scratch)
{
    const char *ctx, *q, *a;
    size_t nc, nq, na;
    if ((o->context_key && column(row, o->context_key, false, &ctx, &nc, where, &k->err) < 0) ||
        (o->question_key && column(row, o->question_key, false, &q, &nq, where, &k->err) < 0) ||
        column(row, o->answer_key, true, &a, &na, where, &k->err) < 0)
        return -1;
    if (!o->context_key)
        ctx = NULL, nc = 0;
    if (!o->question_key)
        q = NULL, nq = 0;
    if (!ctx && !q) {
        am_errorf(&k->err, NULL, "%s: no prompt: neither \"%s\" nor \"%s\" is there", where,
                  o->context_key ? o->context_key : "-", o->question_key ? o->question_key : "-");
        return -1;
    }
    size_t np = (ctx ? nc + 1 : 0) + (q ? nq + 1 : 0);
    char *text = malloc(np + na + 1);
    if (!text) {
        am_errorf(&k->err, NULL, "%s: out of memory", where);
        return -1;
    }
    size_t m = 0;
    if (ctx) {
        memcpy(text, ctx, nc);
        m = nc;
        text[m++] = ' ';
    }
    if (q) {
        memcpy(text + m, q, nq);
        m += nq;
        text[m++] = ' ';
    }
    memcpy(text + m, a, na);
    scratch->n = 0;
    size_t start = k->ids.n;
    int rc = -1;
    if (am_tokenizer_encode(o->tok, s, text, np, true, scratch, &k->err) < 0 ||
        am_tokenizer_encode(o->tok, s, text, np + na, true, &k->ids, &k->err) < 0)
        goto done;
    if ((k->ids.n == start || k->ids.ids[k->ids.n - 1] != o->eos) && push_id(&k->ids, o->eos) < 0)
        goto oom;
    if (am_grow((void **)&k->mask, &k->mask_cap, k->ids.n, 1, 1024) < 0)
        goto oom;
    for (size_t i = start; i < k->ids.n; i++)
        k->mask[i] = i - start >= scratch->n;
    if (end_doc(k, start) < 0)
        goto oom;
    rc = 0;
    goto done;
oom:
    am_errorf(&k->err, NULL, "%s: out of memory", where);
done:
    free(text);
    return rc;
}

static void encode_chunk(struct ctx *c, struct am_tok_state *s, struct chunk *k)
{
    const struct am_text_build *o = c->o;
    const char *path = o->inputs[k->file];
    k->ids.n = 0;
    k->n_docs = 0;
    if (!s) {
        am_errorf(&k->err, NULL, "%s: out of memory", path);
        return;
    }
    if (!c->jsonl[k->file]) {
        int newlines = 0;
        size_t doc = 0, start = 0;
        for (size_t i = 0; i <= k->len; i++) {
            unsigned char ch = i < k->len ? (unsigned char)k->buf[i] : 'x';
            if (ch == '\n') {
                newlines++;
                continue;
            }
            if (blank(ch))
                continue;
            if ((newlines >= 2 && i > doc) || i == k->len) {
                if (i > doc) {
                    start = k->ids.n;
                    if (am_tokenizer_encode(o->tok, s, k->buf + doc, i - doc, o->add_special, &k->ids, &k->err) < 0 ||
                        (o->eod >= 0 && push_id(&k->ids, o->eod) < 0) || end_doc(k, start) < 0) {
                        am_errorf(&k->err, NULL, "%s: out of memory", path);
                        return;
                    }
                }
                doc = i;
            }
            newlines = 0;
        }
        return;
    }
    struct am_tok_ids scratch = {0};
    int64_t line = k->line0;
    char where[4200];
    for (size_t i = 0; i < k->len; line++) {
        char *nl = memchr(k->buf + i, '\n', k->len - i);
        size_t end = nl ? (size_t)(nl - k->buf) : k->len, j = i;
        while (j < end && (blank((unsigned char)k->buf[j])))
            j++;
        if (j == end) { /* a blank line */
            i = end + 1;
            continue;
        }
        snprintf(where, sizeof(where), "%s:%" PRId64, path, line);
        json_error_t jerr;
        json_t *row = json_loadb(k->buf + i, end - i, JSON_ALLOW_NUL, &jerr);
        i = end + 1;
        if (!row || !json_is_object(row)) {
            if (row)
                am_errorf(&k->err, NULL, "%s: not a JSON object (JSONL holds one object per line)", where);
            else
                am_errorf(&k->err, NULL, "%s:%d: not valid JSON: %s", where, jerr.column, jerr.text);
            json_decref(row);
            break;
        }
        int rc;
        if (o->instruction) {
            rc = encode_instruction(o, s, row, k, where, &scratch);
        } else {
            const char *text;
            size_t n;
            size_t start = k->ids.n;
            rc = column(row, o->text_key, true, &text, &n, where, &k->err);
            if (rc == 0 && (am_tokenizer_encode(o->tok, s, text, n, o->add_special, &k->ids, &k->err) < 0 ||
                            (o->eod >= 0 && push_id(&k->ids, o->eod) < 0) || end_doc(k, start) < 0)) {
                am_errorf(&k->err, NULL, "%s: out of memory", where);
                rc = -1;
            }
        }
        json_decref(row);
        if (rc < 0)
            break;
    }
    am_tok_ids_free(&scratch);
}

static void *worker(void *arg)
{
    struct ctx *c = arg;
    struct am_tok_state *s = am_tok_state_new();
    for (;;) {
        pthread_mutex_lock(&c->mu);
        while (c->taken == c->produced && !c->quit)
            pthread_cond_wait(&c->work, &c->mu);
        if (c->taken == c->produced) {
            pthread_mutex_unlock(&c->mu);
            break;
        }
        struct chunk *k = &c->slots[c->taken++ % c->n_slots];
        pthread_mutex_unlock(&c->mu);
        encode_chunk(c, s, k);
        pthread_mutex_lock(&c->mu);
        k->state = SLOT_DONE;
        pthread_cond_broadcast(&c->done);
        pthread_mutex_unlock(&c->mu);
    }
    am_tok_state_free(s);
    return NULL;
}

/* ---- reading -------------------------------------------------------------------------------- */

struct reader {
    const struct am_text_build *o;
    const bool *jsonl;
    int file;
    FILE *f;
    int64_t off;   /* the file offset of buf[0] */
    int64_t line;  /* the line number of buf[0] */
    char *buf;
    size_t len, cap;
    bool eof;      /* of the current file */
};

/* Fills k with the next chunk; k->len == 0 when the inputs are done. */
static int read_chunk(struct reader *r, struct chunk *k, struct am_errors *err)
{
    k->len = 0;
    for (;;) {
        if (!r->f) {
            if (r->file >= r->o->n_inputs)
                return 0;
            if (!(r->f = fopen(r->o->inputs[r->file], "rb")) || fseeko(r->f, r->off, SEEK_SET) < 0) {
                am_errorf(err, NULL, "%s: cannot open: %s", r->o->inputs[r->file], strerror(errno));
                return -1;
            }
            r->eof = false;
        }
        size_t cut = 0;
        for (size_t want = CHUNK_TARGET;;) {
            if (!r->eof) {
                if (am_grow((void **)&r->buf, &r->cap, r->len + want, 1, 1024) < 0) {
                    am_errorf(err, NULL, "%s: out of memory", r->o->inputs[r->file]);
                    return -1;
                }
                size_t got = fread(r->buf + r->len, 1, want, r->f);
                if (got < want) {
                    if (ferror(r->f)) {
                        am_errorf(err, NULL, "%s: read failed: %s", r->o->inputs[r->file], strerror(errno));
                        return -1;
                    }
                    r->eof = true;
                }
                r->len += got;
            }
            if (r->eof) {
                cut = r->len;
                break;
            }
            if (r->jsonl[r->file]) {
                char *nl = r->len ? memrchr(r->buf, '\n', r->len) : NULL;
                cut = nl ? (size_t)(nl - r->buf) + 1 : 0;
            } else {
                cut = last_paragraph_start(r->buf, r->len);
            }
            if (cut > 0)
                break;
            want = r->len; /* one document longer than the chunk: read on, doubling */
        }
        if (cut == 0) { /* the file is done */
            fclose(r->f);
            r->f = NULL;
            r->file++;
            r->off = 0;
            r->line = 1;
            r->len = 0;
            continue;
        }
        if (am_grow((void **)&k->buf, &k->cap, cut, 1, 1024) < 0) {
            am_errorf(err, NULL, "%s: out of memory", r->o->inputs[r->file]);
            return -1;
        }
        memcpy(k->buf, r->buf, cut);
        k->len = cut;
        k->file = r->file;
        k->line0 = r->line;
        for (char *p = k->buf, *e = k->buf + cut; (p = memchr(p, '\n', (size_t)(e - p))); p++)
            r->line++;
        r->off += (int64_t)cut;
        memmove(r->buf, r->buf + cut, r->len - cut);
        r->len -= cut;
        k->end_file = r->file;
        k->end_offset = r->off;
        k->end_line = r->line;
        if (r->eof && r->len == 0) { /* the next chunk starts at the next file */
            k->end_file = r->file + 1;
            k->end_offset = 0;
            k->end_line = 1;
        }
        return 0;
    }
}

/* ---- resuming ------------------------------------------------------------------------------- */

/* What must not change between an interrupted build and its resumption. */
static char *signature(const struct am_text_build *o)
{
    size_t cap = 4096;
    for (int i = 0; i < o->n_inputs; i++)
        cap += strlen(o->inputs[i]) + 64;
    char *s = malloc(cap);
    if (!s)
        return NULL;
    int n = snprintf(s, cap, "am-data 1|tokenizer %s|format %d|text %s|special %d|eod %" PRId32 "|instruction %d|%s|%s|%s|"
                     "eos %" PRId32 "|inputs", o->tok_desc ? o->tok_desc : "", (int)o->format, o->text_key,
                     o->add_special, o->eod, o->instruction, o->context_key ? o->context_key : "-",
                     o->question_key ? o->question_key : "-", o->answer_key ? o->answer_key : "-", o->eos);
    for (int i = 0; i < o->n_inputs; i++) {
        struct stat st;
        if (stat(o->inputs[i], &st) < 0)
            st.st_size = -1, st.st_mtime = 0;
        n += snprintf(s + n, cap - (size_t)n, " %s:%lld:%lld", o->inputs[i], (long long)st.st_size,
                      (long long)st.st_mtime);
    }
    return s;
}

struct resume_point {
    int file;
    int64_t offset, line, docs, tokens, bytes;
};

static int write_resume(const char *path, const char *sig, const struct resume_point *p, struct am_errors *err)
{
    char tmp[4400];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    json_t *j = json_pack("{s:s, s:i, s:I, s:I, s:I, s:I, s:I}", "signature", sig, "file", p->file, "offset",
                          (json_int_t)p->offset, "line", (json_int_t)p->line, "documents", (json_int_t)p->docs,
                          "tokens", (json_int_t)p->tokens, "bytes", (json_int_t)p->bytes);
    FILE *f = fopen(tmp, "wb");
    int ok = j && f && json_dumpf(j, f, JSON_INDENT(1)) == 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (f)
        ok = (fclose(f) == 0) && ok;
    json_decref(j);
    if (!ok || rename(tmp, path) < 0) {
        am_errorf(err, NULL, "%s: cannot write: %s", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* 1: a resume point was read; 0: there is none; -1: error. */
static int read_resume(const char *path, const char *sig, struct resume_point *p, struct am_errors *err)
{
    json_error_t jerr;
    if (access(path, F_OK) != 0)
        return 0;
    json_t *j = json_load_file(path, 0, &jerr);
    const char *s = json_string_value(json_object_get(j, "signature"));
    int rc = -1;
    if (!s) {
        am_errorf(err, NULL, "%s: not a resume file am-data wrote (remove it and the .partial files to start over)",
                  path);
    } else if (strcmp(s, sig) != 0) {
        am_errorf(err, NULL, "%s: written by a build with other inputs, input sizes, tokenizer or options: run the "
                  "same command to resume it, or remove it and the .partial files beside it to start over", path);
    } else {
        p->file = (int)json_integer_value(json_object_get(j, "file"));
        p->offset = json_integer_value(json_object_get(j, "offset"));
        p->line = json_integer_value(json_object_get(j, "line"));
        p->docs = json_integer_value(json_object_get(j, "documents"));
        p->tokens = json_integer_value(json_object_get(j, "tokens"));
        p->bytes = json_integer_value(json_object_get(j, "bytes"));
        rc = 1;
    }
    json_decref(j);
    return rc;
}

/* ---- the build ------------------------------------------------------------------------------ */

/* Appends n ids as the dataset's dtype. */
static int add_ids(struct am_indexed_builder *b, enum am_idx_dtype dt, const int32_t *ids, size_t n,
                   struct am_errors *err)
{
    if (dt == AM_IDX_I32)
        return am_indexed_builder_add_raw(b, ids, n, err);
    uint16_t buf[4096];
    while (n) {
        size_t k = n < 4096 ? n : 4096;
        for (size_t i = 0; i < k; i++)
            buf[i] = (uint16_t)ids[i];
        if (am_indexed_builder_add_raw(b, buf, k, err) < 0)
            return -1;
        ids += k;
        n -= k;
    }
    return 0;
}

int am_text_build_run(const struct am_text_build *o, struct am_text_stats *st, struct am_errors *err)
{
    memset(st, 0, sizeof(*st));
    double t0 = am_mono_time(), last_sync = t0;
    struct am_progress bar = {0}; /* off until the build starts */
    int threads = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    threads = threads < 1 ? 1 : threads > 256 ? 256 : threads;
    enum am_idx_dtype dt = am_tokenizer_vocab_size(o->tok) <= 65536 ? AM_IDX_U16 : AM_IDX_I32;
    struct ctx c = {.o = o, .n_slots = 2 * threads + 2};
    struct reader r = {.o = o, .line = 1};
    struct am_indexed_builder *b = NULL, *mb = NULL;
    char *sig = NULL, resume_path[4200], mask_prefix[4200];
    int64_t total = 0;
    pthread_t *tids = NULL;
    int started = 0, rc = -1;
    snprintf(resume_path, sizeof(resume_path), "%s.resume", o->out);
    snprintf(mask_prefix, sizeof(mask_prefix), "%s.mask", o->out);
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.work, NULL);
    pthread_cond_init(&c.done, NULL);
    if (!(c.jsonl = calloc((size_t)o->n_inputs, sizeof(bool))) || !(c.slots = calloc((size_t)c.n_slots, sizeof(*c.slots))) ||
        !(tids = calloc((size_t)threads, sizeof(*tids))) || !(sig = signature(o))) {
        am_errorf(err, NULL, "%s: out of memory", o->out);
        goto done;
    }
    for (int i = 0; i < c.n_slots; i++)
        am_errors_init(&c.slots[i].err);
    r.jsonl = c.jsonl;
    for (int i = 0; i < o->n_inputs; i++) {
        struct stat sb;
        const char *dot = strrchr(o->inputs[i], '.');
        c.jsonl[i] = o->format == AM_TEXT_JSONL ||
                     (o->format == AM_TEXT_AUTO && dot && (strcmp(dot, ".jsonl") == 0 || strcmp(dot, ".json") == 0));
        if (stat(o->inputs[i], &sb) < 0) {
            am_errorf(err, NULL, "%s: cannot open: %s", o->inputs[i], strerror(errno));
            goto done;
        }
        if (!S_ISREG(sb.st_mode)) {
            am_errorf(err, NULL, "%s: not a regular file (am-data reads its inputs by offset, to resume)", o->inputs[i]);
            goto done;
        }
        total += sb.st_size;
        if (o->instruction && !c.jsonl[i]) {
            am_errorf(err, NULL, "%s: instruction data is JSONL (a .jsonl file, or --format jsonl)", o->inputs[i]);
            goto done;
        }
    }
    struct resume_point rp = {0};
    int have = o->resume ? read_resume(resume_path, sig, &rp, err) : 0;
    if (have < 0)
        goto done;
    if (o->resume) {
        if (am_indexed_builder_open_partial(o->out, dt, rp.docs, rp.tokens, &b, err) < 0 ||
            (o->instruction && am_indexed_builder_open_partial(mask_prefix, AM_IDX_U8, rp.docs, rp.tokens, &mb, err) < 0))
            goto done;
        if (!have && write_resume(resume_path, sig, &rp, err) < 0)
            goto done;
        r.file = rp.file;
        r.off = rp.offset;
        r.line = rp.line ? rp.line : 1;
        st->documents = rp.docs;
        st->tokens = rp.tokens;
        st->bytes = rp.bytes;
        st->resumed = have == 1;
    } else if (am_indexed_builder_open(o->out, dt, &b, err) < 0 ||
               (o->instruction && am_indexed_builder_open(mask_prefix, AM_IDX_U8, &mb, err) < 0)) {
        goto done;
    }
    am_progress_start(&bar, "am-data build", "tokens", (uint64_t)total, o->progress);
    am_progress_set(&bar, (uint64_t)st->bytes, (uint64_t)st->tokens);
    /* for tests: AM_DATA_SYNC_SECONDS (how often a resumable build syncs) and
     * AM_DATA_KILL_AFTER=N (SIGKILL after the N-th chunk is written) */
    const char *env = getenv("AM_DATA_SYNC_SECONDS");
    double sync_seconds = env ? atof(env) : SYNC_SECONDS;
    env = getenv("AM_DATA_KILL_AFTER");
    int64_t kill_after = env ? atoll(env) : 0;
    for (; started < threads; started++)
        if (pthread_create(&tids[started], NULL, worker, &c) != 0) {
            am_errorf(err, NULL, "cannot start thread %d: %s", started, strerror(errno));
            goto done;
        }
    int64_t written = 0;
    bool inputs_done = false;
    for (;;) {
        while (!inputs_done && c.produced - written < c.n_slots) {
            struct chunk *k = &c.slots[c.produced % c.n_slots];
            if (read_chunk(&r, k, err) < 0)
                goto done;
            if (k->len == 0) {
                inputs_done = true;
                break;
            }
            pthread_mutex_lock(&c.mu);
            k->state = SLOT_READY;
            c.produced++;
            pthread_cond_signal(&c.work);
            pthread_mutex_unlock(&c.mu);
        }
        if (written == c.produced)
            break;
        struct chunk *k = &c.slots[written % c.n_slots];
        pthread_mutex_lock(&c.mu);
        while (k->state != SLOT_DONE)
            pthread_cond_wait(&c.done, &c.mu);
        pthread_mutex_unlock(&c.mu);
        if (k->err.n) {
            for (size_t i = 0; i < k->err.n; i++)
                am_errorf(err, NULL, "%s", k->err.msg[i]);
            goto done;
        }
        size_t at = 0;
        for (size_t d = 0; d < k->n_docs; d++) {
            size_t n = (size_t)k->doc_len[d];
            if (add_ids(b, dt, k->ids.ids + at, n, err) < 0 || am_indexed_builder_end_document(b, err) < 0 ||
                (mb && (am_indexed_builder_add_raw(mb, k->mask + at, n, err) < 0 ||
                        am_indexed_builder_end_document(mb, err) < 0)))
                goto done;
            at += n;
        }
        st->documents += (int64_t)k->n_docs;
        st->tokens += (int64_t)k->ids.n;
        st->bytes += (int64_t)k->len;
        k->state = SLOT_FREE;
        written++;
        double t = am_mono_time();
        if (kill_after > 0 && written == kill_after)
            raise(SIGKILL); /* fault injection: an interruption between two syncs */
        if (o->resume && t - last_sync >= sync_seconds) {
            struct resume_point p = {k->end_file, k->end_offset, k->end_line, 0, 0, st->bytes};
            int64_t md, mt;
            if (am_indexed_builder_sync(b, &p.docs, &p.tokens, err) < 0 ||
                (mb && am_indexed_builder_sync(mb, &md, &mt, err) < 0) || write_resume(resume_path, sig, &p, err) < 0)
                goto done;
            last_sync = t;
        }
        am_progress_set(&bar, (uint64_t)st->bytes, (uint64_t)st->tokens);
    }
    if (st->documents == 0) {
        am_errorf(err, NULL, "%s: the input files hold no documents", o->out);
        goto done;
    }
    struct am_indexed_builder *fb = b, *fm = mb;
    b = mb = NULL;
    if (am_indexed_builder_finish(fb, err) < 0 || (fm && am_indexed_builder_finish(fm, err) < 0))
        goto done;
    if (o->resume)
        unlink(resume_path);
    am_progress_end(&bar, true);
    rc = 0;
done:
    pthread_mutex_lock(&c.mu);
    c.quit = true;
    pthread_cond_broadcast(&c.work);
    pthread_mutex_unlock(&c.mu);
    for (int i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    if (rc < 0)
        am_progress_end(&bar, false);
    am_indexed_builder_abort(b);
    am_indexed_builder_abort(mb);
    if (r.f)
        fclose(r.f);
    free(r.buf);
    for (int i = 0; c.slots && i < c.n_slots; i++) {
        free(c.slots[i].buf);
        am_tok_ids_free(&c.slots[i].ids);
        free(c.slots[i].mask);
        free(c.slots[i].doc_len);
        am_errors_free(&c.slots[i].err);
    }
    free(c.slots);
    free(c.jsonl);
    free(tids);
    free(sig);
    pthread_mutex_destroy(&c.mu);
    pthread_cond_destroy(&c.work);
    pthread_cond_destroy(&c.done);
    st->seconds = am_mono_time() - t0;
    return rc;
}
