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
 *      least AM_DIAG_STRAGGLER_S and by twice that median, told apart by its expert load when
 *      the step records carry one (ep_tokens_in: at AM_DIAG_EP_OVERLOAD times the median
 *      rank's or more at its worst step, routing overloaded it); or, in a hang, another member that
 *      never reached #k), clean, missing.
 *   4. mismatches: ranks of one group whose flight recorders hold the same collective
 *      sequence number with a different op, dtype or count, or that are stuck (in flight at
 *      their end) in sequence numbers of one group two or more apart.
 * Every rank number read from a log is checked before use: against the job's size (the start
 * records' "world"; without one, the ranks known) and looked up in the entries, never used as
 * an index. Every step of the analysis is linear or n log n in the logs' size.
 * Output (diag_report.c): a human summary, then per-rank details, untrusted text escaped; or
 * one JSON object (every string valid UTF-8: cut on a character boundary).
 */
#ifndef AM_DIAG_H
#define AM_DIAG_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define AM_DIAG_STRAGGLER_S 1.0
/* A straggler whose experts received at least this many times the median rank's expert tokens
 * at its worst step was overloaded by the routing (expert parallelism), not slow by itself. */
#define AM_DIAG_EP_OVERLOAD 1.5

/* Limits: what one log may cost am-diag, whatever it holds. Ranks, groups, steps and flight
 * entries are stored only as the logs hold them (a rank number written inside a log, "world"
 * included, never sizes an allocation). Lines longer than AM_DIAG_MAX_LINE are skipped; a log
 * longer than max_file (AM_DIAG_MAX_FILE by default) is read as its first AM_DIAG_HEAD bytes and
 * its last max_file - AM_DIAG_HEAD (the start and groups records, and the end: cause, flight
 * recorder, exit); each with a note. */
#define AM_DIAG_MAX_LINE ((size_t)16 << 20)
#define AM_DIAG_MAX_FILE ((size_t)1 << 30)
#define AM_DIAG_HEAD ((size_t)16 << 20)
#define AM_DIAG_MAX_MISMATCHES 1000  /* listed; more are counted */
#define AM_DIAG_MAX_HOPS 64          /* a hang's blame follows at most this many waits */
#define AM_DIAG_MAX_LISTED 65536     /* --json's missing_ranks lists at most this many */
#define AM_DIAG_RECENT_STEPS 64      /* step times kept per rank (its last ones): am_diag_timing */
#define AM_DIAG_RECENT_SAVES 4       /* save durations kept per rank (its last ones) */

/* One flight recorder entry as dumped. Times are wall-clock seconds, 0 when null or not a
 * sane time. The strings are interned: owned by struct am_diag, never NULL ("" when absent). */
struct am_diag_flight {
    const char *group, *op, *dtype, *state;
    int gid;
    uint64_t id, seq, count, bytes;
    int peer, waiting_for; /* -1: null, or not a rank of the job */
    double enqueued, started, ended;
};

struct am_diag_group {
    const char *name;
    int gid;
    int *ranks; /* members in group order (rank numbers outside the job removed) */
    int n;
};

/* A step record: its number, the rank's time outside communication (step_s - comm_s), and
 * with expert parallelism the token rows its experts received in the step (ep_tokens_in; -1
 * when the record has none). */
struct am_diag_step {
    uint32_t step;
    float compute;
    float ep_in;
    float end; /* the record's time, in seconds after the rank's step_t0 (0 when it has none) */
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
    long last_step;                      /* the highest step recorded */
    double last_step_time;               /* the latest step record's time */
    double step_t0;                      /* the first step record's time: steps[].end counts from it */
    uint32_t first_step;                 /* the lowest step recorded and its step_s (where the */
    float first_step_s;                  /* timeline's first step begins) */
    /* memory: the memory record's bytes (weights, gradients, optimizer state, gathered groups,
     * gradient buffers, activations, pipeline buffers: what am-plan counts), am-plan's estimate
     * for the rank (the start record's plan_bytes) and the device allocator's peak (the step
     * records' dev_mem_peak, the largest); 0 when absent */
    double mem_bytes, plan_bytes, dev_peak;
    struct am_diag_flight *flight;
    size_t n_flight, cap_flight;
    struct am_diag_group *groups;
    int n_groups;
    json_t *cause, *stop, *exit, *fault; /* first of each, or NULL */
    json_t *ckpt;                        /* the last "checkpoint" record (a committed save), or NULL */
    long ckpt_started;                   /* the step of the last "checkpoint_start" record, 0: none */
    /* the last AM_DIAG_RECENT_STEPS step records' step_s and the last AM_DIAG_RECENT_SAVES
     * "checkpoint" records' seconds and steps, in rings (slot = count % size); the counts are of
     * all the records read */
    float recent_step_s[AM_DIAG_RECENT_STEPS];
    float recent_save_s[AM_DIAG_RECENT_SAVES];
    long recent_save_step[AM_DIAG_RECENT_SAVES];
    long n_step_s, n_save_s;
    double last_time;                    /* of the last record with a time */
    int lines, bad_lines, truncated;
    /* per log, summarised in one note each: lines that are not JSON objects, lines over
     * AM_DIAG_MAX_LINE, values that are no sane step number, rank numbers outside the job */
    int first_bad_line, long_lines, first_long_line, bad_steps, bad_ranks;
    long first_bad_rank;
    char bad_text[160];                  /* the first bad line's parse error */
    /* analysis */
    enum am_diag_end end;
    const char *kind;       /* the cause's name: signal, nonfinite, error, exit, killed, oom (the OOM killer,
                             * or a device allocation's cause record), cuda, nccl, timeout, comm, ... */
    char signal[16];        /* "SIGSEGV", or "" */
    int status;             /* exit status, -1 unknown */
    long step;              /* the step it was in (1-based), 0 unknown */
    double fail_time;       /* wall clock of its end, 0 unknown */
    double progress;        /* when it last made progress (a completed call, a step) */
    const struct am_diag_flight *in;    /* the call in flight at its end (not completed), or NULL */
    int waiting_for;        /* global rank it waited for, -1 */
    double waited_s;
    int visited;            /* the hang analysis passed here */
    long ep_step;           /* straggler: its worst step when that step's records carry
                             * ep_tokens_in (0: none), the tokens its experts received then and
                             * the median rank's */
    double ep_in, ep_median;
    long slow_step;         /* straggler: the step where its time outside collectives exceeded the
                             * median rank's the most (0: none) */
    enum am_diag_verdict verdict;
    char detail[768];
};

struct am_diag_mismatch {
    const char *group;
    char what[16]; /* what: "op", "size", "sequence" */
    int gid;
    uint64_t seq;
    char text[512];
};

/* The analysis' lookups (built by am_diag_analyze): a group by its id (the first rank's
 * record of it, members sorted for membership tests), and how many ranks waited for a rank
 * in a collective. */
struct am_diag_gref {
    int gid;
    const struct am_diag_group *g;
    int *sorted;
};
struct am_diag_vote {
    int rank, gid, n;
    uint64_t seq;
};

/* A run of ranks lo..hi (inclusive). */
struct am_diag_range {
    int lo, hi;
};

struct am_diag {
    char dir[4096], job[64];
    int world;               /* from the start records; else the highest rank known + 1 */
    /* ranks: those with a log and those named in a log (group members, peers), once each;
     * sorted by rank after am_diag_analyze (loading appends) */
    struct am_diag_rank *ranks;
    int n_ranks, cap_ranks;
    int *index;              /* open addressing: rank -> position + 1 in ranks[] */
    size_t index_cap;
    /* interned strings */
    char **strings;
    size_t n_strings, strings_cap;
    char **notes;
    int n_notes, cap_notes;
    size_t max_file;         /* bytes read per log (AM_DIAG_MAX_FILE) */
    long max_listed;         /* --json's missing_ranks lists at most this many (AM_DIAG_MAX_LISTED) */
    int threads;             /* am_diag_load_dir's readers: 0 = one per CPU, at most 16 */
    int timing;              /* read for am_diag_timing only: step records are not stored (their
                              * times go to the rings alone), flight and groups records are
                              * skipped; no analysis follows */
    void *lock;              /* the readers' pthread mutex while they run, else NULL */
    /* results */
    struct am_diag_gref *gref;
    int n_gref;
    struct am_diag_vote *votes;
    int n_votes;
    struct am_diag_range *missing; /* ranks of 0..world-1 without a log */
    int n_missing_ranges;
    long n_missing;
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
    int n_mismatches, more_mismatches;
};

void am_diag_init(struct am_diag *d);
void am_diag_free(struct am_diag *d);
/* Adds one rank's log, from its text (tests feed hand-written logs). 0, or -1 (no memory). */
int am_diag_add_log(struct am_diag *d, int rank, const char *text, size_t len);
/* dir holds rank-<R>.jsonl files, or exactly one job directory that does. The logs are read
 * by d->threads threads (each parses whole logs; entries, strings and notes are shared under a
 * lock). 0, or -1 with a message (no such directory, no rank logs, several jobs) in err. */
int am_diag_load_dir(struct am_diag *d, const char *dir, char *err, size_t err_len);
/* A note for the report ("rank 3: the last line is cut short ..."). */
void am_diag_note(struct am_diag *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The rank's entry, created (empty) when new; NULL for a negative rank or no memory. Creating
 * an entry may move every entry: no pointer into ranks[] is kept across a call. */
struct am_diag_rank *am_diag_rank_get(struct am_diag *d, int rank);
/* The rank's entry, or NULL: never creates one. */
struct am_diag_rank *am_diag_rank_find(const struct am_diag *d, int rank);
/* Sorts the entries by rank (done by am_diag_analyze). 0, or -1 (no memory). */
int am_diag_sort_ranks(struct am_diag *d);
/* The interned copy of s[0..n) (one per distinct string, freed with d); NULL: no memory. */
const char *am_diag_intern(struct am_diag *d, const char *s, size_t n);

/* The fast reader of flat records (diag_flat.c): a JSON object whose values are all scalars,
 * ASCII without escapes. Returns the number of fields (at most max), or -1 when the line is
 * not such an object (the caller hands it to jansson, which decides). Values are exactly what
 * jansson would load: kind 's' (string, not NUL-terminated), 'i' (integer i), 'r' (real: read
 * it with am_diag_flat_real), 't', 'f', 'n' (true, false, null). */
struct am_diag_field {
    const char *key, *s;
    size_t key_len, s_len;
    char kind;
    char ready, frac, neg; /* a real: r when ready, else -1^neg * mant / 10^frac (exact operands) */
    long long i;
    double r;
    uint64_t mant;
};
int am_diag_flat_parse(const char *line, size_t n, struct am_diag_field *fields, int max);
/* The same, with keys predicted: keys (zeroed before the first line) remembers each
 * position's key of the lines read; a key whose bytes are exactly those of the same position
 * in an earlier line ('"', the key, '":') is taken without scanning it. Lines of one kind
 * repeat their keys in order: most keys are matched as two 8-byte words. */
#define AM_DIAG_FLAT_KEYS 32
struct am_diag_flat_keys {
    uint64_t text[AM_DIAG_FLAT_KEYS][2]; /* '"', the key, '":', zero-filled */
    unsigned char len[AM_DIAG_FLAT_KEYS]; /* 0: none */
    unsigned char tag[AM_DIAG_FLAT_KEYS]; /* the caller's, of the key remembered (0 when it changes) */
};
int am_diag_flat_parse_keys(const char *line, size_t n, struct am_diag_field *fields, int max,
                            struct am_diag_flat_keys *keys);
/* A real field's value (kind 'r'): strtod's, as jansson's (divided when read: most reals
 * of a record are never read). */
double am_diag_flat_real(const struct am_diag_field *f);

/* Untrusted text for a terminal: printable ASCII and well-formed UTF-8 (not C1 controls) as
 * they are; \n \r \t \\ and \xHH for every other byte. Returns the bytes it wrote (the
 * output ends with NUL, cut on a whole escape). */
size_t am_diag_escape(const char *s, char *out, size_t len);
/* Cuts a trailing incomplete UTF-8 sequence off buf (after a truncating snprintf). */
void am_diag_utf8_trim(char *buf);

void am_diag_analyze(struct am_diag *d);

/* The step and save times of a job (diag_timing.c), from the rings of its logs: what am-plan's
 * signal lead reads. step_s: the largest over the ranks of the median of a rank's recent step
 * times (step_rank's), -1 with no step record; save_s: the longest of the ranks' recent saves
 * (save_rank's, of step save_step), -1 with no "checkpoint" record. */
struct am_diag_timing {
    double step_s, save_s;
    int step_rank, save_rank, step_ranks, save_ranks; /* step_ranks, save_ranks: ranks with such records */
    long save_step;
};
void am_diag_timing(const struct am_diag *d, struct am_diag_timing *t);

/* The human report: am_diag_print is the summary (the job, the first failure, its cause and
 * backtrace, the others' verdicts, missing logs, mismatches, the last checkpoint), then a line
 * per rank (am_diag_print_rank's, without a newline: "rank 5 on n3: victim: ..."), then the
 * notes. Untrusted text is escaped (am_diag_escape). */
void am_diag_print(const struct am_diag *d, FILE *f);
void am_diag_print_summary(const struct am_diag *d, FILE *f);
void am_diag_print_rank(const struct am_diag *d, const struct am_diag_rank *r, FILE *f);
/* "41.0 GiB": n bytes in binary units with `decimals` decimals (below 1 KiB: "512 B"), in buf. */
const char *am_diag_bytes_text(double n, int decimals, char *buf, size_t len);

/* The same verdict as one self-contained HTML page (diag_html.c): no file fetched (inline CSS,
 * SVG and a little JS). First am_diag_print_summary's lines, then a timeline (one lane per rank
 * grouped by node: setup, steps over wall time, where it stopped, the call in flight at its end
 * and the rank it waited for, stragglers' slow step; beyond AM_DIAG_HTML_LANES ranks a lane per
 * node plus lanes for the ranks that matter: the first failure, its groups' members, the
 * failed and the stragglers), where the ranks stopped (ranks by the call in flight at their
 * end), memory per rank (or node) against am-plan's estimate, and each rank's verdict and cause
 * record on click (at most AM_DIAG_HTML_CAUSES bytes of cause records, the culprit's first).
 * Every text from a log is escaped as the text report escapes it, then for HTML (entities; in
 * the page's JSON, \u003c for <). Stays under 5 MB at 4096 ranks (docs/performance.md).
 * 0, or -1 (a write failed). */
#define AM_DIAG_HTML_LANES 256
#define AM_DIAG_HTML_CAUSES ((size_t)1 << 20)
int am_diag_html(const struct am_diag *d, FILE *f);
json_t *am_diag_json(const struct am_diag *d);
const char *am_diag_verdict_name(enum am_diag_verdict v);

#endif
