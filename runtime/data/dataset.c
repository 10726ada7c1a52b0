/* dataset.c - indexed datasets and GPT samples behind dataset.h.
 *
 * The sample construction follows Megatron-LM's megatron/core/datasets: gpt_dataset.py
 * (_get_num_epochs, _build_document_index, _build_shuffle_index), helpers.cpp
 * (build_sample_idx, build_blending_indices), blended_megatron_dataset_builder.py (the
 * per-dataset sample counts of a blend) and numpy's legacy RandomState (MT19937 seeded with
 * init_genrand, shuffle by Fisher-Yates with masked rejection sampling), so that the same
 * inputs give the same samples as Megatron, bit for bit.
 */
#include "dataset.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "recipe.h"
#include "util.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "dataset.c assumes a little-endian host (Megatron's files are little-endian)"
#endif

static const unsigned char MAGIC[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};

static const struct {
    const char *name;
    int size;
} idx_dtypes[9] = {[1] = {"uint8", 1}, [2] = {"int8", 1},    [3] = {"int16", 2},
                   [4] = {"int32", 4}, [5] = {"int64", 8},   [6] = {"float64", 8},
                   [7] = {"float32", 4}, [8] = {"uint16", 2}};

const char *am_idx_dtype_name(int code) { return code >= 1 && code <= 8 ? idx_dtypes[code].name : NULL; }
int am_idx_dtype_size(int code) { return code >= 1 && code <= 8 ? idx_dtypes[code].size : 0; }

static inline int32_t rd32(const unsigned char *p, int64_t i)
{
    int32_t v;
    memcpy(&v, p + 4 * i, 4);
    return v;
}

static inline int64_t rd64(const unsigned char *p, int64_t i)
{
    int64_t v;
    memcpy(&v, p + 8 * i, 8);
    return v;
}

/* ---- reading ------------------------------------------------------------------------------------ */

struct map {
    unsigned char *p;
    size_t len;
};

static int map_file(const char *path, struct map *m, struct am_errors *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK), rc = -1;
    struct stat st;
    m->p = NULL;
    m->len = 0;
    if (fd < 0 || fstat(fd, &st) < 0) {
        am_errorf(err, NULL, "%s: cannot open: %s (build the dataset with am-data build --out PREFIX)", path,
                  strerror(errno));
        goto done;
    }
    if (!S_ISREG(st.st_mode)) {
        am_errorf(err, NULL, "%s: not a regular file", path);
        goto done;
    }
    if (st.st_size > 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            am_errorf(err, NULL, "%s: cannot map it: %s", path, strerror(errno));
            goto done;
        }
        m->p = p;
        m->len = (size_t)st.st_size;
    }
    rc = 0;
done:
    if (fd >= 0)
        close(fd);
    return rc;
}

static void unmap(struct map *m)
{
    if (m->p)
        munmap(m->p, m->len);
    m->p = NULL;
}

struct am_indexed {
    char *prefix;
    struct map idx, bin;
    int dtype, isize;
    int64_t S, D, tokens;
    const unsigned char *lengths, *pointers, *docs;
};

/* Checks the index body: boundaries, lengths and pointers. */
static int check_index(struct am_indexed *d, const char *path, struct am_errors *err)
{
    uint64_t off_len = AM_IDX_HEADER_BYTES, off_ptr = off_len + 4 * (uint64_t)d->S,
             off_doc = off_ptr + 8 * (uint64_t)d->S;
    int64_t prev = 0;
    for (int64_t i = 0; i < d->D; i++) {
        int64_t b = rd64(d->docs, i);
        if (i == 0 && b != 0) {
            am_errorf(err, NULL, "%s: offset %" PRIu64 ": document boundary 0 is %" PRId64 ", expected 0 (the index "
                      "is corrupt)", path, off_doc, b);
            return -1;
        }
        if (b < prev || b > d->S) {
            am_errorf(err, NULL, "%s: offset %" PRIu64 ": document boundary %" PRId64 " is %" PRId64 ", expected a "
                      "sequence index from %" PRId64 " to %" PRId64 " (the index is corrupt)", path,
                      off_doc + 8 * (uint64_t)i, i, b, prev, d->S);
            return -1;
        }
        prev = b;
    }
    if (prev != d->S) {
        am_errorf(err, NULL, "%s: offset %" PRIu64 ": the last document boundary is %" PRId64 ", expected the "
                  "sequence count %" PRId64 " (the index is corrupt)", path, off_doc + 8 * (uint64_t)(d->D - 1), prev,
                  d->S);
        return -1;
    }
    int64_t pos = 0;
    for (int64_t i = 0; i < d->S; i++) {
        int32_t len = rd32(d->lengths, i);
        int64_t ptr = rd64(d->pointers, i);
        if (len < 0) {
            am_errorf(err, NULL, "%s: offset %" PRIu64 ": sequence %" PRId64 " has length %" PRId32 ", expected a "
                      "length >= 0 (the index is corrupt)", path, off_len + 4 * (uint64_t)i, i, len);
            return -1;
        }
        if (ptr != pos) {
            am_errorf(err, NULL, "%s: offset %" PRIu64 ": sequence %" PRId64 " starts at byte %" PRId64 " of the "
                      ".bin, expected %" PRId64 " (where the sequence before it ends; the index is corrupt)", path,
                      off_ptr + 8 * (uint64_t)i, i, ptr, pos);
            return -1;
        }
        pos += (int64_t)len * d->isize;
        d->tokens += len;
    }
    return 0;
}

