/* comm_check - a rank program (start it with am-launch) that checks every communicator
 * operation, dtype and edge size against a reference computed locally.
 *
 * Every rank derives every other rank's inputs from (global rank, test, index) with a hash,
 * so each rank can compute the exact reference of what it must receive. Groups of several
 * shapes are created at once: world, world reversed, lower and upper half, even and odd
 * ranks, ranks modulo 3; each rank runs the suite on its groups in creation order, so groups
 * with disjoint members run at the same time and their messages interleave on the workers.
 *
 * Tolerances. Integers and max are exact. A float sum of p inputs rounded to the dtype after
 * each of its p-1 additions is off by at most (p-1) u sum|x| (u: the dtype's unit roundoff,
 * 2^-24 fp32, 2^-8 bf16, 2^-11 fp16), whatever the order of the additions. We allow
 * (p+1) u sum|x| for sums, which also covers backends that scale before summing (NCCL's avg
 * multiplies each input by 1/p: one more rounding, and 1/p itself rounded), divided by p for
 * avg, plus u |reference| for avg's final rounding, plus p times fp16's smallest subnormal
 * step for results in fp16's subnormal range. A backend that accumulated bf16 without
 * widening, or truncated instead of rounding, drifts past this bound on long vectors;
 * tests/comm/test_comm_dtype checks the conversions themselves bit for bit.
 * Allreduce results must also be bitwise identical on every rank of the group (checked by
 * allgathering a hash of each rank's result).
 *
 * Non-blocking sends (am_isend), on every group: a ring in which every rank sends a few MiB
 * (rendezvous) to the right and then blocks receiving from the left (a deadlock with blocking
 * sends), its flight entry checked while pending and after am_send_wait; a chain in which
 * every rank starts a dozen messages of mixed sizes and dtypes to the next rank before
 * receiving any; isends and blocking sends to one peer interleaved (one numbering, taken in
 * order); and the pipeline's pattern over two groups (activations forward on one, gradients
 * back on the other), a send pending on one while the rank blocks receiving on the other.
 * Every value is compared exactly. At the end
 * rank 0 leaves a send pending on the world group, which am_comm_destroy gives up.
 *
 * Environment:
 *   AM_COMM_BACKEND        ucx (default) or nccl (the comm_check_nccl build: device buffers)
 *   AM_COMM_TIMEOUT        seconds for every wait (default 60)
 *   COMM_CHECK_BIG_BYTES   the "few MiB" size, run on the world group (default 3 MiB)
 *   COMM_CHECK_ISEND_BYTES the isend ring's message (default 4 MiB)
 *   COMM_CHECK_DEVICE      the CUDA device (nccl build; default: the local rank)
 *   COMM_CHECK_DIE=R:MODE[:isend]  rank R stops in the middle of a long run of allreduces on
 *                          the world group: MODE exit (exits 0, unnoticed by the launcher),
 *                          hang (stops answering) or kill (SIGKILL); the others must fail with
 *                          a timeout. With :isend, a run of rounds in which every other rank
 *                          sends rank R a few MiB with am_isend and waits with am_send_wait
 *                          (rank R receives them): the pending send must fail, naming rank R.
 *                          With :iallreduce, rounds of two iallreduces in flight, waited for in
 *                          reverse: the wait must fail, naming the call and rank R.
 *   COMM_CHECK_STALL       the first iallreduce on world stalls (am_comm_inject_stall) on every
 *                          rank; a watchdog thread like the trainer's must abort the wait.
 *
 * Ring shift (am_shift, am_ishift), on every group, dtype and size: the left neighbour's input
 * received exactly, blocking and non-blocking; overlapping buffers refused (the refusal breaks
 * nothing: it is checked before the call is numbered).
 *
 * Non-blocking collectives (am_iallreduce, am_ireduce_scatter, am_iallgather), on every group:
 * every op x dtype x edge size x in place or not alone, bit for bit against the blocking call
 * on the same inputs, the flight entry "posted" until the wait and completed after; seven of
 * mixed kinds, dtypes and sizes in flight at once, waited in order, in reverse, polled with
 * am_comm_test and with am_comm_wait_all; then four on two groups at once (world and rev)
 * with blocking calls meanwhile on a third group and on world itself; then overlap: a 16 MiB
 * iallreduce must complete while every rank sleeps without calling in.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "comm.h"
#include "comm_impl.h"
#include "flight.h"

#ifdef COMM_CHECK_CUDA
#include <cuda_runtime_api.h>
#endif

#define MAX_FAIL_LINES 8

struct check {
    struct am_boot_info info;
    struct am_comm_ctx *ctx;
    void *stream;
    long checks, failures;
    size_t big_bytes, isend_bytes;
    const char *gname;          /* group being tested, for messages */
    struct am_flight flight;    /* every call of the run is recorded */
    char err[AM_COMM_ERR_LEN];  /* the message of the last call that failed */
};
/* The last two arguments of every communicator call: its message goes to k->err. */
#define KERR k->err, sizeof(k->err)

/* ---- inputs ------------------------------------------------------------------------------ */

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t salt_of(int a, int b, int c, int d, int e)
{
    return mix(mix(mix(mix(mix((uint64_t)a) + (uint64_t)b) + (uint64_t)c) + (uint64_t)d) + (uint64_t)e);
}

/* The value global rank `grank` contributes at index i of test `salt`, exactly representable
 * in t. */
static double input(enum am_dtype t, int grank, uint64_t salt, size_t i)
{
    uint64_t h = mix(salt ^ mix(((uint64_t)grank << 40) ^ (uint64_t)i));
    double u = (double)(h >> 11) * 0x1.0p-53 * 2.0 - 1.0; /* [-1, 1) */
    switch (t) {
    case AM_F32: return (double)(float)u;
    case AM_BF16: return (double)am_bf16_to_f32(am_f32_to_bf16((float)u));
    case AM_F16: return (double)am_f16_to_f32(am_f32_to_f16((float)u));
    case AM_I32: return (double)((int64_t)(h % 2000001) - 1000000);
    case AM_I64: return (double)((int64_t)(h % (1ull << 41)) - (int64_t)(1ull << 40));
    case AM_F64: return u;
    }
    return 0;
}

static void put_val(void *buf, enum am_dtype t, size_t i, double v)
{
    switch (t) {
    case AM_F32: ((float *)buf)[i] = (float)v; break;
    case AM_BF16: ((uint16_t *)buf)[i] = am_f32_to_bf16((float)v); break;
    case AM_F16: ((uint16_t *)buf)[i] = am_f32_to_f16((float)v); break;
    case AM_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case AM_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case AM_F64: ((double *)buf)[i] = v; break;
    }
}

static double get_val(const void *buf, enum am_dtype t, size_t i)
{
    switch (t) {
    case AM_F32: return ((const float *)buf)[i];
    case AM_BF16: return am_bf16_to_f32(((const uint16_t *)buf)[i]);
    case AM_F16: return am_f16_to_f32(((const uint16_t *)buf)[i]);
    case AM_I32: return ((const int32_t *)buf)[i];
    case AM_I64: return (double)((const int64_t *)buf)[i];
    case AM_F64: return ((const double *)buf)[i];
    }
    return 0;
}

static void fill(void *buf, enum am_dtype t, int grank, uint64_t salt, size_t from, size_t n)
{
    for (size_t i = 0; i < n; i++)
        put_val(buf, t, i, input(t, grank, salt, from + i));
}

static double unit_roundoff(enum am_dtype t)
{
    switch (t) {
    case AM_F32: return 0x1.0p-24;
    case AM_BF16: return 0x1.0p-8;
    case AM_F16: return 0x1.0p-11;
    case AM_F64: return 0x1.0p-52; /* twice fp64's: the reference's sum (in double) rounds too */
    default: return 0;
    }
}

static int is_float(enum am_dtype t) { return t == AM_F32 || t == AM_BF16 || t == AM_F16 || t == AM_F64; }

/* The reduction over every group rank's input at index i; *tol receives the tolerance. */
static double reference(const struct am_comm *c, enum am_dtype t, enum am_comm_op op, uint64_t salt, size_t i,
                        double *tol)
{
    int p = am_comm_size(c);
    double s = 0, abs_sum = 0, m = -INFINITY;
    for (int j = 0; j < p; j++) {
        double v = input(t, c->ranks[j], salt, i);
        s += v;
        abs_sum += fabs(v);
        if (v > m)
            m = v;
    }
    *tol = 0;
    if (op == AM_MAX)
        return m;
    if (!is_float(t))
        return op == AM_AVG ? trunc(s / p) : s;
    double u = unit_roundoff(t), ref = op == AM_AVG ? s / p : s;
    *tol = (p + 1) * u * abs_sum / (op == AM_AVG ? p : 1) + (op == AM_AVG ? u * fabs(ref) : 0);
    if (t == AM_F16)
        *tol += p * 0x1.0p-24;
    return ref;
}

/* ---- device staging (nccl build) ------------------------------------------------------------ */

static void *dev_alloc(size_t bytes)
{
#ifdef COMM_CHECK_CUDA
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess)
        return NULL;
    return d;
#else
    return malloc(bytes ? bytes : 1);
