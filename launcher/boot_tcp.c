/* boot_tcp.c - the step's bootstrap over TCP, served and joined (boot_tcp.h). */
#include "boot_tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "boot_join.h"
#include "boot_proto.h"
#include "boot_server.h"

/* A request that does not arrive whole within this long is dropped (a stalled or hostile
 * peer must not hold the server). */
#define RECV_TIMEOUT_S 10

struct conn {
    int fd;
    int rank; /* -1: has not joined */
    char peer[64];
};

struct am_boot_tcp_server {
    struct am_join_expect x;
    char server[300];
    int lfd, stop[2];
    pthread_t thread;
    int started;
    struct am_boot_server *srv;
    int size;
    struct conn *c;
    size_t n, cap;
    char *joined;
    int n_joined, n_left;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int done;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void server_name(const struct am_slurm_step *st, char *out, size_t len)
{
    snprintf(out, len, "%s:%d", st->server_host, st->port);
}

static void peer_name(int fd, char *out, size_t len)
{
    struct sockaddr_storage a;
    socklen_t l = sizeof(a);
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (getpeername(fd, (struct sockaddr *)&a, &l) == 0) {
        if (a.ss_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *)&a)->sin_addr, host, sizeof(host));
            port = ntohs(((struct sockaddr_in *)&a)->sin_port);
        } else if (a.ss_family == AF_INET6) {
            const struct in6_addr *v6 = &((struct sockaddr_in6 *)&a)->sin6_addr;
            if (IN6_IS_ADDR_V4MAPPED(v6)) /* an IPv4 peer of the dual-stack socket */
                inet_ntop(AF_INET, &v6->s6_addr[12], host, sizeof(host));
            else
                inet_ntop(AF_INET6, v6, host, sizeof(host));
            port = ntohs(((struct sockaddr_in6 *)&a)->sin6_port);
        }
    }
    snprintf(out, len, "%s:%d", host, port);
}

static void close_conn(struct am_boot_tcp_server *s, size_t i)
{
    close(s->c[i].fd);
    s->c[i] = s->c[--s->n];
}

/* A connection that has not joined sent its first request: a join, admitted or refused. */
static void admit(struct am_boot_tcp_server *s, size_t i)
{
    struct am_boot_req req;
    char key[AM_BOOT_MAX_KEY + 1], why[512];
    void *value = NULL;
    int got = am_boot_read_request(s->c[i].fd, &req, key, &value), rank = -1;
    if (got == -1) {
        snprintf(why, sizeof(why), "it closed the connection (or sent nothing within %d s)", RECV_TIMEOUT_S);
    } else if (got == -2 || req.op != AM_BOOT_JOIN) {
        snprintf(why, sizeof(why), "its first request is not a join (op %u)", req.op);
    } else if ((rank = am_join_verify(&s->x, value, why, sizeof(why))) >= 0 && (int)req.rank != rank) {
        snprintf(why, sizeof(why), "it asks to be rank %d with a credential for rank %d", req.rank, rank);
        rank = -1;
    } else if (rank >= 0 && s->joined[rank]) {
        snprintf(why, sizeof(why), "rank %d has joined already", rank);
        rank = -1;
    }
    free(value);
    if (rank < 0) {
        fprintf(stderr, "am-launch: boot server %s: refused a join from %s: %s\n", s->server, s->c[i].peer, why);
        if (got == 0)
            am_boot_reply(s->c[i].fd, 1, why, strlen(why));
        close_conn(s, i);
        return;
    }
    s->joined[rank] = 1;
    s->n_joined++;
    s->c[i].rank = rank;
    am_boot_reply(s->c[i].fd, 0, NULL, 0);
}

static void serve(struct am_boot_tcp_server *s, size_t i)
{
    int status, rank = s->c[i].rank;
    char msg[512];
    enum am_boot_event ev = am_boot_server_serve(s->srv, rank, s->c[i].fd, &status, msg, sizeof(msg));
    if (ev == AM_BOOT_OK)
        return;
    if (ev == AM_BOOT_BAD || ev == AM_BOOT_ABORTED)
        fprintf(stderr, "am-launch: boot server %s: %s; closing rank %d's connection\n", s->server,
                ev == AM_BOOT_BAD ? msg : "an abort request (aborts are the rank's supervisor's)", rank);
    am_boot_server_drop(s->srv, rank);
    s->n_left++;
    close_conn(s, i);
}

