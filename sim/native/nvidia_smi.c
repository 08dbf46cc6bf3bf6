/* The simulated nvidia-smi: what NVIDIA's tool prints, from NVML calls only, so that it runs
 * wherever a libnvidia-ml.so.1 is (the simulated one on the host, or mounted into a container,
 * where it sees only the devices the container was given).
 *
 *   nvidia-smi                     the summary table (GPUs, MIG devices, processes)
 *   nvidia-smi -L | --list-gpus    one line per GPU and per MIG device, with UUIDs
 *   nvidia-smi -r [-i IDS]         reset GPUs (IDS: indices, UUIDs or PCI bus ids, comma-separated)
 *
 * The table's layout is that of driver 580's nvidia-smi (89 columns inside the frame). A GPU
 * reset is no NVML call: the driver does it. Here it is the simulated library's own
 * migsimDeviceReset (found with dlsym), which asks the GPU simulator to reset the GPU; under
 * another libnvidia-ml.so.1 -r reports that it cannot. Anything else: a usage error, exit 2. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <nvml.h>

#define WIDTH 89               /* inside the frame */
#define NAME_WIDTH 31          /* the GPU name column */
#define NAME_KEPT 24           /* a longer name keeps this much, then "..." */
#define PROCESS_NAME_WIDTH 37
#define NOT_FOUND_EXIT 6       /* nvidia-smi's exit code for "No devices were found" */
#define USAGE_EXIT 2
#define RESET_FAILED_EXIT 255
#define MIB (1024ULL * 1024ULL)
#define NO_INSTANCE 0xFFFFFFFFu

typedef nvmlReturn_t (*reset_fn)(nvmlDevice_t, char *, unsigned int);

static const char *gpu_rule = "+-----------------------------------------+------------------------+----------------------+";
static const char *mig_rule = "+------------------+----------------------------------+-----------+-----------------------+";

/* A frame line: "+---...---+", or "|===...===|" under a header. */
static void rule(char c) {
    char end = c == '=' ? '|' : '+';
    putchar(end);
    for (int i = 0; i < WIDTH; i++) putchar(c);
    putchar(end);
    putchar('\n');
}

/* One framed line: the text left-aligned and padded to the frame. */
static void row(const char *fmt, ...) {
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    printf("|%-*s|\n", WIDTH, text);
}

static void usage(FILE *to) {
    fputs("usage: nvidia-smi                    the summary table\n"
          "       nvidia-smi -L | --list-gpus   GPUs and MIG devices with their UUIDs\n"
          "       nvidia-smi -r | --gpu-reset [-i | --id IDS]\n"
          "                                     reset GPUs (indices, UUIDs or PCI bus ids)\n"
          "This simulated nvidia-smi does nothing else.\n",
          to);
}

static int init(void) {
    nvmlReturn_t rc = nvmlInit();
    if (rc == NVML_SUCCESS) return 0;
    printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
           "Make sure that the latest NVIDIA driver is installed and running.\n");
    fprintf(stderr, "nvmlInit: %s\n", nvmlErrorString(rc));
    return 1;
}

/* The visible GPUs' handles (NVML's indices are positions among them); count 0 on error. */
static unsigned int gpus(nvmlDevice_t **out) {
    unsigned int n = 0;
    *out = NULL;
    if (nvmlDeviceGetCount(&n) != NVML_SUCCESS || n == 0) return 0;
    *out = calloc(n, sizeof **out);
    if (!*out) return 0;
    for (unsigned int i = 0; i < n; i++)
        if (nvmlDeviceGetHandleByIndex(i, &(*out)[i]) != NVML_SUCCESS) return 0;
    return n;
}

static int mig_enabled(nvmlDevice_t d) {
    unsigned int current = 0, pending = 0;
    return nvmlDeviceGetMigMode(d, &current, &pending) == NVML_SUCCESS && current;
}

/* Calls f(gpu index, MIG index, MIG handle) for each MIG device NVML enumerates under d (a MIG
 * index without a device, NOT_FOUND, is skipped, as NVIDIA's tools do); how many there were. */
