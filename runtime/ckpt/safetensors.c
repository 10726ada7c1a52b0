/* safetensors.c - the reader and writer behind safetensors.h. */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "util.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c assumes a little-endian host (the format is little-endian)"
#endif

/* ---- dtypes -------------------------------------------------------------------------------- */

static const struct {
    const char *name;
    int bits;
} dtypes[AM_ST_NDTYPES] = {
    [AM_ST_BOOL] = {"BOOL", 8},       [AM_ST_F4] = {"F4", 4},
    [AM_ST_F6_E2M3] = {"F6_E2M3", 6}, [AM_ST_F6_E3M2] = {"F6_E3M2", 6},
    [AM_ST_U8] = {"U8", 8},           [AM_ST_I8] = {"I8", 8},
    [AM_ST_F8_E5M2] = {"F8_E5M2", 8}, [AM_ST_F8_E4M3] = {"F8_E4M3", 8},
    [AM_ST_F8_E8M0] = {"F8_E8M0", 8}, [AM_ST_I16] = {"I16", 16},
    [AM_ST_U16] = {"U16", 16},        [AM_ST_F16] = {"F16", 16},
    [AM_ST_BF16] = {"BF16", 16},      [AM_ST_I32] = {"I32", 32},
    [AM_ST_U32] = {"U32", 32},        [AM_ST_F32] = {"F32", 32},
    [AM_ST_C64] = {"C64", 64},        [AM_ST_F64] = {"F64", 64},
    [AM_ST_I64] = {"I64", 64},        [AM_ST_U64] = {"U64", 64},
};

const char *am_st_dtype_name(enum am_st_dtype d)
{
    return (unsigned)d < AM_ST_NDTYPES ? dtypes[d].name : "?";
}

int am_st_dtype_bits(enum am_st_dtype d) { return (unsigned)d < AM_ST_NDTYPES ? dtypes[d].bits : 0; }

int am_st_dtype_parse(const char *s, enum am_st_dtype *out)
{
    for (int i = 0; i < AM_ST_NDTYPES; i++)
        if (strcmp(s, dtypes[i].name) == 0) {
            *out = (enum am_st_dtype)i;
            return 0;
        }
    return -1;
}

bool am_st_dtype_to_am(enum am_st_dtype d, enum am_dtype *out)
{
    switch (d) {
    case AM_ST_F32: *out = AM_F32; return true;
    case AM_ST_BF16: *out = AM_BF16; return true;
    case AM_ST_F16: *out = AM_F16; return true;
    case AM_ST_I32: *out = AM_I32; return true;
    case AM_ST_I64: *out = AM_I64; return true;
    default: return false;
    }
}

/* ---- small helpers ---------------------------------------------------------------------------- */

const char *am_st_shape_str(const int64_t *shape, int ndim, char *buf, size_t len)
{
    size_t o = 0;
    o += (size_t)snprintf(buf + o, o < len ? len - o : 0, "[");
    for (int i = 0; i < ndim; i++)
        o += (size_t)snprintf(buf + o, o < len ? len - o : 0, "%s%" PRId64, i ? ", " : "", shape[i]);
    snprintf(buf + o, o < len ? len - o : 0, "]");
    return buf;
}

/* A name from a file, safe to print: control characters become '?', long names are cut. */
static const char *shown(const char *s, char *buf, size_t len)
{
    size_t i = 0;
    for (; s[i] && i + 4 < len; i++)
        buf[i] = ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) ? '?' : s[i];
    if (s[i]) {
        memcpy(buf + i, "...", 3);
        i += 3;
    }
    buf[i] = '\0';
    return buf;
}

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            if (w == 0)
                errno = EIO;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* ---- reading ---------------------------------------------------------------------------------- */

struct am_st_file {
    char *path;
    unsigned char *map;
    size_t map_len;
    json_t *root;
    json_t *meta;
    struct am_st_info *t;
    size_t n;
    struct am_st_info **by_name;
};

