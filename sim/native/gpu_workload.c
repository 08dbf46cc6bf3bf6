/* The simulated gpu-workload: what a CUDA program looks like to NVML while it runs, a compute
 * process on the devices it uses, for containers of a node whose GPUs are simulated.
 *
 *   gpu-workload [--memory-mib N] [--name NAME] [--seconds S]
 *
 * It initialises NVML and asks the simulated library (migsimHoldDevices, found with dlsym) to
 * show it, by its pid, as a compute process using N MiB (default 1024) named NAME (default: the
 * base name of argv[0]) on every device it sees: each visible MIG device, each visible GPU with
 * MIG off. It prints "holding UUID" per device, then runs until SIGTERM or SIGINT (or S seconds)
 * and exits 0. The simulator drops the process when its connection closes, so a killed workload
 * leaves nothing behind. Exit 1 if NVML fails or no device is visible, 2 on usage errors. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <nvml.h>

#define USAGE_EXIT 2
#define HELD_MAX 65536

typedef nvmlReturn_t (*hold_fn)(const char *, unsigned int, char *, unsigned int);

static volatile sig_atomic_t stopping = 0;

static void stop(int sig) {
    (void)sig;
    stopping = 1;
}

static void usage(FILE *to) {
    fputs("usage: gpu-workload [--memory-mib N] [--name NAME] [--seconds S]\n"
          "  shows this process as a compute process on every visible GPU or MIG device\n"
          "  until SIGTERM or SIGINT (or S seconds)\n",
          to);
}

/* A non-negative integer argument, or -1. */
static long number(const char *text) {
    char *end;
    long v = strtol(text, &end, 10);
    return *text && !*end && v >= 0 ? v : -1;
}

static int bad_argument(const char *arg) {
    fprintf(stderr, "gpu-workload: unsupported argument '%s'\n", arg);
    usage(stderr);
    return USAGE_EXIT;
}

int main(int argc, char **argv) {
    long memory = 1024, seconds = -1;
    const char *name = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        } else if (strcmp(argv[i], "--memory-mib") == 0 && i + 1 < argc) {
            memory = number(argv[++i]);
            if (memory < 0 || memory > (long)UINT_MAX) return bad_argument(argv[i]);
        } else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
            seconds = number(argv[++i]);
            if (seconds < 0) return bad_argument(argv[i]);
        } else if (strcmp(argv[i], "--name") == 0 && i + 1 < argc) {
            name = argv[++i];
        } else {
            return bad_argument(argv[i]);
        }
    }
    /* Signals first: a SIGTERM right after the "holding" lines must not kill it unreleased
     * (the simulator would still drop it, but the exit code would not be 0). */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = stop;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    hold_fn hold = (hold_fn)dlsym(RTLD_DEFAULT, "migsimHoldDevices");
    if (!hold) {
        fprintf(stderr, "gpu-workload: runs on simulated GPUs only (the libnvidia-ml.so.1 "
                        "loaded has no migsimHoldDevices)\n");
        return 1;
    }
    nvmlReturn_t r = nvmlInit_v2();
    if (r != NVML_SUCCESS) {
        fprintf(stderr, "gpu-workload: nvmlInit: %s\n", nvmlErrorString(r));
        return 1;
    }
    static char held[HELD_MAX];
    r = hold(name, (unsigned int)memory, held, sizeof held);
    if (r != NVML_SUCCESS) {
        fprintf(stderr, "gpu-workload: cannot hold the devices: %s\n", nvmlErrorString(r));
        nvmlShutdown();
        return 1;
    }
    if (!held[0]) {
        fprintf(stderr, "gpu-workload: no GPU or MIG device is visible\n");
        nvmlShutdown();
        return 1;
    }
    for (char *line = held, *end; *line; line = end + 1) {
        end = strchr(line, '\n');
        if (!end) break;
        printf("holding %.*s\n", (int)(end - line), line);
    }
    fflush(stdout);

    struct timespec tick = {0, 50 * 1000 * 1000};
    for (long ticks = 0; !stopping && (seconds < 0 || ticks < seconds * 20); ticks++) {
        nanosleep(&tick, NULL);
    }
    nvmlShutdown(); /* closes the connection: the simulator releases the devices */
    return 0;
}