#endif
}

static void dev_free(void *d)
{
#ifdef COMM_CHECK_CUDA
    cudaFree(d);
#else
    free(d);
#endif
}

/* host <-> "device": the same buffer in the UCX build */
static void to_dev(void *d, const void *h, size_t bytes)
{
#ifdef COMM_CHECK_CUDA
    cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
#else
    if (d != h)
        memmove(d, h, bytes);
#endif
}

static void to_host(void *h, const void *d, size_t bytes)
{
#ifdef COMM_CHECK_CUDA
    cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost);
#else
    if (d != h)
        memmove(h, d, bytes);
#endif
}

/* ---- reporting --------------------------------------------------------------------------- */

static void failf(struct check *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void failf(struct check *k, const char *fmt, ...)
{
    k->failures++;
    if (k->failures > MAX_FAIL_LINES)
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "comm_check: rank %d: group %s: %s\n", k->info.rank, k->gname, msg);
}

/* A communicator call failed: that ends the run (the job is all-or-nothing). */
static void die_call(struct check *k, const char *what)
{
    fprintf(stderr, "comm_check: rank %d: %s: %s\n", k->info.rank, what, k->err);
    exit(1);
}

static const char *op_str(enum am_comm_op op) { return am_comm_op_name(op); }

/* Which elements of an n-element result are compared with the reference: all of them up to
 * 64 Ki elements; beyond (the "few MiB" size, where computing every rank's input for every
 * element dominates the run time) the first and last 4 Ki and every 31st element between, which
 * still lands several times in every pipeline segment. Copies (allgather, broadcast, ...) are
 * always compared in full. */
static int checked(size_t i, size_t n)
{
    return n <= (64u << 10) || i < 4096 || n - i <= 4096 || i % 31 == 0;
}

/* Compares n elements of got against the reduction reference starting at index from. */
static void check_reduced(struct check *k, const struct am_comm *c, const char *what, enum am_dtype t,
                          enum am_comm_op op, uint64_t salt, const void *got, size_t from, size_t n)
{
    k->checks++;
    for (size_t i = 0; i < n; i++) {
        if (!checked(i, n))
            continue;
        double tol, ref = reference(c, t, op, salt, from + i, &tol), v = get_val(got, t, i);
        if (!(fabs(v - ref) <= tol)) {
            failf(k, "%s %s %s: element %zu: got %.9g, expected %.9g (tolerance %.3g)", what, op_str(op),
                  am_dtype_name(t), from + i, v, ref, tol);
            return;
        }
    }
}

static void check_inputs(struct check *k, const char *what, enum am_dtype t, int grank, uint64_t salt,
                         const void *got, size_t from, size_t n, const char *where)
{
    for (size_t i = 0; i < n; i++) {
        double ref = input(t, grank, salt, from + i), v = get_val(got, t, i);
        if (v != ref) {
            failf(k, "%s %s: %s element %zu: got %.9g, expected %.9g (rank %d's input)", what, am_dtype_name(t),
                  where, i, v, ref, grank);
            return;
        }
    }
}

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Every rank of the group must hold the same bits. */
static void check_same_everywhere(struct check *k, struct am_comm *c, const char *what, const void *buf, size_t bytes)
{
    int p = am_comm_size(c);
    int64_t mine = (int64_t)hash_bytes(buf, bytes);
    int64_t *all = calloc((size_t)p, sizeof(*all));
    void *dmine = dev_alloc(sizeof(mine)), *dall = dev_alloc((size_t)p * sizeof(*all));
    if (!all || !dmine || !dall) {
        fprintf(stderr, "comm_check: out of memory\n");
        exit(1);
    }
    to_dev(dmine, &mine, sizeof(mine));
    if (am_allgather(c, dmine, dall, 1, AM_I64, KERR) < 0)
        die_call(k, "allgather of result hashes");
    to_host(all, dall, (size_t)p * sizeof(*all));
    k->checks++;
    for (int j = 0; j < p; j++)
        if (all[j] != mine) {
            failf(k, "%s: group rank %d holds different bits than this rank (%d)", what, j, am_comm_rank(c));
            break;
        }
    free(all);
    dev_free(dmine);
    dev_free(dall);
}

/* ---- the tests ---------------------------------------------------------------------------- */

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "comm_check: out of memory for %zu bytes\n", n);
        exit(1);
    }
    return p;
}

static void test_allreduce(struct check *k, struct am_comm *c, enum am_dtype t, enum am_comm_op op, size_t n,
                           int in_place, uint64_t salt)
{
    size_t es = am_dtype_size(t), bytes = n * es;
    char what[96];
    snprintf(what, sizeof(what), "allreduce%s n=%zu", in_place ? " (in place)" : "", n);
    char *h = xmalloc(bytes), *out = xmalloc(bytes);
    void *ds = dev_alloc(bytes), *dr = in_place ? ds : dev_alloc(bytes);
    fill(h, t, k->info.rank, salt, 0, n);
    to_dev(ds, h, bytes);
    if (!in_place) {
        memset(out, 0x5a, bytes);
        to_dev(dr, out, bytes);
    }
    uint64_t seq = am_comm_seq(c);
    if (am_allreduce(c, ds, dr, n, t, op, KERR) < 0)
        die_call(k, what);
    if (am_comm_seq(c) != seq + 1)
        failf(k, "%s: sequence number went from %llu to %llu", what, (unsigned long long)seq,
              (unsigned long long)am_comm_seq(c));
    to_host(out, dr, bytes);
    check_reduced(k, c, what, t, op, salt, out, 0, n);
    if (!in_place) { /* the send buffer is left alone */
        to_host(out, ds, bytes);
        k->checks++;
        if (memcmp(out, h, bytes) != 0)
            failf(k, "%s %s: the send buffer changed", what, am_dtype_name(t));
    }
    if (n) {
        to_host(out, dr, bytes);
        check_same_everywhere(k, c, what, out, bytes);
    }
    free(h);
    free(out);
    dev_free(ds);
    if (!in_place)
        dev_free(dr);
}

static void test_reduce_scatter(struct check *k, struct am_comm *c, enum am_dtype t, enum am_comm_op op,
                                size_t n, int in_place, uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c);
    size_t es = am_dtype_size(t), full = n * (size_t)p * es;
    char what[96];
    snprintf(what, sizeof(what), "reduce_scatter%s n=%zu", in_place ? " (in place)" : "", n);
    char *h = xmalloc(full), *out = xmalloc(full);
    void *ds = dev_alloc(full), *dr = in_place ? (char *)ds + (size_t)r * n * es : dev_alloc(n * es);
    fill(h, t, k->info.rank, salt, 0, n * (size_t)p);
    to_dev(ds, h, full);
    if (am_reduce_scatter(c, ds, dr, n, t, op, KERR) < 0)
        die_call(k, what);
    to_host(out, dr, n * es);
    check_reduced(k, c, what, t, op, salt, out, (size_t)r * n, n);
    if (!in_place) {
        to_host(out, ds, full);
        k->checks++;
        if (memcmp(out, h, full) != 0)
            failf(k, "%s %s: the send buffer changed", what, am_dtype_name(t));
        dev_free(dr);
    }
    free(h);
    free(out);
    dev_free(ds);
}

static void test_allgather(struct check *k, struct am_comm *c, enum am_dtype t, size_t n, int in_place,
                           uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c);
    size_t es = am_dtype_size(t), full = n * (size_t)p * es;
    char what[96];
    snprintf(what, sizeof(what), "allgather%s n=%zu", in_place ? " (in place)" : "", n);
    char *h = xmalloc(n * es), *out = xmalloc(full);
    void *dr = dev_alloc(full), *ds = in_place ? (char *)dr + (size_t)r * n * es : dev_alloc(n * es);
    fill(h, t, k->info.rank, salt, 0, n);
    memset(out, 0x5a, full);
    to_dev(dr, out, full);
    to_dev(ds, h, n * es);
    if (am_allgather(c, ds, dr, n, t, KERR) < 0)
        die_call(k, what);
    to_host(out, dr, full);
    k->checks++;
    for (int j = 0; j < p; j++)
        check_inputs(k, what, t, c->ranks[j], salt, out + (size_t)j * n * es, 0, n, "block");
    if (!in_place)
        dev_free(ds);
    free(h);
    free(out);
    dev_free(dr);
}

static void test_broadcast(struct check *k, struct am_comm *c, enum am_dtype t, size_t n, int root, uint64_t salt)
{
    size_t es = am_dtype_size(t), bytes = n * es;
    char what[96];
    snprintf(what, sizeof(what), "broadcast n=%zu root=%d", n, root);
    char *h = xmalloc(bytes);
    void *d = dev_alloc(bytes);
    if (am_comm_rank(c) == root)
        fill(h, t, k->info.rank, salt, 0, n);
    else
        memset(h, 0x5a, bytes);
    to_dev(d, h, bytes);
    if (am_broadcast(c, d, n, t, root, KERR) < 0)
        die_call(k, what);
    to_host(h, d, bytes);
    k->checks++;
    check_inputs(k, what, t, c->ranks[root], salt, h, 0, n, "buffer");
    free(h);
    dev_free(d);
}

