/* boot_tcp.h - the bootstrap of a Slurm step without PMIx, over TCP (launch.h).
 *
 * The task on the step's first node with local rank 0 serves the step's bootstrap (the
 * standalone store, boot_server.h) on a TCP port (slurm_env.h) from a thread of its
 * am-launch; every task's am-launch, that one included, connects to it, joins with its munge
 * credential (boot_join.h) and relays its rank's put, fence, get and allgather there. The
 * server admits each rank of the step once; whatever else connects is refused with a
 * message, on its stderr and on the other end's.
 */
#ifndef AM_BOOT_TCP_H
#define AM_BOOT_TCP_H

#include <stddef.h>

#include "slurm_env.h"

struct am_boot_tcp_server;

/* Listens on st's port (every address) and serves from a thread; NULL with a message. */
struct am_boot_tcp_server *am_boot_tcp_serve(const struct am_slurm_step *st, char *err, size_t err_len);
/* Waits up to wait_s for every rank that joined to leave (their tasks ended), then stops. */
void am_boot_tcp_stop(struct am_boot_tcp_server *s, double wait_s);

/* Connects to the step's server (retrying while it is not up yet, up to timeout_s) and joins
 * as st's rank: the connected socket, or -1 with a message naming the server. */
int am_boot_tcp_join(const struct am_slurm_step *st, double timeout_s, char *err, size_t err_len);

/* The lower layers, for tests (a forged join): connects once (-1 with a message), sends a
 * join with cred for rank and reads the answer: 0, or -1 with the server's reason. */
int am_boot_tcp_connect(const char *host, int port, double timeout_s, char *err, size_t err_len);
int am_boot_tcp_send_join(int fd, int rank, const char *cred, char *err, size_t err_len);

#endif
