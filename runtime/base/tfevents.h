/* tfevents.h - TensorBoard event files, written in C: scalars as TensorBoard reads them.
 *
 * A file is a sequence of records (TFRecord framing), each
 *   uint64 length, uint32 masked_crc32c(length's 8 bytes), length bytes of data,
 *   uint32 masked_crc32c(data)
 * little-endian, where masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8 of c =
 * crc32c(x). Each record's data is a protobuf `Event` (tensorflow/core/util/event.proto):
 *   1: wall_time (double), 2: step (int64), 3: file_version (string, the first record's:
 *   "brain.Event:2"), 5: summary (Summary: 1: repeated Value {1: tag, 2: simple_value (float)}),
 * wall_time and step left out at zero, as proto3 encodes (simple_value, a oneof's member,
 * never is): the bytes are those of
 * TensorBoard's own writer (tests/base/scalars.tfevents, made by tests/base/make_fixture.py).
 * TensorBoard finds files named events.out.tfevents.* in a directory (one run per directory).
 *
 * A record is written with one write() and never rewritten: a rank killed mid-run leaves every
 * earlier record readable (TensorBoard stops at a truncated last one). No fsync: the curves
 * are a view of the run, the rank's log is its record. */
#ifndef AM_TFEVENTS_H
#define AM_TFEVENTS_H

#include <stddef.h>
#include <stdint.h>

struct am_tfscalar {
    const char *tag; /* e.g. "train/loss" */
    double value;    /* stored as a float (simple_value) */
};

struct am_tfevents {
    int fd;          /* -1: closed */
    char path[4096]; /* the file */
};

/* Creates dir (and its parents) and in it events.out.tfevents.<seconds>.<host>.<pid>, with
 * the file-version record stamped wall_time. Returns 0, or -1 with a message naming the path
 * and the reason (w->fd stays -1). */
int am_tfevents_open(struct am_tfevents *w, const char *dir, const char *host, double wall_time, char *err,
                     size_t err_len);

/* One Event of the n scalars at step. Returns 0, or -1 with a message. */
int am_tfevents_scalars(struct am_tfevents *w, int64_t step, double wall_time, const struct am_tfscalar *v, size_t n,
                        char *err, size_t err_len);

/* Closes the file (w->fd -1); nothing when closed. */
void am_tfevents_close(struct am_tfevents *w);

/* The bytes of one record (framing included) holding an Event with wall_time and step, and
 * either file_version (v == NULL) or a summary of the n scalars: returns the record's length,
 * written to out when it fits in cap (call with cap 0 for the length). Tags longer than 255
 * bytes are cut there. */
size_t am_tfevents_record(uint8_t *out, size_t cap, int64_t step, double wall_time, const char *file_version,
                          const struct am_tfscalar *v, size_t n);

#endif