typedef void (*mig_visit)(unsigned int, unsigned int, nvmlDevice_t);
static unsigned int each_mig_device(unsigned int gpu, nvmlDevice_t d, mig_visit f) {
    unsigned int max = 0, seen = 0;
    if (!mig_enabled(d) || nvmlDeviceGetMaxMigDeviceCount(d, &max) != NVML_SUCCESS) return 0;
    for (unsigned int j = 0; j < max; j++) {
        nvmlDevice_t mig;
        if (nvmlDeviceGetMigDeviceHandleByIndex(d, j, &mig) != NVML_SUCCESS) continue;
        f(gpu, j, mig);
        seen++;
    }
    return seen;
}

/* -- -L ------------------------------------------------------------------------------------------ */

static void list_mig(unsigned int gpu, unsigned int index, nvmlDevice_t mig) {
    (void)gpu;
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = "", uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
    nvmlDeviceGetName(mig, name, sizeof name);
    nvmlDeviceGetUUID(mig, uuid, sizeof uuid);
    const char *profile = strstr(name, "MIG ");
    profile = profile ? profile + 4 : name; /* "NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> "1g.10gb" */
    printf("  MIG %-11s Device %2u: (UUID: %s)\n", profile, index, uuid);
}

static int list_gpus(void) {
    nvmlDevice_t *devices;
    unsigned int n = gpus(&devices);
    if (n == 0) {
        printf("No devices found.\n");
        free(devices);
        return NOT_FOUND_EXIT;
    }
    for (unsigned int i = 0; i < n; i++) {
        char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = "", uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = "";
        nvmlDeviceGetName(devices[i], name, sizeof name);
        nvmlDeviceGetUUID(devices[i], uuid, sizeof uuid);
        printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
        each_mig_device(i, devices[i], list_mig);
    }
    free(devices);
    return 0;
}

/* -- the table ----------------------------------------------------------------------------------- */

static const char *on_off(nvmlReturn_t rc, unsigned int state) {
    return rc != NVML_SUCCESS ? "N/A" : state ? "On" : "Off";
}

static void gpu_rows(unsigned int i, nvmlDevice_t d) {
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE] = "N/A";
    nvmlDeviceGetName(d, name, sizeof name);
    if (strlen(name) > NAME_KEPT + 3) strcpy(name + NAME_KEPT, "...");

    nvmlEnableState_t persistence = 0, display = 0, ecc = 0, ecc_pending = 0;
    nvmlReturn_t persistence_rc = nvmlDeviceGetPersistenceMode(d, &persistence);
    nvmlReturn_t display_rc = nvmlDeviceGetDisplayActive(d, &display);
    nvmlReturn_t ecc_rc = nvmlDeviceGetEccMode(d, &ecc, &ecc_pending);

    nvmlPciInfo_t pci;
    memset(&pci, 0, sizeof pci);
    if (nvmlDeviceGetPciInfo(d, &pci) != NVML_SUCCESS) strcpy(pci.busId, "N/A");

    /* Volatile uncorrected ECC errors; with MIG on (no count for the GPU) the ECC mode. */
    char ecc_text[24] = "N/A";
    unsigned long long errors = 0;
    if (ecc_rc == NVML_SUCCESS && !ecc) {
        strcpy(ecc_text, "Off");
    } else if (nvmlDeviceGetTotalEccErrors(d, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC,
                                           &errors) == NVML_SUCCESS) {
        snprintf(ecc_text, sizeof ecc_text, "%llu", errors);
    } else if (ecc_rc == NVML_SUCCESS) {
        strcpy(ecc_text, "On");
    }
    printf("|%4u  %-*s%-4s|   %-16s %-3s |%21s |\n", i, NAME_WIDTH, name,
           on_off(persistence_rc, persistence), pci.busId, on_off(display_rc, display), ecc_text);

    char fan[8] = "N/A", temp[12] = "N/A", perf[8] = "N/A", usage[16] = "N/A", cap[16] = "N/A";
    unsigned int value = 0;
    if (nvmlDeviceGetFanSpeed(d, &value) == NVML_SUCCESS) snprintf(fan, sizeof fan, "%u%%", value);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations" /* GetTemperatureV: not simulated */
    if (nvmlDeviceGetTemperature(d, NVML_TEMPERATURE_GPU, &value) == NVML_SUCCESS)
        snprintf(temp, sizeof temp, "%uC", value);
