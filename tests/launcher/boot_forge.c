/* boot_forge - a task of a Slurm step without PMIx that tries to join the step's boot server
 * (boot_tcp.h) with credentials it must refuse, prints each answer, then runs the rest of its
 * command line (the real am-launch, so that the step completes).
 *
 *   boot_forge MODE... -- COMMAND ARGS...
 * MODE: other-job (a valid credential for the next job id), other-server (for another
 * address), garbage (no credential at all), replay (a valid credential, decoded once before,
 * as a captured one would have been), not-a-join (a hello instead of a join), uid (made by
 * uid 65534: needs root).
 * Prints "boot_forge: MODE: refused: REASON" (or "... admitted", a failure) on stdout.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "boot_join.h"
#include "boot_proto.h"
#include "boot_tcp.h"
#include "slurm_env.h"

static const char *env(const char *name) { return getenv(name); }

static int try_join(const struct am_slurm_step *st, const char *mode, const char *cred)
{
    char err[512];
    int fd = am_boot_tcp_connect(st->server_host, st->port, 60, err, sizeof(err));
    if (fd < 0) {
        printf("boot_forge: %s: %s\n", mode, err);
        return 1;
    }
    int rc = am_boot_tcp_send_join(fd, st->info.rank, cred, err, sizeof(err));
    close(fd);
    if (rc == 0) {
        printf("boot_forge: %s: admitted\n", mode);
        return 1;
    }
    printf("boot_forge: %s: refused: %s\n", mode, err);
    return 0;
}

static int not_a_join(const struct am_slurm_step *st)
{
    char err[512];
    int fd = am_boot_tcp_connect(st->server_host, st->port, 60, err, sizeof(err));
    struct am_boot_req req = {.op = AM_BOOT_HELLO};
    struct am_boot_rep rep;
    char why[512] = "";
    if (fd < 0 || am_io_write_full(fd, &req, sizeof(req)) < 0 || am_io_read_full(fd, &rep, sizeof(rep)) < 0 ||
        rep.len >= sizeof(why) || am_io_read_full(fd, why, rep.len) < 0) {
        printf("boot_forge: not-a-join: no answer\n");
        return 1;
    }
    close(fd);
    printf("boot_forge: not-a-join: %s: %s\n", rep.status ? "refused" : "admitted", why);
    return rep.status == 0;
}

int main(int argc, char **argv)
{
    struct am_slurm_step st;
    char err[512], server[300], payload[512];
    if (am_slurm_step_read(&st, env, err, sizeof(err)) < 0) {
        fprintf(stderr, "boot_forge: %s\n", err);
        return 2;
    }
    snprintf(server, sizeof(server), "%s:%d", st.server_host, st.port);
    int i = 1, bad = 0;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        const char *mode = argv[i];
        struct am_join_expect x = {.job = st.job, .step = st.step, .size = st.info.size, .server = server};
        char *cred = NULL;
        if (strcmp(mode, "other-job") == 0) {
            x.job++;
        } else if (strcmp(mode, "other-server") == 0) {
            x.server = "10.9.8.7:1";
        } else if (strcmp(mode, "garbage") == 0) {
            cred = strdup("MUNGE:not-a-credential:");
        } else if (strcmp(mode, "uid") == 0) { /* in a child: the command run next keeps this uid */
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) {
                if (setuid(65534) < 0) {
                    perror("boot_forge: setuid");
                    _exit(2);
                }
                am_join_payload(&x, st.info.rank, payload, sizeof(payload));
                if (!(cred = am_join_encode(payload, err, sizeof(err)))) {
                    fprintf(stderr, "boot_forge: %s\n", err);
                    _exit(2);
                }
                int r = try_join(&st, mode, cred);
                fflush(stdout);
                _exit(r);
            }
            int status = 1;
            bad |= pid < 0 || waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
            continue;
        } else if (strcmp(mode, "not-a-join") == 0) {
            bad |= not_a_join(&st);
            continue;
        } else if (strcmp(mode, "replay") != 0) {
            fprintf(stderr, "boot_forge: unknown mode %s\n", mode);
            return 2;
        }
        if (!cred) {
            am_join_payload(&x, st.info.rank, payload, sizeof(payload));
            if (!(cred = am_join_encode(payload, err, sizeof(err)))) {
                fprintf(stderr, "boot_forge: %s\n", err);
                return 2;
            }
        }
        if (strcmp(mode, "replay") == 0 && am_join_verify(&x, cred, err, sizeof(err)) < 0) {
            fprintf(stderr, "boot_forge: the credential to replay did not verify: %s\n", err);
            return 2;
        }
        bad |= try_join(&st, mode, cred);
        free(cred);
    }
    fflush(stdout);
    if (bad)
        return 1;
    if (i + 1 < argc) {
        execvp(argv[i + 1], &argv[i + 1]);
        perror(argv[i + 1]);
        return 127;
    }
    return 0;
}
