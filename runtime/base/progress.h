/* progress.h - a progress line on a terminal for long work (am-data build, am-ckpt export
 * and merge): what is done of the total bytes, the rate, the time left, and optionally a
 * count of items (tokens) with their rate:
 *   am-ckpt export:  42.0%  1.23 of 2.93 GB  312 MB/s  0:05 left
 *   am-data build:  42.0%  1.23 of 2.93 GB  312 MB/s  0:05 left  12.34M tokens  3.21M tokens/s
 * redrawn in place ("\r") at most four times a second, ended by a newline. Off (nothing
 * printed) unless `on`: the programs turn it on when stderr is a terminal, and take
 * --progress / --quiet (--no-progress) to choose. Not thread-safe: one thread updates it. */
#ifndef AM_PROGRESS_H
#define AM_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

struct am_progress {
    FILE *out;          /* stderr */
    const char *what;   /* "am-ckpt export" */
    const char *items;  /* "tokens", or NULL: no item count */
    uint64_t total;     /* bytes; 0: unknown (no percentage, no time left) */
    uint64_t done, n_items;
    uint64_t from, items_from; /* the first values set (a resumed job's): the rates count from them */
    double t0, drawn;   /* am_mono_time() at the start and at the last draw */
    bool on, shown, set;
};

/* Starts the line (nothing printed yet). */
void am_progress_start(struct am_progress *p, const char *what, const char *items, uint64_t total, bool on);
/* Sets what is done (bytes, and items when counted; the first call's values are where the
 * work started, for the rates), and redraws when a quarter second has passed since the last
 * draw. */
void am_progress_set(struct am_progress *p, uint64_t done, uint64_t n_items);
/* Ends the line: the last values drawn and a newline when it was shown, or (ok) always drawn
 * once at the end so that a short job shows its totals too. */
void am_progress_end(struct am_progress *p, bool ok);

/* The progress switch of a program's options: "--progress" 1, "--quiet" / "--no-progress" 0,
 * another argument -1 (not one of these). */
int am_progress_option(const char *arg);

#endif
