/* testio.h - helpers shared by the checkpoint and dataset tests: scratch directories, whole
 * files, and exact error messages. */
#ifndef AM_TESTIO_H
#define AM_TESTIO_H

#include <dirent.h>
#include <ftw.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "errors.h"

/* A fresh directory under $TMPDIR (or /tmp), removed by rm_tree. */
static inline char *scratch_dir(void)
{
    const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    size_t len = strlen(base) + 32;
    char *p = malloc(len);
    if (!p)
        abort();
    snprintf(p, len, "%s/am-io-test-XXXXXX", base);
    assert_non_null(mkdtemp(p));
    return p;
}

static inline int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    chmod(path, 0700);
    remove(path);
    return 0;
}

static inline void rm_tree(char *dir)
{
    nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(dir);
}

/* A formatted string in a static ring of buffers: enough for the paths one statement uses,
 * including nested calls (fixture() and srcpath() take two each). */
static inline const char *pathf(const char *fmt, ...)
{
    static char ring[32][4096];
    static int next;
    char *b = ring[next++ % 32];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, 4096, fmt, ap);
    va_end(ap);
    return b;
}

static inline unsigned char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

static inline void spit(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        fail_msg("cannot create %s", path);
    assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* Asserts err holds exactly one message, equal to the formatted text, and clears it. */
static inline void expect_error(struct am_errors *err, const char *fmt, ...)
{
    char want[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(want, sizeof(want), fmt, ap);
    va_end(ap);
    if (err->n != 1 || strcmp(err->msg[0], want) != 0) {
        print_error("expected the message:\n  %s\ngot %zu:\n", want, err->n);
        for (size_t i = 0; i < err->n; i++)
            print_error("  %s\n", err->msg[i]);
        fail();
    }
    am_errors_free(err);
    am_errors_init(err);
}

static inline void expect_no_error(struct am_errors *err)
{
    for (size_t i = 0; i < err->n; i++)
        print_error("unexpected: %s\n", err->msg[i]);
    assert_int_equal(err->n, 0);
}

/* The entries of a directory (without . and ..) whose name contains `part`. */
static inline int count_entries(const char *dir, const char *part)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 && strstr(e->d_name, part) != NULL;
    closedir(d);
    return n;
}

/* $AM_SRCDIR/REL (the tests run from the build tree). */
static inline const char *srcpath(const char *rel)
{
    const char *src = getenv("AM_SRCDIR") ? getenv("AM_SRCDIR") : ".";
    return pathf("%s/%s", src, rel);
}

#endif
