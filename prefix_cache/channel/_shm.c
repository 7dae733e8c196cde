/* prefix_cache.channel._shm: the shm channel's put and expectation steps, each one call that
 * makes all its system calls with the GIL released.
 *
 * A put made of Python calls gives the GIL up at each of its twenty-odd system calls (flock,
 * open, fchmod, ftruncate, pread and pwrite of the budget, pwrite of the entry, rename, the
 * expectation's read and unlink) and takes it back after each: on an engine's output thread,
 * every one of those hand-overs makes the engine thread wait for the GIL again. Here puts
 * are one call (`put_all`) where the namespace has room, however many entries they are (a
 * streaming step's chunks: the budget read and written twice for all of them, under the
 * namespace lock the caller took first), three (`reserve`, `write`, `publish`) for an entry
 * that waits for room, and a step's expectations one. The protocol is the one
 * `prefix_cache.channel.shm` documents; its Python keeps the rare paths (a full namespace's
 * recount, sweeps, takes). The caller holds
 * the namespace lock around `put_all`, and the handle's thread lock around the others, which
 * lock the handle's shared descriptor themselves (all but `write`).
 *
 * An entry's rows may be a pool's, named by slot (`write`): they go from the pool into the
 * entry's file by pwritev, one copy, with no gathered copy between.
 *
 * Entry files are numbered from the namespace's chunk ring (`_ring.c`, whose slots share the
 * sequence), and every publish wakes the readers waiting on the ring.
 *
 * Errors raise OSError (its errno's subclass) naming the file (`put_all` returns each entry's
 * instead, the others going on); a call that fails leaves no file of its own behind and
 * releases the namespace lock.
 */
#include "_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <stdatomic.h>
#include <unistd.h>

/* Crash tests only (tests/test_channel_shm_crash.py kills a process before each system call of
 * a put or a take): every open, close, flock, fchmod, ftruncate, pwritev, rename and unlink here
 * is a step; `die_before_step(n)` makes the process exit, status 1, just before the n-th step
 * from then on, and `steps()` counts the steps made. */
static atomic_long steps_made, die_at;

static void
step(void)
{
    long made = atomic_fetch_add(&steps_made, 1) + 1;
    if (made == atomic_load(&die_at)) {
        _exit(1);
    }
}

#define STEP(call) (step(), (call))

/* `.budget`: two little-endian u64, the files' capacity and the bytes they use. */
typedef struct {
    uint64_t capacity, used;
} Budget;

static uint64_t
load_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

static void
store_le64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

/* 0, or -1 with errno set (a short budget file reads as EIO). */
static int
read_budget(int fd, Budget *b)
{
    unsigned char raw[16];
    ssize_t got;
    do {
        got = pread(fd, raw, sizeof raw, 0);
    } while (got < 0 && errno == EINTR);
    if (got != (ssize_t)sizeof raw) {
        if (got >= 0) {
            errno = EIO;
        }
        return -1;
    }
    b->capacity = load_le64(raw);
    b->used = load_le64(raw + 8);
    return 0;
}