/* Elements group rank i sends to group rank j: some zero, some not, scaled by n. */
static size_t a2a_count(int i, int j, size_t n, uint64_t salt)
{
    return (size_t)((mix(salt + (uint64_t)i * 131 + (uint64_t)j) % 4) * n / 2);
}

static void test_alltoallv(struct check *k, struct am_comm *c, enum am_dtype t, size_t n, uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c);
    size_t es = am_dtype_size(t);
    char what[96];
    snprintf(what, sizeof(what), "alltoallv n=%zu", n);
    size_t *sc = xmalloc((size_t)p * sizeof(size_t)), *sd = xmalloc((size_t)p * sizeof(size_t));
    size_t *rc = xmalloc((size_t)p * sizeof(size_t)), *rd = xmalloc((size_t)p * sizeof(size_t));
    size_t stot = 0, rtot = 0;
    for (int j = p - 1; j >= 0; j--) { /* blocks laid out in reverse, with 1-element gaps */
        sc[j] = a2a_count(r, j, n, salt);
        sd[j] = stot;
        stot += sc[j] + 1;
        rc[j] = a2a_count(j, r, n, salt);
        rd[j] = rtot;
        rtot += rc[j] + 1;
    }
    char *hs = xmalloc(stot * es), *hr = xmalloc(rtot * es);
    memset(hs, 0, stot * es);
    memset(hr, 0x5a, rtot * es);
    for (int j = 0; j < p; j++) /* index space: destination j's block starts at j << 32 */
        for (size_t i = 0; i < sc[j]; i++)
            put_val(hs + sd[j] * es, t, i, input(t, k->info.rank, salt, ((size_t)j << 32) + i));
    void *ds = dev_alloc(stot * es), *dr = dev_alloc(rtot * es);
    to_dev(ds, hs, stot * es);
    to_dev(dr, hr, rtot * es);
    if (am_alltoallv(c, ds, sc, sd, dr, rc, rd, t, KERR) < 0)
        die_call(k, what);
    to_host(hr, dr, rtot * es);
    k->checks++;
    for (int j = 0; j < p; j++)
        check_inputs(k, what, t, c->ranks[j], salt, hr + rd[j] * es, ((size_t)r << 32), rc[j], "block");
    for (int j = 0; j < p; j++) { /* the gaps are untouched */
        unsigned char *gap = (unsigned char *)hr + (rd[j] + rc[j]) * es;
        for (size_t b = 0; b < es; b++)
            if (gap[b] != 0x5a) {
                failf(k, "%s: the gap after block %d was written", what, j);
                break;
            }
    }
    free(sc);
    free(sd);
    free(rc);
    free(rd);
    free(hs);
    free(hr);
    dev_free(ds);
    dev_free(dr);
}

/* send/recv: a ring shift (even ranks send first) and a chain 0 -> 1 -> ... -> p-1 of several
 * messages, in which ranks make different numbers of calls on the group. */
static void test_p2p(struct check *k, struct am_comm *c, enum am_dtype t, const size_t *sizes, int n_sizes,
                     uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c);
    if (p == 1) {
        k->checks++;
        if (am_send(c, "x", 1, AM_I32, 0, KERR) == 0 || !strstr(k->err, "itself"))
            failf(k, "send to itself was accepted (or said: %s)", k->err);
        return;
    }
    size_t es = am_dtype_size(t);
    int right = (r + 1) % p, left = (r + p - 1) % p;
    for (int s = 0; s < n_sizes; s++) {
        size_t n = sizes[s], bytes = n * es;
        char what[96];
        snprintf(what, sizeof(what), "send/recv ring n=%zu", n);
        char *hs = xmalloc(bytes), *hr = xmalloc(bytes);
        fill(hs, t, k->info.rank, salt + (uint64_t)s, 0, n);
        memset(hr, 0x5a, bytes);
        void *ds = dev_alloc(bytes), *dr = dev_alloc(bytes);
        to_dev(ds, hs, bytes);
        to_dev(dr, hr, bytes);
        int rc;
        if (r % 2 == 0)
            rc = am_send(c, ds, n, t, right, KERR) < 0 || am_recv(c, dr, n, t, left, KERR) < 0;
        else
            rc = am_recv(c, dr, n, t, left, KERR) < 0 || am_send(c, ds, n, t, right, KERR) < 0;
        if (rc)
            die_call(k, what);
        to_host(hr, dr, bytes);
        k->checks++;
        check_inputs(k, what, t, c->ranks[left], salt + (uint64_t)s, hr, 0, n, "message");
        free(hs);
        free(hr);
        dev_free(ds);
        dev_free(dr);
    }
    /* the chain: each message is relayed unchanged from rank 0 */
    for (int s = 0; s < n_sizes; s++) {
        size_t n = sizes[s], bytes = n * es;
        char what[96];
        snprintf(what, sizeof(what), "send/recv chain n=%zu", n);
        char *h = xmalloc(bytes);
        void *d = dev_alloc(bytes);
        if (r == 0)
            fill(h, t, c->ranks[0], salt + 100 + (uint64_t)s, 0, n);
        else
            memset(h, 0x5a, bytes);
        to_dev(d, h, bytes);
        if ((r > 0 && am_recv(c, d, n, t, r - 1, KERR) < 0) || (r < p - 1 && am_send(c, d, n, t, r + 1, KERR) < 0))
            die_call(k, what);
        to_host(h, d, bytes);
        k->checks++;
        check_inputs(k, what, t, c->ranks[0], salt + 100 + (uint64_t)s, h, 0, n, "message");
        free(h);
        dev_free(d);
    }
}

/* Errors in the arguments are reported without numbering the call or breaking the group. */
static void test_bad_arguments(struct check *k, struct am_comm *c)
{
    int x = 0;
    uint64_t seq = am_comm_seq(c);
    k->checks++;
    if (am_allreduce(c, &x, &x, 1, (enum am_dtype)42, AM_SUM, KERR) == 0 || !strstr(k->err, "dtype 42"))
        failf(k, "a bad dtype was accepted (or said: %s)", k->err);
    if (am_broadcast(c, &x, 1, AM_I32, am_comm_size(c), KERR) == 0 || !strstr(k->err, "root"))
        failf(k, "a bad root was accepted (or said: %s)", k->err);
    if (am_allreduce(c, NULL, &x, 1, AM_I32, AM_SUM, KERR) == 0 || !strstr(k->err, "NULL"))
        failf(k, "a NULL buffer was accepted (or said: %s)", k->err);
    if (am_comm_seq(c) != seq)
        failf(k, "rejected calls changed the sequence number");
}

/* ---- non-blocking sends ---------------------------------------------------------------------- */

/* A device copy of the host buffer h (freed), or exit when the device has no room. */
static void *dev_copy_of(char *h, size_t bytes)
{
    void *d = dev_alloc(bytes);
    if (!d) {
        fprintf(stderr, "comm_check: out of device memory for %zu bytes\n", bytes);
        exit(1);
    }
    to_dev(d, h, bytes);
    free(h);
    return d;
}

/* A host message of n elements of t, rank grank's input for salt, on the device. */
static void *dev_message(enum am_dtype t, int grank, uint64_t salt, size_t n)
{
    size_t bytes = n * am_dtype_size(t);
    char *h = xmalloc(bytes);
    fill(h, t, grank, salt, 0, n);
    return dev_copy_of(h, bytes);
}

/* A device buffer of n elements of t, filled with 0x5a bytes. */
static void *dev_blank(enum am_dtype t, size_t n)
{
    size_t bytes = n * am_dtype_size(t);
    char *h = xmalloc(bytes);
    memset(h, 0x5a, bytes);
    return dev_copy_of(h, bytes);
}

/* Device buffer d (n elements of t) must hold group rank `from`'s input for salt. Frees d. */
static void check_message(struct check *k, const struct am_comm *c, const char *what, enum am_dtype t, size_t n,
                          int from, uint64_t salt, void *d)
{
    size_t bytes = n * am_dtype_size(t);
    char *h = xmalloc(bytes);
    to_host(h, d, bytes);
    k->checks++;
    check_inputs(k, what, t, c->ranks[from], salt, h, 0, n, "message");
    free(h);
    dev_free(d);
}

/* Receives n elements of t from group rank `from` and compares them with that rank's input. */
static void recv_checked(struct check *k, struct am_comm *c, const char *what, enum am_dtype t, size_t n,
                         int from, uint64_t salt)
{
    void *d = dev_blank(t, n);
    if (am_recv(c, d, n, t, from, KERR) < 0)
        die_call(k, what);
    check_message(k, c, what, t, n, from, salt, d);
}

/* Flight entry id must be an isend #seq to group rank peer in state st. */
static void check_flight(struct check *k, const struct am_comm *c, const char *what, uint64_t id, int peer,
                         uint64_t seq, enum am_flight_state st)
{
    struct am_flight_view v;
    k->checks++;
    if (!am_flight_get(&k->flight, id, &v)) {
        failf(k, "%s: flight entry %llu is no longer in the recorder", what, (unsigned long long)id);
        return;
    }
    if (strcmp(v.op, "isend") != 0 || v.peer != c->ranks[peer] || v.seq != seq || v.state != (int)st)
        failf(k, "%s: the flight recorder has %s #%llu to global %d, %s; expected isend #%llu to global %d, %s", what,
              v.op, (unsigned long long)v.seq, v.peer, am_flight_state_name(v.state), (unsigned long long)seq,
              c->ranks[peer], am_flight_state_name(st));
}

