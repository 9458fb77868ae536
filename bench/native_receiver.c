/* A same-node rollout receiver with no Python in its loop: how fast the route could go
 * if its receiving thread did not need the GIL (bench/transport_native.py builds and times it).
 *
 * Why it exists: issue 19 asks the same-node route for >= 0.5 of a raw socket at 64 KB,
 * and the route's receiving thread shares Python's GIL with the trainer's thread that
 * takes each batch. This receiver reads the route's frames (`!QBQ`: sequence, kind,
 * length, then the message), holds at most `capacity` bodies, and answers each batch's
 * `!QB` (sequence, 0 = queued) once it holds it, all in a POSIX thread that never takes
 * the GIL. Python only takes bodies (`take`), with the GIL released while it waits.
 * It keeps the route's contract except deduplication (one producer, numbers checked by
 * the bench), so what it measures is an upper bound on a native receiver's speed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <endian.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define FRAME_BYTES 17 /* !QBQ */
#define ACK_BYTES 9    /* !QB */
#define KIND_BATCH 1

/* One received message, owned by the Python object that exposes it (no copy out of C). */
typedef struct {
    PyObject_HEAD
    char *data;
    Py_ssize_t size;
} Body;

static int body_getbuffer(Body *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->size, 1, flags);
}

static void body_dealloc(Body *self) {
    free(self->data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs body_as_buffer = {(getbufferproc)body_getbuffer, NULL};

static PyTypeObject BodyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_receiver.Body",
    .tp_basicsize = sizeof(Body),
    .tp_dealloc = (destructor)body_dealloc,
    .tp_as_buffer = &body_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

typedef struct {
    uint64_t seq;
    char *data;
    uint64_t size;
} Item;

typedef struct {
    PyObject_HEAD
    int fd, capacity, head, count, closed, started;
    unsigned long long received;
    Item *ring;
    pthread_mutex_t lock;
    pthread_cond_t nonempty, space;
    pthread_t thread;
} Receiver;

/* 1: filled; 0: orderly close before the first byte; -1: error or close mid-way. */
static int recv_all(int fd, char *into, size_t size) {
    size_t got = 0;
    while (got < size) {
        ssize_t n = recv(fd, into + got, size - got, MSG_WAITALL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return (n == 0 && got == 0) ? 0 : -1;
        got += (size_t)n;
    }
    return 1;
}

/* Wait for room, then hold the body; 0 once the receiver is closed. */
static int hold(Receiver *self, Item item) {
    pthread_mutex_lock(&self->lock);
    while (self->count >= self->capacity && !self->closed) pthread_cond_wait(&self->space, &self->lock);
    int open = !self->closed;
    if (open) {
        self->ring[(self->head + self->count) % self->capacity] = item;
        self->count++;
        self->received++;
        pthread_cond_signal(&self->nonempty);
    }
    pthread_mutex_unlock(&self->lock);
    return open;
}

static void *receive_loop(void *arg) {
    Receiver *self = (Receiver *)arg;
    unsigned char frame[FRAME_BYTES], ack[ACK_BYTES] = {0};
    while (recv_all(self->fd, (char *)frame, FRAME_BYTES) == 1) {
        uint64_t seq, size;
        memcpy(&seq, frame, 8);
        memcpy(&size, frame + 9, 8);
        seq = be64toh(seq);
        size = be64toh(size);
        char *data = malloc(size ? size : 1);
        if (data == NULL || recv_all(self->fd, data, size) != 1) {
            free(data);
            break;
        }
        if (frame[8] != KIND_BATCH) { /* a schema: the bench read the connection's first one itself */
            free(data);
            continue;
        }
        if (!hold(self, (Item){seq, data, size})) {
            free(data);
            break;
        }
        uint64_t wire_seq = htobe64(seq);
        memcpy(ack, &wire_seq, 8); /* ack[8] stays 0: "queued" */
        if (send(self->fd, ack, ACK_BYTES, MSG_NOSIGNAL) != ACK_BYTES) break;
    }
    pthread_mutex_lock(&self->lock);
    self->closed = 1;
    pthread_cond_broadcast(&self->nonempty);
    pthread_mutex_unlock(&self->lock);
    return NULL;
}

static int receiver_init(Receiver *self, PyObject *args, PyObject *kwargs) {
    int fd, capacity;
    if (!PyArg_ParseTuple(args, "ii", &fd, &capacity)) return -1;
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity must be at least 1");
        return -1;
    }
    if (self->ring != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Receiver is initialised once");
        return -1;
    }
    self->ring = calloc((size_t)capacity, sizeof(Item));
    if (self->ring == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->fd = dup(fd); /* the Python socket may be closed first; this end is ours */
    if (self->fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->capacity = capacity;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->nonempty, NULL);
    pthread_cond_init(&self->space, NULL);
    if (pthread_create(&self->thread, NULL, receive_loop, self) != 0) {
        close(self->fd);
        PyErr_SetString(PyExc_RuntimeError, "could not start the receiving thread");
        return -1;
    }
    self->started = 1;
    return 0;
}

/* take(timeout_s) -> (sequence, body) | None: None once closed and empty, or on timeout. */
static PyObject *receiver_take(Receiver *self, PyObject *args) {
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s)) return NULL;
    Item item = {0, NULL, 0};
    Py_BEGIN_ALLOW_THREADS
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)timeout_s;
    deadline.tv_nsec += (long)((timeout_s - (double)(time_t)timeout_s) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&self->lock);
    int waited = 0;
    while (self->count == 0 && !self->closed && waited != ETIMEDOUT)
        waited = pthread_cond_timedwait(&self->nonempty, &self->lock, &deadline);
    if (self->count) {
        item = self->ring[self->head];
        self->head = (self->head + 1) % self->capacity;
        self->count--;
        pthread_cond_signal(&self->space);
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (item.data == NULL) Py_RETURN_NONE;
    Body *body = PyObject_New(Body, &BodyType);
    if (body == NULL) {
        free(item.data);
        return NULL;
    }
    body->data = item.data;
    body->size = (Py_ssize_t)item.size;
    return Py_BuildValue("KN", (unsigned long long)item.seq, (PyObject *)body);
}

/* Stop the thread (the producer sees its connection end), free what was never taken. Safe twice. */
static PyObject *receiver_close(Receiver *self, PyObject *unused) {
    if (!self->started) Py_RETURN_NONE;
    self->started = 0;
    Py_BEGIN_ALLOW_THREADS
    shutdown(self->fd, SHUT_RDWR);
    pthread_mutex_lock(&self->lock);
    self->closed = 1;
    pthread_cond_broadcast(&self->space);
    pthread_mutex_unlock(&self->lock);
    pthread_join(self->thread, NULL);
    pthread_mutex_lock(&self->lock); /* a taker in another thread may still be leaving `take` */
    for (; self->count; self->count--, self->head = (self->head + 1) % self->capacity)
        free(self->ring[self->head].data);
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    close(self->fd);
    Py_RETURN_NONE;
}

static PyObject *receiver_received(Receiver *self, void *unused) {
    return PyLong_FromUnsignedLongLong(self->received);
}

static void receiver_dealloc(Receiver *self) {
    Py_XDECREF(receiver_close(self, NULL));
    free(self->ring);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef receiver_methods[] = {
    {"take", (PyCFunction)receiver_take, METH_VARARGS, "take(timeout_s) -> (sequence, body) or None"},
    {"close", (PyCFunction)receiver_close, METH_NOARGS, "stop receiving; safe twice"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef receiver_getset[] = {
    {"received", (getter)receiver_received, NULL, "batches held so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReceiverType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_receiver.Receiver",
    .tp_basicsize = sizeof(Receiver),
    .tp_dealloc = (destructor)receiver_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)receiver_init,
    .tp_methods = receiver_methods,
    .tp_getset = receiver_getset,
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "native_receiver", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_native_receiver(void) {
    if (PyType_Ready(&BodyType) < 0 || PyType_Ready(&ReceiverType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    Py_INCREF(&ReceiverType);
    if (PyModule_AddObject(module, "Receiver", (PyObject *)&ReceiverType) < 0) {
        Py_DECREF(&ReceiverType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
