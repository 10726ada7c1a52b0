/* table.c - the CUDA backend's table of kernels (the functions: the .cu files beside it).
 *
 * A NULL entry is a kernel this backend does not have yet: am_dev_open refuses a context
 * on a table with holes and names them (am_kernels_missing, kernels.c), so that nothing
 * half-works; this one is complete. Attention is attention.cu's: cuDNN's fused attention
 * (attention_cudnn.cu) where the build has cuDNN and cuDNN has the case, the backend's own
 * kernels otherwise. */
#include "cuda_impl.h"

static const struct am_kernels cuda_kernels = {
    .name = "cuda",
    .device = AM_DEV_CUDA,
    .open = am_cuda_open,
    .close = am_cuda_close,
    .sync = am_cuda_sync,
    .alloc = am_cuda_alloc,
    .free = am_cuda_free,
    .upload = am_cuda_upload,
    .download = am_cuda_download,
    .zero = am_cuda_zero,
    .copy = am_cuda_copy,
    .mem_stats = am_cuda_mem_stats,
    .reserve = am_cuda_reserve,
    .add = am_cuda_add,
    .scale = am_cuda_scale,
    .convert = am_cuda_convert,
    .sum_squares = am_cuda_sum_squares,
    .all_finite = am_cuda_all_finite,
    .matmul_forward = am_cuda_matmul_forward,
    .matmul_backward = am_cuda_matmul_backward,
    .embedding_forward = am_cuda_embedding_forward,
    .embedding_backward = am_cuda_embedding_backward,
    .rmsnorm_forward = am_cuda_rmsnorm_forward,
    .rmsnorm_backward = am_cuda_rmsnorm_backward,
    .rope_tables = am_cuda_rope_tables,
    .rope_forward = am_cuda_rope_forward,
    .rope_backward = am_cuda_rope_backward,
    .attention_forward = am_cuda_attention_forward,
    .attention_backward = am_cuda_attention_backward,
    .attention_block_forward = am_cuda_attention_block_forward,
    .attention_block_backward = am_cuda_attention_block_backward,
    .swiglu_forward = am_cuda_swiglu_forward,
    .swiglu_backward = am_cuda_swiglu_backward,
    .moe_route_forward = am_cuda_moe_route_forward,
    .moe_route_backward = am_cuda_moe_route_backward,
    .moe_aux_stats = am_cuda_moe_aux_stats,
    .moe_aux_loss = am_cuda_moe_aux_loss,
    .moe_plan = am_cuda_moe_plan,
    .moe_permute_forward = am_cuda_moe_permute_forward,
    .moe_permute_backward = am_cuda_moe_permute_backward,
    .moe_combine_forward = am_cuda_moe_combine_forward,
    .moe_combine_backward = am_cuda_moe_combine_backward,
    .grouped_matmul_forward = am_cuda_grouped_matmul_forward,
    .grouped_matmul_backward = am_cuda_grouped_matmul_backward,
    .ce_stats = am_cuda_ce_stats,
    .ce_backward = am_cuda_ce_backward,
    .ce_rescale = am_cuda_ce_rescale,
    .ce_loss = am_cuda_ce_loss,
    .ce_fused = am_cuda_ce_fused,
    .adamw = am_cuda_adamw,
    .adamw_multi = am_cuda_adamw_multi,
};

const struct am_kernels *am_kernels_cuda(void) { return &cuda_kernels; }
