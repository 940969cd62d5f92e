/* kvroute.prefix_index._native: the prefix index's data structure in C (the Python face is native.py).
 *
 *     from kvroute.prefix_index.native import NativePrefixIndex
 *     index = NativePrefixIndex()          # or NativeBoundedPrefixIndex(max_entries)
 *     index.store(slot, packed_keys, tier) # bytes of little-endian u64, array('Q'), list, any iterable of ints
 *
 * Contract: the PrefixIndex protocol of base.py, checked against SetPrefixIndex by the conformance
 * suite. Keys are unsigned 64-bit ints; worker slots are ints in [0, 2^27).
 *
 * Representation (docs/benchmarks/2026-12-04-native-index.md measures it):
 * - records: one 16-byte Rec per key (the key and up to two holders inline), in chunks of 4096 so
 *   a record never moves; a key with three or more holders keeps them in a sorted HVec. A holder
 *   is one u32: slot << 5 | SPEC | DISK | CPU | GPU | VALID, so a key's holders cost 4 bytes each
 *   whatever the number of slots.
 * - key -> record: open addressing (linear probing, backward-shift deletion), 8-byte slots holding
 *   the record id and the top 32 bits of the key's hash; the hash's top bits are the home slot, so
 *   resizing never reads a record.
 * - per worker: an open-addressing set of the record ids it holds on any tier (4-byte slots), and
 *   its entry count per tier; clear and worker_keys walk only that set.
 * - a walk keeps per-slot scratch (depth, cpu/disk/speculative counts) and the list of slots it
 *   touched: per prompt block one lookup and one pass over that key's holders, a worker advancing
 *   when its depth equals the position. Nothing is allocated during a walk.
 * - bounded: a ring of record ids (the CLOCK), a stamp per record (in-ring bit, the lap it was last
 *   matched in); the policy is BoundedPrefixIndex's, see bounded.py.
 * Every allocation goes through PyMem_* (tracemalloc sees it) and is counted in `bytes`.
 * Python code runs only while inputs are read (before any change) and while results are built
 * (from copies), so a finalizer that re-enters the index never sees it half-changed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define F_VALID 1u
#define F_GPU 2u
#define F_CPU 4u
#define F_DISK 8u
#define F_SPEC 16u
#define F_TIERS (F_GPU | F_CPU | F_DISK)
#define SLOT_SHIFT 5
#define MAX_SLOT ((1u << 27) - 1)
#define VEC_MARK 2u /* h[0] of a record whose holders live in an HVec (h[1] is its id) */
#define HSLOT(h) ((h) >> SLOT_SHIFT)
#define TIER_FLAG(t) (F_GPU << (t))
#define NTIERS 3

#define CHUNK_BITS 12
#define CHUNK (1u << CHUNK_BITS)
#define MIN_BITS 3
#define IN_RING 0x80000000u
#define LAP_MASK 0x7fffffffu

typedef struct {
    uint64_t key; /* the free list's next id while free */
    uint32_t h[2];
} Rec;

typedef struct {
    uint32_t len, cap;
    uint32_t h[];
} HVec;

typedef struct {
    uint32_t tag, rec; /* rec 0: empty */
} KSlot;

typedef struct {
    uint32_t *set; /* record ids, 0 = empty; NULL when bits == 0 */
    uint32_t bits;
    uint32_t used;
    uint64_t count[NTIERS];
    uint64_t evicted[NTIERS];
    int has_evicted;
} Worker;

typedef struct {
    PyObject_HEAD
    size_t bytes;
    KSlot *kslots;
    uint32_t kbits;
    uint64_t kused;
    Rec **chunks;
    uint32_t nchunks, chunks_cap;
    uint32_t chunk0_cap; /* records chunk 0 holds: it grows from 16 to CHUNK, so a small index stays small */
    uint32_t rec_top, free_head;
    HVec **vecs;
    uint32_t nvecs, vecs_cap;
    uint32_t *vec_free;
    uint32_t vec_free_len, vec_free_cap;
    Worker *workers;
    uint32_t nworkers;
    uint32_t *scratch; /* 5 * nworkers: depth, cpu, disk, spec (zero between walks), touched */
    uint64_t entries;
    /* the bound */
    uint64_t max_entries;
    uint32_t **marks; /* parallel to chunks when bounded */
    uint32_t *ring;
    uint64_t ring_cap, ring_head, ring_len;
    uint32_t lap;
    int64_t lap_left;
    uint64_t marked_now, departed;
    uint64_t ev_keys, ev_entries, ev_recent, workers_with_evictions;
} Index;

/* ------------------------------------------------------------------ memory, counted */

static void *ix_malloc(Index *ix, size_t n) {
    void *p = PyMem_Malloc(n);
    if (p) ix->bytes += n;
    else PyErr_NoMemory();
    return p;
}

static void *ix_calloc(Index *ix, size_t count, size_t size) {
    void *p = PyMem_Calloc(count, size);
    if (p) ix->bytes += count * size;
    else PyErr_NoMemory();
    return p;
}

static void *ix_realloc(Index *ix, void *p, size_t old, size_t n) {
    void *q = PyMem_Realloc(p, n);
    if (q) ix->bytes = ix->bytes - old + n;
    else PyErr_NoMemory();
    return q;
}

static void ix_free(Index *ix, void *p, size_t n) {
    if (p) {
        PyMem_Free(p);
        ix->bytes -= n;
    }
}

/* ------------------------------------------------------------------ records */

static inline Rec *REC(Index *ix, uint32_t id) { return &ix->chunks[id >> CHUNK_BITS][id & (CHUNK - 1)]; }
static inline uint32_t *MARK(Index *ix, uint32_t id) { return &ix->marks[id >> CHUNK_BITS][id & (CHUNK - 1)]; }
static inline int in_ring(Index *ix, uint32_t id) { return ix->marks && (*MARK(ix, id) & IN_RING); }
static inline size_t chunk_recs(Index *ix, uint32_t c) { return c ? CHUNK : ix->chunk0_cap; }

static inline uint64_t mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ULL;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return z;
}

static inline uint32_t key_tag(uint64_t key) { return (uint32_t)(mix64(key) >> 32); }

static inline HVec *VEC(Index *ix, Rec *r) { return ix->vecs[r->h[1]]; }

/* The holders of a record, sorted by slot (a holder's top bits are its slot). */
static inline uint32_t *holders(Index *ix, Rec *r, uint32_t *n) {
    uint32_t a = r->h[0];
    if (!a) {
        *n = 0;
        return r->h;
    }
    if (a & F_VALID) {
        *n = r->h[1] ? 2 : 1;
        return r->h;
    }
    HVec *v = VEC(ix, r);
    *n = v->len;
    return v->h;
}

static inline int rec_has_entries(Index *ix, Rec *r) {
    uint32_t n, *p = holders(ix, r, &n);
    for (uint32_t i = 0; i < n; i++)
        if (p[i] & F_TIERS) return 1;
    return 0;
}

static inline uint32_t *find_holder(Index *ix, Rec *r, uint32_t slot) {
    uint32_t n, *p = holders(ix, r, &n);
    if (n <= 8) {
        for (uint32_t i = 0; i < n; i++)
            if (HSLOT(p[i]) == slot) return &p[i];
        return NULL;
    }
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) >> 1, s = HSLOT(p[mid]);
        if (s == slot) return &p[mid];
        if (s < slot) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

static int vec_new(Index *ix, uint32_t cap, uint32_t *id) {
    HVec *v = ix_malloc(ix, sizeof(HVec) + cap * sizeof(uint32_t));
    if (!v) return -1;
    v->len = 0;
    v->cap = cap;
    if (ix->vec_free_len) {
        *id = ix->vec_free[--ix->vec_free_len];
    } else {
        if (ix->nvecs == ix->vecs_cap) {
            uint32_t cap2 = ix->vecs_cap ? ix->vecs_cap * 2 : 16;
            HVec **t = ix_realloc(ix, ix->vecs, ix->vecs_cap * sizeof(HVec *), cap2 * sizeof(HVec *));
            if (!t) {
                ix_free(ix, v, sizeof(HVec) + cap * sizeof(uint32_t));
                return -1;
            }
            ix->vecs = t;
            ix->vecs_cap = cap2;
        }
        *id = ix->nvecs++;
    }
    ix->vecs[*id] = v;
    return 0;
}

/* Returns the vec's id to the free list; the free list's room is made when the vec is made. */
static void vec_release(Index *ix, uint32_t id) {
    HVec *v = ix->vecs[id];
    ix_free(ix, v, sizeof(HVec) + v->cap * sizeof(uint32_t));
    ix->vecs[id] = NULL;
    ix->vec_free[ix->vec_free_len++] = id;
}

