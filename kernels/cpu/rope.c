/* rope.c - rotary position embedding in Hugging Face's rotate-half layout.
 *
 * A head of size D is split in halves x1 = x[:D/2], x2 = x[D/2:]; at position t, with
 * c = cos(t * inv_freq_i) and s = sin(t * inv_freq_i) for i < D/2:
 *   forward:  y1 = x1 c - x2 s,   y2 = x2 c + x1 s      (q * cos + rotate_half(q) * sin)
 *   backward: the transpose, a rotation by -angle:
 *             dx1 = dy1 c + dy2 s,  dx2 = dy2 c - dy1 s
 * Both work in place on [B, T, H, D].
 * Partial rotary (glm4_moe's partial_rotary_factor): tables [T, R/2] with R < D rotate the
 * first R dims of each head as a head of size R (halves x[:R/2], x[R/2:R]) and leave the
 * other D - R as they are (transformers' q_rot, q_pass = q[..., :R], q[..., R:]).
 *
 * The tables follow transformers' LlamaRotaryEmbedding operation by operation in fp32,
 * because at position 8000 one ulp of inv_freq moves the angle by ~5e-4:
 *   inv_freq_i = 1 / theta^(float(2i) / D)          (fp32 pow, rounded; fp32 reciprocal)
 *   llama3 (_compute_llama3_parameters), with wavelen = 2π / inv_freq in fp32:
 *     wavelen < original / high_freq_factor: inv_freq unchanged
 *     wavelen > original / low_freq_factor:  inv_freq / factor
 *     otherwise smooth = (original / wavelen - low) / (high - low),
 *               inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
 *   linear (_compute_linear_scaling_rope_parameters): inv_freq / factor
 *   angle = float(t) * inv_freq (fp32 product, as torch's matmul of the two), then cos and sin
 *   of that fp32 angle, computed in double and rounded (torch's fp32 cos is within 1 ulp).
 *   yarn (_compute_yarn_parameters), with p_i = theta^(2i/D) (fp32, as above) and D the
 *   rotated size (R with partial rotary):
 *     extrapolation = 1 / p_i,  interpolation = 1 / (float(factor) * p_i)
 *     low, high = D log(orig / (beta 2π)) / (2 log theta) for beta_fast, beta_slow (double),
 *       floored and ceiled unless truncate is false, then max(low, 0), min(high, D - 1);
 *       high += 0.001 when low == high
 *     ramp_i = clamp((float(i) - low) / (high - low), 0, 1)    (fp32; i < D/2)
 *     e_i = 1 - ramp_i;  inv_freq = interpolation (1 - e_i) + extrapolation e_i
 *     attention factor: attention_factor if given, else get_mscale(factor, mscale) /
 *       get_mscale(factor, mscale_all_dim) when both are set, else get_mscale(factor), with
 *       get_mscale(s, m) = 1 for s <= 1, else 0.1 m ln s + 1 (double; am_yarn_mscale,
 *       kernels.h); it multiplies cos and
 *       sin (fp32 products: GptOssRotaryEmbedding's cos * attention_scaling).
 * theta^e is computed in double and rounded to fp32, i.e. the correctly rounded fp32 pow
 * that torch's (Sleef, 1-ulp) pow returns for these arguments. The attention scaling
 * factor is 1 for default, linear and llama3, so it is not applied there.
 *
 * bf16: x (dx) bf16 is rotated in fp32 and rounded once per element, where torch rounds
 * q * cos, rotate_half(q) * sin and their sum (three roundings). The tables stay fp32 from
 * rope_tables; transformers casts cos and sin to the activations' dtype before use, so a
 * caller that wants its angles exactly converts the tables to bf16 (convert): rope takes
 * f32 or bf16 tables with bf16 x. Each position's heads are widened, rotated by the fp32
 * code and narrowed, one position per task.
 */
#include <math.h>
#include <omp.h>

#include "cpu.h"

