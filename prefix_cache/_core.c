/* prefix_cache._core: the per-slot passes of a step's bookkeeping, one C loop each.
 *
 * numpy costs 1.5-2 us a call before it touches a slot, and a step's layout, claim
 * and write record took about fifteen calls; these functions do the same work in
 * a few calls of well under a microsecond plus under a nanosecond a slot. They read
 * and write arrays through the buffer protocol (C-contiguous, native signed ints),
 * check every index before it is used, and leave a table they fill unchanged when
 * they raise (an output buffer may hold the rows written before the error).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* A 1-D or 2-D C-contiguous array of 4- or 8-byte signed integers. */
typedef struct {
    Py_buffer buf;
    Py_ssize_t len;  /* elements */
    int wide;        /* 8-byte elements */
} IntArray;

static int
int_array(PyObject *obj, const char *name, int writable, int ndim, IntArray *out)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &out->buf, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous%s integer array, got %.80s",
                     name, writable ? " writable" : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *fmt = out->buf.format ? out->buf.format : "B";
    while (*fmt == '@' || *fmt == '=' || *fmt == '<') {
        fmt++;
    }
    Py_ssize_t size = out->buf.itemsize;
    int ok = fmt[1] == '\0' && out->buf.ndim == ndim &&
             ((size == 4 && (*fmt == 'i' || *fmt == 'l')) ||
              (size == 8 && (*fmt == 'l' || *fmt == 'q')));
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: expected a %d-D int32 or int64 array, got format "
                     "'%s', %zd-byte items, %d dims", name, ndim, out->buf.format, size,
                     out->buf.ndim);
        PyBuffer_Release(&out->buf);
        return -1;
    }
    out->len = out->buf.len / size;
    out->wide = size == 8;
    return 0;
}

static inline int64_t
get_at(const IntArray *a, Py_ssize_t i)
{
    return a->wide ? ((const int64_t *)a->buf.buf)[i] : ((const int32_t *)a->buf.buf)[i];
}

static int
need_int64(const IntArray *a, const char *name)
{
    if (!a->wide) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int64 array", name);
        return -1;
    }
    return 0;
}

static int
check_args(Py_ssize_t nargs, Py_ssize_t want, const char *fn)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", fn, want, nargs);
        return -1;
    }
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
    long long v = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = v;
    return 0;
}

PyDoc_STRVAR(row_ends_doc,
"row_ends(order, scheduled, ends) -> (total, smallest count)\n\n"
"ends[i] = scheduled[order[0]] + ... + scheduled[order[i]] (int64 ends, len(order) long).");

static PyObject *
row_ends(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_args(nargs, 3, "row_ends") < 0) {
        return NULL;
    }
    PyObject *order = PySequence_Fast(args[0], "row_ends: order must be a sequence");
    if (order == NULL) {
        return NULL;
    }
    IntArray ends;
    if (int_array(args[2], "row_ends: ends", 1, 1, &ends) < 0) {
        Py_DECREF(order);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(order);
    if (need_int64(&ends, "row_ends: ends") < 0) {
        goto done;
    }
    if (ends.len != k) {
        PyErr_Format(PyExc_ValueError, "row_ends: %zd ends for %zd requests", ends.len, k);
        goto done;
    }
    int64_t total = 0, smallest = INT64_MAX, count;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (mapping_int(args[1], PySequence_Fast_GET_ITEM(order, i), "scheduled tokens",
                     &count) < 0) {
            goto done;
        }
        total += count;
        ((int64_t *)ends.buf.buf)[i] = total;
        smallest = count < smallest ? count : smallest;
    }
    result = Py_BuildValue("LL", (long long)total, (long long)(k ? smallest : 0));
done:
    PyBuffer_Release(&ends.buf);
    Py_DECREF(order);
    return result;
}

PyDoc_STRVAR(add_counts_doc,
"add_counts(totals, counts) -> None\n\n"
"totals[k] = totals.get(k, 0) + counts[k] for every key of counts (two dicts of ints).");

