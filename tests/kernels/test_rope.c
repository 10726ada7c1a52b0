/* test_rope.c - the CPU kernels' tests (kernels_test.h: how they are tested): the rotary tables
 * and RoPE.
 */
#include "kernels_test.h"

/* ---- RoPE tables ---- */

/* (A) The textbook definition in double: inv_freq_i = theta^(-2i/D), with Llama 3's
 * scaling (transformers' _compute_llama3_parameters) or linear scaling. */
static double ref_inv_freq(double theta, int64_t i, int64_t D, const struct am_rope_scaling *sc)
{
    double inv = 1.0 / pow(theta, (double)(2 * i) / (double)D);
    if (!sc || !sc->type)
        return inv;
    if (strcmp(sc->type, "linear") == 0)
        return inv / sc->factor;
    double old = (double)sc->original_max_position_embeddings;
    double low_wavelen = old / sc->low_freq_factor, high_wavelen = old / sc->high_freq_factor;
    double wavelen = 2 * M_PI / inv;
    if (wavelen < high_wavelen)
        return inv;
    if (wavelen > low_wavelen)
        return inv / sc->factor;
    double smooth = (old / wavelen - sc->low_freq_factor) / (sc->high_freq_factor - sc->low_freq_factor);
    return (1 - smooth) * inv / sc->factor + smooth * inv;
}

/* (B) What transformers computes, step by step in fp32 tensors (LlamaRotaryEmbedding):
 * written here from the Python source, separately from the kernel. Python scalars meet
 * fp32 tensors as fp32; `a / tensor` is tensor.reciprocal() * a. */
static float torch_inv_freq(double theta, int64_t i, int64_t D, const struct am_rope_scaling *sc)
{
    float expo = (float)(2 * i) / (float)D;                   /* arange(0, dim, 2).float() / dim */
    float powered = (float)pow((double)(float)theta, expo);   /* base ** tensor (correctly rounded) */
    float inv = 1.0f / powered;                               /* 1.0 / tensor */
    if (!sc || !sc->type)
        return inv;
    if (strcmp(sc->type, "linear") == 0)
        return inv / (float)sc->factor;                       /* inv_freq /= factor */
    double old = (double)sc->original_max_position_embeddings;
    float low_wl = (float)(old / sc->low_freq_factor), high_wl = (float)(old / sc->high_freq_factor);
    float wavelen = (1.0f / inv) * (float)(2 * M_PI);         /* 2 * math.pi / inv_freq */
    float llama = wavelen > low_wl ? inv / (float)sc->factor : inv;
    if (wavelen >= high_wl && wavelen <= low_wl) {
        float smooth = ((1.0f / wavelen) * (float)old - (float)sc->low_freq_factor) /
                       (float)(sc->high_freq_factor - sc->low_freq_factor);
        float a = (1.0f - smooth) * llama;
        llama = a / (float)sc->factor + smooth * llama;
    }
    return llama;
}