/* Python's math.pi * 2, rounded to fp32 as torch does with a scalar operand. */
#define TWO_PI_F ((float)(2.0 * 3.141592653589793))

/* Each fp32 operation rounds on its own, as torch's separate tensor operations do: the
 * intermediates are volatile so that a build allowed to fuse a*b+c (FMA) cannot. */
static bool no_scaling(const struct am_rope_scaling *sc)
{
    return !sc || !sc->type || strcmp(sc->type, "default") == 0;
}

static float scaled_inv_freq(float inv, const struct am_rope_scaling *sc)
{
    if (no_scaling(sc))
        return inv;
    if (strcmp(sc->type, "linear") == 0)
        return inv / (float)sc->factor;
    /* llama3: torch works on fp32 tensors with Python-float operands rounded to fp32 */
    float factor = (float)sc->factor, low = (float)sc->low_freq_factor;
    float span = (float)(sc->high_freq_factor - sc->low_freq_factor); /* a Python float, then fp32 */
    float old = (float)sc->original_max_position_embeddings;
    float low_wavelen = (float)((double)sc->original_max_position_embeddings / sc->low_freq_factor);
    float high_wavelen = (float)((double)sc->original_max_position_embeddings / sc->high_freq_factor);
    volatile float recip = 1.0f / inv;
    float wavelen = recip * TWO_PI_F; /* 2π / inv_freq is reciprocal(inv) * 2π in torch */
    float llama = wavelen > low_wavelen ? inv / factor : inv;
    if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        volatile float rw = 1.0f / wavelen, ratio = rw * old; /* old / wavelen = reciprocal * old */
        volatile float smooth = (ratio - low) / span;
        volatile float a = (1.0f - smooth) * llama, b = smooth * llama;
        llama = a / factor + b;
    }
    return llama;
}

/* yarn's constants (the header's formulas): the ramp's ends, factor and the attention
 * factor as fp32 operands */
struct yarn {
    double low, high;
    float factor, attn;
};

static double yarn_correction_dim(double rot, int64_t D, double theta, double orig)
{
    return ((double)D * log(orig / (rot * 2 * 3.141592653589793))) / (2 * log(theta));
}

static struct yarn yarn_setup(const struct am_rope_scaling *sc, double theta, int64_t D)
{
    struct yarn y;
    double f = sc->factor, orig = (double)sc->original_max_position_embeddings;
    double attn = sc->attention_factor;
    if (attn == 0)
        attn = sc->mscale != 0 && sc->mscale_all_dim != 0
                   ? am_yarn_mscale(f, sc->mscale) / am_yarn_mscale(f, sc->mscale_all_dim)
                   : am_yarn_mscale(f, 1.0);
    double fast = sc->beta_fast != 0 ? sc->beta_fast : 32, slow = sc->beta_slow != 0 ? sc->beta_slow : 1;
    double low = yarn_correction_dim(fast, D, theta, orig), high = yarn_correction_dim(slow, D, theta, orig);
    if (!sc->no_truncate) {
        low = floor(low);
        high = ceil(high);
    }
    y.low = low > 0 ? low : 0;
    y.high = high < (double)(D - 1) ? high : (double)(D - 1);
    if (y.low == y.high)
        y.high += 0.001;
    y.factor = (float)f;
    y.attn = (float)attn;
    return y;
}

/* inv_freq of pair i from p = theta^(2i/D) (fp32), each fp32 operation rounded on its own */
static float yarn_inv_freq(const struct yarn *y, float p, int64_t i)
{
    volatile float extra = 1.0f / p, fp = y->factor * p, inter = 1.0f / fp;
    volatile float num = (float)i - (float)y->low, ramp = num / (float)(y->high - y->low);
    ramp = ramp < 0.0f ? 0.0f : ramp > 1.0f ? 1.0f : ramp;
    volatile float ef = 1.0f - ramp, keep = 1.0f - ef, a = inter * keep, b = extra * ef;
    return a + b;
}