static int cmp_offsets(const void *a, const void *b)
{
    const struct am_st_info *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

static int cmp_names(const void *a, const void *b)
{
    const struct am_st_info *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* Reads one tensor entry of the header. */
static int parse_entry(const char *path, const char *name, json_t *v, struct am_st_info *t, struct am_errors *err)
{
    char nb[160];
    shown(name, nb, sizeof(nb));
    if (!json_is_object(v)) {
        am_errorf(err, NULL, "%s: tensor '%s': expected an object {\"dtype\", \"shape\", \"data_offsets\"} "
                  "(the header is corrupt)", path, nb);
        return -1;
    }
    json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape"),
           *off = json_object_get(v, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(shape) || !json_is_array(off)) {
        am_errorf(err, NULL, "%s: tensor '%s': needs \"dtype\" (a string), \"shape\" (a list) and "
                  "\"data_offsets\" (a list) (the header is corrupt)", path, nb);
        return -1;
    }
    t->name = name;
    if (am_st_dtype_parse(json_string_value(dt), &t->dtype) < 0) {
        char db[64];
        am_errorf(err, NULL, "%s: tensor '%s': unknown dtype '%s' (safetensors defines BOOL, U8, I8, I16, "
                  "U16, I32, U32, I64, U64, F16, BF16, F32, F64, C64 and the F4/F6/F8 variants)", path, nb,
                  shown(json_string_value(dt), db, sizeof(db)));
        return -1;
    }
    size_t nd = json_array_size(shape);
    if (nd > AM_ST_MAX_DIMS) {
        am_errorf(err, NULL, "%s: tensor '%s': %zu dimensions, more than the %d am reads", path, nb, nd,
                  AM_ST_MAX_DIMS);
        return -1;
    }
    t->ndim = (int)nd;
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(shape, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0) {
            am_errorf(err, NULL, "%s: tensor '%s': shape must be a list of non-negative integers "
                      "(the header is corrupt)", path, nb);
            return -1;
        }
        t->shape[i] = (int64_t)json_integer_value(d);
        overflow |= __builtin_mul_overflow(numel, (uint64_t)t->shape[i], &numel);
    }
    json_t *b = json_array_get(off, 0), *e = json_array_get(off, 1);
    if (json_array_size(off) != 2 || !json_is_integer(b) || !json_is_integer(e) || json_integer_value(b) < 0 ||
        json_integer_value(e) < 0) {
        am_errorf(err, NULL, "%s: tensor '%s': data_offsets must be [begin, end], two non-negative integers "
                  "(the header is corrupt)", path, nb);
        return -1;
    }
    t->begin = (uint64_t)json_integer_value(b);
    t->end = (uint64_t)json_integer_value(e);
    if (t->end < t->begin) {
        am_errorf(err, NULL, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] end before they begin "
                  "(the header is corrupt)", path, nb, t->begin, t->end);
        return -1;
    }
    uint64_t bits;
    char sb[160];
    if (overflow || numel > INT64_MAX || __builtin_mul_overflow(numel, (uint64_t)am_st_dtype_bits(t->dtype), &bits)) {
        am_errorf(err, NULL, "%s: tensor '%s': shape %s is too large (its size overflows 64 bits; the header "
                  "is corrupt)", path, nb, am_st_shape_str(t->shape, t->ndim, sb, sizeof(sb)));
        return -1;
    }
    if (bits % 8) {
        am_errorf(err, NULL, "%s: tensor '%s': shape %s of %s elements does not fill whole bytes", path, nb,
                  am_st_shape_str(t->shape, t->ndim, sb, sizeof(sb)), am_st_dtype_name(t->dtype));
        return -1;
    }
    t->numel = (int64_t)numel;
    if (bits / 8 != t->end - t->begin) {
        am_errorf(err, NULL, "%s: tensor '%s': dtype %s and shape %s need %" PRIu64 " bytes, but data_offsets "
                  "[%" PRIu64 ", %" PRIu64 "] hold %" PRIu64 " (the header does not match the data)", path, nb,
                  am_st_dtype_name(t->dtype), am_st_shape_str(t->shape, t->ndim, sb, sizeof(sb)), bits / 8,
                  t->begin, t->end, t->end - t->begin);
        return -1;
    }
    return 0;
}

