/*
 * A fake NVML: a shared library named libnvidia-ml.so.1 exporting the NVML symbols agents/gpu.py reaches
 * through pynvml. The tests put its directory on LD_LIBRARY_PATH of a child process, so the real pynvml
 * loads it with its own CDLL("libnvidia-ml.so.1") and the code under test is the code of a GPU host.
 *
 * State: the text file named by FAKE_NVML_STATE, re-read on every call (a test rewrites it to detach a
 * GPU or start a process). No file: nvmlInit fails with NVML_ERROR_DRIVER_NOT_LOADED. Lines:
 *
 *   init_rc N                              nvmlInit's return code (0 = success)
 *   no_v3 | no_v2                          that processes function answers NVML_ERROR_FUNCTION_NOT_FOUND
 *   procs_rc N                             the processes functions' return code (e.g. 3 = NOT_SUPPORTED)
 *   gpu INDEX present|lost TOTAL USED NAME a GPU (lost: every call on it answers NVML_ERROR_GPU_IS_LOST)
 *   mig INDEX SLOT TOTAL USED              a MIG instance of GPU INDEX (the GPU is then in MIG mode)
 *   proc INDEX SLOT PID BYTES|unknown      a compute process on GPU INDEX (SLOT -1) or its MIG instance
 *   ecc INDEX N                            N uncorrected volatile ECC errors (no line: ECC not supported)
 *   pending INDEX 0|1                      retired pages pending (no line: not supported)
 *   xid INDEX N                            a critical XID event N, delivered once to an event set that
 *                                          registered GPU INDEX (a new N is a new event)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OK 0
#define E_UNINITIALIZED 1
#define E_INVALID_ARGUMENT 2
#define E_NOT_SUPPORTED 3
#define E_NOT_FOUND 6
#define E_INSUFFICIENT_SIZE 7
#define E_DRIVER_NOT_LOADED 9
#define E_FUNCTION_NOT_FOUND 13
#define E_TIMEOUT 10
#define E_GPU_IS_LOST 15
#define XID_CRITICAL 0x8ull

#define MAXG 8
#define MAXMIG 7
#define MAXP 64
#define BASE 0x1000u

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;

struct mig { int exists; unsigned long long total, used; };
struct gpu { int declared, lost, mig, ecc_known, pending_known, pending; char name[96]; unsigned long long total, used, ecc, xid; struct mig migs[MAXMIG]; };
struct proc { int gpu, slot, unknown; unsigned int pid; unsigned long long used; };
static struct {
    int loaded, init_rc, no_v3, no_v2, procs_rc, np;
    struct gpu g[MAXG];
    struct proc p[MAXP];
} S;

static int load(void) {
    memset(&S, 0, sizeof S);
    const char *path = getenv("FAKE_NVML_STATE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return 0;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        int i, slot, n;
        unsigned long long a, b;
        unsigned int pid;
        char word[32], name[96];
        if (sscanf(line, "init_rc %d", &n) == 1) S.init_rc = n;
        else if (strncmp(line, "no_v3", 5) == 0) S.no_v3 = 1;
        else if (strncmp(line, "no_v2", 5) == 0) S.no_v2 = 1;
        else if (sscanf(line, "procs_rc %d", &n) == 1) S.procs_rc = n;
        else if (sscanf(line, "gpu %d %31s %llu %llu %95[^\n]", &i, word, &a, &b, name) == 5 && i >= 0 && i < MAXG) {
            S.g[i].declared = 1;
            S.g[i].lost = strcmp(word, "lost") == 0;
            S.g[i].total = a;
            S.g[i].used = b;
            snprintf(S.g[i].name, sizeof S.g[i].name, "%s", name);
        } else if (sscanf(line, "mig %d %d %llu %llu", &i, &slot, &a, &b) == 4 && i >= 0 && i < MAXG && slot >= 0 && slot < MAXMIG) {
            S.g[i].mig = 1;
            S.g[i].migs[slot].exists = 1;
            S.g[i].migs[slot].total = a;
            S.g[i].migs[slot].used = b;
        } else if (sscanf(line, "ecc %d %llu", &i, &a) == 2 && i >= 0 && i < MAXG) {
            S.g[i].ecc_known = 1;
            S.g[i].ecc = a;
        } else if (sscanf(line, "pending %d %d", &i, &n) == 2 && i >= 0 && i < MAXG) {
            S.g[i].pending_known = 1;
            S.g[i].pending = n;
        } else if (sscanf(line, "xid %d %llu", &i, &a) == 2 && i >= 0 && i < MAXG) {
            S.g[i].xid = a;
        } else if (sscanf(line, "proc %d %d %u %31s", &i, &slot, &pid, word) == 4 && S.np < MAXP) {
            struct proc *p = &S.p[S.np++];
            p->gpu = i;
            p->slot = slot;
            p->pid = pid;
            p->unknown = strcmp(word, "unknown") == 0;
            p->used = p->unknown ? 0 : strtoull(word, NULL, 10);
        }
    }
    fclose(f);
    S.loaded = 1;
    return 1;
}

/* A handle is BASE + 0x100 * gpu + (slot + 1): slot -1 is the whole GPU. */
static int decode(void *h, int *gpu, int *slot) {
    uintptr_t v = (uintptr_t)h;
    if (!load()) return E_UNINITIALIZED; /* re-read: a test may have rewritten the state */
    if (v < BASE) return E_INVALID_ARGUMENT;
    v -= BASE;
    *gpu = (int)(v / 0x100);
    *slot = (int)(v % 0x100) - 1;
    if (*gpu >= MAXG || !S.g[*gpu].declared) return E_INVALID_ARGUMENT;
    if (S.g[*gpu].lost) return E_GPU_IS_LOST;
    if (*slot >= 0 && (*slot >= MAXMIG || !S.g[*gpu].migs[*slot].exists)) return E_NOT_FOUND;
    return OK;
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (!load()) return E_DRIVER_NOT_LOADED;
    return S.init_rc;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { return OK; }

const char *nvmlErrorString(int rc) {
    switch (rc) {
    case OK: return "Success";
    case E_UNINITIALIZED: return "Uninitialized";
    case E_INVALID_ARGUMENT: return "Invalid Argument";
    case E_NOT_SUPPORTED: return "Not Supported";
    case E_NOT_FOUND: return "Not Found";
    case E_INSUFFICIENT_SIZE: return "Insufficient Size";
    case E_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case E_FUNCTION_NOT_FOUND: return "Function Not Found";
    case E_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    int gpu, slot;
    load();
    int rc = decode((void *)(uintptr_t)(BASE + 0x100u * index), &gpu, &slot);
    if (index >= MAXG) rc = E_INVALID_ARGUMENT;
    if (rc == OK) *device = (void *)(uintptr_t)(BASE + 0x100u * index);
    return rc;
}

int nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    if (length == 0) return E_INSUFFICIENT_SIZE;
    snprintf(name, length, "%s", S.g[gpu].name);
    return OK;
}

int nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *memory) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    unsigned long long total = slot < 0 ? S.g[gpu].total : S.g[gpu].migs[slot].total;
    unsigned long long used = slot < 0 ? S.g[gpu].used : S.g[gpu].migs[slot].used;
    memory->total = total;
    memory->used = used;
    memory->free = total > used ? total - used : 0;
    return OK;
}

int nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    if (!S.g[gpu].mig) return E_NOT_SUPPORTED; /* a GPU without MIG */
    *current = *pending = 1;
    return OK;
}

int nvmlDeviceGetMaxMigDeviceCount(void *device, unsigned int *count) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    *count = MAXMIG;
    return OK;
}

int nvmlDeviceGetMigDeviceHandleByIndex(void *device, unsigned int index, void **mig) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    if (index >= MAXMIG || !S.g[gpu].migs[index].exists) return E_NOT_FOUND;
    *mig = (void *)(uintptr_t)(BASE + 0x100u * (unsigned)gpu + index + 1);
    return OK;
}

static int processes(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    if (S.procs_rc) return S.procs_rc;
    unsigned int n = 0;
    for (int i = 0; i < S.np; i++)
        if (S.p[i].gpu == gpu && S.p[i].slot == slot) n++;
    if (infos == NULL || *count < n) {
        *count = n;
        return n == 0 ? OK : E_INSUFFICIENT_SIZE;
    }
    unsigned int k = 0;
    for (int i = 0; i < S.np; i++) {
        if (S.p[i].gpu != gpu || S.p[i].slot != slot) continue;
        infos[k].pid = S.p[i].pid;
        infos[k].usedGpuMemory = S.p[i].unknown ? 0xFFFFFFFFFFFFFFFFull : S.p[i].used; /* NVML_VALUE_NOT_AVAILABLE */
        infos[k].gpuInstanceId = slot < 0 ? 0xFFFFFFFFu : (unsigned)slot;
        infos[k].computeInstanceId = slot < 0 ? 0xFFFFFFFFu : 0;
        k++;
    }
    *count = k;
    return OK;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    load();
    if (S.no_v3) return E_FUNCTION_NOT_FOUND;
    return processes(device, count, infos);
}

int nvmlDeviceGetComputeRunningProcesses_v2(void *device, unsigned int *count, nvmlProcessInfo_t *infos) {
    load();
    if (S.no_v2) return E_FUNCTION_NOT_FOUND;
    return processes(device, count, infos);
}

/* ECC and XID: what agents/signals.py reads. */
typedef struct { void *device; unsigned long long eventType, eventData; unsigned int gpuInstanceId, computeInstanceId; } nvmlEventData_t;
static int registered[MAXG];
static unsigned long long delivered[MAXG]; /* the last XID handed out per GPU (outside S: load() clears S) */

int nvmlDeviceGetTotalEccErrors(void *device, int errorType, int counterType, unsigned long long *count) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    if (!S.g[gpu].ecc_known) return E_NOT_SUPPORTED;
    *count = (errorType == 1 && counterType == 0) ? S.g[gpu].ecc : 0;
    return OK;
}

int nvmlDeviceGetRetiredPagesPendingStatus(void *device, int *pending) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    if (rc != OK) return rc;
    if (!S.g[gpu].pending_known) return E_NOT_SUPPORTED;
    *pending = S.g[gpu].pending;
    return OK;
}

int nvmlEventSetCreate(void **set) {
    if (!load()) return E_UNINITIALIZED;
    *set = (void *)(uintptr_t)0x9000u;
    return OK;
}

int nvmlDeviceRegisterEvents(void *device, unsigned long long types, void *set) {
    int gpu, slot, rc = decode(device, &gpu, &slot);
    (void)set;
    if (rc != OK) return rc;
    if (types & XID_CRITICAL) registered[gpu] = 1;
    return OK;
}

int nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned int timeoutms) {
    (void)set;
    (void)timeoutms;
    if (!load()) return E_UNINITIALIZED;
    for (int i = 0; i < MAXG; i++) {
        if (registered[i] && S.g[i].xid && S.g[i].xid != delivered[i]) {
            delivered[i] = S.g[i].xid;
            data->device = (void *)(uintptr_t)(BASE + 0x100u * i);
            data->eventType = XID_CRITICAL;
            data->eventData = S.g[i].xid;
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return OK;
        }
    }
    return E_TIMEOUT;
}