static int vec_free_reserve(Index *ix) {
    if (ix->vec_free_cap >= ix->nvecs + 1) return 0;
    uint32_t cap = ix->vecs_cap ? ix->vecs_cap : 16;
    while (cap < ix->nvecs + 1) cap *= 2;
    uint32_t *t = ix_realloc(ix, ix->vec_free, ix->vec_free_cap * sizeof(uint32_t), cap * sizeof(uint32_t));
    if (!t) return -1;
    ix->vec_free = t;
    ix->vec_free_cap = cap;
    return 0;
}

/* Insert holder `h` (its slot absent) keeping the order; -1 (nothing changed) when out of memory. */
static int add_holder(Index *ix, Rec *r, uint32_t h) {
    uint32_t a = r->h[0];
    if (!a) {
        r->h[0] = h;
        return 0;
    }
    if (a & F_VALID) {
        if (!r->h[1]) {
            if (HSLOT(h) < HSLOT(a)) {
                r->h[1] = a;
                r->h[0] = h;
            } else {
                r->h[1] = h;
            }
            return 0;
        }
        uint32_t id;
        if (vec_free_reserve(ix) < 0 || vec_new(ix, 4, &id) < 0) return -1;
        HVec *v = ix->vecs[id];
        uint32_t x = r->h[0], y = r->h[1];
        if (HSLOT(h) < HSLOT(x)) {
            v->h[0] = h, v->h[1] = x, v->h[2] = y;
        } else if (HSLOT(h) < HSLOT(y)) {
            v->h[0] = x, v->h[1] = h, v->h[2] = y;
        } else {
            v->h[0] = x, v->h[1] = y, v->h[2] = h;
        }
        v->len = 3;
        r->h[0] = VEC_MARK;
        r->h[1] = id;
        return 0;
    }
    uint32_t id = r->h[1];
    HVec *v = ix->vecs[id];
    if (v->len == v->cap) {
        uint32_t cap = v->cap * 2;
        HVec *w = ix_realloc(ix, v, sizeof(HVec) + v->cap * sizeof(uint32_t), sizeof(HVec) + cap * sizeof(uint32_t));
        if (!w) return -1;
        w->cap = cap;
        ix->vecs[id] = v = w;
    }
    uint32_t lo = 0, hi = v->len, s = HSLOT(h);
    while (lo < hi) {
        uint32_t mid = (lo + hi) >> 1;
        if (HSLOT(v->h[mid]) < s) lo = mid + 1;
        else hi = mid;
    }
    memmove(&v->h[lo + 1], &v->h[lo], (v->len - lo) * sizeof(uint32_t));
    v->h[lo] = h;
    v->len++;
    return 0;
}

/* The record's holders were compacted in place to their first `n`: make that its holder count
 * (an HVec of two or fewer goes back inline). */
static void set_holder_count(Index *ix, Rec *r, uint32_t n) {
    uint32_t a = r->h[0];
    if (!a) return;
    if (a & F_VALID) {
        if (n < 2) r->h[1] = 0;
        if (n == 0) r->h[0] = 0;
        return;
    }
    uint32_t id = r->h[1];
    HVec *v = ix->vecs[id];
    v->len = n;
    if (n <= 2) {
        uint32_t x = n > 0 ? v->h[0] : 0, y = n > 1 ? v->h[1] : 0;
        vec_release(ix, id);
        r->h[0] = x;
        r->h[1] = y;
    } else if (n * 4 <= v->cap && v->cap > 4) {
        uint32_t old = v->cap, cap = old / 2;
        HVec *w = PyMem_Realloc(v, sizeof(HVec) + cap * sizeof(uint32_t));
        if (w) { /* else keep the larger one: shrinking is optional */
            ix->bytes -= (size_t)(old - cap) * sizeof(uint32_t);
            w->cap = cap;
            ix->vecs[id] = w;
        }
    }
}

static void remove_holder(Index *ix, Rec *r, uint32_t *ptr) {
    uint32_t n, *p = holders(ix, r, &n);
    uint32_t i = (uint32_t)(ptr - p);
    memmove(&p[i], &p[i + 1], (n - i - 1) * sizeof(uint32_t));
    set_holder_count(ix, r, n - 1);
}

/* ------------------------------------------------------------------ key -> record */

static int kresize(Index *ix, uint32_t bits) {
    size_t n = (size_t)1 << bits, old = (size_t)1 << ix->kbits;
    KSlot *t = ix_calloc(ix, n, sizeof(KSlot));
    if (!t) return -1;
    uint64_t mask = n - 1;
    uint32_t shift = 32 - bits;
    for (size_t j = 0; j < old; j++) {
        KSlot s = ix->kslots[j];
        if (!s.rec) continue;
        uint64_t i = s.tag >> shift;
        while (t[i].rec) i = (i + 1) & mask;
        t[i] = s;
    }
    ix_free(ix, ix->kslots, old * sizeof(KSlot));
    ix->kslots = t;
    ix->kbits = bits;
    return 0;
}

/* The record id of `key` (0: absent); *pos is its slot, or the empty slot that ended the probe. */
static inline uint32_t klookup(Index *ix, uint64_t key, uint32_t tag, uint64_t *pos) {
    uint64_t mask = ((uint64_t)1 << ix->kbits) - 1;
    uint64_t i = tag >> (32 - ix->kbits);
    KSlot *t = ix->kslots;
    for (;;) {
        KSlot s = t[i];
        if (!s.rec) {
            *pos = i;
            return 0;
        }
        if (s.tag == tag && REC(ix, s.rec)->key == key) {
            *pos = i;
            return s.rec;
        }
        i = (i + 1) & mask;
    }
}

static inline uint32_t kfind(Index *ix, uint64_t key) {
    uint64_t pos;
    return klookup(ix, key, key_tag(key), &pos);
}

static void kdelete_at(Index *ix, uint64_t i) {
    uint64_t mask = ((uint64_t)1 << ix->kbits) - 1, j = i;
    uint32_t shift = 32 - ix->kbits;
    KSlot *t = ix->kslots;
    for (;;) {
        j = (j + 1) & mask;
        KSlot s = t[j];
        if (!s.rec) break;
        uint64_t home = s.tag >> shift;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            t[i] = s;
            i = j;
        }
    }
    t[i].rec = 0;
    t[i].tag = 0;
    ix->kused--;
    if (ix->kbits > MIN_BITS && ix->kused * 8 < ((uint64_t)1 << ix->kbits)) {
        uint32_t bits = MIN_BITS;
        while (((uint64_t)1 << bits) < ix->kused * 2) bits++;
        if (kresize(ix, bits) < 0) PyErr_Clear(); /* shrinking is optional */
    }
}

/* A new record for `key` (absent); 0 and an exception when out of memory (nothing changed). */
static uint32_t rec_insert(Index *ix, uint64_t key) {
    uint32_t tag = key_tag(key);
    if ((ix->kused + 1) * 4 > ((uint64_t)3 << ix->kbits)) {
        if (ix->kbits >= 32) {
            PyErr_SetString(PyExc_MemoryError, "prefix index: too many keys");
            return 0;
        }
        if (kresize(ix, ix->kbits + 1) < 0) return 0;
    }
    uint32_t id;
    if (ix->free_head) {
        id = ix->free_head;
        ix->free_head = (uint32_t)REC(ix, id)->key;
    } else {
        if (ix->rec_top == UINT32_MAX) {
            PyErr_SetString(PyExc_MemoryError, "prefix index: too many keys");
            return 0;
        }
        uint32_t c = ix->rec_top >> CHUNK_BITS;
        if (c == ix->nchunks) {
            if (ix->nchunks == ix->chunks_cap) {
                uint32_t cap = ix->chunks_cap ? ix->chunks_cap * 2 : 8;
                Rec **t = ix_realloc(ix, ix->chunks, ix->chunks_cap * sizeof(Rec *), cap * sizeof(Rec *));
                if (!t) return 0;
                ix->chunks = t;
                if (ix->max_entries) {
                    uint32_t **m = ix_realloc(ix, ix->marks, ix->chunks_cap * sizeof(uint32_t *), cap * sizeof(uint32_t *));
                    if (!m) return 0; /* chunks is larger than needed: harmless */
                    ix->marks = m;
                }
                ix->chunks_cap = cap;
            }
            size_t n = c ? CHUNK : 16;
            Rec *chunk = ix_malloc(ix, n * sizeof(Rec));
            if (!chunk) return 0;
            if (ix->max_entries) {
                uint32_t *m = ix_malloc(ix, n * sizeof(uint32_t));
                if (!m) {
                    ix_free(ix, chunk, n * sizeof(Rec));
                    return 0;
                }
                ix->marks[c] = m;
            }
            ix->chunks[c] = chunk;
            ix->nchunks++;
            if (!c) ix->chunk0_cap = (uint32_t)n;
        } else if (!c && ix->rec_top == ix->chunk0_cap) {
            /* chunk 0 doubles: no record pointer lives across an insert, so ids stay valid */
            size_t old = ix->chunk0_cap, n = old * 2;
            Rec *chunk = ix_malloc(ix, n * sizeof(Rec));
            uint32_t *m = chunk && ix->max_entries ? ix_malloc(ix, n * sizeof(uint32_t)) : NULL;
            if (!chunk || (ix->max_entries && !m)) {
                ix_free(ix, chunk, n * sizeof(Rec));
                return 0;
            }
            memcpy(chunk, ix->chunks[0], old * sizeof(Rec));
            ix_free(ix, ix->chunks[0], old * sizeof(Rec));
            ix->chunks[0] = chunk;
            if (m) {
                memcpy(m, ix->marks[0], old * sizeof(uint32_t));
                ix_free(ix, ix->marks[0], old * sizeof(uint32_t));
                ix->marks[0] = m;
            }
            ix->chunk0_cap = (uint32_t)n;
        }
        id = ix->rec_top++;
    }
    Rec *r = REC(ix, id);
    r->key = key;
    r->h[0] = r->h[1] = 0;
    if (ix->marks) *MARK(ix, id) = 0;
    uint64_t mask = ((uint64_t)1 << ix->kbits) - 1, i = tag >> (32 - ix->kbits);
    while (ix->kslots[i].rec) i = (i + 1) & mask;
    ix->kslots[i].tag = tag;
    ix->kslots[i].rec = id;
    ix->kused++;
    return id;
}