int am_indexed_open(const char *prefix, struct am_indexed **out, struct am_errors *err)
{
    int rc = -1;
    char path[4200], bpath[4200];
    *out = NULL;
    struct am_indexed *d = calloc(1, sizeof(*d));
    if (!d || !(d->prefix = strdup(prefix))) {
        am_errorf(err, NULL, "%s: out of memory", prefix);
        goto done;
    }
    if (am_path_cat(path, sizeof(path), prefix, ".idx", "") < 0 ||
        am_path_cat(bpath, sizeof(bpath), prefix, ".bin", "") < 0) {
        am_errorf(err, NULL, "%s: path too long", prefix);
        goto done;
    }
    if (map_file(path, &d->idx, err) < 0)
        goto done;
    const unsigned char *p = d->idx.p;
    size_t len = d->idx.len;
    if (len < AM_IDX_HEADER_BYTES) {
        am_errorf(err, NULL, "%s: truncated: %zu bytes, but the header alone (magic, version, dtype, counts) is %d",
                  path, len, AM_IDX_HEADER_BYTES);
        goto done;
    }
    if (memcmp(p, MAGIC, 9) != 0) {
        char found[40];
        size_t o = 0;
        for (int i = 0; i < 9; i++)
            o += (size_t)snprintf(found + o, sizeof(found) - o, p[i] >= 0x20 && p[i] < 0x7f ? "%c" : "\\x%02x", p[i]);
        am_errorf(err, NULL, "%s: offset 0: expected the magic \"MMIDIDX\\x00\\x00\" of a Megatron index, found "
                  "\"%s\" (not an MMIDIDX .idx file)", path, found);
        goto done;
    }
    uint64_t version, S, D;
    memcpy(&version, p + 9, 8);
    memcpy(&S, p + 18, 8);
    memcpy(&D, p + 26, 8);
    if (version != 1) {
        am_errorf(err, NULL, "%s: offset 9: expected version 1, found %" PRIu64, path, version);
        goto done;
    }
    d->dtype = p[17];
    if (!am_idx_dtype_name(d->dtype)) {
        am_errorf(err, NULL, "%s: offset 17: dtype code %d is not one of Megatron's (1 uint8, 2 int8, 3 int16, "
                  "4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)", path, d->dtype);
        goto done;
    }
    if (d->dtype == AM_IDX_F64 || d->dtype == AM_IDX_F32) {
        am_errorf(err, NULL, "%s: offset 17: dtype %s cannot hold token ids (am reads datasets of integer tokens)",
                  path, am_idx_dtype_name(d->dtype));
        goto done;
    }
    d->isize = am_idx_dtype_size(d->dtype);
    uint64_t need = (S >> 59) || (D >> 59) ? UINT64_MAX : AM_IDX_HEADER_BYTES + 12 * S + 8 * D;
    if (need > len) {
        am_errorf(err, NULL, "%s: truncated: the header announces %" PRIu64 " sequences and %" PRIu64 " document "
                  "boundaries, which need %s%" PRIu64 " bytes, but the file has %zu", path, S, D,
                  need == UINT64_MAX ? "more than " : "", need == UINT64_MAX ? (uint64_t)len : need, len);
        goto done;
    }
    if (len != need && len != need + S) {
        am_errorf(err, NULL, "%s: %zu bytes, but the header's counts (%" PRIu64 " sequences, %" PRIu64 " document "
                  "boundaries) need %" PRIu64 " (or %" PRIu64 " with multimodal sequence modes): the file is corrupt",
                  path, len, S, D, need, need + S);
        goto done;
    }
    if (D == 0) {
        am_errorf(err, NULL, "%s: offset 26: expected at least 1 document boundary (0), found 0", path);
        goto done;
    }
    d->S = (int64_t)S;
    d->D = (int64_t)D;
    d->lengths = p + AM_IDX_HEADER_BYTES;
    d->pointers = d->lengths + 4 * S;
    d->docs = d->pointers + 8 * S;
    if (check_index(d, path, err) < 0)
        goto done;
    if (map_file(bpath, &d->bin, err) < 0)
        goto done;
    if ((uint64_t)d->bin.len != (uint64_t)d->tokens * (uint64_t)d->isize) {
        am_errorf(err, NULL, "%s: %zu bytes, but %s describes %" PRId64 " tokens of %d bytes (%" PRId64 " bytes): "
                  "the .bin and .idx do not belong together, or one is truncated", bpath, d->bin.len, path,
                  d->tokens, d->isize, d->tokens * d->isize);
        goto done;
    }
    *out = d;
    d = NULL;
    rc = 0;
done:
    am_indexed_close(d);
    return rc;
}

void am_indexed_close(struct am_indexed *d)
{
    if (!d)
        return;
    unmap(&d->idx);
    unmap(&d->bin);
    free(d->prefix);
    free(d);
}

const char *am_indexed_prefix(const struct am_indexed *d) { return d->prefix; }
enum am_idx_dtype am_indexed_dtype(const struct am_indexed *d) { return (enum am_idx_dtype)d->dtype; }
int64_t am_indexed_sequences(const struct am_indexed *d) { return d->S; }
int64_t am_indexed_documents(const struct am_indexed *d) { return d->D - 1; }
int64_t am_indexed_tokens(const struct am_indexed *d) { return d->tokens; }
int32_t am_indexed_length(const struct am_indexed *d, int64_t seq) { return rd32(d->lengths, seq); }
int64_t am_indexed_doc_start(const struct am_indexed *d, int64_t doc) { return rd64(d->docs, doc); }

