/* util.c - helpers behind util.h. */
#include "util.h"

#include <stdarg.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

const char *am_read_file(const char *path, size_t max, char **buf, size_t *len)
{
    static __thread char why[160];
    *buf = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) {
        snprintf(why, sizeof(why), "cannot open: %s", strerror(errno));
        return why;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        snprintf(why, sizeof(why), "cannot stat: %s", strerror(errno));
        close(fd);
        return why;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return S_ISDIR(st.st_mode) ? "is a directory, not a file" : "is not a regular file";
    }
    if ((size_t)st.st_size > max) {
        snprintf(why, sizeof(why), "is %lld bytes, more than the %zu accepted (is this the right file?)",
                 (long long)st.st_size, max);
        close(fd);
        return why;
    }
    char *b = malloc((size_t)st.st_size + 1);
    if (!b) {
        close(fd);
        return "out of memory";
    }
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t r = read(fd, b + got, (size_t)st.st_size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            snprintf(why, sizeof(why), "read failed: %s", r < 0 ? strerror(errno) : "file shrank");
            free(b);
            close(fd);
            return why;
        }
        got += (size_t)r;
    }
    close(fd);
    b[got] = '\0';
    *buf = b;
    *len = got;
    return NULL;
}

int am_mkdir_p(const char *path)
{
    char buf[4096];
    if (snprintf(buf, sizeof(buf), "%s", path) >= (int)sizeof(buf)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        int rc = mkdir(buf, 0755);
        *p = '/';
        if (rc < 0 && errno != EEXIST)
            return -1;
    }
    return mkdir(buf, 0755) < 0 && errno != EEXIST ? -1 : 0;
}

int am_copy_file(const char *from, const char *to, unsigned mode)
{
    int in = open(from, O_RDONLY | O_CLOEXEC), out = -1, rc = -1;
    char buf[65536];
    if (in < 0 || (out = open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, (mode_t)mode)) < 0)
        goto done;
    for (;;) {
        ssize_t r = read(in, buf, sizeof(buf));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            goto done;
        if (r == 0)
            break;
        for (ssize_t off = 0; off < r;) {
            ssize_t w = write(out, buf + off, (size_t)(r - off));
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                goto done;
            off += w;
        }
    }
    rc = fsync(out);
done:
    if (in >= 0)
        close(in);
    if (out >= 0 && close(out) < 0)
        rc = -1;
    return rc;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    if (flag == FTW_DP)
        rmdir(path);
    else
        unlink(path);
    return 0;
}

void am_remove_tree(const char *path) { nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

int am_path_cat(char *buf, size_t len, const char *a, const char *sep, const char *b)
{
    size_t la = strlen(a), ls = strlen(sep), lb = strlen(b);
    if (la + ls + lb + 1 > len) {
        if (len)
            buf[0] = '\0';
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(buf, a, la);
    memcpy(buf + la, sep, ls);
    memcpy(buf + la + ls, b, lb + 1);
    return 0;
}

int am_fsync_dir_of(const char *path, bool is_dir)
{
    char dir[4096];
    const char *slash = is_dir ? NULL : strrchr(path, '/');
    size_t n = is_dir ? strlen(path) : !slash ? 0 : slash == path ? 1 : (size_t)(slash - path);
    if (n >= sizeof(dir)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    if (!is_dir && !slash)
        memcpy(dir, ".", 2);
    else {
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    int saved = errno;
    close(fd);
    errno = saved;
    return rc;
}

int am_open_temp(const char *path, char *tmp, size_t len)
{
    for (int attempt = 0; attempt < 100; attempt++) {
        uint32_t r;
        if (getrandom(&r, sizeof(r), GRND_NONBLOCK) != (ssize_t)sizeof(r)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            r = (uint32_t)ts.tv_nsec ^ ((uint32_t)getpid() << 12) ^ ((uint32_t)attempt * 2654435761u);
        }
        char suffix[16];
        snprintf(suffix, sizeof(suffix), ".tmp-%06x", (unsigned)(r & 0xffffff));
        if (am_path_cat(tmp, len, path, suffix, "") < 0)
            return -1;
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0 || errno != EEXIST)
            return fd;
    }
    errno = EEXIST;
    return -1;
}

int am_temp_dir(const char *path, char *tmp, size_t len, struct am_errors *err)
{
    if (am_path_cat(tmp, len, path, ".tmp-XXXXXX", "") < 0 || !mkdtemp(tmp)) {
        am_errorf(err, NULL, "%s: cannot create the temporary directory %s.tmp-XXXXXX: %s (is the parent directory "
                  "writable?)", path, path, strerror(errno));
        tmp[0] = '\0';
        return -1;
    }
    chmod(tmp, 0755); /* mkdtemp makes it 0700 */
    return 0;
}

bool am_key_in(const char *key, const char *const *names)
{
    for (; names && *names; names++)
        if (strcmp(key, *names) == 0)
            return true;
    return false;
}

int am_edit_distance(const char *a, const char *b, int cap)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63)
        return cap + 1;
    int row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int prev = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int cur = row[j];
            int sub = prev + (a[i - 1] != b[j - 1]);
            int best = row[j] + 1 < row[j - 1] + 1 ? row[j] + 1 : row[j - 1] + 1;
            row[j] = sub < best ? sub : best;
            prev = cur;
        }
    }
    return row[lb] > cap ? cap + 1 : row[lb];
}

static void closest(const char *key, const char *const *names, const char **best, int *best_d)
{
    for (; names && *names; names++) {
        int d = am_edit_distance(key, *names, 3);
        if (d < *best_d) {
            *best_d = d;
            *best = *names;
        }
    }
}

void am_error_unknown_key(struct am_errors *err, const struct am_pos *pos, const char *section,
                          const char *key, const char *const *known, const char *const *also)
{
    const char *best = NULL;
    int d = 4;
    closest(key, known, &best, &d);
    closest(key, also, &best, &d);
    char shown[48];
    size_t i = 0;
    for (; key[i] && i < 40; i++)
        shown[i] = (key[i] >= 0x20 && key[i] < 0x7f) ? key[i] : '?';
    shown[i] = '\0';
    if (best && d <= (strlen(key) > 4 ? 3 : 1))
        am_errorf(err, pos, "%s%s%s: unknown key (did you mean %s?)", section, *section ? "." : "", shown, best);
    else
        am_errorf(err, pos, "%s%s%s: unknown key (docs/recipes.md lists the keys of %s)", section,
                  *section ? "." : "", shown, *section ? section : "a recipe");
}

int am_fail(char *err, size_t err_len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
    return -1;
}

int am_grow(void **p, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : first;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}
