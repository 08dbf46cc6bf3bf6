/* The runtime of the simulated libnvidia-ml.so.1 (see nvml_sim.h and migsim/nvml/abi.py).
 *
 * Every NVML call the library implements is one request/reply on a unix socket to the node's
 * simulator (path in $MIG_AGENT_SIM_NVML_SOCKET), which answers from the node's state file with
 * the same Python code pynvml runs over in-process. Here: the connection (one per process, opened
 * by the first nvmlInit, closed by the last nvmlShutdown, reopened in a forked child), one lock
 * around each call (thread-safe), and handles: pointers this library owns, one per token the
 * simulator hands out, stable for the life of the process; a pointer not handed out by this
 * library is sent as token 0, which the simulator refuses with NVML_ERROR_INVALID_ARGUMENT.
 *
 * What the process may see (migsim/nvml/visibility.py) is read here, when it connects: the names
 * of the files in $MIG_AGENT_SIM_VISIBLE_DIR (default /run/migsim-visible, which a container is
 * given), sent with the init call; without that folder, everything. */
#define _GNU_SOURCE
#include "nvml_sim.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <nvml.h>

#define ENV_SOCKET "MIG_AGENT_SIM_NVML_SOCKET"
#define ENV_VISIBLE_DIR "MIG_AGENT_SIM_VISIBLE_DIR"
#define VISIBLE_DIR "/run/migsim-visible"
#define HANDLE_MAGIC 0x6d69677369686e64ULL

