/* optim.c - AdamW and the learning-rate schedule (optim.h). */
#include "optim.h"

#include <math.h>

int am_optim_init(struct am_optim *o, const struct am_dev *d, size_t n_elems, enum am_dtype dt,
                  const struct am_recipe *r)
{
    *o = (struct am_optim){.dev = d, .n = n_elems, .dt = dt, .beta1 = (float)r->optim.beta1,
                           .beta2 = (float)r->optim.beta2, .eps = (float)r->optim.eps,
                           .weight_decay = (float)r->optim.weight_decay};
    o->mdt[0] = o->mdt[1] = dt;
    if (r->optim.te) {
        o->mdt[0] = r->optim.moment_dtype[0];
        o->mdt[1] = r->optim.moment_dtype[1];
        o->te = AM_TE_ADAM | (r->optim.adam_w_mode ? 0 : AM_TE_L2) | (r->optim.bias_correction ? 0 : AM_TE_NO_BIAS_CORR) |
                (r->param_dtype == AM_BF16 ? AM_TE_GRAD_BF16 : 0);
    }
    o->m_mem = d->k->alloc(d, n_elems * am_dtype_size(o->mdt[0]));
    o->v_mem = d->k->alloc(d, n_elems * am_dtype_size(o->mdt[1]));
    bool rem = r->optim.split_master && dt == AM_BF16;
    if (rem && (o->rem_mem = d->k->alloc(d, n_elems * sizeof(uint16_t)))) {
        struct am_tensor z = am_tensor_view(o->rem_mem, d->device, AM_BF16, (int64_t)n_elems, 0, 0, 0);
        d->k->zero(d, &z);
    }
    if (!o->m_mem || !o->v_mem || (rem && !o->rem_mem)) {
        am_optim_free(o);
        return -1;
    }
    return 0;
}

size_t am_optim_bytes(const struct am_optim *o)
{
    return o->n * (am_dtype_size(o->mdt[0]) + am_dtype_size(o->mdt[1]) + (o->rem_mem ? sizeof(uint16_t) : 0));
}

void am_optim_free(struct am_optim *o)
{
    if (o->dev && o->m_mem)
        o->dev->k->free(o->dev, o->m_mem);
    if (o->dev && o->v_mem)
        o->dev->k->free(o->dev, o->v_mem);
    if (o->dev && o->rem_mem)
        o->dev->k->free(o->dev, o->rem_mem);
    o->m_mem = o->v_mem = o->rem_mem = NULL;
}

void am_optim_step(struct am_optim *o, void *params, const void *grads, enum am_dtype gdt,
                   const struct am_tensor *sumsq, double max_norm, float lr)
{
    enum am_device dev = o->dev->device;
    int64_t n = (int64_t)o->n;
    struct am_tensor p = am_tensor_view(params, dev, o->dt, n, 0, 0, 0);
    struct am_tensor g = am_tensor_view((void *)grads, dev, gdt, n, 0, 0, 0);
    struct am_tensor m = am_tensor_view(o->m_mem, dev, o->mdt[0], n, 0, 0, 0);
    struct am_tensor v = am_tensor_view(o->v_mem, dev, o->mdt[1], n, 0, 0, 0);
    struct am_tensor rem = am_tensor_view(o->rem_mem, dev, AM_BF16, n, 0, 0, 0);
    struct am_adamw_tensor slab = {.param = &p, .m = &m, .v = &v, .grad = &g, .rem = o->rem_mem ? &rem : NULL,
                                   .te = o->te};
    o->step++;
    o->dev->k->adamw_multi(o->dev, &slab, 1, sumsq, max_norm, NULL, lr, o->beta1, o->beta2, o->eps, o->weight_decay,
                           o->step);
}

double am_lr_at(const struct am_recipe *r, long step)
{
    double max_lr = r->optim.lr, min_lr = r->lr.min_lr;
    long warmup = r->lr.warmup_steps;
    long decay = r->lr.decay_steps > 0 ? r->lr.decay_steps : r->steps.max_steps;
    if (warmup > 0 && step <= warmup)
        return max_lr * (double)step / (double)warmup;
    if (r->lr.style == AM_LR_CONSTANT)
        return max_lr;
    if (step > decay || decay <= warmup)
        return min_lr;
    double ratio = (double)(step - warmup) / (double)(decay - warmup);
    double coeff = r->lr.style == AM_LR_LINEAR ? 1.0 - ratio : 0.5 * (cos(M_PI * ratio) + 1.0);
    return min_lr + coeff * (max_lr - min_lr);
}