/* Every rank sends a few MiB to the right, then blocks receiving from the left: with blocking
 * (rendezvous) sends every rank would wait for its right neighbour to receive. Buffers are
 * made before and checked after (nccl build: no synchronous CUDA call while a send may be
 * in flight, as it would wait for that send's kernel). */
static void test_isend_ring(struct check *k, struct am_comm *c, uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c), right = (r + 1) % p, left = (r + p - 1) % p;
    const enum am_dtype t = AM_F32;
    size_t n = k->isend_bytes / am_dtype_size(t);
    char what[96];
    snprintf(what, sizeof(what), "isend ring n=%zu", n);
    void *d = dev_message(t, k->info.rank, salt, n), *in = dev_blank(t, n);
    double busy = am_comm_ctx_busy_s(k->ctx);
    if (am_isend(c, d, n, t, right, KERR) < 0)
        die_call(k, what);
    uint64_t id = atomic_load(&k->flight.newest), seq = c->sent[right];
    check_flight(k, c, what, id, right, seq, AM_FLIGHT_POSTED);
    struct am_flight_view v;
    if (am_flight_oldest_inflight(&k->flight, &v)) /* a posted isend does not block the rank */
        failf(k, "%s: the watchdog would time %s #%llu, but nothing blocks", what, v.op, (unsigned long long)v.seq);
    if (am_recv(c, in, n, t, left, KERR) < 0)
        die_call(k, what);
    check_flight(k, c, what, id, right, seq, AM_FLIGHT_POSTED); /* pending until am_send_wait */
    if (am_send_wait(c, KERR) < 0)
        die_call(k, what);
    check_flight(k, c, what, id, right, seq, AM_FLIGHT_COMPLETED);
    check_message(k, c, what, t, n, left, salt, in);
    k->checks++;
    if (!(am_comm_ctx_busy_s(k->ctx) > busy))
        failf(k, "%s: busy time did not grow (%g s before, %g s after)", what, busy, am_comm_ctx_busy_s(k->ctx));
    dev_free(d);
}

/* The chain's messages: empty, eager and rendezvous sizes, every dtype, and equal ones back
 * to back (taken in the wrong order they would still fit, and their values would differ). */
static const struct {
    size_t n;
    enum am_dtype t;
} pipe_msgs[] = {
    {1, AM_F32},     {0, AM_BF16},   {300000, AM_F16}, {300000, AM_F16}, {7, AM_I64},    {70000, AM_F32},
    {1 << 19, AM_BF16}, {5, AM_I32}, {300000, AM_I32}, {0, AM_I64},      {20000, AM_F32}, {3, AM_BF16},
};
#define N_PIPE ((int)(sizeof(pipe_msgs) / sizeof(pipe_msgs[0])))

/* Ranks 0..p-2 each start every message to the next rank, then wait for all but the newest
 * KEPT of them (am_send_wait_keep: they end, the others stay posted), before receiving
 * anything; ranks 1..p-1 receive them in order and check every value. */
#define KEPT 3
static void test_isend_chain(struct check *k, struct am_comm *c, uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c);
    void *bufs[N_PIPE] = {0};
    uint64_t ids[N_PIPE] = {0};
    char what[96];
    uint64_t sent0 = r < p - 1 ? c->sent[r + 1] : 0;
    for (int i = 0; r < p - 1 && i < N_PIPE; i++) {
        snprintf(what, sizeof(what), "isend chain message %d (n=%zu)", i, pipe_msgs[i].n);
        bufs[i] = dev_message(pipe_msgs[i].t, k->info.rank, salt + (uint64_t)i, pipe_msgs[i].n);
        if (am_isend(c, bufs[i], pipe_msgs[i].n, pipe_msgs[i].t, r + 1, KERR) < 0)
            die_call(k, what);
        ids[i] = atomic_load(&k->flight.newest);
    }
    if (r < p - 1) {
        if (am_send_wait_keep(c, KEPT, KERR) < 0)
            die_call(k, "isend chain: send_wait_keep");
        k->checks++;
        if (c->n_pending != KEPT)
            failf(k, "isend chain: %zu sends pending after am_send_wait_keep(%d)", c->n_pending, KEPT);
        for (int i = 0; i < N_PIPE; i++) {
            snprintf(what, sizeof(what), "isend chain message %d after send_wait_keep", i);
            check_flight(k, c, what, ids[i], r + 1, sent0 + (uint64_t)i + 1,
                         i < N_PIPE - KEPT ? AM_FLIGHT_COMPLETED : AM_FLIGHT_POSTED);
        }
    }
    for (int i = 0; r > 0 && i < N_PIPE; i++) {
        snprintf(what, sizeof(what), "isend chain message %d (n=%zu)", i, pipe_msgs[i].n);
        recv_checked(k, c, what, pipe_msgs[i].t, pipe_msgs[i].n, r - 1, salt + (uint64_t)i);
    }
    if (r < p - 1) {
        if (am_send_wait(c, KERR) < 0)
            die_call(k, "isend chain: send_wait");
        k->checks++;
        if (c->sent[r + 1] != sent0 + N_PIPE)
            failf(k, "isend chain: %d isends numbered %llu messages", N_PIPE,
                  (unsigned long long)(c->sent[r + 1] - sent0));
    }
    for (int i = 0; i < N_PIPE; i++)
        dev_free(bufs[i]);
}

/* isend A, blocking send B, isend C to the next rank share one numbering: it receives A, B, C
 * in that order (A and B by rendezvous, C eager). */
static void test_isend_mixed(struct check *k, struct am_comm *c, uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c);
    const size_t n[3] = {(size_t)300000, (size_t)200000, (size_t)9};
    const enum am_dtype t[3] = {AM_I32, AM_I32, AM_I64};
    void *d[3] = {0};
    if (r < p - 1) {
        uint64_t sent0 = c->sent[r + 1];
        for (int i = 0; i < 3; i++) {
            d[i] = dev_message(t[i], k->info.rank, salt + (uint64_t)i, n[i]);
            if ((i == 1 ? am_send(c, d[i], n[i], t[i], r + 1, KERR) : am_isend(c, d[i], n[i], t[i], r + 1, KERR)) < 0)
                die_call(k, i == 1 ? "isend/send mixed: send B" : "isend/send mixed: isend");
        }
        k->checks++;
        if (c->sent[r + 1] != sent0 + 3)
            failf(k, "isend/send mixed: 3 sends numbered %llu", (unsigned long long)(c->sent[r + 1] - sent0));
    }
    for (int i = 0; r > 0 && i < 3; i++)
        recv_checked(k, c, i == 1 ? "isend/send mixed: B" : i ? "isend/send mixed: C" : "isend/send mixed: A", t[i],
                     n[i], r - 1, salt + (uint64_t)i);
    if (r < p - 1 && am_send_wait(c, KERR) < 0)
        die_call(k, "isend/send mixed: send_wait");
    for (int i = 0; i < 3; i++)
        dev_free(d[i]);
}

/* Refused isends are not numbered; am_send_wait with nothing pending returns 0. */
static void test_isend_arguments(struct check *k, struct am_comm *c)
{
    int x = 0, p = am_comm_size(c), r = am_comm_rank(c), other = (r + 1) % p;
    uint64_t sent = c->sent[other];
    k->checks++;
    if (am_isend(c, &x, 1, AM_I32, r, KERR) == 0 || !strstr(k->err, "itself"))
        failf(k, "an isend to itself was accepted (or said: %s)", k->err);
    if (am_isend(c, &x, 1, AM_I32, p, KERR) == 0 || !strstr(k->err, "outside"))
        failf(k, "an isend to group rank %d was accepted (or said: %s)", p, k->err);
    if (other != r && (am_isend(c, NULL, 1, AM_I32, other, KERR) == 0 || !strstr(k->err, "NULL")))
        failf(k, "an isend of a NULL buffer was accepted (or said: %s)", k->err);
    if (c->sent[other] != sent)
        failf(k, "refused isends were numbered");
    if (am_send_wait(c, KERR) < 0)
        failf(k, "send_wait with nothing pending failed: %s", k->err);
}

static void test_isend(struct check *k, struct am_comm *c)
{
    test_isend_arguments(k, c);
    if (am_comm_size(c) == 1)
        return;
    test_isend_ring(k, c, salt_of(10, 0, 0, 0, 0));
    test_isend_chain(k, c, salt_of(11, 0, 0, 0, 0));
    test_isend_mixed(k, c, salt_of(12, 0, 0, 0, 0));
}

/* c's group rank of global rank g (-1: not a member). */
static int group_rank_of(const struct am_comm *c, int g)
{
    for (int i = 0; i < am_comm_size(c); i++)
        if (c->ranks[i] == g)
            return i;
    return -1;
}