#pragma GCC diagnostic pop
    nvmlPstates_t pstate;
    if (nvmlDeviceGetPerformanceState(d, &pstate) == NVML_SUCCESS && pstate != NVML_PSTATE_UNKNOWN)
        snprintf(perf, sizeof perf, "P%d", (int)pstate);
    if (nvmlDeviceGetPowerUsage(d, &value) == NVML_SUCCESS)
        snprintf(usage, sizeof usage, "%uW", (value + 500) / 1000);
    if (nvmlDeviceGetEnforcedPowerLimit(d, &value) == NVML_SUCCESS)
        snprintf(cap, sizeof cap, "%uW", (value + 500) / 1000);

    nvmlMemory_t memory;
    memset(&memory, 0, sizeof memory);
    nvmlDeviceGetMemoryInfo(d, &memory);

    char util[12] = "N/A", mode[16] = "N/A";
    nvmlUtilization_t rates;
    if (nvmlDeviceGetUtilizationRates(d, &rates) == NVML_SUCCESS)
        snprintf(util, sizeof util, "%u%%", rates.gpu);
    nvmlComputeMode_t compute;
    if (nvmlDeviceGetComputeMode(d, &compute) == NVML_SUCCESS) {
        const char *names[] = {"Default", "E. Thread", "Prohibited", "E. Process"};
        if ((unsigned int)compute < sizeof names / sizeof *names) strcpy(mode, names[compute]);
    }
    printf("| %3s%6s%6s%16s / %5s |%8lluMiB / %6lluMiB |%8s%13s |\n", fan, temp, perf, usage, cap,
           memory.used / MIB, memory.total / MIB, util, mode);

    char mig[16] = "N/A";
    unsigned int current = 0, pending = 0;
    if (nvmlDeviceGetMigMode(d, &current, &pending) == NVML_SUCCESS)
        snprintf(mig, sizeof mig, "%s%s", current ? "Enabled" : "Disabled",
                 current != pending ? "*" : ""); /* a pending change, as nvidia-smi marks it */
    printf("|%41s|%24s|%21s |\n", "", "", mig);
    puts(gpu_rule);
}

static void mig_rows(unsigned int gpu, unsigned int index, nvmlDevice_t mig) {
    unsigned int gi = 0, ci = 0;
    nvmlDeviceGetGpuInstanceId(mig, &gi);
    nvmlDeviceGetComputeInstanceId(mig, &ci);
    nvmlMemory_t memory;
    memset(&memory, 0, sizeof memory);
    nvmlDeviceGetMemoryInfo(mig, &memory);
    nvmlDeviceAttributes_t a;
    memset(&a, 0, sizeof a);
    nvmlDeviceGetAttributes(mig, &a);
    char ecc[24] = "N/A";
    unsigned long long errors = 0;
    if (nvmlDeviceGetTotalEccErrors(mig, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC,
                                    &errors) == NVML_SUCCESS)
        snprintf(ecc, sizeof ecc, "%llu", errors);
    printf("|%3u%5u%4u%4u  |%16lluMiB / %5lluMiB    |%3u%7s |%3u%4u%5u%5u%5u |\n", gpu, gi, ci,
           index, memory.used / MIB, memory.total / MIB, a.multiprocessorCount, ecc,
           a.sharedCopyEngineCount, a.sharedEncoderCount, a.sharedDecoderCount,
           a.sharedOfaCount, a.sharedJpegCount);
    char bar1[64] = "";
    nvmlBAR1Memory_t b;
    if (nvmlDeviceGetBAR1MemoryInfo(mig, &b) == NVML_SUCCESS)
        snprintf(bar1, sizeof bar1, "%16lluMiB / %5lluMiB    ", b.bar1Used / MIB, b.bar1Total / MIB);
    else
        snprintf(bar1, sizeof bar1, "%19s%15s", "N/A", ""); /* not simulated: no readout */
    printf("|%18s|%-34s|%11s|%23s|\n", "", bar1, "", "");
    puts(mig_rule);
}

static void mig_section(nvmlDevice_t *devices, unsigned int n) {
    rule('-');
    row(" MIG devices:");
    puts(mig_rule);
    puts("| GPU  GI  CI  MIG |              Shared Memory-Usage |        Vol|        Shared         |");
    puts("|      ID  ID  Dev |                Shared BAR1-Usage | SM     Unc| CE ENC  DEC  OFA  JPG |");
    puts("|                  |                                  |        ECC|                       |");
    puts("|==================+==================================+===========+=======================|");
    unsigned int found = 0;
    for (unsigned int i = 0; i < n; i++) found += each_mig_device(i, devices[i], mig_rows);
    if (!found) {
        row("  No MIG devices found");
        rule('-');
    }
}

