/* diag.h - am-diag's library: read a job's rank logs, find the first failure, judge the rest.
 *
 * Loading (diag_load.c): every <dir>/rank-<R>.jsonl, records as docs/diagnostics.md describes
 * them. Incomplete logs are normal (a rank killed while writing): a last line without its
 * newline that does not parse is noted and skipped, a bad line in the middle too. Ranks of
 * the job (the start records' "world") that left no log are "missing".
 *
 * Analysis (diag.c), in this order:
 *   1. how each rank ended:
 *        clean      exit status 0 after its last step (max_steps), or all steps and no record
 *        failed     a cause of its own: a crash signal, a non-finite loss or gradient, an
 *                   error; or, without a cause record, a non-zero exit, SIGKILL not sent by
 *                   the launcher ("killed"), the OOM killer ("oom"), an early exit (status 0
 *                   before max_steps)
 *        waiting    its communication failed: a timeout (watchdog or backend) or a peer error
 *        stopped    a stop signal from outside (SIGTERM/SIGINT: its supervisor, Slurm, a user)
 *        unknown    the log ends with no end record (killed with its supervisor, or running)
 *   2. the first failure: the earliest "failed" rank by wall-clock time (cause record's
 *      time, else the exit record's). With none, when ranks timed out waiting, the hang
 *      analysis: take the call that had waited longest when the ranks ended (group g,
 *      sequence k); among g's members the culprit is one that never issued #k (its flight
 *      recorder ends before it, it exited, or its log is missing), else one stuck inside #k
 *      waiting for no peer, else the member most waited for; when the member that never
 *      issued #k was itself waiting in another collective, the blame follows it there; cause
 *      "hang". With neither, a job stopped from outside has cause "stopped" and no rank.
 *   3. every other rank: victim (stopped, waiting or unknown after the first failure: which
 *      collective it waited in, #k of group g, and whether the culprit is the member that
 *      never came), failed (another failure of its own, later), straggler (clean but late:
 *      in some step its time outside communication calls exceeded the median rank's by at
 *      least AM_DIAG_STRAGGLER_S and by twice that median; or, in a hang, another member that
 *      never reached #k), clean, missing.
 *   4. mismatches: ranks of one group whose flight recorders hold the same collective
 *      sequence number with a different op, dtype or count, or that are stuck (in flight at
 *      their end) in sequence numbers of one group two or more apart.
 * Output (diag_report.c): a human summary, then per-rank details; or one JSON object.
 */
#ifndef AM_DIAG_H
#define AM_DIAG_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define AM_DIAG_STRAGGLER_S 1.0

/* One flight recorder entry as dumped. Times are wall-clock seconds, 0 when null. */
struct am_diag_flight {
    char group[32], op[24], dtype[12], state[12];
    int gid;
    uint64_t id, seq, count, bytes;
    int peer, waiting_for; /* -1: null */
    double enqueued, started, ended;
};

struct am_diag_group {
    char name[32];
    int gid;
    int *ranks;
    int n;
};

struct am_diag_step {
    long step;
    double step_s, comm_s, time;
};

enum am_diag_end { AM_END_UNKNOWN, AM_END_CLEAN, AM_END_FAILED, AM_END_WAITING, AM_END_STOPPED };

enum am_diag_verdict {
    AM_VERDICT_NONE,
    AM_VERDICT_FIRST,      /* the first failure */
    AM_VERDICT_VICTIM,
    AM_VERDICT_FAILED,     /* failed by itself, after the first */
    AM_VERDICT_STRAGGLER,
    AM_VERDICT_CLEAN,
    AM_VERDICT_STOPPED,    /* stopped from outside, no failure to blame */
    AM_VERDICT_UNKNOWN,    /* no end recorded, no failure to blame */
    AM_VERDICT_MISSING,    /* no log */
};

struct am_diag_rank {
    int rank, have_log, have_start;
    /* from the start record */
    char host[128], job[64];
    int local_rank, node_id, mesh_rank, world;
    int coords[6], have_coords; /* pp, dp_replicate, dp_shard, cp, tp, ep */
    int nccl;                   /* its device is a GPU (start record "device":"cuda"): its
                                 * communicators are NCCL's, which never name the peer waited for */
    long max_steps;
    double start_time;
    /* the records */
    struct am_diag_step *steps;
    size_t n_steps, cap_steps;
    struct am_diag_flight *flight;
    size_t n_flight, cap_flight;
    struct am_diag_group *groups;
    int n_groups;
    json_t *cause, *stop, *exit, *fault; /* first of each, or NULL */
    double last_time;                    /* of the last record with a time */
    int lines, bad_lines, truncated;
    /* analysis */
    enum am_diag_end end;
    const char *kind;       /* the cause's name: signal, nonfinite, error, exit, killed, oom (the OOM killer,
                             * or a device allocation's cause record), cuda, nccl, timeout, comm, ... */
    char signal[16];        /* "SIGSEGV", or "" */
    int status;             /* exit status, -1 unknown */
    long step;              /* the step it was in (1-based), 0 unknown */
    double fail_time;       /* wall clock of its end, 0 unknown */
    const struct am_diag_flight *in;    /* the call in flight at its end (not completed), or NULL */
    int waiting_for;        /* global rank it waited for, -1 */
    double waited_s;
    enum am_diag_verdict verdict;
    char detail[768];
};

struct am_diag_mismatch {
    char group[32], what[16]; /* what: "op", "size", "sequence" */
    int gid;
    uint64_t seq;
    char text[512];
};

struct am_diag {
    char dir[4096], job[64];
    int world;               /* from the start records; else the highest rank seen + 1 */
    struct am_diag_rank *ranks;
    int n_ranks;             /* entries of ranks[] (>= world) */
    char **notes;
    int n_notes;
    /* results */
    int failed;              /* 0: clean, 1: a failure (or an unclean end) was found */
    int culprit;             /* rank of the first failure, -1: none or no rank */
    const char *ff_cause;    /* the first failure's cause, NULL when clean */
    char ff_signal[16];
    int ff_status;           /* exit status, -1 */
    long ff_step;
    double ff_time;
    char ff_detail[768];
    const struct am_diag_flight *ff_in; /* hang: the collective the others waited in */
    struct am_diag_mismatch *mismatches;
    int n_mismatches;
};

void am_diag_init(struct am_diag *d);
void am_diag_free(struct am_diag *d);
/* Adds one rank's log, from its text (tests feed hand-written logs). 0, or -1 (no memory). */
int am_diag_add_log(struct am_diag *d, int rank, const char *text, size_t len);
/* dir holds rank-<R>.jsonl files, or exactly one job directory that does. 0, or -1 with a
 * message (no such directory, no rank logs, several jobs) in err. */
int am_diag_load_dir(struct am_diag *d, const char *dir, char *err, size_t err_len);
/* A note for the report ("rank 3: the last line is cut short ..."). */
void am_diag_note(struct am_diag *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The rank's entry, created (empty) when new; NULL for a negative rank or no memory. */
struct am_diag_rank *am_diag_rank_get(struct am_diag *d, int rank);

void am_diag_analyze(struct am_diag *d);

void am_diag_print(const struct am_diag *d, FILE *f);
json_t *am_diag_json(const struct am_diag *d);
const char *am_diag_verdict_name(enum am_diag_verdict v);

#endif