static void test_rope_tables(void **state)
{
    (void)state;
    struct am_rope_scaling llama31 = {.type = "llama3", /* Llama 3.1's published settings */
                                      .factor = 8.0,
                                      .low_freq_factor = 1.0,
                                      .high_freq_factor = 4.0,
                                      .original_max_position_embeddings = 8192};
    struct am_rope_scaling linear4 = {.type = "linear", .factor = 4.0};
    struct {
        double theta;
        int64_t D;
        const struct am_rope_scaling *sc;
    } cases[] = {{10000, 64, NULL},     {10000, 128, NULL},    {500000, 128, NULL}, {500000, 64, NULL},
                 {500000, 128, &llama31}, {10000, 64, &llama31}, {10000, 64, &linear4}};
    const int64_t T = 8192;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t D = cases[c].D, half = D / 2;
        struct arr co = arr_new(T * half), si = arr_new(T * half);
        struct am_tensor tc = tview(&co, T, half, 0, 0), ts = tview(&si, T, half, 0, 0);
        K->rope_tables(&kdev, &tc, &ts, cases[c].theta, cases[c].sc);
        /* (A) position 1 holds sin(inv_freq) and cos(inv_freq); for small angles sin keeps
         * inv_freq's relative precision. The kernel's fp32 inv_freq comes out of at most
         * ten fp32 operations (llama3's smoothing), each rounding once: 16u relative, plus
         * sin's own rounding. */
        double *wants = dalloc(half), *tol = dalloc(half);
        for (int64_t i = 0; i < half; i++) {
            double inv = ref_inv_freq(cases[c].theta, i, D, cases[c].sc);
            wants[i] = sin(inv);
            tol[i] = 16 * U * inv + U * fabs(wants[i]);
        }
        char what[160];
        snprintf(what, sizeof what, "rope inv_freq theta=%g D=%lld %s", cases[c].theta, (long long)D,
                 cases[c].sc ? cases[c].sc->type : "");
        expect_close(what, si.f + half, wants, tol, half);
        /* (B) every position up to 8191: angle = fp32(t * inv_freq) as torch forms it, cos
         * and sin of that angle. Agreement to 1e-6 requires the fp32 order: at position 8000
         * one ulp of inv_freq or of the angle moves cos by up to 5e-4. */
        double *wc = dalloc(T * half), *ws = dalloc(T * half);
        for (int64_t i = 0; i < half; i++) {
            float inv = torch_inv_freq(cases[c].theta, i, D, cases[c].sc);
            for (int64_t t = 0; t < T; t++) {
                float angle = (float)t * inv;
                wc[t * half + i] = cos((double)angle);
                ws[t * half + i] = sin((double)angle);
            }
        }
        snprintf(what, sizeof what, "rope cos theta=%g D=%lld %s", cases[c].theta, (long long)D,
                 cases[c].sc ? cases[c].sc->type : "");
        expect_close_norm(what, co.f, wc, T * half, 0.0, 1e-6);
        snprintf(what, sizeof what, "rope sin theta=%g D=%lld %s", cases[c].theta, (long long)D,
                 cases[c].sc ? cases[c].sc->type : "");
        expect_close_norm(what, si.f, ws, T * half, 0.0, 1e-6);
        free(wants);
        free(tol);
        free(wc);
        free(ws);
        arr_free(&co);
        arr_free(&si);
    }
    /* llama3 scaling leaves the highest frequencies alone and divides the lowest by 8 */
    struct arr co = arr_new(2 * 64), si = arr_new(2 * 64), co8 = arr_new(2 * 64), si8 = arr_new(2 * 64);
    struct am_tensor tc = tview(&co, 2, 64, 0, 0), ts = tview(&si, 2, 64, 0, 0);
    struct am_tensor tc8 = tview(&co8, 2, 64, 0, 0), ts8 = tview(&si8, 2, 64, 0, 0);
    K->rope_tables(&kdev, &tc, &ts, 500000, NULL);
    struct am_rope_scaling deflt = {.type = "default"}; /* rope_type "default": no scaling */
    K->rope_tables(&kdev, &tc8, &ts8, 500000, &deflt);
    expect_bitwise("rope: rope_type default == no scaling", si8.f, si.f, 2 * 64);
    K->rope_tables(&kdev, &tc8, &ts8, 500000, &llama31);
    assert_true(si8.f[64 + 0] == si.f[64 + 0]);                       /* wavelen 2π < 2048 */
    assert_true(fabs(si8.f[64 + 63] - si.f[64 + 63] / 8) < 1e-6 * si.f[64 + 63]); /* wavelen > 8192 */
    arr_free(&co);
    arr_free(&si);
    arr_free(&co8);
    arr_free(&si8);
}

/* ---- yarn (transformers' _compute_yarn_parameters) ----
 * cos and sin [8 positions, 8 pairs] of a head of 16, as transformers 5's rotary embedding
 * returns them (cos(t inv_freq) * attention_scaling, fp32 tensors): gpt-oss's settings (theta
 * 150000, factor 32, beta_fast 32, beta_slow 1, original 4096, truncate false: attention
 * factor 0.1 ln 32 + 1), a truncated one (theta 10000, factor 4, betas absent, original 64)
 * and DeepSeek-V3's form (factor 40, mscale 1, mscale_all_dim 0.8: the factor's ratio). */
