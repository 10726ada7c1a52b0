/* boot_join.h - how a Slurm task without PMIx proves to the step's boot server that it is one
 * of the step's own ranks: a munge credential (every Slurm cluster runs munged) whose payload
 * binds the job, the step, the rank and the server's address:
 *     "am-join job=JOB step=STEP rank=RANK server=HOST:PORT"
 * The server decodes it with munged, which vouches for the uid that made it and refuses a
 * credential decoded before (a replay), and checks the uid is the job's (its own: the server
 * runs as the job's user) and the payload names its job, step and address and a rank of the
 * step. The credential travels as the value of an AM_BOOT_JOIN request (boot_proto.h) whose
 * rank field is the rank; the reply is status 0, or an error message saying why.
 * The munged socket: AM_MUNGE_SOCKET when set, else the socket= of Slurm's AuthInfo in
 * slurm.conf (slurm_env.h: a munged that listens elsewhere than libmunge's default, like the
 * local test cluster's), else libmunge's default.
 */
#ifndef AM_BOOT_JOIN_H
#define AM_BOOT_JOIN_H

#include <stddef.h>
#include <sys/types.h>

struct am_join_expect {
    unsigned long long job, step;
    int size;           /* ranks of the step */
    const char *server; /* "HOST:PORT" as the ranks were told it */
    uid_t uid;          /* the job's user */
};

/* The payload for rank, into out. */
void am_join_payload(const struct am_join_expect *x, int rank, char *out, size_t len);

/* Checks a decoded payload and the uid munged vouched for against x: returns the rank it
 * names, or -1 with the reason in why (it names what differs). */
int am_join_check(const struct am_join_expect *x, const char *payload, size_t len, uid_t uid, char *why,
                  size_t why_len);

/* A credential for the payload (malloc'd, NUL-terminated; the caller frees), or NULL with the
 * reason in err. Built without libmunge: always NULL, saying so. */
char *am_join_encode(const char *payload, char *err, size_t err_len);

/* Decodes cred with munged and checks it (am_join_check): the rank, or -1 with the reason. */
int am_join_verify(const struct am_join_expect *x, const char *cred, char *why, size_t why_len);

#endif
