/* prefix_cache.devices.cuda._launch: a compiled kernel launched by cuLaunchKernel, its
 * parameters packed here from Python ints.
 *
 * Triton's launcher parses its arguments, asks the driver about each pointer and calls its
 * hooks: 15-24 us a save on an H100 host (`benchmarks/engine_call_timing.py --m2`). Here the
 * kernel's parameter layout is read from the driver once (cuFuncGetParamInfo), and a launch
 * packs the values given into it, the parameters past them (a compiler's scratch pointers)
 * as zero, and calls cuLaunchKernel.
 *
 * No CUDA header or library is linked (`_functions.h`): the caller passes the addresses of the
 * driver's functions, resolved from the libcuda this process loaded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_functions.h"

typedef int (*LaunchKernelFn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, void *, void **, void **);
typedef int (*FuncGetParamInfoFn)(void *, size_t, size_t *, size_t *);
typedef int (*DriverErrorNameFn)(int, const char **);  /* cuGetErrorName */

#define MAX_PARAMS 32
#define FUNCTIONS 3

/* Invariant: `sizes[i]` is parameter i's size (4 or 8 bytes) for every i < num_params, and
 * every parameter at or past `num_given` is 8 bytes (a pointer, passed as null). */
typedef struct {
    PyObject_HEAD
    LaunchKernelFn launch;
    DriverErrorNameFn error_name;
    void *function;
    unsigned block, shared;
    Py_ssize_t num_params, num_given;
    size_t sizes[MAX_PARAMS];
} Kernel;

static PyObject *
driver_error(Kernel *self, const char *call, int err)
{
    const char *name = NULL;
    if (self->error_name == NULL || self->error_name(err, &name) != CUDA_SUCCESS || !name) {
        name = "unknown error";
    }
    return PyErr_Format(PyExc_RuntimeError, "%s failed: %s (%d)", call, name, err);
}

PyDoc_STRVAR(kernel_doc,
"Kernel(functions, function, block, shared, num_given)\n\n"
"functions: the addresses of cuLaunchKernel, cuFuncGetParamInfo and cuGetErrorName; function:\n"
"a loaded CUfunction; block: threads per block; shared: dynamic shared memory bytes;\n"
"num_given: the parameters each launch passes, the rest must be pointers (passed as null).\n"
"Raises ValueError where the kernel's parameters do not allow that.");

static int
kernel_init(Kernel *self, PyObject *args, PyObject *kwds)
{
    PyObject *fns, *function;
    unsigned block, shared;
    Py_ssize_t num_given;
    if (!PyArg_ParseTuple(args, "OOIIn", &fns, &function, &block, &shared, &num_given)) {
        return -1;
    }
    void *f[FUNCTIONS];
    if (function_addresses(fns, FUNCTIONS, f, "Kernel") < 0 ||
            address(function, &self->function) < 0) {
        return -1;
    }
    self->launch = (LaunchKernelFn)f[0];
    self->error_name = (DriverErrorNameFn)f[2];
    FuncGetParamInfoFn param_info = (FuncGetParamInfoFn)f[1];
    self->block = block;
    self->shared = shared;
    self->num_params = 0;
    for (size_t i = 0; i < MAX_PARAMS + 1; i++) {
        size_t offset, size;
        if (param_info(self->function, i, &offset, &size) != CUDA_SUCCESS) {
            break;  /* past the last parameter */
        }
        if (i == MAX_PARAMS || (size != 4 && size != 8)) {
            PyErr_Format(PyExc_ValueError, "Kernel: parameter %zu is %zu bytes (only 4 and 8, "
                         "at most %d of them)", i, size, MAX_PARAMS);
            return -1;
        }
        self->sizes[self->num_params++] = size;
    }
    if (num_given < 0 || num_given > self->num_params) {
        PyErr_Format(PyExc_ValueError, "Kernel: %zd parameters given, the kernel has %zd",
                     num_given, self->num_params);
        return -1;
    }
    for (Py_ssize_t i = num_given; i < self->num_params; i++) {
        if (self->sizes[i] != 8) {
            PyErr_Format(PyExc_ValueError, "Kernel: parameter %zd, past those given, is %zu "
                         "bytes, not a pointer", i, self->sizes[i]);
            return -1;
        }
    }
    self->num_given = num_given;
    return 0;
}