static void *loop(void *arg)
{
    struct am_boot_tcp_server *s = arg;
    struct pollfd *pfd = NULL;
    size_t pcap = 0;
    while (!(s->n_joined == s->size && s->n_left == s->size)) {
        if (pcap < s->n + 2) {
            pcap = 2 * (s->n + 2);
            struct pollfd *p = realloc(pfd, pcap * sizeof(*p));
            if (!p) {
                fprintf(stderr, "am-launch: boot server %s: out of memory\n", s->server);
                break;
            }
            pfd = p;
        }
        pfd[0] = (struct pollfd){.fd = s->stop[0], .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = s->lfd, .events = POLLIN};
        for (size_t i = 0; i < s->n; i++)
            pfd[i + 2] = (struct pollfd){.fd = s->c[i].fd, .events = POLLIN};
        double deadline = am_boot_server_deadline(s->srv);
        int timeout = -1;
        if (deadline > 0) {
            double ms = (deadline - now()) * 1000 + 1;
            timeout = ms < 0 ? 0 : ms > 1e9 ? 1000000000 : (int)ms;
        }
        size_t n = s->n;
        if (poll(pfd, (nfds_t)n + 2, timeout) < 0 && errno != EINTR) {
            fprintf(stderr, "am-launch: boot server %s: poll: %s\n", s->server, strerror(errno));
            break;
        }
        if (pfd[0].revents)
            break;
        am_boot_server_expire(s->srv);
        /* from the last: close_conn moves the last connection into the closed one's place */
        for (size_t i = n; i-- > 0;) {
            if (!(pfd[i + 2].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            if (s->c[i].rank < 0)
                admit(s, i);
            else
                serve(s, i);
        }
        if ((pfd[1].revents & POLLIN) && s->n == s->cap) {
            size_t cap = s->cap ? 2 * s->cap : 16;
            struct conn *c = realloc(s->c, cap * sizeof(*c));
            if (c) {
                s->c = c;
                s->cap = cap;
            }
        }
        if ((pfd[1].revents & POLLIN) && s->n < s->cap) {
            int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
            if (fd >= 0) {
                struct timeval tv = {.tv_sec = RECV_TIMEOUT_S};
                int one = 1;
                setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
                s->c[s->n] = (struct conn){.fd = fd, .rank = -1};
                peer_name(fd, s->c[s->n].peer, sizeof(s->c[s->n].peer));
                s->n++;
            }
        }
    }
    free(pfd);
    pthread_mutex_lock(&s->lock);
    s->done = 1;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

struct am_boot_tcp_server *am_boot_tcp_serve(const struct am_slurm_step *st, char *err, size_t err_len)
{
    struct am_boot_tcp_server *s = calloc(1, sizeof(*s));
    struct am_boot_info *info = calloc((size_t)st->info.size, sizeof(*info));
    if (!s || !info) {
        free(s);
        free(info);
        snprintf(err, err_len, "out of memory");
        return NULL;
    }
    server_name(st, s->server, sizeof(s->server));
    s->x = (struct am_join_expect){.job = st->job, .step = st->step, .size = st->info.size, .server = s->server,
                                   .uid = getuid()};
    s->size = st->info.size;
    s->lfd = s->stop[0] = s->stop[1] = -1;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    /* HELLO is answered by each rank's own supervisor: the store's infos stay empty */
    s->srv = am_boot_server_new(s->size, info);
    s->joined = calloc((size_t)s->size, 1);
    free(info);
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)st->port), .sin6_addr = in6addr_any};
    int one = 1, zero = 0;
    if (!s->srv || !s->joined) {
        snprintf(err, err_len, "out of memory");
        goto fail;
    }
    s->lfd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s->lfd >= 0) { /* IPv4 and IPv6 */
        setsockopt(s->lfd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    } else {
        struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)st->port),
                                 .sin_addr.s_addr = htonl(INADDR_ANY)};
        s->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        memcpy(&a, &a4, sizeof(a4));
    }
    if (s->lfd < 0 || setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
        bind(s->lfd, (struct sockaddr *)&a, a.sin6_family == AF_INET6 ? sizeof(a) : sizeof(struct sockaddr_in)) < 0 ||
        listen(s->lfd, 4096) < 0) {
        snprintf(err, err_len, "cannot serve the bootstrap on port %d: %s%s", st->port, strerror(errno),
                 errno == EADDRINUSE ? " (another program holds it: choose a free port with --boot-port or "
                                       "AM_BOOT_PORT)" : "");
        goto fail;
    }
    if (pipe2(s->stop, O_CLOEXEC) < 0) {
        snprintf(err, err_len, "pipe: %s", strerror(errno));
        goto fail;
    }
    sigset_t all, old; /* the thread takes no signal: the supervisor's thread relays them */
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&s->thread, NULL, loop, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        snprintf(err, err_len, "cannot start the boot server's thread: %s", strerror(rc));
        goto fail;
    }
    s->started = 1;
    return s;
