/* shard_ckpt.c - sharded training checkpoints (shard_ckpt.h). */
#include "shard_ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "util.h"

void am_sckpt_hash_text(const char *text, char out[17])
{
    uint64_t h = 1469598103934665603ull;
    for (const unsigned char *p = (const unsigned char *)text; *p; p++)
        h = (h ^ *p) * 1099511628211ull;
    snprintf(out, 17, "%016" PRIx64, h);
}

const char *am_sckpt_phase_name(enum am_sckpt_phase p)
{
    static const char *const names[] = {"shard", "written", "manifest", "commit", "latest"};
    return p < AM_SCKPT_N_PHASES ? names[p] : "?";
}

/* ---- files -------------------------------------------------------------------------------------- */

void am_sckpt_tmp_dir(const char *root, long step, const char *tag, char *out, size_t len)
{
    snprintf(out, len, "%s/step-%ld.tmp-%s", root, step, tag);
}

void am_sckpt_step_dir(const char *root, long step, char *out, size_t len)
{
    snprintf(out, len, "%s/step-%ld", root, step);
}

static int fsync_path(const char *path, bool dir)
{
    int fd = open(path, (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* A whole file written and fsynced (the caller renames or commits it). */
static int write_file_sync(const char *path, const char *text, char *err, size_t err_len)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return am_fail(err, err_len, "checkpoint: cannot create %s: %s", path, strerror(errno));
    if (write_all(fd, text, strlen(text)) < 0 || fsync(fd) < 0) {
        int e = errno;
        close(fd);
        return am_fail(err, err_len, "checkpoint: cannot write %s: %s", path, strerror(e));
    }
    close(fd);
    return 0;
}

int am_sckpt_begin(const char *root, long step, const char *tag, char *err, size_t err_len)
{
    char tmp[4096];
    if (am_mkdir_p(root) < 0)
        return am_fail(err, err_len, "checkpoint.checkpoint_dir: cannot create %s: %s", root, strerror(errno));
    am_sckpt_tmp_dir(root, step, tag, tmp, sizeof(tmp));
    am_remove_tree(tmp);
    if (mkdir(tmp, 0755) < 0)
        return am_fail(err, err_len, "checkpoint: cannot create %s: %s", tmp, strerror(errno));
    return 0;
}

int am_sckpt_write_rank(const char *tmp_dir, int rank, const float *const sections[AM_SCKPT_SECTIONS], int64_t elems,
                        const struct am_sckpt_piece *pieces, size_t n_pieces, am_sckpt_phase_fn hook, void *hook_arg,
                        char *err, size_t err_len)
{
    char path[4200], name[64];
    snprintf(name, sizeof(name), "rank-%05d.bin", rank);
    snprintf(path, sizeof(path), "%s/%s", tmp_dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return am_fail(err, err_len, "checkpoint: cannot create %s: %s", path, strerror(errno));
    uint32_t crc = 0;
    size_t bytes = (size_t)elems * sizeof(float);
    for (int s = 0; s < AM_SCKPT_SECTIONS; s++) {
        if (write_all(fd, sections[s], bytes) < 0) {
            int e = errno;
            close(fd);
            return am_fail(err, err_len, "checkpoint: cannot write %s: %s", path, strerror(e));
        }
        crc = am_crc32c(crc, sections[s], bytes);
        if (s == 1 && hook)
            hook(hook_arg, AM_SCKPT_PHASE_SHARD);
    }
    if (fsync(fd) < 0) {
        int e = errno;
        close(fd);
        return am_fail(err, err_len, "checkpoint: cannot fsync %s: %s", path, strerror(e));
    }
    close(fd);
    json_t *ps = json_array();
    for (size_t i = 0; i < n_pieces; i++) {
        const struct am_sckpt_piece *p = &pieces[i];
        json_array_append_new(ps, json_pack("[s,I,I,I,I,I,I,I]", p->name, (json_int_t)p->full_rows,
                                            (json_int_t)p->full_cols, (json_int_t)p->offset, (json_int_t)p->row0,
                                            (json_int_t)p->rows, (json_int_t)p->col0, (json_int_t)p->cols));
    }
    json_t *o = json_pack("{s:i,s:s,s:I,s:I,s:I,s:o}", "rank", rank, "name", name, "bytes",
                          (json_int_t)(bytes * AM_SCKPT_SECTIONS), "elems", (json_int_t)elems, "crc32c",
                          (json_int_t)crc, "pieces", ps);
    char *text = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!text)
        return am_fail(err, err_len, "checkpoint: out of memory for the list of rank %d", rank);
    snprintf(path, sizeof(path), "%s/rank-%05d.json", tmp_dir, rank);
    int rc = write_file_sync(path, text, err, err_len);
    free(text);
    if (rc == 0 && hook)
        hook(hook_arg, AM_SCKPT_PHASE_WRITTEN);
    return rc;
}

int am_sckpt_write_text(const char *dir, const char *name, const char *text, char *err, size_t err_len)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return write_file_sync(path, text, err, err_len);
}

/* ---- commit ------------------------------------------------------------------------------------- */

/* Parses "step-N" (exactly); -1 otherwise. */
static long step_of(const char *name)
{
    if (strncmp(name, "step-", 5) != 0 || !name[5])
        return -1;
    char *end;
    errno = 0;
    long s = strtol(name + 5, &end, 10);
    return *end || errno || s < 0 ? -1 : s;
}

static int cmp_long_desc(const void *a, const void *b)
{
    long x = *(const long *)a, y = *(const long *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Removes complete checkpoints beyond the newest keep_last (never `keep`) and any temporary
 * directory of an unfinished save. */
static void prune(const char *root, long keep_last, long keep)
{
    DIR *d = opendir(root);
    if (!d)
        return;
    long *steps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    char path[4200];
    while ((e = readdir(d))) {
        long s = step_of(e->d_name);
        if (s >= 0) {
            if (n == cap) {
                cap = cap ? 2 * cap : 16;
                long *ns = realloc(steps, cap * sizeof(long));
                if (!ns)
                    break;
                steps = ns;
            }
            steps[n++] = s;
        } else if (strncmp(e->d_name, "step-", 5) == 0 && strstr(e->d_name, ".tmp-")) {
            snprintf(path, sizeof(path), "%s/%s", root, e->d_name);
            am_remove_tree(path);
        }
    }
    closedir(d);
    if (keep_last > 0 && n > (size_t)keep_last) {
        qsort(steps, n, sizeof(long), cmp_long_desc);
        for (size_t i = (size_t)keep_last; i < n; i++)
            if (steps[i] != keep) {
                am_sckpt_step_dir(root, steps[i], path, sizeof(path));
                am_remove_tree(path);
            }
    }
    free(steps);
}

/* The rank lists merged into the manifest's "files" and "tensors". */
static int merge_ranks(const char *tmp, const int *ranks, int n_ranks, json_t *files, json_t *tensors, char *err,
                       size_t err_len)
{
    char path[4200];
    for (int i = 0; i < n_ranks; i++) {
        snprintf(path, sizeof(path), "%s/rank-%05d.json", tmp, ranks[i]);
        json_error_t je;
        json_t *o = json_load_file(path, 0, &je);
        json_t *ps = o ? json_object_get(o, "pieces") : NULL;
        if (!json_is_array(ps)) {
            json_decref(o);
            return am_fail(err, err_len, "checkpoint: %s: unreadable (%s)", path, je.text);
        }
        json_array_append_new(files, json_pack("{s:O,s:O,s:O,s:O}", "name", json_object_get(o, "name"), "bytes",
                                               json_object_get(o, "bytes"), "elems", json_object_get(o, "elems"),
                                               "crc32c", json_object_get(o, "crc32c")));
        size_t k;
        json_t *p;
        json_array_foreach(ps, k, p) {
            const char *name = json_string_value(json_array_get(p, 0));
            json_int_t fr = json_integer_value(json_array_get(p, 1)), fc = json_integer_value(json_array_get(p, 2));
            json_t *t = json_object_get(tensors, name);
            if (!t) {
                t = fc > 0 ? json_pack("{s:[I,I],s:[]}", "shape", fr, fc, "pieces")
                           : json_pack("{s:[I],s:[]}", "shape", fr, "pieces");
                json_object_set_new(tensors, name, t);
            } else if (json_integer_value(json_array_get(json_object_get(t, "shape"), 0)) != fr ||
                       json_integer_value(json_array_get(json_object_get(t, "shape"), 1)) != fc) {
                json_decref(o);
                return am_fail(err, err_len, "checkpoint: rank %d holds %s as a %lld x %lld tensor, another rank as "
                               "%lld x %lld", ranks[i], name, (long long)fr, (long long)fc,
                               (long long)json_integer_value(json_array_get(json_object_get(t, "shape"), 0)),
                               (long long)json_integer_value(json_array_get(json_object_get(t, "shape"), 1)));
            }
            json_array_append_new(json_object_get(t, "pieces"),
                                  json_pack("[i,O,O,O,O,O]", i, json_array_get(p, 3), json_array_get(p, 4),
                                            json_array_get(p, 5), json_array_get(p, 6), json_array_get(p, 7)));
        }
        json_decref(o);
        unlink(path);
    }
    return 0;
}

int am_sckpt_commit(const char *root, long step, const char *tag, const int *ranks, int n_ranks, json_t *meta,
                    const char *model_hash, long keep_last, am_sckpt_phase_fn hook, void *hook_arg, bool *already,
                    char *err, size_t err_len)
{
    char tmp[4096], dir[4096], path[4200];
    am_sckpt_tmp_dir(root, step, tag, tmp, sizeof(tmp));
    am_sckpt_step_dir(root, step, dir, sizeof(dir));
    *already = false;
    json_t *files = json_array(), *tensors = json_object();
    json_t *man = json_pack("{s:s,s:i,s:I,s:f,s:s,s:o,s:o,s:o}", "format", AM_SCKPT_FORMAT, "version",
                            AM_SCKPT_VERSION, "step", (json_int_t)step, "time", (double)time(NULL), "model_hash",
                            model_hash, "meta", meta ? meta : json_object(), "files", files, "tensors", tensors);
    if (!man)
        return am_fail(err, err_len, "checkpoint: out of memory for the manifest");
    if (merge_ranks(tmp, ranks, n_ranks, files, tensors, err, err_len) < 0) {
        json_decref(man);
        return -1;
    }
    char *text = json_dumps(man, JSON_INDENT(1) | JSON_SORT_KEYS);
    json_decref(man);
    if (!text)
        return am_fail(err, err_len, "checkpoint: out of memory for the manifest");
    snprintf(path, sizeof(path), "%s/manifest.json", tmp);
    int rc = write_file_sync(path, text, err, err_len);
    free(text);
    if (rc < 0)
        return -1;
    if (fsync_path(tmp, true) < 0)
        return am_fail(err, err_len, "checkpoint: cannot fsync %s: %s", tmp, strerror(errno));
    if (hook)
        hook(hook_arg, AM_SCKPT_PHASE_MANIFEST);
    struct stat st;
    if (stat(dir, &st) == 0) {
        /* saved before (by the killed run this one resumes, or by a run restored from an older
         * checkpoint): swapped in one rename for the new one; where the filesystem cannot swap,
         * the complete one that is there is kept */
        *already = true;
        if (renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_EXCHANGE) == 0)
            *already = false;
        am_remove_tree(tmp);
    } else if (rename(tmp, dir) < 0) {
        return am_fail(err, err_len, "checkpoint: cannot rename %s to %s: %s", tmp, dir, strerror(errno));
    }
    if (fsync_path(root, true) < 0)
        return am_fail(err, err_len, "checkpoint: cannot fsync %s: %s", root, strerror(errno));
    if (hook)
        hook(hook_arg, AM_SCKPT_PHASE_COMMIT);
    char latest_tmp[4200], latest[4200], line[64];
    snprintf(latest_tmp, sizeof(latest_tmp), "%s/latest.tmp-%s", root, tag);
    snprintf(latest, sizeof(latest), "%s/latest", root);
    snprintf(line, sizeof(line), "step-%ld\n", step);
    if (write_file_sync(latest_tmp, line, err, err_len) < 0)
        return -1;
    if (rename(latest_tmp, latest) < 0 || fsync_path(root, true) < 0)
        return am_fail(err, err_len, "checkpoint: cannot update %s: %s", latest, strerror(errno));
    if (hook)
        hook(hook_arg, AM_SCKPT_PHASE_LATEST);
    prune(root, keep_last, step);
    return 0;
}

/* ---- reading ------------------------------------------------------------------------------------ */

int am_sckpt_resolve(const char *root, const char *restore_from, char *out, size_t len, bool *found, char *err,
                     size_t err_len)
{
    char path[4200], *buf = NULL;
    size_t n;
    struct stat st;
    const char *dir = restore_from;
    *found = false;
    bool named_latest = strcmp(restore_from, "latest") == 0 || strcmp(restore_from, "LATEST") == 0;
    if (named_latest)
        dir = root;
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    if (!named_latest && stat(path, &st) == 0) {
        snprintf(out, len, "%s", dir);
        *found = true;
        return 0;
    }
    snprintf(path, sizeof(path), "%s/latest", dir);
    if (named_latest && lstat(path, &st) < 0 && errno == ENOENT)
        return 0; /* nothing saved yet */
    const char *why = am_read_file(path, 4096, &buf, &n);
    if (why) {
        return am_fail(err, err_len, "checkpoint.restore_from: %s: no checkpoint there (%s has no manifest.json, and "
                       "%s: %s): name a step-N directory, a checkpoint_dir holding `latest`, or `latest`",
                       restore_from, dir, path, why);
    }
    buf[strcspn(buf, "\n")] = '\0';
    if (step_of(buf) < 0) {
        am_fail(err, err_len, "checkpoint.restore_from: %s: `latest` says \"%.64s\", not step-N", path, buf);
        free(buf);
        return -1;
    }
    snprintf(out, len, "%s/%s", dir, buf);
    free(buf);
    *found = true;
    return 0;
}

struct piece {
    int file;
    int64_t offset, row0, rows, col0, cols;
};

struct tensor {
    const char *name;
    int ndim;
    int64_t rows, cols;
    struct piece *pieces;
    size_t n_pieces;
};

struct file {
    char name[64];
    int64_t bytes, elems;
    uint32_t crc;
    const float *map; /* NULL until needed */
    bool checked;
};

struct am_sckpt {
    char dir[4096];
    json_t *man;
    long step;
    struct file *files;
    size_t n_files;
    struct tensor *tensors;
    size_t n_tensors;
};

static int bad(struct am_sckpt *c, char *err, size_t err_len, const char *what)
{
    am_fail(err, err_len, "checkpoint %s: manifest.json: %s (the manifest is damaged or not am's: restore from "
            "another checkpoint)", c->dir, what);
    am_sckpt_close(c);
    return -1;
}

int am_sckpt_open(const char *dir, struct am_sckpt **out, char *err, size_t err_len)
{
    struct am_sckpt *c = calloc(1, sizeof(*c));
    char path[4200], what[512];
    if (!c)
        return am_fail(err, err_len, "checkpoint %s: out of memory", dir);
    snprintf(c->dir, sizeof(c->dir), "%s", dir);
    snprintf(path, sizeof(path), "%s/manifest.json", dir);
    json_error_t je;
    c->man = json_load_file(path, 0, &je);
    if (!c->man) {
        snprintf(what, sizeof(what), "cannot be read: %s (line %d)", je.text, je.line);
        return bad(c, err, err_len, what);
    }
    const char *fmt = json_string_value(json_object_get(c->man, "format"));
    if (!fmt || strcmp(fmt, AM_SCKPT_FORMAT) != 0)
        return bad(c, err, err_len, "\"format\" is not \"" AM_SCKPT_FORMAT "\"");
    if (json_integer_value(json_object_get(c->man, "version")) != AM_SCKPT_VERSION) {
        snprintf(what, sizeof(what), "version %lld, this am reads version %d",
                 (long long)json_integer_value(json_object_get(c->man, "version")), AM_SCKPT_VERSION);
        return bad(c, err, err_len, what);
    }
    c->step = (long)json_integer_value(json_object_get(c->man, "step"));
    json_t *files = json_object_get(c->man, "files"), *tensors = json_object_get(c->man, "tensors");
    if (!json_is_array(files) || !json_is_object(tensors) || !json_is_string(json_object_get(c->man, "model_hash")))
        return bad(c, err, err_len, "\"files\", \"tensors\" or \"model_hash\" missing");
    c->n_files = json_array_size(files);
    c->files = calloc(c->n_files + 1, sizeof(*c->files));
    c->n_tensors = json_object_size(tensors);
    c->tensors = calloc(c->n_tensors + 1, sizeof(*c->tensors));
    if (!c->files || !c->tensors)
        return bad(c, err, err_len, "out of memory");
    for (size_t i = 0; i < c->n_files; i++) {
        json_t *f = json_array_get(files, i);
        const char *name = json_string_value(json_object_get(f, "name"));
        if (!name || strchr(name, '/') || strlen(name) >= sizeof(c->files[i].name))
            return bad(c, err, err_len, "a file without a plain name");
        snprintf(c->files[i].name, sizeof(c->files[i].name), "%s", name);
        c->files[i].bytes = json_integer_value(json_object_get(f, "bytes"));
        c->files[i].elems = json_integer_value(json_object_get(f, "elems"));
        c->files[i].crc = (uint32_t)json_integer_value(json_object_get(f, "crc32c"));
        if (c->files[i].elems < 0 || c->files[i].bytes != c->files[i].elems * (int64_t)sizeof(float) * AM_SCKPT_SECTIONS)
            return bad(c, err, err_len, "a file whose size is not three sections of its elements");
    }
    const char *key;
    json_t *t;
    size_t ti = 0;
    json_object_foreach(tensors, key, t) {
        struct tensor *T = &c->tensors[ti++];
        json_t *shape = json_object_get(t, "shape"), *ps = json_object_get(t, "pieces");
        T->name = key;
        T->ndim = (int)json_array_size(shape);
        T->rows = json_integer_value(json_array_get(shape, 0));
        T->cols = T->ndim == 2 ? json_integer_value(json_array_get(shape, 1)) : 1;
        if (T->ndim < 1 || T->ndim > 2 || T->rows < 0 || T->cols < 0) {
            snprintf(what, sizeof(what), "tensor %s: \"shape\" is not [rows] or [rows, cols]", key);
            return bad(c, err, err_len, what);
        }
        T->n_pieces = json_array_size(ps);
        T->pieces = calloc(T->n_pieces + 1, sizeof(*T->pieces));
        if (!T->pieces)
            return bad(c, err, err_len, "out of memory");
        for (size_t k = 0; k < T->n_pieces; k++) {
            json_t *p = json_array_get(ps, k);
            struct piece *P = &T->pieces[k];
            P->file = (int)json_integer_value(json_array_get(p, 0));
            P->offset = json_integer_value(json_array_get(p, 1));
            P->row0 = json_integer_value(json_array_get(p, 2));
            P->rows = json_integer_value(json_array_get(p, 3));
            P->col0 = json_integer_value(json_array_get(p, 4));
            P->cols = json_integer_value(json_array_get(p, 5));
            if (P->file < 0 || (size_t)P->file >= c->n_files || P->row0 < 0 || P->col0 < 0 || P->rows < 0 ||
                P->cols < 0 || P->row0 + P->rows > T->rows || P->col0 + P->cols > T->cols || P->offset < 0 ||
                P->offset + P->rows * P->cols > c->files[P->file].elems) {
                snprintf(what, sizeof(what), "a piece of %s lies outside the tensor or its file", key);
                return bad(c, err, err_len, what);
            }
        }
    }
    *out = c;
    return 0;
}

void am_sckpt_close(struct am_sckpt *c)
{
    if (!c)
        return;
    for (size_t i = 0; c->files && i < c->n_files; i++)
        if (c->files[i].map)
            munmap((void *)c->files[i].map, (size_t)c->files[i].bytes);
    for (size_t i = 0; c->tensors && i < c->n_tensors; i++)
        free(c->tensors[i].pieces);
    free(c->files);
    free(c->tensors);
    json_decref(c->man);
    free(c);
}

const char *am_sckpt_dir(const struct am_sckpt *c) { return c->dir; }
long am_sckpt_step(const struct am_sckpt *c) { return c->step; }
const char *am_sckpt_model_hash(const struct am_sckpt *c)
{
    return json_string_value(json_object_get(c->man, "model_hash"));
}
json_t *am_sckpt_meta(const struct am_sckpt *c) { return json_object_get(c->man, "meta"); }
json_t *am_sckpt_json(const struct am_sckpt *c) { return c->man; }
size_t am_sckpt_n_tensors(const struct am_sckpt *c) { return c->n_tensors; }

void am_sckpt_tensor(const struct am_sckpt *c, size_t i, struct am_sckpt_tensor_info *out)
{
    const struct tensor *T = &c->tensors[i];
    *out = (struct am_sckpt_tensor_info){T->name, T->ndim, T->rows, T->cols, T->n_pieces};
}

int am_sckpt_find(const struct am_sckpt *c, const char *name)
{
    for (size_t i = 0; i < c->n_tensors; i++)
        if (strcmp(c->tensors[i].name, name) == 0)
            return (int)i;
    return -1;
}

/* Maps file i and checks its size and checksum (once). */
static int load_file(struct am_sckpt *c, size_t i, char *err, size_t err_len)
{
    struct file *f = &c->files[i];
    char path[4200];
    if (f->checked)
        return 0;
    snprintf(path, sizeof(path), "%s/%s", c->dir, f->name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0)
        return am_fail(err, err_len, "checkpoint %s: shard %s: %s (the checkpoint is incomplete: restore from "
                       "another one)", c->dir, f->name, strerror(errno));
    if (fstat(fd, &st) < 0 || st.st_size != f->bytes) {
        close(fd);
        return am_fail(err, err_len, "checkpoint %s: shard %s is %lld bytes, the manifest says %lld (truncated or "
                       "damaged: restore from another checkpoint)", c->dir, f->name, (long long)st.st_size,
                       (long long)f->bytes);
    }
    if (f->bytes > 0) {
        void *m = mmap(NULL, (size_t)f->bytes, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            int e = errno;
            close(fd);
            return am_fail(err, err_len, "checkpoint %s: cannot map %s: %s", c->dir, f->name, strerror(e));
        }
        f->map = m;
    }
    close(fd);
    uint32_t crc = f->bytes > 0 ? am_crc32c(0, f->map, (size_t)f->bytes) : 0;
    if (crc != f->crc)
        return am_fail(err, err_len, "checkpoint %s: shard %s: crc32c %08x, the manifest says %08x (the file is "
                       "damaged: restore from another checkpoint)", c->dir, f->name, crc, f->crc);
    f->checked = true;
    return 0;
}

int am_sckpt_verify(struct am_sckpt *c, char *err, size_t err_len)
{
    for (size_t i = 0; i < c->n_files; i++)
        if (load_file(c, i, err, err_len) < 0)
            return -1;
    return 0;
}

int am_sckpt_read(struct am_sckpt *c, size_t i, int section, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                  float *dst, int64_t ld, unsigned char *mask, char *err, size_t err_len)
{
    const struct tensor *T = &c->tensors[i];
    for (size_t k = 0; k < T->n_pieces; k++) {
        const struct piece *P = &T->pieces[k];
        int64_t r0 = row0 > P->row0 ? row0 : P->row0, r1 = row0 + rows < P->row0 + P->rows ? row0 + rows
                                                                                           : P->row0 + P->rows;
        int64_t c0 = col0 > P->col0 ? col0 : P->col0, c1 = col0 + cols < P->col0 + P->cols ? col0 + cols
                                                                                           : P->col0 + P->cols;
        if (r0 >= r1 || c0 >= c1)
            continue;
        if (load_file(c, (size_t)P->file, err, err_len) < 0)
            return -1;
        const float *sec = c->files[P->file].map + (size_t)section * (size_t)c->files[P->file].elems;
        for (int64_t r = r0; r < r1; r++) {
            const float *src = sec + P->offset + (r - P->row0) * P->cols + (c0 - P->col0);
            int64_t d = (r - row0) * ld + (c0 - col0);
            memcpy(dst + d, src, (size_t)(c1 - c0) * sizeof(float));
            if (mask)
                memset(mask + d, 1, (size_t)(c1 - c0));
        }
    }
    return 0;
}
