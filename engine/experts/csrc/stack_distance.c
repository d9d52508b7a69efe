/* LRU stack distances (Mattson) of an access stream, with a Fenwick tree over access times.
 *
 * Only the latest access of each key is marked in the tree, so the distance of an access is the
 * number of marks between the key's previous access and now. Times live in a ring of `cap` slots;
 * when it is full, the marked times are renumbered 1..K in order (compaction).
 * The Python fallback in engine/experts/whatif.py is the reference for this file.
 */
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t cap;        /* Fenwick positions 1..cap */
    int64_t now;        /* last position used */
    int64_t num_keys;
    int64_t window;     /* distances remembered for the recent-window histogram */
    int64_t seen;       /* accesses ever added */
    int32_t *tree;      /* [cap + 1] */
    int64_t *last;      /* [num_keys] position of each key's latest access, 0 = never */
    int32_t *ring;      /* [window] distance of each recent access (num_keys = cold) */
    int64_t *hist;      /* [num_keys + 1] recent-window histogram of distances */
    int64_t *order;     /* [cap + 1] scratch: key at each position, -1 if unmarked */
} sd_state;

static void tree_add(int32_t *tree, int64_t cap, int64_t i, int32_t v) {
    for (; i <= cap; i += i & -i) tree[i] += v;
}

static int64_t tree_sum(const int32_t *tree, int64_t i) {
    int64_t s = 0;
    for (; i > 0; i -= i & -i) s += tree[i];
    return s;
}

static void compact(sd_state *st) {
    int64_t n = 0;
    for (int64_t i = 0; i <= st->cap; i++) st->order[i] = -1;
    for (int64_t k = 0; k < st->num_keys; k++)
        if (st->last[k] > 0) st->order[st->last[k]] = k;
    memset(st->tree, 0, sizeof(int32_t) * (st->cap + 1));
    for (int64_t i = 1; i <= st->cap; i++) {
        if (st->order[i] >= 0) {
            n++;
            st->last[st->order[i]] = n;
            tree_add(st->tree, st->cap, n, 1);
        }
    }
    st->now = n;
}

void sd_add(sd_state *st, const int64_t *keys, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        int64_t key = keys[j];
        if (st->now == st->cap) compact(st);
        int64_t t = ++st->now;
        int64_t prev = st->last[key];
        int32_t dist;
        if (prev == 0) {
            dist = (int32_t)st->num_keys;
        } else {
            dist = (int32_t)(tree_sum(st->tree, t - 1) - tree_sum(st->tree, prev));
            tree_add(st->tree, st->cap, prev, -1);
        }
        tree_add(st->tree, st->cap, t, 1);
        st->last[key] = t;
        int64_t slot = st->seen % st->window;
        if (st->seen >= st->window) st->hist[st->ring[slot]]--;
        st->ring[slot] = dist;
        st->hist[dist]++;
        st->seen++;
    }
}
