/* boot_check - a rank program that exercises the bootstrap and, on request, fails in the
 * ways the launcher must handle. Prints one line per rank.
 *
 *   BOOT_CHECK_FAIL=RANK:CODE  that rank exits with CODE right after hello (before the fence)
 *   BOOT_CHECK_SEGV=RANK       that rank dies of SIGSEGV after the allgather
 *   BOOT_CHECK_HANG=RANK[:MODE] that rank hangs: MODE "before" (before the allgather), "after"
 *                              (default, after it) or "stubborn" (after it, ignoring SIGTERM);
 *                              RANK "all": every rank that does not fail otherwise
 *   BOOT_CHECK_EXIT=RANK:CODE  that rank exits with CODE after the allgather
 *   BOOT_CHECK_ABORT=RANK:CODE that rank asks the launcher to abort the job with CODE
 *   BOOT_CHECK_OOM=RANK        that rank allocates and touches memory until it is killed
 *   BOOT_CHECK_WAIT=1          every rank prints "rank R ready", then reports each SIGUSR1
 *                              and SIGUSR2 it gets and exits 0 on SIGTERM
 *   BOOT_CHECK_TIMEOUT=S       the bootstrap timeout (default 30 s)
 *   BOOT_CHECK_WIDE=RANK       that rank sends 8 bytes to the allgather, the others 4
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bootstrap.h"

static volatile sig_atomic_t got_usr1, got_usr2, got_term;

static void on_signal(int sig)
{
    if (sig == SIGUSR1)
        got_usr1++;
    else if (sig == SIGUSR2)
        got_usr2++;
    else
        got_term = 1;
}

/* "RANK" or "RANK:X" naming this rank ("all" names every rank): returns 1 and sets *arg to
 * X (or NULL). */
static int for_me(const char *var, int rank, const char **arg)
{
    const char *v = getenv(var);
    if (!v || !*v || (strncmp(v, "all", 3) != 0 && atoi(v) != rank))
        return 0;
    const char *colon = strchr(v, ':');
    *arg = colon ? colon + 1 : NULL;
    return 1;
}

static void wait_for_signals(int rank)
{
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    sigaction(SIGUSR2, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    printf("rank %d ready\n", rank);
    fflush(stdout);
    int usr1 = 0, usr2 = 0;
    while (!got_term) {
        pause();
        for (; usr1 < got_usr1; usr1++)
            printf("rank %d got SIGUSR1\n", rank);
        for (; usr2 < got_usr2; usr2++)
            printf("rank %d got SIGUSR2\n", rank);
        fflush(stdout);
    }
    printf("rank %d got SIGTERM\n", rank);
}

static void hang(const char *mode)
{
    if (mode && strcmp(mode, "stubborn") == 0)
        signal(SIGTERM, SIG_IGN);
    for (;;)
        pause();
}

int main(void)
{
    struct am_boot_info info;
    char err[512];
    const char *arg;
    struct am_boot *b = am_boot_init(&info, err, sizeof(err));
    if (!b) {
        fprintf(stderr, "boot_check: %s\n", err);
        return 3;
    }
    double timeout = getenv("BOOT_CHECK_TIMEOUT") ? atof(getenv("BOOT_CHECK_TIMEOUT")) : 30;
    if (for_me("BOOT_CHECK_FAIL", info.rank, &arg))
        return arg ? atoi(arg) : 1;
    if (for_me("BOOT_CHECK_HANG", info.rank, &arg) && arg && strcmp(arg, "stubborn") == 0)
        signal(SIGTERM, SIG_IGN); /* before the fence: no other rank can fail earlier */
    if (for_me("BOOT_CHECK_HANG", info.rank, &arg) && arg && strcmp(arg, "before") == 0)
        hang(arg);
    int *all = calloc(2 * (size_t)info.size, sizeof(int));
    int mine[2] = {1000 + info.rank, 0};
    size_t len = for_me("BOOT_CHECK_WIDE", info.rank, &arg) ? sizeof(mine) : sizeof(int);
    snprintf(err, sizeof(err), "out of memory");
    if (!all || am_boot_allgather(b, "x", mine, len, all, timeout, err, sizeof(err)) < 0) {
        fprintf(stderr, "boot_check: rank %d: %s\n", info.rank, err);
        return 4;
    }
    for (int r = 0; r < info.size; r++)
        if (all[r] != 1000 + r) {
            fprintf(stderr, "boot_check: rank %d: got %d from rank %d\n", info.rank, all[r], r);
            return 5;
        }
    printf("rank %d/%d on %s (node %d/%d, local %d/%d) job %s: allgather ok\n", info.rank, info.size, info.host,
           info.node_id, info.n_nodes, info.local_rank, info.local_size, info.job_id);
    fflush(stdout);
    free(all);
    if (for_me("BOOT_CHECK_SEGV", info.rank, &arg))
        raise(SIGSEGV);
    if (for_me("BOOT_CHECK_EXIT", info.rank, &arg))
        return arg ? atoi(arg) : 1;
    if (for_me("BOOT_CHECK_ABORT", info.rank, &arg))
        am_boot_abort(b, arg ? atoi(arg) : 1, "boot_check asked to abort");
    if (for_me("BOOT_CHECK_HANG", info.rank, &arg))
        hang(arg);
    if (for_me("BOOT_CHECK_OOM", info.rank, &arg)) {
        for (;;) {
            char *p = malloc(16 << 20);
            if (p)
                memset(p, 1, 16 << 20);
        }
    }
    if (getenv("BOOT_CHECK_WAIT"))
        wait_for_signals(info.rank);
    am_boot_fini(b);
    return 0;
}
