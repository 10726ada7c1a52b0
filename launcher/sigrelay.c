/* sigrelay.c - signals into the poll loop (sigrelay.h). */
#include "sigrelay.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2};
#define N_FORWARDED (int)(sizeof(forwarded) / sizeof(forwarded[0]))

/* The one piece of state the handler touches. */
static struct {
    volatile sig_atomic_t pending[N_FORWARDED]; /* deliveries to forward, not yet taken */
    volatile sig_atomic_t seen[N_FORWARDED];    /* deliveries the rank got too */
    volatile sig_atomic_t pipe_w;               /* -1: not installed */
    pid_t group_sender;
    int pipe_r;
} relay = {.pipe_w = -1, .pipe_r = -1};

static void on_signal(int sig, siginfo_t *si, void *ctx)
{
    (void)ctx;
    int saved = errno;
    int from_group = relay.group_sender > 0 && si && si->si_code == SI_USER && si->si_pid == relay.group_sender;
    for (int i = 0; i < N_FORWARDED; i++) {
        if (forwarded[i] != sig)
            continue;
        if (from_group)
            relay.seen[i]++;
        else
            relay.pending[i]++;
    }
    if (relay.pipe_w >= 0) {
        char c = 0;
        (void)!write(relay.pipe_w, &c, 1);
    }
    errno = saved;
}

int am_sigrelay_install(pid_t group_sender)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC | O_NONBLOCK) < 0)
        return -1;
    relay.pipe_r = p[0];
    relay.pipe_w = p[1];
    relay.group_sender = group_sender;
    for (int i = 0; i < N_FORWARDED; i++)
        relay.pending[i] = relay.seen[i] = 0;
    struct sigaction sa = {.sa_sigaction = on_signal, .sa_flags = SA_RESTART | SA_SIGINFO};
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_FORWARDED; i++)
        sigaction(forwarded[i], &sa, NULL);
    sa.sa_flags |= SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    return relay.pipe_r;
}

void am_sigrelay_uninstall(void)
{
    for (int i = 0; i < N_FORWARDED; i++)
        signal(forwarded[i], SIG_IGN);
    signal(SIGCHLD, SIG_DFL);
    if (relay.pipe_r >= 0) {
        int w = relay.pipe_w;
        relay.pipe_w = -1;
        close(w);
        close(relay.pipe_r);
        relay.pipe_r = -1;
    }
}

int am_sigrelay_take(int *forward)
{
    char drain[64];
    int sig = 0;
    sigset_t block, old;
    sigemptyset(&block);
    for (int i = 0; i < N_FORWARDED; i++)
        sigaddset(&block, forwarded[i]);
    while (relay.pipe_r >= 0 && read(relay.pipe_r, drain, sizeof(drain)) > 0)
        ;
    sigprocmask(SIG_BLOCK, &block, &old); /* the counters change only here and in the handler */
    for (int i = 0; i < N_FORWARDED && !sig; i++) {
        if (relay.pending[i] > 0) {
            relay.pending[i]--;
            *forward = 1;
            sig = forwarded[i];
        } else if (relay.seen[i] > 0) {
            relay.seen[i]--;
            *forward = 0;
            sig = forwarded[i];
        }
    }
    sigprocmask(SIG_SETMASK, &old, NULL);
    return sig;
}

void am_sigrelay_child(void)
{
    for (int i = 0; i < N_FORWARDED; i++)
        signal(forwarded[i], SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
}

const char *am_signal_name(int sig, char *buf, int len)
{
    const char *abbrev = sigabbrev_np(sig);
    snprintf(buf, (size_t)len, "SIG%s", abbrev ? abbrev : "?");
    return buf;
}