static const float yarn_gptoss_cos[8 * 8] = {
    0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
    0x1.748256p-1f, 0x1.50006ap+0f, 0x1.584724p+0f, 0x1.58b702p+0f, 0x1.58b90ap+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
    -0x1.1ee920p-1f, 0x1.36477cp+0f, 0x1.56f1b8p+0f, 0x1.58b0e6p+0f, 0x1.58b902p+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
    -0x1.5545e4p+0f, 0x1.0cdb6ep+0f, 0x1.54b9acp+0f, 0x1.58a6b6p+0f, 0x1.58b8f6p+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
    -0x1.c2a6dap-1f, 0x1.aba9aap-1f, 0x1.51a074p+0f, 0x1.589874p+0f, 0x1.58b8e6p+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
    0x1.8723acp-2f, 0x1.27f8d6p-1f, 0x1.4da81cp+0f, 0x1.58861ep+0f, 0x1.58b8d0p+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
    0x1.4afe1cp+0f, 0x1.2a9c70p-2f, 0x1.48d346p+0f, 0x1.586fb8p+0f, 0x1.58b8b8p+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
    0x1.03e328p+0f, -0x1.3a97b0p-7f, 0x1.432522p+0f, 0x1.58553cp+0f, 0x1.58b898p+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f, 0x1.58b90cp+0f,
};
static const float yarn_gptoss_sin[8 * 8] = {
    0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f,
    0x1.221302p+0f, 0x1.343386p-2f, 0x1.1824b2p-4f, 0x1.2bd272p-7f, 0x1.42462ep-11f, 0x1.9ae80ep-16f, 0x1.7280bap-18f, 0x1.4e1272p-20f,
    0x1.3974a2p+0f, 0x1.2c676cp-1f, 0x1.17c820p-3f, 0x1.2bd0acp-6f, 0x1.42462ep-10f, 0x1.9ae80ep-15f, 0x1.7280bap-17f, 0x1.4e1272p-19f,
    0x1.852da6p-3f, 0x1.af81e4p-1f, 0x1.a2c504p-3f, 0x1.c1b492p-6f, 0x1.e3693cp-10f, 0x1.342e0ap-14f, 0x1.15e08cp-16f, 0x1.f51bacp-19f,
    -0x1.04e31ap+0f, 0x1.0e637ap+0f, 0x1.165696p-2f, 0x1.2bc994p-5f, 0x1.424624p-9f, 0x1.9ae80ep-14f, 0x1.7280bap-16f, 0x1.4e1272p-18f,
    -0x1.4a9028p+0f, 0x1.37579cp+0f, 0x1.5a92b6p-2f, 0x1.76b556p-5f, 0x1.92d7a4p-9f, 0x1.00d10ap-13f, 0x1.cf20eap-16f, 0x1.a1970ep-18f,
    -0x1.81489ap-2f, 0x1.508adcp+0f, 0x1.9de9d2p-2f, 0x1.c19ca6p-5f, 0x1.e36920p-9f, 0x1.342e0ap-13f, 0x1.15e08cp-15f, 0x1.f51bacp-18f,
    0x1.c4f4e2p-1f, 0x1.58b6cep+0f, 0x1.e02f64p-2f, 0x1.063f54p-4f, 0x1.19fd4ap-8f, 0x1.678b0cp-13f, 0x1.4430a4p-15f, 0x1.245024p-17f,
};
static const float yarn_trunc_cos[8 * 8] = {
    0x1.237d38p+0f, 0x1.237d38p+0f, 0x1.237d38p+0f, 0x1.237d38p+0f, 0x1.237d38p+0f, 0x1.237d38p+0f, 0x1.237d38p+0f, 0x1.237d38p+0f,
    0x1.3afc0ap-1f, 0x1.1b5452p+0f, 0x1.231ff6p+0f, 0x1.237ae4p+0f, 0x1.237cfcp+0f, 0x1.237d32p+0f, 0x1.237d38p+0f, 0x1.237d38p+0f,
    -0x1.e5358ap-2f, 0x1.034e90p+0f, 0x1.22086cp+0f, 0x1.2373e4p+0f, 0x1.237c48p+0f, 0x1.237d20p+0f, 0x1.237d36p+0f, 0x1.237d38p+0f,
    -0x1.209272p+0f, 0x1.b98882p-1f, 0x1.20374ep+0f, 0x1.23683cp+0f, 0x1.237b1ep+0f, 0x1.237d02p+0f, 0x1.237d32p+0f, 0x1.237d38p+0f,
    -0x1.7d0f5ep-1f, 0x1.53bb94p-1f, 0x1.1dadc4p+0f, 0x1.2357eap+0f, 0x1.23797cp+0f, 0x1.237cd8p+0f, 0x1.237d2ep+0f, 0x1.237d36p+0f,
    0x1.4abce0p-2f, 0x1.b5d2c0p-2f, 0x1.1a6d6ep+0f, 0x1.2342eep+0f, 0x1.237764p+0f, 0x1.237ca2p+0f, 0x1.237d2ap+0f, 0x1.237d36p+0f,
    0x1.17e114p+0f, 0x1.575660p-3f, 0x1.167860p+0f, 0x1.232948p+0f, 0x1.2374d4p+0f, 0x1.237c60p+0f, 0x1.237d22p+0f, 0x1.237d36p+0f,
    0x1.b78236p-1f, -0x1.a06354p-4f, 0x1.11d124p+0f, 0x1.230afcp+0f, 0x1.2371cap+0f, 0x1.237c14p+0f, 0x1.237d1ap+0f, 0x1.237d36p+0f,
};
static const float yarn_trunc_sin[8 * 8] = {
    0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f,
    0x1.ea8f2ep-1f, 0x1.11f218p-2f, 0x1.d23032p-5f, 0x1.26f696p-7f, 0x1.751b10p-9f, 0x1.d7f22ep-11f, 0x1.2a7c22p-12f, 0x1.798e8ep-14f,
    0x1.090ce2p+0f, 0x1.0a46eap-1f, 0x1.d19b0ep-4f, 0x1.26f438p-6f, 0x1.751ac2p-8f, 0x1.d7f224p-10f, 0x1.2a7c22p-11f, 0x1.798e8ep-13f,
    0x1.491460p-3f, 0x1.7cac54p-1f, 0x1.5c7a0ap-3f, 0x1.ba686ep-6f, 0x1.17d3b2p-7f, 0x1.61f58ep-9f, 0x1.bfba30p-11f, 0x1.1b2aeap-12f,
    -0x1.b9330cp-1f, 0x1.d9c1b4p-1f, 0x1.cf4792p-3f, 0x1.26eac8p-5f, 0x1.751990p-7f, 0x1.d7f1fcp-9f, 0x1.2a7c20p-10f, 0x1.798e8ep-12f,
    -0x1.17841ap+0f, 0x1.0e2872p+0f, 0x1.207656p-2f, 0x1.709ca2p-5f, 0x1.d25ed4p-7f, 0x1.26f72cp-8f, 0x1.751b24p-10f, 0x1.d7f230p-12f,
    -0x1.45c94cp-2f, 0x1.204ff8p+0f, 0x1.58904ep-2f, 0x1.ba4894p-5f, 0x1.17d1aep-6f, 0x1.61f54ep-8f, 0x1.bfba26p-10f, 0x1.1b2ae8p-11f,
    0x1.7f0248p-1f, 0x1.225338p+0f, 0x1.8fcdccp-2f, 0x1.01f6bap-4f, 0x1.46737ep-6f, 0x1.9cf360p-8f, 0x1.052c94p-9f, 0x1.4a5cbcp-11f,
};
static const float yarn_dsv3_cos[8 * 8] = {
    0x1.0e9558p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
    0x1.2464c6p-1f, 0x1.012aa6p+0f, 0x1.0d3b4ap+0f, 0x1.0e818ap+0f, 0x1.0e9470p+0f, 0x1.0e9552p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
    -0x1.c268e0p-2f, 0x1.b47e50p-1f, 0x1.093092p+0f, 0x1.0e4620p+0f, 0x1.0e91b4p+0f, 0x1.0e953ep+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
    -0x1.0be022p+0f, 0x1.3b5deep-1f, 0x1.027f88p+0f, 0x1.0de326p+0f, 0x1.0e8d28p+0f, 0x1.0e951ep+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
    -0x1.61baeep-1f, 0x1.45ee62p-2f, 0x1.f27294p-1f, 0x1.0d58a8p+0f, 0x1.0e86cap+0f, 0x1.0e94f2p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
    0x1.330460p-2f, -0x1.663418p-7f, 0x1.daeb22p-1f, 0x1.0ca6bcp+0f, 0x1.0e7e9ap+0f, 0x1.0e94b8p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
    0x1.03ce5ep+0f, -0x1.5b356cp-2f, 0x1.bea4eap-1f, 0x1.0bcd7ap+0f, 0x1.0e749ap+0f, 0x1.0e9472p+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
    0x1.97fca2p-1f, -0x1.446548p-1f, 0x1.9de83cp-1f, 0x1.0acd04p+0f, 0x1.0e68c6p+0f, 0x1.0e941ep+0f, 0x1.0e9558p+0f, 0x1.0e9558p+0f,
};
static const float yarn_dsv3_sin[8 * 8] = {
    0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f, 0x0.0p+0f,
    0x1.c76048p-1f, 0x1.509684p-2f, 0x1.b03654p-4f, 0x1.9e198ep-6f, 0x1.6300fap-8f, 0x1.d6f482p-11f, 0x1.bb52e4p-16f, 0x1.1861f2p-17f,
    0x1.ec14dep-1f, 0x1.3fe5f8p-1f, 0x1.ae0d8ep-3f, 0x1.9dfb3ep-5f, 0x1.62ffc8p-7f, 0x1.d6f476p-10f, 0x1.bb52e4p-15f, 0x1.1861f2p-16f,
    0x1.317a52p-3f, 0x1.b7c750p-1f, 0x1.3fd9f8p-2f, 0x1.36568cp-4f, 0x1.0a3e5ap-6f, 0x1.61374cp-9f, 0x1.4c7e2ap-14f, 0x1.a492eap-16f,
    -0x1.998e6cp-1f, 0x1.0205eap+0f, 0x1.a57b04p-2f, 0x1.9d820cp-4f, 0x1.62fb02p-6f, 0x1.d6f44ap-9f, 0x1.bb52e4p-14f, 0x1.1861f2p-15f,
    -0x1.03780ep+0f, 0x1.0e91a4p+0f, 0x1.0372fcp-1f, 0x1.023880p-3f, 0x1.bbb548p-6f, 0x1.26589cp-8f, 0x1.1513cep-13f, 0x1.5e7a70p-15f,
    -0x1.2e6bb6p-2f, 0x1.004856p+0f, 0x1.3190d4p-1f, 0x1.358a2ep-3f, 0x1.0a364ap-5f, 0x1.613702p-8f, 0x1.4c7e2ap-13f, 0x1.a492eap-15f,
    0x1.638a10p-1f, 0x1.b1295cp-1f, 0x1.5ca112p-1f, 0x1.68ae8ap-3f, 0x1.369024p-5f, 0x1.9c1556p-8f, 0x1.83e888p-13f, 0x1.eaab68p-15f,
};