/* `iov[0..k)` in full at `at`, resuming after a short write; 0, or -1 with errno set. */
static int
writev_all(int fd, struct iovec *iov, int k, off_t at)
{
    while (k > 0) {
        ssize_t put = STEP(pwritev(fd, iov, k, at));
        if (put < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        at += put;
        for (; k > 0 && (size_t)put >= iov->iov_len; iov++, k--) {
            put -= (ssize_t)iov->iov_len;
        }
        if (k > 0) {
            iov->iov_base = (char *)iov->iov_base + put;
            iov->iov_len -= (size_t)put;
        }
    }
    return 0;
}

/* `n` bytes of `data` in full at `offset`; 0, or -1 with errno set. */
static int
write_all(int fd, const char *data, size_t n, off_t offset)
{
    struct iovec one = {(void *)data, n};
    return writev_all(fd, &one, 1, offset);
}

static int
write_budget(int fd, const Budget *b)
{
    unsigned char raw[16];
    store_le64(raw, b->capacity);
    store_le64(raw + 8, b->used);
    return write_all(fd, (const char *)raw, sizeof raw, 0);
}

static int
lock(int fd, int op)
{
    int rc;
    step();
    do {
        rc = flock(fd, op);
    } while (rc < 0 && errno == EINTR);
    return rc;
}

/* A new file at `path` open for writing, mode exactly 0600 (`exclusive`: refused if one is
 * there; else one left there is truncated and taken over), as `_create_private_file`. */
static int
create_private(const char *path, int exclusive)
{
    int fd = STEP(open(path, O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC |
                       (exclusive ? O_EXCL : O_TRUNC), 0600));
    if (fd >= 0 && STEP(fchmod(fd, 0600)) < 0) {  /* the file is this call's: none is left */
        int err = errno;
        STEP(close(fd));
        STEP(unlink(path));
        errno = err;
        return -1;
    }
    return fd;
}

/* Raise OSError for `err` naming `path` (NULL: none); returns NULL. */
static PyObject *
raise_errno(int err, const char *path)
{
    errno = err;
    return path ? PyErr_SetFromErrnoWithFilename(PyExc_OSError, path)
                : PyErr_SetFromErrno(PyExc_OSError);
}

static int
fs_path(PyObject *obj, PyObject **out)
{
    return PyUnicode_FSConverter(obj, out);  /* a new bytes object, or 0 with an error set */
}

PyObject *
fetch_error(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value;
}

#define ROW_RUNS 1024  /* iovecs a pwritev takes (Linux's IOV_MAX) */

/* Rows `slots[0..n)` of the rows of `row_bytes` at `pool`, laid end to end in `fd` from
 * `offset`; a slot of -1 leaves its row as the file has it (zeros). Each run of consecutive
 * slots is one iovec, and up to ROW_RUNS runs of rows adjacent in the file one pwritev:
 * the rows go from the pool to the file in one copy. 0, or -1 with errno set. */
static int
write_rows(int fd, const char *pool, size_t row_bytes, const int64_t *slots, Py_ssize_t n,
           off_t offset)
{
    struct iovec iov[ROW_RUNS];
    int k = 0;
    off_t at = offset;  /* where iov[0] lands */
    size_t pending = 0;  /* bytes in iov[0..k) */
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *row = slots[i] >= 0 ? pool + (size_t)slots[i] * row_bytes : NULL;
        if (k > 0 && row == (const char *)iov[k - 1].iov_base + iov[k - 1].iov_len) {
            iov[k - 1].iov_len += row_bytes;
            pending += row_bytes;
            continue;
        }
        if (k > 0 && (row == NULL || k == ROW_RUNS)) {
            if (writev_all(fd, iov, k, at) < 0) {
                return -1;
            }
            at += (off_t)pending;
            k = 0, pending = 0;
        }
        if (row == NULL) {
            at = offset + (off_t)((size_t)(i + 1) * row_bytes);
            continue;
        }
        iov[k].iov_base = (void *)row;
        iov[k].iov_len = row_bytes;
        k++, pending += row_bytes;
    }
    return k > 0 ? writev_all(fd, iov, k, at) : 0;
}

static int
write_each(int fd, const Pieces *p)
{
    for (Py_ssize_t i = 0; i < p->n; i++) {
        const Py_buffer *b = &p->bufs[i];
        int rc = p->slots[i].obj == NULL
            ? write_all(fd, b->buf, (size_t)b->len, p->offsets[i])
            : write_rows(fd, b->buf, (size_t)(b->shape[1] * b->itemsize), p->slots[i].buf,
                         p->slots[i].shape[0], p->offsets[i]);
        if (rc < 0) {
            return errno;
        }
    }
    return 0;
}

void
release_pieces(Pieces *p)
{
    for (Py_ssize_t i = 0; i < p->n; i++) {
        PyBuffer_Release(&p->bufs[i]);
        if (p->slots[i].obj != NULL) {
            PyBuffer_Release(&p->slots[i]);
        }
    }
    PyMem_Free(p->bufs);
    PyMem_Free(p->slots);
    PyMem_Free(p->offsets);
    p->bufs = NULL, p->slots = NULL, p->offsets = NULL, p->n = 0;
}

/* Piece `i`'s rows of a pool (`rows`: its `pool`, a 2-d C-contiguous buffer, and its `slots`,
 * 1-d int64, each -1 or a row of the pool), checked with the GIL held: the writes need none. */