/* Checks that the tensors (sorted by offsets) pack the data buffer exactly. */
static int check_layout(const char *path, struct am_st_info *t, size_t n, uint64_t buf_len, struct am_errors *err)
{
    char nb[160], pb[160];
    uint64_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i].begin < pos) {
            am_errorf(err, NULL, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] overlap tensor '%s' "
                      "[%" PRIu64 ", %" PRIu64 "] (tensors must not share bytes; the header is corrupt)", path,
                      shown(t[i].name, nb, sizeof(nb)), t[i].begin, t[i].end, shown(t[i - 1].name, pb, sizeof(pb)),
                      t[i - 1].begin, t[i - 1].end);
            return -1;
        }
        if (t[i].begin > pos) {
            if (i == 0)
                am_errorf(err, NULL, "%s: tensor '%s': data_offsets start at %" PRIu64 ", but the first tensor "
                          "must start at 0 (tensors are packed without gaps; the header is corrupt)", path,
                          shown(t[i].name, nb, sizeof(nb)), t[i].begin);
            else
                am_errorf(err, NULL, "%s: tensor '%s': data_offsets start at %" PRIu64 ", but the previous tensor "
                          "'%s' ends at %" PRIu64 " (tensors are packed without gaps; the header is corrupt)",
                          path, shown(t[i].name, nb, sizeof(nb)), t[i].begin, shown(t[i - 1].name, pb, sizeof(pb)),
                          pos);
            return -1;
        }
        if (t[i].end > buf_len) {
            am_errorf(err, NULL, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] run past the end of the "
                      "data (%" PRIu64 " bytes after the header): the file is truncated", path,
                      shown(t[i].name, nb, sizeof(nb)), t[i].begin, t[i].end, buf_len);
            return -1;
        }
        pos = t[i].end;
    }
    if (pos != buf_len) {
        am_errorf(err, NULL, "%s: %" PRIu64 " bytes follow the last tensor (the data is %" PRIu64 " bytes, the "
                  "tensors end at %" PRIu64 "); safetensors allows no trailing bytes: the file is corrupt", path,
                  buf_len - pos, buf_len, pos);
        return -1;
    }
    return 0;
}

static int parse_header(struct am_st_file *f, const char *path, uint64_t hlen, struct am_errors *err)
{
    json_error_t je;
    f->root = json_loadb((const char *)f->map + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!f->root) {
        if (strncmp(je.text, "duplicate object key", 20) == 0)
            am_errorf(err, NULL, "%s: the header names a tensor twice (%s); each name must be unique: the file "
                      "is corrupt", path, je.text);
        else
            am_errorf(err, NULL, "%s: the header is not valid JSON: %s (at byte %d of the header): the file is "
                      "corrupt or not a safetensors file", path, je.text, je.position);
        return -1;
    }
    if (!json_is_object(f->root)) {
        am_errorf(err, NULL, "%s: the header is not a JSON object: not a safetensors file", path);
        return -1;
    }
    size_t n = json_object_size(f->root);
    f->meta = json_object_get(f->root, "__metadata__");
    if (f->meta) {
        n--;
        const char *k;
        json_t *v;
        bool ok = json_is_object(f->meta);
        if (ok)
            json_object_foreach(f->meta, k, v) ok &= json_is_string(v);
        if (!ok) {
            am_errorf(err, NULL, "%s: __metadata__ must map strings to strings (the header is corrupt)", path);
            return -1;
        }
    }
    f->t = calloc(n ? n : 1, sizeof(*f->t));
    f->by_name = calloc(n ? n : 1, sizeof(*f->by_name));
    if (!f->t || !f->by_name) {
        am_errorf(err, NULL, "%s: out of memory for %zu tensors", path, n);
        return -1;
    }
    const char *key;
    json_t *v;
    json_object_foreach(f->root, key, v)
    {
        if (strcmp(key, "__metadata__") == 0)
            continue;
        if (parse_entry(path, key, v, &f->t[f->n], err) < 0)
            return -1;
        f->n++;
    }
    return 0;
}

