/* prefix_cache.core._core: the per-request and per-run loops of a step's bookkeeping, in C.
 *
 * numpy costs 1.5-2 us a call before it touches a slot, and a step's layout, claim
 * and write record took about fifteen calls; these functions do the same work in
 * a few calls of well under a microsecond, plus a pass over the step's runs of
 * consecutive slots (a block at a time). The pool's tables are tiered, an entry
 * per block and one per slot, so a run's whole blocks cost one entry each and a
 * step's bookkeeping grows with its blocks, not its tokens. The functions read
 * and write arrays through the buffer protocol (C-contiguous, native signed ints),
 * check every index before it is used, and leave a table they fill unchanged when
 * they raise (an output buffer may hold what was written before).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* A borrowed 1-D or 2-D C-contiguous array of 4- or 8-byte signed integers. */
typedef struct {
    Py_buffer buf;
    Py_ssize_t len;  /* elements */
    int wide;        /* 8-byte elements */
    int held;        /* buf must be released */
} IntArray;

/* What a function takes at args[index]: `cols` 2 for [k, 2] runs, 0 for any. */
typedef struct {
    Py_ssize_t index;
    const char *name;
    int writable, ndim, cols, int64_only, optional;  /* optional: None borrows nothing */
} ArraySpec;

static int
borrow(PyObject *obj, const ArraySpec *spec, IntArray *out)
{
    out->held = 0;
    out->len = 0;
    if (spec->optional && obj == Py_None) {
        return 0;
    }
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (spec->writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->buf, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s integer array, got %.80s",
                     spec->name, spec->writable ? " writable" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    out->held = 1;
    const char *fmt = out->buf.format ? out->buf.format : "B";
    while (*fmt == '@' || *fmt == '=' || *fmt == '<') {
        fmt++;
    }
    Py_ssize_t size = out->buf.itemsize;
    int integer = fmt[1] == '\0' && ((size == 4 && (*fmt == 'i' || *fmt == 'l')) ||
                                     (size == 8 && (*fmt == 'l' || *fmt == 'q')));
    if (!integer || out->buf.ndim != spec->ndim || (spec->int64_only && size != 8)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a %d-D %s array, got format '%s', "
                     "%zd-byte items, %d dims", spec->name, spec->ndim,
                     spec->int64_only ? "int64" : "int32 or int64", out->buf.format, size,
                     out->buf.ndim);
        return -1;
    }
    if (spec->cols && out->buf.shape[1] != spec->cols) {
        PyErr_Format(PyExc_ValueError, "%s: expected [k, %d] runs, got [%zd, %zd]", spec->name,
                     spec->cols, out->buf.shape[0], out->buf.shape[1]);
        return -1;
    }
    out->len = out->buf.len / size;
    out->wide = size == 8;
    return 0;
}

static void
release(IntArray *arrays, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (arrays[i].held) {
            PyBuffer_Release(&arrays[i].buf);
            arrays[i].held = 0;
        }
    }
}

/* Check the argument count, then borrow each spec's array; on failure nothing stays borrowed. */
static int
borrow_all(const char *fn, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
           const ArraySpec *specs, Py_ssize_t n, IntArray *arrays)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (borrow(args[specs[i].index], &specs[i], &arrays[i]) < 0) {
            release(arrays, i + 1);
            return -1;
        }
    }
    return 0;
}

static inline int64_t
get_at(const IntArray *a, Py_ssize_t i)
{
    return a->wide ? ((const int64_t *)a->buf.buf)[i] : ((const int32_t *)a->buf.buf)[i];
}

static inline int64_t *
int64s(const IntArray *a)
{
    return (int64_t *)a->buf.buf;
}

static int
int_arg(PyObject *obj, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = v;
    return 0;
}

/* mapping[key] as an integer: a dict's item directly, any other mapping's through []. */
static int
mapping_int(PyObject *mapping, PyObject *key, const char *what, int64_t *out)
{
    PyObject *value;
    if (PyDict_CheckExact(mapping)) {
        value = Py_XNewRef(PyDict_GetItemWithError(mapping, key));
        if (value == NULL && !PyErr_Occurred()) {
            PyErr_Format(PyExc_KeyError, "request %R has no %s", key, what);
        }
    } else {
        value = PyObject_GetItem(mapping, key);
    }
    if (value == NULL) {
        return -1;
    }
    int status = int_arg(value, out);
    Py_DECREF(value);
    return status;
}