int am_indexed_read(const struct am_indexed *d, int64_t seq, int64_t offset, int64_t count, int32_t *dst,
                    struct am_errors *err)
{
    if (seq < 0 || seq >= d->S || offset < 0 || count < 0 || offset + count > rd32(d->lengths, seq)) {
        am_errorf(err, NULL, "%s: tokens [%" PRId64 ", %" PRId64 ") of sequence %" PRId64 " are outside the "
                  "dataset (%" PRId64 " sequences)", d->prefix, offset, offset + count, seq, d->S);
        return -1;
    }
    const unsigned char *p = d->bin.p + rd64(d->pointers, seq) + offset * d->isize;
    for (int64_t i = 0; i < count; i++) {
        switch (d->dtype) {
        case AM_IDX_U8: dst[i] = p[i]; break;
        case AM_IDX_I8: dst[i] = (int8_t)p[i]; break;
        case AM_IDX_I16: { int16_t v; memcpy(&v, p + 2 * i, 2); dst[i] = v; break; }
        case AM_IDX_U16: { uint16_t v; memcpy(&v, p + 2 * i, 2); dst[i] = v; break; }
        case AM_IDX_I32: dst[i] = rd32(p, i); break;
        default: {
            int64_t v = rd64(p, i);
            if (v < INT32_MIN || v > INT32_MAX) {
                am_errorf(err, NULL, "%s.bin: token %" PRId64 " of sequence %" PRId64 " is %" PRId64 ", outside "
                          "int32 (am's token ids are int32)", d->prefix, offset + i, seq, v);
                return -1;
            }
            dst[i] = (int32_t)v;
        }
        }
    }
    return 0;
}

/* ---- building ---------------------------------------------------------------------------------- */

struct am_indexed_builder {
    char *prefix;
    char bin_tmp[4300], idx_tmp[4300], bin_path[4200], idx_path[4200];
    FILE *bin;
    int dtype, isize;
    int32_t *lengths;
    size_t n, cap;
    int64_t cur;
    /* resumable (am_indexed_builder_open_partial): bin_tmp is PREFIX.bin.partial, and
     * PREFIX.len.partial holds the first len_synced lengths */
    bool partial;
    char len_path[4300];
    FILE *len;
    size_t len_synced;
};

/* A builder for PREFIX with its final paths set (dtype checked), no file open yet. */
static struct am_indexed_builder *builder_new(const char *prefix, enum am_idx_dtype dtype, struct am_errors *err)
{
    if (!am_idx_dtype_name((int)dtype) || dtype == AM_IDX_F64 || dtype == AM_IDX_F32) {
        am_errorf(err, NULL, "%s: dtype code %d is not an integer token dtype", prefix, (int)dtype);
        return NULL;
    }
    struct am_indexed_builder *b = calloc(1, sizeof(*b));
    if (!b || !(b->prefix = strdup(prefix))) {
        free(b);
        am_errorf(err, NULL, "%s: out of memory", prefix);
        return NULL;
    }
    b->dtype = (int)dtype;
    b->isize = am_idx_dtype_size(b->dtype);
    if (am_path_cat(b->bin_path, sizeof(b->bin_path), prefix, ".bin", "") < 0 ||
        am_path_cat(b->idx_path, sizeof(b->idx_path), prefix, ".idx", "") < 0) {
        am_errorf(err, NULL, "%s: path too long", prefix);
        free(b->prefix);
        free(b);
        return NULL;
    }
    return b;
}

int am_indexed_builder_open(const char *prefix, enum am_idx_dtype dtype, struct am_indexed_builder **out,
                            struct am_errors *err)
{
    struct am_indexed_builder *b = *out = builder_new(prefix, dtype, err);
    if (!b)
        return -1;
    int fd = am_open_temp(b->bin_path, b->bin_tmp, sizeof(b->bin_tmp));
    if (fd < 0 || !(b->bin = fdopen(fd, "wb"))) {
        am_errorf(err, NULL, "%s: cannot create a file beside it: %s (does the directory exist, is it writable?)",
                  b->bin_path, strerror(errno));
        if (fd >= 0) {
            close(fd);
            unlink(b->bin_tmp);
        }
        free(b->prefix);
        free(b);
        *out = NULL;
        return -1;
    }
    setvbuf(b->bin, NULL, _IOFBF, 1 << 20);
    return 0;
}

static int check_doc_length(struct am_indexed_builder *b, size_t n, struct am_errors *err)
{
    if ((uint64_t)b->cur + n > INT32_MAX) {
        am_errorf(err, NULL, "%s: a document of more than %d tokens (Megatron's sequence lengths are int32): split "
                  "it", b->prefix, INT32_MAX);
        return -1;
    }
    return 0;
}

int am_indexed_builder_add_raw(struct am_indexed_builder *b, const void *tokens, size_t n, struct am_errors *err)
{
    if (check_doc_length(b, n, err) < 0)
        return -1;
    if (n && fwrite(tokens, (size_t)b->isize, n, b->bin) != n) {
        am_errorf(err, NULL, "%s: write failed: %s (is the disk full?)", b->bin_path, strerror(errno));
        return -1;
    }
    b->cur += (int64_t)n;
    return 0;
}