static PyObject *
add_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_args(nargs, 2, "add_counts") < 0) {
        return NULL;
    }
    if (!PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        return PyErr_Format(PyExc_TypeError, "add_counts: totals and counts must be dicts");
    }
    PyObject *key, *count;
    Py_ssize_t pos = 0;
    while (PyDict_Next(args[1], &pos, &key, &count)) {
        PyObject *total = PyDict_GetItemWithError(args[0], key);
        if (total == NULL && PyErr_Occurred()) {
            return NULL;
        }
        PyObject *sum = total == NULL ? Py_NewRef(count) : PyNumber_Add(total, count);
        if (sum == NULL || PyDict_SetItem(args[0], key, sum) < 0) {
            Py_XDECREF(sum);
            return NULL;
        }
        Py_DECREF(sum);
    }
    Py_RETURN_NONE;
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
        PyErr_Format(PyExc_ValueError, "request_runs: more than the %zd runs room was given for",
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

static PyObject *
request_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_args(nargs, 7, "request_runs") < 0) {
        return NULL;
    }
    long long unit = PyLong_AsLongLong(args[5]);
    if (unit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (unit <= 0) {
        return PyErr_Format(PyExc_ValueError, "request_runs: unit %lld must be positive", unit);
    }
    PyObject *req_ids = PySequence_Fast(args[0], "request_runs: req_ids must be a sequence");
    if (req_ids == NULL) {
        return NULL;
    }
    IntArray computed = {0}, table = {0}, runs = {0};
    PyObject *result = NULL;
    int held = 0;
    if (int_array(args[3], "request_runs: computed", 0, 1, &computed) < 0) {
        goto done;
    }
    held = 1;
    if (int_array(args[4], "request_runs: table", 0, 2, &table) < 0) {
        goto done;
    }
    held = 2;
    if (int_array(args[6], "request_runs: runs", 1, 2, &runs) < 0) {
        goto done;
    }
    held = 3;
    if (need_int64(&runs, "request_runs: runs") < 0 || runs.buf.shape[1] != 2) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "request_runs: runs must be [capacity, 2]");
        }
        goto done;
    }
    RunsOut out = {(int64_t *)runs.buf.buf, 0, runs.buf.shape[0], 0, -1};
    Py_ssize_t num_rows = table.buf.shape[0], width = table.buf.shape[1];
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(req_ids); i++) {
        PyObject *req = PySequence_Fast_GET_ITEM(req_ids, i);
        int64_t count, row;
        if (mapping_int(args[1], req, "scheduled tokens", &count) < 0 ||
                mapping_int(args[2], req, "batch row", &row) < 0) {
            goto done;
        }
        if (row < 0 || row >= num_rows || row >= computed.len) {
            PyErr_Format(PyExc_IndexError, "request %R: batch row %lld outside the table's %zd "
                         "rows", req, (long long)row, num_rows);
            goto done;
        }
        if (count < 0) {
            PyErr_Format(PyExc_ValueError, "request %R: %lld scheduled tokens", req,
                         (long long)count);
            goto done;
        }
        int64_t first = get_at(&computed, row), last = first + count - 1;
        if (count && (first < 0 || last / unit >= width)) {
            PyErr_Format(PyExc_IndexError, "request %R: positions %lld..%lld need blocks past "
                         "the table's %zd per request", req, (long long)first, (long long)last,
                         width);
            goto done;
        }
        /* block by block: the first may start mid-block, every later one at its offset 0 */
        int64_t offset = count ? first % unit : 0, left = count;
        for (int64_t block = count ? first / unit : 0; left > 0; block++, offset = 0) {
            int64_t run = unit - offset < left ? unit - offset : left;
            int64_t slot = get_at(&table, row * width + block) * unit + offset;
            if (add_run(&out, slot, slot + run) < 0) {
                goto done;
            }
            left -= run;
        }
    }
    result = Py_BuildValue("nLL", out.k, (long long)out.low, (long long)out.high);
done:
    if (held >= 3) PyBuffer_Release(&runs.buf);
    if (held >= 2) PyBuffer_Release(&table.buf);
    if (held >= 1) PyBuffer_Release(&computed.buf);
    Py_DECREF(req_ids);
    return result;
}

