/* boot_proto.h - the bootstrap's wire format between a rank and its launcher.
 *
 * A stream socket carries requests from the rank and one reply to each; integers in host
 * order (both ends run on one machine, or, over TCP without PMIx, on nodes of one cluster). A request is struct am_boot_req followed by
 * key_len bytes of key and val_len bytes of value; a reply is struct am_boot_rep followed
 * by len bytes: the info (HELLO), the value (GET), every rank's value of the key in rank order
 * (ALLGATHER: a put and a fence in one request, answered when the last rank sends its
 * own; one request per rank instead of a put, a fence and N gets), or an error message
 * (status != 0).
 */
#ifndef AM_BOOT_PROTO_H
#define AM_BOOT_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "bootstrap.h"

enum am_boot_op { AM_BOOT_HELLO = 1, AM_BOOT_PUT, AM_BOOT_FENCE, AM_BOOT_GET, AM_BOOT_ABORT, AM_BOOT_ALLGATHER,
                  AM_BOOT_JOIN /* TCP only: a rank's credential (launcher/boot_join.h) */ };

struct am_boot_req {
    uint32_t op;
    uint32_t key_len;
    uint64_t val_len;
    int32_t rank;    /* GET: whose value; ABORT: the exit status */
    uint32_t pad;
    double timeout_s;
};

struct am_boot_rep {
    int32_t status; /* 0 ok */
    uint32_t pad;
    uint64_t len;
};

/* Reads or writes exactly len bytes, retrying on EINTR; -1 on error or end of stream. */
int am_io_read_full(int fd, void *buf, size_t len);
int am_io_write_full(int fd, const void *buf, size_t len);

/* The launcher side (boot_server.c, pmix_task.c). Reads one request: its header, its key
 * (NUL-terminated into key) and its value (malloc'd into *value, NUL-terminated, the
 * caller frees). Returns 0; -1 when the stream ended or broke; -2 when the header asks
 * for a key or value over the limits (nothing more is read: drop the connection). */
int am_boot_read_request(int fd, struct am_boot_req *req, char key[AM_BOOT_MAX_KEY + 1], void **value);
/* Sends one reply: status 0 and the payload, or status != 0 and an error message. */
int am_boot_reply(int fd, int status, const void *payload, size_t len);

#endif