int am_indexed_builder_add(struct am_indexed_builder *b, const int64_t *ids, size_t n, struct am_errors *err)
{
    static const int64_t lo[9] = {0, 0, INT8_MIN, INT16_MIN, INT32_MIN, INT64_MIN, 0, 0, 0};
    static const int64_t hi[9] = {0, UINT8_MAX, INT8_MAX, INT16_MAX, INT32_MAX, INT64_MAX, 0, 0, UINT16_MAX};
    unsigned char buf[8 * 512];
    while (n > 0) {
        size_t k = n < 512 ? n : 512;
        for (size_t i = 0; i < k; i++) {
            int64_t v = ids[i];
            if (v < lo[b->dtype] || v > hi[b->dtype]) {
                am_errorf(err, NULL, "%s: token id %" PRId64 " does not fit the dataset's dtype %s (%" PRId64 " to "
                          "%" PRId64 ")", b->prefix, v, am_idx_dtype_name(b->dtype), lo[b->dtype], hi[b->dtype]);
                return -1;
            }
            switch (b->isize) {
            case 1: buf[i] = (unsigned char)v; break;
            case 2: { uint16_t u = (uint16_t)v; memcpy(buf + 2 * i, &u, 2); break; }
            case 4: { int32_t u = (int32_t)v; memcpy(buf + 4 * i, &u, 4); break; }
            default: memcpy(buf + 8 * i, &v, 8);
            }
        }
        if (am_indexed_builder_add_raw(b, buf, k, err) < 0)
            return -1;
        ids += k;
        n -= k;
    }
    return 0;
}

int am_indexed_builder_end_document(struct am_indexed_builder *b, struct am_errors *err)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 1024;
        int32_t *l = realloc(b->lengths, cap * sizeof(*l));
        if (!l) {
            am_errorf(err, NULL, "%s: out of memory after %zu documents", b->prefix, b->n);
            return -1;
        }
        b->lengths = l;
        b->cap = cap;
    }
    b->lengths[b->n++] = (int32_t)b->cur;
    b->cur = 0;
    return 0;
}

void am_indexed_builder_abort(struct am_indexed_builder *b)
{
    if (!b)
        return;
    if (b->bin)
        fclose(b->bin);
    if (b->len)
        fclose(b->len);
    if (b->bin_tmp[0] && !b->partial) /* a partial build is kept: a resume starts from it */
        unlink(b->bin_tmp);
    if (b->idx_tmp[0])
        unlink(b->idx_tmp);
    free(b->lengths);
    free(b->prefix);
    free(b);
}

/* Writes the index (Megatron's _IndexWriter layout) to an open stream. */
static int write_index(FILE *f, const struct am_indexed_builder *b)
{
    uint64_t version = 1, S = b->n, D = b->n + 1;
    unsigned char code = (unsigned char)b->dtype;
    int ok = fwrite(MAGIC, 9, 1, f) == 1 && fwrite(&version, 8, 1, f) == 1 && fwrite(&code, 1, 1, f) == 1 &&
             fwrite(&S, 8, 1, f) == 1 && fwrite(&D, 8, 1, f) == 1 && fwrite(b->lengths, 4, b->n, f) == b->n;
    int64_t ptr = 0;
    for (size_t i = 0; ok && i < b->n; i++) {
        ok = fwrite(&ptr, 8, 1, f) == 1;
        ptr += (int64_t)b->lengths[i] * b->isize;
    }
    for (int64_t i = 0; ok && i <= (int64_t)b->n; i++)
        ok = fwrite(&i, 8, 1, f) == 1;
    return ok ? 0 : -1;
}

int am_indexed_builder_finish(struct am_indexed_builder *b, struct am_errors *err)
{
    int rc = -1;
    FILE *idx = NULL;
    if (b->cur > 0 && am_indexed_builder_end_document(b, err) < 0)
        goto done;
    if (fflush(b->bin) != 0 || fsync(fileno(b->bin)) != 0) {
        am_errorf(err, NULL, "%s: write failed: %s (is the disk full?)", b->bin_path, strerror(errno));
        goto done;
    }
    int fclose_rc = fclose(b->bin);
    b->bin = NULL;
    if (fclose_rc != 0) {
        am_errorf(err, NULL, "%s: write failed: %s", b->bin_path, strerror(errno));
        goto done;
    }
    int fd = am_open_temp(b->idx_path, b->idx_tmp, sizeof(b->idx_tmp));
    if (fd < 0 || !(idx = fdopen(fd, "wb"))) {
        am_errorf(err, NULL, "%s: cannot create a file beside it: %s", b->idx_path, strerror(errno));
        if (fd >= 0)
            close(fd);
        goto done;
    }
    if (write_index(idx, b) < 0 || fflush(idx) != 0 || fsync(fileno(idx)) != 0) {
        am_errorf(err, NULL, "%s: write failed: %s (is the disk full?)", b->idx_path, strerror(errno));
        goto done;
    }
    fclose_rc = fclose(idx);
    idx = NULL;
    if (fclose_rc != 0) {
        am_errorf(err, NULL, "%s: write failed: %s", b->idx_path, strerror(errno));
        goto done;
    }
    /* .bin first: a crash between the renames leaves a .bin that its old .idx does not
     * describe, which am_indexed_open rejects (the sizes disagree), never silent garbage */
    if (rename(b->bin_tmp, b->bin_path) < 0 || (b->bin_tmp[0] = '\0', rename(b->idx_tmp, b->idx_path) < 0)) {
        am_errorf(err, NULL, "%s: cannot rename the finished files into place: %s", b->prefix, strerror(errno));
        goto done;
    }
    b->idx_tmp[0] = '\0';
    if (b->partial) {
        if (b->len)
            fclose(b->len);
        b->len = NULL;
        unlink(b->len_path);
        b->partial = false;
    }
    if (am_fsync_dir_of(b->idx_path, false) < 0) {
        am_errorf(err, NULL, "%s: written, but syncing the directory failed: %s", b->prefix, strerror(errno));
        goto done;
    }
    rc = 0;
done:
    if (idx)
        fclose(idx);
    am_indexed_builder_abort(b);
    return rc;
}