/* Raise unless each of the k runs is a non-empty range within [0, limit). */
static int
check_runs(const IntArray *runs, Py_ssize_t limit, const char *name)
{
    const int64_t *r = int64s(runs);
    for (Py_ssize_t i = 0; i < runs->buf.shape[0]; i++) {
        if (r[2 * i] < 0 || r[2 * i] >= r[2 * i + 1] || r[2 * i + 1] > limit) {
            PyErr_Format(PyExc_IndexError, "%s: run %zd, slots %lld..%lld, is not a range "
                         "within 0..%zd", name, i, (long long)r[2 * i],
                         (long long)r[2 * i + 1] - 1, limit - 1);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(add_counts_doc,
"add_counts(totals, counts) -> None\n\n"
"totals[k] = totals.get(k, 0) + counts[k] for every key of counts (two dicts of ints).");

/* totals[k] = totals.get(k, 0) + counts[k] for every key of counts (two dicts). */
static int
add_counts_to(PyObject *totals, PyObject *counts)
{
    PyObject *key, *count;
    Py_ssize_t pos = 0;
    while (PyDict_Next(counts, &pos, &key, &count)) {
        PyObject *total = PyDict_GetItemWithError(totals, key);
        if (total == NULL && PyErr_Occurred()) {
            return -1;
        }
        PyObject *sum = total == NULL ? Py_NewRef(count) : PyNumber_Add(total, count);
        if (sum == NULL || PyDict_SetItem(totals, key, sum) < 0) {
            Py_XDECREF(sum);
            return -1;
        }
        Py_DECREF(sum);
    }
    return 0;
}

static PyObject *
add_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (borrow_all("add_counts", args, nargs, 2, NULL, 0, NULL) < 0) {
        return NULL;
    }
    if (!PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        return PyErr_Format(PyExc_TypeError, "add_counts: totals and counts must be dicts");
    }
    if (add_counts_to(args[0], args[1]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* obj.name into *out (NULL where it has none: 0 returned); -1 on any other error. */
static int
optional_attr(PyObject *obj, PyObject *name, PyObject **out)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(obj, name, out);
#else
    return _PyObject_LookupAttr(obj, name, out);
#endif
}

/* Whether obj's attribute `name` is missing, None or empty (1), holds something (0), or is of
 * a kind whose emptiness a truth test may not tell (-2: an iterator, say); -1 on error. */
static int
attr_empty(PyObject *obj, PyObject *name, int containers_only)
{
    PyObject *value;
    if (optional_attr(obj, name, &value) < 0) {
        return -1;
    }
    if (value == NULL || value == Py_None) {
        Py_XDECREF(value);
        return 1;
    }
    int known = !containers_only || PyAnySet_Check(value) || PyList_Check(value) ||
                PyTuple_Check(value) || PyDict_Check(value);
    int full = known ? PyObject_IsTrue(value) : -2;
    Py_DECREF(value);
    return full < 0 ? full : !full;
}

PyDoc_STRVAR(running_step_doc,
"running_step(scheduler_output, progress) -> dict or None\n\n"
"The step of a scheduler output that only schedules running requests (no new, resumed,\n"
"finished or preempted request and no block copy; num_scheduled_tokens a dict): a copy of\n"
"its num_scheduled_tokens, each request's progress[r] advanced by its count as add_counts\n"
"does. None, nothing changed, for any other step, and for one whose resumed requests it\n"
"cannot tell apart without iterating (an older vLLM's non-empty resumed_from_preemption\n"
"flags, a resumed_req_ids that is no container): the caller translates those field by field.");

static PyObject *
running_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static PyObject *names[6];  /* the fields read, interned once */
    static const char *const spelled[6] = {"scheduled_new_reqs", "finished_req_ids",
                                           "preempted_req_ids", "kv_cache_block_copies",
                                           "scheduled_cached_reqs", "num_scheduled_tokens"};
    static PyObject *resumed_names[2];
    static const char *const resumed_spelled[2] = {"resumed_req_ids", "resumed_from_preemption"};
    if (borrow_all("running_step", args, nargs, 2, NULL, 0, NULL) < 0) {
        return NULL;
    }
    if (!PyDict_Check(args[1])) {
        return PyErr_Format(PyExc_TypeError, "running_step: progress must be a dict");
    }
    if (names[0] == NULL) {
        for (int i = 0; i < 6; i++) {
            if ((names[i] = PyUnicode_InternFromString(spelled[i])) == NULL) {
                return NULL;
            }
        }
        for (int i = 0; i < 2; i++) {
            if ((resumed_names[i] = PyUnicode_InternFromString(resumed_spelled[i])) == NULL) {
                return NULL;
            }
        }
    }
    PyObject *so = args[0];
    for (int i = 0; i < 4; i++) {
        int empty = attr_empty(so, names[i], 0);
        if (empty != 1) {
            return empty == -1 ? NULL : Py_NewRef(Py_None);
        }
    }
    PyObject *cached;
    if (optional_attr(so, names[4], &cached) < 0) {
        return NULL;
    }
    if (cached != NULL && cached != Py_None) {
        /* vLLM >= 0.11.1 names the resumed requests; before, a flag per cached request */
        PyObject *resumed;
        if (optional_attr(cached, resumed_names[0], &resumed) < 0) {
            Py_DECREF(cached);
            return NULL;
        }
        int named = resumed != NULL && resumed != Py_None;
        Py_XDECREF(resumed);
        int empty = attr_empty(cached, resumed_names[named ? 0 : 1], 1);
        Py_DECREF(cached);
        if (empty != 1) {
            return empty == -1 ? NULL : Py_NewRef(Py_None);
        }
    } else {
        Py_XDECREF(cached);
    }
    PyObject *scheduled;
    if (optional_attr(so, names[5], &scheduled) < 0) {
        return NULL;
    }
    if (scheduled == NULL || !PyDict_CheckExact(scheduled)) {
        Py_XDECREF(scheduled);
        return Py_NewRef(Py_None);  /* refused, or another mapping: field by field */
    }
    PyObject *copy = PyDict_Copy(scheduled);
    Py_DECREF(scheduled);
    if (copy == NULL || add_counts_to(args[1], copy) < 0) {
        Py_XDECREF(copy);
        return NULL;
    }
    return copy;
}

/* The tensor attributes a step's output check reads, their names interned once. */
enum { ATTR_SHAPE, ATTR_REQUIRES_GRAD, ATTR_DEVICE, ATTR_DTYPE, NUM_ATTRS };
static PyObject *tensor_attrs[NUM_ATTRS];

/* Whether attribute `attr` of obj equals want (1), differs (0); -1 on error. */
static int
attr_equals(PyObject *obj, int attr, PyObject *want)
{
    PyObject *value = PyObject_GetAttr(obj, tensor_attrs[attr]);
    if (value == NULL) {
        return -1;
    }
    int equal = PyObject_RichCompareBool(value, want, Py_EQ);
    Py_DECREF(value);
    return equal;
}

PyDoc_STRVAR(hidden_rows_doc,
"hidden_rows(hidden, unpadded, padded, tensor_type, device, feat_shape, dtype, capacity)\n"
"-> (rows, shape) or None\n\n"
"The checks of a step that hands over hidden states alone, in one call: hidden a tensor_type\n"
"on `device` with feature shape feat_shape and dtype (its pool's), not requiring grad, of at\n"
"least `unpadded` rows; unpadded and padded ints (no bool) with 0 < unpadded <= padded and\n"
"unpadded <= capacity. Returns its first `unpadded` rows (hidden itself where it has no more)\n"
"and their shape, a tuple. None for any other step, having checked nothing: the caller's\n"
"checks take it, and name what is wrong.");

static PyObject *
hidden_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const spelled[NUM_ATTRS] = {"shape", "requires_grad", "device", "dtype"};
    if (borrow_all("hidden_rows", args, nargs, 8, NULL, 0, NULL) < 0) {
        return NULL;
    }
    if (!PyType_Check(args[3]) || !PyTuple_CheckExact(args[5])) {
        return PyErr_Format(PyExc_TypeError, "hidden_rows: tensor_type must be a type and "
                            "feat_shape a tuple");
    }
    if (tensor_attrs[0] == NULL) {
        for (int i = 0; i < NUM_ATTRS; i++) {
            if ((tensor_attrs[i] = PyUnicode_InternFromString(spelled[i])) == NULL) {
                return NULL;
            }
        }
    }
    PyObject *hidden = args[0];
    if (!PyLong_CheckExact(args[1]) || !PyLong_CheckExact(args[2]) ||
            !PyObject_TypeCheck(hidden, (PyTypeObject *)args[3])) {
        Py_RETURN_NONE;
    }
    int64_t n, padded, capacity;
    if (int_arg(args[1], &n) < 0 || int_arg(args[2], &padded) < 0 ||
            int_arg(args[7], &capacity) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return NULL;
        }
        PyErr_Clear();  /* a count past int64: refused by the caller's checks */
        Py_RETURN_NONE;
    }
    if (n <= 0 || n > padded || n > capacity) {
        Py_RETURN_NONE;
    }
    PyObject *shape = PyObject_GetAttr(hidden, tensor_attrs[ATTR_SHAPE]);
    if (shape == NULL) {
        return NULL;
    }
    PyObject *result = NULL, *feat = NULL, *rows = NULL, *out_shape = NULL;
    Py_ssize_t dims = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : 0;
    int64_t given;
    if (dims == 0 || !PyLong_Check(PyTuple_GET_ITEM(shape, 0))) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (int_arg(PyTuple_GET_ITEM(shape, 0), &given) < 0) {
        goto done;
    }
    feat = PyTuple_GetSlice(shape, 1, dims);
    if (feat == NULL) {
        goto done;
    }
    int grad = 0, same = given >= n;
    if (same) {
        PyObject *requires = PyObject_GetAttr(hidden, tensor_attrs[ATTR_REQUIRES_GRAD]);
        grad = requires == NULL ? -1 : PyObject_IsTrue(requires);
        Py_XDECREF(requires);
        same = grad == 0;
    }
    if (grad < 0) {
        goto done;
    }
    if (same && (same = PyObject_RichCompareBool(feat, args[5], Py_EQ)) == 1) {
        same = attr_equals(hidden, ATTR_DTYPE, args[6]);
    }
    if (same == 1) {
        same = attr_equals(hidden, ATTR_DEVICE, args[4]);
    }
    if (same < 0) {
        goto done;
    }
    if (!same) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (given == n) {
        rows = Py_NewRef(hidden);
    } else {  /* padded rows (CUDA graphs): a view of the first n */
        PyObject *end = PyLong_FromLongLong((long long)n), *cut = NULL;
        if (end != NULL) {
            cut = PySlice_New(NULL, end, NULL);
            Py_DECREF(end);
        }
        if (cut == NULL) {
            goto done;
        }
        rows = PyObject_GetItem(hidden, cut);
        Py_DECREF(cut);
        if (rows == NULL) {
            goto done;
        }
    }
    out_shape = PyTuple_New(dims);
    if (out_shape == NULL) {
        goto done;
    }
    PyObject *count = PyLong_FromLongLong((long long)n);
    if (count == NULL) {
        goto done;
    }
    PyTuple_SET_ITEM(out_shape, 0, count);
    for (Py_ssize_t i = 1; i < dims; i++) {
        PyTuple_SET_ITEM(out_shape, i, Py_NewRef(PyTuple_GET_ITEM(feat, i - 1)));
    }
    result = PyTuple_Pack(2, rows, out_shape);
done:
    Py_XDECREF(out_shape);
    Py_XDECREF(rows);
    Py_XDECREF(feat);
    Py_DECREF(shape);
    return result;
}

PyDoc_STRVAR(row_ends_doc,
"row_ends(order, scheduled, ends) -> (total, smallest count)\n\n"
"ends[i] = scheduled[order[0]] + ... + scheduled[order[i]] (int64 ends, len(order) long).");

static PyObject *
row_ends(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{2, "row_ends: ends", 1, 1, 0, 1, 0}};
    IntArray ends;
    if (borrow_all("row_ends", args, nargs, 3, specs, 1, &ends) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    /* a tuple: the mapping's lookups may run Python code, which must not resize or free the
     * sequence under the loop */
    PyObject *order = PySequence_Tuple(args[0]);
    if (order == NULL) {
        goto done;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(order);
    if (ends.len != k) {
        PyErr_Format(PyExc_ValueError, "row_ends: %zd ends for %zd requests", ends.len, k);
        goto done;
    }
    int64_t total = 0, smallest = INT64_MAX, count;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *req = PyTuple_GET_ITEM(order, i);
        if (mapping_int(args[1], req, "scheduled tokens", &count) < 0) {
            goto done;
        }
        if (count < 0 || total > INT64_MAX - count) {
            PyErr_Format(count < 0 ? PyExc_ValueError : PyExc_OverflowError,
                         "row_ends: request %R: %lld scheduled tokens%s", req, (long long)count,
                         count < 0 ? "" : " overflow the step's total");
            goto done;
        }
        total += count;
        int64s(&ends)[i] = total;
        smallest = count < smallest ? count : smallest;
    }
    result = Py_BuildValue("LL", (long long)total, (long long)(k ? smallest : 0));
done:
    Py_XDECREF(order);
    release(&ends, 1);
    return result;
}

/* Runs found so far: a new run extends the last one where it starts at the last one's end. */
typedef struct {
    int64_t *runs;
    Py_ssize_t k, capacity;
    int64_t low, high;
} RunsOut;

static int
add_run(RunsOut *out, int64_t first, int64_t end)
{
    out->low = out->k == 0 || first < out->low ? first : out->low;
    out->high = out->k == 0 || end - 1 > out->high ? end - 1 : out->high;
    if (out->k > 0 && out->runs[2 * out->k - 1] == first) {
        out->runs[2 * out->k - 1] = end;
        return 0;
    }
    if (out->k == out->capacity) {
        PyErr_Format(PyExc_ValueError, "more than the %zd runs room was given for",
                     out->capacity);
        return -1;
    }
    out->runs[2 * out->k] = first;
    out->runs[2 * out->k + 1] = end;
    out->k++;
    return 0;
}

PyDoc_STRVAR(request_runs_doc,
"request_runs(req_ids, scheduled, index_of, computed, table, unit, runs) -> (k, min, max)\n\n"
"The slots of each request's next scheduled[r] positions from computed[index_of[r]], with\n"
"slot = table[index_of[r], p // unit] * unit + p % unit, as k runs of consecutive slots in\n"
"runs[:k] (int64 [capacity, 2] of (first, end)), and their min and max slot ((0, -1) for\n"
"none). Found a block at a time. Raises when a row or a block falls outside the table, or\n"
"runs has too few rows.");

/* Add the runs of `req`'s next `count` positions, from computed[index_of[req]] on (see
 * request_runs), to `out`. */
static int
add_request_runs(PyObject *req, int64_t count, PyObject *index_of, const IntArray *computed,
                 const IntArray *table, int64_t unit, RunsOut *out)
{
    int64_t row;
    if (mapping_int(index_of, req, "batch row", &row) < 0) {
        return -1;
    }
    Py_ssize_t num_rows = table->buf.shape[0], width = table->buf.shape[1];
    if (row < 0 || row >= num_rows || row >= computed->len) {
        PyErr_Format(PyExc_IndexError, "request %R: batch row %lld outside the table's %zd "
                     "rows", req, (long long)row, num_rows);
        return -1;
    }
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "request %R: %lld scheduled tokens", req,
                     (long long)count);
        return -1;
    }
    int64_t first = get_at(computed, row);
    if (first < 0 || count > INT64_MAX - first) {
        PyErr_Format(PyExc_ValueError, "request %R: %lld computed and %lld scheduled tokens "
                     "are not positions", req, (long long)first, (long long)count);
        return -1;
    }
    int64_t last = first + count - 1;
    if (count && last / unit >= width) {
        PyErr_Format(PyExc_IndexError, "request %R: positions %lld..%lld need blocks past "
                     "the table's %zd per request", req, (long long)first, (long long)last,
                     width);
        return -1;
    }
    /* block by block: the first may start mid-block, every later one at its offset 0 */
    int64_t offset = count ? first % unit : 0, left = count;
    for (int64_t block = count ? first / unit : 0; left > 0; block++, offset = 0) {
        int64_t run = unit - offset < left ? unit - offset : left;
        int64_t id = get_at(table, row * width + block);
        if (id < 0 || id > (INT64_MAX - (offset + run)) / unit) {  /* slot + run fits */
            PyErr_Format(PyExc_ValueError, "request %R: block id %lld at block %lld is not "
                         "a block of %lld slots", req, (long long)id, (long long)block,
                         (long long)unit);
            return -1;
        }
        int64_t slot = id * unit + offset;
        if (add_run(out, slot, slot + run) < 0) {
            return -1;
        }
        left -= run;
    }
    return 0;
}

