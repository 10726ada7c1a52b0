/* boot_scale - the standalone bootstrap's cost as ranks grow, without training: the real
 * boot server (launcher/boot_server.c) and the real rank side (runtime/rank/bootstrap.c)
 * with N simulated ranks on this machine. The server runs in a child process (one poll loop,
 * as am-launch serves its ranks); the ranks are N threads of this process, each with its
 * own connection over a unix socket. Each rank says hello, then gathers a BLOB-byte value
 * from every rank:
 *   allgather  one request per rank (AM_BOOT_ALLGATHER)
 *   gets       a put, a fence and N gets per rank (how am_boot_allgather worked before)
 * and prints one line per N:
 *   mode ranks hello_ms first_allgather_ms requests bytes server_maxrss_kib server_cpu_s
 * first_allgather_ms: from the start of the threads until the last rank has every value;
 * requests and bytes: what crossed the sockets, both ways (from the protocol's sizes);
 * server_maxrss_kib, server_cpu_s: the server process's peak resident memory and its CPU time.
 *
 * Usage: boot_scale [--mode allgather|gets] [--blob B] N...     (bench/boot_scale.sh) */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "boot_proto.h"
#include "boot_server.h"
#include "bootstrap.h"

static int gets_mode;
static size_t blob = 64;
static struct sockaddr_un addr;
static double t_start;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e3 * (double)ts.tv_sec + 1e-6 * (double)ts.tv_nsec;
}

/* ---- the server: accept N ranks (each says its rank first), then serve them ------------ */