/* ---- numpy's legacy RandomState ------------------------------------------------------------------- */

struct mt19937 {
    uint32_t key[624];
    int pos;
};

static void mt_seed(struct mt19937 *s, uint32_t seed)
{
    for (int i = 0; i < 624; i++) {
        s->key[i] = seed;
        seed = 1812433253u * (seed ^ (seed >> 30)) + (uint32_t)i + 1;
    }
    s->pos = 624;
}

static void mt_generate(struct mt19937 *s)
{
    const uint32_t upper = 0x80000000u, lower = 0x7fffffffu, a = 0x9908b0dfu;
    int i;
    uint32_t y;
    for (i = 0; i < 624 - 397; i++) {
        y = (s->key[i] & upper) | (s->key[i + 1] & lower);
        s->key[i] = s->key[i + 397] ^ (y >> 1) ^ (-(y & 1) & a);
    }
    for (; i < 623; i++) {
        y = (s->key[i] & upper) | (s->key[i + 1] & lower);
        s->key[i] = s->key[i + 397 - 624] ^ (y >> 1) ^ (-(y & 1) & a);
    }
    y = (s->key[623] & upper) | (s->key[0] & lower);
    s->key[623] = s->key[396] ^ (y >> 1) ^ (-(y & 1) & a);
    s->pos = 0;
}

