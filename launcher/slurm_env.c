/* slurm_env.c - a Slurm task's place in its step, from the environment (slurm_env.h). */
#include "slurm_env.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

int am_boot_port_derive(unsigned long long job, unsigned long long step)
{
    return AM_BOOT_PORT_BASE + (int)((job * 64 + step) % AM_BOOT_PORT_SPAN);
}

/* One bracket group "[1-4,07,9-10]" at *p (just past '['): its number of hosts, and the first
 * element as written into first (when not NULL). Leaves *p past ']'. -1: malformed. */
static long bracket(const char **p, char *first, size_t first_len)
{
    const char *s = *p;
    long n = 0;
    int elem = 0;
    for (;;) {
        const char *a = s;
        while (isdigit((unsigned char)*s))
            s++;
        size_t alen = (size_t)(s - a);
        if (alen == 0 || alen > 18)
            return -1;
        long long lo = strtoll(a, NULL, 10), hi = lo;
        if (*s == '-') {
            const char *b = ++s;
            while (isdigit((unsigned char)*s))
                s++;
            if (s == b || s - b > 18)
                return -1;
            hi = strtoll(b, NULL, 10);
            if (hi < lo)
                return -1;
        }
        if (elem++ == 0 && first) {
            if (alen >= first_len)
                return -1;
            memcpy(first, a, alen);
            first[alen] = '\0';
        }
        n += (long)(hi - lo + 1);
        if (*s == ',') {
            s++;
            continue;
        }
        if (*s != ']')
            return -1;
        *p = s + 1;
        return n;
    }
}

/* The hosts of the one name at *p (up to a ',' outside brackets or the end), its first host
 * into out when not NULL. Leaves *p at the ',' or the end. -1: malformed. */
static long one_name(const char **p, char *out, size_t out_len)
{
    const char *s = *p;
    size_t o = 0;
    long n = 1;
    if (*s == '\0' || *s == ',')
        return -1;
    while (*s && *s != ',') {
        if (*s == ']')
            return -1;
        if (*s == '[') {
            char num[24];
            s++;
            long k = bracket(&s, num, sizeof(num));
            if (k < 0)
                return -1;
            n *= k;
            size_t l = strlen(num);
            if (out && o + l >= out_len)
                return -1;
            if (out)
                memcpy(out + o, num, l);
            o += l;
            continue;
        }
        if (out && o + 1 >= out_len)
            return -1;
        if (out)
            out[o] = *s;
        o++;
        s++;
    }
    if (out)
        out[o] = '\0';
    *p = s;
    return n;
}

int am_hostlist_first(const char *list, char *out, size_t out_len, char *err, size_t err_len)
{
    const char *p = list ? list : "";
    if (one_name(&p, out, out_len) < 0) {
        snprintf(err, err_len, "hostlist '%s': cannot read its first host (expected names like n1 or n[1-4],gpu07, "
                 "each under %zu characters)", list ? list : "", out_len);
        return -1;
    }
    return 0;
}

long am_hostlist_count(const char *list, char *err, size_t err_len)
{
    const char *p = list ? list : "";
    long total = 0;
    for (;;) {
        long n = one_name(&p, NULL, 0);
        if (n < 0) {
            snprintf(err, err_len, "hostlist '%s': malformed (expected names like n1 or n[1-4],gpu07)",
                     list ? list : "");
            return -1;
        }
        total += n;
        if (*p == '\0')
            return total;
        p++;
    }
}

int am_tasks_on_node(const char *spec, int node, char *err, size_t err_len)
{
    const char *s = spec ? spec : "";
    int at = 0;
    while (*s) {
        char *end;
        errno = 0;
        long count = strtol(s, &end, 10), times = 1;
        if (end == s || errno || count < 1 || count > 1000000)
            break;
        s = end;
        if (*s == '(') {
            if (s[1] != 'x')
                break;
            times = strtol(s + 2, &end, 10);
            if (end == s + 2 || *end != ')' || times < 1 || times > 1000000)
                break;
            s = end + 1;
        }
        if (node < at + times)
            return (int)count;
        at += (int)times;
        if (*s == ',')
            s++;
        else if (*s)
            break;
        else {
            snprintf(err, err_len, "tasks per node '%s' names %d nodes: no node %d", spec, at, node);
            return -1;
        }
    }
    snprintf(err, err_len, "tasks per node '%s': malformed (expected counts like 2(x3),1)", spec ? spec : "");
    return -1;
}

int am_slurm_auth_socket_parse(const char *text, char *out, size_t out_len)
{
    for (const char *line = text; line && *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        const char *p = line, *stop = line + len;
        line = end ? end + 1 : NULL;
        while (p < stop && isspace((unsigned char)*p))
            p++;
        if ((size_t)(stop - p) < 9 || strncasecmp(p, "AuthInfo", 8) != 0)
            continue;
        p += 8;
        while (p < stop && isspace((unsigned char)*p))
            p++;
        if (p == stop || *p++ != '=')
            continue;
        while (p < stop && isspace((unsigned char)*p))
            p++;
        while (p < stop && *p != '#' && !isspace((unsigned char)*p)) { /* options, comma-separated */
            const char *opt = p;
            while (p < stop && *p != ',' && *p != '#' && !isspace((unsigned char)*p))
                p++;
            size_t n = (size_t)(p - opt);
            if (n > 7 && strncasecmp(opt, "socket=", 7) == 0 && n - 7 < out_len) {
                memcpy(out, opt + 7, n - 7);
                out[n - 7] = '\0';
                return 1;
            }
            if (p < stop && *p == ',')
                p++;
        }
    }
    return 0;
}

