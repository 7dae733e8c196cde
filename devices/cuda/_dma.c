/* prefix_cache.devices.cuda._dma: a step's rows into their pool slots by the copy engine.
 *
 * A save is a list of runs of consecutive slots; cudaMemcpyBatchAsync moves them all with
 * the DMA engines (no SMs) at the speed of one contiguous copy. The driver spends about
 * 0.4 us a run to issue it, so the engine thread does not: `submit` checks the slots, plans
 * the runs, orders the copy stream after the caller's stream with an event, and queues the
 * job; a thread of this module, which never takes the GIL, issues the batch and records the
 * job's done event, in submit order. A job is over once it is issued and that event has
 * completed; `error` then names an issuing call of it that failed. The done event is recorded
 * whatever happened to the job's batch, after the runs a failed batch did issue and after every
 * earlier job, so a job is over only once its runs and every earlier job's have landed (a job
 * whose event could not be recorded at all is over, failed, once issued).
 *
 * A forked child has none of the issuer's thread: there the issuer refuses every call but
 * `release` and `close`, which do nothing, and going away frees its memory alone.
 *
 * No CUDA header or library is linked: the caller passes the addresses of the runtime's
 * functions, resolved from the libcudart torch loaded, so this builds on any host.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "_functions.h"

typedef int (*SetDeviceFn)(int);
typedef int (*StreamWaitEventFn)(void *, void *, unsigned);
/* CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream); 12.8-12.9 have a
 * `size_t *failIdx` before the stream */
typedef int (*Batch13Fn)(void **, void **, size_t *, size_t, void *, size_t *, size_t, void *);
typedef int (*Batch12Fn)(void **, void **, size_t *, size_t, void *, size_t *, size_t,
                         size_t *, void *);

#define ACCESS_ORDER_STREAM 1     /* cudaMemcpySrcAccessOrderStream */
#define PREFER_OVERLAP_COMPUTE 1  /* cudaMemcpyFlagPreferOverlapWithCompute */

/* struct cudaMemcpyAttributes (CUDA 12.8-13.x): 24 bytes */
typedef struct {
    int src_access_order;
    int src_loc_type, src_loc_id;
    int dst_loc_type, dst_loc_id;
    unsigned flags;
} MemcpyAttributes;

enum { JOB_FREE, JOB_QUEUED, JOB_ISSUED, JOB_FAILED };

/* One save: its runs, its done event and where it stands. The submitting thread fills it
 * while FREE; the issuing thread reads it while QUEUED; the state is read and written under
 * the issuer's lock. */
typedef struct {
    int state;
    int released;  /* its handle is gone: FREE once issued */
    int recorded;  /* its done event follows every run issued: ISSUED, not FAILED, at once */
    int error;
    const char *failed_call;
    void *done;
    size_t count, capacity;
    void **dsts, **srcs;
    size_t *sizes;
} Job;

typedef struct {
    PyObject_HEAD
    SetDeviceFn set_device;
    EventCreateFn event_create;
    EventRecordFn event_record;
    EventQueryFn event_query;
    EventSynchronizeFn event_synchronize;
    EventDestroyFn event_destroy;
    StreamWaitEventFn stream_wait_event;
    GetLastErrorFn get_last_error;
    RuntimeErrorNameFn get_error_name;
    void *batch;
    int batch_has_fail_idx;
    int device;
    void *copy_stream;
    void *ready;  /* recorded on the caller's stream by `submit` (the submitting thread only) */
    Job *jobs;
    size_t ring;
    uint64_t submitted, issued;  /* job ids: [issued, submitted) are QUEUED, in order */
    int stopping, running;
    unsigned long forks;  /* `forks` when it was made: another value in a forked child */
    pid_t owner;          /* the process that made it */
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t work, progress;
} Issuer;

/* Forks this process came through (pthread_atfork): a forked child has none of the threads
 * its parent's issuers started, and their locks may have been held by those threads. */
static unsigned long forks;

static void
count_fork_in_child(void)
{
    forks++;
}

/* Whether this process is a forked child of the one that made the issuer; RuntimeError if so. */
static int
refuse_in_child(Issuer *self)
{
    if (self->forks == forks) {
        return 0;
    }
    PyErr_Format(PyExc_RuntimeError, "dma: the copy-engine issuer of process %d is not usable in "
                 "its forked child (process %d): its thread is not here", (int)self->owner,
                 (int)getpid());
    return -1;
}

static const char *
error_name(Issuer *self, int err)
{
    const char *name = self->get_error_name(err);
    return name ? name : "?";
}