static void test_rope_yarn(void **state)
{
    (void)state;
    struct am_rope_scaling gptoss = {.type = "yarn", .factor = 32.0, .original_max_position_embeddings = 4096,
                                     .beta_fast = 32.0, .beta_slow = 1.0, .no_truncate = true};
    struct am_rope_scaling trunc = {.type = "yarn", .factor = 4.0, .original_max_position_embeddings = 64};
    struct am_rope_scaling dsv3 = {.type = "yarn", .factor = 40.0, .original_max_position_embeddings = 4096,
                                   .beta_fast = 32, .beta_slow = 1, .mscale = 1.0, .mscale_all_dim = 0.8};
    struct {
        const char *what;
        double theta;
        const struct am_rope_scaling *sc;
        const float *cos, *sin;
    } cases[] = {{"yarn gpt-oss", 150000.0, &gptoss, yarn_gptoss_cos, yarn_gptoss_sin},
                 {"yarn truncated", 10000.0, &trunc, yarn_trunc_cos, yarn_trunc_sin},
                 {"yarn mscale", 10000.0, &dsv3, yarn_dsv3_cos, yarn_dsv3_sin}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        struct arr co = arr_new(64), si = arr_new(64);
        struct am_tensor tc = tview(&co, 8, 8, 0, 0), ts = tview(&si, 8, 8, 0, 0);
        K->rope_tables(&kdev, &tc, &ts, cases[c].theta, cases[c].sc);
        double wc[64], ws[64], tcl[64], tsl[64];
        /* the same fp32 angles (inv_freq as torch's, operation by operation); torch's cos and
         * sin within an ulp of the correctly rounded, then the product by the factor: a few
         * ulps of the value, and of the factor where cos crosses zero */
        for (int i = 0; i < 64; i++) {
            wc[i] = cases[c].cos[i];
            ws[i] = cases[c].sin[i];
            tcl[i] = 4 * U * (fabs(wc[i]) + 2.0);
            tsl[i] = 4 * U * (fabs(ws[i]) + 2.0 * (i >= 8 && fabs(ws[i]) > 1e-3));
        }
        char what[64];
        snprintf(what, sizeof what, "%s cos", cases[c].what);
        expect_close(what, co.f, wc, tcl, 64);
        snprintf(what, sizeof what, "%s sin", cases[c].what);
        expect_close(what, si.f, ws, tsl, 64);
        arr_free(&co);
        arr_free(&si);
    }
}

