/* gemma.cu - the layers Gemma 2 and Gemma 3 add to a Llama-style decoder, computing what
 * kernels/cpu/gemma.c computes (the formulas are there): RMSNorm with the fp32 weight 1 + w
 * (rmsnorm.cu's kernels, am_cuda_rms_offset_*) and GeGLU, out = gelu_tanh(gate) * up (glu.cuh's
 * kernels with torch's gelu(approximate="tanh")). Gemma's soft-capped attention and
 * cross-entropy are attention.cu's and crossentropy.cu's kernels with a cap.
 */
#include "glu.cuh"

/* ================= RMSNorm with weight 1 + w ================= */

void am_cuda_rmsnorm_offset_forward(const struct am_dev *d, struct am_tensor *out, struct am_tensor *rstd,
                                    const struct am_tensor *x, const struct am_tensor *w, float eps)
{
    am_cuda_rms_offset_forward("am_cuda_rmsnorm_offset_forward", d, out, rstd, x, w, eps);
}

void am_cuda_rmsnorm_offset_backward(const struct am_dev *d, struct am_tensor *dx, struct am_tensor *dw,
                                     const struct am_tensor *dout, const struct am_tensor *x, const struct am_tensor *w,
                                     const struct am_tensor *rstd)
{
    am_cuda_rms_offset_backward("am_cuda_rmsnorm_offset_backward", d, dx, dw, dout, x, w, rstd);
}

/* ================= GeGLU ================= */

#define GELU_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define GELU_KAPPA 0.044715f

struct gelu_tanh_op { /* GeGLU: torch's gelu(approximate="tanh") and its GeluBackward formula */
    __device__ static float f(float g)
    {
        float inner = GELU_BETA * (g + GELU_KAPPA * (g * g * g));
        return 0.5f * g * (1.0f + tanhf(inner));
    }
    __device__ static float df(float g)
    {
        float g2 = g * g, t = tanhf(GELU_BETA * (g + GELU_KAPPA * (g2 * g)));
        return 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * GELU_BETA * (1.0f + 3.0f * GELU_KAPPA * g2);
    }
};

void am_cuda_geglu_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_forward<gelu_tanh_op>("am_cuda_geglu_forward", d, out, gate, up);
}

void am_cuda_geglu_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                            const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_backward<gelu_tanh_op>("am_cuda_geglu_backward", d, dgate, dup, dout, gate, up);
}
