/* swiglu.cu - SwiGLU, out = silu(gate) * up, forward and backward, computing what
 * kernels/cpu/swiglu.c computes, in fp32 (glu.cuh: the kernels GeGLU shares).
 */
#include "glu.cuh"

struct silu_op { /* SwiGLU: silu(g) = g * sigmoid(g) */
    __device__ static float f(float g) { return g / (1.0f + expf(-g)); }
    __device__ static float df(float g)
    {
        float sig = 1.0f / (1.0f + expf(-g));
        return sig * (1.0f + g * (1.0f - sig));
    }
};

void am_cuda_swiglu_forward(const struct am_dev *d, struct am_tensor *out, const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_forward<silu_op>("am_cuda_swiglu_forward", d, out, gate, up);
}

void am_cuda_swiglu_backward(const struct am_dev *d, struct am_tensor *dgate, struct am_tensor *dup, const struct am_tensor *dout,
                             const struct am_tensor *gate, const struct am_tensor *up)
{
    glu_backward<silu_op>("am_cuda_swiglu_backward", d, dgate, dup, dout, gate, up);
}
