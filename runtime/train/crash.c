/* crash.c - the rank's failure report and its signal handlers (crash.h). */
#include "crash.h"

#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include "flight.h"
#include "sigfmt.h"

#define ALT_STACK_BYTES (128 * 1024)
#define MAX_FRAMES 48
#define WAIT_OTHER_REPORT_MS 2000

enum { REPORT_NONE, REPORT_WRITING, REPORT_DONE };

static const int crash_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
static const int stop_signals[] = {SIGTERM, SIGINT};
#define N_CRASH (int)(sizeof(crash_signals) / sizeof(crash_signals[0]))
#define N_STOP (int)(sizeof(stop_signals) / sizeof(stop_signals[0]))

/* The one static context (crash.h, "State"). */
static struct {
    int fd;                      /* the log, our own copy; -1: not installed */
    int rank;
    pid_t supervisor;            /* the parent at install time: am-launch */
    const struct am_flight *flight;
    pid_t main_tid;              /* the installing thread: stop signals are handled there */
    _Atomic long step;
    _Atomic int report;          /* REPORT_* */
    void *alt_stack;
    int leaving;                 /* am_crash_leaving: stop signals ignored */
} crash = {.fd = -1};

void am_crash_set_step(long step) { atomic_store_explicit(&crash.step, step, memory_order_relaxed); }
long am_crash_step(void) { return atomic_load_explicit(&crash.step, memory_order_relaxed); }

int am_crash_report_begin(void)
{
    int expected = REPORT_NONE;
    return atomic_compare_exchange_strong(&crash.report, &expected, REPORT_WRITING);
}

void am_crash_report_end(void)
{
    if (crash.fd >= 0)
        am_flight_dump(crash.flight, crash.fd);
    atomic_store(&crash.report, REPORT_DONE);
}

int am_crash_reported(void) { return atomic_load(&crash.report) != REPORT_NONE; }

/* ---- names (tables: no strsignal, which is not async-signal-safe) ------------------------ */

static const char *signal_name(int sig)
{
    switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    }
    return "SIG?";
}

static const char *code_name(int sig, int code)
{
    switch (code) {
    case SI_USER: return "SI_USER";
    case SI_TKILL: return "SI_TKILL";
    case SI_QUEUE: return "SI_QUEUE";
    case SI_KERNEL: return "SI_KERNEL";
    }
    if (sig == SIGSEGV)
        return code == SEGV_MAPERR ? "SEGV_MAPERR" : code == SEGV_ACCERR ? "SEGV_ACCERR" : NULL;
    if (sig == SIGBUS)
        return code == BUS_ADRALN ? "BUS_ADRALN" : code == BUS_ADRERR ? "BUS_ADRERR" : code == BUS_OBJERR ? "BUS_OBJERR" : NULL;
    if (sig == SIGFPE)
        return code == FPE_INTDIV ? "FPE_INTDIV" : code == FPE_INTOVF ? "FPE_INTOVF" : code == FPE_FLTDIV ? "FPE_FLTDIV"
             : code == FPE_FLTOVF ? "FPE_FLTOVF" : code == FPE_FLTINV ? "FPE_FLTINV" : NULL;
    if (sig == SIGILL)
        return code == ILL_ILLOPC ? "ILL_ILLOPC" : code == ILL_ILLOPN ? "ILL_ILLOPN" : code == ILL_PRVOPC ? "ILL_PRVOPC"
             : NULL;
    return NULL;
}

static int is_crash(int sig)
{
    for (int i = 0; i < N_CRASH; i++)
        if (crash_signals[i] == sig)
            return 1;
    return 0;
}

/* "am-train(am_fault_segv+0x1c) [0x55d0c1a2b3c4]", as backtrace_symbols_fd writes it. A
 * caller's frame holds a return address, which for a call to a function that does not
 * return (abort) may lie past the caller's end: such frames are looked up at pc - 1. */