/* Runs per cudaMemcpyBatchAsync call: the copy engine starts on a job's first runs while the
 * driver still takes its later ones (about 0.4 us a run), instead of after all of them. */
#define RUNS_PER_CALL 16

static void
issue(Issuer *self, Job *job)
{
    static const MemcpyAttributes attrs = {ACCESS_ORDER_STREAM, 0, 0, 0, 0,
                                           PREFER_OVERLAP_COMPUTE};
    size_t attr_index = 0, fail_index = 0, at = 0;
    int err = CUDA_SUCCESS;
    while (at < job->count) {
        size_t count = job->count - at < RUNS_PER_CALL ? job->count - at : RUNS_PER_CALL;
        err = self->batch_has_fail_idx
            ? ((Batch12Fn)self->batch)(job->dsts + at, job->srcs + at, job->sizes + at, count,
                                       (void *)&attrs, &attr_index, 1, &fail_index,
                                       self->copy_stream)
            : ((Batch13Fn)self->batch)(job->dsts + at, job->srcs + at, job->sizes + at, count,
                                       (void *)&attrs, &attr_index, 1, self->copy_stream);
        if (err != CUDA_SUCCESS) {
            self->get_last_error();  /* this thread's; cleared for its next call */
            job->error = err;
            job->failed_call = "cudaMemcpyBatchAsync";
            break;
        }
        at += count;
    }
    /* whatever happened: after the runs issued (a failed batch's slots may still be written
     * until then) and after every earlier job, which may still write when none of this
     * job's runs was issued */
    int recorded = self->event_record(job->done, self->copy_stream);
    if (recorded != CUDA_SUCCESS) {
        self->get_last_error();
        if (err == CUDA_SUCCESS) {
            job->error = recorded;
            job->failed_call = "cudaEventRecord";
        }
        return;
    }
    job->recorded = 1;
}