/* The GPU's compute processes (NVML's two-call protocol); *count 0 when there are none. */
static nvmlProcessInfo_t *processes(nvmlDevice_t d, unsigned int *count) {
    *count = 0;
    nvmlReturn_t rc = nvmlDeviceGetComputeRunningProcesses(d, count, NULL);
    if (rc == NVML_SUCCESS || rc != NVML_ERROR_INSUFFICIENT_SIZE) {
        *count = 0;
        return NULL;
    }
    unsigned int capacity = *count + 8; /* room for processes started in between */
    nvmlProcessInfo_t *infos = calloc(capacity, sizeof *infos);
    *count = capacity;
    if (!infos || nvmlDeviceGetComputeRunningProcesses(d, count, infos) != NVML_SUCCESS) {
        free(infos);
        *count = 0;
        return NULL;
    }
    return infos;
}

static void id_text(char *out, size_t size, unsigned int id) {
    if (id == NO_INSTANCE)
        snprintf(out, size, "N/A");
    else
        snprintf(out, size, "%u", id);
}

static void process_section(nvmlDevice_t *devices, unsigned int n) {
    rule('-');
    row(" Processes:");
    puts("|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |");
    puts("|        ID   ID                                                               Usage      |");
    rule('=');
    unsigned int listed = 0;
    for (unsigned int i = 0; i < n; i++) {
        unsigned int count;
        nvmlProcessInfo_t *infos = processes(devices[i], &count);
        for (unsigned int k = 0; k < count; k++) {
            nvmlProcessInfo_t *p = &infos[k];
            char gi[12], ci[12], memory[24] = "N/A", name[256] = "N/A";
            id_text(gi, sizeof gi, p->gpuInstanceId);
            id_text(ci, sizeof ci, p->computeInstanceId);
            if (p->usedGpuMemory != (unsigned long long)NVML_VALUE_NOT_AVAILABLE)
                snprintf(memory, sizeof memory, "%lluMiB", p->usedGpuMemory / MIB);
            if (nvmlSystemGetProcessName(p->pid, name, sizeof name) != NVML_SUCCESS)
                strcpy(name, "N/A");
            const char *shown = name;
            char cut[PROCESS_NAME_WIDTH + 1];
            if (strlen(name) > PROCESS_NAME_WIDTH) { /* keep the end: the program's own name */
                snprintf(cut, sizeof cut, "...%s", name + strlen(name) - (PROCESS_NAME_WIDTH - 3));
                shown = cut;
            }
            printf("|%5u%6s%5s%16u%7s   %-*s%9s |\n", i, gi, ci, p->pid, "C", PROCESS_NAME_WIDTH,
                   shown, memory);
            listed++;
        }
        free(infos);
    }
    if (!listed) row("  No running processes found");
    rule('-');
}

static int table(void) {
    nvmlDevice_t *devices;
    unsigned int n = gpus(&devices);
    if (n == 0) {
        printf("No devices were found\n");
        free(devices);
        return NOT_FOUND_EXIT;
    }
    char driver[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE] = "N/A", cuda[16] = "N/A";
    nvmlSystemGetDriverVersion(driver, sizeof driver);
    int version = 0;
    if (nvmlSystemGetCudaDriverVersion_v2(&version) == NVML_SUCCESS)
        snprintf(cuda, sizeof cuda, "%d.%d", version / 1000, version % 1000 / 10);

    char when[64];
    time_t now = time(NULL);
    strftime(when, sizeof when, "%a %b %e %H:%M:%S %Y", localtime(&now));
    printf("%s       \n", when);
    rule('-');
    printf("| NVIDIA-SMI %-23sDriver Version: %-15sCUDA Version: %-9s|\n", driver, driver, cuda);
    puts(gpu_rule);
    puts("| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |");
    puts("| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |");
    puts("|                                         |                        |               MIG M. |");
    puts("|=========================================+========================+======================|");
    int any_mig = 0;
    for (unsigned int i = 0; i < n; i++) {
        gpu_rows(i, devices[i]);
        any_mig |= mig_enabled(devices[i]);
    }
    putchar('\n');
    if (any_mig) {
        mig_section(devices, n);
        putchar('\n');
    }
    process_section(devices, n);
    free(devices);
    return 0;
}