/* Forget a record with no holders that is not in the clock; the last one gives every chunk back. */
static void rec_free(Index *ix, uint32_t id) {
    Rec *r = REC(ix, id);
    uint64_t pos;
    uint32_t found = klookup(ix, r->key, key_tag(r->key), &pos);
    if (found == id) kdelete_at(ix, pos);
    r->key = ix->free_head;
    ix->free_head = id;
    if (ix->kused) return;
    for (uint32_t c = 0; c < ix->nchunks; c++) {
        ix_free(ix, ix->chunks[c], chunk_recs(ix, c) * sizeof(Rec));
        if (ix->marks) ix_free(ix, ix->marks[c], chunk_recs(ix, c) * sizeof(uint32_t));
    }
    ix->nchunks = 0;
    ix->chunk0_cap = 0;
    ix->rec_top = 1;
    ix->free_head = 0;
    ix_free(ix, ix->vecs, ix->vecs_cap * sizeof(HVec *)); /* no record, so no vec in use */
    ix_free(ix, ix->vec_free, ix->vec_free_cap * sizeof(uint32_t));
    ix->vecs = NULL;
    ix->vec_free = NULL;
    ix->nvecs = ix->vecs_cap = ix->vec_free_len = ix->vec_free_cap = 0;
}

static inline void rec_maybe_free(Index *ix, uint32_t id) {
    if (!REC(ix, id)->h[0] && !in_ring(ix, id)) rec_free(ix, id);
}

/* ------------------------------------------------------------------ per-worker sets */

static inline uint32_t wset_home(uint32_t id, uint32_t bits) { return (uint32_t)(id * 0x9E3779B1u) >> (32 - bits); }

static int wset_resize(Index *ix, Worker *w, uint32_t bits) {
    size_t n = (size_t)1 << bits;
    uint32_t *t = ix_calloc(ix, n, sizeof(uint32_t));
    if (!t) return -1;
    uint32_t mask = (uint32_t)n - 1;
    if (w->set) {
        size_t old = (size_t)1 << w->bits;
        for (size_t j = 0; j < old; j++) {
            uint32_t id = w->set[j];
            if (!id) continue;
            uint32_t i = wset_home(id, bits);
            while (t[i]) i = (i + 1) & mask;
            t[i] = id;
        }
        ix_free(ix, w->set, old * sizeof(uint32_t));
    }
    w->set = t;
    w->bits = bits;
    return 0;
}

static int wset_reserve(Index *ix, Worker *w, uint32_t extra) {
    uint64_t want = (uint64_t)w->used + extra;
    if (w->set && want * 4 <= ((uint64_t)3 << w->bits)) return 0;
    uint32_t bits = w->bits > MIN_BITS ? w->bits : MIN_BITS;
    while (want * 4 > ((uint64_t)3 << bits)) bits++;
    return wset_resize(ix, w, bits);
}

static inline void wset_insert(Worker *w, uint32_t id) {
    uint32_t mask = (1u << w->bits) - 1, i = wset_home(id, w->bits);
    while (w->set[i]) i = (i + 1) & mask;
    w->set[i] = id;
    w->used++;
}

static void wset_delete(Index *ix, Worker *w, uint32_t id) {
    if (!w->set) return; /* clear took the set over */
    uint32_t mask = (1u << w->bits) - 1, i = wset_home(id, w->bits);
    while (w->set[i] != id) {
        if (!w->set[i]) return;
        i = (i + 1) & mask;
    }
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t x = w->set[j];
        if (!x) break;
        uint32_t home = wset_home(x, w->bits);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            w->set[i] = x;
            i = j;
        }
    }
    w->set[i] = 0;
    w->used--;
    if (!w->used) {
        ix_free(ix, w->set, ((size_t)1 << w->bits) * sizeof(uint32_t));
        w->set = NULL;
        w->bits = 0;
    } else if (w->bits > MIN_BITS && (uint64_t)w->used * 8 < ((uint64_t)1 << w->bits)) {
        uint32_t bits = MIN_BITS;
        while (((uint64_t)1 << bits) < (uint64_t)w->used * 2) bits++;
        if (wset_resize(ix, w, bits) < 0) PyErr_Clear();
    }
}

static int ensure_worker(Index *ix, uint32_t slot) {
    if (slot < ix->nworkers) return 0;
    uint64_t n = (uint64_t)slot + 1, grown = (uint64_t)ix->nworkers + ix->nworkers / 2;
    if (n < grown) n = grown;
    if (n < 8) n = 8;
    if (n > (uint64_t)MAX_SLOT + 1) n = (uint64_t)MAX_SLOT + 1;
    Worker *w = ix_calloc(ix, n, sizeof(Worker));
    if (!w) return -1;
    uint32_t *s = ix_calloc(ix, 5 * n, sizeof(uint32_t));
    if (!s) {
        ix_free(ix, w, n * sizeof(Worker));
        return -1;
    }
    if (ix->nworkers) {
        memcpy(w, ix->workers, ix->nworkers * sizeof(Worker));
        ix_free(ix, ix->workers, ix->nworkers * sizeof(Worker));
        ix_free(ix, ix->scratch, 5 * (size_t)ix->nworkers * sizeof(uint32_t));
    }
    ix->workers = w;
    ix->scratch = s; /* all zero: no walk is under way */
    ix->nworkers = (uint32_t)n;
    return 0;
}

/* ------------------------------------------------------------------ the clock */

static int ring_resize(Index *ix, uint64_t cap) {
    uint32_t *t = ix_malloc(ix, cap * sizeof(uint32_t));
    if (!t) return -1;
    for (uint64_t i = 0; i < ix->ring_len; i++) t[i] = ix->ring[(ix->ring_head + i) & (ix->ring_cap - 1)];
    ix_free(ix, ix->ring, ix->ring_cap * sizeof(uint32_t));
    ix->ring = t;
    ix->ring_cap = cap;
    ix->ring_head = 0;
    return 0;
}

static int ring_reserve(Index *ix, uint64_t extra) {
    uint64_t cap = ix->ring_cap ? ix->ring_cap : 64;
    while (cap < ix->ring_len + extra) cap *= 2;
    return cap == ix->ring_cap ? 0 : ring_resize(ix, cap);
}

static void ring_maybe_shrink(Index *ix) {
    if (ix->ring_cap > 64 && ix->ring_len * 4 < ix->ring_cap)
        if (ring_resize(ix, ix->ring_cap / 2) < 0) PyErr_Clear();
}

static inline void ring_push(Index *ix, uint32_t id) {
    ix->ring[(ix->ring_head + ix->ring_len) & (ix->ring_cap - 1)] = id;
    ix->ring_len++;
}

static void new_lap(Index *ix) {
    ix->lap = ix->lap >= LAP_MASK ? 2 : ix->lap + 1;
    ix->marked_now = 0;
    ix->lap_left = (int64_t)ix->ring_len + 1;
}

static uint32_t hand(Index *ix) {
    uint32_t id = ix->ring[ix->ring_head];
    ix->ring_head = (ix->ring_head + 1) & (ix->ring_cap - 1);
    ix->ring_len--;
    if (--ix->lap_left <= 0) new_lap(ix);
    return id;
}