struct sim_handle {
    uint64_t magic;
    uint64_t token;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int fd = -1;
static unsigned int init_count;
static struct sim_handle **handles;
static size_t handle_count, handle_cap;

static void warn(const char *what, const char *detail) {
    fprintf(stderr, "libnvidia-ml.so.1 (simulated): %s%s%s\n", what, detail ? ": " : "",
            detail ? detail : "");
}

/* -- handles (called with the lock held) ------------------------------------------------------- */

static void *handle_for(uint64_t token) {
    if (token == 0) return NULL;
    for (size_t i = 0; i < handle_count; i++)
        if (handles[i]->token == token) return handles[i];
    if (handle_count == handle_cap) {
        size_t cap = handle_cap ? 2 * handle_cap : 64;
        struct sim_handle **grown = realloc(handles, cap * sizeof *grown);
        if (!grown) return NULL;
        handles = grown;
        handle_cap = cap;
    }
    struct sim_handle *h = malloc(sizeof *h);
    if (!h) return NULL;
    h->magic = HANDLE_MAGIC;
    h->token = token;
    handles[handle_count++] = h;
    return h;
}

static uint64_t token_of(const void *p) {
    if (!p) return 0;
    for (size_t i = 0; i < handle_count; i++)
        if (handles[i] == p) return handles[i]->token;
    return 0;
}

/* -- I/O ------------------------------------------------------------------------------------------ */

static int write_all(const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(char *p, size_t n) {
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int reserve(sim_call *c, size_t more) {
    if (c->failed) return -1;
    if (c->len + more <= c->cap) return 0;
    size_t cap = c->cap ? c->cap : 256;
    while (cap < c->len + more) cap *= 2;
    char *grown = realloc(c->buf, cap);
    if (!grown) {
        c->failed = 1;
        return -1;
    }
    c->buf = grown;
    c->cap = cap;
    return 0;
}

static void begin(sim_call *c, const char *name) {
    memset(c, 0, sizeof *c);
    uint32_t placeholder = 0;
    sim_put_bytes(c, &placeholder, sizeof placeholder);
    sim_put_bytes(c, name, strlen(name) + 1);
}

/* Sends c's request and reads the reply into c; -1 when the connection failed. */
static int exchange(sim_call *c, int *rc) {
    if (c->failed) return -1;
    uint32_t len = (uint32_t)(c->len - 4);
    memcpy(c->buf, &len, 4);
    if (fd < 0 || write_all(c->buf, c->len) < 0 || read_all((char *)&len, 4) < 0 || len < 4) {
        warn("lost the connection to the GPU simulator", strerror(errno));
        c->failed = 1;
        return -1;
    }
    c->len = 0;
    if (reserve(c, len) < 0 || read_all(c->buf, len) < 0) {
        c->failed = 1;
        return -1;
    }
    c->len = len;
    int32_t code;
    memcpy(&code, c->buf, 4);
    c->pos = 4;
    *rc = code;
    return 0;
}

static int connect_server(void) {
    const char *path = getenv(ENV_SOCKET);
    if (!path || !*path) {
        warn("no GPU simulator: " ENV_SOCKET " is not set (run under scripts/with-sim-gpus)", NULL);
        return -1;
    }
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        warn("socket path too long", path);
        return -1;
    }
    strcpy(addr.sun_path, path);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    if (connect(s, (struct sockaddr *)&addr, sizeof addr) < 0) {
        warn("cannot connect to the GPU simulator", strerror(errno));
        close(s);
        return -1;
    }
    fd = s;
    return 0;
}

/* Appends what this process sees: u32 n (sim_visible_everything: all), n names (abi.py). No
 * folder: everything; a folder that cannot be read: nothing (and a warning); a file "all":
 * everything. Dotfiles are not names. */
static void put_visible(sim_call *c) {
    const char *dir = getenv(ENV_VISIBLE_DIR);
    if (!dir || !*dir) dir = VISIBLE_DIR;
    DIR *d = opendir(dir);
    if (!d) {
        int absent = errno == ENOENT;
        if (!absent) warn("cannot read the visible-devices folder; no GPU is visible", dir);
        sim_put_u32(c, absent ? sim_visible_everything : 0);
        return;
    }
    size_t at = c->len;
    uint32_t n = 0;
    sim_put_u32(c, 0);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        if (strcmp(e->d_name, "all") == 0) {
            n = sim_visible_everything;
            break;
        }
        sim_put_text(c, e->d_name);
        n++;
    }
    closedir(d);
    if (c->failed) return;
    if (n == sim_visible_everything) c->len = at + 4;
    memcpy(c->buf + at, &n, 4);
}

/* Connects and sends an init call; NVML's code for it. Lock held. */
static int init_locked(const char *name, int has_flags, unsigned int flags) {
    if (fd < 0 && connect_server() < 0) return NVML_ERROR_DRIVER_NOT_LOADED;
    sim_call c;
    begin(&c, name);
    if (has_flags) sim_put_u32(&c, flags);
    put_visible(&c);
    int rc = NVML_ERROR_UNKNOWN;
    if (exchange(&c, &rc) < 0) rc = NVML_ERROR_DRIVER_NOT_LOADED;
    free(c.buf);
    if (rc != NVML_SUCCESS) {
        close(fd);
        fd = -1;
    }
    return rc;
}

/* A forked child has its parent's socket: it reconnects on its next call. */
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork_parent(void) { pthread_mutex_unlock(&lock); }
static void after_fork_child(void) {
    if (fd >= 0) close(fd);
    fd = -1;
    pthread_mutex_unlock(&lock);
}

__attribute__((constructor)) static void setup(void) {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* -- the calls ------------------------------------------------------------------------------------ */

int sim_start(sim_call *c, const char *name) {
    pthread_mutex_lock(&lock);
    if (init_count == 0) {
        pthread_mutex_unlock(&lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (fd < 0) {
        int rc = init_locked("nvmlInit_v2", 0, 0);
        if (rc != NVML_SUCCESS) {
            pthread_mutex_unlock(&lock);
            return rc;
        }
    }
    begin(c, name);
    return NVML_SUCCESS;
}

int sim_send(sim_call *c) {
    int rc = NVML_ERROR_UNKNOWN;
    if (exchange(c, &rc) < 0) return NVML_ERROR_UNKNOWN;
    return rc;
}

int sim_finish(sim_call *c, int rc) {
    if (!c->failed && c->pos != c->len) {
        warn("malformed reply from the GPU simulator", NULL);
        c->failed = 1;
    }
    if (c->failed && rc == NVML_SUCCESS) rc = NVML_ERROR_UNKNOWN;
    free(c->buf);
    pthread_mutex_unlock(&lock);
    return rc;
}

void sim_put_bytes(sim_call *c, const void *p, size_t size) {
    if (reserve(c, size) < 0) return;
    memcpy(c->buf + c->len, p, size);
    c->len += size;
}

void sim_put_u8(sim_call *c, uint8_t v) { sim_put_bytes(c, &v, 1); }
void sim_put_u32(sim_call *c, uint32_t v) { sim_put_bytes(c, &v, 4); }

void sim_put_handle(sim_call *c, const void *handle) {
    uint64_t token = token_of(handle);
    sim_put_bytes(c, &token, 8);
}

void sim_put_text(sim_call *c, const char *text) {
    if (!text) {
        sim_put_u32(c, UINT32_MAX);
        return;
    }
    size_t n = strlen(text);
    sim_put_u32(c, (uint32_t)n);
    sim_put_bytes(c, text, n);
}

size_t sim_put_ptr(sim_call *c, const void *p, size_t size) {
    sim_put_u8(c, p != NULL);
    if (!p) return 0;
    size_t off = c->len;
    sim_put_bytes(c, p, size);
    return off;
}

void sim_tokenize(sim_call *c, size_t off) {
    if (c->failed || off + sizeof(void *) > c->len) return;
    void *p;
    memcpy(&p, c->buf + off, sizeof p);
    uint64_t token = token_of(p);
    memcpy(c->buf + off, &token, 8);
}

static const char *take(sim_call *c, size_t n) {
    if (c->failed || c->pos + n > c->len) {
        c->failed = 1;
        return NULL;
    }
    const char *p = c->buf + c->pos;
    c->pos += n;
    return p;
}

void sim_get_ptr(sim_call *c, void *p, size_t size) {
    const char *src = take(c, size);
    if (src) memcpy(p, src, size);
}

void sim_get_handle(sim_call *c, void **out) {
    const char *src = take(c, 8);
    if (!src) return;
    uint64_t token;
    memcpy(&token, src, 8);
    if (token) *out = handle_for(token);
}

static size_t get_count(sim_call *c, size_t max) {
    const char *src = take(c, 4);
    if (!src) return 0;
    uint32_t k;
    memcpy(&k, src, 4);
    if (k > max) {
        c->failed = 1;
        return 0;
    }
    return k;
}

void sim_get_array(sim_call *c, void *p, size_t elem, size_t max) {
    size_t k = get_count(c, max);
    const char *src = take(c, k * elem);
    if (src && k) memcpy(p, src, k * elem);
}

void sim_get_handles(sim_call *c, void **p, size_t max) {
    size_t k = get_count(c, max);
    for (size_t i = 0; i < k; i++) sim_get_handle(c, &p[i]);
}

void sim_untokenize(void *p) {
    uint64_t token;
    memcpy(&token, p, 8);
    void *h = handle_for(token);
    memcpy(p, &h, sizeof h);
}

/* -- init, shutdown, error strings: the library's own ------------------------------------------- */

static nvmlReturn_t init(const char *name, int has_flags, unsigned int flags) {
    pthread_mutex_lock(&lock);
    int rc = NVML_SUCCESS;
    if (init_count == 0) rc = init_locked(name, has_flags, flags);
    if (rc == NVML_SUCCESS) init_count++;
    pthread_mutex_unlock(&lock);
    return (nvmlReturn_t)rc;
}

nvmlReturn_t nvmlInit_v2(void) { return init("nvmlInit_v2", 0, 0); }
nvmlReturn_t nvmlInit(void) { return init("nvmlInit_v2", 0, 0); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { return init("nvmlInitWithFlags", 1, flags); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    int rc = NVML_SUCCESS;
    if (init_count == 0) {
        rc = NVML_ERROR_UNINITIALIZED;
    } else if (--init_count == 0 && fd >= 0) {
        sim_call c;
        begin(&c, "nvmlShutdown");
        if (exchange(&c, &rc) < 0) rc = NVML_SUCCESS; /* the simulator is gone: nothing to undo */
        free(c.buf);
        close(fd);
        fd = -1;
    }
    pthread_mutex_unlock(&lock);
    return (nvmlReturn_t)rc;
}

const char *nvmlErrorString(nvmlReturn_t result) { return sim_error_string((int)result); }

/* -- GPU reset: not NVML ---------------------------------------------------------------------------
 * Real GPU resets go to the driver, not through NVML (nvidia-smi -r). The simulated nvidia-smi
 * finds this function with dlsym and asks the simulator to reset a GPU it has a handle of; why a
 * refused reset was refused goes to message (length bytes, NUL-terminated; may be NULL). */

nvmlReturn_t migsimDeviceReset(nvmlDevice_t device, char *message, unsigned int length);

nvmlReturn_t migsimDeviceReset(nvmlDevice_t device, char *message, unsigned int length) {
    if (message && length) message[0] = '\0';
    sim_call c;
    int rc = sim_start(&c, sim_reset_gpu);
    if (rc != NVML_SUCCESS) return (nvmlReturn_t)rc;
    sim_put_handle(&c, device.handle);
    rc = sim_send(&c);
    if (!c.failed) {
        const char *src = NULL;
        uint32_t k = 0;
        sim_get_ptr(&c, &k, 4);
        if (!c.failed && c.pos + k <= c.len) {
            src = c.buf + c.pos;
            c.pos += k;
        } else {
            c.failed = 1;
        }
        if (src && message && length) {
            size_t n = k < length - 1 ? k : length - 1;
            memcpy(message, src, n);
            message[n] = '\0';
        }
    }
    return (nvmlReturn_t)sim_finish(&c, rc);
}

/* -- a CUDA program's footprint: not NVML ------------------------------------------------------
 * A CUDA program shows as a compute process on the devices it uses until it exits. The simulated
 * gpu-workload finds this function with dlsym and asks the simulator to show the calling process
 * (name, usedMemoryMiB) on every device it sees, for as long as its connection stays open: until
 * the process exits (however) or its last nvmlShutdown. The UUIDs held go to held (length bytes,
 * each followed by a newline, NUL-terminated, cut short if too long; may be NULL). */

nvmlReturn_t migsimHoldDevices(const char *name, unsigned int usedMemoryMiB, char *held,
                               unsigned int length);

nvmlReturn_t migsimHoldDevices(const char *name, unsigned int usedMemoryMiB, char *held,
                               unsigned int length) {
    if (held && length) held[0] = '\0';
    sim_call c;
    int rc = sim_start(&c, sim_hold_devices);
    if (rc != NVML_SUCCESS) return (nvmlReturn_t)rc;
    sim_put_u32(&c, usedMemoryMiB);
    sim_put_text(&c, name ? name : "");
    rc = sim_send(&c);
    if (!c.failed) {
        uint32_t k = 0;
        sim_get_ptr(&c, &k, 4);
        if (!c.failed && c.pos + k <= c.len) {
            if (held && length) {
                size_t n = k < length - 1 ? k : length - 1;
                memcpy(held, c.buf + c.pos, n);
                held[n] = '\0';
            }
            c.pos += k;
        } else {
            c.failed = 1;
        }
    }
    return (nvmlReturn_t)sim_finish(&c, rc);
}

/* -- event sets: the library's own ----------------------------------------------------------------
 * An event set is a list of (GPU, event types) registrations and a cursor: the number of the last
 * simulator event it has seen (events raised before the set was created are not its). Events are
 * raised in the node's state (python -m migsim.nvml xid). nvmlEventSetWait_v2 polls the simulator
 * every sim_event_poll_ms and sleeps in between *without the lock* (other threads of the process
 * keep calling NVML, as with real NVML) until an event or its timeout: NVML_ERROR_TIMEOUT, as a
 * quiet GPU gives. nvmlDeviceRegisterEvents asks the simulator which types the device supports
 * (which also checks the handle) and refuses any other type with NVML_ERROR_NOT_SUPPORTED. */

#define EVENT_SET_MAGIC 0x6d69677365767473ULL

struct registration {
    uint64_t token;
    unsigned long long types;
};

struct nvmlEventSet_st {
    uint64_t magic;
    uint64_t cursor;
    struct registration *regs;
    uint32_t count;
};

static int initialized(void) {
    pthread_mutex_lock(&lock);
    int ok = init_count > 0;
    pthread_mutex_unlock(&lock);
    return ok;
}

/* go-nvml's nvml.h wraps the pointer in a struct, as it does device handles. */
static struct nvmlEventSet_st *set_of(nvmlEventSet_t set) {
    return set.handle && set.handle->magic == EVENT_SET_MAGIC ? set.handle : NULL;
}

/* One poll: NVML_SUCCESS with *data filled, NVML_ERROR_TIMEOUT when no event is there, or an
 * error. With data NULL it only moves the cursor to the latest event. */
static int poll_events(struct nvmlEventSet_st *s, nvmlEventData_t *data) {
    sim_call c;
    int rc = sim_start(&c, sim_poll_events);
    if (rc != NVML_SUCCESS) return rc;
    uint64_t cursor = data ? s->cursor : UINT64_MAX; /* ~0: only the latest event number */
    sim_put_bytes(&c, &cursor, 8);
    sim_put_u32(&c, data ? s->count : 0);
    for (uint32_t i = 0; data && i < s->count; i++) {
        sim_put_bytes(&c, &s->regs[i].token, 8);
        sim_put_bytes(&c, &s->regs[i].types, 8);
    }
    rc = sim_send(&c);
    if (!c.failed && rc == NVML_SUCCESS) {
        uint64_t after = 0;
        uint8_t found = 0;
        sim_get_ptr(&c, &after, 8);
        sim_get_ptr(&c, &found, 1);
        if (found) {
            void *device = NULL;
            unsigned long long type = 0, value = 0;
            unsigned int gi = 0, ci = 0;
            sim_get_handle(&c, &device);
            sim_get_ptr(&c, &type, 8);
            sim_get_ptr(&c, &value, 8);
            sim_get_ptr(&c, &gi, 4);
            sim_get_ptr(&c, &ci, 4);
            if (!c.failed && data) {
                data->device.handle = device;
                data->eventType = type;
                data->eventData = value;
                data->gpuInstanceId = gi;
                data->computeInstanceId = ci;
            }
        }
        if (!c.failed) s->cursor = after;
        rc = found ? NVML_SUCCESS : NVML_ERROR_TIMEOUT;
    }
    return sim_finish(&c, rc);
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    int rc = poll_events(s, NULL);
    if (rc != NVML_ERROR_TIMEOUT) {
        free(s);
        return (nvmlReturn_t)(rc == NVML_SUCCESS ? NVML_ERROR_UNKNOWN : rc);
    }
    set->handle = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    struct nvmlEventSet_st *s = set_of(set);
    if (!s) return NVML_ERROR_INVALID_ARGUMENT;
    s->magic = 0;
    free(s->regs);
    free(s);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set) {
    unsigned long long supported = 0;
    nvmlReturn_t rc = nvmlDeviceGetSupportedEventTypes(device, &supported);
    if (rc != NVML_SUCCESS) return rc;
    struct nvmlEventSet_st *s = set_of(set);
    if (!s) return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~supported) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    struct registration *grown = realloc(s->regs, (s->count + 1) * sizeof *grown);
    if (grown) {
        s->regs = grown;
        s->regs[s->count].token = token_of(device.handle);
        s->regs[s->count].types = eventTypes;
        s->count++;
    }
    pthread_mutex_unlock(&lock);
    return grown ? NVML_SUCCESS : NVML_ERROR_MEMORY;
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Sleeps ms milliseconds; signals (the Go runtime preempts with SIGURG) do not cut it short. */
static void sleep_ms(int64_t ms) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += ms / 1000;
    until.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR) {
    }
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!initialized()) return NVML_ERROR_UNINITIALIZED;
    struct nvmlEventSet_st *s = set_of(set);
    if (!s || !data) return NVML_ERROR_INVALID_ARGUMENT;
    int64_t deadline = now_ms() + timeoutms;
    for (;;) {
        int rc = poll_events(s, data);
        if (rc != NVML_ERROR_TIMEOUT) return (nvmlReturn_t)rc;
        int64_t left = deadline - now_ms();
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        sleep_ms(left < sim_event_poll_ms ? left : sim_event_poll_ms);
    }
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