static int
positive_unit(const char *fn, PyObject *obj, int64_t *unit)
{
    if (int_arg(obj, unit) < 0) {
        return -1;
    }
    if (*unit <= 0) {
        PyErr_Format(PyExc_ValueError, "%s: unit %lld must be positive", fn, (long long)*unit);
        return -1;
    }
    return 0;
}

static PyObject *
request_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{3, "request_runs: computed", 0, 1, 0, 0, 0},
                                      {4, "request_runs: table", 0, 2, 0, 0, 0},
                                      {6, "request_runs: runs", 1, 2, 2, 1, 0}};
    IntArray a[3];
    if (borrow_all("request_runs", args, nargs, 7, specs, 3, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *req_ids = NULL;
    int64_t unit;
    if (positive_unit("request_runs", args[5], &unit) < 0) {
        goto done;
    }
    req_ids = PySequence_Tuple(args[0]);  /* see row_ends */
    if (req_ids == NULL) {
        goto done;
    }
    RunsOut out = {int64s(&a[2]), 0, a[2].buf.shape[0], 0, -1};
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(req_ids); i++) {
        PyObject *req = PyTuple_GET_ITEM(req_ids, i);
        int64_t count;
        if (mapping_int(args[1], req, "scheduled tokens", &count) < 0 ||
                add_request_runs(req, count, args[2], &a[0], &a[1], unit, &out) < 0) {
            goto done;
        }
    }
    result = Py_BuildValue("nLL", out.k, (long long)out.low, (long long)out.high);
done:
    Py_XDECREF(req_ids);
    release(a, 3);
    return result;
}

/* scheduled[req] as a count, or `missing` (1) where it has none (a KeyError, cleared). */
static int
scheduled_count(PyObject *scheduled, PyObject *req, int64_t *count, int *missing)
{
    *missing = 0;
    if (mapping_int(scheduled, req, "scheduled tokens", count) == 0) {
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
        return -1;
    }
    PyErr_Clear();
    *missing = 1;
    return 0;
}

/* `order`: the batch's requests without its None entries, all of them where they are exactly
 * the scheduled ones, else those scheduled for more than 0 tokens; `counts[i]` each one's. */
static int
scheduled_order(PyObject *batch, PyObject *scheduled, PyObject *order, int64_t *counts)
{
    Py_ssize_t n = PyTuple_GET_SIZE(batch), present = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        present += PyTuple_GET_ITEM(batch, i) != Py_None;
    }
    Py_ssize_t num_scheduled = PyObject_Length(scheduled);
    if (num_scheduled < 0) {
        return -1;
    }
    int exact = present == num_scheduled, missing;
    for (int pass = exact ? 0 : 1; pass < 2; pass++) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *req = PyTuple_GET_ITEM(batch, i);
            if (req == Py_None) {
                continue;
            }
            if (scheduled_count(scheduled, req, &counts[k], &missing) < 0) {
                return -1;
            }
            if (pass == 0 && missing) {
                break;  /* not exactly the scheduled requests: those scheduled tokens */
            }
            if (pass == 1 && (missing || counts[k] <= 0)) {
                continue;
            }
            if (PyList_Append(order, req) < 0) {
                return -1;
            }
            k++;
        }
        if (pass == 0 && k == present) {
            return 0;
        }
        if (pass == 0 && PyList_SetSlice(order, 0, PyList_GET_SIZE(order), NULL) < 0) {
            return -1;
        }
    }
    return 0;
}

/* Whether the scheduled requests left out of the step's `k` are not exactly those scheduled
 * for no tokens. */
static int
rows_left_out(PyObject *scheduled, Py_ssize_t k, int *refused)
{
    Py_ssize_t left_out = PyObject_Length(scheduled);
    if (left_out < 0) {
        return -1;
    }
    left_out -= k;
    if (left_out == 0) {
        return 0;
    }
    PyObject *values = PyMapping_Values(scheduled);
    if (values == NULL) {
        return -1;
    }
    Py_ssize_t idle = 0;
    int64_t count;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values); i++) {
        if (int_arg(PyList_GET_ITEM(values, i), &count) < 0) {
            Py_DECREF(values);
            return -1;
        }
        idle += count <= 0;
    }
    Py_DECREF(values);
    *refused = left_out != idle;
    return 0;
}

PyDoc_STRVAR(step_layout_doc,
"step_layout(batch, scheduled, index_of, computed, table, unit, empty, num_rows)\n"
"-> (order, ends, total, smallest, runs, min, max)\n\n"
"A step's rows and slots in one call. order: the batch's requests (its None entries left\n"
"out) in batch order, all of them where they are exactly the scheduled requests, else those\n"
"scheduled for more than 0 tokens; ends: their row ends as row_ends makes them, total and\n"
"smallest too; runs: their slots as request_runs finds them, [k, 2], and their min and max\n"
"slot; runs None (min and max 0 and -1) where total is not num_rows, a request of order is\n"
"scheduled for no tokens, or the scheduled requests order leaves out are not those\n"
"scheduled for none (the step is refused for its rows). ends and runs are made by\n"
"empty(shape), an int64 numpy.empty.");

static PyObject *
step_layout(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{3, "step_layout: computed", 0, 1, 0, 0, 0},
                                      {4, "step_layout: table", 0, 2, 0, 0, 0}};
    static const ArraySpec ends_spec = {0, "step_layout: ends", 1, 1, 0, 1, 0};
    static const ArraySpec runs_spec = {0, "step_layout: runs", 1, 2, 2, 1, 0};
    IntArray a[2], made[2] = {{.held = 0}, {.held = 0}};
    if (borrow_all("step_layout", args, nargs, 8, specs, 2, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *batch = NULL, *order = NULL, *ends = NULL, *runs = NULL;
    PyObject *cut = NULL;
    int64_t *counts = NULL, unit, num_rows;
    if (positive_unit("step_layout", args[5], &unit) < 0 || int_arg(args[7], &num_rows) < 0) {
        goto done;
    }
    batch = PySequence_Tuple(args[0]);  /* see row_ends */
    order = PyList_New(0);
    if (batch == NULL || order == NULL) {
        goto done;
    }
    counts = PyMem_Malloc((PyTuple_GET_SIZE(batch) + 1) * sizeof(int64_t));
    if (counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (scheduled_order(batch, args[1], order, counts) < 0) {
        goto done;
    }
    Py_ssize_t k = PyList_GET_SIZE(order);
    int64_t total = 0, smallest = INT64_MAX;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (counts[i] < 0 || total > INT64_MAX - counts[i]) {
            PyErr_Format(counts[i] < 0 ? PyExc_ValueError : PyExc_OverflowError,
                         "step_layout: request %R: %lld scheduled tokens%s",
                         PyList_GET_ITEM(order, i), (long long)counts[i],
                         counts[i] < 0 ? "" : " overflow the step's total");
            goto done;
        }
        total += counts[i];
        smallest = counts[i] < smallest ? counts[i] : smallest;
    }
    ends = PyObject_CallFunction(args[6], "(n)", k);
    if (ends == NULL || borrow(ends, &ends_spec, &made[0]) < 0) {
        goto done;
    }
    if (made[0].len != k) {
        PyErr_Format(PyExc_ValueError, "step_layout: empty(%zd) made %zd ends", k, made[0].len);
        goto done;
    }
    int64_t end = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64s(&made[0])[i] = end += counts[i];
    }
    int refused = total != num_rows || (k && smallest <= 0);
    if (!refused && rows_left_out(args[1], k, &refused) < 0) {
        goto done;
    }
    if (refused) {
        result = Py_BuildValue("OOLLOii", order, ends, (long long)total,
                               (long long)(k ? smallest : 0), Py_None, 0, -1);
        goto done;
    }
    /* a request's positions span at most count // unit + 2 blocks */
    runs = PyObject_CallFunction(args[6], "((Ln))", (long long)(total / unit) + 2 * k,
                                 (Py_ssize_t)2);
    if (runs == NULL || borrow(runs, &runs_spec, &made[1]) < 0) {
        goto done;
    }
    RunsOut out = {int64s(&made[1]), 0, made[1].buf.shape[0], 0, -1};
    for (Py_ssize_t i = 0; i < k; i++) {
        if (add_request_runs(PyList_GET_ITEM(order, i), counts[i], args[2], &a[0], &a[1], unit,
                             &out) < 0) {
            goto done;
        }
    }
    cut = PySequence_GetSlice(runs, 0, out.k);
    if (cut == NULL) {
        goto done;
    }
    result = Py_BuildValue("OOLLOLL", order, ends, (long long)total,
                           (long long)(k ? smallest : 0), cut, (long long)out.low,
                           (long long)out.high);
done:
    release(made, 2);
    PyMem_Free(counts);
    Py_XDECREF(cut);
    Py_XDECREF(runs);
    Py_XDECREF(ends);
    Py_XDECREF(order);
    Py_XDECREF(batch);
    release(a, 2);
    return result;
}