int am_slurm_auth_socket(char *out, size_t out_len)
{
    const char *path = getenv("SLURM_CONF");
    FILE *f = fopen(path && *path ? path : "/etc/slurm/slurm.conf", "re");
    if (!f)
        return 0;
    char text[65536];
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = '\0';
    return am_slurm_auth_socket_parse(text, out, out_len);
}

/* The first of the variables that is set and not empty (its name into *which). */
static const char *var(const char *(*get)(const char *), const char *a, const char *b, const char **which)
{
    const char *v = get(a);
    *which = a;
    if ((!v || !*v) && b) {
        v = get(b);
        *which = b;
        if (!v || !*v)
            *which = a;
    }
    return v && *v ? v : NULL;
}

static int number(const char *(*get)(const char *), const char *a, const char *b, unsigned long long max,
                  unsigned long long *out, char *err, size_t err_len)
{
    const char *name, *v = var(get, a, b, &name);
    if (!v) {
        snprintf(err, err_len, "%s is not set: is this a task of a Slurm step (srun)?", name);
        return -1;
    }
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (!isdigit((unsigned char)*v) || *end || errno || x > max) {
        snprintf(err, err_len, "%s='%s': not a whole number from 0 to %llu", name, v, max);
        return -1;
    }
    *out = x;
    return 0;
}

int am_slurm_step_read(struct am_slurm_step *s, const char *(*get)(const char *name), char *err, size_t err_len)
{
    unsigned long long rank, size, local, node, nodes, job, step;
    const char *name;
    memset(s, 0, sizeof(*s));
    if (number(get, "SLURM_JOB_ID", NULL, ~0ULL, &job, err, err_len) < 0 ||
        number(get, "SLURM_STEP_ID", "SLURM_STEPID", ~0ULL, &step, err, err_len) < 0 ||
        number(get, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", 1 << 24, &size, err, err_len) < 0 ||
        number(get, "SLURM_PROCID", NULL, size ? size - 1 : 0, &rank, err, err_len) < 0 ||
        number(get, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", size, &nodes, err, err_len) < 0 ||
        number(get, "SLURM_NODEID", NULL, nodes ? nodes - 1 : 0, &node, err, err_len) < 0 ||
        number(get, "SLURM_LOCALID", NULL, size ? size - 1 : 0, &local, err, err_len) < 0)
        return -1;
    if (size == 0 || nodes == 0) {
        snprintf(err, err_len, "SLURM_NTASKS=%llu and SLURM_STEP_NUM_NODES=%llu: a step has at least one of each", size,
                 nodes);
        return -1;
    }
    const char *tpn = var(get, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", &name);
    char why[256];
    int local_size = am_tasks_on_node(tpn, (int)node, why, sizeof(why));
    if (local_size < 0 || local >= (unsigned long long)local_size) {
        if (local_size < 0)
            snprintf(err, err_len, "%s: %s", name, why);
        else
            snprintf(err, err_len, "SLURM_LOCALID=%llu, but %s='%s' gives node %llu %d tasks", local, name, tpn, node,
                     local_size);
        return -1;
    }
    const char *list = var(get, "SLURM_STEP_NODELIST", "SLURM_NODELIST", &name);
    long n_hosts = am_hostlist_count(list, why, sizeof(why));
    if (n_hosts < 0 || am_hostlist_first(list, s->first_host, sizeof(s->first_host), why, sizeof(why)) < 0) {
        snprintf(err, err_len, "%s: %s", name, why);
        return -1;
    }
    if ((unsigned long long)n_hosts != nodes) {
        snprintf(err, err_len, "%s='%s' names %ld nodes, but the step has %llu (SLURM_STEP_NUM_NODES)", name, list,
                 n_hosts, nodes);
        return -1;
    }
    const char *host = get("AM_BOOT_HOST");
    snprintf(s->server_host, sizeof(s->server_host), "%s", host && *host ? host : s->first_host);
    const char *port = get("AM_BOOT_PORT");
    if (port && *port) {
        char *end;
        errno = 0;
        long p = strtol(port, &end, 10);
        if (*end || errno || p < 1 || p > 65535) {
            snprintf(err, err_len, "AM_BOOT_PORT='%s': not a TCP port (1 to 65535)", port);
            return -1;
        }
        s->port = (int)p;
    } else {
        s->port = am_boot_port_derive(job, step);
    }
    s->job = job;
    s->step = step;
    s->serves = node == 0 && local == 0;
    s->info.rank = (int)rank;
    s->info.size = (int)size;
    s->info.local_rank = (int)local;
    s->info.local_size = local_size;
    s->info.node_id = (int)node;
    s->info.n_nodes = (int)nodes;
    const char *me = get("SLURMD_NODENAME");
    if (me && *me)
        snprintf(s->info.host, sizeof(s->info.host), "%s", me);
    else if (gethostname(s->info.host, sizeof(s->info.host) - 1) < 0)
        snprintf(s->info.host, sizeof(s->info.host), "localhost");
    snprintf(s->info.job_id, sizeof(s->info.job_id), "%llu.%llu", job, step);
    return 0;
}
