/* prefix_cache.devices.cuda._events: the done events of the engine thread's launches, recycled.
 *
 * A save records an event after its launch, and the landing queries it. A torch event costs the
 * engine thread its Python constructor, a cudaEventCreate at its first record and a
 * cudaEventDestroy when it is dropped: about 8 us a save on an H100 host. Here `EventPool.record`
 * takes an event the pool created earlier, records it, and hands it out as an `Event`; when the
 * last reference to that `Event` goes, its CUDA event goes back to the pool's free list (a CUDA
 * event may be recorded again whether or not its last record completed). Every call runs with
 * the GIL held, but for `Event.synchronize`, which waits in the driver without it. A failed
 * runtime call raises RuntimeError naming it, its error cleared from the thread's last error.
 *
 * No CUDA header or library is linked (`_functions.h`): the caller passes the addresses of the
 * runtime's functions, resolved from the libcudart torch loaded, so this builds on any host.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_functions.h"

#define FUNCTIONS 7

/* Invariant: every CUDA event the pool created is either in `free` or held by exactly one live
 * `Event`, which holds a reference to the pool; so the pool outlives its events, and destroys
 * them all (every one is free by then) when it goes. */
typedef struct {
    PyObject_HEAD
    EventCreateFn create;
    EventRecordFn record;
    EventQueryFn query;
    EventSynchronizeFn synchronize;
    EventDestroyFn destroy;
    GetLastErrorFn get_last_error;
    RuntimeErrorNameFn error_name;
    void **free;
    Py_ssize_t num_free, num_created;
} EventPool;

typedef struct {
    PyObject_HEAD
    EventPool *pool;
    void *event;
} Event;

static PyTypeObject EventType;

/* Raise the failure of `call`, cleared from the thread's last error (`_functions.h`). */
static PyObject *
cuda_error(EventPool *pool, const char *call, int err)
{
    pool->get_last_error();
    return PyErr_Format(PyExc_RuntimeError, "%s failed: %s (%d)", call, pool->error_name(err),
                        err);
}

PyDoc_STRVAR(pool_doc,
"EventPool(functions) -> pool of blocking, untimed CUDA events of the current device\n\n"
"functions: the addresses of cudaEventCreateWithFlags, cudaEventRecord, cudaEventQuery,\n"
"cudaEventSynchronize, cudaEventDestroy, cudaGetLastError and cudaGetErrorName. Events are\n"
"created by `grow`, on the device current when it is called. A failed call raises\n"
"RuntimeError naming it, its error cleared from the thread's last error.");

static int
pool_init(EventPool *self, PyObject *args, PyObject *kwds)
{
    PyObject *fns;
    if (!PyArg_ParseTuple(args, "O", &fns)) {
        return -1;
    }
    if (self->create != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "EventPool: already initialized");
        return -1;
    }
    void *f[FUNCTIONS];
    if (function_addresses(fns, FUNCTIONS, f, "EventPool") < 0) {
        return -1;
    }
    self->create = (EventCreateFn)f[0];
    self->record = (EventRecordFn)f[1];
    self->query = (EventQueryFn)f[2];
    self->synchronize = (EventSynchronizeFn)f[3];
    self->destroy = (EventDestroyFn)f[4];
    self->get_last_error = (GetLastErrorFn)f[5];
    self->error_name = (RuntimeErrorNameFn)f[6];
    return 0;
}

PyDoc_STRVAR(grow_doc,
"grow(n) -> None\n\n"
"Create n more events on the current device, free for `record`.");