PyDoc_STRVAR(slot_runs_doc,
"slot_runs(slots, runs) -> (number of runs, min slot, max slot)\n\n"
"Cuts int64 slots into runs of consecutive slots: runs[i] = (first, end), int64 [n, 2] with\n"
"n >= len(slots). The bounds of no slots are (0, -1).");

static PyObject *
slot_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{0, "slot_runs: slots", 0, 1, 0, 1, 0},
                                      {1, "slot_runs: runs", 1, 2, 2, 1, 0}};
    IntArray a[2];
    if (borrow_all("slot_runs", args, nargs, 2, specs, 2, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const int64_t *s = int64s(&a[0]);
    Py_ssize_t n = a[0].len;
    if (a[1].buf.shape[0] < n) {
        PyErr_Format(PyExc_ValueError, "slot_runs: runs must be [>= %zd, 2], got [%zd, 2]", n,
                     a[1].buf.shape[0]);
        goto done;
    }
    RunsOut out = {int64s(&a[1]), 0, a[1].buf.shape[0], 0, -1};
    for (Py_ssize_t i = 0; i < n; i++) {  /* a slot after the last run's end extends it */
        add_run(&out, s[i], s[i] + 1);  /* cannot fail: room for a run per slot */
    }
    result = Py_BuildValue("nLL", out.k, (long long)out.low, (long long)out.high);
done:
    release(a, 2);
    return result;
}

/* The slots k runs hold, and their min and max ((0, 0, -1) for none); raises unless each run
 * is non-empty. */
typedef struct {
    int64_t count, low, high;
} RunTotals;

static int
run_totals(const IntArray *runs, const char *name, RunTotals *out)
{
    const int64_t *r = int64s(runs);
    *out = (RunTotals){0, 0, -1};
    for (Py_ssize_t i = 0; i < runs->buf.shape[0]; i++) {
        if (r[2 * i] < 0 || r[2 * i] >= r[2 * i + 1]) {
            PyErr_Format(PyExc_ValueError, "%s: run %zd, %lld..%lld, is empty or negative", name,
                         i, (long long)r[2 * i], (long long)r[2 * i + 1]);
            return -1;
        }
        int64_t len = r[2 * i + 1] - r[2 * i];  /* no overflow: 0 <= first < end */
        if (out->count > INT64_MAX - len) {
            PyErr_Format(PyExc_OverflowError, "%s: the runs hold more than 2**63 - 1 slots", name);
            return -1;
        }
        out->count += len;
        out->low = i == 0 || r[2 * i] < out->low ? r[2 * i] : out->low;
        out->high = i == 0 || r[2 * i + 1] - 1 > out->high ? r[2 * i + 1] - 1 : out->high;
    }
    return 0;
}

PyDoc_STRVAR(run_stats_doc,
"run_stats(runs) -> (slots, min, max) of int64 runs [k, 2] of (first, end); (0, 0, -1) for\n"
"none. Raises if a run is empty or reversed.");

static PyObject *
run_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{0, "run_stats: runs", 0, 2, 2, 1, 0}};
    IntArray runs;
    if (borrow_all("run_stats", args, nargs, 1, specs, 1, &runs) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    RunTotals totals;
    if (run_totals(&runs, "run_stats", &totals) == 0) {
        result = Py_BuildValue("LLL", (long long)totals.count, (long long)totals.low,
                               (long long)totals.high);
    }
    release(&runs, 1);
    return result;
}

PyDoc_STRVAR(runs_slots_doc,
"runs_slots(runs, out) -> None\n\n"
"out = the slots of int64 runs [k, 2] of (first, end), in order; out is int64 and exactly\n"
"as long as the runs hold slots.");