/* ---- RoPE forward / backward ---- */

static void ref_rope(const double *x, const double *co, const double *si, int64_t B, int64_t T, int64_t H, int64_t D,
                     double sign, double *y, double *yabs)
{
    int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const double *xr = x + ((b * T + t) * H + h) * D;
                double *yr = y + ((b * T + t) * H + h) * D;
                for (int64_t i = 0; i < half; i++) {
                    double c = co[t * half + i], s = sign * si[t * half + i];
                    yr[i] = xr[i] * c - xr[i + half] * s;
                    yr[i + half] = xr[i + half] * c + xr[i] * s;
                    if (yabs) {
                        yabs[((b * T + t) * H + h) * D + i] = fabs(xr[i] * c) + fabs(xr[i + half] * s);
                        yabs[((b * T + t) * H + h) * D + i + half] = fabs(xr[i + half] * c) + fabs(xr[i] * s);
                    }
                }
            }
}

struct rope_ctx {
    double *x, *co, *si, *R, *y;
    int64_t B, T, H, D;
};

static double rope_loss(void *p)
{
    struct rope_ctx *c = p;
    ref_rope(c->x, c->co, c->si, c->B, c->T, c->H, c->D, 1.0, c->y, NULL);
    double L = 0.0;
    for (int64_t i = 0; i < c->B * c->T * c->H * c->D; i++)
        L += c->y[i] * c->R[i];
    return L;
}

