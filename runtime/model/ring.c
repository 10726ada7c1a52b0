/* ring.c - context parallelism in the model: the zigzag split and ring attention (ring.h). */
#include "ring.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "model_impl.h"
#include "util.h"

static int mod(int a, int p) { return ((a % p) + p) % p; }

/* n rounded up to a multiple of 64 bytes (each ring buffer starts aligned). */
static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

void am_cp_positions(int64_t T, int cp, int rank, int32_t *pos)
{
    int64_t c = T / (2 * cp);
    for (int64_t i = 0; i < c; i++) {
        pos[i] = (int32_t)(rank * c + i);
        pos[c + i] = (int32_t)((2 * cp - 1 - rank) * c + i);
    }
}

/* A pair of rotary tables (cos, sin) at this rank's positions: the whole sequence's (theta,
 * scaling), built in mem, then its two chunks' rows copied in. */
static void tables_at(struct am_model *m, struct am_cp *c, void *mem, struct am_tensor *cos, struct am_tensor *sin,
                      double theta, const struct am_rope_scaling *scaling)
{
    const struct am_kernels *K = m->K;
    int64_t T = c->seq_len, half = am_model_rotary_dim(&m->cfg) / 2, ch = T / (2 * c->size);
    size_t bytes = (size_t)(T * half) * sizeof(float);
    struct am_tensor fc = am_tensor_view(mem, m->dev->device, AM_F32, T, half, 0, 0);
    struct am_tensor fs = am_tensor_view((char *)mem + bytes, m->dev->device, AM_F32, T, half, 0, 0);
    K->rope_tables(m->dev, &fc, &fs, theta, scaling);
    int64_t from[2] = {c->rank * ch, (2 * c->size - 1 - c->rank) * ch};
    for (int i = 0; i < 2; i++) {
        const struct am_tensor *full[2] = {&fc, &fs};
        struct am_tensor *mine[2] = {cos, sin};
        for (int t = 0; t < 2; t++) {
            struct am_tensor dst = am_tensor_view((float *)mine[t]->data + i * ch * half, m->dev->device, AM_F32,
                                                  ch * half, 0, 0, 0);
            struct am_tensor src = am_tensor_view((float *)full[t]->data + from[i] * half, m->dev->device, AM_F32,
                                                  ch * half, 0, 0, 0);
            K->copy(m->dev, &dst, &src);
        }
    }
    K->sync(m->dev);
}

/* The rotary tables at this rank's positions: the model's, and Gemma 3's sliding layers'
 * (their own theta, unscaled, as model.c builds them). */
static int rope_at_positions(struct am_model *m, struct am_cp *c, char *err, size_t err_len)
{
    const struct am_kernels *K = m->K;
    const struct am_model_config *cfg = &m->cfg;
    int64_t T = c->seq_len, half = am_model_rotary_dim(cfg) / 2;
    size_t bytes = (size_t)(T * half) * sizeof(float);
    void *mem = K->alloc(m->dev, 2 * bytes);
    if (!mem)
        return am_fail(err, err_len, "context parallelism: out of memory for the rotary tables of %lld positions",
                       (long long)T);
    struct am_rope_scaling rs = am_model_rope_scaling(cfg);
    tables_at(m, c, mem, &m->cos, &m->sin, cfg->rope_theta, &rs);
    if (cfg->rope_local_base_freq > 0)
        tables_at(m, c, mem, &m->cos_local, &m->sin_local, cfg->rope_local_base_freq, NULL);
    K->free(m->dev, mem);
    return 0;
}