void am_cpu_rope_tables(const struct am_dev *dev, struct am_tensor *tcos, struct am_tensor *tsin, double theta,
                        const struct am_rope_scaling *scaling)
{
    float *c = F32(tcos), *s = F32(tsin);
    int64_t T = am_rows(tcos), half = am_cols(tcos), D = 2 * half;
    AM_CHECK(am_rows(tsin) == T && am_cols(tsin) == half, "cos (%s) and sin (%s) must both be [T, D/2]", am_tname(tcos),
             am_tname(tsin));
    AM_CHECK(theta > 0, "rope_theta %g must be positive", theta);
    bool yarn = !no_scaling(scaling) && strcmp(scaling->type, "yarn") == 0;
    if (!no_scaling(scaling) && !yarn) {
        bool llama3 = strcmp(scaling->type, "llama3") == 0, linear = strcmp(scaling->type, "linear") == 0;
        AM_CHECK(llama3 || linear, "rope_scaling type '%s' is not supported (default, llama3, linear, yarn)",
                 scaling->type);
        AM_CHECK(scaling->factor > 0, "rope_scaling factor %g must be positive", scaling->factor);
        AM_CHECK(linear || (scaling->high_freq_factor > scaling->low_freq_factor && scaling->low_freq_factor > 0 &&
                            scaling->original_max_position_embeddings > 0),
                 "llama3 rope_scaling needs 0 < low_freq_factor (%g) < high_freq_factor (%g) and "
                 "original_max_position_embeddings > 0 (%ld)",
                 scaling->low_freq_factor, scaling->high_freq_factor, scaling->original_max_position_embeddings);
    }
    struct yarn y = {0};
    if (yarn) {
        AM_CHECK(scaling->factor > 0 && scaling->original_max_position_embeddings > 0,
                 "yarn rope_scaling needs factor (%g) > 0 and original_max_position_embeddings (%ld) > 0",
                 scaling->factor, scaling->original_max_position_embeddings);
        y = yarn_setup(scaling, theta, D);
    }
    float base = (float)theta;
    for (int64_t i = 0; i < half; i++) {
        float e = (float)(2 * i) / (float)D;
        float p = (float)pow((double)base, (double)e);
        float inv = yarn ? yarn_inv_freq(&y, p, i) : scaled_inv_freq(1.0f / p, scaling);
        for (int64_t t = 0; t < T; t++) {
            float angle = (float)t * inv;
            c[t * half + i] = (float)cos((double)angle);
            s[t * half + i] = (float)sin((double)angle);
            if (yarn) {
                c[t * half + i] *= y.attn;
                s[t * half + i] *= y.attn;
            }
        }
    }
}

static void check_rope(const char *kernel, const struct am_tensor *x, const struct am_tensor *tcos,
                       const struct am_tensor *tsin)
{
    if (x->ndim != 4)
        am_cpu_fatal(kernel, "x (%s) must be [B, T, H, D], has %d dimensions", am_tname(x), x->ndim);
    int64_t T = x->shape[1], D = x->shape[3], half = am_cols(tcos);
    if (D % 2 || half < 1 || half > D / 2 || am_cols(tsin) != half)
        am_cpu_fatal(kernel, "head size %lld must be even and the tables [T, R/2] with R <= %lld, they are [.., %lld] "
                     "and [.., %lld]", (long long)D, (long long)D, (long long)half, (long long)am_cols(tsin));
    if (am_rows(tcos) < T || am_rows(tsin) < T)
        am_cpu_fatal(kernel, "the tables cover %lld positions, x (%s) has %lld", (long long)am_rows(tcos), am_tname(x),
                     (long long)T);
}

/* Rotates the first 2 half dims of every head (of size D) of one position's H heads by +angle
 * (sign 1) or -angle (sign -1). */
AM_HOT static void rope_rows(float *restrict x, const float *restrict cs, const float *restrict sn, int64_t H,
                             int64_t D, int64_t half, float sign)
{
    for (int64_t h = 0; h < H; h++) {
        float *restrict x1 = x + h * D, *restrict x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float a = x1[i], b = x2[i], c = cs[i], s = sign * sn[i];
            x1[i] = a * c - b * s;
            x2[i] = b * c + a * s;
        }
    }
}