static void put_frame(struct am_sbuf *b, void *pc, int is_return_address)
{
    Dl_info info;
    char text[512];
    struct am_sbuf t;
    am_sbuf_init(&t, text, sizeof(text));
    if (dladdr((char *)pc - is_return_address, &info) && info.dli_fname) {
        const char *base = info.dli_fname;
        for (const char *p = info.dli_fname; *p; p++)
            if (*p == '/')
                base = p + 1;
        am_sbuf_str(&t, base);
        am_sbuf_char(&t, '(');
        if (info.dli_sname && info.dli_saddr) {
            am_sbuf_str(&t, info.dli_sname);
            am_sbuf_char(&t, '+');
            am_sbuf_hex(&t, (uint64_t)((uintptr_t)pc - (uintptr_t)info.dli_saddr));
        } else {
            am_sbuf_char(&t, '+');
            am_sbuf_hex(&t, (uint64_t)((uintptr_t)pc - (uintptr_t)info.dli_fbase));
        }
        am_sbuf_str(&t, ") [");
    } else {
        am_sbuf_char(&t, '[');
    }
    am_sbuf_hex(&t, (uint64_t)(uintptr_t)pc);
    am_sbuf_char(&t, ']');
    am_sbuf_json_str(b, text);
}

size_t am_crash_format_signal(char *buf, size_t cap, int sig, int code, const void *addr, long sender_pid,
                              int from_supervisor, int rank, long step, double time, void *const *frames,
                              int n_frames)
{
    struct am_sbuf b;
    if (cap < 8)
        return 0;
    am_sbuf_init(&b, buf, cap - 4); /* room for "]}\n" when the frames overflow */
    const char *cname = code_name(sig, code);
    int user = code == SI_USER || code == SI_TKILL || code == SI_QUEUE;
    am_sbuf_str(&b, "{\"type\":\"cause\",\"cause\":\"signal\",\"signal\":");
    am_sbuf_i64(&b, sig);
    am_sbuf_str(&b, ",\"signal_name\":");
    am_sbuf_json_str(&b, signal_name(sig));
    am_sbuf_str(&b, ",\"code\":");
    am_sbuf_i64(&b, code);
    am_sbuf_str(&b, ",\"code_name\":");
    am_sbuf_json_str(&b, cname);
    am_sbuf_str(&b, ",\"addr\":");
    if (is_crash(sig) && !user) {
        am_sbuf_char(&b, '"');
        am_sbuf_hex(&b, (uint64_t)(uintptr_t)addr);
        am_sbuf_char(&b, '"');
    } else {
        am_sbuf_str(&b, "null");
    }
    am_sbuf_str(&b, ",\"sender_pid\":");
    if (user)
        am_sbuf_i64(&b, sender_pid);
    else
        am_sbuf_str(&b, "null");
    am_sbuf_str(&b, ",\"from\":");
    am_sbuf_json_str(&b, !user ? "kernel" : from_supervisor ? "supervisor" : sender_pid == (long)getpid() ? "self" : "other");
    am_sbuf_str(&b, ",\"rank\":");
    am_sbuf_i64(&b, rank);
    am_sbuf_str(&b, ",\"step\":");
    if (step > 0)
        am_sbuf_i64(&b, step);
    else
        am_sbuf_str(&b, "null");
    am_sbuf_str(&b, ",\"time\":");
    am_sbuf_fixed(&b, time, 6);
    am_sbuf_str(&b, ",\"backtrace\":[");
    size_t keep = b.len;
    for (int i = 0; i < n_frames; i++) {
        if (i)
            am_sbuf_char(&b, ',');
        put_frame(&b, frames[i], i > 0);
        if (b.overflow) { /* drop the frame that did not fit */
            b.len = keep;
            b.buf[b.len] = '\0';
            break;
        }
        keep = b.len;
    }
    b.cap = cap; /* the closing text always fits: reserved above */
    b.overflow = 0;
    am_sbuf_str(&b, "]}\n");
    return b.len;
}

/* ---- the handler ------------------------------------------------------------------------------ */

/* The interrupted instruction, from the signal's context (0 when unknown). */
static uintptr_t interrupted_pc(const void *uctx)
{
    const ucontext_t *uc = uctx;
    if (!uc)
        return 0;
#if defined(__x86_64__)
    return (uintptr_t)uc->uc_mcontext.gregs[REG_RIP];
#elif defined(__aarch64__)
    return (uintptr_t)uc->uc_mcontext.pc;
#else
    return 0;
#endif
}