int am_cp_init(struct am_model *m, struct am_comm *cp, int64_t seq_len, char *err, size_t err_len)
{
    int P = am_comm_size(cp);
    if (P < 2)
        return 0;
    if (seq_len % (2 * P) || m->seq_len * P != seq_len)
        return am_fail(err, err_len, "context parallelism: a sequence of %lld tokens does not split into 2 x cp = %d "
                       "chunks of equal length (dataset.seq_length must be a multiple of %d)", (long long)seq_len,
                       2 * P, 2 * P);
    struct am_cp *c = calloc(1, sizeof(*c));
    if (!c)
        return am_fail(err, err_len, "context parallelism: out of memory");
    c->comm = cp;
    c->size = P;
    c->rank = am_comm_rank(cp);
    c->seq_len = seq_len;
    const char *ov = getenv("AM_RING_OVERLAP");
    c->overlap = !(ov && strcmp(ov, "0") == 0);
    /* each buffer at what it holds (multi-head latent attention: k at qk_nope + qk_rope a head, v
     * at v_head_dim; ring.h) */
    int64_t Tl = m->seq_len, qk = am_model_qk_head_dim(&m->cfg), vd = am_model_v_head_dim(&m->cfg);
    int64_t kn = m->max_tokens * m->kv_heads * qk, vn = m->max_tokens * m->kv_heads * vd;
    size_t kb = align64((size_t)kn * am_dtype_size(m->act_dt)); /* k, v: the compute dtype */
    size_t vb = align64((size_t)vn * am_dtype_size(m->act_dt));
    size_t gk = align64((size_t)kn * sizeof(float)); /* dk, dv sums: fp32 */
    size_t gv = align64((size_t)vn * sizeof(float));
    /* bf16: the running out (heads x v wide) and dq sum (heads x qk wide) share one, the wider */
    int64_t an = m->max_tokens * m->heads * (qk > vd ? qk : vd);
    size_t accb = m->act_dt == AM_F32 ? 0 : align64((size_t)an * sizeof(float));
    size_t posb = align64((size_t)(P * Tl) * sizeof(int32_t));
    c->bytes = posb + 2 * (kb + vb) + 3 * (gk + gv) + accb;
    c->mem = m->K->alloc(m->dev, c->bytes);
    if (!c->mem) {
        size_t bytes = c->bytes;
        free(c);
        return am_fail(err, err_len, "context parallelism: out of memory for %zu bytes of ring buffers", bytes);
    }
    char *p = c->mem;
    c->pos = (int32_t *)p;
    p += posb;
    for (int b = 0; b < 2; b++) {
        c->kv[b][0] = p;
        p += kb;
        c->kv[b][1] = p;
        p += vb;
        c->dkv[b][0] = p;
        p += gk;
        c->dkv[b][1] = p;
        p += gv;
    }
    c->part[0] = p;
    c->part[1] = p + gk;
    c->acc = accb ? p + gk + gv : NULL;
    int32_t *host = malloc((size_t)(P * Tl) * sizeof(int32_t));
    if (!host) {
        m->K->free(m->dev, c->mem);
        free(c);
        return am_fail(err, err_len, "context parallelism: out of memory");
    }
    for (int r = 0; r < P; r++)
        am_cp_positions(seq_len, P, r, host + r * Tl);
    m->K->upload(m->dev, c->pos, host, (size_t)(P * Tl) * sizeof(int32_t));
    free(host);
    m->cp = c;
    m->act_bytes += c->bytes;
    return rope_at_positions(m, c, err, err_len);
}

void am_cp_free(struct am_model *m)
{
    if (!m->cp)
        return;
    if (m->cp->mem && m->K)
        m->K->free(m->dev, m->cp->mem);
    free(m->cp);
    m->cp = NULL;
}

/* Rank r's positions, as a tensor. */
static struct am_tensor pos_of(const struct am_model *m, int r)
{
    int64_t Tl = m->seq_len;
    return am_tensor_view(m->cp->pos + r * Tl, m->dev->device, AM_I32, Tl, 0, 0, 0);
}

/* A tensor of t's shape and dtype over buffer p. */
static struct am_tensor like(const struct am_tensor *t, void *p)
{
    struct am_tensor v = *t;
    v.data = p;
    return v;
}

