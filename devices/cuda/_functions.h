/* The CUDA functions and handles the C modules of devices/cuda are handed as Python ints: the
 * addresses of the runtime's and the driver's functions, resolved in Python from the libraries
 * this process loaded (so no CUDA header or library is linked), and raw handles (streams,
 * events, kernels), and the runtime's types and constants they share. Included by each
 * module: every one gets its own static copies. */
#ifndef PREFIX_CACHE_CUDA_FUNCTIONS_H
#define PREFIX_CACHE_CUDA_FUNCTIONS_H

#include <Python.h>

/* The runtime's event functions, as `_dma` and `_events` call them. */
typedef int (*EventCreateFn)(void **, unsigned);
typedef int (*EventRecordFn)(void *, void *);
typedef int (*EventQueryFn)(void *);
typedef int (*EventSynchronizeFn)(void *);
typedef int (*EventDestroyFn)(void *);
/* cudaGetLastError: a failed runtime call leaves its error as the calling thread's last error,
 * which torch's next launch check on that thread raises from an unrelated kernel; so every
 * failure a module handles is cleared with it. */
typedef int (*GetLastErrorFn)(void);
typedef const char *(*RuntimeErrorNameFn)(int);  /* cudaGetErrorName */

#define CUDA_SUCCESS 0  /* cudaSuccess and CUDA_SUCCESS alike */
#define CUDA_NOT_READY 600
#define EVENT_BLOCKING_SYNC 1
#define EVENT_DISABLE_TIMING 2

/* An int's value as an address or handle (0 is a valid one: the legacy default stream). */
static int
address(PyObject *obj, void **out)
{
    *out = PyLong_AsVoidPtr(obj);
    return *out == NULL && PyErr_Occurred() ? -1 : 0;
}

/* The `n` function addresses of the tuple `fns` into `out`, none null; `who` names the caller
 * in the error. */
static int
function_addresses(PyObject *fns, Py_ssize_t n, void **out, const char *who)
{
    if (!PyTuple_Check(fns) || PyTuple_GET_SIZE(fns) != n) {
        PyErr_Format(PyExc_ValueError, "%s: a tuple of %zd function addresses, got %R", who, n,
                     fns);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (address(PyTuple_GET_ITEM(fns, i), &out[i]) < 0) {
            return -1;
        }
        if (out[i] == NULL) {
            PyErr_Format(PyExc_ValueError, "%s: function %zd has a null address", who, i);
            return -1;
        }
    }
    return 0;
}

#endif
