/* The shm channel's chunk ring: fixed slots in `.ring`, a file every handle of the namespace
 * maps shared, where a chunk small enough is published and taken without a system call or a
 * lock another process can hold (`prefix_cache.channel.shm` documents where it fits).
 *
 * `.ring` is a RingHeader (`_shm.h`), then `slot_count` slots of `slot_bytes`, each a
 * SlotHeader and its payload. A slot's `word` (state, generation, writer) is the only field
 * two processes race on; every change of it is a compare-and-swap, and every other field is
 * written only by the one process that holds the slot in WRITING or TAKEN:
 *
 *     FREE(g) --writer--> WRITING(g+1, producer) --writer--> READY(g+1)
 *     READY(g) --reader--> TAKEN(g) --reader--> FREE(g)
 *     READY(g) --anyone, expired--> FREE(g);  TAKEN(g) --sweep, held past the ttl--> FREE(g)
 *     WRITING(g, producer) --sweep, once that producer is found dead--> FREE(g)
 *
 * A slot's payload changes only in WRITING, and only a writer's claim moves the generation, so
 * a reader that copied a slot out while it held it TAKEN(g) knows its copy is whole if the word
 * still reads TAKEN(g) or FREE(g) afterwards: a sweep that took the slot from a reader stopped
 * past the ttl makes that reader's copy fail, never another request's rows. A writer is never
 * cut off while it lives (the sweep frees a WRITING slot only once the producer number in its
 * word names no live producer), so no write lands in a slot someone else holds.
 *
 * Readers block on the header's `published` futex word, which every publish of the namespace
 * bumps (a slot's here, a file's in `_shm.c`); the publisher makes the wake system call only
 * while a reader waits.
 */
#include "_shm.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define RING_MAGIC 0x01474e495243504fULL  /* "OPCRING\x01", little endian */

enum { FREE = 0, WRITING = 1, READY = 2, TAKEN = 3 };

/* A slot's header; its payload follows (`slot_bytes - sizeof(SlotHeader)` bytes). */
typedef struct {
    uint64_t word;  /* atomic: producer << 32 | generation << 2 | state */
    uint64_t seq;  /* the entry's number in the namespace */
    uint64_t nbytes;  /* of the payload */
    double published_at;  /* time.time() */
    double claimed_at;  /* time.time() its writer or reader took it */
    unsigned char name[32];  /* the id's name in the namespace (its MAC) */
    unsigned char reserved[56];
} SlotHeader;

_Static_assert(sizeof(RingHeader) == 64, "the ring's header is 64 bytes");
_Static_assert(sizeof(SlotHeader) == 128, "a slot's header is 128 bytes");

#define STATE(w) ((unsigned)((w) & 3u))
#define GEN(w) ((uint32_t)(((w) >> 2) & 0x3fffffffu))
#define PRODUCER(w) ((uint32_t)((w) >> 32))

static uint64_t
make_word(uint32_t producer, uint32_t gen, unsigned state)
{
    return (uint64_t)producer << 32 | (uint64_t)(gen & 0x3fffffffu) << 2 | state;
}

static SlotHeader *
slot_at(RingHeader *ring, uint32_t i)
{
    return (SlotHeader *)((char *)ring + sizeof *ring + (size_t)i * ring->slot_bytes);
}

static size_t
payload_bytes(const RingHeader *ring)
{
    return ring->slot_bytes - sizeof(SlotHeader);
}

static uint64_t
load_word(const SlotHeader *s)
{
    return __atomic_load_n(&s->word, __ATOMIC_ACQUIRE);
}

