/* prefix_cache.channel._shm: the shm channel's put and expectation steps, each one call that
 * makes all its system calls with the GIL released.
 *
 * A put made of Python calls gives the GIL up at each of its twenty-odd system calls (flock,
 * open, fchmod, ftruncate, pread and pwrite of the budget, pwrite of the entry, rename, the
 * expectation's read and unlink) and takes it back after each: on an engine's output thread,
 * every one of those hand-overs makes the engine thread wait for the GIL again. Here a put is
 * one call (`put`) where the namespace has room, three (`reserve`, `write`, `publish`) where it
 * waits for room, and a step's expectations one. The protocol is the one
 * `prefix_cache.channel.shm` documents; its Python keeps the rare paths (a full namespace's
 * recount, sweeps, takes). `put` locks a descriptor of `.lock` it opens itself (flock excludes
 * separate open files, threads included); around the others, which lock the handle's shared
 * descriptor, the caller holds the handle's thread lock (all but `write`).
 *
 * An entry's rows may be a pool's, named by slot (`write`): they go from the pool into the
 * entry's file by pwritev, one copy, with no gathered copy between.
 *
 * Errors raise OSError (its errno's subclass) naming the file; a call that raises leaves no
 * file of its own behind and releases the namespace lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

/* `.budget`: three little-endian u64, capacity, bytes used, next sequence number. */
typedef struct {
    uint64_t capacity, used, next_seq;
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
    unsigned char raw[24];
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
    b->next_seq = load_le64(raw + 16);
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
    unsigned char raw[24];
    store_le64(raw, b->capacity);
    store_le64(raw + 8, b->used);
    store_le64(raw + 16, b->next_seq);
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

/* The steps of a put, without the GIL; each returns 0 or an errno, setting `*failed` to the
 * file it names (NULL: none). */

/* Under the namespace lock (taken unless `take_lock` is 0: the caller holds it): unless `force`
 * or the budget has room for `nbytes` more, sets `*full` and changes nothing; else creates
 * `temp` (exclusive), flocks it, sizes it and counts its bytes, setting `*fd`. */
static int
reserve_room(int lock_fd, int budget_fd, const char *temp, uint64_t nbytes, int force,
             int take_lock, int *fd, int *full, const char **failed)
{
    int err = 0;
    Budget b = {0, 0, 0};
    *fd = -1;
    *full = 0;
    if (take_lock && lock(lock_fd, LOCK_EX) < 0) {
        return errno;
    }
    if (read_budget(budget_fd, &b) < 0) {
        err = errno;
    } else if (!force && b.used + nbytes > b.capacity) {
        *full = 1;
    } else if ((*fd = create_private(temp, 1)) < 0) {
        err = errno, *failed = temp;
    } else if (lock(*fd, LOCK_EX) < 0 || STEP(ftruncate(*fd, (off_t)nbytes)) < 0) {
        err = errno, *failed = temp;
    } else {
        b.used += nbytes;
        if (write_budget(budget_fd, &b) < 0) {
            err = errno;
        }
    }
    if (err && *fd >= 0) {
        STEP(close(*fd));
        STEP(unlink(temp));
        *fd = -1;
    }
    if (take_lock) {
        lock(lock_fd, LOCK_UN);
    }
    return err;
}

/* Under the namespace lock: the id's marker, the next sequence number, the rename into place
 * (`*renamed` once done), and the end of this handle's expectation (`expect_path` NULL: none). */
static int
publish_entry(int lock_fd, int budget_fd, const char *temp, const char *marker, char *entry,
              size_t entry_len, const char *prefix, const char *expect_path,
              const Py_buffer *expectation, uint64_t *seq, int *renamed, const char **failed)
{
    int err = 0;
    Budget b = {0, 0, 0};
    *renamed = 0;
    if (lock(lock_fd, LOCK_EX) < 0) {
        return errno;
    }
    int marker_fd = create_private(marker, 1);
    if (marker_fd >= 0) {
        STEP(close(marker_fd));
    } else if (errno != EEXIST) {
        err = errno, *failed = marker;
    }
    if (!err && read_budget(budget_fd, &b) < 0) {
        err = errno;
    }
    if (!err) {
        *seq = b.next_seq;
        snprintf(entry, entry_len, "%s%llu", prefix, (unsigned long long)b.next_seq);
        b.next_seq += 1;
        if (write_budget(budget_fd, &b) < 0) {
            err = errno;
        } else if (STEP(rename(temp, entry)) < 0) {
            err = errno, *failed = temp;
        } else {
            *renamed = 1;
        }
    }
    if (!err && expect_path) {  /* ended only if this handle's record is still the one there */
        int efd = STEP(open(expect_path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
        if (efd >= 0) {
            char seen[4096];
            size_t want = (size_t)expectation->len;
            ssize_t got = want < sizeof seen ? read(efd, seen, want + 1) : -1;
            STEP(close(efd));
            if (got == (ssize_t)want && memcmp(seen, expectation->buf, want) == 0 &&
                    STEP(unlink(expect_path)) < 0 && errno != ENOENT) {
                err = errno, *failed = expect_path;
            }
        } else if (errno != ENOENT) {
            err = errno, *failed = expect_path;
        }
    }
    lock(lock_fd, LOCK_UN);
    return err;
}

/* A reservation given back: its file removed and its bytes uncounted, under the lock. */
static void
return_room(int lock_fd, int budget_fd, const char *temp, uint64_t nbytes)
{
    Budget b;
    if (lock(lock_fd, LOCK_EX) < 0) {
        return;
    }
    if (STEP(unlink(temp)) == 0 && read_budget(budget_fd, &b) == 0) {
        b.used = b.used > nbytes ? b.used - nbytes : 0;
        write_budget(budget_fd, &b);
    }
    lock(lock_fd, LOCK_UN);
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

/* An entry's pieces, borrowed until release_pieces: each is bytes written at its offset, or
 * rows of a pool (`slots[i].obj` set) that `write_rows` writes there. */
typedef struct {
    Py_buffer *bufs;  /* the bytes, or the pool's [slots, row bytes] rows */
    Py_buffer *slots;  /* a pool piece's int64 slots */
    off_t *offsets;
    Py_ssize_t n;
} Pieces;

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

static void
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

static int
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
    PyObject *temp_obj;
    unsigned long long nbytes;
    if (!PyArg_ParseTuple(args, "iiO&Kpp:reserve", &lock_fd, &budget_fd, fs_path, &temp_obj,
                          &nbytes, &force, &take_lock)) {
        return NULL;
    }
    const char *temp = PyBytes_AS_STRING(temp_obj), *failed = NULL;
    int fd, full, err;
    Py_BEGIN_ALLOW_THREADS
    err = reserve_room(lock_fd, budget_fd, temp, nbytes, force, take_lock, &fd, &full, &failed);
    Py_END_ALLOW_THREADS
    PyObject *result = err ? raise_errno(err, failed) : PyLong_FromLong(full ? -1 : fd);
    Py_DECREF(temp_obj);
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
"publish(lock_fd, budget_fd, fd, temp_path, marker_path, entry_prefix, expectation_path,\n"
"        expectation) -> int\n\n"
"Under the namespace lock: create the id's marker `marker_path` unless it exists, take the\n"
"next sequence number from the budget, rename the written temp file `temp_path` to\n"
"`entry_prefix` + that number, and remove `expectation_path` if its contents are exactly\n"
"`expectation` (the expectation this handle wrote; None: none to end). Then closes `fd`, the\n"
"reservation's descriptor (on error the caller still owns it and the reservation). Returns\n"
"the sequence number.");

static PyObject *
publish(PyObject *self, PyObject *args)
{
    int lock_fd, budget_fd, fd;
    PyObject *temp_obj, *marker_obj, *prefix_obj, *expect_path, *expect_record;
    if (!PyArg_ParseTuple(args, "iiiO&O&O&OO:publish", &lock_fd, &budget_fd, &fd, fs_path,
                          &temp_obj, fs_path, &marker_obj, fs_path, &prefix_obj,
                          &expect_path, &expect_record)) {
        return NULL;
    }
    PyObject *result = NULL;
    Expectation e = {NULL, {0}};
    size_t entry_len = (size_t)PyBytes_GET_SIZE(prefix_obj) + 24;
    char *entry = PyMem_Malloc(entry_len);
    if (entry == NULL) {
        PyErr_NoMemory();
    } else if (borrow_expectation(expect_path, expect_record, &e) == 0) {
        const char *failed = NULL;
        uint64_t seq = 0;
        int err, renamed;
        Py_BEGIN_ALLOW_THREADS
        err = publish_entry(lock_fd, budget_fd, PyBytes_AS_STRING(temp_obj),
                            PyBytes_AS_STRING(marker_obj), entry, entry_len,
                            PyBytes_AS_STRING(prefix_obj),
                            e.path ? PyBytes_AS_STRING(e.path) : NULL, &e.record, &seq,
                            &renamed, &failed);
        if (!err) {
            STEP(close(fd));
        }
        Py_END_ALLOW_THREADS
        result = err ? raise_errno(err, failed) : PyLong_FromUnsignedLongLong(seq);
    }
    release_expectation(&e);
    PyMem_Free(entry);
    Py_DECREF(temp_obj);
    Py_DECREF(marker_obj);
    Py_DECREF(prefix_obj);
    return result;
}

PyDoc_STRVAR(put_doc,
"put(lock_path, budget_fd, temp_path, nbytes, force, pieces, marker_path, entry_prefix,\n"
"    expectation_path, expectation) -> int\n\n"
"A whole put in one call, where there is room now: `reserve`, `write` and `publish`, the\n"
"namespace lock taken on a descriptor of `lock_path` of this call's own (so no thread lock is\n"
"needed: flock excludes separate open files, threads included). Returns the sequence number,\n"
"or -1 with nothing changed where the budget has no room for `nbytes` (unless `force`). A\n"
"failure before the entry is renamed into place gives its room back.");

static PyObject *
put(PyObject *self, PyObject *args)
{
    int budget_fd, force;
    unsigned long long nbytes;
    PyObject *lock_obj, *temp_obj, *pieces_obj, *marker_obj, *prefix_obj, *expect_path;
    PyObject *expect_record;
    if (!PyArg_ParseTuple(args, "O&iO&KpOO&O&OO:put", fs_path, &lock_obj, &budget_fd,
                          fs_path, &temp_obj, &nbytes, &force, &pieces_obj, fs_path,
                          &marker_obj, fs_path, &prefix_obj, &expect_path, &expect_record)) {
        return NULL;
    }
    PyObject *result = NULL;
    Pieces pieces = {NULL, NULL, NULL, 0};
    Expectation e = {NULL, {0}};
    size_t entry_len = (size_t)PyBytes_GET_SIZE(prefix_obj) + 24;
    char *entry = PyMem_Malloc(entry_len);
    if (entry == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (borrow_pieces("put", pieces_obj, &pieces) < 0 ||
            borrow_expectation(expect_path, expect_record, &e) < 0) {
        goto done;
    }
    const char *lock_path = PyBytes_AS_STRING(lock_obj), *temp = PyBytes_AS_STRING(temp_obj);
    const char *failed = NULL;
    uint64_t seq = 0;
    int err = 0, full = 0, fd = -1, renamed = 0;
    Py_BEGIN_ALLOW_THREADS
    int lock_fd = STEP(open(lock_path, O_RDWR | O_NOFOLLOW | O_CLOEXEC));
    if (lock_fd < 0) {
        err = errno, failed = lock_path;
    } else {
        err = reserve_room(lock_fd, budget_fd, temp, nbytes, force, 1, &fd, &full, &failed);
        if (!err && !full) {
            err = write_each(fd, &pieces);
            if (err) {
                failed = temp;
            } else {
                err = publish_entry(lock_fd, budget_fd, temp, PyBytes_AS_STRING(marker_obj),
                                    entry, entry_len, PyBytes_AS_STRING(prefix_obj),
                                    e.path ? PyBytes_AS_STRING(e.path) : NULL, &e.record,
                                    &seq, &renamed, &failed);
            }
            if (err && !renamed) {
                return_room(lock_fd, budget_fd, temp, nbytes);
            }
            STEP(close(fd));  /* published or given back: its flock goes with it */
        }
        STEP(close(lock_fd));
    }
    Py_END_ALLOW_THREADS
    result = err ? raise_errno(err, failed)
                 : PyLong_FromLongLong(full ? -1 : (long long)seq);
done:
    PyMem_Free(entry);
    release_pieces(&pieces);
    release_expectation(&e);
    Py_DECREF(lock_obj);
    Py_DECREF(temp_obj);
    Py_DECREF(marker_obj);
    Py_DECREF(prefix_obj);
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
    {"put", put, METH_VARARGS, put_doc},
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
    return PyModule_Create(&shm_module);
}