static inline void mark_rec(Index *ix, uint32_t id) {
    uint32_t *m = MARK(ix, id);
    if ((*m & LAP_MASK) != ix->lap) {
        *m = (*m & IN_RING) | ix->lap;
        ix->marked_now++;
    }
}

static inline int recently_matched(Index *ix, uint32_t id) {
    uint32_t m = *MARK(ix, id) & LAP_MASK;
    return m && (m == ix->lap || m == ix->lap - 1);
}

/* The hand passed a key no worker holds any more: out of the clock (and gone, if nobody claims it). */
static void leave_departed(Index *ix, uint32_t id) {
    *MARK(ix, id) &= ~IN_RING;
    ix->departed--;
    rec_maybe_free(ix, id);
}

/* Drop every worker's entries of the record (claims stay). */
static void drop(Index *ix, uint32_t id, int recent) {
    Rec *r = REC(ix, id);
    uint32_t n, *p = holders(ix, r, &n), kept = 0;
    uint64_t dropped = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t h = p[i], tiers = h & F_TIERS;
        if (tiers) {
            Worker *w = &ix->workers[HSLOT(h)];
            for (int t = 0; t < NTIERS; t++) {
                if (tiers & TIER_FLAG(t)) {
                    w->count[t]--;
                    w->evicted[t]++;
                    dropped++;
                }
            }
            if (!w->has_evicted) {
                w->has_evicted = 1;
                ix->workers_with_evictions++;
            }
            wset_delete(ix, w, id);
        }
        if (h & F_SPEC) p[kept++] = h & ~F_TIERS;
    }
    set_holder_count(ix, r, kept);
    ix->entries -= dropped;
    ix->ev_keys++;
    ix->ev_entries += dropped;
    if (recent) ix->ev_recent += dropped;
    rec_maybe_free(ix, id);
}

static void evict(Index *ix) {
    int64_t chances = 64 + 8 * (int64_t)(ix->entries - ix->max_entries);
    while (ix->entries > ix->max_entries && ix->ring_len) {
        uint32_t id = hand(ix);
        if (!rec_has_entries(ix, REC(ix, id))) {
            leave_departed(ix, id);
            continue;
        }
        int recent = recently_matched(ix, id);
        if (recent && chances > 0) {
            chances--;
            ring_push(ix, id);
            continue;
        }
        *MARK(ix, id) &= ~IN_RING;
        drop(ix, id, recent);
    }
    ring_maybe_shrink(ix);
}

/* `gone` keys lost their last entry: while departed keys are over an eighth of the clock, move the hand. */
static void depart(Index *ix, uint64_t gone) {
    uint64_t steps = 64 + 8 * gone;
    while (steps && ix->departed * 8 > ix->ring_len) {
        uint32_t id = hand(ix);
        if (!rec_has_entries(ix, REC(ix, id))) leave_departed(ix, id);
        else ring_push(ix, id);
        steps--;
    }
    ring_maybe_shrink(ix);
}

static void forget_evictions(Index *ix, uint32_t slot) {
    if (slot >= ix->nworkers) return;
    Worker *w = &ix->workers[slot];
    if (w->has_evicted) {
        w->has_evicted = 0;
        memset(w->evicted, 0, sizeof(w->evicted));
        ix->workers_with_evictions--;
    }
}

/* ------------------------------------------------------------------ inputs */

typedef struct {
    uint64_t *v;
    Py_ssize_t n, cap;
    uint64_t local[64];
} Keys;

static int keys_grow(Keys *k, Py_ssize_t want) {
    if (want <= k->cap) return 0;
    Py_ssize_t cap = k->cap * 2 > want ? k->cap * 2 : want;
    if ((size_t)cap > PY_SSIZE_T_MAX / sizeof(uint64_t)) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *t = k->v == k->local ? PyMem_Malloc(cap * sizeof(uint64_t)) : PyMem_Realloc(k->v, cap * sizeof(uint64_t));
    if (!t) {
        PyErr_NoMemory();
        return -1;
    }
    if (k->v == k->local) memcpy(t, k->local, k->n * sizeof(uint64_t));
    k->v = t;
    k->cap = cap;
    return 0;
}

static void keys_release(Keys *k) {
    if (k->v != k->local) PyMem_Free(k->v);
    k->v = k->local;
}

static inline int key_of(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "block keys must be ints, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "block keys must be unsigned 64-bit ints");
        }
        return -1;
    }
    *out = v;
    return 0;
}

/* Read keys: bytes-like (little-endian u64 words; an array of format Q: native words), a list or
 * tuple, or any iterable of ints. */
static int keys_parse(PyObject *obj, Keys *k) {
    k->v = k->local;
    k->n = 0;
    k->cap = 64;
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        if (keys_grow(k, n) < 0) return -1;
        PyObject **items = PySequence_Fast_ITEMS(obj);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (key_of(items[i], &k->v[i]) < 0) goto fail;
        }
        k->n = n;
        return 0;
    }
    if (PyObject_CheckBuffer(obj)) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
        const char *f = view.format ? view.format : "B";
        char order = '@';
        if (*f == '<' || *f == '>' || *f == '!' || *f == '=' || *f == '@') order = *f++;
        int bytes_like = view.itemsize == 1 && (!strcmp(f, "B") || !strcmp(f, "b") || !strcmp(f, "c"));
        int words = view.itemsize == 8 && (!strcmp(f, "Q") || !strcmp(f, "L"));
        if ((!bytes_like && !words) || view.len % 8) {
            PyErr_Format(PyExc_ValueError,
                         "packed block keys must be bytes of little-endian 64-bit words (or an array of format Q), "
                         "got format %.20s, %zd bytes", view.format ? view.format : "B", view.len);
            PyBuffer_Release(&view);
            return -1;
        }
        Py_ssize_t n = view.len / 8;
        if (keys_grow(k, n) < 0) {
            PyBuffer_Release(&view);
            return -1;
        }
        memcpy(k->v, view.buf, n * 8);
        /* bytes hold little-endian words; an array's words are in its format's byte order */
        int little = bytes_like || order == '<' || ((order == '@' || order == '=') && !PY_BIG_ENDIAN);
        if (little == PY_BIG_ENDIAN)
            for (Py_ssize_t i = 0; i < n; i++) k->v[i] = __builtin_bswap64(k->v[i]);
        k->n = n;
        PyBuffer_Release(&view);
        return 0;
    }
    PyObject *it = PyObject_GetIter(obj);
    if (!it) return -1;
    Py_ssize_t hint = PyObject_LengthHint(obj, 64);
    if (hint > (1 << 20)) hint = 1 << 20; /* a hint, not a promise: grow as items come */
    if (hint < 0 || keys_grow(k, hint) < 0) {
        Py_DECREF(it);
        goto fail;
    }
    PyObject *item;
    while ((item = PyIter_Next(it))) {
        if (k->n == k->cap && keys_grow(k, k->cap * 2) < 0) {
            Py_DECREF(item);
            Py_DECREF(it);
            goto fail;
        }
        int bad = key_of(item, &k->v[k->n]);
        Py_DECREF(item);
        if (bad < 0) {
            Py_DECREF(it);
            goto fail;
        }
        k->n++;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) goto fail;
    return 0;
fail:
    keys_release(k);
    return -1;
}

static int parse_slot(PyObject *o, uint32_t *slot) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > (long)MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "worker slot must be in [0, %u], got %ld", MAX_SLOT, v);
        return -1;
    }
    *slot = (uint32_t)v;
    return 0;
}

static int parse_tier(PyObject *o, int *tier) {
    if (!o) {
        *tier = 0;
        return 0;
    }
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v >= NTIERS) {
        PyErr_Format(PyExc_ValueError, "tier must be 0 (gpu), 1 (cpu) or 2 (disk), got %ld", v);
        return -1;
    }
    *tier = (int)v;
    return 0;
}

