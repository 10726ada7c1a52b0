/* bootstrap.h - how a rank learns who it is and exchanges small blobs with the others.
 *
 * A rank program (am-train, the communicator tests) is always started by am-launch, which
 * hands it one end of a unix socketpair in the environment (AM_BOOTSTRAP_FD) and serves
 * this interface over it:
 *   - standalone (`am-launch --nproc N`): the parent serves all N ranks from its own store;
 *   - under `srun --mpi=pmix am-launch`: each rank's supervisor is the PMIx client and relays
 *     put -> PMIx_Put, fence -> PMIx_Commit + PMIx_Fence(collect), get -> PMIx_Get, and
 *     abort -> PMIx_Abort, so the rank itself never links PMIx and its supervisor can abort
 *     the step when the rank dies without a word.
 *
 * Keys are short strings; values are blobs of at most AM_BOOT_MAX_VALUE bytes. Every call
 * that waits takes a timeout and fails with a message naming the operation rather than hang.
 * Errors: the runtime's convention (util.h): a call that can fail takes `char *err, size_t
 * err_len` last and returns 0, or -1 with the message written there.
 */
#ifndef AM_BOOTSTRAP_H
#define AM_BOOTSTRAP_H

#include <stddef.h>

#define AM_BOOT_MAX_KEY 64
#define AM_BOOT_MAX_VALUE (1 << 20)

struct am_boot_info {
    int rank, size;             /* global rank and world size */
    int local_rank, local_size; /* on this node */
    int node_id, n_nodes;       /* dense node index, 0..n_nodes-1 */
    char host[256];             /* node name: SLURMD_NODENAME under Slurm, else the host name */
    char job_id[64];            /* SLURM_JOB_ID[.step], or a made-up id for standalone runs */
};

struct am_boot;

/* Connects to the launcher named by AM_BOOTSTRAP_FD. On failure returns NULL and writes a
 * message (which says how to launch a rank program) to err. */
struct am_boot *am_boot_init(struct am_boot_info *info, char *err, size_t err_len);
/* The same over an open stream to a launcher (the bootstrap's benchmark drives a server with
 * thousands of these); the fd is the am_boot's from then on (closed by am_boot_fini). */
struct am_boot *am_boot_connect(int fd, struct am_boot_info *info, char *err, size_t err_len);
void am_boot_fini(struct am_boot *b);

/* Publishes key=value for the other ranks; visible to them after the next fence. */
int am_boot_put(struct am_boot *b, const char *key, const void *value, size_t len, char *err, size_t err_len);
/* Collective over all ranks: returns when every rank has fenced; puts before it are visible. */
int am_boot_fence(struct am_boot *b, double timeout_s, char *err, size_t err_len);
/* Reads rank's value of key (after a fence). *value is malloc'd; the caller frees it. */
int am_boot_get(struct am_boot *b, int rank, const char *key, void **value, size_t *len, double timeout_s,
                char *err, size_t err_len);
/* Every rank's len bytes under key, in one request (a put and a fence: the launcher answers
 * when every rank has sent its own): all holds size * len bytes, rank r's at r * len. */
int am_boot_allgather(struct am_boot *b, const char *key, const void *mine, size_t len, void *all,
                      double timeout_s, char *err, size_t err_len);
/* Ends the whole job (every rank), with status and a message for the logs. Does not return. */
void am_boot_abort(struct am_boot *b, int status, const char *msg) __attribute__((noreturn));

#endif