/* The pipeline's pattern (train/pipeline.c): activations go forward on one group ("world"),
 * gradients back on another ("rev": the same ranks). Rank r receives its activation from
 * r - 1, starts sending its own to r + 1 with am_isend and, with that send pending, blocks
 * receiving the gradient from r + 1 on the other group, which r + 1 sends only once it has
 * the activation; then it sends its gradient to r - 1. UCX moves the pending send meanwhile;
 * NCCL enqueues it at the receive on the other group. Buffers are made before and checked
 * after, as in the ring. */
static void test_isend_cross(struct check *k, struct am_comm *fwd, struct am_comm *bwd)
{
    int p = am_comm_size(fwd), r = k->info.rank;
    const enum am_dtype t = AM_I64;
    size_t n = k->isend_bytes / am_dtype_size(t);
    uint64_t salt = salt_of(13, 0, 0, 0, 0);
    k->gname = "world+rev";
    if (p == 1)
        return;
    void *act = dev_message(t, r, salt, n), *grad = dev_message(t, r, salt + 1, n);
    void *in_act = r > 0 ? dev_blank(t, n) : NULL, *in_grad = r < p - 1 ? dev_blank(t, n) : NULL;
    int next = group_rank_of(bwd, r + 1), prev = group_rank_of(bwd, r - 1);
    if (r > 0 && am_recv(fwd, in_act, n, t, r - 1, KERR) < 0)
        die_call(k, "isend across groups: activation");
    if (r < p - 1 && am_isend(fwd, act, n, t, r + 1, KERR) < 0)
        die_call(k, "isend across groups: activation");
    if (r < p - 1 && am_recv(bwd, in_grad, n, t, next, KERR) < 0)
        die_call(k, "isend across groups: gradient (an activation pending on the other group)");
    if (r > 0 && am_isend(bwd, grad, n, t, prev, KERR) < 0)
        die_call(k, "isend across groups: gradient");
    if (am_send_wait(fwd, KERR) < 0)
        die_call(k, "isend across groups: send_wait");
    if (am_send_wait(bwd, KERR) < 0)
        die_call(k, "isend across groups: send_wait");
    if (r > 0)
        check_message(k, fwd, "isend across groups: activation", t, n, r - 1, salt, in_act);
    if (r < p - 1)
        check_message(k, bwd, "isend across groups: gradient", t, n, next, salt + 1, in_grad);
    dev_free(act);
    dev_free(grad);
}

/* Rank 0 sends rank 1 a few MiB with am_isend on the world group and never waits: destroying
 * the group gives the send up (its flight entry ends as failed). UCX: the data still goes and
 * rank 1 receives it (the caller then destroys the group and meets rank 1 in a barrier on
 * another group, so rank 0's worker is still there to serve it; the buffer lives until the
 * end); NCCL: never enqueued, nothing to receive. Returns the buffer to free after
 * am_comm_ctx_fini, and the entry's id in *id (0: none). */
static void *isend_left_pending(struct check *k, struct am_comm *world, uint64_t *id)
{
    const enum am_dtype t = AM_I32;
    size_t n = k->isend_bytes / am_dtype_size(t);
    uint64_t salt = salt_of(14, 0, 0, 0, 0);
    void *d = NULL;
    *id = 0;
    k->gname = "world";
    if (am_comm_size(world) == 1)
        return NULL;
    if (am_comm_rank(world) == 0) {
        d = dev_message(t, k->info.rank, salt, n);
        if (am_isend(world, d, n, t, 1, KERR) < 0)
            die_call(k, "isend left pending");
        *id = atomic_load(&k->flight.newest);
    }
#ifndef COMM_CHECK_CUDA
    if (am_comm_rank(world) == 1)
        recv_checked(k, world, "isend left pending", t, n, 0, salt);
#endif
    return d;
}

/* ---- non-blocking collectives ---------------------------------------------------------------- */

enum { NB_ALLREDUCE, NB_REDUCE_SCATTER, NB_ALLGATHER };
static const char *const nb_names[] = {"iallreduce", "ireduce_scatter", "iallgather"};

/* One non-blocking call and the bits the blocking call gave for the same inputs. */
struct nb_op {
    int kind;
    enum am_dtype t;
    enum am_comm_op op;
    size_t n;                   /* allreduce: elements; the others: per rank */
    int in_place;
    uint64_t salt;
    void *dbuf, *dsend, *drecv; /* dbuf: what is freed; send and recv inside it, or apart */
    void *dsend_own;
    char *ref;                  /* the blocking call's result */
    size_t in_bytes, out_bytes;
    struct am_comm_req *req;
};

static int nb_blocking(struct check *k, struct am_comm *c, const struct nb_op *o, const void *s, void *r)
{
    switch (o->kind) {
    case NB_ALLREDUCE: return am_allreduce(c, s, r, o->n, o->t, o->op, KERR);
    case NB_REDUCE_SCATTER: return am_reduce_scatter(c, s, r, o->n, o->t, o->op, KERR);
    default: return am_allgather(c, s, r, o->n, o->t, KERR);
    }
}

static int nb_start(struct check *k, struct am_comm *c, struct nb_op *o)
{
    switch (o->kind) {
    case NB_ALLREDUCE:
        return am_iallreduce(c, o->dsend, o->drecv, o->n, o->t, o->op, &o->req, KERR);
    case NB_REDUCE_SCATTER:
        return am_ireduce_scatter(c, o->dsend, o->drecv, o->n, o->t, o->op, &o->req, KERR);
    default: return am_iallgather(c, o->dsend, o->drecv, o->n, o->t, &o->req, KERR);
    }
}

/* Runs the blocking call (its result in o->ref) and lays out fresh buffers with the same
 * inputs for the non-blocking one. */
static void nb_prepare(struct check *k, struct am_comm *c, struct nb_op *o)
{
    size_t p = (size_t)am_comm_size(c), r = (size_t)am_comm_rank(c), es = am_dtype_size(o->t);
    size_t in = o->kind == NB_REDUCE_SCATTER ? o->n * p : o->n, out = o->kind == NB_ALLGATHER ? o->n * p : o->n;
    o->in_bytes = in * es;
    o->out_bytes = out * es;
    char *h = xmalloc(o->in_bytes);
    fill(h, o->t, k->info.rank, o->salt, 0, in);
    void *bs = dev_alloc(o->in_bytes), *br = dev_alloc(o->out_bytes);
    to_dev(bs, h, o->in_bytes);
    if (nb_blocking(k, c, o, bs, br) < 0)
        die_call(k, "the blocking reference of a non-blocking call");
    o->ref = xmalloc(o->out_bytes);
    to_host(o->ref, br, o->out_bytes);
    dev_free(bs);
    dev_free(br);
    o->dsend_own = NULL;
    if (!o->in_place) {
        o->dsend = o->dsend_own = dev_alloc(o->in_bytes);
        o->dbuf = o->drecv = dev_alloc(o->out_bytes);
        to_dev(o->dsend, h, o->in_bytes);
    } else if (o->kind == NB_ALLREDUCE) {
        o->dbuf = o->dsend = o->drecv = dev_alloc(o->in_bytes);
        to_dev(o->dsend, h, o->in_bytes);
    } else if (o->kind == NB_REDUCE_SCATTER) {
        o->dbuf = o->dsend = dev_alloc(o->in_bytes);
        o->drecv = (char *)o->dsend + r * o->n * es;
        to_dev(o->dsend, h, o->in_bytes);
    } else {
        o->dbuf = o->drecv = dev_alloc(o->out_bytes);
        o->dsend = (char *)o->drecv + r * o->n * es;
        to_dev(o->dsend, h, o->in_bytes);
    }
    free(h);
}

/* The non-blocking result must be the blocking one, bit for bit. */
static void nb_check(struct check *k, struct nb_op *o, const char *how)
{
    char *got = xmalloc(o->out_bytes);
    to_host(got, o->drecv, o->out_bytes);
    k->checks++;
    if (memcmp(got, o->ref, o->out_bytes) != 0)
        failf(k, "%s%s n=%zu %s %s (%s): the result differs from the blocking call's bits", nb_names[o->kind],
              o->in_place ? " (in place)" : "", o->n, am_dtype_name(o->t), op_str(o->op), how);
    free(got);
    free(o->ref);
    dev_free(o->dbuf);
    dev_free(o->dsend_own);
    o->ref = NULL;
}

static void nb_issue(struct check *k, struct am_comm *c, struct nb_op *o)
{
    uint64_t seq = am_comm_seq(c);
    if (nb_start(k, c, o) < 0 || !o->req)
        die_call(k, nb_names[o->kind]);
    k->checks++;
    if (am_comm_seq(c) != seq + 1)
        failf(k, "%s: sequence number went from %llu to %llu", nb_names[o->kind], (unsigned long long)seq,
              (unsigned long long)am_comm_seq(c));
}

/* Every op x dtype x edge size on its own: started, then waited for, against the blocking
 * bits; the flight entry is "posted" until the wait and completed after. */