/* Positional or keyword arguments, `names[:nmin]` required. */
static int parse_args(const char *fname, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, int nmin, int nmax, PyObject **out) {
    for (int i = 0; i < nmax; i++) out[i] = NULL;
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fname, nmax, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    if (kwnames) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, k);
            int j = 0;
            while (j < nmax && PyUnicode_CompareWithASCIIString(name, names[j])) j++;
            if (j == nmax) {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fname, name);
                return -1;
            }
            if (out[j]) {
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname, names[j]);
                return -1;
            }
            out[j] = args[nargs + k];
        }
    }
    for (int i = 0; i < nmin; i++) {
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ changes */

/* Returns entries added, -1 with an exception (the keys before the failing one are stored). */
static int64_t store_keys(Index *ix, uint32_t slot, const uint64_t *keys, Py_ssize_t n, int tier) {
    if (ensure_worker(ix, slot) < 0) return -1;
    int bounded = ix->max_entries != 0;
    uint32_t *fresh = NULL;
    if (bounded && n) {
        if (ring_reserve(ix, (uint64_t)n) < 0) return -1;
        fresh = PyMem_Malloc(n * sizeof(uint32_t));
        if (!fresh) {
            PyErr_NoMemory();
            return -1;
        }
    }
    uint32_t bit = TIER_FLAG(tier), nfresh = 0;
    int64_t added = 0;
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = keys[i], pos;
        uint32_t tag = key_tag(key);
        uint32_t id = klookup(ix, key, tag, &pos);
        int created = 0;
        if (!id) {
            id = rec_insert(ix, key);
            if (!id) {
                failed = 1;
                break;
            }
            created = 1;
        }
        Rec *r = REC(ix, id);
        uint32_t *h = find_holder(ix, r, slot);
        if (h && (*h & bit)) continue;
        Worker *w = &ix->workers[slot];
        int new_to_worker = !h || !(*h & F_TIERS);
        if (new_to_worker && wset_reserve(ix, w, 1) < 0) {
            if (created) rec_maybe_free(ix, id);
            failed = 1;
            break;
        }
        int had_entries = bounded && !created && rec_has_entries(ix, r);
        if (h) {
            *h |= bit;
        } else if (add_holder(ix, r, (slot << SLOT_SHIFT) | bit | F_VALID) < 0) {
            if (created) rec_maybe_free(ix, id);
            failed = 1;
            break;
        }
        if (new_to_worker) wset_insert(w, id);
        w->count[tier]++;
        ix->entries++;
        added++;
        if (bounded && !had_entries) {
            uint32_t *m = MARK(ix, id);
            if (*m & IN_RING) {
                ix->departed--; /* stored again before the hand passed it: it keeps its place */
            } else {
                *m |= IN_RING;
                fresh[nfresh++] = id;
            }
        }
    }
    if (bounded) {
        while (nfresh) ring_push(ix, fresh[--nfresh]); /* deepest first: the hand reaches a chain's tail first */
        PyMem_Free(fresh);
        if (ix->entries > ix->max_entries) evict(ix);
        else ring_maybe_shrink(ix); /* the room reserved for keys that were not new */
    }
    return failed ? -1 : added;
}

/* `slot` no longer holds the record on `tier` (it did): entries, its set, the record, the clock. */
static void unhold(Index *ix, uint32_t slot, uint32_t id, uint32_t *h, uint32_t tiers, uint64_t *gone) {
    Worker *w = &ix->workers[slot];
    Rec *r = REC(ix, id);
    for (int t = 0; t < NTIERS; t++) {
        if (tiers & TIER_FLAG(t)) {
            w->count[t]--;
            ix->entries--;
        }
    }
    *h &= ~tiers;
    if (!(*h & F_TIERS)) {
        wset_delete(ix, w, id);
        if (!(*h & F_SPEC)) remove_holder(ix, r, h);
    }
    if (ix->max_entries && !rec_has_entries(ix, r)) {
        ix->departed++;
        (*gone)++;
    }
    rec_maybe_free(ix, id);
}

static int64_t remove_keys(Index *ix, uint32_t slot, const uint64_t *keys, Py_ssize_t n, int tier) {
    if (slot >= ix->nworkers || !ix->workers[slot].count[tier]) return 0;
    uint32_t bit = TIER_FLAG(tier);
    uint64_t gone = 0;
    int64_t removed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t id = kfind(ix, keys[i]);
        if (!id) continue;
        uint32_t *h = find_holder(ix, REC(ix, id), slot);
        if (!h || !(*h & bit)) continue;
        unhold(ix, slot, id, h, bit, &gone);
        removed++;
    }
    if (gone) depart(ix, gone);
    return removed;
}

static int64_t clear_worker(Index *ix, uint32_t slot) {
    if (ix->max_entries) forget_evictions(ix, slot);
    if (slot >= ix->nworkers) return 0;
    Worker *w = &ix->workers[slot];
    if (!w->used) return 0;
    uint32_t *set = w->set, bits = w->bits;
    w->set = NULL; /* taken over: unhold's set deletions have nothing to do */
    w->bits = 0;
    w->used = 0;
    int64_t dropped = 0;
    uint64_t gone = 0;
    for (size_t j = 0; j < ((size_t)1 << bits); j++) {
        uint32_t id = set[j];
        if (!id) continue;
        uint32_t *h = find_holder(ix, REC(ix, id), slot);
        uint32_t tiers = *h & F_TIERS;
        dropped += __builtin_popcount(tiers);
        unhold(ix, slot, id, h, tiers, &gone);
    }
    ix_free(ix, set, ((size_t)1 << bits) * sizeof(uint32_t));
    if (gone) depart(ix, gone);
    return dropped;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int replace_keys(Index *ix, uint32_t slot, const uint64_t *keys, Py_ssize_t n, int tier) {
    uint64_t *wanted = NULL, *stale = NULL;
    Py_ssize_t nstale = 0;
    uint32_t bit = TIER_FLAG(tier);
    if (slot < ix->nworkers && ix->workers[slot].count[tier]) {
        Worker *w = &ix->workers[slot];
        wanted = PyMem_Malloc((n ? n : 1) * sizeof(uint64_t));
        stale = PyMem_Malloc((w->used ? w->used : 1) * sizeof(uint64_t));
        if (!wanted || !stale) {
            PyMem_Free(wanted);
            PyMem_Free(stale);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(wanted, keys, n * sizeof(uint64_t));
        qsort(wanted, n, sizeof(uint64_t), cmp_u64);
        for (size_t j = 0; j < ((size_t)1 << w->bits); j++) {
            uint32_t id = w->set[j];
            if (!id) continue;
            Rec *r = REC(ix, id);
            uint32_t *h = find_holder(ix, r, slot);
            if ((*h & bit) && !bsearch(&r->key, wanted, n, sizeof(uint64_t), cmp_u64)) stale[nstale++] = r->key;
        }
        remove_keys(ix, slot, stale, nstale, tier);
        PyMem_Free(wanted);
        PyMem_Free(stale);
    }
    return store_keys(ix, slot, keys, n, tier) < 0 ? -1 : 0;
}

static int speculate_keys(Index *ix, uint32_t slot, const uint64_t *keys, Py_ssize_t n) {
    if (ensure_worker(ix, slot) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t id = kfind(ix, keys[i]);
        int created = 0;
        if (!id) {
            id = rec_insert(ix, keys[i]);
            if (!id) return -1;
            created = 1;
        }
        Rec *r = REC(ix, id);
        uint32_t *h = find_holder(ix, r, slot);
        if (h) {
            *h |= F_SPEC;
        } else if (add_holder(ix, r, (slot << SLOT_SHIFT) | F_SPEC | F_VALID) < 0) {
            if (created) rec_maybe_free(ix, id);
            return -1;
        }
    }
    return 0;
}

static void unspeculate_keys(Index *ix, uint32_t slot, const uint64_t *keys, Py_ssize_t n) {
    if (slot >= ix->nworkers) return;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t id = kfind(ix, keys[i]);
        if (!id) continue;
        Rec *r = REC(ix, id);
        uint32_t *h = find_holder(ix, r, slot);
        if (!h || !(*h & F_SPEC)) continue;
        *h &= ~F_SPEC;
        if (!(*h & F_TIERS)) {
            remove_holder(ix, r, h);
            rec_maybe_free(ix, id);
        }
    }
}

/* ------------------------------------------------------------------ the walk */

typedef struct {
    uint32_t slot, depth, cpu, disk, spec;
} Hit;

#define PREFETCH 8

/* Walk `keys` from the start: per worker holding keys[0] (on a tier, or a claim when `qualify`
 * includes F_SPEC), the depth of its held prefix and, with `tiers`, its cpu/disk/speculative-only
 * block counts, left in the scratch for the `*nt` slots listed in touched. Returns the walk's end;
 * a bounded index marks keys[:end] as recently matched. */
static Py_ssize_t walk(Index *ix, const uint64_t *keys, Py_ssize_t n, uint32_t qualify, int tiers, uint32_t *nt_out) {
    *nt_out = 0;
    if (!n || !ix->nworkers) return 0;
    uint32_t nw = ix->nworkers;
    uint32_t *depth = ix->scratch, *cpu = depth + nw, *disk = cpu + nw, *spec = disk + nw, *touched = spec + nw;
    int mark = ix->max_entries != 0;
    uint32_t id = kfind(ix, keys[0]);
    if (!id) return 0;
    uint32_t cnt, *p = holders(ix, REC(ix, id), &cnt), nt = 0;
    for (uint32_t i = 0; i < cnt; i++) {
        uint32_t h = p[i];
        if (!(h & qualify)) continue;
        uint32_t s = HSLOT(h);
        depth[s] = 1;
        touched[nt++] = s;
        if (tiers && !(h & F_GPU)) {
            if (h & F_CPU) cpu[s]++;
            else if (h & F_DISK) disk[s]++;
            else spec[s]++;
        }
    }
    *nt_out = nt;
    if (!nt) return 0;
    if (mark) mark_rec(ix, id);
    Py_ssize_t pos;
    uint32_t shift = 32 - ix->kbits;
    for (pos = 1; pos < n; pos++) {
        if (pos + PREFETCH < n) /* the table slot of a key a few blocks on: its miss overlaps this block's work */
            __builtin_prefetch(&ix->kslots[key_tag(keys[pos + PREFETCH]) >> shift]);
        id = kfind(ix, keys[pos]);
        if (!id) break;
        p = holders(ix, REC(ix, id), &cnt);
        uint32_t want = (uint32_t)pos, advanced = 0;
        for (uint32_t i = 0; i < cnt; i++) {
            uint32_t h = p[i], s = HSLOT(h);
            if (depth[s] != want || !(h & qualify)) continue;
            depth[s] = want + 1;
            advanced++;
            if (tiers && !(h & F_GPU)) {
                if (h & F_CPU) cpu[s]++;
                else if (h & F_DISK) disk[s]++;
                else spec[s]++;
            }
        }
        if (!advanced) break;
        if (mark) mark_rec(ix, id);
    }
    if (mark) {
        uint64_t limit = ix->ring_len >> 2;
        if (ix->marked_now > (limit > 4096 ? limit : 4096)) new_lap(ix);
    }
    return pos;
}

/* Copy the walk's results out and zero the scratch (before any Python object is made). */
static Hit *collect(Index *ix, uint32_t nt) {
    uint32_t nw = ix->nworkers;
    uint32_t *depth = ix->scratch, *cpu = depth + nw, *disk = cpu + nw, *spec = disk + nw, *touched = spec + nw;
    Hit *hits = PyMem_Malloc((nt ? nt : 1) * sizeof(Hit));
    for (uint32_t i = 0; i < nt; i++) {
        uint32_t s = touched[i];
        if (hits) {
            hits[i].slot = s;
            hits[i].depth = depth[s];
            hits[i].cpu = cpu[s];
            hits[i].disk = disk[s];
            hits[i].spec = spec[s];
        }
        depth[s] = cpu[s] = disk[s] = spec[s] = 0;
    }
    if (!hits) PyErr_NoMemory();
    return hits;
}

static int dict_put(PyObject *d, uint32_t k, uint32_t v) {
    PyObject *key = PyLong_FromUnsignedLong(k), *val = key ? PyLong_FromUnsignedLong(v) : NULL;
    int rc = val ? PyDict_SetItem(d, key, val) : -1;
    Py_XDECREF(key);
    Py_XDECREF(val);
    return rc;
}

/* ------------------------------------------------------------------ the type */

#define IX(o) ((Index *)(o))

static void ix_release_all(Index *ix) {
    for (uint32_t c = 0; c < ix->nchunks; c++) {
        PyMem_Free(ix->chunks[c]);
        if (ix->marks) PyMem_Free(ix->marks[c]);
    }
    PyMem_Free(ix->chunks);
    PyMem_Free(ix->marks);
    for (uint32_t v = 0; v < ix->nvecs; v++) PyMem_Free(ix->vecs[v]);
    PyMem_Free(ix->vecs);
    PyMem_Free(ix->vec_free);
    for (uint32_t w = 0; w < ix->nworkers; w++) PyMem_Free(ix->workers[w].set);
    PyMem_Free(ix->workers);
    PyMem_Free(ix->scratch);
    PyMem_Free(ix->kslots);
    PyMem_Free(ix->ring);
}

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"max_entries", NULL};
    long long max_entries = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L:Index", names, &max_entries)) return NULL;
    if (max_entries < 0) {
        PyErr_Format(PyExc_ValueError, "max_entries must be >= 0 (0: unbounded), got %lld", max_entries);
        return NULL;
    }
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (!ix) return NULL;
    ix->max_entries = (uint64_t)max_entries;
    ix->lap = 2;
    ix->kbits = MIN_BITS;
    ix->rec_top = 1; /* record 0 means "none" */
    ix->kslots = ix_calloc(ix, (size_t)1 << MIN_BITS, sizeof(KSlot));
    if (!ix->kslots) {
        Py_DECREF(ix);
        return NULL;
    }
    return (PyObject *)ix;
}