static void *
issue_loop(void *arg)
{
    Issuer *self = arg;
    int bound = self->set_device(self->device);
    if (bound != CUDA_SUCCESS) {
        self->get_last_error();
    }
    pthread_mutex_lock(&self->lock);
    for (;;) {
        while (!self->stopping && self->issued == self->submitted) {
            pthread_cond_wait(&self->work, &self->lock);
        }
        if (self->issued == self->submitted) {
            break;  /* stopping, and every job submitted was issued */
        }
        Job *job = &self->jobs[self->issued % self->ring];
        pthread_mutex_unlock(&self->lock);
        if (bound == CUDA_SUCCESS) {
            issue(self, job);
        } else {
            job->error = bound;
            job->failed_call = "cudaSetDevice";
        }
        pthread_mutex_lock(&self->lock);
        job->state = job->recorded ? JOB_ISSUED : JOB_FAILED;
        if (job->released) {
            job->state = JOB_FREE;
        }
        self->issued++;
        pthread_cond_broadcast(&self->progress);
    }
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

PyDoc_STRVAR(issuer_doc,
"Issuer(functions, runtime_version, device, copy_stream, ring)\n\n"
"Copies of rows into pool slots, issued by a thread of this module on `copy_stream` (a raw\n"
"cudaStream_t) of device `device`. `functions` are the addresses of cudaSetDevice,\n"
"cudaEventCreateWithFlags, cudaEventRecord, cudaEventQuery, cudaEventSynchronize,\n"
"cudaEventDestroy, cudaStreamWaitEvent, cudaGetLastError, cudaGetErrorName and\n"
"cudaMemcpyBatchAsync, whose form `runtime_version` (cudaRuntimeGetVersion) selects. At\n"
"most `ring` jobs are held.");

static int
issuer_init(Issuer *self, PyObject *args, PyObject *kwds)
{
    PyObject *fns;
    int version, device;
    Py_ssize_t ring;
    PyObject *stream;
    if (!PyArg_ParseTuple(args, "O!iiOn", &PyTuple_Type, &fns, &version, &device, &stream,
                          &ring)) {
        return -1;
    }
    if (self->jobs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Issuer: already initialized");
        return -1;
    }
    void *f[10];
    if (function_addresses(fns, 10, f, "Issuer") < 0) {
        return -1;
    }
    if (version < 12080 || ring <= 0) {
        PyErr_Format(PyExc_ValueError, "Issuer: needs CUDA runtime >= 12.8 (got %d) and a ring "
                     "of at least one job (got %zd)", version, ring);
        return -1;
    }
    self->set_device = (SetDeviceFn)f[0];
    self->event_create = (EventCreateFn)f[1];
    self->event_record = (EventRecordFn)f[2];
    self->event_query = (EventQueryFn)f[3];
    self->event_synchronize = (EventSynchronizeFn)f[4];
    self->event_destroy = (EventDestroyFn)f[5];
    self->stream_wait_event = (StreamWaitEventFn)f[6];
    self->get_last_error = (GetLastErrorFn)f[7];
    self->get_error_name = (RuntimeErrorNameFn)f[8];
    self->batch = f[9];
    self->batch_has_fail_idx = version < 13000;
    self->device = device;
    self->forks = forks;
    self->owner = getpid();
    if (address(stream, &self->copy_stream) < 0) {
        return -1;
    }
    self->jobs = PyMem_Calloc((size_t)ring, sizeof(Job));
    if (self->jobs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->ring = (size_t)ring;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->progress, NULL);
    int err = self->event_create(&self->ready, EVENT_DISABLE_TIMING);
    for (size_t i = 0; i < self->ring && err == CUDA_SUCCESS; i++) {
        err = self->event_create(&self->jobs[i].done, EVENT_DISABLE_TIMING | EVENT_BLOCKING_SYNC);
    }
    if (err != CUDA_SUCCESS) {
        self->get_last_error();
        PyErr_Format(PyExc_RuntimeError, "Issuer: cudaEventCreateWithFlags failed: %s (%d)",
                     error_name(self, err), err);
        return -1;
    }
    if ((err = pthread_create(&self->thread, NULL, issue_loop, self)) != 0) {
        PyErr_Format(PyExc_RuntimeError, "Issuer: no thread: %s", strerror(err));
        return -1;
    }
    self->running = 1;
    return 0;
}

/* The job `id` names, or NULL with an error set (in a forked child too). */
static Job *
job_of(Issuer *self, PyObject *arg, uint64_t *id)
{
    if (refuse_in_child(self) < 0) {
        return NULL;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(arg);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (self->jobs == NULL || value >= self->submitted || self->submitted - value > self->ring) {
        PyErr_Format(PyExc_ValueError, "dma: no job %llu", value);
        return NULL;
    }
    *id = value;
    return &self->jobs[value % self->ring];
}

/* Bytes of the runs of consecutive slots: plan them into `job` (grown as needed). */
static int
plan_runs(Job *job, const int64_t *slots, Py_ssize_t n, char *src, char *dst, size_t row)
{
    size_t count = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        count += i == 0 || slots[i] != slots[i - 1] + 1;
    }
    if (count > job->capacity) {
        size_t capacity = count < 64 ? 64 : count;
        void **dsts = PyMem_Realloc(job->dsts, capacity * sizeof(void *));
        if (dsts != NULL) {
            job->dsts = dsts;
        }
        void **srcs = PyMem_Realloc(job->srcs, capacity * sizeof(void *));
        if (srcs != NULL) {
            job->srcs = srcs;
        }
        size_t *sizes = PyMem_Realloc(job->sizes, capacity * sizeof(size_t));
        if (sizes != NULL) {
            job->sizes = sizes;
        }
        if (dsts == NULL || srcs == NULL || sizes == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        job->capacity = capacity;
    }
    size_t k = 0;
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t first = i;
        while (++i < n && slots[i] == slots[i - 1] + 1) {
        }
        job->dsts[k] = dst + (size_t)slots[first] * row;
        job->srcs[k] = src + (size_t)first * row;
        job->sizes[k] = (size_t)(i - first) * row;
        k++;
    }
    job->count = k;
    return 0;
}

PyDoc_STRVAR(submit_doc,
"submit(caller_stream, ready, src, row_bytes, slots, dst, num_slots) -> job\n\n"
"Queue the copy of row i (row_bytes at device address src + i * row_bytes) into slot\n"
"slots[i] of the host pool at dst (num_slots rows of row_bytes, registered with the device)\n"
"for each of the int64 slots, a run of consecutive slots at a time. The copy stream waits\n"
"for `ready` (a cudaEvent_t), or, when it is 0, for the caller's stream as it is now. Raises,\n"
"queuing nothing: IndexError naming the first slot outside 0..num_slots-1; RuntimeError when\n"
"the ring is full of unreleased jobs, or a stream call fails. One thread submits at a time.");

static PyObject *
issuer_submit(Issuer *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        return PyErr_Format(PyExc_TypeError, "submit takes 7 arguments, got %zd", nargs);
    }
    if (refuse_in_child(self) < 0) {
        return NULL;
    }
    if (!self->running) {
        return PyErr_Format(PyExc_RuntimeError, "dma: submit after close()");
    }
    void *stream, *ready, *src, *dst;
    long long row_bytes = PyLong_AsLongLong(args[3]), num_slots = PyLong_AsLongLong(args[6]);
    if (address(args[0], &stream) < 0 || address(args[1], &ready) < 0 ||
            address(args[2], &src) < 0 || address(args[5], &dst) < 0 || PyErr_Occurred()) {
        return NULL;
    }
    if (row_bytes <= 0 || num_slots < 0) {
        return PyErr_Format(PyExc_ValueError, "dma: rows of %lld bytes, %lld slots", row_bytes,
                            num_slots);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[4], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    const char *fmt = view.format ? view.format : "B";
    char kind = fmt[strlen(fmt) - 1];
    if (view.ndim != 1 || view.itemsize != 8 || (kind != 'l' && kind != 'q')) {
        PyErr_Format(PyExc_TypeError, "dma: slots must be a 1-D int64 array, got format '%s'",
                     view.format);
        goto done;
    }
    const int64_t *slots = view.buf;
    Py_ssize_t n = view.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= num_slots) {
            PyErr_Format(PyExc_IndexError, "cuda DMA: slot %lld (index %zd) is outside 0..%lld",
                         (long long)slots[i], i, num_slots - 1);
            goto done;
        }
    }
    pthread_mutex_lock(&self->lock);
    uint64_t id = self->submitted;
    Job *job = &self->jobs[id % self->ring];
    int busy = job->state != JOB_FREE;
    pthread_mutex_unlock(&self->lock);
    if (busy) {
        PyErr_Format(PyExc_RuntimeError, "dma: %zu copies in flight, none released: the ring "
                     "is full", self->ring);
        goto done;
    }
    if (plan_runs(job, slots, n, src, dst, (size_t)row_bytes) < 0) {
        goto done;
    }
    int err = CUDA_SUCCESS;
    const char *call = "cudaEventRecord";
    if (ready == NULL) {
        err = self->event_record(self->ready, stream);
        ready = self->ready;
    }
    if (err == CUDA_SUCCESS) {
        call = "cudaStreamWaitEvent";
        err = self->stream_wait_event(self->copy_stream, ready, 0);
    }
    if (err != CUDA_SUCCESS) {
        self->get_last_error();  /* not left for torch's next launch check on this thread */
        PyErr_Format(PyExc_RuntimeError, "cuda DMA: %s failed: %s (%d)", call,
                     error_name(self, err), err);
        goto done;
    }
    pthread_mutex_lock(&self->lock);
    if (self->stopping) {  /* close() raced this call: its thread would never issue the job */
        pthread_mutex_unlock(&self->lock);
        PyErr_Format(PyExc_RuntimeError, "dma: submit after close()");
        goto done;
    }
    job->state = JOB_QUEUED;
    job->released = 0;
    job->recorded = 0;
    job->error = CUDA_SUCCESS;
    self->submitted++;
    pthread_cond_signal(&self->work);
    pthread_mutex_unlock(&self->lock);
    result = PyLong_FromUnsignedLongLong(id);