static int
borrow_rows(const char *fn, Py_ssize_t i, PyObject *rows, Pieces *p)
{
    Py_buffer *b = &p->bufs[i], *s = &p->slots[i];
    PyObject *pool = PyObject_GetAttrString(rows, "pool");
    int rc = pool == NULL ? -1 : PyObject_GetBuffer(pool, b, PyBUF_C_CONTIGUOUS);
    Py_XDECREF(pool);  /* the buffer holds the pool */
    if (rc < 0) {
        return -1;
    }
    if (b->ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s: piece %zd's pool rows have %d dimensions, not 2",
                     fn, i, b->ndim);
        return -1;
    }
    PyObject *slots = PyObject_GetAttrString(rows, "slots");
    rc = slots == NULL ? -1 : PyObject_GetBuffer(slots, s, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_XDECREF(slots);
    if (rc < 0) {
        return -1;
    }
    const char *format = s->format ? s->format : "B";
    char code = format[strlen(format) - 1];
    if (s->ndim != 1 || s->itemsize != 8 || (code != 'l' && code != 'q')) {
        PyErr_Format(PyExc_TypeError, "%s: piece %zd's slots must be a 1-d int64 array, got "
                     "format %s of %zd-byte items", fn, i, format, s->itemsize);
        return -1;
    }
    const int64_t *slot = s->buf;
    for (Py_ssize_t r = 0; r < s->shape[0]; r++) {
        if (slot[r] < -1 || slot[r] >= b->shape[0]) {
            PyErr_Format(PyExc_ValueError, "%s: piece %zd's row %zd reads slot %lld, outside "
                         "the pool's %zd rows", fn, i, r, (long long)slot[r], b->shape[0]);
            return -1;
        }
    }
    return 0;
}

int
borrow_pieces(const char *fn, PyObject *obj, Pieces *p)
{
    p->bufs = NULL, p->slots = NULL, p->offsets = NULL, p->n = 0;
    PyObject *seq = PySequence_Fast(
        obj, "pieces must be a sequence of (offset, bytes or pool rows)");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    p->bufs = PyMem_Calloc((size_t)(n ? n : 1), sizeof *p->bufs);
    p->slots = PyMem_Calloc((size_t)(n ? n : 1), sizeof *p->slots);
    p->offsets = PyMem_Calloc((size_t)(n ? n : 1), sizeof *p->offsets);
    if (p->bufs == NULL || p->slots == NULL || p->offsets == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    while (p->n < n) {
        long long offset;
        PyObject *data;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, p->n), "LO", &offset, &data)) {
            goto fail;
        }
        if (offset < 0) {
            PyErr_Format(PyExc_ValueError, "%s: piece %zd has a negative offset", fn, p->n);
            goto fail;
        }
        p->offsets[p->n] = (off_t)offset;
        int rc = PyObject_CheckBuffer(data)
            ? PyObject_GetBuffer(data, &p->bufs[p->n], PyBUF_C_CONTIGUOUS)
            : borrow_rows(fn, p->n, data, p);
        p->n++;  /* what this piece borrowed is released with the rest */
        if (rc < 0) {
            goto fail;
        }
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    release_pieces(p);
    return -1;
}

/* This handle's expectation to end: none where `path` is None. */
typedef struct {
    PyObject *path;  /* bytes, or NULL */
    Py_buffer record;
} Expectation;

static int
borrow_expectation(PyObject *path, PyObject *record, Expectation *e)
{
    e->path = NULL;
    e->record.obj = NULL;
    if (path == Py_None) {
        return 0;
    }
    if (!fs_path(path, &e->path)) {
        return -1;
    }
    return PyObject_GetBuffer(record, &e->record, PyBUF_SIMPLE);
}

static void
release_expectation(Expectation *e)
{
    if (e->record.obj != NULL) {
        PyBuffer_Release(&e->record);
    }
    Py_CLEAR(e->path);
}

/* One entry of a put, from its room to its place: borrowed with the GIL held, then taken
 * through the phases below without it. Invariant: `fd` >= 0 exactly while this call holds
 * the entry's temp file (created, flocked, sized and counted in the budget). */