static void Index_dealloc(PyObject *self) {
    ix_release_all(IX(self));
    Py_TYPE(self)->tp_free(self);
}

static const char *const NAMES_WKT[] = {"worker", "keys", "tier"};

#define PARSE_WORKER_KEYS(fname, nmin, nmax)                                                        \
    PyObject *a[3] = {NULL, NULL, NULL};                                                            \
    uint32_t slot;                                                                                  \
    int tier;                                                                                       \
    Keys k;                                                                                         \
    if (parse_args(fname, args, nargs, kwnames, NAMES_WKT, nmin, nmax, a) < 0) return NULL;         \
    if (parse_slot(a[0], &slot) < 0 || parse_tier(a[2], &tier) < 0) return NULL;                   \
    if (keys_parse(a[1], &k) < 0) return NULL;

static PyObject *Index_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PARSE_WORKER_KEYS("store", 2, 3)
    int64_t added = store_keys(IX(self), slot, k.v, k.n, tier);
    keys_release(&k);
    return added < 0 ? NULL : PyLong_FromLongLong(added);
}

static PyObject *Index_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PARSE_WORKER_KEYS("remove", 2, 3)
    int64_t removed = remove_keys(IX(self), slot, k.v, k.n, tier);
    keys_release(&k);
    return PyLong_FromLongLong(removed);
}

static PyObject *Index_replace(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PARSE_WORKER_KEYS("replace", 2, 3)
    int rc = replace_keys(IX(self), slot, k.v, k.n, tier);
    keys_release(&k);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Index_speculate(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PARSE_WORKER_KEYS("speculate", 2, 2)
    int rc = speculate_keys(IX(self), slot, k.v, k.n);
    keys_release(&k);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Index_unspeculate(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PARSE_WORKER_KEYS("unspeculate", 2, 2)
    unspeculate_keys(IX(self), slot, k.v, k.n);
    keys_release(&k);
    Py_RETURN_NONE;
}

static PyObject *Index_held_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PARSE_WORKER_KEYS("held_prefix", 2, 2)
    Index *ix = IX(self);
    Py_ssize_t depth = 0;
    if (slot < ix->nworkers) {
        for (; depth < k.n; depth++) {
            uint32_t id = kfind(ix, k.v[depth]);
            if (!id) break;
            uint32_t *h = find_holder(ix, REC(ix, id), slot);
            if (!h || !(*h & F_TIERS)) break;
        }
    }
    keys_release(&k);
    return PyLong_FromSsize_t(depth);
}

static PyObject *Index_clear(PyObject *self, PyObject *worker) {
    uint32_t slot;
    if (parse_slot(worker, &slot) < 0) return NULL;
    return PyLong_FromLongLong(clear_worker(IX(self), slot));
}

static int walk_keys(Index *ix, PyObject *obj, uint32_t qualify, int tiers, Hit **hits, uint32_t *nt) {
    Keys k;
    if (keys_parse(obj, &k) < 0) return -1;
    if ((uint64_t)k.n >= UINT32_MAX) {
        keys_release(&k);
        PyErr_SetString(PyExc_ValueError, "too many keys in one walk");
        return -1;
    }
    walk(ix, k.v, k.n, qualify, tiers, nt);
    keys_release(&k);
    *hits = collect(ix, *nt);
    return *hits ? 0 : -1;
}

static PyObject *Index_match(PyObject *self, PyObject *keys) {
    Hit *hits;
    uint32_t nt;
    if (walk_keys(IX(self), keys, F_TIERS, 0, &hits, &nt) < 0) return NULL;
    PyObject *d = PyDict_New();
    for (uint32_t i = 0; d && i < nt; i++) {
        if (dict_put(d, hits[i].slot, hits[i].depth) < 0) Py_CLEAR(d);
    }
    PyMem_Free(hits);
    return d;
}

static PyObject *Index_match_tiers_raw(PyObject *self, PyObject *keys) {
    Hit *hits;
    uint32_t nt;
    if (walk_keys(IX(self), keys, F_TIERS | F_SPEC, 1, &hits, &nt) < 0) return NULL;
    PyObject *d[4] = {PyDict_New(), PyDict_New(), PyDict_New(), PyDict_New()};
    int ok = d[0] && d[1] && d[2] && d[3];
    for (uint32_t i = 0; ok && i < nt; i++) {
        Hit *h = &hits[i];
        ok = dict_put(d[0], h->slot, h->depth) == 0 && (!h->cpu || dict_put(d[1], h->slot, h->cpu) == 0) &&
             (!h->disk || dict_put(d[2], h->slot, h->disk) == 0) && (!h->spec || dict_put(d[3], h->slot, h->spec) == 0);
    }
    PyMem_Free(hits);
    PyObject *out = ok ? PyTuple_Pack(4, d[0], d[1], d[2], d[3]) : NULL;
    for (int i = 0; i < 4; i++) Py_XDECREF(d[i]);
    return out;
}

static PyObject *Index_match_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "match_columns(keys, slots) takes 2 arguments");
        return NULL;
    }
    Index *ix = IX(self);
    PyObject *seq = PySequence_Fast(args[1], "slots must be a sequence of ints");
    if (!seq) return NULL;
    Py_ssize_t ns = PySequence_Fast_GET_SIZE(seq);
    uint32_t *slots = PyMem_Malloc((ns ? ns : 1) * sizeof(uint32_t));
    uint32_t *cols = PyMem_Malloc((ns ? ns : 1) * 4 * sizeof(uint32_t));
    PyObject *out = NULL, *lists[4] = {NULL, NULL, NULL, NULL};
    if (!slots || !cols) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ns; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) goto done;
        slots[i] = v < 0 || v > (long)MAX_SLOT ? UINT32_MAX : (uint32_t)v;
    }
    Keys k;
    if (keys_parse(args[0], &k) < 0) goto done;
    uint32_t nt;
    walk(ix, k.v, k.n, F_TIERS | F_SPEC, 1, &nt);
    keys_release(&k);
    uint32_t nw = ix->nworkers;
    uint32_t *depth = ix->scratch, *cpu = depth + nw, *disk = cpu + nw, *spec = disk + nw, *touched = spec + nw;
    for (Py_ssize_t i = 0; i < ns; i++) {
        uint32_t s = slots[i];
        int in = s < nw;
        cols[i] = in ? depth[s] : 0;
        cols[ns + i] = in ? cpu[s] : 0;
        cols[2 * ns + i] = in ? disk[s] : 0;
        cols[3 * ns + i] = in ? spec[s] : 0;
    }
    for (uint32_t i = 0; i < nt; i++) {
        uint32_t s = touched[i];
        depth[s] = cpu[s] = disk[s] = spec[s] = 0;
    }
    for (int c = 0; c < 4; c++) {
        lists[c] = PyList_New(ns);
        if (!lists[c]) goto done;
        for (Py_ssize_t i = 0; i < ns; i++) {
            PyObject *v = PyLong_FromUnsignedLong(cols[c * ns + i]);
            if (!v) goto done;
            PyList_SET_ITEM(lists[c], i, v);
        }
    }
    out = PyTuple_Pack(4, lists[0], lists[1], lists[2], lists[3]);