static uint32_t mt_next32(struct mt19937 *s)
{
    if (s->pos == 624)
        mt_generate(s);
    uint32_t y = s->key[s->pos++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

/* numpy's random_interval: a uniform integer in [0, max] by masked rejection. */
static uint64_t mt_interval(struct mt19937 *s, uint64_t max)
{
    if (max == 0)
        return 0;
    uint64_t mask = max, v;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    if (max <= 0xffffffffu) {
        while ((v = (mt_next32(s) & mask)) > max)
            ;
    } else {
        while ((v = ((((uint64_t)mt_next32(s) << 32) | mt_next32(s)) & mask)) > max)
            ;
    }
    return v;
}

/* RandomState.shuffle of a 1-d array. */
static void shuffle_i32(struct mt19937 *s, int32_t *a, int64_t n)
{
    for (int64_t i = n - 1; i >= 1; i--) {
        int64_t j = (int64_t)mt_interval(s, (uint64_t)i);
        int32_t t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

static void shuffle_i64(struct mt19937 *s, int64_t *a, int64_t n)
{
    for (int64_t i = n - 1; i >= 1; i--) {
        int64_t j = (int64_t)mt_interval(s, (uint64_t)i);
        int64_t t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

/* ---- GPT samples ---------------------------------------------------------------------------------- */

struct gpt_ds {
    struct am_indexed *d;
    int32_t *doc_index;
    int64_t n_doc_index;
    int64_t *sample_index; /* (n_samples + 1) x 2 */
    int64_t n_samples;
    int64_t *shuffle; /* NULL: identity */
    int epochs;
};

struct am_gpt {
    struct gpt_ds *ds;
    int n;
    int64_t seq_length, size;
    int16_t *blend_ds; /* NULL for a single dataset */
    int64_t *blend_sample;
};

/* GPTDataset._build_document_sample_shuffle_indices for one dataset (all of its sequences,
 * add_extra_token_to_sequence and drop_last_partial_sequence as in training). */
static int build_gpt_ds(struct gpt_ds *g, int64_t L, int64_t num_samples, bool shuffle, uint32_t seed,
                        struct am_errors *err)
{
    const struct am_indexed *d = g->d;
    int64_t S = d->S, T = d->tokens;
    if (T < L + 1) {
        /* Megatron would build zero samples (one epoch) or loop; say what is wrong instead */
        if (num_samples == 0 || T <= 1) {
            am_errorf(err, NULL, "%s: %" PRId64 " tokens, fewer than one sample of seq_length + 1 = %" PRId64
                      " (use a larger dataset or a smaller dataset.seq_length)", d->prefix, T, L + 1);
            return -1;
        }
    }
    /* _get_num_epochs: the fewest epochs whose tokens cover num_samples * L + 1 */
    int64_t epochs = 1;
    if (num_samples > 0) {
        if (num_samples > (INT64_MAX - 1) / L) {
            am_errorf(err, NULL, "%s: %" PRId64 " samples of %" PRId64 " tokens is too many", d->prefix, num_samples, L);
            return -1;
        }
        int64_t requested = num_samples * L + 1;
        epochs = (requested + T - 1) / T;
        if (epochs < 1)
            epochs = 1;
    }
    if (epochs > INT32_MAX / (S ? S : 1) || epochs * T > INT64_MAX / 2) {
        am_errorf(err, NULL, "%s: %" PRId64 " samples need %" PRId64 " epochs of its %" PRId64 " sequences, more "
                  "than a document index holds (Megatron's is int32): use a larger dataset or fewer steps",
                  d->prefix, num_samples, epochs, S);
        return -1;
    }
    g->epochs = (int)epochs;
    bool separate = false;
    int64_t sans = 0;
    if (epochs > 1) {
        sans = ((epochs - 1) * T - 1) / L;
        int64_t from_final = num_samples - sans, per_epoch = (T - 1) / L;
        separate = from_final < (int64_t)(0.80 * (double)per_epoch);
    }
    struct mt19937 *rs = malloc(sizeof(*rs));
    g->n_doc_index = epochs * S;
    g->doc_index = malloc((size_t)(g->n_doc_index ? g->n_doc_index : 1) * sizeof(int32_t));
    int64_t ns = (epochs * T - 1) / L;
    g->n_samples = ns;
    g->sample_index = malloc((size_t)(ns + 1) * 2 * sizeof(int64_t));
    g->shuffle = shuffle ? malloc((size_t)(ns ? ns : 1) * sizeof(int64_t)) : NULL;
    if (!rs || !g->doc_index || !g->sample_index || (shuffle && !g->shuffle)) {
        free(rs);
        am_errorf(err, NULL, "%s: out of memory for the sample index of %" PRId64 " samples (%" PRId64 " epochs)",
                  d->prefix, ns, epochs);
        return -1;
    }
    mt_seed(rs, seed);
    /* _build_document_index */
    for (int64_t e = 0; e < epochs; e++)
        for (int64_t i = 0; i < S; i++)
            g->doc_index[e * S + i] = (int32_t)i;
    if (shuffle) {
        if (!separate) {
            shuffle_i32(rs, g->doc_index, epochs * S);
        } else {
            shuffle_i32(rs, g->doc_index, (epochs - 1) * S);
            shuffle_i32(rs, g->doc_index + (epochs - 1) * S, S);
        }
    }
    /* helpers.cpp build_sample_idx */
    int64_t *si = g->sample_index, di = 0, off = 0;
    si[0] = 0;
    si[1] = 0;
    for (int64_t k = 1; k <= ns; k++) {
        int64_t remaining = L + 1;
        while (remaining != 0) {
            int32_t doc = g->doc_index[di];
            int64_t dl = rd32(d->lengths, doc) - off;
            remaining -= dl;
            if (remaining <= 0) {
                off += remaining + dl - 1;
                remaining = 0;
            } else {
                if (di == g->n_doc_index - 1) {
                    off = rd32(d->lengths, g->doc_index[di]) - 1;
                    break;
                }
                di++;
                off = 0;
            }
        }
        si[2 * k] = di;
        si[2 * k + 1] = off;
    }
    /* _build_shuffle_index */
    if (shuffle) {
        for (int64_t i = 0; i < ns; i++)
            g->shuffle[i] = i;
        if (!separate) {
            shuffle_i64(rs, g->shuffle, ns);
        } else {
            int64_t first = sans < ns ? sans : ns;
            shuffle_i64(rs, g->shuffle, first);
            shuffle_i64(rs, g->shuffle + first, ns - first);
        }
    }
    free(rs);
    return 0;
}

/* numpy.sum of a short float64 array (pairwise summation: sequential below 8 elements,
 * eight lanes up to 128), so that normalised weights match Megatron's bit for bit. */
static double np_sum(const double *a, int n)
{
    if (n < 8) {
        double r = 0.;
        for (int i = 0; i < n; i++)
            r += a[i];
        return r;
    }
    double r[8];
    int i;
    for (int j = 0; j < 8; j++)
        r[j] = a[j];
    for (i = 8; i < n - (n % 8); i += 8)
        for (int j = 0; j < 8; j++)
            r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++)
        res += a[i];
    return res;
}

static void normalize(double *w, int n)
{
    double s = np_sum(w, n);
    for (int i = 0; i < n; i++)
        w[i] /= s;
}

int am_gpt_open(const struct am_gpt_config *cfg, struct am_gpt **out, struct am_errors *err)
{
    int rc = -1;
    double w[AM_MAX_DATA_PATHS];
    *out = NULL;
    struct am_gpt *g = NULL;
    if (cfg->n_paths < 1 || cfg->n_paths > AM_MAX_DATA_PATHS) {
        am_errorf(err, NULL, "dataset.paths: %d datasets; am blends 1 to %d", cfg->n_paths, AM_MAX_DATA_PATHS);
        goto done;
    }
    if (cfg->seq_length < 1 || cfg->seq_length > INT32_MAX - 1) {
        am_errorf(err, NULL, "dataset.seq_length: %" PRId64 " must be at least 1", cfg->seq_length);
        goto done;
    }
    if (cfg->num_samples < 0 || (cfg->n_paths > 1 && cfg->num_samples == 0)) {
        am_errorf(err, NULL, "dataset: a blend of %d datasets needs the number of samples to draw (global batch x "
                  "steps), got %" PRId64, cfg->n_paths, cfg->num_samples);
        goto done;
    }
    for (int i = 0; i < cfg->n_paths; i++) {
        w[i] = cfg->weights ? cfg->weights[i] : 1.0;
        if (!(w[i] > 0) || !isfinite(w[i])) {
            am_errorf(err, NULL, "dataset.paths: weight %g of %s must be positive", w[i], cfg->paths[i]);
            goto done;
        }
    }
    if (!(g = calloc(1, sizeof(*g))) || !(g->ds = calloc((size_t)cfg->n_paths, sizeof(*g->ds)))) {
        am_errorf(err, NULL, "dataset: out of memory");
        goto done;
    }
    g->n = cfg->n_paths;
    g->seq_length = cfg->seq_length;
    if (g->n == 1) { /* Megatron builds the GPTDataset itself: no blend */
        if (am_indexed_open(cfg->paths[0], &g->ds[0].d, err) < 0 ||
            build_gpt_ds(&g->ds[0], cfg->seq_length, cfg->num_samples, cfg->shuffle, cfg->seed, err) < 0)
            goto done;
        g->size = g->ds[0].n_samples;
        *out = g;
        g = NULL;
        rc = 0;
        goto done;
    }
    /* BlendedMegatronDatasetBuilder: weights normalised; dataset i builds
     * ceil(ceil(N * w_i) * 1.005) samples and the blend is sum_i ceil(N * w_i) long */
    normalize(w, g->n);
    const double N = (double)cfg->num_samples, surplus = 1.0 + 0.005;
    g->size = 0;
    for (int i = 0; i < g->n; i++) {
        int64_t target = (int64_t)ceil(ceil(N * w[i]) * 1.0), buffer = (int64_t)ceil(ceil(N * w[i]) * surplus);
        g->size += target;
        if (am_indexed_open(cfg->paths[i], &g->ds[i].d, err) < 0 ||
            build_gpt_ds(&g->ds[i], cfg->seq_length, buffer, cfg->shuffle, cfg->seed, err) < 0)
            goto done;
    }
    /* BlendedDataset normalises again, then helpers.cpp build_blending_indices */
    normalize(w, g->n);
    g->blend_ds = malloc((size_t)g->size * sizeof(*g->blend_ds));
    g->blend_sample = malloc((size_t)g->size * sizeof(*g->blend_sample));
    if (!g->blend_ds || !g->blend_sample) {
        am_errorf(err, NULL, "dataset: out of memory for a blend of %" PRId64 " samples", g->size);
        goto done;
    }
    int64_t current[AM_MAX_DATA_PATHS] = {0};
    for (int64_t s = 0; s < g->size; s++) {
        double sd = s > 1 ? (double)s : 1.0;
        int best = 0;
        double best_err = w[0] * sd - (double)current[0];
        for (int i = 1; i < g->n; i++) {
            double e = w[i] * sd - (double)current[i];
            if (e > best_err) {
                best_err = e;
                best = i;
            }
        }
        g->blend_ds[s] = (int16_t)best;
        g->blend_sample[s] = current[best]++;
    }
    for (int i = 0; i < g->n; i++)
        if (current[i] > g->ds[i].n_samples) {
            am_errorf(err, NULL, "%s: the blend draws %" PRId64 " samples from it but it has %" PRId64 " (internal "
                      "error: please report it)", cfg->paths[i], current[i], g->ds[i].n_samples);
            goto done;
        }
    *out = g;
    g = NULL;
    rc = 0;
done:
    am_gpt_close(g);
    return rc;
}

void am_gpt_close(struct am_gpt *g)
{
    if (!g)
        return;
    for (int i = 0; g->ds && i < g->n; i++) {
        am_indexed_close(g->ds[i].d);
        free(g->ds[i].doc_index);
        free(g->ds[i].sample_index);
        free(g->ds[i].shuffle);
    }
    free(g->ds);
    free(g->blend_ds);
    free(g->blend_sample);
    free(g);
}

int64_t am_gpt_size(const struct am_gpt *g) { return g->size; }
int64_t am_gpt_seq_length(const struct am_gpt *g) { return g->seq_length; }
int am_gpt_dataset_epochs(const struct am_gpt *g, int k) { return k >= 0 && k < g->n ? g->ds[k].epochs : 0; }
int64_t am_gpt_dataset_samples(const struct am_gpt *g, int k) { return k >= 0 && k < g->n ? g->ds[k].n_samples : 0; }

int am_gpt_source(const struct am_gpt *g, int64_t i, int *dataset, int64_t *dataset_sample)
{
    if (i < 0 || i >= g->size)
        return -1;
    *dataset = g->blend_ds ? g->blend_ds[i] : 0;
    *dataset_sample = g->blend_sample ? g->blend_sample[i] : i;
    return 0;
}

/* GPTDataset._query_document_sample_shuffle_indices */
int am_gpt_sample(const struct am_gpt *g, int64_t i, int32_t *tokens, struct am_errors *err)
{
    int k;
    int64_t j;
    if (am_gpt_source(g, i, &k, &j) < 0) {
        am_errorf(err, NULL, "dataset: sample %" PRId64 " is past the end (%" PRId64 " samples were built: pass the "
                  "number the run reads as num_samples)", i, g->size);
        return -1;
    }
    const struct gpt_ds *ds = &g->ds[k];
    int64_t idx = ds->shuffle ? ds->shuffle[j] : j;
    int64_t beg = ds->sample_index[2 * idx], beg_off = ds->sample_index[2 * idx + 1];
    int64_t end = ds->sample_index[2 * idx + 2], end_off = ds->sample_index[2 * idx + 3];
    int64_t n = 0;
    for (int64_t p = beg; p <= end; p++) {
        int32_t seq = ds->doc_index[p];
        int64_t off = p == beg ? beg_off : 0;
        int64_t len = p < end ? am_indexed_length(ds->d, seq) - off : end_off + 1 - off;
        if (n + len > g->seq_length + 1 || len < 0) {
            am_errorf(err, NULL, "%s: sample %" PRId64 " is malformed (internal error: please report it)",
                      ds->d->prefix, i);
            return -1;
        }
        if (am_indexed_read(ds->d, seq, off, len, tokens + n, err) < 0)
            return -1;
        n += len;
    }
    if (n != g->seq_length + 1) {
        am_errorf(err, NULL, "%s: sample %" PRId64 " has %" PRId64 " tokens instead of %" PRId64 " (internal error: "
                  "please report it)", ds->d->prefix, i, n, g->seq_length + 1);
        return -1;
    }
    return 0;
}

int am_gpt_config_from_recipe(const struct am_recipe *r, int64_t num_samples, struct am_gpt_config *cfg,
                              struct am_errors *err)
{
    memset(cfg, 0, sizeof(*cfg));
    if (r->data.seed < 0 || r->data.seed > (long)UINT32_MAX) {
        struct am_pos pos = am_recipe_pos(r, "dataset.seed");
        am_errorf(err, &pos, "dataset.seed: %ld is outside 0 to 4294967295 (numpy's RandomState, which Megatron "
                  "seeds with it, takes a 32-bit seed)", r->data.seed);
        return -1;
    }
    cfg->paths = r->data.paths;
    cfg->weights = r->data.weights;
    cfg->n_paths = r->data.n_paths;
    cfg->seq_length = r->data.seq_length;
    cfg->shuffle = r->data.shuffle;
    cfg->seed = (uint32_t)r->data.seed;
    cfg->num_samples = num_samples;
    return 0;
}

/* ---- numpy's RandomState(seed).shuffle, for other modules (the packer's documents) --------------- */

int am_np_shuffle_i64(uint32_t seed, int64_t *a, int64_t n)
{
    struct mt19937 *rs = malloc(sizeof(*rs));
    if (!rs)
        return -1;
    mt_seed(rs, seed);
    shuffle_i64(rs, a, n);
    free(rs);
    return 0;
}

/* ---- resumable building ------------------------------------------------------------------------ */

int am_indexed_builder_open_partial(const char *prefix, enum am_idx_dtype dtype, int64_t docs, int64_t tokens,
                                    struct am_indexed_builder **out, struct am_errors *err)
{
    *out = NULL;
    struct am_indexed_builder *b = builder_new(prefix, dtype, err);
    if (!b)
        return -1;
    b->partial = true;
    if (am_path_cat(b->bin_tmp, sizeof(b->bin_tmp), prefix, ".bin.partial", "") < 0 ||
        am_path_cat(b->len_path, sizeof(b->len_path), prefix, ".len.partial", "") < 0) {
        am_errorf(err, NULL, "%s: path too long", prefix);
        goto fail;
    }
    bool fresh = docs == 0 && tokens == 0;
    b->bin = fopen(b->bin_tmp, fresh ? "wb" : "r+b");
    b->len = fopen(b->len_path, fresh ? "wb" : "r+b");
    if (!b->bin || !b->len) {
        am_errorf(err, NULL, "%s: cannot %s: %s", b->bin ? b->len_path : b->bin_tmp, fresh ? "create" : "open",
                  strerror(errno));
        goto fail;
    }
    if (!fresh) {
        struct stat sb, sl;
        if (fstat(fileno(b->bin), &sb) < 0 || fstat(fileno(b->len), &sl) < 0 || sb.st_size < tokens * b->isize ||
            sl.st_size < docs * 4 || !(b->lengths = malloc((size_t)(docs ? docs : 1) * sizeof(int32_t))) ||
            fread(b->lengths, 4, (size_t)docs, b->len) != (size_t)docs) {
            am_errorf(err, NULL, "%s: shorter than its resume point (%" PRId64 " documents, %" PRId64 " tokens): remove "
                      "the .partial files and the .resume file to start over", b->bin_tmp, docs, tokens);
            goto fail;
        }
        int64_t sum = 0;
        for (int64_t i = 0; i < docs; i++)
            sum += b->lengths[i];
        if (sum != tokens) {
            am_errorf(err, NULL, "%s: its lengths add up to %" PRId64 " tokens, the resume point says %" PRId64 ": "
                      "remove the .partial files and the .resume file to start over", b->len_path, sum, tokens);
            goto fail;
        }
        b->n = b->cap = b->len_synced = (size_t)docs;
        if (ftruncate(fileno(b->bin), (off_t)(tokens * b->isize)) < 0 || ftruncate(fileno(b->len), docs * 4) < 0 ||
            fseeko(b->bin, 0, SEEK_END) < 0 || fseeko(b->len, 0, SEEK_END) < 0) {
            am_errorf(err, NULL, "%s: cannot cut it back to its resume point: %s", b->bin_tmp, strerror(errno));
            goto fail;
        }
    }
    setvbuf(b->bin, NULL, _IOFBF, 1 << 20);
    *out = b;
    return 0;
fail:
    if (b->bin)
        fclose(b->bin);
    if (b->len)
        fclose(b->len);
    free(b->lengths);
    free(b->prefix);
    free(b);
    return -1;
}

int am_indexed_builder_sync(struct am_indexed_builder *b, int64_t *docs, int64_t *tokens, struct am_errors *err)
{
    if (!b->partial || b->cur != 0) {
        am_errorf(err, NULL, "%s: synced %s", b->prefix, b->partial ? "inside a document" : "without a partial build");
        return -1;
    }
    size_t k = b->n - b->len_synced;
    if ((k && fwrite(b->lengths + b->len_synced, 4, k, b->len) != k) || fflush(b->len) != 0 || fflush(b->bin) != 0 ||
        fsync(fileno(b->len)) != 0 || fsync(fileno(b->bin)) != 0) {
        am_errorf(err, NULL, "%s: write failed: %s (is the disk full?)", b->bin_tmp, strerror(errno));
        return -1;
    }
    b->len_synced = b->n;
    int64_t t = 0;
    for (size_t i = 0; i < b->n; i++)
        t += b->lengths[i];
    *docs = (int64_t)b->n;
    *tokens = t;
    return 0;
}
