/* diag_logs.c - synthetic rank logs of a large job for bench/diag_scale.sh: what am-train and
 * am-launch write (docs/diagnostics.md), at any size.
 *
 *   diag_logs DIR RANKS [STEPS [RING]]
 *
 * Every rank: a start record; a groups record with 8 groups (kind k: blocks of 2^(k+1)
 * consecutive ranks, so each rank's groups hold 2 to 256 members); STEPS step records (default
 * 10000); then a failure injected at step STEPS+1: rank RANKS*5/8+3 (mod RANKS) segfaults (cause,
 * its flight recorder, exit 139); every other rank is stopped by its supervisor while waiting
 * in its next collective (stop, cause SIGTERM, flight recorder with that call in flight, exit
 * 143). Flight recorders hold the last RING calls (default 1024), cycling through the 8 groups
 * with per-group sequence numbers, the same on every member, 40 calls a step. A memory record and
 * the plan's estimate (start record's plan_bytes) give am-diag --html its memory chart. Prints
 * the injected rank. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define T0 1767000000.0
#define KINDS 8
#define STEP_S 0.5
#define CALL_S (STEP_S / 40) /* 40 collectives a step: the flight times follow the steps' */

static int block(int k, int ranks)
{
    int b = 2 << k;
    return b < ranks ? b : ranks;
}

