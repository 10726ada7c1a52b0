/* am-diag - after a job: which rank failed first, and why; what happened to the others.
 *
 *   am-diag LOGDIR [--json] [--html OUT.html] [--threads N]
 *
 * LOGDIR is the job's log directory (<log dir>/<job id>, holding rank-<R>.jsonl), or a log
 * directory holding exactly one job. Prints a short summary, then per-rank details; --json
 * prints one JSON object instead (docs/diagnostics.md); --html also writes the verdict as one
 * self-contained page (diag_html.c; "-": to stdout, instead of the report). Exit status: 0 the job was clean,
 * 1 a failure was found, 2 the input is unusable (with a message).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"
#include "version.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: am-diag LOGDIR [--json] [--html OUT.html] [--threads N]\n"
               "  LOGDIR   a job's log directory (<log dir>/<job id>, with rank-<R>.jsonl files),\n"
               "           or a log directory that holds one job\n"
               "  --json   one JSON object: first_failure, ranks (verdicts), missing_ranks, mismatches\n"
               "  --html OUT.html  also write the verdict as one self-contained page (a timeline of the ranks;\n"
               "           - : the page on stdout, instead of the report)\n"
               "  --threads N  read the logs with N threads (default: one per CPU, at most 16)\n"
               "exit status: 0 clean, 1 failure found, 2 unusable input\n");
}

int main(int argc, char **argv)
{
    if (am_version_option(argc, argv, "am-diag"))
        return 0;
    const char *dir = NULL, *html = NULL;
    int json = 0, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--html") == 0) {
            if (i + 1 >= argc || !argv[i + 1][0]) {
                fprintf(stderr, "am-diag: --html needs the page's file name (for example --html verdict.html; - for "
                        "stdout)\n");
                return 2;
            }
            html = argv[++i];
        } else if (strcmp(argv[i], "--threads") == 0) {
            char *end = NULL;
            long n = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : 0;
            if (!end || *end || n < 1 || n > 64) {
                fprintf(stderr, "am-diag: --threads %s: give a whole number from 1 to 64 (the threads that read the "
                        "logs, for example --threads 4)\n", i + 1 < argc ? argv[i + 1] : "(nothing)");
                return 2;
            }
            threads = (int)n;
            i++;
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "am-diag: unknown option %s\n", argv[i]);
            usage(stderr);
            return 2;
        } else if (dir) {
            fprintf(stderr, "am-diag: one LOGDIR only (got %s and %s)\n", dir, argv[i]);
            return 2;
        } else {
            dir = argv[i];
        }
    }
    if (!dir) {
        usage(stderr);
        return 2;
    }
    struct am_diag d;
    char err[1024];
    am_diag_init(&d);
    d.threads = threads;
    if (am_diag_load_dir(&d, dir, err, sizeof(err)) < 0) {
        fprintf(stderr, "am-diag: %s\n", err);
        am_diag_free(&d);
        return 2;
    }
    int records = 0;
    for (int q = 0; q < d.n_ranks; q++)
        records += d.ranks[q].lines - d.ranks[q].bad_lines - d.ranks[q].long_lines - d.ranks[q].truncated;
    if (records == 0) {
        fprintf(stderr, "am-diag: %s: the rank logs hold no record (every line is empty or not JSON): nothing to "
                "analyse\n", d.dir);
        for (int i = 0; i < d.n_notes; i++) { /* why: unreadable files, bad lines */
            char text[4200];
            am_diag_escape(d.notes[i], text, sizeof(text));
            fprintf(stderr, "  %s\n", text);
        }
        am_diag_free(&d);
        return 2;
    }
    am_diag_analyze(&d);
    if (html) {
        int out = strcmp(html, "-") == 0;
        FILE *f = out ? stdout : fopen(html, "w");
        if (!f || am_diag_html(&d, f) < 0 || (!out && fclose(f) != 0)) {
            fprintf(stderr, "am-diag: --html %s: cannot write the page: %s\n", html, strerror(errno));
            am_diag_free(&d);
            return 2;
        }
        if (out) {
            int rc = d.failed ? 1 : 0;
            am_diag_free(&d);
            return rc;
        }
    }
    if (json) {
        json_t *o = am_diag_json(&d);
        char *text = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(16));
        json_decref(o);
        if (!text) {
            fprintf(stderr, "am-diag: out of memory\n");
            am_diag_free(&d);
            return 2;
        }
        printf("%s\n", text);
        free(text);
    } else {
        am_diag_print(&d, stdout);
    }
    int rc = d.failed ? 1 : 0;
    am_diag_free(&d);
    return rc;
}