/* An fp32 tensor of t's shape over buffer p (the ring's sums). */
static struct am_tensor like_f32(const struct am_tensor *t, void *p)
{
    struct am_tensor v = like(t, p);
    v.dtype = AM_F32;
    return v;
}

/* Starts the shift of the k and v block (kb, vb) into buffers (nk, nv): two ishifts (v's heads
 * may be narrower than k's: multi-head latent attention's v_head_dim; each buffer is as wide as
 * what it receives, k's or v's, am_cp_init). */
static int shift_kv(struct am_cp *c, const struct am_tensor *kb, const struct am_tensor *vb, void *nk, void *nv,
                    struct am_comm_req **q, char *err, size_t err_len)
{
    if (am_ishift(c->comm, kb->data, nk, (size_t)am_tensor_numel(kb), kb->dtype, &q[0], err, err_len) < 0)
        return -1;
    return am_ishift(c->comm, vb->data, nv, (size_t)am_tensor_numel(vb), vb->dtype, &q[1], err, err_len);
}

/* Whether any of this rank's rows may see a key of rank r's block under a sliding window of
 * W (W <= 0: always): some pair of their zigzag chunks, queries [a, a + ch) and keys
 * [b, b + ch), with a difference of positions q - k in 0 .. W - 1. */
static bool block_seen(const struct am_cp *c, int r, int64_t W)
{
    if (W <= 0)
        return true;
    int64_t ch = c->seq_len / (2 * c->size);
    int64_t mine[2] = {c->rank * ch, (2 * c->size - 1 - c->rank) * ch}, theirs[2] = {r * ch, (2 * c->size - 1 - r) * ch};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            if (mine[i] + ch - 1 - theirs[j] >= 0 && mine[i] - theirs[j] - ch + 1 <= W - 1)
                return true;
    return false;
}

/* Waits for the two requests (both released whatever happens). */
static int wait2(struct am_cp *c, struct am_comm_req **q, char *err, size_t err_len)
{
    double t0 = am_mono_time();
    int rc = am_comm_wait_all(q, 2, err, err_len);
    c->wait_s += am_mono_time() - t0;
    return rc;
}

int am_cp_attention_forward(struct am_model *m, struct am_tensor *out, struct am_tensor *lse, const struct am_tensor *q,
                            const struct am_tensor *k, const struct am_tensor *v, const struct am_tensor *qstart,
                            int64_t window, float scale, float softcap, char *err, size_t err_len)
{
    struct am_cp *c = m->cp;
    struct am_tensor hk = *k, hv = *v, mine = pos_of(m, c->rank); /* the block held: this rank's own first */
    struct am_comm_req *rq[2] = {NULL, NULL};
    struct am_tensor run = c->acc ? like_f32(out, c->acc) : *out; /* the running merge: fp32 */
    for (int s = 0; s < c->size; s++) {
        bool more = s + 1 < c->size;
        struct am_tensor kp = pos_of(m, mod(c->rank - s, c->size));
        if (more && shift_kv(c, &hk, &hv, c->kv[s % 2][0], c->kv[s % 2][1], rq, err, err_len) < 0) {
            am_comm_wait_all(rq, 2, NULL, 0);
            return -1;
        }
        if (more && !c->overlap && wait2(c, rq, err, err_len) < 0) /* AM_RING_OVERLAP=0: the shift alone */
            return -1;
        double t0 = am_mono_time();
        if (s == 0 || block_seen(c, mod(c->rank - s, c->size), window)) /* step 0: the diagonal */
            m->K->attention_block_softcap_forward(m->dev, &run, lse, q, &hk, &hv, &mine, &kp, qstart, window, s > 0,
                                                  scale, softcap);
        c->block_s += am_mono_time() - t0;
        if (more) {
            if (wait2(c, rq, err, err_len) < 0)
                return -1;
            hk = like(k, c->kv[s % 2][0]);
            hv = like(v, c->kv[s % 2][1]);
        }
    }
    if (c->acc) /* bf16: rounded once, after the last block */
        m->K->convert(m->dev, out, &run);
    return 0;
}