PyDoc_STRVAR(slot_runs_doc,
"slot_runs(slots, runs) -> (number of runs, min slot, max slot)\n\n"
"Cuts int64 slots into runs of consecutive slots: runs[i] = (first, end), int64 [n, 2] with\n"
"n >= len(slots). The bounds of no slots are (0, -1).");

static PyObject *
slot_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_args(nargs, 2, "slot_runs") < 0) {
        return NULL;
    }
    IntArray slots, runs;
    if (int_array(args[0], "slot_runs: slots", 0, 1, &slots) < 0) {
        return NULL;
    }
    if (int_array(args[1], "slot_runs: runs", 1, 2, &runs) < 0) {
        PyBuffer_Release(&slots.buf);
        return NULL;
    }
    PyObject *result = NULL;
    if (need_int64(&slots, "slot_runs: slots") < 0 || need_int64(&runs, "slot_runs: runs") < 0) {
        goto done;
    }
    if (runs.buf.shape[1] != 2 || runs.buf.shape[0] < slots.len) {
        PyErr_Format(PyExc_ValueError, "slot_runs: runs must be [>= %zd, 2], got [%zd, %zd]",
                     slots.len, runs.buf.shape[0], runs.buf.shape[1]);
        goto done;
    }
    const int64_t *s = (const int64_t *)slots.buf.buf;
    int64_t *r = (int64_t *)runs.buf.buf;
    int64_t lo = 0, hi = -1;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < slots.len; k++) {
        Py_ssize_t j = i + 1;
        while (j < slots.len && s[j] == s[j - 1] + 1) {
            j++;
        }
        r[2 * k] = s[i];
        r[2 * k + 1] = s[j - 1] + 1;
        lo = (k == 0 || s[i] < lo) ? s[i] : lo;
        hi = (k == 0 || s[j - 1] > hi) ? s[j - 1] : hi;
        i = j;
    }
    result = Py_BuildValue("nLL", k, (long long)lo, (long long)hi);
done:
    PyBuffer_Release(&runs.buf);
    PyBuffer_Release(&slots.buf);
    return result;
}

PyDoc_STRVAR(run_stats_doc,
"run_stats(runs) -> (slots, min, max) of int64 runs [k, 2] of (first, end); (0, 0, -1) for\n"
"none. Raises if a run is empty or reversed.");

static PyObject *
run_stats(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_args(nargs, 1, "run_stats") < 0) {
        return NULL;
    }
    IntArray runs;
    if (int_array(args[0], "run_stats: runs", 0, 2, &runs) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (need_int64(&runs, "run_stats: runs") < 0 || runs.buf.shape[1] != 2) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "run_stats: runs must be [k, 2]");
        }
        goto done;
    }
    const int64_t *r = (const int64_t *)runs.buf.buf;
    int64_t count = 0, low = 0, high = -1;
    for (Py_ssize_t i = 0; i < runs.buf.shape[0]; i++) {
        if (r[2 * i] >= r[2 * i + 1]) {
            PyErr_Format(PyExc_ValueError, "run_stats: run %zd, %lld..%lld, is empty", i,
                         (long long)r[2 * i], (long long)r[2 * i + 1]);
            goto done;
        }
        count += r[2 * i + 1] - r[2 * i];
        low = i == 0 || r[2 * i] < low ? r[2 * i] : low;
        high = i == 0 || r[2 * i + 1] - 1 > high ? r[2 * i + 1] - 1 : high;
    }
    result = Py_BuildValue("LLL", (long long)count, (long long)low, (long long)high);
done:
    PyBuffer_Release(&runs.buf);
    return result;
}

PyDoc_STRVAR(runs_slots_doc,
"runs_slots(runs, out) -> None\n\n"
"out = the slots of int64 runs [k, 2] of (first, end), in order; out is int64 and exactly\n"
"as long as the runs hold slots.");