int am_st_open(const char *path, struct am_st_file **out, struct am_errors *err)
{
    int rc = -1, fd = -1;
    *out = NULL;
    struct am_st_file *f = calloc(1, sizeof(*f));
    if (!f || !(f->path = strdup(path))) {
        am_errorf(err, NULL, "%s: out of memory", path);
        goto done;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0) {
        am_errorf(err, NULL, "%s: cannot open: %s", path, strerror(errno));
        goto done;
    }
    if (!S_ISREG(st.st_mode)) {
        am_errorf(err, NULL, "%s: not a regular file", path);
        goto done;
    }
    uint64_t size = (uint64_t)st.st_size;
    if (size < 8) {
        am_errorf(err, NULL, "%s: the file is %" PRIu64 " bytes, too short for the 8-byte header length "
                  "(truncated, or not a safetensors file)", path, size);
        goto done;
    }
    f->map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        am_errorf(err, NULL, "%s: cannot map %" PRIu64 " bytes: %s", path, size, strerror(errno));
        goto done;
    }
    f->map_len = (size_t)size;
    uint64_t hlen;
    memcpy(&hlen, f->map, 8);
    if (hlen > AM_ST_MAX_HEADER) {
        am_errorf(err, NULL, "%s: header length %" PRIu64 " is more than the %llu bytes safetensors allows "
                  "(corrupt, or not a safetensors file)", path, hlen, AM_ST_MAX_HEADER);
        goto done;
    }
    if (hlen > size - 8) {
        am_errorf(err, NULL, "%s: header length %" PRIu64 " runs past the end of the file (%" PRIu64 " bytes "
                  "follow the length): the file is truncated", path, hlen, size - 8);
        goto done;
    }
    if (parse_header(f, path, hlen, err) < 0)
        goto done;
    qsort(f->t, f->n, sizeof(*f->t), cmp_offsets);
    if (check_layout(path, f->t, f->n, size - 8 - hlen, err) < 0)
        goto done;
    for (size_t i = 0; i < f->n; i++) {
        f->t[i].data = f->map + 8 + hlen + f->t[i].begin;
        f->by_name[i] = &f->t[i];
    }
    qsort(f->by_name, f->n, sizeof(*f->by_name), cmp_names);
    *out = f;
    f = NULL;
    rc = 0;
done:
    if (fd >= 0)
        close(fd);
    am_st_close(f);
    return rc;
}

void am_st_close(struct am_st_file *f)
{
    if (!f)
        return;
    if (f->map)
        munmap(f->map, f->map_len);
    if (f->root)
        json_decref(f->root);
    free(f->t);
    free(f->by_name);
    free(f->path);
    free(f);
}

const char *am_st_path(const struct am_st_file *f) { return f->path; }
size_t am_st_count(const struct am_st_file *f) { return f->n; }
const struct am_st_info *am_st_at(const struct am_st_file *f, size_t i) { return i < f->n ? &f->t[i] : NULL; }

const struct am_st_info *am_st_find(const struct am_st_file *f, const char *name)
{
    struct am_st_info key = {.name = name}, *kp = &key;
    struct am_st_info **hit = bsearch(&kp, f->by_name, f->n, sizeof(*f->by_name), cmp_names);
    return hit ? *hit : NULL;
}

const char *am_st_meta(const struct am_st_file *f, const char *key)
{
    return f->meta ? json_string_value(json_object_get(f->meta, key)) : NULL;
}

int am_st_read_f32(const struct am_st_file *f, const struct am_st_info *t, int64_t first, int64_t count, float *dst,
                   struct am_errors *err)
{
    char nb[160];
    if (first < 0 || count < 0 || first > t->numel || count > t->numel - first) {
        am_errorf(err, NULL, "%s: tensor '%s': elements [%" PRId64 ", %" PRId64 ") are outside its %" PRId64
                  " elements", f->path, shown(t->name, nb, sizeof(nb)), first, first + count, t->numel);
        return -1;
    }
    const unsigned char *p = t->data;
    switch (t->dtype) {
    case AM_ST_F32:
        memcpy(dst, p + 4 * first, (size_t)count * 4);
        return 0;
    case AM_ST_BF16:
    case AM_ST_F16:
        p += 2 * first;
        for (int64_t i = 0; i < count; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = t->dtype == AM_ST_BF16 ? am_bf16_to_f32(h) : am_f16_to_f32(h);
        }
        return 0;
    case AM_ST_I32:
        p += 4 * first;
        for (int64_t i = 0; i < count; i++) {
            int32_t v;
            memcpy(&v, p + 4 * i, 4);
            dst[i] = (float)v;
        }
        return 0;
    case AM_ST_I64:
        p += 8 * first;
        for (int64_t i = 0; i < count; i++) {
            int64_t v;
            memcpy(&v, p + 8 * i, 8);
            dst[i] = (float)v;
        }
        return 0;
    default:
        am_errorf(err, NULL, "%s: tensor '%s': dtype %s is not one am converts (F32, BF16, F16, I32, I64)",
                  f->path, shown(t->name, nb, sizeof(nb)), am_st_dtype_name(t->dtype));
        return -1;
    }
}

