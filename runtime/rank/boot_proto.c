/* boot_proto.c - reading and writing the bootstrap's messages (boot_proto.h). */
#include "boot_proto.h"

#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

int am_io_read_full(int fd, void *buf, size_t len)
{
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int am_io_write_full(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

int am_boot_read_request(int fd, struct am_boot_req *req, char key[AM_BOOT_MAX_KEY + 1], void **value)
{
    *value = NULL;
    if (am_io_read_full(fd, req, sizeof(*req)) < 0)
        return -1;
    if (req->key_len > AM_BOOT_MAX_KEY || req->val_len > AM_BOOT_MAX_VALUE)
        return -2;
    char *v = malloc(req->val_len + 1);
    if (!v || am_io_read_full(fd, key, req->key_len) < 0 || am_io_read_full(fd, v, req->val_len) < 0) {
        free(v);
        return -1;
    }
    key[req->key_len] = '\0';
    v[req->val_len] = '\0';
    *value = v;
    return 0;
}

int am_boot_reply(int fd, int status, const void *payload, size_t len)
{
    struct am_boot_rep rep = {.status = status, .len = len};
    if (am_io_write_full(fd, &rep, sizeof(rep)) < 0)
        return -1;
    return am_io_write_full(fd, payload, len);
}