static void test_nb_single(struct check *k, struct am_comm *c, enum am_dtype t, const size_t *sizes, int ns,
                           int di)
{
    static const enum am_comm_op ops[] = {AM_SUM, AM_MAX, AM_AVG};
    int p = am_comm_size(c);
    for (int si = 0; si < ns; si++)
        for (int kind = 0; kind < 3; kind++)
            for (int oi = 0; oi < (kind == NB_ALLGATHER ? 1 : 3); oi++)
                for (int ip = 0; ip < 2; ip++) {
                    size_t n = kind == NB_ALLREDUCE ? sizes[si] : sizes[si] / (size_t)p + (sizes[si] % 2);
                    struct nb_op o = {.kind = kind, .t = t, .op = ops[oi], .n = n, .in_place = ip,
                                      .salt = salt_of(20, di, si, kind * 3 + oi, ip)};
                    nb_prepare(k, c, &o);
                    nb_issue(k, c, &o);
                    uint64_t id = atomic_load(&k->flight.newest);
                    struct am_flight_view v;
                    k->checks++;
                    if (!am_flight_get(&k->flight, id, &v) || strcmp(v.op, nb_names[kind]) != 0 ||
                        v.seq != am_comm_seq(c) || (v.state != AM_FLIGHT_POSTED))
                        failf(k, "%s n=%zu: its flight entry is not a posted %s #%llu (state %s)", nb_names[kind], n,
                              nb_names[kind], (unsigned long long)am_comm_seq(c), am_flight_state_name(v.state));
                    if (am_comm_wait(o.req, KERR) < 0)
                        die_call(k, nb_names[kind]);
                    if (!am_flight_get(&k->flight, id, &v) || v.state != AM_FLIGHT_COMPLETED)
                        failf(k, "%s n=%zu: its flight entry did not end completed", nb_names[kind], n);
                    nb_check(k, &o, "alone");
                }
}

/* Argument errors: refused at once, not numbered, the group still usable. */
static void test_nb_arguments(struct check *k, struct am_comm *c)
{
    int x = 0;
    struct am_comm_req *q = (struct am_comm_req *)&x;
    uint64_t seq = am_comm_seq(c);
    k->checks++;
    if (am_iallreduce(c, &x, &x, 1, (enum am_dtype)42, AM_SUM, &q, KERR) == 0 || q ||
        !strstr(k->err, "iallreduce on group") || !strstr(k->err, "dtype 42"))
        failf(k, "a bad dtype was accepted by iallreduce (or said: %s)", k->err);
    if (am_iallgather(c, NULL, &x, 1, AM_I32, &q, KERR) == 0 || !strstr(k->err, "NULL"))
        failf(k, "a NULL buffer was accepted by iallgather (or said: %s)", k->err);
    if (am_ireduce_scatter(c, &x, &x, 1, AM_I32, AM_SUM, NULL, KERR) == 0 || !strstr(k->err, "request"))
        failf(k, "a NULL request pointer was accepted (or said: %s)", k->err);
    if (am_comm_seq(c) != seq)
        failf(k, "refused non-blocking calls changed the sequence number");
    if (am_comm_wait(NULL, KERR) != 0)
        failf(k, "am_comm_wait(NULL) failed");
}

/* A mix of N_NB calls (every kind, dtype and a few MiB among them) in flight at once on the
 * group, finished in the order `how` says: in order, in reverse, by polling am_comm_test (in
 * reverse: a later one done means the earlier ones are too), or am_comm_wait_all. */
#define N_NB 7
static void test_nb_many(struct check *k, struct am_comm *c, int how, uint64_t salt)
{
    static const char *const hows[] = {"waited in order", "waited in reverse", "polled with test", "wait_all"};
    static const enum am_dtype ts[N_NB] = {AM_F32, AM_BF16, AM_I64, AM_F32, AM_F16, AM_I32, AM_F32};
    int p = am_comm_size(c);
    size_t big = k->big_bytes / 4 / (size_t)p + 5;
    const size_t ns[N_NB] = {big * (size_t)p, 7, 1000, big, 0, (size_t)(33 << 10), 3};
    struct nb_op o[N_NB];
    for (int i = 0; i < N_NB; i++) {
        o[i] = (struct nb_op){.kind = i % 3, .t = ts[i], .op = (enum am_comm_op)(i % 3), .n = ns[i],
                              .in_place = i % 2, .salt = salt + (uint64_t)i};
        nb_prepare(k, c, &o[i]); /* the blocking references first: all of them before any starts */
    }
    for (int i = 0; i < N_NB; i++)
        nb_issue(k, c, &o[i]);
    if (how == 0 || how == 1) {
        for (int j = 0; j < N_NB; j++)
            if (am_comm_wait(o[how ? N_NB - 1 - j : j].req, KERR) < 0)
                die_call(k, hows[how]);
    } else if (how == 2) {
        int left = N_NB;
        double t0 = am_comm_now();
        while (left && am_comm_now() - t0 < 120) {
            for (int i = N_NB - 1; i >= 0; i--) {
                int done = 0;
                if (!o[i].req)
                    continue;
                if (am_comm_test(o[i].req, &done, KERR) < 0)
                    die_call(k, hows[how]);
                if (done) {
                    o[i].req = NULL;
                    left--;
                }
            }
            struct timespec ts1 = {0, 200000};
            nanosleep(&ts1, NULL);
        }
        k->checks++;
        if (left)
            failf(k, "%d non-blocking calls never tested done", left);
    } else {
        struct am_comm_req *reqs[N_NB + 1];
        for (int i = 0; i < N_NB; i++)
            reqs[i] = o[i].req;
        reqs[N_NB] = NULL;
        if (am_comm_wait_all(reqs, N_NB + 1, KERR) < 0)
            die_call(k, hows[how]);
    }
    for (int i = 0; i < N_NB; i++)
        nb_check(k, &o[i], hows[how]);
}

static void test_nonblocking(struct check *k, struct am_comm *c)
{
    test_nb_arguments(k, c);
    for (int how = 0; how < 4; how++)
        test_nb_many(k, c, how, salt_of(21, how, 0, 0, 0));
}

/* Requests in flight on two groups at once (world and rev: the same ranks), with blocking
 * calls meanwhile on a third group and on world itself; each against the blocking bits. */
static void test_nb_groups(struct check *k, struct am_comm *a, struct am_comm *b, struct am_comm *other)
{
    k->gname = "world+rev";
    size_t n = k->big_bytes / 4 + 11;
    struct nb_op o[4] = {
        {.kind = NB_ALLREDUCE, .t = AM_F32, .op = AM_SUM, .n = n, .salt = salt_of(22, 0, 0, 0, 0)},
        {.kind = NB_ALLREDUCE, .t = AM_BF16, .op = AM_AVG, .n = n, .salt = salt_of(22, 1, 0, 0, 0)},
        {.kind = NB_REDUCE_SCATTER, .t = AM_F32, .op = AM_SUM, .n = n / 8, .salt = salt_of(22, 2, 0, 0, 0)},
        {.kind = NB_ALLGATHER, .t = AM_I32, .n = n / 8, .in_place = 1, .salt = salt_of(22, 3, 0, 0, 0)},
    };
    struct am_comm *on[4] = {a, b, a, b};
    for (int i = 0; i < 4; i++)
        nb_prepare(k, on[i], &o[i]);
    for (int i = 0; i < 4; i++) {
        nb_issue(k, on[i], &o[i]);
        if (i == 1 && other) /* blocking, on a third group, while two are in flight */
            test_allreduce(k, other, AM_F32, AM_SUM, 100000, 0, salt_of(22, 9, 0, 0, 0));
    }
    test_allreduce(k, a, AM_I64, AM_SUM, 70000, 1, salt_of(22, 10, 0, 0, 0)); /* blocking on world */
    for (int i = 3; i >= 0; i--)
        if (am_comm_wait(o[i].req, KERR) < 0)
            die_call(k, "non-blocking calls on two groups");
    for (int i = 0; i < 4; i++)
        nb_check(k, &o[i], "two groups, blocking calls between");
}

/* One int64 reduced over the group through device memory (the nccl build needs it there). */
static int64_t reduce_i64(struct check *k, struct am_comm *c, int64_t v, enum am_comm_op op)
{
    void *d = dev_alloc(sizeof(v));
    to_dev(d, &v, sizeof(v));
    if (am_allreduce(c, d, d, 1, AM_I64, op, KERR) < 0)
        die_call(k, "a reduction of one number");
    to_host(&v, d, sizeof(v));
    dev_free(d);
    return v;
}

/* Overlap: a large iallreduce progresses while the rank sleeps without calling in. The rank
 * sleeps 5 times the blocking call's time (the slowest rank's), plus 0.2 s; then
 * am_comm_test must find it complete. All ranks retry together (longer sleeps, up to 3
 * tries) when any did not, so a loaded machine does not fail it; without a thread that moves
 * the request, no sleep would do. */