static void rope_apply(const char *kernel, struct am_tensor *x, const struct am_tensor *tcos,
                       const struct am_tensor *tsin, float sign)
{
    float *xd = am_cpu_f32(kernel, "x", x);
    const float *c = am_cpu_f32(kernel, "cos", tcos), *s = am_cpu_f32(kernel, "sin", tsin);
    check_rope(kernel, x, tcos, tsin);
    int64_t B = x->shape[0], T = x->shape[1], H = x->shape[2], D = x->shape[3], half = am_cols(tcos);
#pragma omp parallel for collapse(2) schedule(static) if (am_tensor_numel(x) >= AM_PAR_MIN)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            rope_rows(xd + (b * T + t) * H * D, c + t * half, s + t * half, H, D, half, sign);
}

/* bf16 x and/or tables: the fp32 rotation (rope_rows) on each position's heads widened
 * into the thread's slice of the scratch (with that position's table rows, when bf16), x
 * narrowed back. */
static void rope_apply_bf16(const char *kernel, const struct am_dev *dev, struct am_tensor *x,
                            const struct am_tensor *tcos, const struct am_tensor *tsin, float sign)
{
    am_cpu_act(kernel, "x", x);
    am_cpu_act(kernel, "cos", tcos);
    am_cpu_act(kernel, "sin", tsin);
    AM_CHECK(x->dtype == AM_BF16, "x (%s) is fp32 with %s tables: bf16 tables go with bf16 activations",
             am_tname(x), am_dtype_name(tcos->dtype == AM_F32 ? tsin->dtype : tcos->dtype));
    check_rope(kernel, x, tcos, tsin);
    int64_t B = x->shape[0], T = x->shape[1], H = x->shape[2], D = x->shape[3], half = am_cols(tcos), HD = H * D;
    int64_t per = HD + 2 * half + 32; /* floats of scratch per thread */
    float *ws = am_cpu_scratch(kernel, dev, (int64_t)omp_get_max_threads() * per);
    uint16_t *xd = x->data;
#pragma omp parallel for collapse(2) schedule(static) if (am_tensor_numel(x) >= AM_PAR_MIN)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            float *buf = ws + (size_t)omp_get_thread_num() * (size_t)per, *cb = buf + HD, *sb = cb + half;
            const float *c = (const float *)tcos->data + t * half, *sn = (const float *)tsin->data + t * half;
            if (tcos->dtype == AM_BF16) {
                am_bf16_widen1(cb, (const uint16_t *)tcos->data + t * half, half);
                c = cb;
            }
            if (tsin->dtype == AM_BF16) {
                am_bf16_widen1(sb, (const uint16_t *)tsin->data + t * half, half);
                sn = sb;
            }
            uint16_t *row = xd + (b * T + t) * HD;
            am_bf16_widen1(buf, row, HD);
            rope_rows(buf, c, sn, H, D, half, sign);
            am_bf16_narrow1(row, buf, HD);
        }
}

void am_cpu_rope_forward(const struct am_dev *dev, struct am_tensor *x, const struct am_tensor *tcos, const struct am_tensor *tsin)
{
    if (am_not_f32(x) || am_not_f32(tcos) || am_not_f32(tsin)) {
        rope_apply_bf16(__func__, dev, x, tcos, tsin, 1.0f);
        return;
    }
    rope_apply(__func__, x, tcos, tsin, 1.0f);
}

void am_cpu_rope_backward(const struct am_dev *dev, struct am_tensor *dx, const struct am_tensor *tcos, const struct am_tensor *tsin)
{
    if (am_not_f32(dx) || am_not_f32(tcos) || am_not_f32(tsin)) {
        rope_apply_bf16(__func__, dev, dx, tcos, tsin, -1.0f);
        return;
    }
    rope_apply(__func__, dx, tcos, tsin, -1.0f);
}