static PyObject *
runs_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_args(nargs, 2, "runs_slots") < 0) {
        return NULL;
    }
    IntArray runs, out;
    if (int_array(args[0], "runs_slots: runs", 0, 2, &runs) < 0) {
        return NULL;
    }
    if (int_array(args[1], "runs_slots: out", 1, 1, &out) < 0) {
        PyBuffer_Release(&runs.buf);
        return NULL;
    }
    PyObject *result = NULL;
    if (need_int64(&runs, "runs_slots: runs") < 0 || need_int64(&out, "runs_slots: out") < 0) {
        goto done;
    }
    const int64_t *r = (const int64_t *)runs.buf.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; runs.buf.shape[1] == 2 && i < runs.buf.shape[0]; i++) {
        total += r[2 * i + 1] > r[2 * i] ? r[2 * i + 1] - r[2 * i] : -1 - out.len;
    }
    if (runs.buf.shape[1] != 2 || total != out.len) {
        PyErr_Format(PyExc_ValueError, "runs_slots: runs must be [k, 2] non-empty ranges of "
                     "%zd slots in all", out.len);
        goto done;
    }
    int64_t *dst = (int64_t *)out.buf.buf;
    for (Py_ssize_t i = 0; i < runs.buf.shape[0]; i++) {
        for (int64_t slot = r[2 * i]; slot < r[2 * i + 1]; slot++) {
            *dst++ = slot;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&out.buf);
    PyBuffer_Release(&runs.buf);
    return result;
}

/* Borrow int64 runs [k, 2] and raise unless each is a non-empty range within [0, limit). */
static int
checked_runs(PyObject *obj, const char *name, Py_ssize_t limit, IntArray *runs)
{
    if (int_array(obj, name, 0, 2, runs) < 0) {
        return -1;
    }
    if (need_int64(runs, name) < 0 || runs->buf.shape[1] != 2) {
        if (!PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "%s: expected [k, 2] runs, got [%zd, %zd]", name,
                         runs->buf.shape[0], runs->buf.shape[1]);
        }
        PyBuffer_Release(&runs->buf);
        return -1;
    }
    const int64_t *r = (const int64_t *)runs->buf.buf;
    for (Py_ssize_t i = 0; i < runs->buf.shape[0]; i++) {
        if (r[2 * i] < 0 || r[2 * i] >= r[2 * i + 1] || r[2 * i + 1] > limit) {
            PyErr_Format(PyExc_IndexError, "%s: run %zd, slots %lld..%lld, is not a range "
                         "within 0..%zd", name, i, (long long)r[2 * i],
                         (long long)r[2 * i + 1] - 1, limit - 1);
            PyBuffer_Release(&runs->buf);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(any_held_doc,
"any_held(slot_claim, read_pins, runs, held_from) -> bool\n\n"
"Whether some slot of the runs carries a claim >= held_from or is pinned (read_pins != 0;\n"
"read_pins None: no slot is).");

static PyObject *
any_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_args(nargs, 4, "any_held") < 0) {
        return NULL;
    }
    long long held_from = PyLong_AsLongLong(args[3]);
    if (held_from == -1 && PyErr_Occurred()) {
        return NULL;
    }
    IntArray claims = {0}, pins = {0}, runs = {0};
    PyObject *result = NULL;
    int held = 0, with_pins = args[1] != Py_None;
    if (int_array(args[0], "any_held: slot_claim", 0, 1, &claims) < 0) {
        goto done;
    }
    held = 1;
    if (with_pins && int_array(args[1], "any_held: read_pins", 0, 1, &pins) < 0) {
        goto done;
    }
    held = 2;
    if (need_int64(&claims, "any_held: slot_claim") < 0) {
        goto done;
    }
    if (with_pins && pins.len != claims.len) {
        PyErr_Format(PyExc_ValueError, "any_held: %zd pins for %zd slots", pins.len,
                     claims.len);
        goto done;
    }
    if (checked_runs(args[2], "any_held: runs", claims.len, &runs) < 0) {
        goto done;
    }
    held = 3;
    const int64_t *c = (const int64_t *)claims.buf.buf, *r = (const int64_t *)runs.buf.buf;
    int found = 0;
    for (Py_ssize_t i = 0; i < runs.buf.shape[0] && !found; i++) {
        for (int64_t slot = r[2 * i]; slot < r[2 * i + 1]; slot++) {
            found |= c[slot] >= held_from;
        }
        for (int64_t slot = r[2 * i]; with_pins && slot < r[2 * i + 1]; slot++) {
            found |= get_at(&pins, slot) != 0;
        }
    }
    result = PyBool_FromLong(found);
done:
    if (held >= 3) PyBuffer_Release(&runs.buf);
    if (held >= 2 && with_pins) PyBuffer_Release(&pins.buf);
    if (held >= 1) PyBuffer_Release(&claims.buf);
    return result;
}

