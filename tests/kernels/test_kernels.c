/* test_kernels.c - the CPU kernels' tests (kernels_test.h: how they are tested): the table, the
 * device context and the checks: a wrong shape or dtype is a caller's bug (the kernel names it
 * and aborts), the CUDA context where there is no GPU.
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef AM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "kernels_test.h"
#include "cpu/cpu.h" /* the backend's private helpers (am_expf, am_cpu_set_chunk), used directly */

/* ---- a wrong shape is a caller's bug: the kernel names it and aborts ---- */

static void test_bad_shape_aborts(void **state)
{
    (void)state;
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(pipefd[1], 2);
        float a[6] = {0}, b[6] = {0}, c[4] = {0};
        struct am_tensor x = am_tensor_view(a, AM_DEV_CPU, AM_F32, 2, 3, 0, 0);
        struct am_tensor w = am_tensor_view(b, AM_DEV_CPU, AM_F32, 3, 2, 0, 0); /* K mismatch */
        struct am_tensor y = am_tensor_view(c, AM_DEV_CPU, AM_F32, 2, 2, 0, 0);
        w.name = "model.layers.0.mlp.up_proj.weight";
        K->matmul_forward(&kdev, &y, &x, &w);
        _exit(0);
    }
    close(pipefd[1]);
    char msg[512] = {0};
    ssize_t got = 0, rd;
    while ((rd = read(pipefd[0], msg + got, sizeof msg - 1 - (size_t)got)) > 0)
        got += rd;
    close(pipefd[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    assert_non_null(strstr(msg, "am_cpu_matmul_forward"));
    assert_non_null(strstr(msg, "model.layers.0.mlp.up_proj.weight"));
}

/* A wrong dtype is a caller's bug: the kernel names itself, the tensor and the rule. */
static void bad_dtype_call(int which)
{
    uint16_t h[64] = {0};
    float f[64] = {0};
    struct am_tensor x16 = am_tensor_view(h, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor xh = am_tensor_view(h, AM_DEV_CPU, AM_F16, 4, 4, 0, 0);
    struct am_tensor x32 = am_tensor_view(f, AM_DEV_CPU, AM_F32, 4, 4, 0, 0);
    struct am_tensor w16 = am_tensor_view(h + 16, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor w32 = am_tensor_view(f + 16, AM_DEV_CPU, AM_F32, 4, 4, 0, 0);
    struct am_tensor y16 = am_tensor_view(h + 32, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor dw16 = am_tensor_view(h + 48, AM_DEV_CPU, AM_BF16, 4, 4, 0, 0);
    struct am_tensor n16 = am_tensor_view(h + 16, AM_DEV_CPU, AM_BF16, 4, 0, 0, 0);
    struct am_tensor n32 = am_tensor_view(f + 16, AM_DEV_CPU, AM_F32, 4, 0, 0, 0);
    struct am_tensor r16 = am_tensor_view(h + 48, AM_DEV_CPU, AM_BF16, 4, 0, 0, 0);
    xh.name = "model.layers.0.mlp.act";
    dw16.name = "model.layers.0.mlp.up_proj.weight.grad";
    n32.name = "model.norm.weight";
    r16.name = "model.norm.rstd";
    switch (which) {
    case 0: K->matmul_forward(&kdev, &y16, &xh, &w16); break;                 /* f16 */
    case 1: K->matmul_backward(&kdev, NULL, &dw16, &x32, &x32, &w32); break;  /* bf16 dw, f32 x */
    case 2: K->rmsnorm_forward(&kdev, &y16, &n32, &x16, &n32, 1e-5f); break; /* f32 w, bf16 x */
    case 3: K->rmsnorm_forward(&kdev, &y16, &r16, &x16, &n16, 1e-5f); break; /* bf16 rstd */
    }
}

static void test_bf16_bad_dtype_aborts(void **state)
{
    (void)state;
    const char *want[][4] = {
        {"am_cpu_matmul_forward", "model.layers.0.mlp.act", "fp16", "fp32 or bf16"},
        {"am_cpu_matmul_backward", "model.layers.0.mlp.up_proj.weight.grad", "bf16 when the activations are bf16", ""},
        {"am_cpu_rmsnorm_forward", "model.norm.weight", "share one dtype", "fp32"},
        {"am_cpu_rmsnorm_forward", "model.norm.rstd", "statistics", "stay fp32"},
    };
    for (int c = 0; c < 4; c++)
        expect_abort(bad_dtype_call, c, want[c], 4);
}

/* The CUDA device context where there is no GPU (this test runs in CI, on CPUs): a build
 * without CUDA says so; a build with CUDA fails cleanly with "no CUDA device" and the
 * CUDA runtime's reason, leaving the context zeroed. The tables: the CPU's is complete, the
 * CUDA backend's names what it lacks (am_dev_open refuses it on a GPU for that). */
static void test_cuda_context(void **state)
{
    (void)state;
    char msg[512] = "", missing[512];
    struct am_dev d;
    memset(&d, 0x5a, sizeof d);
    assert_int_equal(am_kernels_missing(am_kernels_cpu(), missing, sizeof missing), 0);
    assert_string_equal(missing, "");
#ifdef AM_HAVE_CUDA
    const struct am_kernels *ck = am_kernels_for(AM_DEV_CUDA);
    assert_non_null(ck);
    assert_ptr_equal(ck, am_kernels_cuda());
    assert_string_equal(ck->name, "cuda");
    assert_int_equal(ck->device, AM_DEV_CUDA);
    int n = am_kernels_missing(ck, missing, sizeof missing);
    assert_int_equal(n, 0);
    assert_string_equal(missing, "");
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    int rc = am_dev_open(&d, AM_DEV_CUDA, 0, msg, sizeof msg);
    if (getenv("AM_TEST_VERBOSE"))
        fprintf(stderr, "am_dev_open(cuda): %d %s\n", rc, rc ? msg : "opened");
    if (e == cudaSuccess && ndev > 0) { /* a GPU machine: opened, or refused for what the table lacks */
        if (rc == 0) {
            am_dev_close(&d);
            return;
        }
        char want[600];
        snprintf(want, sizeof want, "kernels: the cuda backend lacks: %s", missing);
        assert_non_null(strstr(msg, want));
    } else {
        char want[300];
        snprintf(want, sizeof want, "kernels (cuda): no CUDA device (cudaGetDeviceCount: %s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        assert_int_equal(rc, -1);
        assert_string_equal(msg, want);
    }
#else
    assert_int_equal(am_dev_open(&d, AM_DEV_CUDA, 0, msg, sizeof msg), -1);
    assert_non_null(strstr(msg, "this build of am has no cuda backend"));
#endif
    assert_null(d.k);
    assert_null(d.stream);
    assert_null(d.workspace);
    /* a table with holes is refused by name, whatever the device */
    struct am_kernels holes = *am_kernels_cpu();
    holes.name = "holey";
    holes.rope_forward = NULL;
    holes.adamw = NULL;
    holes.adamw_multi = NULL;
    assert_int_equal(am_kernels_missing(&holes, missing, sizeof missing), 3);
    assert_string_equal(missing, "rope_forward, adamw, adamw_multi");
    char tiny[8];
    assert_int_equal(am_kernels_missing(&holes, tiny, sizeof tiny), 3); /* truncated, terminated */
    assert_true(strlen(tiny) < sizeof tiny);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_shape_aborts),
        cmocka_unit_test(test_bf16_bad_dtype_aborts),
        cmocka_unit_test(test_cuda_context),
    };
    return cmocka_run_group_tests_name("kernels (cpu)", tests, kernels_test_setup, NULL);
}