static PyObject *
runs_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{0, "runs_slots: runs", 0, 2, 2, 1, 0},
                                      {1, "runs_slots: out", 1, 1, 0, 1, 0}};
    IntArray a[2];
    if (borrow_all("runs_slots", args, nargs, 2, specs, 2, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    RunTotals totals;
    if (run_totals(&a[0], "runs_slots", &totals) < 0) {
        goto done;
    }
    if (totals.count != a[1].len) {
        PyErr_Format(PyExc_ValueError, "runs_slots: the runs hold %lld slots, out has room for "
                     "%zd", (long long)totals.count, a[1].len);
        goto done;
    }
    const int64_t *r = int64s(&a[0]);
    int64_t *dst = int64s(&a[1]);
    for (Py_ssize_t i = 0; i < a[0].buf.shape[0]; i++) {
        for (int64_t slot = r[2 * i]; slot < r[2 * i + 1]; slot++) {
            *dst++ = slot;
        }
    }
    result = Py_NewRef(Py_None);
done:
    release(a, 2);
    return result;
}

/* A run [first, end) cut at block boundaries: slots head..head_end-1, then whole blocks
 * block..block_end-1, then slots tail..end-1 (any part may be empty). */
typedef struct {
    int64_t head, head_end, block, block_end, tail, end;
} RunParts;

static inline RunParts
run_parts(int64_t first, int64_t end, int64_t block_size)
{
    int64_t up = (first + block_size - 1) / block_size, down = end / block_size;
    int64_t head_end = up * block_size < end ? up * block_size : end;
    int64_t tail = down * block_size > head_end ? down * block_size : head_end;
    return (RunParts){first, head_end, up, up < down ? down : up, tail, end};
}

/* Tier tables are `slots` long and `slots / block_size` blocks long; raise unless so. */
static int
check_tiers(const char *fn, int64_t block_size, const IntArray *slot_tier,
            const IntArray *block_tier)
{
    if (block_size <= 0 || slot_tier->len % block_size ||
            block_tier->len != slot_tier->len / block_size) {
        PyErr_Format(PyExc_ValueError, "%s: a slot tier of %zd and a block tier of %zd do not "
                     "make blocks of %lld slots", fn, slot_tier->len, block_tier->len,
                     (long long)block_size);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(any_held_doc,
"any_held(runs, block_size, held_from, slot_claim, block_claim, newest, read_pins,\n"
"         block_pins) -> bool\n\n"
"Whether some slot of the runs carries a claim >= held_from (the larger of its slot's and\n"
"its block's entries; newest: each block's largest slot entry since its block entry was\n"
"written) or is pinned (read_pins per slot, block_pins their sum per block; both None: no\n"
"slot is). A run's whole blocks cost one look each.");

static PyObject *
any_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{0, "any_held: runs", 0, 2, 2, 1, 0},
                                      {3, "any_held: slot_claim", 0, 1, 0, 1, 0},
                                      {4, "any_held: block_claim", 0, 1, 0, 1, 0},
                                      {5, "any_held: newest", 0, 1, 0, 1, 0},
                                      {6, "any_held: read_pins", 0, 1, 0, 0, 1},
                                      {7, "any_held: block_pins", 0, 1, 0, 0, 1}};
    IntArray a[6];
    if (borrow_all("any_held", args, nargs, 8, specs, 6, a) < 0) {
        return NULL;
    }
    const IntArray *pins = &a[4], *block_pins = &a[5];
    PyObject *result = NULL;
    int64_t bs, held_from;
    if (int_arg(args[1], &bs) < 0 || int_arg(args[2], &held_from) < 0 ||
            check_tiers("any_held", bs, &a[1], &a[2]) < 0) {
        goto done;
    }
    if (a[3].len != a[2].len || pins->held != block_pins->held ||
            (pins->held && (pins->len != a[1].len || block_pins->len != a[2].len))) {
        PyErr_Format(PyExc_ValueError, "any_held: newest (%zd), read_pins (%zd) and block_pins "
                     "(%zd) must match %zd slots in %zd blocks, the pins both given or both "
                     "None", a[3].len, pins->len, block_pins->len, a[1].len, a[2].len);
        goto done;
    }
    if (check_runs(&a[0], a[1].len, "any_held: runs") < 0) {
        goto done;
    }
    const int64_t *r = int64s(&a[0]), *slot_claim = int64s(&a[1]);
    const int64_t *block_claim = int64s(&a[2]), *newest = int64s(&a[3]);
    int found = 0;
    for (Py_ssize_t i = 0; i < a[0].buf.shape[0] && !found; i++) {
        RunParts p = run_parts(r[2 * i], r[2 * i + 1], bs);
        for (int64_t b = p.block; b < p.block_end; b++) {
            found |= block_claim[b] >= held_from || newest[b] >= held_from ||
                     (pins->held && get_at(block_pins, b) != 0);
        }
        for (int pass = 0; pass < 2; pass++) {
            int64_t slot = pass ? p.tail : p.head, stop = pass ? p.end : p.head_end;
            for (; slot < stop; slot++) {
                found |= slot_claim[slot] >= held_from || block_claim[slot / bs] >= held_from ||
                         (pins->held && get_at(pins, slot) != 0);
            }
        }
    }
    result = PyBool_FromLong(found);
done:
    release(a, 6);
    return result;
}

PyDoc_STRVAR(row_states_doc,
"row_states(slots, block_size, slot_claim, block_claim, slot_version, block_version,\n"
"           slot_producer, block_producer, state, producers) -> (present, lost)\n\n"
"Per slot of slots, one key's row there: state[i] = 1 where its version (the larger in\n"
"magnitude of its slot's and its block's entries) is the slot's claim (the larger of its\n"
"two), -1 where it is minus the claim (lost to a failed write), else 0 (also for a slot never\n"
"claimed); the producer of each present row, from the tier its version was, in\n"
"producers[:present] in the order of slots. state: int32, as long as slots; producers: int64,\n"
"at least as long. Raises before writing if a slot is outside the tables.");

static PyObject *
row_states(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{0, "row_states: slots", 0, 1, 0, 0, 0},
                                      {2, "row_states: slot_claim", 0, 1, 0, 1, 0},
                                      {3, "row_states: block_claim", 0, 1, 0, 1, 0},
                                      {4, "row_states: slot_version", 0, 1, 0, 1, 0},
                                      {5, "row_states: block_version", 0, 1, 0, 1, 0},
                                      {6, "row_states: slot_producer", 0, 1, 0, 1, 0},
                                      {7, "row_states: block_producer", 0, 1, 0, 1, 0},
                                      {8, "row_states: state", 1, 1, 0, 0, 0},
                                      {9, "row_states: producers", 1, 1, 0, 1, 0}};
    IntArray a[9];
    if (borrow_all("row_states", args, nargs, 10, specs, 9, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const IntArray *slots = &a[0], *state = &a[7];
    int64_t bs;
    if (int_arg(args[1], &bs) < 0 || check_tiers("row_states", bs, &a[1], &a[2]) < 0 ||
            check_tiers("row_states", bs, &a[3], &a[4]) < 0 ||
            check_tiers("row_states", bs, &a[5], &a[6]) < 0) {
        goto done;
    }
    if (a[3].len != a[1].len || a[5].len != a[1].len || state->wide ||
            state->len != slots->len || a[8].len < slots->len) {
        PyErr_Format(PyExc_ValueError, "row_states: tables of %zd, %zd and %zd slots; state "
                     "(int32) of %zd and producers of %zd for %zd slots", a[1].len, a[3].len,
                     a[5].len, state->len, a[8].len, slots->len);
        goto done;
    }
    for (Py_ssize_t i = 0; i < slots->len; i++) {
        int64_t slot = get_at(slots, i);
        if (slot < 0 || slot >= a[1].len) {
            PyErr_Format(PyExc_IndexError, "row_states: slot %lld outside the pool's %zd",
                         (long long)slot, a[1].len);
            goto done;
        }
    }
    const int64_t *slot_claim = int64s(&a[1]), *block_claim = int64s(&a[2]);
    const int64_t *slot_version = int64s(&a[3]), *block_version = int64s(&a[4]);
    const int64_t *slot_producer = int64s(&a[5]), *block_producer = int64s(&a[6]);
    int32_t *out = (int32_t *)state->buf.buf;
    int64_t *producers = int64s(&a[8]);
    Py_ssize_t present = 0, lost = 0;
    for (Py_ssize_t i = 0; i < slots->len; i++) {
        int64_t slot = get_at(slots, i), block = slot / bs;
        int64_t claim = slot_claim[slot] > block_claim[block] ? slot_claim[slot]
                                                                : block_claim[block];
        int64_t by_slot = slot_version[slot], by_block = block_version[block];
        int from_block = llabs(by_block) > llabs(by_slot);
        int64_t version = from_block ? by_block : by_slot;
        int32_t s = claim == 0 ? 0 : version == claim ? 1 : version == -claim ? -1 : 0;
        out[i] = s;
        if (s > 0) {
            producers[present++] = from_block ? block_producer[block] : slot_producer[slot];
        }
        lost += s < 0;
    }
    result = Py_BuildValue("nn", present, lost);
done:
    release(a, 9);
    return result;
}

PyDoc_STRVAR(add_pins_doc,
"add_pins(slots, block_size, read_pins, block_pins, delta) -> None\n\n"
"read_pins[s] += delta and block_pins[s // block_size] += delta for each of the int64 slots\n"
"(int32 counts per slot and per block); raises before counting if a slot is out of range.");

static PyObject *
add_pins(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{0, "add_pins: slots", 0, 1, 0, 1, 0},
                                      {2, "add_pins: read_pins", 1, 1, 0, 0, 0},
                                      {3, "add_pins: block_pins", 1, 1, 0, 0, 0}};
    IntArray a[3];
    if (borrow_all("add_pins", args, nargs, 5, specs, 3, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    int64_t bs, delta;
    if (int_arg(args[1], &bs) < 0 || int_arg(args[4], &delta) < 0 ||
            check_tiers("add_pins", bs, &a[1], &a[2]) < 0) {
        goto done;
    }
    if (a[1].wide || a[2].wide) {
        PyErr_SetString(PyExc_TypeError, "add_pins: pins must be int32 counts");
        goto done;
    }
    const int64_t *slots = int64s(&a[0]);
    for (Py_ssize_t i = 0; i < a[0].len; i++) {
        if (slots[i] < 0 || slots[i] >= a[1].len) {
            PyErr_Format(PyExc_IndexError, "add_pins: slot %lld (index %zd) is outside "
                         "0..%zd", (long long)slots[i], i, a[1].len - 1);
            goto done;
        }
    }
    int32_t *pins = (int32_t *)a[1].buf.buf, *block_pins = (int32_t *)a[2].buf.buf;
    for (Py_ssize_t i = 0; i < a[0].len; i++) {
        pins[slots[i]] += (int32_t)delta;
        block_pins[slots[i] / bs] += (int32_t)delta;
    }
    result = Py_NewRef(Py_None);
done:
    release(a, 3);
    return result;
}

/* value at every slot of the (checked) runs: whole blocks into `blocks`, the other slots into
 * `slots`; `marks` (or NULL) per block: value where a slot entry was written, 0 where the
 * block entry was. */
static void
fill_runs(const IntArray *runs, int64_t bs, int64_t *slots, int64_t *blocks, int64_t value,
          int64_t *marks)
{
    const int64_t *r = int64s(runs);
    for (Py_ssize_t i = 0; i < runs->buf.shape[0]; i++) {
        RunParts p = run_parts(r[2 * i], r[2 * i + 1], bs);
        for (int64_t b = p.block; b < p.block_end; b++) {
            blocks[b] = value;
            if (marks) {
                marks[b] = 0;
            }
        }
        for (int pass = 0; pass < 2; pass++) {
            int64_t slot = pass ? p.tail : p.head, stop = pass ? p.end : p.head_end;
            for (; slot < stop; slot++) {
                slots[slot] = value;
            }
            if (marks && slot > (pass ? p.tail : p.head)) {
                marks[(slot - 1) / bs] = value;
            }
        }
    }
}

#define MAX_FILLS 2

PyDoc_STRVAR(fill_tiers_doc,
"fill_tiers(runs, block_size, newest, slots, blocks, value[, slots, blocks, value]) -> None\n\n"
"Writes value at every slot of the runs into one or two tiered int64 tables: a run's whole\n"
"blocks into the block tier, its other slots into the slot tier. newest (int64 per block, or\n"
"None) tracks the first table's slot tier: value where a slot entry was written, 0 where the\n"
"block entry was. Raises before writing if a run is not a range within the tables.");

static PyObject *
fill_tiers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t fills = (nargs - 3) / 3;
    if (nargs < 6 || (nargs - 3) % 3 || fills > MAX_FILLS) {
        return PyErr_Format(PyExc_TypeError, "fill_tiers takes runs, block_size, newest and 1 "
                            "to %d (slots, blocks, value) triples, got %zd arguments",
                            MAX_FILLS, nargs);
    }
    ArraySpec specs[2 + 2 * MAX_FILLS] = {{0, "fill_tiers: runs", 0, 2, 2, 1, 0},
                                          {2, "fill_tiers: newest", 1, 1, 0, 1, 1}};
    for (Py_ssize_t t = 0; t < fills; t++) {
        specs[2 + 2 * t] = (ArraySpec){3 + 3 * t, "fill_tiers: slots", 1, 1, 0, 1, 0};
        specs[3 + 2 * t] = (ArraySpec){4 + 3 * t, "fill_tiers: blocks", 1, 1, 0, 1, 0};
    }
    IntArray a[2 + 2 * MAX_FILLS];
    if (borrow_all("fill_tiers", args, nargs, nargs, specs, 2 + 2 * fills, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const IntArray *newest = &a[1];
    int64_t bs, values[MAX_FILLS];
    if (int_arg(args[1], &bs) < 0) {
        goto done;
    }
    for (Py_ssize_t t = 0; t < fills; t++) {
        if (int_arg(args[5 + 3 * t], &values[t]) < 0 ||
                check_tiers("fill_tiers", bs, &a[2 + 2 * t], &a[3 + 2 * t]) < 0) {
            goto done;
        }
        if (a[2 + 2 * t].len != a[2].len) {
            PyErr_Format(PyExc_ValueError, "fill_tiers: tables of %zd and %zd slots", a[2].len,
                         a[2 + 2 * t].len);
            goto done;
        }
    }
    if (newest->held && newest->len != a[3].len) {
        PyErr_Format(PyExc_ValueError, "fill_tiers: newest has %zd entries for %zd blocks",
                     newest->len, a[3].len);
        goto done;
    }
    if (check_runs(&a[0], a[2].len, "fill_tiers: runs") < 0) {
        goto done;
    }
    for (Py_ssize_t t = 0; t < fills; t++) {
        fill_runs(&a[0], bs, int64s(&a[2 + 2 * t]), int64s(&a[3 + 2 * t]), values[t],
                  t == 0 && newest->held ? int64s(newest) : NULL);
    }
    result = Py_NewRef(Py_None);
done:
    release(a, 2 + 2 * fills);
    return result;
}

/* The tables a key's write fills, in claim_write's order. */
#define WRITE_TABLES 4

PyDoc_STRVAR(claim_write_doc,
"claim_write(runs, block_size, newest, claim_slots, claim_blocks, claim, writes, producer)\n"
"-> None\n\n"
"A step's claim and its write's record in one call: fill_tiers(runs, block_size, newest,\n"
"claim_slots, claim_blocks, claim), then, for each (version_slots, version_blocks,\n"
"producer_slots, producer_blocks) of the sequence writes, fill_tiers(runs, block_size,\n"
"None, version_slots, version_blocks, claim, producer_slots, producer_blocks, producer).\n"
"Every table is checked before any is written: one that raises leaves them all unchanged.");

static PyObject *
claim_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const ArraySpec specs[] = {{0, "claim_write: runs", 0, 2, 2, 1, 0},
                                      {2, "claim_write: newest", 1, 1, 0, 1, 0},
                                      {3, "claim_write: claim_slots", 1, 1, 0, 1, 0},
                                      {4, "claim_write: claim_blocks", 1, 1, 0, 1, 0}};
    static const ArraySpec table_spec = {0, "claim_write: a write's table", 1, 1, 0, 1, 0};
    IntArray a[4], *tables = NULL;
    Py_ssize_t num_tables = 0;  /* calloc'ed: those not borrowed yet hold nothing */
    if (borrow_all("claim_write", args, nargs, 8, specs, 4, a) < 0) {
        return NULL;
    }
    PyObject *result = NULL, *writes = NULL;
    int64_t bs, claim, producer;
    if (int_arg(args[1], &bs) < 0 || int_arg(args[5], &claim) < 0 ||
            int_arg(args[7], &producer) < 0 ||
            check_tiers("claim_write", bs, &a[2], &a[3]) < 0) {
        goto done;
    }
    if (a[1].len != a[3].len) {
        PyErr_Format(PyExc_ValueError, "claim_write: newest has %zd entries for %zd blocks",
                     a[1].len, a[3].len);
        goto done;
    }
    if (check_runs(&a[0], a[2].len, "claim_write: runs") < 0) {
        goto done;
    }
    writes = PySequence_Tuple(args[6]);
    if (writes == NULL) {
        goto done;
    }
    Py_ssize_t num_writes = PyTuple_GET_SIZE(writes);
    tables = PyMem_Calloc(num_writes ? num_writes * WRITE_TABLES : 1, sizeof(IntArray));
    if (tables == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    num_tables = num_writes * WRITE_TABLES;
    for (Py_ssize_t w = 0; w < num_writes; w++) {
        PyObject *write = PyTuple_GET_ITEM(writes, w);
        if (!PyTuple_Check(write) || PyTuple_GET_SIZE(write) != WRITE_TABLES) {
            PyErr_Format(PyExc_TypeError, "claim_write: write %zd must be a tuple of %d tables, "
                         "got %.80s", w, WRITE_TABLES, Py_TYPE(write)->tp_name);
            goto done;
        }
        IntArray *w_tables = &tables[w * WRITE_TABLES];
        for (int t = 0; t < WRITE_TABLES; t++) {
            if (borrow(PyTuple_GET_ITEM(write, t), &table_spec, &w_tables[t]) < 0) {
                goto done;
            }
        }
        if (check_tiers("claim_write", bs, &w_tables[0], &w_tables[1]) < 0 ||
                check_tiers("claim_write", bs, &w_tables[2], &w_tables[3]) < 0) {
            goto done;
        }
        if (w_tables[0].len != a[2].len || w_tables[2].len != a[2].len) {
            PyErr_Format(PyExc_ValueError, "claim_write: write %zd's tables of %zd and %zd "
                         "slots for a pool of %zd", w, w_tables[0].len, w_tables[2].len,
                         a[2].len);
            goto done;
        }
    }
    fill_runs(&a[0], bs, int64s(&a[2]), int64s(&a[3]), claim, int64s(&a[1]));
    for (Py_ssize_t w = 0; w < num_writes; w++) {
        IntArray *w_tables = &tables[w * WRITE_TABLES];
        fill_runs(&a[0], bs, int64s(&w_tables[0]), int64s(&w_tables[1]), claim, NULL);
        fill_runs(&a[0], bs, int64s(&w_tables[2]), int64s(&w_tables[3]), producer, NULL);
    }
    result = Py_NewRef(Py_None);
done:
    if (tables != NULL) {
        release(tables, num_tables);
        PyMem_Free(tables);
    }
    Py_XDECREF(writes);
    release(a, 4);
    return result;
}

/* A borrowed 2-D C-contiguous array of bytes: rows of `width` bytes. */
typedef struct {
    Py_buffer buf;
    Py_ssize_t rows, width;
    int held;
} ByteRows;

/* Rows read in place at a host address: `(address, n, W)`, n rows of W bytes that the caller
 * keeps alive and unchanged for the call (a contiguous CPU tensor's data_ptr(): no numpy view
 * of it to make, about 3 us a step on the engine thread). */
static int
address_rows(const char *fn, PyObject *obj, const char *name, ByteRows *out)
{
    if (PyTuple_GET_SIZE(obj) != 3) {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected (address, rows, row bytes), got a tuple "
                     "of %zd", fn, name, PyTuple_GET_SIZE(obj));
        return -1;
    }
    void *address = PyLong_AsVoidPtr(PyTuple_GET_ITEM(obj, 0));
    Py_ssize_t rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(obj, 1));
    Py_ssize_t width = PyLong_AsSsize_t(PyTuple_GET_ITEM(obj, 2));
    if (PyErr_Occurred()) {
        return -1;
    }
    if (rows < 0 || width < 0 || (width && rows > PY_SSIZE_T_MAX / width) ||
            (address == NULL && rows && width)) {
        PyErr_Format(PyExc_ValueError, "%s: %s: %zd rows of %zd bytes at address %p", fn, name,
                     rows, width, address);
        return -1;
    }
    memset(&out->buf, 0, sizeof out->buf);
    out->buf.buf = address;
    out->buf.len = rows * width;
    out->rows = rows;
    out->width = width;
    return 0;
}

static int
borrow_rows(const char *fn, PyObject *obj, const char *name, int writable, ByteRows *out)
{
    out->held = 0;
    if (!writable && PyTuple_Check(obj)) {
        return address_rows(fn, obj, name, out);
    }
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->buf, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected a C-contiguous%s 2-D uint8 "
                     "array, got %.80s", fn, name, writable ? " writable" : "",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    out->held = 1;
    const char *fmt = out->buf.format ? out->buf.format : "B";
    while (*fmt == '@' || *fmt == '=' || *fmt == '<' || *fmt == '>' || *fmt == '!') {
        fmt++;
    }
    if (out->buf.itemsize != 1 || out->buf.ndim != 2 || (*fmt != 'B' && *fmt != 'b') ||
            fmt[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "%s: %s: expected a 2-D uint8 array, got format "
                     "'%s', %zd-byte items, %d dims", fn, name, out->buf.format,
                     out->buf.itemsize, out->buf.ndim);
        return -1;
    }
    out->rows = out->buf.shape[0];
    out->width = out->buf.shape[1];
    return 0;
}

/* Copies at least this many bytes run with the GIL released; a smaller one is over before
 * another thread could use the GIL, and taking it back could wait a switch interval. */
#define COPY_ROWS_NOGIL_BYTES (64 << 10)

/* Runs at least this long are written with non-temporal stores where the processor has them
 * (SSE2, every x86-64): a pool's rows are not read again soon, and stores that bypass the
 * cache skip reading each destination line first (a third of a large copy's memory traffic)
 * and leave the forward's weights in the cache. Shorter runs take memcpy. */
#define COPY_ROWS_STREAM_BYTES (64 << 10)

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM_STORES 1

/* memcpy(dst, src, len) through 16-byte streaming stores; the unaligned head and tail of dst
 * through memcpy. The caller fences (_mm_sfence) before any later store. */
static void
stream_copy(char *dst, const char *src, size_t len)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > len) {
        head = len;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    size_t i = 0;
    for (; i + 64 <= len; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    for (; i + 16 <= len; i += 16) {
        _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
    }
    memcpy(dst + i, src + i, len - i);
}
#else
#define HAVE_STREAM_STORES 0
#endif

/* Which way a copy runs between a caller's rows (one per index) and a pool's slots. */
typedef enum { INTO_SLOTS, FROM_SLOTS } Direction;

/* Copy rows [lo, hi) between `rows` and the pool's `slots`, a run of consecutive slots at a
 * time (the slots were checked). Streaming stores for long runs are fenced before return. */
static void
copy_slot_runs(char *rows, char *pool, const int64_t *s, Py_ssize_t lo, Py_ssize_t hi,
               size_t row, Direction dir)
{
    if (row == 0) {
        return;
    }
    for (Py_ssize_t i = lo; i < hi;) {
        Py_ssize_t first = i;
        /* s[i] < num_slots <= PY_SSIZE_T_MAX, so s[i] + 1 cannot overflow */
        while (++i < hi && s[i] == s[i - 1] + 1) {
        }
        char *at_rows = rows + (size_t)first * row, *at_pool = pool + (size_t)s[first] * row;
        char *to = dir == INTO_SLOTS ? at_pool : at_rows;
        const char *from = dir == INTO_SLOTS ? at_rows : at_pool;
        size_t len = (size_t)(i - first) * row;
#if HAVE_STREAM_STORES
        if (len >= COPY_ROWS_STREAM_BYTES) {
            stream_copy(to, from, len);
            /* streaming stores are ordered with no other store: fence them before any later
             * one (a row given the same slot again, the caller's flags after the call) */
            _mm_sfence();
            continue;
        }
#endif
        memcpy(to, from, len);
    }
}

/* Copies are split across at most this many threads, each given at least SPLIT_BYTES: below
 * that, handing a share to another thread costs more than its share takes (a step's own rows,
 * up to a few hundred tokens', stay on the calling thread: split at 512 KiB, M5 on the 2-core
 * machine fell from 0.86-0.89 to 0.80-0.87). */
#define MAX_COPY_THREADS 16
#define SPLIT_BYTES (2 << 20)

/* One share of a split copy: rows [lo, hi). */
typedef struct {
    char *rows, *pool;
    const int64_t *slots;
    Py_ssize_t lo, hi;
    size_t row;
    Direction dir;
} CopyPart;

/* The copy threads, started on first need and kept for the process's life: starting and
 * joining 7 threads took 130-200 us on the 2-core machine, as long as the 16 MiB gather they
 * share on a 16-core host. One split copy at a time uses them (`busy`); a copy that finds them
 * busy runs on its caller alone rather than wait. Invariant: a part is taken (next++) by one
 * thread, and `left` counts the parts not yet finished. A forked child starts with none. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t posted, finished;
    int threads;            /* started and waiting for work */
    int busy;               /* a copy owns parts[] until its last part finishes */
    const CopyPart *parts;  /* the current copy's parts; parts[0] is its caller's */
    int count, next, left;
} copy_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
               0, 0, NULL, 0, 0, 0};