static void test_rope(void **state)
{
    (void)state;
    struct rng r = {17};
    int64_t cases[][4] = {{2, 7, 3, 8}, {1, 1, 2, 4}, {2, 33, 4, 64}}; /* B, T, H, D */
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        int64_t B = cases[c][0], T = cases[c][1], H = cases[c][2], D = cases[c][3], n = B * T * H * D;
        int64_t TT = T + 9; /* tables longer than the sequence */
        struct arr co = arr_new(TT * D / 2), si = arr_new(TT * D / 2);
        struct am_tensor tc = tview(&co, TT, D / 2, 0, 0), ts = tview(&si, TT, D / 2, 0, 0);
        K->rope_tables(&kdev, &tc, &ts, 10000, NULL);
        for (int64_t i = 0; i < TT * D / 2; i++) {
            co.d[i] = co.f[i];
            si.d[i] = si.f[i];
        }
        struct arr x = arr_rand(&r, n, -1, 1), x0 = arr_copy(&x);
        struct am_tensor tx = tview(&x, B, T, H, D);
        K->rope_forward(&kdev, &tx, &tc, &ts);
        double *want = dalloc(n), *absr = dalloc(n), *tol = dalloc(n);
        ref_rope(x0.d, co.d, si.d, B, T, H, D, 1.0, want, absr);
        for (int64_t i = 0; i < n; i++) /* two products and a sum: 3 roundings */
            tol[i] = 3 * U * absr[i];
        expect_close("rope forward", x.f, want, tol, n);
        /* backward rotates dy in place by the opposite angle */
        struct arr g = arr_rand(&r, n, -1, 1), g0 = arr_copy(&g);
        struct am_tensor tg = tview(&g, B, T, H, D);
        K->rope_backward(&kdev, &tg, &tc, &ts);
        ref_rope(g0.d, co.d, si.d, B, T, H, D, -1.0, want, absr);
        for (int64_t i = 0; i < n; i++)
            tol[i] = 3 * U * absr[i];
        expect_close("rope backward", g.f, want, tol, n);
        if (n <= 512) {
            struct rope_ctx ctx = {x0.d, co.d, si.d, g0.d, dalloc(n), B, T, H, D};
            double *fd = dalloc(n);
            fd_grad(rope_loss, &ctx, x0.d, n, fd);
            expect_fd("rope backward vs finite differences", g.f, NULL, fd, tol, n);
            free(fd);
            free(ctx.y);
        }
        /* the backward undoes the forward (a rotation, cos² + sin² = 1 to 2u): 3 roundings
         * each way plus the tables' 2u, relative to the head's largest value */
        K->rope_backward(&kdev, &tx, &tc, &ts);
        double mx = max_abs(x0.d, n);
        for (int64_t i = 0; i < n; i++)
            tol[i] = 10 * U * mx;
        expect_close("rope backward(forward(x)) == x", x.f, x0.d, tol, n);
        free(want);
        free(absr);
        free(tol);
        struct arr *all[] = {&co, &si, &x, &x0, &g, &g0};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++)
            arr_free(all[i]);
    }
}

