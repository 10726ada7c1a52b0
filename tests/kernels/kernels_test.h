/* kernels_test.h - what the CPU kernels' tests share (tests/kernels/test_*.c, one program per
 * kernel family, and kernels_test.c): the CPU context, paired fp32/double arrays, the
 * comparisons and finite differences, the bf16 arrays and their comparisons.
 *
 * The CPU kernels are tested against plain references written in double precision.
 *
 * Every forward is compared with a reference computed here, in double, from the same fp32
 * inputs; every backward with (a) a reference backward and (b) central finite differences
 * of a scalar loss, L = Σ out ⊙ R with R random, taken on the double-precision reference
 * forward (so the differences are accurate to ~1e-9 and the tolerance is the kernel's).
 * Backward kernels accumulate, so gradients start from random values and the expected
 * result is start + gradient.
 *
 * Tolerances. u = 2^-24 is fp32's unit roundoff. A dot product of K fp32 terms, however it
 * is blocked, errs by at most about K u Σ|a_k b_k| (the classic γ_K bound); where a
 * reference can carry Σ|terms| along (matmul, RMSNorm, cross-entropy) the bound is per
 * element and derived in the test; where the composition is long (attention) it is
 * normwise, max|err| <= c (D + T) u max|ref|, with the factor explained at the test.
 * Observed errors are one to three orders of magnitude below these bounds (run with
 * AM_TEST_VERBOSE=1 to print the worst error/tolerance ratio of every comparison); a
 * wrong index, sign, scale or GQA mapping gives errors of order 1.
 */
#ifndef AM_TESTS_KERNELS_TEST_H
#define AM_TESTS_KERNELS_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "kernels.h"

#define U 5.9604644775390625e-08 /* 2^-24 */

extern struct am_dev kdev;         /* the CPU's device context */
extern const struct am_kernels *K; /* kdev.k */
/* cmocka's group setup of every program: opens kdev */
int kernels_test_setup(void **state);

/* ---- helpers: random numbers, paired fp32/double arrays, comparisons, finite differences ---- */

struct rng {
    uint64_t s;
};
double rng_uniform(struct rng *r, double lo, double hi); /* xorshift64*, 53 bits */

/* An fp32 array (what the kernel sees) with its exact double copy (what the reference sees). */
struct arr {
    float *f;
    double *d;
    int64_t n;
};
struct arr arr_new(int64_t n);
struct arr arr_rand(struct rng *r, int64_t n, double lo, double hi);
struct arr arr_copy(const struct arr *src);
void arr_free(struct arr *a);
double *dalloc(int64_t n);
struct am_tensor tview(struct arr *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
struct am_tensor ids_view(int32_t *p, int64_t n);
double max_abs(const double *x, int64_t n);
/* Asserts |got_i - want_i| <= tol_i for every i (NaN fails). */
void expect_close(const char *what, const float *got, const double *want, const double *tol, int64_t n);
/* The same with one tolerance for all: rel * max|want| + abs. */
void expect_close_norm(const char *what, const float *got, const double *want, int64_t n, double rel, double abs_tol);
void expect_bitwise(const char *what, const float *a, const float *b, int64_t n);
/* Central differences of loss() with respect to p[0..n), into fd. loss() is the double
 * reference forward, h = 1e-6: truncation error ~h² f''' / 6 ~ 1e-12 f''', cancellation
 * ~1e-16 |L| / h ~ 1e-10 |L|. */
typedef double (*loss_fn)(void *ctx);
void fd_grad(loss_fn loss, void *ctx, double *p, int64_t n, double *fd);
/* got (accumulated onto start) against start + fd, with the kernel's tolerance plus the
 * finite differences' own error (1e-7 of the largest derivative, far above ~1e-10). */
void expect_fd(const char *what, const float *got, const double *start, const double *fd, const double *tol, int64_t n);

/* ---- references shared by the families ---- */
/* y[M,N] = x[M,Kd] · w[N,Kd]ᵀ in double; yabs (optional): Σ|terms| of each element */
void ref_matmul(const double *x, const double *w, int64_t M, int64_t Kd, int64_t N, double *y, double *yabs);
/* SwiGLU's activation, x sigmoid(x), in double */
double silu(double x);

/* ---- bf16 storage, fp32 arithmetic (the test_bf16_* cases of each family) ----
 *
 * Every kernel with a bf16 path runs on random inputs rounded to bf16, and the fp32 kernel
 * (tested above against double) on the same values widened to fp32, which is exact. A bf16
 * output must be the fp32 output rounded once:
 *     |got - ref| <= 2^-8 |ref| + 2^-12 max|ref|                     (expect_bf16)
 * bf16 keeps 8 significant bits, so rounding to nearest errs by at most its unit roundoff
 * 2^-8 of |ref| (the worst case, at the bottom of a binade; 2^-9 at its top). The absolute
 * term covers a result that differs from ref in its last fp32 bits because the bf16 path
 * sums in another order (tiles of 512 in the matrix products, chunks of vocabulary in the
 * cross-entropy, rows grouped in the embedding's backward): 2^-12 max|ref| is 16 times below
 * one bf16 rounding of the largest element and far above those fp32 differences (about
 * K 2^-24 of the sum of |terms|, K <= 700 here). The fraction of outputs bitwise equal to
 * bf16(ref) is printed too (AM_TEST_VERBOSE=1: 100% wherever the kernel runs the same fp32
 * code on the same values), and where the semantics round twice (RMSNorm's forward: bf16(w * bf16(x * rstd)),
 * transformers' order) the test reproduces both roundings and compares bitwise.
 * An f32 parameter gradient with bf16 inputs (mixed precision) sees only the fp32
 * differences: |got - ref| <= 2^-16 max|ref| (expect_mixed); f32 statistics the same.
 * The worst error of each comparison, relative to max|ref|, is printed with AM_TEST_VERBOSE.
 */
#define B16_REL 0x1p-8
#define B16_ABS 0x1p-12
#define MIXED_ABS 0x1p-16

/* A bf16 array (what the kernel sees) and its exact fp32 widening (what the fp32 kernel sees). */
struct bt {
    uint16_t *h;
    float *f;
    int64_t n;
};
struct bt bt_new(int64_t n);
struct bt bt_rand(struct rng *r, int64_t n, double lo, double hi);
struct bt bt_copy(const struct bt *s);
void bt_free(struct bt *a);
struct am_tensor hv(struct bt *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
struct am_tensor fv(struct bt *a, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
void expect_bf16(const char *what, const uint16_t *got, const float *ref, int64_t n);
void expect_mixed(const char *what, const float *got, const float *ref, int64_t n);
struct am_tensor f32v(float *p, int64_t d0, int64_t d1, int64_t d2, int64_t d3);

/* Runs call(c) in a child, which must abort (a kernel's caller-bug check); the message it
 * printed on stderr is checked to hold each of the n strings in want (printed with
 * AM_TEST_VERBOSE). */
void expect_abort(void (*call)(int), int c, const char *const *want, int n);

#endif