static void
copy_part(const CopyPart *part)
{
    copy_slot_runs(part->rows, part->pool, part->slots, part->lo, part->hi, part->row, part->dir);
}

/* Take and run parts of the current copy until none is left untaken; hold copy_pool.lock. */
static void
run_parts_locked(void)
{
    while (copy_pool.next < copy_pool.count) {
        const CopyPart *part = &copy_pool.parts[copy_pool.next++];
        pthread_mutex_unlock(&copy_pool.lock);
        copy_part(part);
        pthread_mutex_lock(&copy_pool.lock);
        if (--copy_pool.left == 0) {
            pthread_cond_signal(&copy_pool.finished);
        }
    }
}

static void *
copy_thread(void *unused)
{
    (void)unused;
    pthread_mutex_lock(&copy_pool.lock);
    for (;;) {
        while (copy_pool.next >= copy_pool.count) {
            pthread_cond_wait(&copy_pool.posted, &copy_pool.lock);
        }
        run_parts_locked();
    }
    return NULL;
}

/* In a forked child: no copy thread exists there, and the lock may have been held by one. */
static void
copy_pool_after_fork(void)
{
    pthread_mutex_init(&copy_pool.lock, NULL);
    pthread_cond_init(&copy_pool.posted, NULL);
    pthread_cond_init(&copy_pool.finished, NULL);
    copy_pool.threads = copy_pool.busy = copy_pool.count = copy_pool.next = copy_pool.left = 0;
    copy_pool.parts = NULL;
}

