/* crash.h - the rank's failure report: one cause record, then the flight recorder.
 *
 * Whatever ends a rank abnormally writes one "cause" record to the rank's log followed by
 * the flight recorder's dump (flight.h); the first writer wins and later ones write
 * nothing, so that a rank's log names one cause (the first) even when, say, a watchdog's
 * timeout and a SIGTERM from the supervisor race. Writers:
 *
 *   - signal handlers, installed by am_crash_install, async-signal-safe (no malloc, no
 *     stdio; text from sigfmt.h; the log's fd opened beforehand):
 *       SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT   "cause":"signal" with the signal, its code,
 *                                                   the fault address and a backtrace
 *       SIGTERM, SIGINT                            "cause":"signal" with the sender's pid
 *                                                   ("from":"supervisor" when it is the
 *                                                   supervisor am-launch, else "other": Slurm
 *                                                   at the time limit, scancel, preemption)
 *     (a stop signal that the kernel hands to another thread is passed on to the thread that
 *     installed the handlers, the main thread, so that the backtrace shows where the rank was);
 *     then the handler restores the default action and re-raises, so the rank still dies of
 *     that signal (core dumps and the supervisor's exit record unchanged). The crash signals
 *     run on an alternate stack (a stack overflow is a SIGSEGV too).
 *   - ordinary code (the trainer, the watchdog thread): am_crash_report_begin() says
 *     whether the caller is first; it then writes its cause record itself (log.h) and calls
 *     am_crash_report_end(), which appends the flight recorder.
 *
 * The cause record of a signal (docs/diagnostics.md lists every field):
 *   {"type":"cause","cause":"signal","signal":11,"signal_name":"SIGSEGV","code":1,
 *    "code_name":"SEGV_MAPERR","addr":"0x10","sender_pid":null,"from":"kernel","rank":3,
 *    "step":4,"time":1767000000.123456,
 *    "backtrace":["am-train(am_fault_segv+0x1c) [0x55d0c1a2b3c4]", ...]}
 * Backtraces: backtrace(3) (libgcc's unwinder, loaded at install by one call so that the
 * handler does not load it) and dladdr(3) for the module and symbol of each frame, the same
 * as backtrace_symbols_fd(3) does; static functions show as module(+offset) (am-train is
 * linked with -rdynamic so that its other functions have names). dladdr is not on POSIX's
 * async-signal-safe list (glibc's takes the loader's lock): a crash inside the dynamic
 * loader could deadlock the handler before it writes the record; the supervisor's exit
 * record still says how the rank ended.
 *
 * State: the module has one static context (the handler can reach nothing else): the log's
 * fd, the rank, the supervisor's pid, the main thread's id, the flight recorder, the step in
 * progress and the report's state (none / being written / written), set by
 * am_crash_install and the calls below, read by the handler. It is the only global mutable
 * state of the runtime.
 */
#ifndef AM_CRASH_H
#define AM_CRASH_H

#include <stddef.h>

struct am_flight;

/* Installs the handlers. log_fd is duplicated (the handler writes to its own copy; the
 * file must be open with O_APPEND); f may be NULL. 0, or -1 with a message. */
int am_crash_install(int log_fd, int rank, const struct am_flight *f, char *err, size_t err_len);
/* The flight recorder to dump after a cause record (NULL: none), once it exists. */
void am_crash_set_flight(const struct am_flight *f);
/* Default actions back, the fd closed (a normal end). */
void am_crash_uninstall(void);
/* The rank leaves on its own with a status its job needs (saved on Slurm's warning, to be
 * requeued): stop signals are ignored from now on, past am_crash_uninstall too, so that a peer
 * ending first (srun --kill-on-bad-exit then stops the step) cannot turn this rank's status
 * into a signal's. */
void am_crash_leaving(void);
/* The 1-based training step in progress (0: none yet), for the cause records. */
void am_crash_set_step(long step);
long am_crash_step(void);

/* 1: the caller is first and must write its cause record now, then call
 * am_crash_report_end; 0: a report exists or is being written (write nothing). */
int am_crash_report_begin(void);
/* Appends the flight recorder's dump after the caller's cause record; marks the report done. */
void am_crash_report_end(void);
/* 1 once a report was begun. */
int am_crash_reported(void);

/* The async-signal-safe cause record of signal sig (as the handler writes it, without the
 * backtrace when frames is 0), for tests: returns the line's length (with '\n'). */
size_t am_crash_format_signal(char *buf, size_t cap, int sig, int code, const void *addr, long sender_pid,
                              int from_supervisor, int rank, long step, double time, void *const *frames,
                              int n_frames);

#endif
