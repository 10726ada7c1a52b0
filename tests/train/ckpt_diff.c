/* ckpt_diff - compares two Hugging Face checkpoints tensor by tensor.
 *
 *   ckpt_diff DIR_A DIR_B TOLERANCE
 *
 * Prints the largest absolute difference and the tensor it is in. Exits 0 when both hold
 * the same tensors with the same shapes and every element differs by at most TOLERANCE,
 * 1 otherwise (naming the first tensor missing, mis-shaped or off), 2 on a usage or read
 * error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"

static int read_tensor(const struct am_ckpt *c, const struct am_st_info *info, float **out, struct am_errors *err)
{
    *out = malloc((size_t)info->numel * sizeof(float));
    if (!*out)
        return -1;
    struct am_tensor dst = {.data = *out, .device = AM_DEV_CPU, .dtype = AM_F32, .ndim = info->ndim};
    for (int d = 0; d < info->ndim; d++)
        dst.shape[d] = info->shape[d];
    return am_ckpt_read(c, info->name, NULL, &dst, err);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: ckpt_diff DIR_A DIR_B TOLERANCE\n");
        return 2;
    }
    double tol = atof(argv[3]), worst = 0;
    const char *worst_name = "(none)";
    struct am_errors err;
    am_errors_init(&err);
    struct am_ckpt *a = NULL, *b = NULL;
    int rc = 0;
    if (am_ckpt_open(argv[1], &a, &err) < 0 || am_ckpt_open(argv[2], &b, &err) < 0) {
        fprintf(stderr, "ckpt_diff: %s\n", err.n ? err.msg[0] : "cannot open");
        return 2;
    }
    if (am_ckpt_count(a) != am_ckpt_count(b)) {
        printf("%s holds %zu tensors, %s holds %zu\n", argv[1], am_ckpt_count(a), argv[2], am_ckpt_count(b));
        return 1;
    }
    for (size_t i = 0; i < am_ckpt_count(a) && rc == 0; i++) {
        const char *name = am_ckpt_name(a, i);
        const struct am_st_info *ia = am_ckpt_find(a, name, NULL), *ib = am_ckpt_find(b, name, NULL);
        if (!ib || ib->ndim != ia->ndim || ib->numel != ia->numel ||
            memcmp(ia->shape, ib->shape, (size_t)ia->ndim * sizeof(ia->shape[0])) != 0) {
            printf("%s: %s in %s\n", name, ib ? "another shape" : "missing", argv[2]);
            rc = 1;
            break;
        }
        float *x = NULL, *y = NULL;
        if (read_tensor(a, ia, &x, &err) < 0 || read_tensor(b, ib, &y, &err) < 0) {
            fprintf(stderr, "ckpt_diff: %s\n", err.n ? err.msg[0] : "out of memory");
            rc = 2;
        }
        for (int64_t k = 0; rc == 0 && k < ia->numel; k++) {
            double d = fabs((double)x[k] - (double)y[k]);
            if (!(d <= worst)) { /* NaN counts as worst */
                worst = isnan(d) ? INFINITY : d;
                worst_name = name;
            }
        }
        free(x);
        free(y);
    }
    if (rc == 0) {
        printf("%zu tensors, largest difference %.2g in %s\n", am_ckpt_count(a), worst, worst_name);
        rc = worst <= tol ? 0 : 1;
    }
    am_ckpt_close(a);
    am_ckpt_close(b);
    am_errors_free(&err);
    return rc;
}