fail:
    am_boot_tcp_stop(s, 0);
    return NULL;
}

void am_boot_tcp_stop(struct am_boot_tcp_server *s, double wait_s)
{
    if (!s)
        return;
    if (s->started) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += (time_t)wait_s;
        pthread_mutex_lock(&s->lock);
        while (!s->done && pthread_cond_timedwait(&s->cond, &s->lock, &until) == 0)
            ;
        pthread_mutex_unlock(&s->lock);
        (void)!write(s->stop[1], "x", 1);
        pthread_join(s->thread, NULL);
    }
    for (size_t i = 0; i < s->n; i++)
        close(s->c[i].fd);
    if (s->lfd >= 0)
        close(s->lfd);
    if (s->stop[0] >= 0) {
        close(s->stop[0]);
        close(s->stop[1]);
    }
    am_boot_server_free(s->srv);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->cond);
    free(s->joined);
    free(s->c);
    free(s);
}

int am_boot_tcp_connect(const char *host, int port, double timeout_s, char *err, size_t err_len)
{
    char service[16];
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    snprintf(service, sizeof(service), "%d", port);
    int rc = getaddrinfo(host, service, &hints, &res);
    if (rc != 0) {
        snprintf(err, err_len, "cannot resolve the step's first node '%s': %s (give its address in AM_BOOT_HOST)",
                 host, gai_strerror(rc));
        return -1;
    }
    double end = now() + timeout_s;
    int last = 0;
    for (;;) {
        for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
            int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
            if (fd < 0) {
                last = errno;
                continue;
            }
            if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
                int one = 1;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
                freeaddrinfo(res);
                return fd;
            }
            last = errno;
            close(fd);
        }
        if (now() >= end)
            break;
        struct timespec ts = {0, 100 * 1000 * 1000}; /* the server may not be up yet */
        nanosleep(&ts, NULL);
    }
    freeaddrinfo(res);
    snprintf(err, err_len, "cannot reach the boot server at %s:%d within %g s: %s", host, port, timeout_s,
             strerror(last));
    return -1;
}

int am_boot_tcp_send_join(int fd, int rank, const char *cred, char *err, size_t err_len)
{
    size_t len = strlen(cred);
    struct am_boot_req req = {.op = AM_BOOT_JOIN, .val_len = len, .rank = rank};
    struct am_boot_rep rep;
    if (am_io_write_full(fd, &req, sizeof(req)) < 0 || am_io_write_full(fd, cred, len) < 0 ||
        am_io_read_full(fd, &rep, sizeof(rep)) < 0) {
        snprintf(err, err_len, "the connection closed during the join");
        return -1;
    }
    if (rep.status == 0 && rep.len == 0)
        return 0;
    char why[512];
    size_t n = rep.len < sizeof(why) - 1 ? rep.len : sizeof(why) - 1;
    if (am_io_read_full(fd, why, n) < 0)
        n = 0;
    why[n] = '\0';
    snprintf(err, err_len, "%s", why);
    return -1;
}

int am_boot_tcp_join(const struct am_slurm_step *st, double timeout_s, char *err, size_t err_len)
{
    char server[300], payload[512], why[512];
    server_name(st, server, sizeof(server));
    struct am_join_expect x = {.job = st->job, .step = st->step, .size = st->info.size, .server = server};
    am_join_payload(&x, st->info.rank, payload, sizeof(payload));
    char *cred = am_join_encode(payload, err, err_len);
    if (!cred)
        return -1;
    int fd = am_boot_tcp_connect(st->server_host, st->port, timeout_s, err, err_len);
    if (fd >= 0 && am_boot_tcp_send_join(fd, st->info.rank, cred, why, sizeof(why)) < 0) {
        snprintf(err, err_len, "the boot server at %s refused rank %d's join: %s", server, st->info.rank, why);
        close(fd);
        fd = -1;
    }
    free(cred);
    return fd;
}
