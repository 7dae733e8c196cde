/* What the two files of prefix_cache.channel._shm share: an entry's pieces (`_shm.c`) and the
 * namespace's chunk ring (`_ring.c`). */
#ifndef PREFIX_CACHE_CHANNEL_SHM_H
#define PREFIX_CACHE_CHANNEL_SHM_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <sys/types.h>

/* An entry's pieces, borrowed until release_pieces: each is bytes written at its offset, or
 * rows of a pool (`slots[i].obj` set) laid end to end from its offset. */
typedef struct {
    Py_buffer *bufs;  /* the bytes, or the pool's [slots, row bytes] rows */
    Py_buffer *slots;  /* a pool piece's int64 slots */
    off_t *offsets;
    Py_ssize_t n;
} Pieces;

/* `obj`'s pieces, checked with the GIL held (`fn` names the caller in errors); 0, or -1 with
 * an error set and nothing borrowed. */
int borrow_pieces(const char *fn, PyObject *obj, Pieces *p);
void release_pieces(Pieces *p);

/* The exception set, taken (its traceback kept on it) to hand back unraised. */
PyObject *fetch_error(void);

/* The ring's header, at the start of `.ring` (see `_ring.c`). */
typedef struct {
    uint64_t magic;
    uint32_t slot_count;
    uint32_t slot_bytes;  /* a slot's bytes, its header included */
    uint64_t next_seq;  /* atomic: the number the namespace's next entry gets, file or slot */
    uint32_t published;  /* atomic, a futex word: bumped by every publish of the namespace */
    uint32_t waiters;  /* atomic: readers blocked on `published` */
    uint32_t next_slot;  /* atomic: where a writer's search for a free slot starts */
    uint32_t next_producer;  /* atomic: the number the next producer registered gets */
    unsigned char reserved[24];
} RingHeader;

/* A borrowed writable mapping of `.ring`, its header checked; 0, or -1 with an error set. */
int borrow_ring(PyObject *obj, Py_buffer *view, RingHeader **ring);

/* The next entry number of the namespace (files and slots share one sequence). */
uint64_t ring_take_seq(RingHeader *ring);

/* Tell readers waiting on the ring that the namespace has a new entry (a futex wake only
 * where one waits). */
void ring_notify(RingHeader *ring);

extern PyMethodDef ring_methods[];  /* NULL-terminated; `_shm.c` adds them to the module */

#endif