PyDoc_STRVAR(launch_doc,
"launch(grid, stream, *params) -> None\n\n"
"Launch grid blocks on the stream of that raw handle with the given parameters (ints: a\n"
"pointer's address or a value, packed at the kernel's size of each).");

static PyObject *
kernel_launch(Kernel *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (self->launch == NULL) {
        return PyErr_Format(PyExc_RuntimeError, "Kernel: not initialized");
    }
    if (nargs != 2 + self->num_given) {
        return PyErr_Format(PyExc_TypeError, "launch: grid, stream and %zd parameters, got %zd "
                            "arguments", self->num_given, nargs);
    }
    unsigned long grid = PyLong_AsUnsignedLong(args[0]);
    void *stream;
    if ((grid == (unsigned long)-1 && PyErr_Occurred()) || address(args[1], &stream) < 0) {
        return NULL;
    }
    uint64_t values[MAX_PARAMS] = {0};
    void *params[MAX_PARAMS];
    for (Py_ssize_t i = 0; i < self->num_params; i++) {
        if (i < self->num_given) {
            /* a pointer or an i64 as its 64 bits; an i32 by its value, range-checked */
            if (self->sizes[i] == 8) {
                long long v = PyLong_AsLongLong(args[2 + i]);
                if (v == -1 && PyErr_Occurred()) {
                    PyErr_Clear();  /* an address above INT64_MAX */
                    unsigned long long u = PyLong_AsUnsignedLongLong(args[2 + i]);
                    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                        return NULL;
                    }
                    values[i] = u;
                } else {
                    values[i] = (uint64_t)v;
                }
            } else {
                long long v = PyLong_AsLongLong(args[2 + i]);
                if (v == -1 && PyErr_Occurred()) {
                    return NULL;
                }
                if (v < INT32_MIN || v > INT32_MAX) {
                    return PyErr_Format(PyExc_OverflowError, "launch: parameter %zd, %lld, "
                                        "does not fit its 4 bytes", i, v);
                }
                int32_t narrow = (int32_t)v;
                memcpy(&values[i], &narrow, sizeof narrow);
            }
        }
        params[i] = &values[i];
    }
    int err = self->launch(self->function, (unsigned)grid, 1, 1, self->block, 1, 1,
                           self->shared, stream, params, NULL);
    if (err != CUDA_SUCCESS) {
        return driver_error(self, "cuLaunchKernel", err);
    }
    Py_RETURN_NONE;
}

static PyObject *
kernel_param_sizes(Kernel *self, void *closure)
{
    PyObject *out = PyTuple_New(self->num_params);
    for (Py_ssize_t i = 0; out != NULL && i < self->num_params; i++) {
        PyTuple_SET_ITEM(out, i, PyLong_FromSize_t(self->sizes[i]));
    }
    return out;
}

static PyMethodDef kernel_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))kernel_launch, METH_FASTCALL, launch_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef kernel_getset[] = {
    {"param_sizes", (getter)kernel_param_sizes, NULL, "each parameter's bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefix_cache.devices.cuda._launch.Kernel",
    .tp_basicsize = sizeof(Kernel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = kernel_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)kernel_init,
    .tp_methods = kernel_methods,
    .tp_getset = kernel_getset,
};

static struct PyModuleDef launch_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefix_cache.devices.cuda._launch",
    .m_doc = "A compiled kernel launched by cuLaunchKernel, its parameters packed from ints.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__launch(void)
{
    if (PyType_Ready(&KernelType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&launch_module);
    if (module == NULL || PyModule_AddObjectRef(module, "Kernel", (PyObject *)&KernelType) < 0) {
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}
