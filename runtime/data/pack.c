/* pack.c - whole documents packed into sequences of a fixed size (pack.h). */
#include "pack.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dataset.h"

struct am_packs {
    struct am_indexed *data, *mask;
    int64_t size, count, dropped;
    int64_t *first; /* [count + 1]: pack i holds docs[first[i] .. first[i + 1]) */
    int64_t *docs;
};

/* A pack's rows for document d: its tokens but the last. */
static int64_t rows_of(const struct am_indexed *d, int64_t doc) { return (int64_t)am_indexed_length(d, doc) - 1; }

/* The min-heap of open packs of neat, by (fill, pack number) as Python's heapq orders tuples. */
struct heap {
    int64_t *fill, *pack, n;
};

static bool heap_less(const struct heap *h, int64_t a, int64_t b)
{
    return h->fill[a] < h->fill[b] || (h->fill[a] == h->fill[b] && h->pack[a] < h->pack[b]);
}

static void heap_swap(struct heap *h, int64_t a, int64_t b)
{
    int64_t f = h->fill[a], p = h->pack[a];
    h->fill[a] = h->fill[b];
    h->pack[a] = h->pack[b];
    h->fill[b] = f;
    h->pack[b] = p;
}

static void heap_down(struct heap *h, int64_t i)
{
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < h->n && heap_less(h, l, m))
            m = l;
        if (r < h->n && heap_less(h, r, m))
            m = r;
        if (m == i)
            return;
        heap_swap(h, i, m);
        i = m;
    }
}

static void heap_push(struct heap *h, int64_t fill, int64_t pack)
{
    int64_t i = h->n++;
    h->fill[i] = fill;
    h->pack[i] = pack;
    while (i > 0 && heap_less(h, i, (i - 1) / 2)) {
        heap_swap(h, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
}

/* neat's order: longer first, then the earlier document (Python's stable sort by -length). */
struct by_len {
    int64_t len, k;
};
static int by_length(const void *a, const void *b)
{
    const struct by_len *x = a, *y = b;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->k < y->k ? -1 : x->k > y->k;
}

/* The packs of n documents with rows len[] (all fitting): into pack_of[k] the pack of
 * document k, into order[] the documents in the order they went into their packs; returns the
 * number of packs, or -1 when out of memory. */
static int64_t pack_thd(const int64_t *len, int64_t n, int64_t size, int64_t *pack_of, int64_t *order)
{
    int64_t packs = 0, fill = 0;
    for (int64_t k = 0; k < n; k++) {
        order[k] = k;
        if (packs == 0 || fill + len[k] > size) {
            packs++;
            fill = 0;
        }
        fill += len[k];
        pack_of[k] = packs - 1;
    }
    return packs;
}

static int64_t pack_neat(const int64_t *len, int64_t n, int64_t size, int64_t *pack_of, int64_t *order)
{
    struct heap h = {malloc((size_t)(n ? n : 1) * sizeof(int64_t)), malloc((size_t)(n ? n : 1) * sizeof(int64_t)), 0};
    struct by_len *a = malloc((size_t)(n ? n : 1) * sizeof(*a));
    if (!h.fill || !h.pack || !a) {
        free(h.fill);
        free(h.pack);
        free(a);
        return -1;
    }
    for (int64_t k = 0; k < n; k++)
        a[k] = (struct by_len){len[k], k};
    qsort(a, (size_t)n, sizeof(*a), by_length);
    for (int64_t k = 0; k < n; k++)
        order[k] = a[k].k;
    free(a);
    int64_t packs = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = order[i];
        if (h.n > 0 && h.fill[0] + len[k] <= size) { /* the least filled pack: heappop, heappush */
            pack_of[k] = h.pack[0];
            h.fill[0] += len[k];
            heap_down(&h, 0);
        } else {
            pack_of[k] = packs;
            heap_push(&h, len[k], packs++);
        }
    }
    free(h.fill);
    free(h.pack);
    return packs;
}

int am_packs_open(const struct am_pack_config *cfg, struct am_packs **out, struct am_errors *err)
{
    *out = NULL;
    struct am_packs *p = calloc(1, sizeof(*p));
    if (!p)
        return am_errors_fail(err, "out of memory for the packs");
    p->size = cfg->size;
    if (am_indexed_open(cfg->path, &p->data, err) < 0) {
        am_packs_close(p);
        return -1;
    }
    char mpath[4200];
    snprintf(mpath, sizeof(mpath), "%s.mask.idx", cfg->path);
    if (access(mpath, F_OK) == 0) {
        snprintf(mpath, sizeof(mpath), "%s.mask", cfg->path);
        if (am_indexed_open(mpath, &p->mask, err) < 0) {
            am_packs_close(p);
            return -1;
        }
        int64_t S = am_indexed_sequences(p->data);
        bool same = am_indexed_sequences(p->mask) == S;
        for (int64_t s = 0; same && s < S; s++)
            same = am_indexed_length(p->mask, s) == am_indexed_length(p->data, s);
        if (!same) {
            am_errors_fail(err, "%s: its documents do not have the lengths of %s's (was it built with them?)", mpath,
                           cfg->path);
            am_packs_close(p);
            return -1;
        }
    }
    /* the documents that have rows, in order (or shuffled), with their rows */
    int64_t S = am_indexed_sequences(p->data), n = 0;
    int64_t *ids = malloc((size_t)(S ? S : 1) * sizeof(int64_t)), *len = malloc((size_t)(S ? S : 1) * sizeof(int64_t));
    int64_t *pack_of = malloc((size_t)(S ? S : 1) * sizeof(int64_t));
    int64_t *order = malloc((size_t)(S ? S : 1) * sizeof(int64_t));
    if (!ids || !len || !pack_of || !order)
        goto oom;
    for (int64_t s = 0; s < S; s++)
        ids[s] = s;
    if (cfg->shuffle && am_np_shuffle_i64(cfg->seed, ids, S) < 0)
        goto oom;
    for (int64_t i = 0; i < S; i++) {
        int64_t r = rows_of(p->data, ids[i]);
        if (r < 1)
            continue;
        if (r > cfg->size) {
            if (!cfg->drop_long) {
                am_errors_fail(err, "%s: document %" PRId64 " has %" PRId64 " tokens, %" PRId64 " rows, longer than a "
                               "pack of packed_sequence_size %" PRId64 " (raise it, or drop such documents with "
                               "packed_sequence.drop_long_samples: true)", cfg->path, ids[i], r + 1, r, cfg->size);
                goto fail;
            }
            p->dropped++;
            continue;
        }
        ids[n] = ids[i];
        len[n++] = r;
    }
    int64_t packs = cfg->neat ? pack_neat(len, n, cfg->size, pack_of, order)
                              : pack_thd(len, n, cfg->size, pack_of, order);
    if (packs < 0)
        goto oom;
    if (cfg->max_packs > 0 && packs > cfg->max_packs)
        packs = cfg->max_packs;
    if (packs == 0) {
        am_errors_fail(err, "%s: no pack: none of its %" PRId64 " documents has 2 tokens or more and fits a pack of "
                       "%" PRId64 " rows (%" PRId64 " longer ones dropped)", cfg->path, S, cfg->size, p->dropped);
        goto fail;
    }
    /* the documents of each pack, in the order they went in */
    p->count = packs;
    p->first = calloc((size_t)packs + 1, sizeof(int64_t));
    p->docs = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!p->first || !p->docs)
        goto oom;
    for (int64_t k = 0; k < n; k++)
        if (pack_of[k] < packs)
            p->first[pack_of[k] + 1]++;
    for (int64_t i = 0; i < packs; i++)
        p->first[i + 1] += p->first[i];
    memcpy(len, p->first, (size_t)packs * sizeof(int64_t)); /* each pack's next place */
    for (int64_t i = 0; i < n; i++) {
        int64_t k = order[i];
        if (pack_of[k] < packs)
            p->docs[len[pack_of[k]]++] = ids[k];
    }
    free(ids);
    free(len);
    free(pack_of);
    free(order);
    *out = p;
    return 0;
oom:
    am_errors_fail(err, "out of memory packing %s", cfg->path);
fail:
    free(ids);
    free(len);
    free(pack_of);
    free(order);
    am_packs_close(p);
    return -1;
}