static void flight(FILE *f, int r, int ranks, long calls, int ring, int in_flight, int culprit)
{
    long first = calls - ring + (in_flight ? 1 : 0);
    if (first < 0)
        first = 0;
    long last = calls - (in_flight ? 0 : 1); /* call numbers first..last (0-based) */
    for (long c = first; c <= last; c++) {
        int k = (int)(c % KINDS), b = block(k, ranks);
        long gid = (long)k * ranks + r / b, seq = c / KINDS + 1;
        double t = T0 + 1.0 + (double)c * CALL_S;
        if (c < calls || !in_flight) {
            fprintf(f, "{\"type\":\"flight\",\"id\":%ld,\"group\":\"g%d\",\"gid\":%ld,\"seq\":%ld,\"op\":\"allreduce\","
                    "\"dtype\":\"bf16\",\"count\":%d,\"bytes\":%d,\"redop\":\"sum\",\"peer\":null,\"state\":\"completed\","
                    "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":%.6f,\"waiting_for\":null}\n", c + 1, k, gid, seq,
                    4096 << k, 8192 << k, t, t, t + 5e-4);
        } else {
            int base = r / b * b, waiting = culprit >= base && culprit < base + b ? culprit : base + (r - base + 1) % b;
            fprintf(f, "{\"type\":\"flight\",\"id\":%ld,\"group\":\"g%d\",\"gid\":%ld,\"seq\":%ld,\"op\":\"allreduce\","
                    "\"dtype\":\"bf16\",\"count\":%d,\"bytes\":%d,\"redop\":\"sum\",\"peer\":null,\"state\":\"started\","
                    "\"enqueued\":%.6f,\"started\":%.6f,\"ended\":null,\"waiting_for\":%d}\n", c + 1, k, gid, seq,
                    4096 << k, 8192 << k, t, t, waiting);
        }
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: diag_logs DIR RANKS [STEPS [RING]]\n");
        return 2;
    }
    const char *dir = argv[1];
    int ranks = atoi(argv[2]), steps = argc > 3 ? atoi(argv[3]) : 10000, ring = argc > 4 ? atoi(argv[4]) : 1024;
    if (ranks < 2 || steps < 1 || ring < 1) {
        fprintf(stderr, "diag_logs: RANKS >= 2, STEPS >= 1, RING >= 1\n");
        return 2;
    }
    if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
        fprintf(stderr, "diag_logs: %s: %s\n", dir, strerror(errno));
        return 1;
    }
    int culprit = (ranks * 5 / 8 + 3) % ranks;
    long calls = 40L * steps; /* collectives issued per rank before the failure */
    double t_fail = T0 + 1.0 + (double)calls * CALL_S + 0.1;
    char path[4096];
    static char iobuf[1 << 20];
    for (int r = 0; r < ranks; r++) {
        snprintf(path, sizeof(path), "%s/rank-%d.jsonl", dir, r);
        FILE *f = fopen(path, "w");
        if (!f) {
            fprintf(stderr, "diag_logs: %s: %s\n", path, strerror(errno));
            return 1;
        }
        setvbuf(f, iobuf, _IOFBF, sizeof(iobuf));
        fprintf(f, "{\"type\":\"start\",\"host\":\"node%04d\",\"pid\":%d,\"rank\":%d,\"world\":%d,\"job\":\"4242.0\","
                "\"local_rank\":%d,\"coords\":{\"pp\":0,\"dp_replicate\":0,\"dp_shard\":%d,\"cp\":0,\"tp\":%d,\"ep\":0},"
                "\"device\":\"cuda\",\"time\":%.6f,\"version\":\"0.1.0\",\"node_id\":%d,\"mesh_rank\":%d,"
                "\"max_steps\":%d,\"flight_size\":%d,\"plan_bytes\":%lld}\n", r / 8, 1000 + r, r, ranks, r % 8, r / 8,
                r % 8, T0, r / 8, r, steps * 2, ring, 80LL << 30);
        /* what the rank allocated, a little under the plan (the pipeline's first stages hold more) */
        fprintf(f, "{\"type\":\"memory\",\"param_bytes\":%lld,\"weights_bytes\":%lld,\"grads_bytes\":%lld,"
                "\"optimizer_bytes\":%lld,\"act_bytes\":%lld,\"pipe_bytes\":0,\"slots\":1,\"peak_micro\":1,"
                "\"recompute\":false,\"compute_dtype\":\"bfloat16\",\"gathered_bytes\":%lld,\"grad_buffers_bytes\":%lld,"
                "\"sharded\":true,\"alltoall_bytes\":0}\n", 16LL << 30, 12LL << 30, 8LL << 30, 16LL << 30,
                (30LL << 30) + ((long long)(r % 8) << 28), 4LL << 30, 2LL << 30);
        fprintf(f, "{\"type\":\"groups\",\"rank\":%d,\"groups\":[", r);
        for (int k = 0; k < KINDS; k++) {
            int b = block(k, ranks), base = r / b * b;
            fprintf(f, "%s{\"name\":\"g%d\",\"gid\":%ld,\"ranks\":[", k ? "," : "", k, (long)k * ranks + r / b);
            for (int m = 0; m < b && base + m < ranks; m++)
                fprintf(f, "%s%d", m ? "," : "", base + m);
            fprintf(f, "]}");
        }
        fprintf(f, "]}\n");
        for (int s = 1; s <= steps; s++) {
            double comm = 0.30 + 0.01 * (double)((r * 7 + s * 13) % 10);
            fprintf(f, "{\"type\":\"step\",\"step\":%d,\"loss\":%.6f,\"lr\":0.0003,\"grad_norm\":%.5f,\"tokens\":65536,"
                    "\"step_s\":0.5,\"time\":%.6f,\"comm_s\":%.5f}\n", s, 2.0 + 8.0 / s, 1.0 + 0.5 / s,
                    T0 + 1.0 + (double)s * STEP_S, comm);
        }
        if (r == culprit) {
            fprintf(f, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":11,\"signal_name\":\"SIGSEGV\",\"code\":1,"
                    "\"code_name\":\"SEGV_MAPERR\",\"addr\":\"0x10\",\"sender_pid\":null,\"from\":\"kernel\",\"rank\":%d,"
                    "\"step\":%d,\"time\":%.6f,\"backtrace\":[\"am-train(am_layer_forward+0x12) [0x1]\","
                    "\"am-train(am_train+0x17ef) [0x2]\"]}\n", r, steps + 1, t_fail);
            flight(f, r, ranks, calls, ring, 0, culprit);
            fprintf(f, "{\"type\":\"exit\",\"rank\":%d,\"host\":\"node%04d\",\"pid\":%d,\"status\":139,\"signal\":11,"
                    "\"signal_name\":\"SIGSEGV\",\"core_dumped\":false,\"oom_killed\":false,\"stop_signal\":null,"
                    "\"time\":%.6f}\n", r, r / 8, 1000 + r, t_fail + 0.01);
        } else {
            fprintf(f, "{\"type\":\"stop\",\"rank\":%d,\"host\":\"node%04d\",\"signal\":\"SIGINT\",\"by\":\"slurm\","
                    "\"because_rank\":%d,\"because_host\":\"node%04d\",\"because\":\"rank %d was killed by signal 11\","
                    "\"because_time\":%.6f,\"time\":%.6f}\n", r, r / 8, culprit, culprit / 8, culprit, t_fail + 0.01,
                    t_fail + 0.02);
            fprintf(f, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":2,\"signal_name\":\"SIGINT\",\"code\":0,"
                    "\"code_name\":\"SI_USER\",\"addr\":null,\"sender_pid\":99,\"from\":\"other\",\"rank\":%d,"
                    "\"step\":%d,\"time\":%.6f,\"backtrace\":[]}\n", r, steps + 1, t_fail + 0.03);
            flight(f, r, ranks, calls, ring, 1, culprit);
            fprintf(f, "{\"type\":\"exit\",\"rank\":%d,\"host\":\"node%04d\",\"pid\":%d,\"status\":130,\"signal\":2,"
                    "\"signal_name\":\"SIGINT\",\"core_dumped\":false,\"oom_killed\":false,\"stop_signal\":\"SIGINT\","
                    "\"time\":%.6f}\n", r, r / 8, 1000 + r, t_fail + 0.04);
        }
        if (fclose(f) != 0) {
            fprintf(stderr, "diag_logs: %s: %s\n", path, strerror(errno));
            return 1;
        }
    }
    printf("%d\n", culprit);
    return 0;
}