done:
    PyBuffer_Release(&view);
    return result;
}

/* The job's state; an ISSUED job whose event failed, or whose batch failed partway and whose
 * event completed, becomes FAILED (caller holds the lock). */
static int
settle(Issuer *self, Job *job)
{
    if (job->state == JOB_ISSUED) {
        int err = self->event_query(job->done);
        if (err == CUDA_NOT_READY) {
            return JOB_QUEUED;  /* in flight */
        }
        if (err != CUDA_SUCCESS) {
            self->get_last_error();
            job->error = err;
            job->failed_call = "cudaEventQuery";
            job->state = JOB_FAILED;
        } else if (job->error != CUDA_SUCCESS) {
            job->state = JOB_FAILED;  /* the runs it issued have landed; the rest never will */
        }
    }
    return job->state;
}

/* The CLOCK_REALTIME time (the condition variables' clock) `timeout_s` from now; raises
 * ValueError for a timeout that is not a number of seconds from 0 to 1e9. */
static int
deadline_after(double timeout_s, struct timespec *deadline)
{
    if (!(timeout_s >= 0.0 && timeout_s <= 1e9)) {
        char text[32];
        snprintf(text, sizeof text, "%g", timeout_s);
        PyErr_Format(PyExc_ValueError, "dma: timeout %s is not 0 to 1e9 seconds", text);
        return -1;
    }
    clock_gettime(CLOCK_REALTIME, deadline);
    time_t whole = (time_t)timeout_s;
    deadline->tv_sec += whole;
    deadline->tv_nsec += (long)((timeout_s - (double)whole) * 1e9);
    if (deadline->tv_nsec >= 1000000000L) {
        deadline->tv_sec++;
        deadline->tv_nsec -= 1000000000L;
    }
    return 0;
}