typedef struct {
    PyObject *refused;  /* the exception that refused it before any system call, or NULL */
    PyObject *temp, *marker, *prefix;  /* fs paths as bytes (marker and prefix: NULL unless
                                        * it is to be published) */
    unsigned long long nbytes;
    Pieces pieces;
    Expectation expect;
    char *entry;  /* its place: `prefix` + its sequence number */
    size_t entry_len;
    int fd;
    int full;  /* no room counted for it: nothing made */
    int err;  /* 0, or the errno that stopped it */
    const char *failed;  /* the file `err` names (NULL: none) */
    uint64_t seq;
} Put;

static void
init_put(Put *p)
{
    memset(p, 0, sizeof *p);
    p->fd = -1;
}

static void
fail_put(Put *p, int err, const char *failed)
{
    p->err = err;
    p->failed = failed;
}

/* Whether `p` is written and its room still held, to be placed. */
static int
ready(const Put *p)
{
    return p->fd >= 0 && !p->err;
}

/* Its temp file: created (exclusive), flocked (its writer lives while the lock is held) and
 * sized; 0, or an errno with nothing left behind. */
static int
open_room(Put *p)
{
    const char *temp = PyBytes_AS_STRING(p->temp);
    p->fd = create_private(temp, 1);
    if (p->fd < 0) {
        return errno;
    }
    if (lock(p->fd, LOCK_EX) < 0 || STEP(ftruncate(p->fd, (off_t)p->nbytes)) < 0) {
        int err = errno;
        STEP(close(p->fd));
        STEP(unlink(temp));
        p->fd = -1;
        return err;
    }
    return 0;
}

/* Under the namespace lock (taken here unless `take_lock` is 0: the caller holds it), room for
 * each of `puts` in turn, with one read and one write of the budget: unless `force` or the
 * budget has room for its bytes, it is marked `full` and nothing is made; else its temp file
 * (`open_room`), counted. */
static void
reserve_puts(int lock_fd, int budget_fd, int force, int take_lock, Put *puts, Py_ssize_t n)
{
    Budget b = {0, 0};
    int err = 0, counted = 0;
    if (take_lock && lock(lock_fd, LOCK_EX) < 0) {
        err = errno;
        for (Py_ssize_t i = 0; i < n; i++) {
            fail_put(&puts[i], err, NULL);
        }
        return;
    }
    if (read_budget(budget_fd, &b) < 0) {
        err = errno;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Put *p = &puts[i];
        if (p->refused) {
            continue;
        }
        if (err) {
            fail_put(p, err, NULL);
        } else if (!force && b.used + p->nbytes > b.capacity) {
            p->full = 1;
        } else if ((p->err = open_room(p)) != 0) {
            p->failed = PyBytes_AS_STRING(p->temp);
        } else {
            b.used += p->nbytes;
            counted = 1;
        }
    }
    if (counted && write_budget(budget_fd, &b) < 0) {  /* uncounted, so none may stay */
        err = errno;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (puts[i].fd >= 0) {
                STEP(close(puts[i].fd));
                STEP(unlink(PyBytes_AS_STRING(puts[i].temp)));
                puts[i].fd = -1;
                fail_put(&puts[i], err, NULL);
            }
        }
    }
    if (take_lock) {
        lock(lock_fd, LOCK_UN);
    }
}

/* Each reserved entry's pieces into its temp file (the namespace lock is not needed: the file
 * is this call's alone). */
static void
write_puts(Put *puts, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Put *p = &puts[i];
        if (ready(p) && (p->err = write_each(p->fd, &p->pieces)) != 0) {
            p->failed = PyBytes_AS_STRING(p->temp);
        }
    }
}

/* Its marker unless it exists, its rename into place, and the end of its handle's
 * expectation if that is still the record there (under the namespace lock, numbered). Once
 * renamed the entry is out, so ending the expectation is done where it can be, never a failure
 * of the put: one left in place names this producer, which lives, and its entry is there. */
