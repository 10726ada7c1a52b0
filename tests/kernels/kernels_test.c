/* kernels_test.c - the helpers of the CPU kernels' tests (kernels_test.h says what they are). */
#include "kernels_test.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

struct am_dev kdev;
const struct am_kernels *K;

int kernels_test_setup(void **state)
{
    (void)state;
    char msg[256];
    if (am_dev_open(&kdev, AM_DEV_CPU, -1, msg, sizeof(msg)) < 0) {
        fprintf(stderr, "%s\n", msg);
        return 1;
    }
    K = kdev.k;
    return K ? 0 : -1;
}

double rng_uniform(struct rng *r, double lo, double hi) /* xorshift64*, 53 bits */
{
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    uint64_t v = r->s * 2685821657736338717ull;
    return lo + (hi - lo) * (double)(v >> 11) * (1.0 / 9007199254740992.0);
}

struct arr arr_new(int64_t n)
{
    struct arr a = {K->alloc(&kdev, (size_t)n * sizeof(float)), calloc((size_t)(n ? n : 1), sizeof(double)), n};
    assert_non_null(a.f);
    assert_non_null(a.d);
    return a;
}

struct arr arr_rand(struct rng *r, int64_t n, double lo, double hi)
{
    struct arr a = arr_new(n);
    for (int64_t i = 0; i < n; i++) {
        a.f[i] = (float)rng_uniform(r, lo, hi);
        a.d[i] = a.f[i];
    }
    return a;
}

struct arr arr_copy(const struct arr *src)
{
    struct arr a = arr_new(src->n);
    memcpy(a.f, src->f, (size_t)src->n * sizeof(float));
    memcpy(a.d, src->d, (size_t)src->n * sizeof(double));
    return a;
}

void arr_free(struct arr *a)
{
    K->free(&kdev, a->f);
    free(a->d);
    a->f = NULL;
    a->d = NULL;
}

double *dalloc(int64_t n)
{
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    assert_non_null(p);
    return p;
}

struct am_tensor tview(struct arr *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(a->f, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
}

struct am_tensor ids_view(int32_t *p, int64_t n)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_I32, n, 0, 0, 0);
}

double max_abs(const double *x, int64_t n)
{
    double m = 0.0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

/* Asserts |got_i - want_i| <= tol_i for every i (NaN fails). */
void expect_close(const char *what, const float *got, const double *want, const double *tol, int64_t n)
{
    double worst = 0.0;
    int64_t at = -1, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        double ratio = tol[i] > 0 ? e / tol[i] : (e > 0 ? INFINITY : 0.0);
        if (!(e <= tol[i]))
            bad++;
        if (!(ratio <= worst)) {
            worst = ratio;
            at = i;
        }
    }
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %-44s n=%-7lld worst err/tol %.2e [%lld]\n", what, (long long)n, worst, (long long)at);
    if (bad) {
        print_error("%s: %lld of %lld elements out of tolerance; worst [%lld]: got %.9g want %.9g (|err| %.3g, tol %.3g)\n",
                    what, (long long)bad, (long long)n, (long long)at, (double)got[at], want[at],
                    fabs((double)got[at] - want[at]), tol[at]);
        fail();
    }
}

/* The same with one tolerance for all: rel * max|want| + abs. */
void expect_close_norm(const char *what, const float *got, const double *want, int64_t n, double rel,
                              double abs_tol)
{
    double *tol = dalloc(n), t = rel * max_abs(want, n) + abs_tol;
    for (int64_t i = 0; i < n; i++)
        tol[i] = t;
    expect_close(what, got, want, tol, n);
    free(tol);
}

void expect_bitwise(const char *what, const float *a, const float *b, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            print_error("%s: element %lld differs: %.9g vs %.9g\n", what, (long long)i, (double)a[i], (double)b[i]);
            fail();
        }
}

/* Central differences of loss() with respect to p[0..n), into fd. loss() is the double
 * reference forward, h = 1e-6: truncation error ~h² f''' / 6 ~ 1e-12 f''', cancellation
 * ~1e-16 |L| / h ~ 1e-10 |L|. */
void fd_grad(loss_fn loss, void *ctx, double *p, int64_t n, double *fd)
{
    for (int64_t i = 0; i < n; i++) {
        double s = p[i], h = 1e-6 * fmax(1.0, fabs(s));
        volatile double up = s + h, dn = s - h;
        p[i] = up;
        double lp = loss(ctx);
        p[i] = dn;
        double lm = loss(ctx);
        p[i] = s;
        fd[i] = (lp - lm) / (up - dn);
    }
}

/* got (accumulated onto start) against start + fd, with the kernel's tolerance plus the
 * finite differences' own error (1e-7 of the largest derivative, far above ~1e-10). */
void expect_fd(const char *what, const float *got, const double *start, const double *fd, const double *tol,
                      int64_t n)
{
    double *want = dalloc(n), *t = dalloc(n), slack = 1e-7 * (1.0 + max_abs(fd, n));
    for (int64_t i = 0; i < n; i++) {
        want[i] = (start ? start[i] : 0.0) + fd[i];
        t[i] = tol[i] + slack;
    }
    expect_close(what, got, want, t, n);
    free(want);
    free(t);
}