PyDoc_STRVAR(query_doc, "query(job) -> bool\n\nWhether the job is over: copied, or failed.");

static PyObject *
issuer_query(Issuer *self, PyObject *arg)
{
    uint64_t id;
    Job *job = job_of(self, arg, &id);
    if (job == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    int state = settle(self, job);
    pthread_mutex_unlock(&self->lock);
    return PyBool_FromLong(state == JOB_ISSUED || state == JOB_FAILED);
}

PyDoc_STRVAR(wait_doc,
"wait(job, timeout_s) -> bool\n\nWait, GIL released, at most timeout_s for the job to be over.");

static PyObject *
issuer_wait(Issuer *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "wait takes 2 arguments, got %zd", nargs);
    }
    uint64_t id;
    Job *job = job_of(self, args[0], &id);
    double timeout_s = PyFloat_AsDouble(args[1]);
    if (job == NULL || (timeout_s == -1.0 && PyErr_Occurred())) {
        return NULL;
    }
    struct timespec now, deadline;
    if (deadline_after(timeout_s, &deadline) < 0) {
        return NULL;
    }
    int state, pause_us = 10;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    for (;;) {
        state = settle(self, job);
        if (state == JOB_ISSUED || state == JOB_FAILED) {
            break;
        }
        if (self->issued <= id) {  /* not issued yet: the issuing thread says when */
            if (pthread_cond_timedwait(&self->progress, &self->lock, &deadline) == ETIMEDOUT) {
                state = settle(self, job);
                break;
            }
            continue;
        }
        clock_gettime(CLOCK_REALTIME, &now);  /* issued: poll its event, backing off */
        if (now.tv_sec > deadline.tv_sec ||
                (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec)) {
            break;
        }
        pthread_mutex_unlock(&self->lock);
        struct timespec pause = {0, pause_us * 1000L};
        nanosleep(&pause, NULL);
        pause_us = pause_us < 200 ? pause_us * 2 : 200;
        pthread_mutex_lock(&self->lock);
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(state == JOB_ISSUED || state == JOB_FAILED);
}

PyDoc_STRVAR(synchronize_doc,
"synchronize(job) -> None\n\nWait, GIL released, for the job to be over: for its issue, then in\n"
"the driver on its done event (a blocking-sync event: the thread sleeps). Unbounded, as a\n"
"torch event's synchronize; bounded waits use `wait`.");

