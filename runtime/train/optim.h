/* optim.h - AdamW over a model's parameter slab, and the learning-rate schedule.
 *
 * The optimizer keeps Adam's two moments in two slabs parallel to the parameters, so one
 * kernel call updates every parameter (torch.optim.AdamW semantics, or Transformer Engine's
 * FusedAdam's with that optimizer in the recipe; weight decay applied to every parameter as
 * AutoModel's default optimizer does), the gradient clipping and the skip of a non-finite
 * step decided on the device in that same call.
 *
 * The schedule is AutoModel's (Megatron's OptimizerParamScheduler): linear warm-up from 0
 * over lr_warmup_steps, then constant, linear or cosine decay to min_lr at lr_decay_steps
 * (default max_steps), min_lr after. Step s (0-based) of the optimizer uses am_lr_at(s).
 */
#ifndef AM_OPTIM_H
#define AM_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "recipe.h"

struct am_optim {
    const struct am_dev *dev;
    void *m_mem, *v_mem;
    size_t n;
    enum am_dtype dt; /* the masters' dtype (the parameters' for torch's AdamW: fp32, or bf16
                         with bf16 parameters; FusedAdam's master_weight_dtype with its
                         master_weights) */
    enum am_dtype mdt[2]; /* the moments' (m, v): torch's AdamW keeps them in the parameters'
                             dtype, FusedAdam in its exp_avg_dtype and exp_avg_sq_dtype */
    unsigned te;          /* 0: torch's AdamW; FusedAdam: AM_TE_ADAM and its options (kernels.h) */
    void *rem_mem;        /* FusedAdam's store_param_remainders (recipe optim.split_master): the
                             fp32 masters' low halves, n 16-bit words beside the bf16 parameters
                             (kernels.h, am_adamw_tensor.rem), zero at first as TE's; else NULL */
    int64_t step; /* optimizer steps taken */
    float beta1, beta2, eps, weight_decay;
};

int am_optim_init(struct am_optim *o, const struct am_dev *d, size_t n_elems, enum am_dtype dt,
                  const struct am_recipe *r);
void am_optim_free(struct am_optim *o);
/* The bytes it allocated: the moments, and the remainders when it keeps them. */
size_t am_optim_bytes(const struct am_optim *o);
/* One AdamW step over params (o->n elements of o->dt) given grads (o->n of gdt: fp32; with
 * bf16 parameters rounded to bf16 first, as FSDP2 casts the reduced gradient to the
 * parameters' dtype, then clipped in bf16: kernels.h; or, with bf16 parameters, bf16 already:
 * FSDP2's bf16 gradient shards), both on the device, in one
 * kernel call that reads nothing back (adamw_multi, kernels.h): with max_norm > 0 the
 * gradients are clipped to the global norm max_norm (coefficient max_norm / (norm + 1e-6),
 * applied when below 1), norm = sqrt of the device scalar sumsq (AM_F64 or AM_F32: the one
 * am_model_read_scalars reads, am_model_sumsq); and when sumsq is an Inf or a NaN (a
 * gradient is not finite) the step is skipped on the device, nothing written (the trainer
 * then fails the step, having read the same value). sumsq may be NULL without clipping. */
void am_optim_step(struct am_optim *o, void *params, const void *grads, enum am_dtype gdt,
                   const struct am_tensor *sumsq, double max_norm, float lr);

double am_lr_at(const struct am_recipe *r, long step);

#endif
