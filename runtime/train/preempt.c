/* preempt.c - SIGUSR1 noted for a save before the time limit (preempt.h). */
#include "preempt.h"

#include <errno.h>
#include <signal.h>
#include <string.h>

#include "util.h"

/* The one flag a signal handler may set: process-wide by nature. */
static volatile sig_atomic_t warned;

static void on_usr1(int sig)
{
    (void)sig;
    warned = 1;
}

int am_preempt_install(char *err, size_t err_len)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGUSR1, &sa, NULL) < 0)
        return am_fail(err, err_len, "cannot handle SIGUSR1 (Slurm's warning before the time limit): %s",
                       strerror(errno));
    return 0;
}

bool am_preempt_noted(void) { return warned != 0; }