done:
    for (int c = 0; c < 4; c++) Py_XDECREF(lists[c]);
    PyMem_Free(slots);
    PyMem_Free(cols);
    Py_DECREF(seq);
    return out;
}

/* A set of the `n` keys (taking `keys` over). */
static PyObject *keys_to_set(uint64_t *keys, size_t n) {
    PyObject *set = PySet_New(NULL);
    for (size_t i = 0; set && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(keys[i]);
        if (!v || PySet_Add(set, v) < 0) Py_CLEAR(set);
        Py_XDECREF(v);
    }
    PyMem_Free(keys);
    return set;
}

static PyObject *Index_worker_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"worker", "tier"};
    PyObject *a[2];
    uint32_t slot;
    int tier;
    if (parse_args("worker_keys", args, nargs, kwnames, names, 2, 2, a) < 0) return NULL;
    if (parse_slot(a[0], &slot) < 0 || parse_tier(a[1], &tier) < 0) return NULL;
    Index *ix = IX(self);
    size_t n = 0;
    Worker *w = slot < ix->nworkers ? &ix->workers[slot] : NULL;
    uint64_t *keys = PyMem_Malloc((w && w->count[tier] ? w->count[tier] : 1) * sizeof(uint64_t));
    if (!keys) return PyErr_NoMemory();
    if (w && w->count[tier]) {
        uint32_t bit = TIER_FLAG(tier);
        for (size_t j = 0; j < ((size_t)1 << w->bits); j++) {
            uint32_t id = w->set[j];
            if (!id) continue;
            Rec *r = REC(ix, id);
            if (*find_holder(ix, r, slot) & bit) keys[n++] = r->key;
        }
    }
    return keys_to_set(keys, n);
}

static PyObject *Index_speculative_keys(PyObject *self, PyObject *worker) {
    uint32_t slot;
    if (parse_slot(worker, &slot) < 0) return NULL;
    Index *ix = IX(self);
    uint64_t *keys = PyMem_Malloc((ix->kused ? ix->kused : 1) * sizeof(uint64_t));
    if (!keys) return PyErr_NoMemory();
    size_t n = 0;
    for (size_t j = 0; j < ((size_t)1 << ix->kbits); j++) {
        uint32_t id = ix->kslots[j].rec;
        if (!id) continue;
        Rec *r = REC(ix, id);
        uint32_t *h = find_holder(ix, r, slot);
        if (h && (*h & F_SPEC)) keys[n++] = r->key;
    }
    return keys_to_set(keys, n);
}

static PyObject *Index_worker_block_count(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"worker", "tier"};
    PyObject *a[2];
    uint32_t slot;
    if (parse_args("worker_block_count", args, nargs, kwnames, names, 1, 2, a) < 0) return NULL;
    if (parse_slot(a[0], &slot) < 0) return NULL;
    Index *ix = IX(self);
    if (a[1] && a[1] != Py_None) {
        int tier;
        if (parse_tier(a[1], &tier) < 0) return NULL;
        return PyLong_FromUnsignedLongLong(slot < ix->nworkers ? ix->workers[slot].count[tier] : 0);
    }
    if (slot >= ix->nworkers) return PyLong_FromLong(0);
    Worker *w = &ix->workers[slot];
    return PyLong_FromUnsignedLongLong(w->count[0] + w->count[1] + w->count[2]);
}

static PyObject *Index_entry_count(PyObject *self, PyObject *unused) { return PyLong_FromUnsignedLongLong(IX(self)->entries); }

static PyObject *Index_estimated_bytes(PyObject *self, PyObject *unused) {
    return PyLong_FromSize_t(IX(self)->bytes + Py_TYPE(self)->tp_basicsize);
}

static PyObject *Index_evictions(PyObject *self, PyObject *worker) {
    uint32_t slot;
    if (parse_slot(worker, &slot) < 0) return NULL;
    Index *ix = IX(self);
    if (slot >= ix->nworkers || !ix->workers[slot].has_evicted) Py_RETURN_NONE;
    uint64_t *e = ix->workers[slot].evicted;
    return Py_BuildValue("(KKK)", (unsigned long long)e[0], (unsigned long long)e[1], (unsigned long long)e[2]);
}

static PyObject *Index_forget_evictions(PyObject *self, PyObject *worker) {
    uint32_t slot;
    if (parse_slot(worker, &slot) < 0) return NULL;
    forget_evictions(IX(self), slot);
    Py_RETURN_NONE;
}

static PyObject *Index_workers_with_evictions(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(IX(self)->workers_with_evictions);
}

static PyObject *Index_counters(PyObject *self, PyObject *unused) {
    Index *ix = IX(self);
    return Py_BuildValue("(KKK)", (unsigned long long)ix->ev_keys, (unsigned long long)ix->ev_entries,
                         (unsigned long long)ix->ev_recent);
}

static PyObject *Index_clock(PyObject *self, PyObject *unused) {
    Index *ix = IX(self);
    return Py_BuildValue("(KKK)", (unsigned long long)ix->ring_len, (unsigned long long)ix->departed,
                         (unsigned long long)ix->marked_now);
}

static PyObject *Index_new_lap(PyObject *self, PyObject *unused) {
    new_lap(IX(self));
    Py_RETURN_NONE;
}

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            PyErr_Format(PyExc_AssertionError, __VA_ARGS__);               \
            goto fail;                                                     \
        }                                                                  \
    } while (0)