/* ---- references shared by the families ---- */

void ref_matmul(const double *x, const double *w, int64_t M, int64_t Kd, int64_t N, double *y, double *yabs)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0.0, a = 0.0;
            for (int64_t k = 0; k < Kd; k++) {
                s += x[i * Kd + k] * w[j * Kd + k];
                a += fabs(x[i * Kd + k] * w[j * Kd + k]);
            }
            y[i * N + j] = s;
            if (yabs)
                yabs[i * N + j] = a;
        }
}

double silu(double x) { return x / (1.0 + exp(-x)); }

/* ---- bf16 arrays and their comparisons ---- */

struct bt bt_new(int64_t n)
{
    struct bt a = {K->alloc(&kdev, (size_t)n * 2), K->alloc(&kdev, (size_t)n * 4), n};
    assert_non_null(a.h);
    assert_non_null(a.f);
    return a;
}

struct bt bt_rand(struct rng *r, int64_t n, double lo, double hi)
{
    struct bt a = bt_new(n);
    for (int64_t i = 0; i < n; i++) {
        a.h[i] = am_f32_to_bf16((float)rng_uniform(r, lo, hi));
        a.f[i] = am_bf16_to_f32(a.h[i]);
    }
    return a;
}

struct bt bt_copy(const struct bt *s)
{
    struct bt a = bt_new(s->n);
    memcpy(a.h, s->h, (size_t)s->n * 2);
    memcpy(a.f, s->f, (size_t)s->n * 4);
    return a;
}

void bt_free(struct bt *a)
{
    K->free(&kdev, a->h);
    K->free(&kdev, a->f);
}

struct am_tensor hv(struct bt *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(a->h, AM_DEV_CPU, AM_BF16, d0, d1, d2, d3);
}

struct am_tensor fv(struct bt *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(a->f, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
}

static void report(const char *what, int64_t n, double worst_rel, int64_t bitwise, int64_t bad, int64_t at,
                   double got, double want, double tol)
{
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %-50s n=%-7lld max|err|/max|ref| %.2e, bitwise %.1f%%\n", what, (long long)n, worst_rel,
               n ? 100.0 * (double)bitwise / (double)n : 100.0);
    if (bad) {
        print_error("%s: %lld of %lld elements out of tolerance; worst [%lld]: got %.9g want %.9g (tol %.3g)\n", what,
                    (long long)bad, (long long)n, (long long)at, got, want, tol);
        fail();
    }
}

void expect_bf16(const char *what, const uint16_t *got, const float *ref, int64_t n)
{
    double mx = 0.0, worst = 0.0, wr = 0.0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs((double)ref[i]));
    int64_t bad = 0, at = 0, same = 0;
    for (int64_t i = 0; i < n; i++) {
        double g = am_bf16_to_f32(got[i]), e = fabs(g - ref[i]), tol = B16_REL * fabs((double)ref[i]) + B16_ABS * mx;
        same += got[i] == am_f32_to_bf16(ref[i]);
        if (!(e <= tol)) {
            bad++;
            at = i;
        }
        if (!(e / tol <= worst)) {
            worst = e / tol;
            if (!bad)
                at = i;
        }
        wr = fmax(wr, mx > 0 ? e / mx : e);
    }
    report(what, n, wr, same, bad, at, n ? am_bf16_to_f32(got[at]) : 0, n ? ref[at] : 0,
           n ? B16_REL * fabs((double)ref[at]) + B16_ABS * mx : 0);
}

void expect_mixed(const char *what, const float *got, const float *ref, int64_t n)
{
    double mx = 0.0, wr = 0.0;
    for (int64_t i = 0; i < n; i++)
        mx = fmax(mx, fabs((double)ref[i]));
    int64_t bad = 0, at = 0, same = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - ref[i]);
        same += memcmp(&got[i], &ref[i], 4) == 0;
        if (!(e <= MIXED_ABS * mx)) {
            bad++;
            at = i;
        }
        wr = fmax(wr, mx > 0 ? e / mx : e);
    }
    report(what, n, wr, same, bad, at, n ? got[at] : 0, n ? ref[at] : 0, MIXED_ABS * mx);
}

struct am_tensor f32v(float *p, int64_t d0, int64_t d1, int64_t d2, int64_t d3)
{
    return am_tensor_view(p, AM_DEV_CPU, AM_F32, d0, d1, d2, d3);
}

void expect_abort(void (*call)(int), int c, const char *const *want, int n)
{
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(pipefd[1], 2);
        call(c);
        _exit(0);
    }
    close(pipefd[1]);
    char msg[1024] = {0};
    ssize_t got = 0, rd;
    while ((rd = read(pipefd[0], msg + got, sizeof msg - 1 - (size_t)got)) > 0)
        got += rd;
    close(pipefd[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (getenv("AM_TEST_VERBOSE"))
        printf("    %s", msg);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    for (int i = 0; i < n; i++)
        if (!strstr(msg, want[i])) {
            print_error("case %d: \"%s\" not in: %s\n", c, want[i], msg);
            fail();
        }
}