static PyObject *
pool_grow(EventPool *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n < 0) {
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "grow: n must be >= 0");
    }
    /* the free list holds every event at once when none is out: room for all created */
    void **free = PyMem_Realloc(self->free, (size_t)(self->num_created + n) * sizeof(void *));
    if (free == NULL) {
        return PyErr_NoMemory();
    }
    self->free = free;
    for (Py_ssize_t i = 0; i < n; i++) {
        void *event = NULL;
        int err = self->create(&event, EVENT_BLOCKING_SYNC | EVENT_DISABLE_TIMING);
        if (err != CUDA_SUCCESS) {
            return cuda_error(self, "cudaEventCreateWithFlags", err);
        }
        self->free[self->num_free++] = event;
        self->num_created++;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(record_doc,
"record(stream) -> Event | None\n\n"
"A free event recorded on the stream of that raw handle; None when none is free (`grow`).");

static PyObject *
pool_record(EventPool *self, PyObject *arg)
{
    void *stream;
    if (address(arg, &stream) < 0) {
        return NULL;
    }
    if (self->num_free == 0) {
        Py_RETURN_NONE;
    }
    Event *out = PyObject_New(Event, &EventType);
    if (out == NULL) {
        return NULL;
    }
    out->event = self->free[--self->num_free];
    out->pool = (EventPool *)Py_NewRef(self);
    int err = self->record(out->event, stream);
    if (err != CUDA_SUCCESS) {
        Py_DECREF(out);  /* its event goes back to the free list */
        return cuda_error(self, "cudaEventRecord", err);
    }
    return (PyObject *)out;
}

static PyObject *
pool_counts(EventPool *self, void *closure)
{
    return Py_BuildValue("nn", self->num_free, self->num_created);
}

static void
pool_dealloc(EventPool *self)
{
    int destroyed = CUDA_SUCCESS;
    for (Py_ssize_t i = 0; i < self->num_free; i++) {
        destroyed |= self->destroy(self->free[i]);
    }
    if (destroyed != CUDA_SUCCESS) {
        self->get_last_error();
    }
    PyMem_Free(self->free);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(query_doc, "query() -> bool\n\nWhether the work before the record has completed.");

static PyObject *
event_query(Event *self, PyObject *unused)
{
    int err = self->pool->query(self->event);
    if (err == CUDA_SUCCESS) {
        Py_RETURN_TRUE;
    }
    if (err == CUDA_NOT_READY) {
        Py_RETURN_FALSE;
    }
    return cuda_error(self->pool, "cudaEventQuery", err);
}

PyDoc_STRVAR(synchronize_doc,
"synchronize() -> None\n\nWait in the driver, GIL released, until the event has completed.");

static PyObject *
event_synchronize(Event *self, PyObject *unused)
{
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = self->pool->synchronize(self->event);
    Py_END_ALLOW_THREADS
    if (err != CUDA_SUCCESS) {
        return cuda_error(self->pool, "cudaEventSynchronize", err);
    }
    Py_RETURN_NONE;
}

static void
event_dealloc(Event *self)
{
    EventPool *pool = self->pool;
    pool->free[pool->num_free++] = self->event;  /* room for every event created */
    Py_TYPE(self)->tp_free((PyObject *)self);
    Py_DECREF(pool);
}

static PyMethodDef event_methods[] = {
    {"query", (PyCFunction)event_query, METH_NOARGS, query_doc},
    {"synchronize", (PyCFunction)event_synchronize, METH_NOARGS, synchronize_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EventType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefix_cache.devices.cuda._events.Event",
    .tp_basicsize = sizeof(Event),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A recorded CUDA event of an EventPool; back in the pool when dropped.",
    .tp_dealloc = (destructor)event_dealloc,
    .tp_methods = event_methods,
};

static PyMethodDef pool_methods[] = {
    {"grow", (PyCFunction)pool_grow, METH_O, grow_doc},
    {"record", (PyCFunction)pool_record, METH_O, record_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"counts", (getter)pool_counts, NULL, "(free, created) events", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EventPoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefix_cache.devices.cuda._events.EventPool",
    .tp_basicsize = sizeof(EventPool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = pool_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)pool_init,
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

static struct PyModuleDef events_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefix_cache.devices.cuda._events",
    .m_doc = "Recycled CUDA events for the done events of launches.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__events(void)
{
    if (PyType_Ready(&EventType) < 0 || PyType_Ready(&EventPoolType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&events_module);
    if (module == NULL ||
            PyModule_AddObjectRef(module, "EventPool", (PyObject *)&EventPoolType) < 0) {
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}