/* Start copy threads until `want` wait for work, or one cannot start; hold copy_pool.lock. */
static void
grow_copy_pool_locked(int want)
{
    while (copy_pool.threads < want) {
        pthread_t thread;
        pthread_attr_t attr;
        if (pthread_attr_init(&attr) != 0) {
            return;
        }
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&thread, &attr, copy_thread, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            return;  /* the threads already started, and the caller, take every part */
        }
        copy_pool.threads++;
    }
}

/* Run `count` parts, the caller's thread and the kept copy threads taking them as they go (up to
 * `threads` - 1 copy threads started for them, no more than there are parts for): the caller
 * copies the first and takes any left over. Returns once every part is copied. Call without
 * the GIL. */
static void
copy_parts(const CopyPart *parts, int count, int threads)
{
    if (count <= 1 || threads <= 1) {
        goto alone;
    }
    pthread_mutex_lock(&copy_pool.lock);  /* never held across a copy: a short wait at most */
    if (copy_pool.busy) {
        pthread_mutex_unlock(&copy_pool.lock);
        goto alone;
    }
    grow_copy_pool_locked((threads < count ? threads : count) - 1);
    copy_pool.busy = 1;
    copy_pool.parts = parts;
    copy_pool.count = count;
    copy_pool.next = 1;  /* part 0 is the caller's */
    copy_pool.left = count - 1;
    pthread_cond_broadcast(&copy_pool.posted);
    pthread_mutex_unlock(&copy_pool.lock);
    copy_part(&parts[0]);
    pthread_mutex_lock(&copy_pool.lock);
    run_parts_locked();  /* the parts no thread took yet (none could start, or all are slow) */
    while (copy_pool.left > 0) {
        pthread_cond_wait(&copy_pool.finished, &copy_pool.lock);
    }
    copy_pool.busy = 0;
    copy_pool.parts = NULL;
    copy_pool.count = copy_pool.next = 0;
    pthread_mutex_unlock(&copy_pool.lock);
    return;
alone:
    for (int i = 0; i < count; i++) {
        copy_part(&parts[i]);
    }
}

/* How many threads copy `total` bytes, given `threads`: one per SPLIT_BYTES, 1 to
 * MAX_COPY_THREADS. */
static int
split_count(size_t total, long threads)
{
    size_t most = total / SPLIT_BYTES;
    size_t count = (size_t)threads < most ? (size_t)threads : most;
    return count < 1 ? 1 : count > MAX_COPY_THREADS ? MAX_COPY_THREADS : (int)count;
}

/* Rows [0, n) copied in up to `threads` contiguous shares of at least SPLIT_BYTES each
 * (`copy_parts`). Call without the GIL. */
static void
copy_split(char *rows, char *pool, const int64_t *s, Py_ssize_t n, size_t row, Direction dir,
           int threads)
{
    int count = split_count((size_t)n * row, threads);
    CopyPart part[MAX_COPY_THREADS];
    for (int i = 0; i < count; i++) {
        part[i] = (CopyPart){rows, pool, s, n * i / count, n * (i + 1) / count, row, dir};
    }
    copy_parts(part, count, count);
}

/* The optional threads argument args[3] (1 where nargs < 4), or -1 with an error set. */
static long
threads_arg(const char *fn, PyObject *const *args, Py_ssize_t nargs)
{
    long threads = nargs == 4 ? PyLong_AsLong(args[3]) : 1;
    if (threads == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: threads must be at least 1, got %ld", fn, threads);
        return -1;
    }
    return threads;
}

/* 0 where each of the n slots is a row of 0..num_slots-1, else -1 with an IndexError naming
 * the first other one. */
static int
check_slot_range(const char *fn, const int64_t *s, Py_ssize_t n, Py_ssize_t num_slots)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || s[i] >= num_slots) {
            PyErr_Format(PyExc_IndexError, "%s: slot %lld (index %zd) is outside 0..%zd", fn,
                         (long long)s[i], i, num_slots - 1);
            return -1;
        }
    }
    return 0;
}

/* Whether the byte ranges of two borrowed buffers overlap. */
static int
overlaps(const Py_buffer *a, const Py_buffer *b)
{
    uintptr_t a_lo = (uintptr_t)a->buf, b_lo = (uintptr_t)b->buf;
    return a->len > 0 && b->len > 0 && a_lo < b_lo + (uintptr_t)b->len &&
           b_lo < a_lo + (uintptr_t)a->len;
}

/* copy_rows and gather_rows: borrow (src, slots, dst), check every slot and that the arrays
 * do not overlap, then copy with the GIL released; a gather splits across up to args[3]
 * threads (a pool write keeps row order: a slot given twice holds its last row). */