void am_packs_close(struct am_packs *p)
{
    if (!p)
        return;
    am_indexed_close(p->data);
    am_indexed_close(p->mask);
    free(p->first);
    free(p->docs);
    free(p);
}

int64_t am_packs_count(const struct am_packs *p) { return p->count; }
int64_t am_packs_dropped(const struct am_packs *p) { return p->dropped; }
bool am_packs_masked(const struct am_packs *p) { return p->mask != NULL; }

int64_t am_packs_docs(const struct am_packs *p, int64_t i, const int64_t **docs)
{
    i %= p->count;
    *docs = p->docs + p->first[i];
    return p->first[i + 1] - p->first[i];
}

int64_t am_packs_rows(const struct am_packs *p, int64_t i)
{
    const int64_t *docs;
    int64_t nd = am_packs_docs(p, i, &docs), rows = 0;
    for (int64_t k = 0; k < nd; k++) /* a packed document has 2 tokens or more */
        rows += rows_of(p->data, docs[k]);
    return rows;
}

int am_packs_read(const struct am_packs *p, int64_t i, int32_t *tokens, int32_t *targets, int32_t *starts,
                  struct am_errors *err)
{
    const int64_t *docs;
    int64_t nd = am_packs_docs(p, i, &docs), row = 0, S = p->size;
    int32_t *buf = malloc((size_t)(2 * (S + 1)) * sizeof(int32_t)), *mbuf = buf + S + 1;
    if (!buf)
        return am_errors_fail(err, "out of memory reading a pack");
    for (int64_t k = 0; k < nd; k++) {
        int64_t n = am_indexed_length(p->data, docs[k]);
        if (am_indexed_read(p->data, docs[k], 0, n, buf, err) < 0 ||
            (p->mask && am_indexed_read(p->mask, docs[k], 0, n, mbuf, err) < 0)) {
            free(buf);
            return -1;
        }
        for (int64_t j = 0; j + 1 < n; j++) {
            tokens[row + j] = buf[j];
            targets[row + j] = p->mask && !mbuf[j + 1] ? -1 : buf[j + 1];
            starts[row + j] = (int32_t)row;
        }
        row += n - 1;
    }
    for (int64_t j = row; j < S; j++) { /* the pads: a document of their own that predicts nothing */
        tokens[j] = 0;
        targets[j] = -1;
        starts[j] = (int32_t)row;
    }
    free(buf);
    return 0;
}