static void test_nb_overlap(struct check *k, struct am_comm *c)
{
    k->gname = am_comm_name(c);
    if (am_comm_size(c) == 1)
        return;
    size_t n = (16u << 20) / 4;
    float *h = xmalloc(n * 4);
    fill(h, AM_F32, k->info.rank, salt_of(23, 0, 0, 0, 0), 0, n);
    void *ds = dev_copy_of((char *)h, n * 4), *dr = dev_alloc(n * 4);
    double t0 = am_comm_now();
    if (am_allreduce(c, ds, dr, n, AM_F32, AM_SUM, KERR) < 0)
        die_call(k, "overlap: blocking allreduce");
    int64_t slowest = reduce_i64(k, c, (int64_t)((am_comm_now() - t0) * 1e9), AM_MAX);
    double sleep_s = 5 * (double)slowest * 1e-9 + 0.2;
    int ok = 0, tries = 0;
    for (; tries < 3 && !ok; tries++, sleep_s *= 4) {
        struct am_comm_req *q;
        if (am_iallreduce(c, ds, dr, n, AM_F32, AM_SUM, &q, KERR) < 0)
            die_call(k, "overlap: iallreduce");
        struct timespec ts = {(time_t)sleep_s, (long)((sleep_s - (double)(time_t)sleep_s) * 1e9)};
        nanosleep(&ts, NULL);
        int done = 0;
        if (am_comm_test(q, &done, KERR) < 0 || (!done && am_comm_wait(q, KERR) < 0))
            die_call(k, "overlap: iallreduce");
        ok = reduce_i64(k, c, done, AM_SUM) == am_comm_size(c);
    }
    k->checks++;
    if (!ok)
        failf(k, "overlap: a 16 MiB iallreduce was not complete after the rank slept 5, 20 and 80 times the "
              "blocking call's time (%.3f s) without calling in", (double)slowest * 1e-9);
    else if (k->info.rank == 0)
        printf("comm_check: overlap: a 16 MiB iallreduce completed while the rank slept (%d tr%s; blocking %.3f s)\n",
               tries, tries == 1 ? "y" : "ies", (double)slowest * 1e-9);
    dev_free(ds);
    dev_free(dr);
}

/* COMM_CHECK_STALL: iallreduce #N on world stalls (am_comm_inject_stall) on every rank. It is
 * posted (the watchdog does not time it) until the wait; then it is the oldest call in
 * flight, and a watchdog like the trainer's (a thread that aborts the context when that call
 * has run longer than its timeout, 0.5 s) ends the wait with "aborted". */
struct mini_watchdog {
    struct check *k;
    struct am_flight_view seen;
    int fired;
};

static void *mini_watchdog(void *arg)
{
    struct mini_watchdog *w = arg;
    for (int i = 0; i < 600; i++) {
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
        struct am_flight_view v;
        if (!am_flight_oldest_inflight(&w->k->flight, &v) || am_flight_now() - v.started < 0.5)
            continue;
        w->seen = v;
        w->fired = 1;
        am_comm_ctx_abort(w->k->ctx, "the test's watchdog gave up");
        return NULL;
    }
    return NULL;
}

static int run_stall(struct check *k, struct am_comm *world)
{
    k->gname = "world";
    size_t n = 1 << 20;
    void *d = dev_alloc(n * 4);
    uint64_t seq = am_comm_seq(world) + 1;
    am_comm_inject_stall(world, seq);
    struct am_comm_req *q;
    if (am_iallreduce(world, d, d, n, AM_F32, AM_SUM, &q, KERR) < 0)
        die_call(k, "stall: iallreduce");
    struct am_flight_view v;
    k->checks++;
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL); /* posted: nothing to time yet */
    if (am_flight_oldest_inflight(&k->flight, &v))
        failf(k, "stall: %s #%llu is timed by the watchdog before anything waits for it", v.op,
              (unsigned long long)v.seq);
    struct mini_watchdog w = {.k = k};
    pthread_t th;
    pthread_create(&th, NULL, mini_watchdog, &w);
    double t0 = am_comm_now();
    int rc = am_comm_wait(q, KERR);
    double took = am_comm_now() - t0;
    pthread_join(th, NULL);
    char want[96];
    snprintf(want, sizeof(want), "iallreduce #%llu on group world", (unsigned long long)seq);
    k->checks++;
    if (rc == 0 || !w.fired || !strstr(k->err, want) || !strstr(k->err, "aborted"))
        failf(k, "stall: the wait returned %d after %.2f s (watchdog %s): %s", rc, took, w.fired ? "fired" : "idle",
              k->err);
    else if (strcmp(w.seen.op, "iallreduce") != 0 || w.seen.seq != seq)
        failf(k, "stall: the watchdog timed %s #%llu, not iallreduce #%llu", w.seen.op,
              (unsigned long long)w.seen.seq, (unsigned long long)seq);
    uint64_t id = atomic_load(&k->flight.newest);
    if (!am_flight_get(&k->flight, id, &v) || v.state != AM_FLIGHT_ABORTED)
        failf(k, "stall: the flight entry did not end aborted");
    dev_free(d);
    if (k->failures) {
        fprintf(stderr, "comm_check: rank %d: %ld of %ld checks FAILED\n", k->info.rank, k->failures, k->checks);
        return 1;
    }
    fprintf(stderr, "comm_check: rank %d: stall: %s (after %.2f s)\n", k->info.rank, k->err, took);
    return 0;
}

/* am_shift and am_ishift: each rank must receive its left neighbour's input (a copy of its
 * own on a group of one), blocking and non-blocking alike; overlapping buffers refused. */
static void test_shift(struct check *k, struct am_comm *c, enum am_dtype t, size_t n, uint64_t salt)
{
    int p = am_comm_size(c), r = am_comm_rank(c), left = (r + p - 1) % p;
    for (int nb = 0; nb < 2; nb++) {
        void *s = dev_message(t, c->ranks[r], salt + (uint64_t)nb, n), *d = dev_blank(t, n);
        struct am_comm_req *q = NULL;
        int rc = nb ? am_ishift(c, s, d, n, t, &q, KERR) : am_shift(c, s, d, n, t, KERR);
        if (rc < 0 || (nb && am_comm_wait(q, KERR) < 0))
            die_call(k, nb ? "ishift" : "shift");
        check_message(k, c, nb ? "ishift" : "shift", t, n, left, salt + (uint64_t)nb, d);
        dev_free(s);
    }
    if (n > 1) {
        void *s = dev_blank(t, 2 * n);
        k->checks++;
        if (am_shift(c, s, (char *)s + am_dtype_size(t), n, t, KERR) == 0 || !strstr(k->err, "overlap"))
            failf(k, "shift: overlapping buffers were accepted (or said: %s)", k->err);
        dev_free(s);
    }
}

static void run_group(struct check *k, struct am_comm *c, int is_world)
{
    int p = am_comm_size(c);
    k->gname = am_comm_name(c);
    test_bad_arguments(k, c);
    static const enum am_dtype dtypes[] = {AM_F32, AM_BF16, AM_F16, AM_I32, AM_I64, AM_F64};
    static const enum am_comm_op ops[] = {AM_SUM, AM_MAX, AM_AVG};
    for (int di = 0; di < 6; di++) {
        enum am_dtype t = dtypes[di];
        size_t es = am_dtype_size(t);
        size_t sizes[10];
        int ns = 0;
        sizes[ns++] = 0;
        sizes[ns++] = 1;
        sizes[ns++] = 7;
        if (p > 2)
            sizes[ns++] = (size_t)p - 1;
        sizes[ns++] = (size_t)p + 1;
        sizes[ns++] = 5 * (size_t)p + 3;
        sizes[ns++] = (96 << 10) / es + 1; /* above the small-message threshold */
        if (is_world)
            sizes[ns++] = k->big_bytes / es + 3;
        for (int si = 0; si < ns; si++) {
            size_t n = sizes[si], per_rank = n / (size_t)p + (n % 2); /* reduce_scatter/allgather blocks */
            for (int oi = 0; oi < 3; oi++) {
                uint64_t salt = salt_of(1, di, si, oi, 0);
                test_allreduce(k, c, t, ops[oi], n, 0, salt);
                test_reduce_scatter(k, c, t, ops[oi], per_rank, 0, salt + 1);
            }
            test_allreduce(k, c, t, AM_SUM, n, 1, salt_of(2, di, si, 0, 0));
            test_reduce_scatter(k, c, t, AM_AVG, per_rank, 1, salt_of(3, di, si, 0, 0));
            test_allgather(k, c, t, per_rank, 0, salt_of(4, di, si, 0, 0));
            test_allgather(k, c, t, per_rank, 1, salt_of(5, di, si, 0, 0));
            int roots = n <= 4096 ? p : 1;
            for (int root = 0; root < roots; root++)
                test_broadcast(k, c, t, n, p - 1 - root, salt_of(6, di, si, root, 0));
            test_alltoallv(k, c, t, n / (size_t)p + 1, salt_of(7, di, si, 0, 0));
            test_shift(k, c, t, n, salt_of(9, di, si, 0, 0));
        }
        test_p2p(k, c, t, sizes, ns, salt_of(8, di, 0, 0, 0));
        test_nb_single(k, c, t, sizes, ns, di);
    }
    test_isend(k, c);
    test_nonblocking(k, c);
    for (int i = 0; i < 3; i++)
        if (am_barrier(c, KERR) < 0)
            die_call(k, "barrier");
}

/* ---- a rank that stops mid-collective ------------------------------------------------------ */