static int serve(int lfd, int n, int report)
{
    struct pollfd *pf = calloc((size_t)n, sizeof(*pf));
    int *rank_of = calloc((size_t)n, sizeof(int));
    struct am_boot_info *info = calloc((size_t)n, sizeof(*info));
    if (!pf || !rank_of || !info)
        return 1;
    for (int i = 0; i < n; i++) {
        int fd = accept(lfd, NULL, NULL);
        int32_t r;
        if (fd < 0 || am_io_read_full(fd, &r, sizeof(r)) < 0 || r < 0 || r >= n) {
            fprintf(stderr, "boot_scale: server: accept %d: %s\n", i, strerror(errno));
            return 1;
        }
        pf[r] = (struct pollfd){.fd = fd, .events = POLLIN};
    }
    for (int r = 0; r < n; r++)
        info[r] = (struct am_boot_info){.rank = r, .size = n, .local_rank = r, .local_size = n, .n_nodes = 1};
    struct am_boot_server *s = am_boot_server_new(n, info);
    int open = n;
    while (open > 0) {
        if (poll(pf, (nfds_t)n, -1) < 0 && errno != EINTR)
            return 1;
        for (int r = 0; r < n; r++) {
            if (pf[r].fd < 0 || !pf[r].revents)
                continue;
            int status;
            char msg[256];
            if (am_boot_server_serve(s, r, pf[r].fd, &status, msg, sizeof msg) != AM_BOOT_OK) {
                close(pf[r].fd);
                pf[r].fd = -1;
                open--;
            }
        }
    }
    am_boot_server_free(s);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double out[2] = {(double)ru.ru_maxrss, (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec +
                                               (double)ru.ru_stime.tv_sec + 1e-6 * (double)ru.ru_stime.tv_usec};
    (void)!write(report, out, sizeof out);
    return 0;
}

/* ---- a rank ------------------------------------------------------------------------------ */

struct rank {
    pthread_t tid;
    int r, n, ok;
    double hello_ms, done_ms;
};

static void *rank_main(void *arg)
{
    struct rank *k = arg;
    char err[512], *mine = malloc(blob), *all = malloc((size_t)k->n * blob);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    int32_t r = k->r;
    while (fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0 && (errno == EAGAIN || errno == EINTR))
        usleep(1000);
    if (fd < 0 || !mine || !all || am_io_write_full(fd, &r, sizeof r) < 0) {
        fprintf(stderr, "boot_scale: rank %d: cannot connect: %s\n", k->r, strerror(errno));
        return NULL;
    }
    struct am_boot_info info;
    struct am_boot *b = am_boot_connect(fd, &info, err, sizeof err);
    if (!b) {
        fprintf(stderr, "boot_scale: rank %d: %s\n", k->r, err);
        return NULL;
    }
    k->hello_ms = now_ms() - t_start;
    memset(mine, 'a' + k->r % 26, blob);
    int rc = 0;
    if (!gets_mode) {
        rc = am_boot_allgather(b, "x", mine, blob, all, 600, err, sizeof err);
    } else {
        rc = am_boot_put(b, "x", mine, blob, err, sizeof err) < 0 || am_boot_fence(b, 600, err, sizeof err) < 0 ? -1 : 0;
        for (int p = 0; rc == 0 && p < k->n; p++) {
            void *v;
            size_t len;
            rc = am_boot_get(b, p, "x", &v, &len, 600, err, sizeof err);
            if (rc == 0) {
                memcpy(all + (size_t)p * blob, v, len < blob ? len : blob);
                free(v);
            }
        }
    }
    k->done_ms = now_ms() - t_start;
    k->ok = rc == 0;
    for (int p = 0; k->ok && p < k->n; p++)
        k->ok = all[(size_t)p * blob] == 'a' + p % 26;
    if (!k->ok)
        fprintf(stderr, "boot_scale: rank %d: %s\n", k->r, rc ? err : "a value came back wrong");
    am_boot_fini(b);
    free(mine);
    free(all);
    return NULL;
}

static int run(int n)
{
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0), report[2];
    addr = (struct sockaddr_un){.sun_family = AF_UNIX};
    snprintf(addr.sun_path + 1, sizeof addr.sun_path - 1, "am-boot-scale-%d-%d", (int)getpid(), n); /* abstract */
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 4096) < 0 || pipe(report) < 0) {
        fprintf(stderr, "boot_scale: listen: %s\n", strerror(errno));
        return 1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(report[0]);
        _exit(serve(lfd, n, report[1]));
    }
    close(lfd);
    close(report[1]);
    struct rank *k = calloc((size_t)n, sizeof(*k));
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 << 10);
    t_start = now_ms();
    for (int r = 0; r < n; r++) {
        k[r] = (struct rank){.r = r, .n = n};
        if (pthread_create(&k[r].tid, &attr, rank_main, &k[r]) != 0) {
            fprintf(stderr, "boot_scale: thread %d: %s\n", r, strerror(errno));
            return 1;
        }
    }
    double hello = 0, done = 0;
    int ok = 1;
    for (int r = 0; r < n; r++) {
        pthread_join(k[r].tid, NULL);
        hello = k[r].hello_ms > hello ? k[r].hello_ms : hello;
        done = k[r].done_ms > done ? k[r].done_ms : done;
        ok &= k[r].ok;
    }
    double srv[2] = {0, 0}; /* the server's peak RSS (KiB) and CPU seconds */
    (void)!read(report[0], srv, sizeof srv);
    close(report[0]);
    int st;
    waitpid(pid, &st, 0);
    /* what crossed the sockets, from the protocol: a request is its header, key and value, a
     * reply its header and payload; the hello's rank word and the hello itself included */
    double req = sizeof(struct am_boot_req), rep = sizeof(struct am_boot_rep), N = n, B = (double)blob;
    double requests = N * (gets_mode ? 2 + N + 1 : 2);
    double bytes = N * (4 + req + rep + sizeof(struct am_boot_info));
    if (gets_mode)
        bytes += N * ((req + 1 + B + rep) + (req + rep) + N * (req + 1 + rep + B));
    else
        bytes += N * (req + 1 + B + rep + N * B);
    printf("%s %d %.1f %.1f %.0f %.0f %.0f %.2f%s\n", gets_mode ? "gets" : "allgather", n, hello, done, requests, bytes,
           srv[0], srv[1],
           ok && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? "" : " FAILED");
    fflush(stdout);
    free(k);
    return ok ? 0 : 1;
}

int main(int argc, char **argv)
{
    int rc = 0;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) { /* a descriptor per rank on each side */
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    printf("mode ranks hello_ms first_allgather_ms requests bytes server_maxrss_kib server_cpu_s\n");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mode") == 0 && i + 1 < argc)
            gets_mode = strcmp(argv[++i], "gets") == 0;
        else if (strcmp(argv[i], "--blob") == 0 && i + 1 < argc)
            blob = (size_t)atol(argv[++i]);
        else
            rc |= run(atoi(argv[i]));
    }
    return rc;
}