/* Partial rotary (glm4_moe): tables of a head of R < D rotate the first R dims of each head of
 * D exactly as the whole-head rope of a head of R would, and leave the other D - R as they are,
 * forward and backward. */
static void test_rope_partial(void **state)
{
    (void)state;
    struct rng r = {19};
    int64_t B = 2, T = 9, H = 3, D = 16, R = 8, n = B * T * H * D, nr = B * T * H * R;
    struct arr co = arr_new(T * R / 2), si = arr_new(T * R / 2);
    struct am_tensor tc = tview(&co, T, R / 2, 0, 0), ts = tview(&si, T, R / 2, 0, 0);
    K->rope_tables(&kdev, &tc, &ts, 10000, NULL);
    for (int sign = 1; sign >= -1; sign -= 2) {
        struct arr x = arr_rand(&r, n, -1, 1), x0 = arr_copy(&x), xr = arr_new(nr);
        for (int64_t i = 0; i < B * T * H; i++) /* the rotary part alone, as heads of R */
            memcpy(xr.f + i * R, x.f + i * D, (size_t)R * sizeof(float));
        struct am_tensor tx = tview(&x, B, T, H, D), txr = tview(&xr, B, T, H, R);
        if (sign > 0) {
            K->rope_forward(&kdev, &tx, &tc, &ts);
            K->rope_forward(&kdev, &txr, &tc, &ts);
        } else {
            K->rope_backward(&kdev, &tx, &tc, &ts);
            K->rope_backward(&kdev, &txr, &tc, &ts);
        }
        for (int64_t i = 0; i < B * T * H; i++) {
            assert_memory_equal(x.f + i * D, xr.f + i * R, (size_t)R * sizeof(float));
            assert_memory_equal(x.f + i * D + R, x0.f + i * D + R, (size_t)(D - R) * sizeof(float));
        }
        arr_free(&x);
        arr_free(&x0);
        arr_free(&xr);
    }
    arr_free(&co);
    arr_free(&si);
}