static volatile sig_atomic_t die_mode; /* 1 exit, 2 hang, 3 kill; read by the signal handler */

static void on_alarm(int sig)
{
    (void)sig;
    if (die_mode == 1)
        _exit(0);
    if (die_mode == 3)
        kill(getpid(), SIGKILL);
    for (;;)
        pause();
}

/* COMM_CHECK_DIE=R:MODE:isend: every rank but R sends R 8 MiB with am_isend and waits for it
 * with am_send_wait, round after round; R receives them all. */
static int run_die_isend(struct check *k, struct am_comm *world, int who, void *buf, size_t n)
{
    int p = am_comm_size(world);
    for (int i = 0; i < 1000000; i++) {
        int rc = 0;
        if (k->info.rank != who)
            rc = am_isend(world, buf, n, AM_F32, who, KERR) < 0 || am_send_wait(world, KERR) < 0;
        for (int j = 0; j < p && k->info.rank == who && !rc; j++)
            rc = j != who && am_recv(world, buf, n, AM_F32, j, KERR) < 0;
        if (rc) {
            fprintf(stderr, "comm_check: rank %d: %s\n", k->info.rank, k->err);
            return 1;
        }
    }
    fprintf(stderr, "comm_check: rank %d: the dying rank never died\n", k->info.rank);
    return 1;
}

/* COMM_CHECK_DIE=R:MODE:iallreduce: rounds of two 8 MiB iallreduces in flight, waited for in
 * reverse order (the failure surfaces in whichever wait meets it). */
static int run_die_iallreduce(struct check *k, struct am_comm *world, void *a, void *b, size_t n)
{
    for (int i = 0; i < 1000000; i++) {
        struct am_comm_req *q[2];
        if (am_iallreduce(world, a, a, n, AM_F32, AM_SUM, &q[0], KERR) < 0 ||
            am_iallreduce(world, b, b, n, AM_F32, AM_MAX, &q[1], KERR) < 0) {
            fprintf(stderr, "comm_check: rank %d: %s\n", k->info.rank, k->err);
            return 1;
        }
        int rc1 = am_comm_wait(q[1], KERR), rc0 = am_comm_wait(q[0], KERR);
        if (rc0 < 0 || rc1 < 0) {
            fprintf(stderr, "comm_check: rank %d: %s\n", k->info.rank, k->err);
            return 1;
        }
    }
    fprintf(stderr, "comm_check: rank %d: the dying rank never died\n", k->info.rank);
    return 1;
}

static int run_die(struct check *k, struct am_comm *world, const char *spec)
{
    int who = atoi(spec);
    const char *m = strchr(spec, ':');
    size_t n = (8 << 20) / 4;
    float *a = calloc(n, sizeof(float)), *b = calloc(n, sizeof(float));
    void *da = dev_alloc(n * 4), *db = dev_alloc(n * 4);
    if (!a || !b || !da || !db)
        return 1;
    if (k->info.rank == who) {
        die_mode = !m ? 1 : !strncmp(m + 1, "hang", 4) ? 2 : !strncmp(m + 1, "kill", 4) ? 3 : 1;
        signal(SIGALRM, on_alarm);
        struct itimerval it = {.it_value = {0, 300000}};
        setitimer(ITIMER_REAL, &it, NULL);
    }
    if (m && strstr(m + 1, ":isend"))
        return run_die_isend(k, world, who, da, n);
    if (m && strstr(m + 1, ":iallreduce"))
        return run_die_iallreduce(k, world, da, db, n);
    for (int i = 0; i < 1000000; i++)
        if (am_allreduce(world, da, db, n, AM_F32, AM_SUM, KERR) < 0) {
            fprintf(stderr, "comm_check: rank %d: %s\n", k->info.rank, k->err);
            return 1;
        }
    fprintf(stderr, "comm_check: rank %d: the dying rank never died\n", k->info.rank);
    return 1;
}

/* ---- main ------------------------------------------------------------------------------------- */

int main(void)
{
    struct check k = {0};
    char err[1024];
    struct am_boot *boot = am_boot_init(&k.info, err, sizeof(err));
    if (!boot) {
        fprintf(stderr, "comm_check: %s\n", err);
        return 3;
    }
    const char *be = getenv("AM_COMM_BACKEND");
    enum am_comm_backend backend = be && !strcmp(be, "nccl") ? AM_COMM_NCCL : AM_COMM_UCX;
#ifdef COMM_CHECK_CUDA
    backend = AM_COMM_NCCL;
#endif
    const char *to = getenv("AM_COMM_TIMEOUT"), *big = getenv("COMM_CHECK_BIG_BYTES");
    const char *ib = getenv("COMM_CHECK_ISEND_BYTES"), *dev = getenv("COMM_CHECK_DEVICE");
    double timeout = to ? atof(to) : 60;
    k.big_bytes = big ? (size_t)atoll(big) : (size_t)3 << 20;
    k.isend_bytes = ib ? (size_t)atoll(ib) : (size_t)4 << 20;
    double t0 = am_comm_now();
    k.ctx = am_comm_ctx_init(backend, boot, &k.info, dev ? atoi(dev) : k.info.local_rank, timeout, err, sizeof(err));
    if (!k.ctx) {
        fprintf(stderr, "comm_check: rank %d: %s\n", k.info.rank, err);
        return 3;
    }
    if (am_flight_init(&k.flight, 4096, err, sizeof(err)) < 0) {
        fprintf(stderr, "comm_check: rank %d: %s\n", k.info.rank, err);
        return 3;
    }
    am_comm_ctx_set_flight(k.ctx, &k.flight);
    int P = k.info.size, ng = 0;
    int *members[16], sizes[16];
    const char *names[16];
    /* world, reversed world, halves, even/odd, modulo 3 (in reverse order) */
    for (int g = 0; g < 9; g++) {
        int *m = malloc((size_t)P * sizeof(int)), n = 0;
        const char *name = "";
        for (int i = 0; i < P; i++) {
            int r = g == 1 ? P - 1 - i : g >= 6 ? P - 1 - i : i;
            int in = g <= 1 ? 1 : g == 2 ? r < (P + 1) / 2 : g == 3 ? r >= (P + 1) / 2 : g == 4 ? r % 2 == 0
                   : g == 5 ? r % 2 == 1 : r % 3 == g - 6;
            if (in)
                m[n++] = r;
        }
        static const char *const gnames[] = {"world", "rev", "lo", "hi", "even", "odd", "mod3_0", "mod3_1", "mod3_2"};
        name = gnames[g];
        if (n == 0) {
            free(m);
            continue;
        }
        members[ng] = m;
        sizes[ng] = n;
        names[ng] = name;
        ng++;
    }
    struct am_comm *groups[16];
    if (am_comm_create_groups(k.ctx, ng, (const int *const *)members, sizes, names, groups, k.err, sizeof(k.err)) < 0) {
        fprintf(stderr, "comm_check: rank %d: %s\n", k.info.rank, k.err);
        return 3;
    }
#ifdef COMM_CHECK_CUDA
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    for (int g = 0; g < ng; g++)
        am_comm_set_stream(groups[g], stream);
#endif
    double t1 = am_comm_now();
    const char *die = getenv("COMM_CHECK_DIE");
    if (die)
        return run_die(&k, groups[0], die);
    if (getenv("COMM_CHECK_STALL"))
        return run_stall(&k, groups[0]);
    int n_mine = 0;
    for (int g = 0; g < ng; g++)
        if (groups[g]) {
            run_group(&k, groups[g], g == 0);
            n_mine++;
        }
    test_isend_cross(&k, groups[0], groups[1]); /* world and rev: the same ranks */
    test_nb_groups(&k, groups[0], groups[1], ng > 2 ? groups[2] : NULL);
    test_nb_overlap(&k, groups[0]);
    uint64_t left_id;
    void *left_buf = isend_left_pending(&k, groups[0], &left_id);
    double t2 = am_comm_now();
    am_comm_destroy(groups[0]); /* with rank 0's send pending */
    groups[0] = NULL;
    if (am_barrier(groups[1], k.err, sizeof(k.err)) < 0)
        die_call(&k, "barrier after destroying a group with a send pending");
    for (int g = 0; g < ng; g++) {
        am_comm_destroy(groups[g]);
        free(members[g]);
    }
    struct am_flight_view v;
    k.checks++;
    if (left_id && (!am_flight_get(&k.flight, left_id, &v) || v.state != AM_FLIGHT_FAILED))
        failf(&k, "the isend left pending at am_comm_destroy is not recorded as failed");
    am_comm_ctx_fini(k.ctx);
    dev_free(left_buf);
    am_flight_free(&k.flight);
    am_boot_fini(boot);
    if (k.failures) {
        fprintf(stderr, "comm_check: rank %d: %ld of %ld checks FAILED\n", k.info.rank, k.failures, k.checks);
        return 1;
    }
    printf("comm_check: rank %d/%d on %s: %ld checks passed on %d groups (setup %.2f s, checks %.2f s)\n", k.info.rank,
           P, k.info.host, k.checks, n_mine, t1 - t0, t2 - t1);
    return 0;
}