static PyObject *
issuer_synchronize(Issuer *self, PyObject *arg)
{
    uint64_t id;
    Job *job = job_of(self, arg, &id);
    if (job == NULL) {
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    while (self->issued <= id) {
        pthread_cond_wait(&self->progress, &self->lock);
    }
    int issued = job->state == JOB_ISSUED;
    pthread_mutex_unlock(&self->lock);
    if (issued && self->event_synchronize(job->done) != CUDA_SUCCESS) {
        self->get_last_error();  /* settle() records what the event's query then finds */
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(error_doc,
"error(job) -> str | None\n\nWhy the job failed (the CUDA call and error), or None.");

static PyObject *
issuer_error(Issuer *self, PyObject *arg)
{
    uint64_t id;
    Job *job = job_of(self, arg, &id);
    if (job == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    int state = settle(self, job), err = job->error;
    const char *call = job->failed_call;
    pthread_mutex_unlock(&self->lock);
    if (state != JOB_FAILED) {
        Py_RETURN_NONE;
    }
    return PyUnicode_FromFormat("%s failed: %s (%d)", call, error_name(self, err), err);
}

PyDoc_STRVAR(release_doc,
"release(job) -> None\n\nThe job's handle is gone: its place in the ring is free once issued\n"
"(nothing, in a forked child).");

static PyObject *
issuer_release(Issuer *self, PyObject *arg)
{
    if (self->forks != forks) {
        Py_RETURN_NONE;  /* the parent's ring */
    }
    uint64_t id;
    Job *job = job_of(self, arg, &id);
    if (job == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    if (job->state == JOB_QUEUED) {
        job->released = 1;  /* the issuing thread frees it */
    } else {
        job->state = JOB_FREE;
    }
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(flush_doc,
"flush(timeout_s) -> bool\n\nWait, GIL released, at most timeout_s for every job submitted so\n"
"far to be issued; the copy stream then holds them all.");

static PyObject *
issuer_flush(Issuer *self, PyObject *arg)
{
    double timeout_s = PyFloat_AsDouble(arg);
    if ((timeout_s == -1.0 && PyErr_Occurred()) || refuse_in_child(self) < 0) {
        return NULL;
    }
    struct timespec deadline;
    if (deadline_after(timeout_s, &deadline) < 0) {
        return NULL;
    }
    int flushed;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    uint64_t target = self->submitted;
    while (self->issued < target &&
           pthread_cond_timedwait(&self->progress, &self->lock, &deadline) != ETIMEDOUT) {
    }
    flushed = self->issued >= target;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(flushed);
}

PyDoc_STRVAR(close_doc,
"close() -> None\n\nIssue what is queued, stop the thread. Call once every job is over. In a\n"
"forked child, nothing: the thread is the parent's.");

static PyObject *
issuer_close(Issuer *self, PyObject *unused)
{
    if (!self->running || self->forks != forks) {
        Py_RETURN_NONE;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    self->stopping = 1;
    pthread_cond_signal(&self->work);
    pthread_mutex_unlock(&self->lock);
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->running = 0;
    Py_RETURN_NONE;
}

static void
issuer_dealloc(Issuer *self)
{
    /* kept across the runtime calls below: a failed __init__ deallocates with its error set */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    /* a forked child frees its copy of the memory alone: the thread, the events and the lock
     * (which a thread of the parent may have held at the fork) are the parent's */
    int owned = self->forks == forks, destroyed = CUDA_SUCCESS;
    if (owned && self->running) {
        PyObject *ignored = issuer_close(self, NULL);
        Py_XDECREF(ignored);
    }
    if (self->jobs != NULL) {
        for (size_t i = 0; i < self->ring; i++) {
            Job *job = &self->jobs[i];
            if (owned && job->done != NULL) {
                destroyed |= self->event_destroy(job->done);
            }
            PyMem_Free(job->dsts);
            PyMem_Free(job->srcs);
            PyMem_Free(job->sizes);
        }
        if (owned && self->ready != NULL) {
            destroyed |= self->event_destroy(self->ready);
        }
        if (destroyed != CUDA_SUCCESS) {
            self->get_last_error();
        }
        PyMem_Free(self->jobs);
        if (owned) {
            pthread_mutex_destroy(&self->lock);
            pthread_cond_destroy(&self->work);
            pthread_cond_destroy(&self->progress);
        }
    }
    PyErr_Restore(type, value, traceback);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef issuer_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))issuer_submit, METH_FASTCALL, submit_doc},
    {"query", (PyCFunction)issuer_query, METH_O, query_doc},
    {"wait", (PyCFunction)(void (*)(void))issuer_wait, METH_FASTCALL, wait_doc},
    {"synchronize", (PyCFunction)issuer_synchronize, METH_O, synchronize_doc},
    {"error", (PyCFunction)issuer_error, METH_O, error_doc},
    {"release", (PyCFunction)issuer_release, METH_O, release_doc},
    {"flush", (PyCFunction)issuer_flush, METH_O, flush_doc},
    {"close", (PyCFunction)issuer_close, METH_NOARGS, close_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IssuerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefix_cache.devices.cuda._dma.Issuer",
    .tp_basicsize = sizeof(Issuer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = issuer_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)issuer_init,
    .tp_dealloc = (destructor)issuer_dealloc,
    .tp_methods = issuer_methods,
};

static struct PyModuleDef dma_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefix_cache.devices.cuda._dma",
    .m_doc = "Copies of rows into pool slots by the CUDA copy engine, issued off the GIL.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__dma(void)
{
    if (PyType_Ready(&IssuerType) < 0) {
        return NULL;
    }
    if (pthread_atfork(NULL, NULL, count_fork_in_child) != 0) {
        return PyErr_Format(PyExc_RuntimeError, "_dma: pthread_atfork failed");
    }
    PyObject *module = PyModule_Create(&dma_module);
    if (module == NULL || PyModule_AddObjectRef(module, "Issuer", (PyObject *)&IssuerType) < 0) {
        Py_XDECREF(module);
        return NULL;
    }
    return module;
}