static int
swap_word(SlotHeader *s, uint64_t expected, uint64_t desired)
{
    return __atomic_compare_exchange_n(&s->word, &expected, desired, 0, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
}

static double
wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int
borrow_ring(PyObject *obj, Py_buffer *view, RingHeader **ring)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) {
        return -1;
    }
    RingHeader *r = view->buf;
    if ((size_t)view->len < sizeof *r || r->magic != RING_MAGIC || r->slot_bytes % 64 ||
            (r->slot_count && r->slot_bytes <= sizeof(SlotHeader)) ||
            (size_t)view->len != sizeof *r + (size_t)r->slot_count * r->slot_bytes) {
        PyErr_Format(PyExc_ValueError, "not a chunk ring of this version (%zd bytes)",
                     view->len);
        PyBuffer_Release(view);
        return -1;
    }
    *ring = r;
    return 0;
}

uint64_t
ring_take_seq(RingHeader *ring)
{
    return __atomic_fetch_add(&ring->next_seq, 1, __ATOMIC_ACQ_REL);
}

void
ring_notify(RingHeader *ring)
{
    __atomic_fetch_add(&ring->published, 1, __ATOMIC_ACQ_REL);
    if (__atomic_load_n(&ring->waiters, __ATOMIC_ACQUIRE) > 0) {
        syscall(SYS_futex, &ring->published, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    }
}

/* `p`'s pieces laid into `dst` (zeros between them): 0, or -1 where a piece runs past
 * `nbytes` (then `dst` holds a part of them). */
static int
copy_pieces(char *dst, size_t nbytes, const Pieces *p)
{
    memset(dst, 0, nbytes);
    for (Py_ssize_t i = 0; i < p->n; i++) {
        const Py_buffer *b = &p->bufs[i];
        size_t at = (size_t)p->offsets[i];
        if (p->slots[i].obj == NULL) {
            if (at > nbytes || (size_t)b->len > nbytes - at) {
                return -1;
            }
            memcpy(dst + at, b->buf, (size_t)b->len);
            continue;
        }
        size_t row_bytes = (size_t)(b->shape[1] * b->itemsize);
        const int64_t *slot = p->slots[i].buf;
        Py_ssize_t rows = p->slots[i].shape[0];
        if (at > nbytes || (size_t)rows * row_bytes > nbytes - at) {
            return -1;
        }
        for (Py_ssize_t r = 0; r < rows; r++, at += row_bytes) {
            if (slot[r] >= 0) {
                memcpy(dst + at, (const char *)b->buf + (size_t)slot[r] * row_bytes, row_bytes);
            }
        }
    }
    return 0;
}

/* A free slot taken for `producer` (WRITING), or NULL where every slot is held. */
static SlotHeader *
claim_free(RingHeader *ring, uint32_t producer)
{
    uint32_t start = __atomic_fetch_add(&ring->next_slot, 1, __ATOMIC_RELAXED);
    for (uint32_t k = 0; k < ring->slot_count; k++) {
        SlotHeader *s = slot_at(ring, (start + k) % ring->slot_count);
        uint64_t w = load_word(s);
        if (STATE(w) == FREE && swap_word(s, w, make_word(producer, GEN(w) + 1, WRITING))) {
            return s;
        }
    }
    return NULL;
}

/* One entry of ring_put_all's, borrowed with the GIL held. */
typedef struct {
    PyObject *refused;  /* the exception that refused it, or NULL */
    Py_buffer name;
    unsigned long long nbytes;
    Pieces pieces;
    long long seq;  /* its number once published; -1: no slot took it */
    int misplaced;  /* a piece ran past its bytes: nothing published */
} RingPut;

static void
release_ring_put(RingPut *p)
{
    if (p->name.obj != NULL) {
        PyBuffer_Release(&p->name);
    }
    release_pieces(&p->pieces);
    Py_CLEAR(p->refused);
}

/* Entry `item`: (name, nbytes, pieces); -1 where it is no such tuple (an error set). */
static int
borrow_ring_put(PyObject *item, RingPut *p)
{
    PyObject *name, *pieces;
    if (!PyArg_ParseTuple(item, "OKO:ring_put_all", &name, &p->nbytes, &pieces)) {
        return -1;
    }
    if (PyObject_GetBuffer(name, &p->name, PyBUF_SIMPLE) < 0) {
        p->refused = fetch_error();
        return 0;
    }
    if (p->name.len != 32) {
        PyErr_Format(PyExc_ValueError, "ring_put_all: a name is 32 bytes, got %zd", p->name.len);
        p->refused = fetch_error();
    } else if (borrow_pieces("ring_put_all", pieces, &p->pieces) < 0) {
        p->refused = fetch_error();
    }
    return 0;
}

/* `p` into a free slot, published: its number, or -1 where no slot is free or it is too big. */
static void
put_one(RingHeader *ring, uint32_t producer, RingPut *p)
{
    p->seq = -1;
    if (p->nbytes > payload_bytes(ring)) {
        return;
    }
    SlotHeader *s = claim_free(ring, producer);
    if (s == NULL) {
        return;
    }
    uint64_t held = load_word(s);
    s->claimed_at = wall_now();
    if (copy_pieces((char *)(s + 1), p->nbytes, &p->pieces) < 0) {
        p->misplaced = 1;
        swap_word(s, held, make_word(0, GEN(held), FREE));
        return;
    }
    memcpy(s->name, p->name.buf, 32);
    s->nbytes = p->nbytes;
    s->seq = ring_take_seq(ring);
    s->published_at = wall_now();
    p->seq = (long long)s->seq;
    __atomic_store_n(&s->word, make_word(0, GEN(held), READY), __ATOMIC_RELEASE);
}

PyDoc_STRVAR(ring_put_all_doc,
"ring_put_all(ring, producer, entries) -> list\n\n"
"Publish each of `entries`, a tuple (name, nbytes, pieces) as `put_all` takes them, into a\n"
"free slot of `ring` (the mapped `.ring`) written by `producer` (its number), with no system\n"
"call but one futex wake where a reader waits. Returns, per entry in order, its number in the\n"
"namespace; -1 where no slot took it (every slot held, or it is bigger than a slot's\n"
"payload): nothing changed for it; or the exception that refused it, not raised.");

static PyObject *
ring_put_all(PyObject *self, PyObject *args)
{
    PyObject *ring_obj, *entries;
    unsigned int producer;
    if (!PyArg_ParseTuple(args, "OIO:ring_put_all", &ring_obj, &producer, &entries)) {
        return NULL;
    }
    Py_buffer view;
    RingHeader *ring;
    if (borrow_ring(ring_obj, &view, &ring) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *seq = PySequence_Fast(entries, "ring_put_all: entries must be "
                                                    "a sequence of tuples");
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 0, borrowed = 0;
    RingPut *puts = seq ? PyMem_Calloc((size_t)(n ? n : 1), sizeof *puts) : NULL;
    if (seq != NULL && puts == NULL) {
        PyErr_NoMemory();
    }
    if (puts == NULL) {
        goto done;
    }
    for (; borrowed < n; borrowed++) {
        if (borrow_ring_put(PySequence_Fast_GET_ITEM(seq, borrowed), &puts[borrowed]) < 0) {
            borrowed++;
            goto done;
        }
    }
    int published = 0;
    for (Py_ssize_t i = 0; i < n; i++) {  /* memory alone: the GIL is not worth a hand-over */
        if (puts[i].refused == NULL) {
            put_one(ring, producer, &puts[i]);
            published |= puts[i].seq >= 0;
        }
    }
    if (published) {
        ring_notify(ring);
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        RingPut *p = &puts[i];
        PyObject *item = p->refused ? Py_NewRef(p->refused)
            : p->misplaced ? PyObject_CallFunction(PyExc_ValueError, "s",
                                                   "a piece runs past the entry's bytes")
            : PyLong_FromLongLong(p->seq);
        if (item == NULL) {
            Py_CLEAR(result);
        } else {
            PyList_SET_ITEM(result, i, item);
        }
    }
done:
    for (Py_ssize_t i = 0; i < borrowed; i++) {
        release_ring_put(&puts[i]);
    }
    PyMem_Free(puts);
    Py_XDECREF(seq);
    PyBuffer_Release(&view);
    return result;
}

/* A READY slot of `name` seen whole (its word read again after its fields); `at`: its prefix's
 * place among ring_find's. */
typedef struct {
    uint64_t seq, word;
    uint32_t slot, at;
} Found;

static int
by_seq(const void *a, const void *b)
{
    uint64_t x = ((const Found *)a)->seq, y = ((const Found *)b)->seq;
    return (x > y) - (x < y);
}

PyDoc_STRVAR(ring_find_doc,
"ring_find(ring, name, expired_before, prefix_bytes) -> list\n\n"
"The published slots of the id named `name` (32 bytes), oldest first: a tuple (seq, slot,\n"
"word, prefix) each, `prefix` the payload's first `prefix_bytes`; those published before\n"
"`expired_before` (time.time()) are freed instead. A tuple names the slot as it was: take it\n"
"with ring_claim(ring, slot, word).");

static PyObject *
ring_find(PyObject *self, PyObject *args)
{
    PyObject *ring_obj;
    Py_buffer name;
    double expired_before;
    Py_ssize_t prefix_bytes;
    if (!PyArg_ParseTuple(args, "Oy*dn:ring_find", &ring_obj, &name, &expired_before,
                          &prefix_bytes)) {
        return NULL;
    }
    Py_buffer view;
    RingHeader *ring;
    if (name.len != 32 || prefix_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "ring_find: a name is 32 bytes; prefix_bytes >= 0");
        PyBuffer_Release(&name);
        return NULL;
    }
    if (borrow_ring(ring_obj, &view, &ring) < 0) {
        PyBuffer_Release(&name);
        return NULL;
    }
    PyObject *result = NULL;
    size_t slots = ring->slot_count ? ring->slot_count : 1;
    Found *found = PyMem_Malloc(sizeof *found * slots);
    char *prefixes = PyMem_Malloc((size_t)prefix_bytes * slots + 1);
    if (ring->slot_count && (size_t)prefix_bytes > payload_bytes(ring)) {
        PyErr_SetString(PyExc_ValueError, "ring_find: prefix_bytes exceeds a slot's payload");
        goto done;
    }
    if (found == NULL || prefixes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < ring->slot_count; i++) {
        SlotHeader *s = slot_at(ring, i);
        uint64_t w = load_word(s);
        if (STATE(w) != READY || memcmp(s->name, name.buf, 32) != 0) {
            continue;
        }
        uint64_t seq = s->seq;
        double published_at = s->published_at;
        memcpy(prefixes + (size_t)n * (size_t)prefix_bytes, s + 1, (size_t)prefix_bytes);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (load_word(s) != w) {
            continue;  /* taken or reused while read: what was read is not its */
        }
        if (published_at < expired_before) {
            swap_word(s, w, make_word(0, GEN(w), FREE));
            continue;
        }
        found[n] = (Found){seq, w, i, n};
        n++;
    }
    qsort(found, n, sizeof *found, by_seq);
    result = PyList_New(n);
    for (uint32_t i = 0; result != NULL && i < n; i++) {
        const Found *f = &found[i];
        PyObject *item = Py_BuildValue(
            "KIKy#", (unsigned long long)f->seq, f->slot, (unsigned long long)f->word,
            prefixes + (size_t)f->at * (size_t)prefix_bytes, prefix_bytes);
        if (item == NULL) {
            Py_CLEAR(result);
        } else {
            PyList_SET_ITEM(result, i, item);
        }
    }
done:
    PyMem_Free(found);
    PyMem_Free(prefixes);
    PyBuffer_Release(&view);
    PyBuffer_Release(&name);
    return result;
}

/* A slot call's arguments (ring, slot, word), parsed by `format`: the slot, its ring borrowed
 * into `view` (the caller releases it), and its word in `word`; NULL with an error set and
 * nothing borrowed. */
static SlotHeader *
borrow_slot(PyObject *args, const char *format, Py_buffer *view, unsigned long long *word)
{
    PyObject *ring_obj;
    unsigned int slot;
    RingHeader *ring;
    if (!PyArg_ParseTuple(args, format, &ring_obj, &slot, word) ||
            borrow_ring(ring_obj, view, &ring) < 0) {
        return NULL;
    }
    if (slot >= ring->slot_count) {
        PyErr_Format(PyExc_IndexError, "slot %u of a ring of %u", slot, ring->slot_count);
        PyBuffer_Release(view);
        return NULL;
    }
    return slot_at(ring, slot);
}

PyDoc_STRVAR(ring_claim_doc,
"ring_claim(ring, slot, word) -> int\n\n"
"Take the published slot `slot` for reading if its word is still `word` (as ring_find saw\n"
"it): the word it holds it by (TAKEN), to pass to ring_copy_out; -1 where someone took it\n"
"first or it changed.");

static PyObject *
ring_claim(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long long word;
    SlotHeader *s = borrow_slot(args, "OIK:ring_claim", &view, &word);
    if (s == NULL) {
        return NULL;
    }
    uint64_t taken = make_word(0, GEN(word), TAKEN);
    int won = STATE(word) == READY && swap_word(s, word, taken);
    if (won) {
        s->claimed_at = wall_now();
    }
    PyBuffer_Release(&view);
    return PyLong_FromLongLong(won ? (long long)taken : -1);
}

PyDoc_STRVAR(ring_copy_out_doc,
"ring_copy_out(ring, slot, taken) -> bytearray | None\n\n"
"The payload of the slot this reader took (`taken`, what ring_claim returned), copied out;\n"
"then the slot is free. None where the slot was taken from this reader and written again\n"
"meanwhile (a sweep frees a slot held past the ttl): the copy is not the entry's.");

static PyObject *
ring_copy_out(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long long taken;
    SlotHeader *s = borrow_slot(args, "OIK:ring_copy_out", &view, &taken);
    if (s == NULL) {
        return NULL;
    }
    const RingHeader *ring = view.buf;
    size_t nbytes = s->nbytes < payload_bytes(ring) ? s->nbytes : payload_bytes(ring);
    PyObject *result = PyByteArray_FromStringAndSize((const char *)(s + 1), (Py_ssize_t)nbytes);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t freed = make_word(0, GEN(taken), FREE);
    if (!swap_word(s, taken, freed) && load_word(s) != freed) {
        Py_XDECREF(result);  /* written again since it was taken: not the entry's bytes */
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(ring_slots_doc,
"ring_slots(ring) -> list\n\n"
"Every slot not free: a tuple (slot, word, state, producer, seq, nbytes, published_at,\n"
"claimed_at) each, state 1 writing, 2 published, 3 taken by a reader; the fields as read,\n"
"which a slot in use may change meanwhile (for sweeps and counts).");

static PyObject *
ring_slots(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    RingHeader *ring;
    if (borrow_ring(arg, &view, &ring) < 0) {
        return NULL;
    }
    PyObject *result = PyList_New(0);
    for (uint32_t i = 0; result != NULL && i < ring->slot_count; i++) {
        SlotHeader *s = slot_at(ring, i);
        uint64_t w = load_word(s);
        if (STATE(w) == FREE) {
            continue;
        }
        PyObject *item = Py_BuildValue("IKIIKKdd", i, (unsigned long long)w, STATE(w),
                                       PRODUCER(w), (unsigned long long)s->seq,
                                       (unsigned long long)s->nbytes, s->published_at,
                                       s->claimed_at);
        if (item == NULL || PyList_Append(result, item) < 0) {
            Py_CLEAR(result);
        }
        Py_XDECREF(item);
    }
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(ring_release_doc,
"ring_release(ring, slot, word) -> bool\n\n"
"Free the slot if its word is still `word` (a sweep's: an expired entry, a reader's slot held\n"
"past the ttl, a dead producer's half-written one); whether it did.");

static PyObject *
ring_release(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long long word;
    SlotHeader *s = borrow_slot(args, "OIK:ring_release", &view, &word);
    if (s == NULL) {
        return NULL;
    }
    int freed = STATE(word) != FREE && swap_word(s, word, make_word(0, GEN(word), FREE));
    PyBuffer_Release(&view);
    return PyBool_FromLong(freed);
}

PyDoc_STRVAR(ring_wait_doc,
"ring_wait(ring, seen, timeout_s) -> int\n\n"
"Block (the GIL released) until the namespace's publish count is no longer `seen`, or\n"
"`timeout_s` passes, or a signal; returns the count then. ring_wait(ring, -1, 0) reads it.");

static PyObject *
ring_wait(PyObject *self, PyObject *args)
{
    PyObject *ring_obj;
    long long seen;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "OLd:ring_wait", &ring_obj, &seen, &timeout_s)) {
        return NULL;
    }
    Py_buffer view;
    RingHeader *ring;
    if (borrow_ring(ring_obj, &view, &ring) < 0) {
        return NULL;
    }
    uint32_t now = __atomic_load_n(&ring->published, __ATOMIC_ACQUIRE);
    if (seen >= 0 && (uint32_t)seen == now && timeout_s > 0) {
        struct timespec ts = {(time_t)timeout_s,
                              (long)((timeout_s - (double)(time_t)timeout_s) * 1e9)};
        Py_BEGIN_ALLOW_THREADS
        __atomic_fetch_add(&ring->waiters, 1, __ATOMIC_ACQ_REL);
        syscall(SYS_futex, &ring->published, FUTEX_WAIT, now, &ts, NULL, 0);
        __atomic_fetch_sub(&ring->waiters, 1, __ATOMIC_ACQ_REL);
        Py_END_ALLOW_THREADS
        now = __atomic_load_n(&ring->published, __ATOMIC_ACQUIRE);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(now);
}

PyDoc_STRVAR(ring_next_seq_doc,
"ring_next_seq(ring) -> int\n\n"
"The number the namespace's next entry gets: every file numbered below it is in place once\n"
"the namespace lock is held.");

static PyObject *
ring_next_seq(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    RingHeader *ring;
    if (borrow_ring(arg, &view, &ring) < 0) {
        return NULL;
    }
    uint64_t next = __atomic_load_n(&ring->next_seq, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(next);
}

PyDoc_STRVAR(ring_new_producer_doc,
"ring_new_producer(ring) -> int\n\n"
"A number for a new producer of the namespace (never 0), unique in it: the writer a slot's\n"
"word names.");

static PyObject *
ring_new_producer(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    RingHeader *ring;
    if (borrow_ring(arg, &view, &ring) < 0) {
        return NULL;
    }
    uint32_t number = __atomic_add_fetch(&ring->next_producer, 1, __ATOMIC_ACQ_REL);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(number);
}

PyMethodDef ring_methods[] = {
    {"ring_put_all", ring_put_all, METH_VARARGS, ring_put_all_doc},
    {"ring_find", ring_find, METH_VARARGS, ring_find_doc},
    {"ring_claim", ring_claim, METH_VARARGS, ring_claim_doc},
    {"ring_copy_out", ring_copy_out, METH_VARARGS, ring_copy_out_doc},
    {"ring_slots", ring_slots, METH_O, ring_slots_doc},
    {"ring_release", ring_release, METH_VARARGS, ring_release_doc},
    {"ring_wait", ring_wait, METH_VARARGS, ring_wait_doc},
    {"ring_next_seq", ring_next_seq, METH_O, ring_next_seq_doc},
    {"ring_new_producer", ring_new_producer, METH_O, ring_new_producer_doc},
    {NULL, NULL, 0, NULL},
};
