/* flight.c - the flight recorder (flight.h). */
#include "flight.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sigfmt.h"

int am_flight_size_from_env(size_t *size, char *err, size_t err_len)
{
    const char *s = getenv("AM_FLIGHT_RECORDER_SIZE");
    *size = AM_FLIGHT_DEFAULT_SIZE;
    if (!s || !*s)
        return 0;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s || v < 1 || v > AM_FLIGHT_MAX_SIZE) {
        snprintf(err, err_len, "AM_FLIGHT_RECORDER_SIZE=%.40s: the flight recorder's size must be a whole number of "
                 "entries from 1 to %d (for example AM_FLIGHT_RECORDER_SIZE=%d; unset for the default)", s,
                 AM_FLIGHT_MAX_SIZE, AM_FLIGHT_DEFAULT_SIZE);
        return -1;
    }
    *size = (size_t)v;
    return 0;
}

double am_flight_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double am_flight_wall(const struct am_flight *f, double mono)
{
    return f->anchor_wall + (mono - f->anchor_mono);
}

int am_flight_init(struct am_flight *f, size_t cap, char *err, size_t err_len)
{
    memset(f, 0, sizeof(*f));
    if (cap < 1 || cap > AM_FLIGHT_MAX_SIZE) {
        snprintf(err, err_len, "flight recorder: %zu entries is not from 1 to %d", cap, AM_FLIGHT_MAX_SIZE);
        return -1;
    }
    f->ring = calloc(cap, sizeof(*f->ring));
    if (!f->ring) {
        snprintf(err, err_len, "flight recorder: out of memory for %zu entries (set AM_FLIGHT_RECORDER_SIZE lower)",
                 cap);
        return -1;
    }
    f->cap = cap;
    f->next_id = 1;
    struct timespec w, m;
    clock_gettime(CLOCK_REALTIME, &w);
    clock_gettime(CLOCK_MONOTONIC, &m);
    f->anchor_wall = (double)w.tv_sec + 1e-9 * (double)w.tv_nsec;
    f->anchor_mono = (double)m.tv_sec + 1e-9 * (double)m.tv_nsec;
    return 0;
}

void am_flight_free(struct am_flight *f)
{
    free(f->ring);
    f->ring = NULL;
    f->cap = 0;
}

/* ---- recording: a version counter around every change (odd while writing) -------------- */

static struct am_flight_entry *slot(const struct am_flight *f, uint64_t id)
{
    return &f->ring[(id - 1) % f->cap];
}