static void
place_put(Put *p)
{
    const char *marker = PyBytes_AS_STRING(p->marker), *temp = PyBytes_AS_STRING(p->temp);
    int marker_fd = create_private(marker, 1);
    if (marker_fd >= 0) {
        STEP(close(marker_fd));
    } else if (errno != EEXIST) {
        fail_put(p, errno, marker);
        return;
    }
    snprintf(p->entry, p->entry_len, "%s%llu", PyBytes_AS_STRING(p->prefix),
             (unsigned long long)p->seq);
    if (STEP(rename(temp, p->entry)) < 0) {
        fail_put(p, errno, temp);
        return;
    }
    if (p->expect.path == NULL) {
        return;
    }
    const char *expect_path = PyBytes_AS_STRING(p->expect.path);
    int efd = STEP(open(expect_path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (efd < 0) {
        return;
    }
    char seen[4096];
    size_t want = (size_t)p->expect.record.len;
    ssize_t got = want < sizeof seen ? read(efd, seen, want + 1) : -1;
    STEP(close(efd));
    if (got == (ssize_t)want && memcmp(seen, p->expect.record.buf, want) == 0) {
        STEP(unlink(expect_path));
    }
}

/* Under the namespace lock (taken here unless `take_lock` is 0): each written entry numbered
 * from the ring's sequence, which slots share (numbers taken under the lock, before any rename,
 * so an id's files are numbered in the order they are placed), and placed (`place_put`); then
 * the ring's readers are told. */
static void
publish_puts(RingHeader *ring, int lock_fd, int take_lock, Put *puts, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i < n && !ready(&puts[i])) {
        i++;
    }
    if (i == n) {
        return;
    }
    if (take_lock && lock(lock_fd, LOCK_EX) < 0) {
        int err = errno;
        for (; i < n; i++) {
            if (ready(&puts[i])) {
                fail_put(&puts[i], err, NULL);
            }
        }
        return;
    }
    for (Py_ssize_t j = i; j < n; j++) {
        if (ready(&puts[j])) {
            puts[j].seq = ring_take_seq(ring);
        }
    }
    int placed = 0;
    for (; i < n; i++) {
        if (ready(&puts[i])) {
            place_put(&puts[i]);
            placed |= !puts[i].err;
        }
    }
    if (take_lock) {
        lock(lock_fd, LOCK_UN);
    }
    if (placed) {
        ring_notify(ring);
    }
}

/* Whether `p` failed while its room was held (so before its rename, which no failure
 * follows): the room is to return. */
static int
lost(const Put *p)
{
    return p->fd >= 0 && p->err;
}

/* Under the namespace lock, which the caller holds: the rooms of entries `lost` given back,
 * their temp files removed and their bytes uncounted. */
static void
return_rooms(int budget_fd, Put *puts, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i < n && !lost(&puts[i])) {
        i++;
    }
    if (i == n) {
        return;
    }
    uint64_t freed = 0;
    for (; i < n; i++) {
        if (lost(&puts[i]) && STEP(unlink(PyBytes_AS_STRING(puts[i].temp))) == 0) {
            freed += puts[i].nbytes;
        }
    }
    Budget b;
    if (freed && read_budget(budget_fd, &b) == 0) {
        b.used = b.used > freed ? b.used - freed : 0;
        write_budget(budget_fd, &b);
    }
}

/* `p`'s paths to its place (`marker`, `prefix` and the expectation's, taken here) and the
 * room for its numbered name; 0, or -1 with an error set. */
