/* fault.h - fault injection: AM_FAULT makes one rank misbehave on purpose at one step.
 *
 *   AM_FAULT=rank=R,step=S,kind=K
 *
 * R is the global rank (0-based), S the 1-based training step (the "step" of the log's step
 * records), K one of:
 *
 *   segv                a write to address 0x10 (SIGSEGV) at the start of step S
 *   abort               abort() (SIGABRT) at the start of step S
 *   exit:CODE           exit(CODE), CODE 0..255, at the start of step S, without a word
 *   nan                 a NaN in one gradient (the middle parameter tensor, named in the "fault"
 *                       record) after the backward pass of step S
 *   hang                the rank stops making progress at the start of step S (outside any
 *                       collective) and never resumes
 *   hang-in-collective  the gradient all-reduce of step S blocks inside the call on this rank
 *                       (as a hung kernel or a dead link would) until the watchdog aborts it;
 *                       needs data parallelism (dp > 1)
 *   slow:SECONDS        the rank sleeps SECONDS (> 0) at the start of step S, then goes on
 *   kill                the rank sends itself SIGKILL at the start of step S
 *   oom                 the rank allocates and touches memory until the kernel's OOM killer
 *                       ends it (run it under a memory limit: a cgroup's memory.max)
 *   device-oom          in the backward of step S, when the first parameter group's gradients
 *                       are final, the rank asks its device for more memory than any device
 *                       has (2^62 bytes), as a kernel's workspace outgrowing the GPU would:
 *                       the allocation fails for real, the device's fault hook (kernels.h)
 *                       writes the "oom" cause record (phase, layer, bytes), the step fails
 *   kill-in-alltoall    the rank sends itself SIGKILL inside the all-to-all that dispatches
 *                       the first MoE layer's tokens in step S, a second after the call began
 *                       (its flight entry open; its ep peers wait for it in that all-to-all);
 *                       needs expert parallelism (ep > 1)
 *   expert-rows-oom     in the forward of step S, the first MoE layer whose experts receive
 *                       rows on this rank grows its pool of saved expert rows as if the
 *                       routing had sent them more than the pool holds, and the growth asks
 *                       the device for 2^62 bytes: the allocation fails for real, the device's
 *                       fault hook writes the "oom" cause record, and the rank stops with the
 *                       growth's error (the layer, the rows received, the plan's balanced
 *                       load: moe.h); needs expert parallelism (ep > 1)
 *   kill-in-save:PHASE  the rank sends itself SIGKILL inside the checkpoint saved after step S,
 *                       at PHASE (shard_ckpt.h's phases, in this order: shard: half of its shard
 *                       file written; written: its shard on disk, before the ranks agree;
 *                       manifest, commit, latest: rank 0's, after the manifest, after the rename
 *                       of the directory, after `latest`); code holds the phase's number
 *
 * Before misbehaving the rank writes a "fault" record to its log (docs/diagnostics.md) so
 * that a reader of the log knows the failure was injected; am-diag never uses it to decide
 * anything. Unset or empty AM_FAULT: no fault. The functions that misbehave are not static,
 * so that they are named in backtraces.
 */
#ifndef AM_FAULT_H
#define AM_FAULT_H

#include <stddef.h>

enum am_fault_kind {
    AM_FAULT_NONE,
    AM_FAULT_SEGV,
    AM_FAULT_ABORT,
    AM_FAULT_EXIT,
    AM_FAULT_NAN,
    AM_FAULT_HANG,
    AM_FAULT_HANG_IN_COLLECTIVE,
    AM_FAULT_SLOW,
    AM_FAULT_KILL,
    AM_FAULT_OOM,
    AM_FAULT_DEVICE_OOM,
    AM_FAULT_KILL_IN_ALLTOALL,
    AM_FAULT_KILL_IN_SAVE,
    AM_FAULT_EXPERT_ROWS_OOM,
};

struct am_fault {
    enum am_fault_kind kind;
    int rank;
    long step;
    int code;           /* exit:CODE */
    double seconds;     /* slow:SECONDS */
    char spec[128];     /* the text, for the "fault" record */
};

/* Parses spec (NULL or "" -> kind AM_FAULT_NONE). 0, or -1 with a message that quotes
 * AM_FAULT, names the part that is wrong, the rule and an example. */
int am_fault_parse(const char *spec, struct am_fault *f, char *err, size_t err_len);
/* The job's facts: rank < world, and hang-in-collective needs dp > 1. 0, or -1. */
int am_fault_check(const struct am_fault *f, int world, int dp, char *err, size_t err_len);
/* The kinds that need expert parallelism: -1 with a message when ep is 1. */
int am_fault_check_ep(const struct am_fault *f, int ep, char *err, size_t err_len);
/* True when f is due at this rank and 1-based step, for one of the kinds. */
int am_fault_due(const struct am_fault *f, int rank, long step, enum am_fault_kind kind);
const char *am_fault_kind_name(enum am_fault_kind kind);

/* The misbehaviours. */
void am_fault_segv(void) __attribute__((noreturn, noinline));
void am_fault_abort(void) __attribute__((noreturn, noinline));
void am_fault_exit(int code) __attribute__((noreturn, noinline));
void am_fault_kill(void) __attribute__((noreturn, noinline));
void am_fault_oom(void) __attribute__((noreturn, noinline));
void am_fault_hang(void) __attribute__((noreturn, noinline));
void am_fault_sleep(double seconds) __attribute__((noinline));

#endif