static void write_begin(struct am_flight_entry *e)
{
    atomic_fetch_add_explicit(&e->version, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
}

static void write_end(struct am_flight_entry *e)
{
    atomic_fetch_add_explicit(&e->version, 1, memory_order_release);
}

uint64_t am_flight_begin(struct am_flight *f, const struct am_flight_op *op)
{
    uint64_t id = f->next_id++;
    struct am_flight_entry *e = slot(f, id);
    write_begin(e);
    e->id = id;
    e->op = op->op;
    e->dtype = op->dtype;
    e->redop = op->redop;
    size_t i = 0;
    for (; op->group && op->group[i] && i + 1 < sizeof(e->group); i++)
        e->group[i] = op->group[i];
    e->group[i] = '\0';
    e->gid = op->gid;
    e->seq = op->seq;
    e->count = op->count;
    e->bytes = op->bytes;
    e->peer = op->peer;
    e->waiting_for = -1;
    e->enqueued = am_flight_now();
    e->started = e->ended = 0;
    e->state = AM_FLIGHT_ISSUED;
    write_end(e);
    atomic_store_explicit(&f->newest, id, memory_order_release);
    return id;
}

void am_flight_start(struct am_flight *f, uint64_t id)
{
    struct am_flight_entry *e = slot(f, id);
    if (e->id != id)
        return;
    write_begin(e);
    e->started = am_flight_now();
    e->state = AM_FLIGHT_STARTED;
    write_end(e);
}

void am_flight_post(struct am_flight *f, uint64_t id)
{
    struct am_flight_entry *e = slot(f, id);
    if (e->id != id)
        return;
    write_begin(e);
    e->state = AM_FLIGHT_POSTED;
    write_end(e);
}

void am_flight_waiting(struct am_flight *f, uint64_t id, int global_rank)
{
    struct am_flight_entry *e = slot(f, id);
    if (e->id != id || e->waiting_for == global_rank)
        return;
    write_begin(e);
    e->waiting_for = global_rank;
    write_end(e);
}

void am_flight_end(struct am_flight *f, uint64_t id, enum am_flight_state state)
{
    struct am_flight_entry *e = slot(f, id);
    if (e->id != id)
        return;
    write_begin(e);
    e->ended = am_flight_now();
    e->state = (int)state;
    if (state == AM_FLIGHT_COMPLETED)
        e->waiting_for = -1;
    write_end(e);
}

void am_flight_mark_timed_out(struct am_flight *f, uint64_t id)
{
    atomic_store_explicit(&f->timed_out_id, id, memory_order_release);
}

/* ---- reading ------------------------------------------------------------------------------- */

/* Copies the slot; 1 when the copy is whole (the version did not change and was even). A
 * signal handler that interrupted the writer would retry forever: after a few tries the
 * copy is taken as it is. */
static int copy_slot(const struct am_flight_entry *e, struct am_flight_view *out)
{
    for (int tries = 0;; tries++) {
        unsigned v1 = atomic_load_explicit(&e->version, memory_order_acquire);
        out->id = e->id;
        out->op = e->op;
        out->dtype = e->dtype;
        out->redop = e->redop;
        memcpy(out->group, e->group, sizeof(out->group));
        out->group[sizeof(out->group) - 1] = '\0';
        out->gid = e->gid;
        out->seq = e->seq;
        out->count = e->count;
        out->bytes = e->bytes;
        out->peer = e->peer;
        out->waiting_for = e->waiting_for;
        out->enqueued = e->enqueued;
        out->started = e->started;
        out->ended = e->ended;
        out->state = e->state;
        atomic_thread_fence(memory_order_acquire);
        unsigned v2 = atomic_load_explicit(&e->version, memory_order_relaxed);
        if ((v1 == v2 && !(v1 & 1)) || tries >= 3)
            return 1;
    }
}

int am_flight_get(const struct am_flight *f, uint64_t id, struct am_flight_view *out)
{
    if (!f || !f->ring || id == 0)
        return 0;
    uint64_t newest = atomic_load_explicit(&f->newest, memory_order_acquire);
    if (id > newest || newest - id >= f->cap)
        return 0;
    copy_slot(slot(f, id), out);
    return out->id == id;
}

int am_flight_oldest_inflight(const struct am_flight *f, struct am_flight_view *out)
{
    if (!f || !f->ring)
        return 0;
    uint64_t newest = atomic_load_explicit(&f->newest, memory_order_acquire);
    uint64_t first = newest > f->cap ? newest - f->cap + 1 : 1;
    int found = 0;
    struct am_flight_view v;
    for (uint64_t id = newest; id >= first && id > 0; id--) {
        if (!am_flight_get(f, id, &v))
            continue;
        if (v.state == AM_FLIGHT_POSTED)
            continue;
        if (v.state == AM_FLIGHT_ISSUED || v.state == AM_FLIGHT_STARTED) {
            *out = v;
            found = 1;
        } else if (found) {
            break; /* calls end in order: nothing older is still running */
        }
    }
    return found;
}

const char *am_flight_state_name(int state)
{
    switch (state) {
    case AM_FLIGHT_ISSUED: return "issued";
    case AM_FLIGHT_STARTED: return "started";
    case AM_FLIGHT_COMPLETED: return "completed";
    case AM_FLIGHT_FAILED: return "failed";
    case AM_FLIGHT_TIMED_OUT: return "timed_out";
    case AM_FLIGHT_ABORTED: return "aborted";
    case AM_FLIGHT_POSTED: return "posted";
    }
    return "free";
}

static void put_rank(struct am_sbuf *b, int r)
{
    if (r < 0)
        am_sbuf_str(b, "null");
    else
        am_sbuf_i64(b, r);
}

static void put_time(struct am_sbuf *b, const struct am_flight *f, double mono)
{
    if (mono <= 0)
        am_sbuf_str(b, "null");
    else
        am_sbuf_fixed(b, am_flight_wall(f, mono), 6);
}

size_t am_flight_format(const struct am_flight *f, const struct am_flight_view *e, char *buf, size_t cap)
{
    struct am_sbuf b;
    if (cap < 2)
        return 0;
    am_sbuf_init(&b, buf, cap - 1); /* room for the newline */
    int state = e->state;
    uint64_t timed_out = atomic_load_explicit(&f->timed_out_id, memory_order_acquire);
    if (timed_out == e->id && (state == AM_FLIGHT_ISSUED || state == AM_FLIGHT_STARTED))
        state = AM_FLIGHT_TIMED_OUT;
    am_sbuf_str(&b, "{\"type\":\"flight\",\"id\":");
    am_sbuf_u64(&b, e->id);
    am_sbuf_str(&b, ",\"group\":");
    am_sbuf_json_str(&b, e->group);
    am_sbuf_str(&b, ",\"gid\":");
    am_sbuf_i64(&b, e->gid);
    am_sbuf_str(&b, ",\"seq\":");
    am_sbuf_u64(&b, e->seq);
    am_sbuf_str(&b, ",\"op\":");
    am_sbuf_json_str(&b, e->op);
    am_sbuf_str(&b, ",\"dtype\":");
    am_sbuf_json_str(&b, e->dtype);
    am_sbuf_str(&b, ",\"count\":");
    am_sbuf_u64(&b, e->count);
    am_sbuf_str(&b, ",\"bytes\":");
    am_sbuf_u64(&b, e->bytes);
    am_sbuf_str(&b, ",\"redop\":");
    am_sbuf_json_str(&b, e->redop);
    am_sbuf_str(&b, ",\"peer\":");
    put_rank(&b, e->peer);
    am_sbuf_str(&b, ",\"state\":");
    am_sbuf_json_str(&b, am_flight_state_name(state));
    am_sbuf_str(&b, ",\"enqueued\":");
    put_time(&b, f, e->enqueued);
    am_sbuf_str(&b, ",\"started\":");
    put_time(&b, f, e->started);
    am_sbuf_str(&b, ",\"ended\":");
    put_time(&b, f, e->ended);
    am_sbuf_str(&b, ",\"waiting_for\":");
    put_rank(&b, e->waiting_for);
    am_sbuf_char(&b, '}');
    buf[b.len] = '\n';
    buf[b.len + 1] = '\0';
    return b.len + 1;
}

long am_flight_dump(const struct am_flight *f, int fd)
{
    if (!f || !f->ring)
        return 0;
    char out[8192], line[768];
    size_t used = 0;
    long n = 0;
    uint64_t newest = atomic_load_explicit(&f->newest, memory_order_acquire);
    uint64_t first = newest > f->cap ? newest - f->cap + 1 : 1;
    for (uint64_t id = first; id <= newest && id > 0; id++) {
        struct am_flight_view v;
        if (!am_flight_get(f, id, &v))
            continue;
        size_t len = am_flight_format(f, &v, line, sizeof(line));
        if (used + len > sizeof(out)) {
            if (am_write_all(fd, out, used) < 0)
                return -1;
            used = 0;
        }
        memcpy(out + used, line, len);
        used += len;
        n++;
    }
    if (used && am_write_all(fd, out, used) < 0)
        return -1;
    return n;
}