/* ---- writing ----------------------------------------------------------------------------------- */

uint64_t am_st_wtensor_bytes(const struct am_st_wtensor *t, bool *ok)
{
    uint64_t n = (uint64_t)am_st_dtype_bits(t->dtype);
    *ok = (unsigned)t->dtype < AM_ST_NDTYPES && t->ndim >= 0 && t->ndim <= AM_ST_MAX_DIMS;
    for (int i = 0; *ok && i < t->ndim; i++)
        *ok = t->shape[i] >= 0 && !__builtin_mul_overflow(n, (uint64_t)t->shape[i], &n);
    *ok = *ok && n % 8 == 0;
    return *ok ? n / 8 : 0;
}

static int cmp_write_order(const void *a, const void *b)
{
    const struct am_st_wtensor *x = *(const struct am_st_wtensor *const *)a;
    const struct am_st_wtensor *y = *(const struct am_st_wtensor *const *)b;
    if (x->dtype != y->dtype)
        return x->dtype > y->dtype ? -1 : 1; /* largest alignment first, as the reference */
    return strcmp(x->name, y->name);
}

/* Builds the padded header for tensors in `order`. */
static char *build_header(const char *path, const struct am_st_wtensor *const *order, size_t n,
                          const struct am_st_kv *meta, size_t n_meta, uint64_t *hlen, struct am_errors *err)
{
    char *text = NULL, *out = NULL, nb[160];
    json_t *root = json_object(), *md = json_object();
    if (!root || !md || json_object_set_new(md, "format", json_string("pt")) < 0)
        goto oom;
    for (size_t i = 0; i < n_meta; i++)
        if (json_object_set_new(md, meta[i].key, json_string(meta[i].value)) < 0) {
            am_errorf(err, NULL, "%s: __metadata__ key '%s': keys and values must be valid UTF-8", path,
                      shown(meta[i].key, nb, sizeof(nb)));
            goto done;
        }
    json_object_set_new(root, "__metadata__", md);
    md = NULL;
    uint64_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        const struct am_st_wtensor *t = order[i];
        bool ok;
        uint64_t bytes = am_st_wtensor_bytes(t, &ok);
        if (!t->name || !ok || (!t->data && !t->fill)) {
            am_errorf(err, NULL, "%s: tensor '%s': invalid dtype, shape (at most %d non-negative sizes) or data",
                      path, t->name ? shown(t->name, nb, sizeof(nb)) : "(null)", AM_ST_MAX_DIMS);
            goto done;
        }
        if (strcmp(t->name, "__metadata__") == 0 || json_object_get(root, t->name)) {
            am_errorf(err, NULL, "%s: tensor '%s': the name is %s", path, shown(t->name, nb, sizeof(nb)),
                      strcmp(t->name, "__metadata__") == 0 ? "reserved" : "given twice");
            goto done;
        }
        json_t *info = json_object(), *shape = json_array(), *off = json_array();
        if (!info || !shape || !off) {
            json_decref(info);
            json_decref(shape);
            json_decref(off);
            goto oom;
        }
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->shape[d]));
        json_array_append_new(off, json_integer((json_int_t)pos));
        json_array_append_new(off, json_integer((json_int_t)(pos + bytes)));
        json_object_set_new(info, "dtype", json_string(am_st_dtype_name(t->dtype)));
        json_object_set_new(info, "shape", shape);
        json_object_set_new(info, "data_offsets", off);
        if (json_object_set_new(root, t->name, info) < 0) {
            am_errorf(err, NULL, "%s: tensor '%s': names must be valid UTF-8", path, shown(t->name, nb, sizeof(nb)));
            goto done;
        }
        pos += bytes;
    }
    text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    if (!text)
        goto oom;
    size_t len = strlen(text), padded = (len + 7) / 8 * 8;
    if (padded > AM_ST_MAX_HEADER) {
        am_errorf(err, NULL, "%s: the header would be %zu bytes, more than the %llu safetensors allows (use "
                  "fewer tensors per file)", path, padded, AM_ST_MAX_HEADER);
        goto done;
    }
    if (!(out = malloc(padded)))
        goto oom;
    memcpy(out, text, len);
    memset(out + len, ' ', padded - len);
    *hlen = padded;
    goto done;
