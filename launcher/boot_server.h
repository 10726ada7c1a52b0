/* boot_server.h - the launcher side of the bootstrap for a standalone job: one store for
 * all ranks of this machine, served over each rank's socket (boot_proto.h). */
#ifndef AM_BOOT_SERVER_H
#define AM_BOOT_SERVER_H

#include "bootstrap.h"

struct am_boot_server;

/* size ranks; info[r] is what rank r learns at HELLO (copied). */
struct am_boot_server *am_boot_server_new(int size, const struct am_boot_info *info);
void am_boot_server_free(struct am_boot_server *s);

enum am_boot_event { AM_BOOT_OK, AM_BOOT_CLOSED, AM_BOOT_ABORTED, AM_BOOT_BAD };

/* Serves one request that is ready on fd, from rank. AM_BOOT_CLOSED: the rank closed its
 * end; AM_BOOT_ABORTED: it asked to end the job (*status and the message are set; the
 * rank got its reply and exits by itself); AM_BOOT_BAD: a malformed request (the message
 * says what). A fence is answered when the last rank reaches it, or with an error when a
 * rank's timeout passes first (am_boot_server_expire). */
enum am_boot_event am_boot_server_serve(struct am_boot_server *s, int rank, int fd, int *status, char *msg,
                                        size_t msg_len);

/* Seconds (CLOCK_MONOTONIC) at which the earliest waiting fence times out; 0: none waits. */
double am_boot_server_deadline(const struct am_boot_server *s);
/* Fails the current fence, naming the ranks that did not reach it, when a waiting rank's
 * timeout has passed. */
void am_boot_server_expire(struct am_boot_server *s);

/* Forgets rank's connection (it exited): a fence it was part of can never complete, so
 * the ranks waiting in it are told so. */
void am_boot_server_drop(struct am_boot_server *s, int rank);

#endif