#define MAX_FILLS 4

PyDoc_STRVAR(fill_runs_doc,
"fill_runs(runs, table, value[, table, value ...]) -> None\n\n"
"table[first:end] = value for each run and up to four int64 tables of one length; raises\n"
"before writing if a run is not a range within the tables.");

static PyObject *
fill_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t fills = (nargs - 1) / 2;
    if (nargs < 3 || nargs % 2 == 0 || fills > MAX_FILLS) {
        return PyErr_Format(PyExc_TypeError, "fill_runs takes runs and 1 to %d (table, value) "
                            "pairs, got %zd arguments", MAX_FILLS, nargs);
    }
    IntArray runs, tables[MAX_FILLS];
    int64_t *data[MAX_FILLS], values[MAX_FILLS];
    PyObject *result = NULL;
    Py_ssize_t held = 0;
    for (; held < fills; held++) {
        long long value = PyLong_AsLongLong(args[2 + 2 * held]);
        if ((value == -1 && PyErr_Occurred()) ||
                int_array(args[1 + 2 * held], "fill_runs: table", 1, 1, &tables[held]) < 0) {
            goto done;
        }
        if (need_int64(&tables[held], "fill_runs: table") < 0 ||
                tables[held].len != tables[0].len) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "fill_runs: tables of %zd and %zd slots",
                             tables[0].len, tables[held].len);
            }
            PyBuffer_Release(&tables[held].buf);
            goto done;
        }
        data[held] = (int64_t *)tables[held].buf.buf;
        values[held] = value;
    }
    if (checked_runs(args[0], "fill_runs: runs", tables[0].len, &runs) < 0) {
        goto done;
    }
    const int64_t *r = (const int64_t *)runs.buf.buf;
    for (Py_ssize_t t = 0; t < fills; t++) {
        for (Py_ssize_t i = 0; i < runs.buf.shape[0]; i++) {
            int64_t *row = data[t], value = values[t];
            for (int64_t slot = r[2 * i]; slot < r[2 * i + 1]; slot++) {
                row[slot] = value;
            }
        }
    }
    PyBuffer_Release(&runs.buf);
    result = Py_NewRef(Py_None);
done:
    while (held > 0) {
        PyBuffer_Release(&tables[--held].buf);
    }
    return result;
}

static PyMethodDef core_methods[] = {
    {"add_counts", (PyCFunction)(void (*)(void))add_counts, METH_FASTCALL, add_counts_doc},
    {"row_ends", (PyCFunction)(void (*)(void))row_ends, METH_FASTCALL, row_ends_doc},
    {"request_runs", (PyCFunction)(void (*)(void))request_runs, METH_FASTCALL,
     request_runs_doc},
    {"slot_runs", (PyCFunction)(void (*)(void))slot_runs, METH_FASTCALL, slot_runs_doc},
    {"run_stats", (PyCFunction)(void (*)(void))run_stats, METH_FASTCALL, run_stats_doc},
    {"runs_slots", (PyCFunction)(void (*)(void))runs_slots, METH_FASTCALL, runs_slots_doc},
    {"any_held", (PyCFunction)(void (*)(void))any_held, METH_FASTCALL, any_held_doc},
    {"fill_runs", (PyCFunction)(void (*)(void))fill_runs, METH_FASTCALL, fill_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefix_cache._core",
    .m_doc = "The per-slot passes of a step's bookkeeping (layout, holds, claims) in C.",
    .m_size = -1,
    .m_methods = core_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    return PyModule_Create(&core_module);
}