static int
borrow_place(Put *p, PyObject *marker, PyObject *prefix, PyObject *expect_path,
             PyObject *expectation)
{
    if (!fs_path(marker, &p->marker) || !fs_path(prefix, &p->prefix) ||
            borrow_expectation(expect_path, expectation, &p->expect) < 0) {
        return -1;
    }
    p->entry_len = (size_t)PyBytes_GET_SIZE(p->prefix) + 24;
    p->entry = PyMem_Malloc(p->entry_len);
    if (p->entry == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
release_put(Put *p)
{
    release_pieces(&p->pieces);
    release_expectation(&p->expect);
    PyMem_Free(p->entry);
    p->entry = NULL;
    Py_CLEAR(p->temp);
    Py_CLEAR(p->marker);
    Py_CLEAR(p->prefix);
    Py_CLEAR(p->refused);
}

/* An OSError (its errno's subclass) for `err` naming `path` (NULL: none), not raised. */
static PyObject *
os_error(int err, const char *path)
{
    return path ? PyObject_CallFunction(PyExc_OSError, "iss", err, strerror(err), path)
                : PyObject_CallFunction(PyExc_OSError, "is", err, strerror(err));
}

PyDoc_STRVAR(reserve_doc,
"reserve(lock_fd, budget_fd, temp_path, nbytes, force, take_lock) -> int\n\n"
"A put's room: under the namespace lock (taken here unless `take_lock` is False: the caller\n"
"holds it), unless `force` or the budget has room for `nbytes` more, returns -1 and changes\n"
"nothing; else creates `temp_path` (exclusive, mode 0600), takes an exclusive flock on it,\n"
"sizes it to `nbytes`, adds them to the bytes in use, and returns its descriptor.");

static PyObject *
reserve(PyObject *self, PyObject *args)
{
    int lock_fd, budget_fd, force, take_lock;
    Put p;
    init_put(&p);
    if (!PyArg_ParseTuple(args, "iiO&Kpp:reserve", &lock_fd, &budget_fd, fs_path, &p.temp,
                          &p.nbytes, &force, &take_lock)) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    reserve_puts(lock_fd, budget_fd, force, take_lock, &p, 1);
    Py_END_ALLOW_THREADS
    PyObject *result = p.err ? raise_errno(p.err, p.failed) : PyLong_FromLong(p.full ? -1 : p.fd);
    release_put(&p);  /* the descriptor is the caller's now */
    return result;
}

PyDoc_STRVAR(write_doc,
"write(fd, pieces) -> None\n\n"
"Write each (offset, data) of `pieces` into the reserved file `fd`, in full: a bytes-like\n"
"`data` as it is; else `data.pool`'s rows (a C-contiguous [num_slots, bytes] buffer) at\n"
"`data.slots` (1-d int64), laid end to end from the offset straight from the pool (a slot of\n"
"-1 leaves its row zeros): `prefix_cache.core.pool_rows.PoolRows`.");

static PyObject *
write_pieces(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *pieces_obj;
    Pieces pieces;
    if (!PyArg_ParseTuple(args, "iO:write", &fd, &pieces_obj) ||
            borrow_pieces("write", pieces_obj, &pieces) < 0) {
        return NULL;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = write_each(fd, &pieces);
    Py_END_ALLOW_THREADS
    release_pieces(&pieces);
    return err ? raise_errno(err, NULL) : Py_NewRef(Py_None);
}

PyDoc_STRVAR(publish_doc,
"publish(ring, lock_fd, fd, temp_path, marker_path, entry_prefix, expectation_path,\n"
"        expectation) -> int\n\n"
"Under the namespace lock: take the next sequence number from `ring` (the mapped `.ring`),\n"
"create the id's\n"
"marker `marker_path` unless it exists, rename the written temp file `temp_path` to\n"
"`entry_prefix` + that number, and remove `expectation_path` if its contents are exactly\n"
"`expectation` (the expectation this handle wrote; None: none to end). Then closes `fd`, the\n"
"reservation's descriptor (on error the caller still owns it and the reservation). Returns\n"
"the sequence number.");

static PyObject *
publish(PyObject *self, PyObject *args)
{
    int lock_fd;
    PyObject *ring_obj, *marker, *prefix, *expect_path, *expectation;
    Put p;
    init_put(&p);
    if (!PyArg_ParseTuple(args, "OiiO&OOOO:publish", &ring_obj, &lock_fd, &p.fd, fs_path,
                          &p.temp, &marker, &prefix, &expect_path, &expectation)) {
        return NULL;
    }
    Py_buffer view;
    RingHeader *ring;
    if (borrow_ring(ring_obj, &view, &ring) < 0) {
        release_put(&p);
        return NULL;
    }
    PyObject *result = NULL;
    if (borrow_place(&p, marker, prefix, expect_path, expectation) == 0) {
        Py_BEGIN_ALLOW_THREADS
        publish_puts(ring, lock_fd, 1, &p, 1);
        if (!p.err) {
            STEP(close(p.fd));
        }
        Py_END_ALLOW_THREADS
        result = p.err ? raise_errno(p.err, p.failed) : PyLong_FromUnsignedLongLong(p.seq);
    }
    release_put(&p);
    PyBuffer_Release(&view);
    return result;
}

/* Entry `i` of put_all's: (temp_path, nbytes, pieces, marker_path, entry_prefix,
 * expectation_path, expectation). One whose pieces or paths are refused keeps the exception
 * (`refused`) and is left out of the phases: the others go on. -1 where `item` is no such tuple
 * at all (an error set). */
static int
borrow_put(PyObject *item, Put *p)
{
    PyObject *pieces, *marker, *prefix, *expect_path, *expectation;
    if (!PyArg_ParseTuple(item, "O&KOOOOO:put_all", fs_path, &p->temp, &p->nbytes, &pieces,
                          &marker, &prefix, &expect_path, &expectation)) {
        return -1;
    }
    if (borrow_pieces("put_all", pieces, &p->pieces) < 0 ||
            borrow_place(p, marker, prefix, expect_path, expectation) < 0) {
        p->refused = fetch_error();
    }
    return 0;
}

PyDoc_STRVAR(put_all_doc,
"put_all(ring, budget_fd, force, entries) -> list\n\n"
"Whole puts in one call, where there is room now, under the namespace lock, which the caller\n"
"holds (taken before it lets any pool's rows be read here, so none is held while a lock\n"
"that another process keeps is awaited): each of `entries`, a tuple (temp_path, nbytes,\n"
"pieces, marker_path, entry_prefix, expectation_path, expectation), reserved, written and\n"
"published as `reserve`, `write` and `publish` do (numbered from `ring`). Returns, per entry in order, its sequence\n"
"number; -1 where the budget had no room for it (unless `force`), nothing changed for it; or\n"
"the exception that failed it, not raised (an OSError naming the file; a pieces error): its\n"
"room was given back and the others went on.");

static PyObject *
put_all(PyObject *self, PyObject *args)
{
    int budget_fd, force;
    PyObject *ring_obj, *entries;
    if (!PyArg_ParseTuple(args, "OipO:put_all", &ring_obj, &budget_fd, &force, &entries)) {
        return NULL;
    }
    Py_buffer view;
    RingHeader *ring;
    if (borrow_ring(ring_obj, &view, &ring) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *seq = PySequence_Fast(entries, "put_all: entries must be a "
                                                    "sequence of tuples");
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 0, borrowed = 0;
    Put *puts = seq ? PyMem_Calloc((size_t)(n ? n : 1), sizeof *puts) : NULL;
    if (seq != NULL && puts == NULL) {
        PyErr_NoMemory();
    }
    if (puts == NULL) {
        goto done;
    }
    for (; borrowed < n; borrowed++) {
        init_put(&puts[borrowed]);
        if (borrow_put(PySequence_Fast_GET_ITEM(seq, borrowed), &puts[borrowed]) < 0) {
            borrowed++;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    reserve_puts(-1, budget_fd, force, 0, puts, n);
    write_puts(puts, n);
    publish_puts(ring, -1, 0, puts, n);
    return_rooms(budget_fd, puts, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (puts[i].fd >= 0) {  /* published or given back: its flock goes with it */
            STEP(close(puts[i].fd));
            puts[i].fd = -1;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        Put *p = &puts[i];
        PyObject *item = p->refused ? Py_NewRef(p->refused)
            : p->err ? os_error(p->err, p->failed)
            : PyLong_FromLongLong(p->full ? -1 : (long long)p->seq);
        if (item == NULL) {
            Py_CLEAR(result);
        } else {
            PyList_SET_ITEM(result, i, item);
        }
    }
done:
    for (Py_ssize_t i = 0; i < borrowed; i++) {
        release_put(&puts[i]);
    }
    PyMem_Free(puts);
    Py_XDECREF(seq);
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(expect_doc,
"expect(lock_fd, paths, record) -> None\n\n"
"Under the namespace lock, write `record` (bytes-like) to each of `paths`: to path + '.new'\n"
"(mode 0600; a temp left there by a writer that died is truncated and taken over), then\n"
"renamed into place. On error, raises naming the file; the expectations before it stay.");

static PyObject *
expect(PyObject *self, PyObject *args)
{
    int lock_fd;
    PyObject *paths_obj, *record_obj;
    if (!PyArg_ParseTuple(args, "iOO:expect", &lock_fd, &paths_obj, &record_obj)) {
        return NULL;
    }
    PyObject *paths = PySequence_Fast(paths_obj, "expect: paths must be a sequence");
    if (paths == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(paths), converted = 0;
    PyObject **names = PyMem_Calloc((size_t)(n ? n : 1), sizeof *names);
    char **temps = PyMem_Calloc((size_t)(n ? n : 1), sizeof *temps);
    Py_buffer record = {0};
    PyObject *result = NULL;
    if (names == NULL || temps == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(record_obj, &record, PyBUF_SIMPLE) < 0) {
        goto done;
    }
    for (; converted < n; converted++) {
        if (!fs_path(PySequence_Fast_GET_ITEM(paths, converted), &names[converted])) {
            goto done;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(names[converted]);
        temps[converted] = PyMem_Malloc((size_t)len + 5);
        if (temps[converted] == NULL) {
            PyErr_NoMemory();
            converted++;
            goto done;
        }
        memcpy(temps[converted], PyBytes_AS_STRING(names[converted]), (size_t)len);
        memcpy(temps[converted] + len, ".new", 5);
    }
    int err = 0;
    const char *failed = NULL;
    Py_BEGIN_ALLOW_THREADS
    if (lock(lock_fd, LOCK_EX) < 0) {
        err = errno;
    } else {
        for (Py_ssize_t i = 0; i < n && !err; i++) {
            int fd = create_private(temps[i], 0);
            if (fd < 0) {
                err = errno, failed = temps[i];
                break;
            }
            if (write_all(fd, record.buf, (size_t)record.len, 0) < 0) {
                err = errno, failed = temps[i];
            }
            STEP(close(fd));
            if (!err && STEP(rename(temps[i], PyBytes_AS_STRING(names[i]))) < 0) {
                err = errno, failed = temps[i];
            }
        }
        lock(lock_fd, LOCK_UN);
    }
    Py_END_ALLOW_THREADS
    if (err) {
        raise_errno(err, failed);
    } else {
        result = Py_NewRef(Py_None);
    }
done:
    for (Py_ssize_t i = 0; i < converted; i++) {
        Py_XDECREF(names[i]);
        PyMem_Free(temps[i]);
    }
    PyMem_Free(names);
    PyMem_Free(temps);
    if (record.obj != NULL) {
        PyBuffer_Release(&record);
    }
    Py_DECREF(paths);
    return result;
}

PyDoc_STRVAR(die_before_step_doc,
"die_before_step(n) -> None\n\n"
"Crash tests only: exit the process (status 1) just before the n-th step of this module from\n"
"now on (0: never).");

static PyObject *
die_before_step(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    atomic_store(&die_at, n > 0 ? atomic_load(&steps_made) + n : 0);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(steps_doc,
"steps() -> int\n\n"
"The steps (system calls that change files or locks) this module made in this process.");

static PyObject *
steps(PyObject *self, PyObject *unused)
{
    return PyLong_FromLong(atomic_load(&steps_made));
}

static PyMethodDef shm_methods[] = {
    {"reserve", reserve, METH_VARARGS, reserve_doc},
    {"write", write_pieces, METH_VARARGS, write_doc},
    {"publish", publish, METH_VARARGS, publish_doc},
    {"put_all", put_all, METH_VARARGS, put_all_doc},
    {"expect", expect, METH_VARARGS, expect_doc},
    {"die_before_step", die_before_step, METH_O, die_before_step_doc},
    {"steps", steps, METH_NOARGS, steps_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef shm_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefix_cache.channel._shm",
    .m_doc = "The shm channel's put and expectation steps, their system calls made with the GIL "
             "released.",
    .m_size = -1,
    .m_methods = shm_methods,
};

PyMODINIT_FUNC
PyInit__shm(void)
{
    PyObject *module = PyModule_Create(&shm_module);
    if (module != NULL && PyModule_AddFunctions(module, ring_methods) < 0) {
        Py_CLEAR(module);
    }
    return module;
}