/* -- -r ------------------------------------------------------------------------------------------ */

static int is_index(const char *s) {
    if (!*s) return 0;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return 0;
    return 1;
}

static nvmlReturn_t device_by_id(const char *id, nvmlDevice_t *out) {
    if (is_index(id)) return nvmlDeviceGetHandleByIndex((unsigned int)strtoul(id, NULL, 10), out);
    if (strncmp(id, "GPU-", 4) == 0) return nvmlDeviceGetHandleByUUID(id, out);
    return nvmlDeviceGetHandleByPciBusId(id, out);
}

static int reset(const char *ids) {
    reset_fn reset_device = (reset_fn)dlsym(RTLD_DEFAULT, "migsimDeviceReset");
    if (!reset_device) {
        fprintf(stderr, "GPU reset is not available: this nvidia-smi resets simulated GPUs only "
                        "(the libnvidia-ml.so.1 loaded has no migsimDeviceReset)\n");
        return RESET_FAILED_EXIT;
    }
    nvmlDevice_t *targets;
    unsigned int n = 0;
    if (ids) {
        char *copy = strdup(ids), *save = NULL;
        targets = calloc(strlen(ids) + 1, sizeof *targets);
        if (!copy || !targets) return RESET_FAILED_EXIT;
        for (char *id = strtok_r(copy, ",", &save); id; id = strtok_r(NULL, ",", &save)) {
            if (device_by_id(id, &targets[n]) != NVML_SUCCESS) {
                fprintf(stderr, "No devices were found matching %s\n", id);
                return NOT_FOUND_EXIT;
            }
            n++;
        }
        free(copy);
    } else {
        n = gpus(&targets);
        if (n == 0) {
            fprintf(stderr, "No devices were found\n");
            return NOT_FOUND_EXIT;
        }
    }
    int rc = 0;
    for (unsigned int i = 0; i < n; i++) {
        nvmlPciInfo_t pci;
        memset(&pci, 0, sizeof pci);
        nvmlDeviceGetPciInfo(targets[i], &pci);
        char why[512];
        nvmlReturn_t r = reset_device(targets[i], why, sizeof why);
        if (r == NVML_SUCCESS) {
            printf("GPU %s was successfully reset.\n", pci.busId);
        } else {
            fprintf(stderr, "Unable to reset GPU %s: %s\n", pci.busId,
                    *why ? why : nvmlErrorString(r));
            rc = RESET_FAILED_EXIT;
        }
    }
    free(targets);
    return rc;
}

/* -- arguments ----------------------------------------------------------------------------------- */

static int is(const char *arg, const char *short_name, const char *long_name) {
    return strcmp(arg, short_name) == 0 || strcmp(arg, long_name) == 0;
}

int main(int argc, char **argv) {
    enum { TABLE, LIST, RESET } what = TABLE;
    const char *ids = NULL;
    for (int i = 1; i < argc; i++) {
        if (is(argv[i], "-h", "--help")) {
            usage(stdout);
            return 0;
        } else if (is(argv[i], "-L", "--list-gpus") && what == TABLE && !ids) {
            what = LIST;
        } else if (is(argv[i], "-r", "--gpu-reset") && what == TABLE) {
            what = RESET;
        } else if (is(argv[i], "-i", "--id") && i + 1 < argc && !ids) {
            ids = argv[++i];
        } else if (strncmp(argv[i], "--id=", 5) == 0 && !ids) {
            ids = argv[i] + 5;
        } else {
            fprintf(stderr, "nvidia-smi (simulated): unsupported argument '%s'\n", argv[i]);
            usage(stderr);
            return USAGE_EXIT;
        }
    }
    if (ids && what != RESET) {
        fprintf(stderr, "nvidia-smi (simulated): -i selects GPUs for -r only\n");
        usage(stderr);
        return USAGE_EXIT;
    }
    if (init()) return 9; /* NVML_ERROR_DRIVER_NOT_LOADED, as nvidia-smi exits without a driver */
    int rc = what == LIST ? list_gpus() : what == RESET ? reset(ids) : table();
    nvmlShutdown();
    return rc;
}
