/* fp8_load - the time a rank takes to read a Hugging Face checkpoint's weights into fp32 host
 * memory, as am-train's load does (am_ckpt_read of every weight, into one staging buffer per
 * tensor): for an FP8 checkpoint (its F8_E4M3 weights dequantised, block scales from
 * weight_block_size) against a bf16 one of the same shapes. Used by bench/fp8_load.sh.
 *
 *   bench/fp8_load DIR [B0 B1 [TP]]    B0 B1: the FP8 blocks (absent or 0: not FP8); TP > 1: this
 *                                       rank reads rows [0, R / TP) of each weight, a tp shard
 * Prints "seconds S bytes N" (N: the fp32 bytes written). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "checkpoint.h"

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 4 && argc != 5) {
        fprintf(stderr, "usage: fp8_load DIR [B0 B1 [TP]]\n");
        return 2;
    }
    struct am_errors err;
    am_errors_init(&err);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct am_ckpt *c;
    if (am_ckpt_open(argv[1], &c, &err) < 0) {
        fprintf(stderr, "%s\n", err.msg[0]);
        return 1;
    }
    if (argc >= 4 && atoll(argv[2]) > 0)
        am_ckpt_set_fp8(c, (const int64_t[2]){atoll(argv[2]), atoll(argv[3])});
    int64_t tp = argc == 5 ? atoll(argv[4]) : 1;
    double bytes = 0;
    for (size_t i = 0; i < am_ckpt_count(c); i++) {
        const char *name = am_ckpt_name(c, i);
        const struct am_st_info *t = am_ckpt_find(c, name, NULL);
        if (t->ndim != 2 || strstr(name, "_scale_inv"))
            continue;
        int64_t rows = t->shape[0] / tp, cols = t->shape[1];
        float *buf = malloc((size_t)(rows * cols) * sizeof(float));
        struct am_tensor dst = am_tensor_view(buf, AM_DEV_CPU, AM_F32, rows, cols, 0, 0);
        struct am_ckpt_slice s = am_ckpt_rows(0, rows);
        if (!buf || am_ckpt_read(c, name, tp > 1 ? &s : NULL, &dst, &err) < 0) {
            fprintf(stderr, "%s\n", buf ? err.msg[0] : "out of memory");
            return 1;
        }
        bytes += (double)(rows * cols) * sizeof(float);
        free(buf);
    }
    am_ckpt_close(c);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("seconds %.4f bytes %.0f\n", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec),
           bytes);
    return 0;
}