oom:
    am_errorf(err, NULL, "%s: out of memory building the header", path);
done:
    free(text);
    json_decref(md);
    json_decref(root);
    return out;
}

int am_st_write(const char *path, const struct am_st_wtensor *t, size_t n, const struct am_st_kv *meta,
                size_t n_meta, size_t index_base, struct am_errors *err)
{
    int rc = -1, fd = -1;
    char tmp[4200] = "";
    char *header = NULL, *chunk = NULL;
    const struct am_st_wtensor **order = calloc(n ? n : 1, sizeof(*order));
    if (!order) {
        am_errorf(err, NULL, "%s: out of memory", path);
        goto done;
    }
    for (size_t i = 0; i < n; i++)
        order[i] = &t[i];
    qsort(order, n, sizeof(*order), cmp_write_order);
    uint64_t hlen = 0;
    if (!(header = build_header(path, order, n, meta, n_meta, &hlen, err)))
        goto done;
    if ((fd = am_open_temp(path, tmp, sizeof(tmp))) < 0) {
        am_errorf(err, NULL, "%s: cannot create a temporary file beside it: %s (is the directory writable?)", path,
                  strerror(errno));
        tmp[0] = '\0';
        goto done;
    }
    if (write_all(fd, &hlen, 8) < 0 || write_all(fd, header, (size_t)hlen) < 0)
        goto write_error;
    for (size_t i = 0; i < n; i++) {
        bool ok;
        uint64_t bytes = am_st_wtensor_bytes(order[i], &ok);
        if (order[i]->data) {
            if (write_all(fd, order[i]->data, (size_t)bytes) < 0)
                goto write_error;
            continue;
        }
        const size_t CHUNK = 1u << 20;
        if (!chunk && !(chunk = malloc(CHUNK))) {
            am_errorf(err, NULL, "%s: out of memory", path);
            goto done;
        }
        for (uint64_t off = 0; off < bytes; off += CHUNK) {
            size_t len = bytes - off < CHUNK ? (size_t)(bytes - off) : CHUNK;
            if (order[i]->fill(order[i]->ctx, index_base + (size_t)(order[i] - t), off, chunk, len, err) < 0)
                goto done;
            if (write_all(fd, chunk, len) < 0)
                goto write_error;
        }
    }
    if (fsync(fd) < 0)
        goto write_error;
    if (close(fd) < 0) {
        fd = -1;
        goto write_error;
    }
    fd = -1;
    if (rename(tmp, path) < 0) {
        am_errorf(err, NULL, "%s: cannot rename the finished temporary file into place: %s", path, strerror(errno));
        goto done;
    }
    tmp[0] = '\0';
    if (am_fsync_dir_of(path, false) < 0) {
        am_errorf(err, NULL, "%s: written, but syncing its directory failed: %s (the file may not survive a "
                  "crash)", path, strerror(errno));
        goto done;
    }
    rc = 0;
    goto done;
write_error:
    am_errorf(err, NULL, "%s: writing failed: %s (is the disk full?); the previous file, if any, is untouched",
              path, strerror(errno));
done:
    if (fd >= 0)
        close(fd);
    if (tmp[0])
        unlink(tmp);
    free(chunk);
    free(header);
    free(order);
    return rc;
}