static void on_signal(int sig, siginfo_t *si, void *uctx)
{
    int saved = errno;
    if (!is_crash(sig) && crash.main_tid > 0 && (pid_t)syscall(SYS_gettid) != crash.main_tid) {
        /* a stop signal is the process's: the kernel may hand it to any thread (an OpenMP
         * worker); pass it to the main thread, whose backtrace says where the rank was */
        syscall(SYS_tgkill, getpid(), crash.main_tid, sig);
        errno = saved;
        return;
    }
    int expected = REPORT_NONE;
    if (atomic_compare_exchange_strong(&crash.report, &expected, REPORT_WRITING)) {
        char line[12288];
        void *frames[MAX_FRAMES];
        int n = backtrace(frames, MAX_FRAMES), first = 0;
        uintptr_t pc = interrupted_pc(uctx);
        for (int i = 0; pc && i < n; i++) /* drop the handler's own frames */
            if ((uintptr_t)frames[i] == pc || (uintptr_t)frames[i] == pc + 1) {
                first = i;
                break;
            }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long sender = si ? (long)si->si_pid : 0;
        size_t len = am_crash_format_signal(line, sizeof(line), sig, si ? si->si_code : 0, si ? si->si_addr : NULL,
                                            sender, sender > 0 && sender == (long)crash.supervisor, crash.rank,
                                            am_crash_step(), (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec,
                                            frames + first, n - first);
        if (crash.fd >= 0) {
            am_write_all(crash.fd, line, len);
            am_flight_dump(crash.flight, crash.fd);
        }
        atomic_store(&crash.report, REPORT_DONE);
    } else {
        /* another thread is writing the report: let it finish before this signal ends us */
        for (int i = 0; i < WAIT_OTHER_REPORT_MS / 10 && atomic_load(&crash.report) == REPORT_WRITING; i++) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    /* die of this signal, the default way: a fault re-executes and is fatal now; a raised
     * signal is pending until the handler returns */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (!is_crash(sig) || (si && (si->si_code == SI_USER || si->si_code == SI_TKILL)))
        raise(sig);
    errno = saved;
}

int am_crash_install(int log_fd, int rank, const struct am_flight *f, char *err, size_t err_len)
{
    if (crash.fd >= 0)
        am_crash_uninstall();
    int fd = fcntl(log_fd, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) {
        snprintf(err, err_len, "crash handler: cannot duplicate the log's file descriptor: %s", strerror(errno));
        return -1;
    }
    void *frames[4];
    backtrace(frames, 4); /* loads libgcc's unwinder now, not in the handler */
    crash.alt_stack = malloc(ALT_STACK_BYTES);
    if (crash.alt_stack) {
        stack_t st = {.ss_sp = crash.alt_stack, .ss_size = ALT_STACK_BYTES, .ss_flags = 0};
        if (sigaltstack(&st, NULL) < 0) {
            free(crash.alt_stack);
            crash.alt_stack = NULL;
        }
    }
    crash.rank = rank;
    crash.supervisor = getppid();
    crash.main_tid = (pid_t)syscall(SYS_gettid);
    crash.flight = f;
    atomic_store(&crash.step, 0);
    atomic_store(&crash.report, REPORT_NONE);
    crash.fd = fd;
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_CRASH; i++)
        sigaddset(&sa.sa_mask, crash_signals[i]);
    for (int i = 0; i < N_STOP; i++)
        sigaddset(&sa.sa_mask, stop_signals[i]);
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    for (int i = 0; i < N_CRASH; i++)
        sigaction(crash_signals[i], &sa, NULL);
    for (int i = 0; i < N_STOP; i++)
        sigaction(stop_signals[i], &sa, NULL);
    return 0;
}

void am_crash_set_flight(const struct am_flight *f) { crash.flight = f; }

void am_crash_leaving(void)
{
    crash.leaving = 1;
    for (int i = 0; i < N_STOP; i++)
        signal(stop_signals[i], SIG_IGN);
}

void am_crash_uninstall(void)
{
    if (crash.fd < 0)
        return;
    for (int i = 0; i < N_CRASH; i++)
        signal(crash_signals[i], SIG_DFL);
    for (int i = 0; i < N_STOP; i++)
        signal(stop_signals[i], crash.leaving ? SIG_IGN : SIG_DFL);
    if (crash.alt_stack) {
        stack_t st = {.ss_flags = SS_DISABLE};
        sigaltstack(&st, NULL);
        free(crash.alt_stack);
        crash.alt_stack = NULL;
    }
    close(crash.fd);
    crash.fd = -1;
    crash.flight = NULL;
}