/* Every invariant, O(size of the index): for tests. */
static PyObject *Index_check(PyObject *self, PyObject *unused) {
    Index *ix = IX(self);
    uint64_t *counts = PyMem_Calloc((size_t)ix->nworkers * 4 + 1, sizeof(uint64_t)); /* per slot: 3 tiers, set size */
    uint8_t *seen = NULL;
    if (!counts) return PyErr_NoMemory();
    uint64_t recs = 0, entries = 0, ringed = 0, departed = 0;
    for (size_t j = 0; j < ((size_t)1 << ix->kbits); j++) {
        uint32_t id = ix->kslots[j].rec;
        if (!id) continue;
        recs++;
        Rec *r = REC(ix, id);
        CHECK(ix->kslots[j].tag == key_tag(r->key), "tag of key %llu", (unsigned long long)r->key);
        CHECK(kfind(ix, r->key) == id, "key %llu not found from its home", (unsigned long long)r->key);
        uint32_t n, *p = holders(ix, r, &n);
        CHECK(r->h[0] & F_VALID || !r->h[0] || ix->vecs[r->h[1]]->len > 2, "a vec of %u holders", n);
        int has_entries = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t h = p[i], s = HSLOT(h);
            CHECK((h & F_VALID) && (h & (F_TIERS | F_SPEC)), "holder %u of key %llu", h, (unsigned long long)r->key);
            CHECK(i == 0 || HSLOT(p[i - 1]) < s, "holders out of order");
            CHECK(s < ix->nworkers, "holder slot %u beyond the workers", s);
            for (int t = 0; t < NTIERS; t++) counts[s * 4 + t] += (h & TIER_FLAG(t)) != 0;
            if (h & F_TIERS) {
                counts[s * 4 + 3]++;
                has_entries = 1;
                Worker *w = &ix->workers[s];
                CHECK(w->set, "worker %u holds keys but has no set", s);
                uint32_t mask = (1u << w->bits) - 1, i2 = wset_home(id, w->bits);
                while (w->set[i2] && w->set[i2] != id) i2 = (i2 + 1) & mask;
                CHECK(w->set[i2] == id, "key %llu missing from worker %u's set", (unsigned long long)r->key, s);
            }
        }
        if (ix->marks) {
            int ring = (*MARK(ix, id) & IN_RING) != 0;
            ringed += ring;
            CHECK(!has_entries || ring, "key %llu held but not in the clock", (unsigned long long)r->key);
            departed += ring && !has_entries;
            CHECK(n || ring, "a record with no holders outside the clock");
        } else {
            CHECK(n, "a record with no holders");
        }
    }
    CHECK(recs == ix->kused, "%llu records, kused %llu", (unsigned long long)recs, (unsigned long long)ix->kused);
    for (uint32_t s = 0; s < ix->nworkers; s++) {
        Worker *w = &ix->workers[s];
        for (int t = 0; t < NTIERS; t++) {
            CHECK(counts[s * 4 + t] == w->count[t], "worker %u tier %d: %llu entries, count %llu", s, t,
                  (unsigned long long)counts[s * 4 + t], (unsigned long long)w->count[t]);
            entries += w->count[t];
        }
        CHECK(counts[s * 4 + 3] == w->used, "worker %u: set of %u, %llu keys held", s, w->used,
              (unsigned long long)counts[s * 4 + 3]);
    }
    CHECK(entries == ix->entries, "entries %llu, counted %llu", (unsigned long long)ix->entries, (unsigned long long)entries);
    /* what every structure holds, against what the allocation counter says */
    size_t recs_held = 0;
    for (uint32_t c = 0; c < ix->nchunks; c++) recs_held += chunk_recs(ix, c);
    size_t bytes = ((size_t)1 << ix->kbits) * sizeof(KSlot) + ix->chunks_cap * sizeof(Rec *) +
                   recs_held * sizeof(Rec) + ix->vecs_cap * sizeof(HVec *) +
                   ix->vec_free_cap * sizeof(uint32_t) + ix->nworkers * (sizeof(Worker) + 5 * sizeof(uint32_t)) +
                   ix->ring_cap * sizeof(uint32_t);
    if (ix->marks) bytes += ix->chunks_cap * sizeof(uint32_t *) + recs_held * sizeof(uint32_t);
    for (uint32_t v = 0; v < ix->nvecs; v++)
        if (ix->vecs[v]) bytes += sizeof(HVec) + ix->vecs[v]->cap * sizeof(uint32_t);
    for (uint32_t s = 0; s < ix->nworkers; s++)
        if (ix->workers[s].set) bytes += ((size_t)1 << ix->workers[s].bits) * sizeof(uint32_t);
    CHECK(bytes == ix->bytes, "%zu bytes held, %zu counted", bytes, ix->bytes);
    for (uint32_t s = 0; s < 4 * ix->nworkers; s++) CHECK(!ix->scratch[s], "scratch left dirty");
    if (ix->marks) {
        CHECK(ringed == ix->ring_len, "%llu keys flagged in the clock, ring of %llu", (unsigned long long)ringed,
              (unsigned long long)ix->ring_len);
        CHECK(departed == ix->departed, "%llu departed, counted %llu", (unsigned long long)departed,
              (unsigned long long)ix->departed);
        seen = PyMem_Calloc((size_t)ix->rec_top + 1, 1);
        if (!seen) {
            PyMem_Free(counts);
            return PyErr_NoMemory();
        }
        for (uint64_t i = 0; i < ix->ring_len; i++) {
            uint32_t id = ix->ring[(ix->ring_head + i) & (ix->ring_cap - 1)];
            CHECK(id && id < ix->rec_top && !seen[id], "ring entry %u twice or invalid", id);
            seen[id] = 1;
            CHECK(*MARK(ix, id) & IN_RING, "ring entry %u not flagged", id);
        }
        CHECK(ix->entries <= ix->max_entries, "over the bound");
    }
    PyMem_Free(counts);
    PyMem_Free(seen);
    Py_RETURN_NONE;
fail:
    PyMem_Free(counts);
    PyMem_Free(seen);
    return NULL;
}

static PyObject *Index_get_max_entries(PyObject *self, void *closure) {
    return PyLong_FromUnsignedLongLong(IX(self)->max_entries);
}

#define FAST (METH_FASTCALL | METH_KEYWORDS)

static PyMethodDef Index_methods[] = {
    {"store", (PyCFunction)(void (*)(void))Index_store, FAST,
     "store(worker, keys, tier=GPU) -> int: entries new on that tier"},
    {"remove", (PyCFunction)(void (*)(void))Index_remove, FAST,
     "remove(worker, keys, tier=GPU) -> int: entries that were there"},
    {"replace", (PyCFunction)(void (*)(void))Index_replace, FAST,
     "replace(worker, keys, tier=GPU): make keys exactly what worker holds on tier"},
    {"speculate", (PyCFunction)(void (*)(void))Index_speculate, FAST, "speculate(worker, keys): unconfirmed claims"},
    {"unspeculate", (PyCFunction)(void (*)(void))Index_unspeculate, FAST, "unspeculate(worker, keys)"},
    {"held_prefix", (PyCFunction)(void (*)(void))Index_held_prefix, FAST,
     "held_prefix(worker, keys) -> int: leading keys held on any tier"},
    {"clear", Index_clear, METH_O, "clear(worker) -> int: entries dropped (claims stay)"},
    {"match", Index_match, METH_O, "match(keys) -> {slot: depth}"},
    {"_match_tiers", Index_match_tiers_raw, METH_O, "(depth, cpu, disk, speculative) dicts of match_tiers"},
    {"match_columns", (PyCFunction)(void (*)(void))Index_match_columns, METH_FASTCALL,
     "match_columns(keys, slots) -> (depth, cpu, disk, speculative) lists in the order of slots"},
    {"worker_keys", (PyCFunction)(void (*)(void))Index_worker_keys, FAST, "worker_keys(worker, tier) -> set"},
    {"speculative_keys", Index_speculative_keys, METH_O, "speculative_keys(worker) -> set (O(keys): tests)"},
    {"worker_block_count", (PyCFunction)(void (*)(void))Index_worker_block_count, FAST,
     "worker_block_count(worker, tier=None) -> int"},
    {"entry_count", Index_entry_count, METH_NOARGS, "(key, worker, tier) entries held"},
    {"estimated_bytes", Index_estimated_bytes, METH_NOARGS, "bytes the index allocated, exactly"},
    {"_evictions", Index_evictions, METH_O, "(gpu, cpu, disk) entries dropped for the bound, or None"},
    {"_forget_evictions", Index_forget_evictions, METH_O, "a snapshot: the worker's dropped entries are known again"},
    {"workers_with_evictions", Index_workers_with_evictions, METH_NOARGS, "workers with entries dropped for the bound"},
    {"_counters", Index_counters, METH_NOARGS, "(keys, entries, recently matched entries) dropped for the bound"},
    {"_clock", Index_clock, METH_NOARGS, "(keys in the clock, of which departed, marked this lap)"},
    {"_new_lap", Index_new_lap, METH_NOARGS, "start a new lap of the clock (benches)"},
    {"_check", Index_check, METH_NOARGS, "raise AssertionError unless every invariant holds (tests)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Index_getset[] = {
    {"max_entries", Index_get_max_entries, NULL, "the bound on entries; 0 = unbounded", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvroute.prefix_index._native.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Index(max_entries=0): the prefix index in C (see kvroute.prefix_index.native)",
    .tp_new = Index_new,
    .tp_dealloc = Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The prefix index's data structure in C (kvroute.prefix_index.native).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&IndexType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(&IndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