static void test_bf16_rope(void **state)
{
    (void)state;
    struct rng r = {113};
    int64_t shapes[][4] = {{2, 19, 3, 16}, {2, 64, 4, 64}}; /* B, T, H, D; the second in parallel */
    for (int sc = 0; sc < 2; sc++) {
        int64_t B = shapes[sc][0], T = shapes[sc][1], H = shapes[sc][2], D = shapes[sc][3], half = D / 2;
        int64_t n = B * T * H * D;
        float *c = malloc((size_t)(T * half) * 4), *s = malloc((size_t)(T * half) * 4);
        struct am_tensor tc = f32v(c, T, half, 0, 0), ts = f32v(s, T, half, 0, 0);
        K->rope_tables(&kdev, &tc, &ts, 10000.0, NULL);
        struct bt cb = bt_new(T * half), sb = bt_new(T * half); /* the tables in bf16, as transformers uses them */
        struct am_tensor tcb = hv(&cb, T, half, 0, 0), tsb = hv(&sb, T, half, 0, 0);
        K->convert(&kdev, &tcb, &tc);
        K->convert(&kdev, &tsb, &ts);
        K->convert(&kdev, &(struct am_tensor){.data = cb.f, .dtype = AM_F32, .ndim = 1, .shape = {T * half}}, &tcb);
        K->convert(&kdev, &(struct am_tensor){.data = sb.f, .dtype = AM_F32, .ndim = 1, .shape = {T * half}}, &tsb);
        struct am_tensor tcbf = fv(&cb, T, half, 0, 0), tsbf = fv(&sb, T, half, 0, 0);
        for (int bt16 = 0; bt16 < 2; bt16++) {
            struct bt x = bt_rand(&r, n, -1, 1);
            struct am_tensor tx = hv(&x, B, T, H, D), txf = fv(&x, B, T, H, D);
            const struct am_tensor *C16 = bt16 ? &tcb : &tc, *S16 = bt16 ? &tsb : &ts;
            const struct am_tensor *C32 = bt16 ? &tcbf : &tc, *S32 = bt16 ? &tsbf : &ts;
            K->rope_forward(&kdev, &tx, C16, S16);
            K->rope_forward(&kdev, &txf, C32, S32);
            char what[96];
            snprintf(what, sizeof what, "bf16 rope fwd, %s tables, B%lld T%lld H%lld D%lld", bt16 ? "bf16" : "f32",
                     (long long)B, (long long)T, (long long)H, (long long)D);
            expect_bf16(what, x.h, x.f, n);
            for (int64_t i = 0; i < n; i++) /* the backward from the same (bf16) start */
                x.f[i] = am_bf16_to_f32(x.h[i]);
            K->rope_backward(&kdev, &tx, C16, S16);
            K->rope_backward(&kdev, &txf, C32, S32);
            snprintf(what, sizeof what, "bf16 rope bwd, %s tables, B%lld T%lld H%lld D%lld", bt16 ? "bf16" : "f32",
                     (long long)B, (long long)T, (long long)H, (long long)D);
            expect_bf16(what, x.h, x.f, n);
            bt_free(&x);
        }
        free(c);
        free(s);
        bt_free(&cb);
        bt_free(&sb);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rope_tables),
        cmocka_unit_test(test_rope_yarn),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_rope_partial),
        cmocka_unit_test(test_bf16_rope),
    };
    return cmocka_run_group_tests_name("kernels (cpu): rope", tests, kernels_test_setup, NULL);
}