static PyObject *
slot_copy(const char *fn, PyObject *const *args, Py_ssize_t nargs, Direction dir)
{
    char slots_name[32];
    snprintf(slots_name, sizeof slots_name, "%s: slots", fn);
    const ArraySpec slot_spec = {1, slots_name, 0, 1, 0, 1, 0};
    if (nargs != 3 && !(nargs == 4 && dir == FROM_SLOTS)) {
        return PyErr_Format(PyExc_TypeError, "%s takes %s arguments, got %zd", fn,
                            dir == FROM_SLOTS ? "3 or 4" : "3", nargs);
    }
    long threads = threads_arg(fn, args, nargs);
    if (threads < 0) {
        return NULL;
    }
    ByteRows src, dst;
    IntArray slots;
    slots.held = dst.held = 0;
    PyObject *result = NULL;
    if (borrow_rows(fn, args[0], "src", 0, &src) < 0 ||
            borrow_rows(fn, args[2], "dst", 1, &dst) < 0 ||
            borrow(args[1], &slot_spec, &slots) < 0) {
        goto done;
    }
    const ByteRows *rows = dir == INTO_SLOTS ? &src : &dst;
    const ByteRows *pool = dir == INTO_SLOTS ? &dst : &src;
    Py_ssize_t n = rows->rows, width = rows->width, num_slots = pool->rows;
    if (slots.len != n || pool->width != width) {
        PyErr_Format(PyExc_ValueError, "%s: %zd slots for %zd rows of %zd bytes, %s rows of "
                     "%zd bytes", fn, slots.len, n, width,
                     dir == INTO_SLOTS ? "into" : "from", pool->width);
        goto done;
    }
    const int64_t *s = int64s(&slots);
    if (check_slot_range(fn, s, n, num_slots) < 0) {
        goto done;
    }
    /* the byte ranges: rows.len == n * width and pool.len == num_slots * width, both
     * allocated, so every offset below (a slot < num_slots or a row < n, times width) fits */
    if (overlaps(&src.buf, &dst.buf)) {
        PyErr_Format(PyExc_ValueError, "%s: src and dst share memory; copy the rows first", fn);
        goto done;
    }
    int nogil = rows->buf.len >= COPY_ROWS_NOGIL_BYTES;
    PyThreadState *state = nogil ? PyEval_SaveThread() : NULL;
    copy_split((char *)rows->buf.buf, (char *)pool->buf.buf, s, n, (size_t)width, dir,
               nogil ? (int)(threads < MAX_COPY_THREADS ? threads : MAX_COPY_THREADS) : 1);
    if (nogil) {
        PyEval_RestoreThread(state);
    }
    result = Py_NewRef(Py_None);
done:
    if (src.held) {
        PyBuffer_Release(&src.buf);
    }
    if (dst.held) {
        PyBuffer_Release(&dst.buf);
    }
    release(&slots, 1);
    return result;
}

PyDoc_STRVAR(copy_rows_doc,
"copy_rows(src, slots, dst) -> None\n\n"
"dst[slots[i]] = src[i] for each row i of src, a C-contiguous uint8 [n, W] array (or\n"
"(address, n, W): n rows of W bytes at a host address, such as a contiguous CPU tensor's\n"
"data_ptr(), that the caller keeps alive and unchanged for the call), into dst, a\n"
"writable C-contiguous uint8 [num_slots, W] array (a pool's rows as bytes); slots is a\n"
"C-contiguous int64 array of n slots. Each run of consecutive slots is one copy (non-temporal\n"
"stores for a run of 64 KiB or more on x86-64, else memcpy), in row order, with the GIL\n"
"released (copies of 64 KiB or more): a slot given twice (vLLM's null block 0 takes\n"
"discarded rows) holds the last of its rows. Raises before copying anything, leaving dst\n"
"unchanged: IndexError naming the first slot outside 0..num_slots-1 and its index;\n"
"ValueError if the lengths or row widths differ or src and dst share memory.");

static PyObject *
copy_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return slot_copy("copy_rows", args, nargs, INTO_SLOTS);
}

PyDoc_STRVAR(gather_rows_doc,
"gather_rows(src, slots, dst, threads=1) -> None\n\n"
"dst[i] = src[slots[i]] for each of the n int64 slots, from src, a C-contiguous uint8\n"
"[num_slots, W] array (a pool's rows as bytes), into dst, a writable C-contiguous uint8\n"
"[n, W] array: copy_rows the other way, with the same copies of runs, GIL release, checks\n"
"and errors (dst unchanged when it raises). A large gather is split across up to `threads`\n"
"threads (at most 16), the caller's among them, each copying at least 2 MiB of rows; the\n"
"others are copy threads of this module, started once and kept (never torch's). While they\n"
"serve one gather, another runs on its caller alone.");

static PyObject *
gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return slot_copy("gather_rows", args, nargs, FROM_SLOTS);
}

PyDoc_STRVAR(gather_parts_doc,
"gather_parts(src, slots, dsts, threads=1) -> None\n\n"
"gather_rows into several tensors at once: dsts is a sequence of writable C-contiguous uint8\n"
"[n_j, W] arrays whose rows take the n int64 slots in order (dsts[0] the first n_0 of them, and\n"
"so on; the n_j add up to n). Each dst is a part the caller's thread and the module's copy\n"
"threads take as they go (up to `threads` of them, at most 16 and one per 2 MiB of rows in\n"
"all), with the GIL released (64 KiB or more in all). Raises before copying anything, every\n"
"dst unchanged: IndexError naming the first slot outside 0..num_slots-1; ValueError if the row\n"
"counts or widths differ or a dst shares memory with src; TypeError for a dst of another form.");

static PyObject *
gather_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char fn[] = "gather_parts";
    static const ArraySpec slot_spec = {1, "gather_parts: slots", 0, 1, 0, 1, 0};
    if (nargs != 3 && nargs != 4) {
        return PyErr_Format(PyExc_TypeError, "%s takes 3 or 4 arguments, got %zd", fn, nargs);
    }
    long threads = threads_arg(fn, args, nargs);
    if (threads < 0) {
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[2], "gather_parts: dsts must be a sequence");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > INT_MAX) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "%s: %zd dsts, at most %d", fn, count, INT_MAX);
    }
    ByteRows src, *dst = PyMem_Calloc(count ? count : 1, sizeof(ByteRows));
    CopyPart *parts = PyMem_Calloc(count ? count : 1, sizeof(CopyPart));
    IntArray slots;
    slots.held = src.held = 0;
    Py_ssize_t borrowed = 0;  /* dsts looked at; each one borrowed is marked held */
    PyObject *result = NULL;
    if (dst == NULL || parts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (borrow_rows(fn, args[0], "src", 0, &src) < 0 || borrow(args[1], &slot_spec, &slots) < 0) {
        goto done;
    }
    const int64_t *s = int64s(&slots);
    Py_ssize_t at = 0, width = src.width;
    for (; borrowed < count; borrowed++) {
        char name[32];
        snprintf(name, sizeof name, "dsts[%zd]", borrowed);
        ByteRows *d = &dst[borrowed];
        if (borrow_rows(fn, PySequence_Fast_GET_ITEM(seq, borrowed), name, 1, d) < 0) {
            goto done;
        }
        if (d->width != width || d->rows > slots.len - at) {
            PyErr_Format(PyExc_ValueError, "%s: %s has %zd rows of %zd bytes, after %zd of the "
                         "%zd slots, of rows of %zd bytes", fn, name, d->rows, d->width, at,
                         slots.len, width);
            goto done;
        }
        if (overlaps(&src.buf, &d->buf)) {
            PyErr_Format(PyExc_ValueError, "%s: src and %s share memory; copy the rows first",
                         fn, name);
            goto done;
        }
        parts[borrowed] = (CopyPart){(char *)d->buf.buf, (char *)src.buf.buf, s + at, 0, d->rows,
                                     (size_t)width, FROM_SLOTS};
        at += d->rows;
    }
    if (at != slots.len) {
        PyErr_Format(PyExc_ValueError, "%s: %zd slots for %zd rows of dsts", fn, slots.len, at);
        goto done;
    }
    if (check_slot_range(fn, s, at, src.rows) < 0) {
        goto done;
    }
    size_t total = (size_t)at * (size_t)width;
    int want = split_count(total, threads);
    if (total >= COPY_ROWS_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        copy_parts(parts, (int)count, want);
        Py_END_ALLOW_THREADS
    } else {
        copy_parts(parts, (int)count, 1);
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t j = 0; dst != NULL && j < count; j++) {
        if (dst[j].held) {
            PyBuffer_Release(&dst[j].buf);
        }
    }
    if (src.held) {
        PyBuffer_Release(&src.buf);
    }
    release(&slots, 1);
    PyMem_Free(dst);
    PyMem_Free(parts);
    Py_DECREF(seq);
    return result;
}

#define METHOD(name) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, name##_doc}

static PyMethodDef core_methods[] = {
    METHOD(add_counts), METHOD(running_step), METHOD(hidden_rows), METHOD(row_ends),
    METHOD(request_runs), METHOD(step_layout), METHOD(slot_runs),
    METHOD(run_stats), METHOD(runs_slots), METHOD(any_held), METHOD(fill_tiers), METHOD(claim_write),
    METHOD(add_pins),
    METHOD(row_states),
    METHOD(copy_rows), METHOD(gather_rows), METHOD(gather_parts),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefix_cache.core._core",
    .m_doc = "The per-request and per-run loops of a step's bookkeeping (layout, holds, "
             "claims) in C.",
    .m_size = -1,
    .m_methods = core_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    static int registered;
    if (!registered) {
        if (pthread_atfork(NULL, NULL, copy_pool_after_fork) != 0) {
            return PyErr_Format(PyExc_RuntimeError, "_core: pthread_atfork failed");
        }
        registered = 1;
    }
    return PyModule_Create(&core_module);
}
