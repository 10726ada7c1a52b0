/* fail_alloc.c - an LD_PRELOAD library that makes one host allocation fail for real, so that a
 * rank's out-of-memory paths run (tests/train/test-early-failure.sh):
 *   AM_TEST_FAIL_MALLOC=N   the first malloc of exactly N bytes returns NULL
 *   AM_TEST_FAIL_CALLOC=N   the first calloc of exactly N bytes in all returns NULL
 * Every other call goes to glibc's own allocator. */
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>

void *__libc_malloc(size_t n);
void *__libc_calloc(size_t count, size_t size);
void *malloc(size_t n);
void *calloc(size_t count, size_t size);

static atomic_int malloc_done, calloc_done;

/* whether this call of `n` bytes is the one that fails (once per process) */
static int fails(const char *var, size_t n, atomic_int *done)
{
    const char *v = getenv(var);
    if (!v || strtoull(v, NULL, 10) != n || atomic_exchange(done, 1))
        return 0;
    errno = ENOMEM;
    return 1;
}

void *malloc(size_t n) { return fails("AM_TEST_FAIL_MALLOC", n, &malloc_done) ? NULL : __libc_malloc(n); }

void *calloc(size_t count, size_t size)
{
    return fails("AM_TEST_FAIL_CALLOC", count * size, &calloc_done) ? NULL : __libc_calloc(count, size);
}