int am_cp_attention_backward(struct am_model *m, struct am_tensor *dq, struct am_tensor *dk, struct am_tensor *dv,
                             const struct am_tensor *dout, const struct am_tensor *out, const struct am_tensor *lse,
                             const struct am_tensor *q, const struct am_tensor *k, const struct am_tensor *v,
                             const struct am_tensor *qstart, int64_t window, float scale, float softcap, char *err,
                             size_t err_len)
{
    struct am_cp *c = m->cp;
    const struct am_kernels *K = m->K;
    struct am_tensor hk = *k, hv = *v, mine = pos_of(m, c->rank);
    struct am_comm_req *rkv[2] = {NULL, NULL}, *rd[2] = {NULL, NULL};
    struct am_tensor gq = c->acc ? like_f32(dq, c->acc) : *dq; /* dq's sum over the blocks: fp32 */
    int rc = 0;
    if (c->acc)
        K->zero(m->dev, &gq);
    for (int s = 0; s < c->size && rc == 0; s++) {
        bool more = s + 1 < c->size;
        struct am_tensor kp = pos_of(m, mod(c->rank - s, c->size));
        if (more && (shift_kv(c, &hk, &hv, c->kv[s % 2][0], c->kv[s % 2][1], rkv, err, err_len) < 0 ||
                     (!c->overlap && wait2(c, rkv, err, err_len) < 0))) {
            rc = -1;
            break;
        }
        /* this step's terms for the block held: into the sums that start here (step 0), or
         * into part, added to the sums that arrived with the block */
        struct am_tensor tk = like_f32(k, s == 0 ? c->dkv[1][0] : c->part[0]);
        struct am_tensor tv = like_f32(v, s == 0 ? c->dkv[1][1] : c->part[1]);
        K->zero(m->dev, &tk);
        K->zero(m->dev, &tv);
        double t0 = am_mono_time();
        if (s == 0 || block_seen(c, mod(c->rank - s, c->size), window))
            K->attention_block_softcap_backward(m->dev, &gq, &tk, &tv, dout, out, lse, q, &hk, &hv, &mine, &kp, qstart,
                                                window, scale, softcap);
        c->block_s += am_mono_time() - t0;
        struct am_tensor ak = tk, av = tv; /* the sums sent onward */
        if (s > 0) {
            if (c->overlap && wait2(c, rd, err, err_len) < 0) {
                rc = -1;
                break;
            }
            ak = like_f32(k, c->dkv[(s - 1) % 2][0]);
            av = like_f32(v, c->dkv[(s - 1) % 2][1]);
            K->add(m->dev, &ak, &tk);
            K->add(m->dev, &av, &tv);
        }
        if (shift_kv(c, &ak, &av, c->dkv[s % 2][0], c->dkv[s % 2][1], rd, err, err_len) < 0 ||
            (!c->overlap && wait2(c, rd, err, err_len) < 0) || (more && c->overlap && wait2(c, rkv, err, err_len) < 0)) {
            rc = -1;
            break;
        }
        hk = like(k, c->kv[s % 2][0]);
        hv = like(v, c->kv[s % 2][1]);
    }
    if (rc < 0) {
        am_comm_wait_all(rkv, 2, NULL, 0);
        am_comm_wait_all(rd, 2, NULL, 0);
        return -1;
    }
    /* the sums of this rank's own block, back from around the ring */
    if (c->overlap && wait2(c, rd, err, err_len) < 0)
        return -1;
    struct am_tensor ok = like_f32(k, c->dkv[(c->size - 1) % 2][0]), ov = like_f32(v, c->dkv[(c->size - 1) % 2][1]);
    K->add(m->dev, dk, &ok); /* bf16: each sum rounded once, here */
    K->add(m->dev, dv, &ov);
    if (c->acc)
        K->add(m->dev, dq, &gq);
    return 0;
}
