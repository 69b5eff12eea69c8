/*
 * A test double of libnvidia-ml.so.1 for machines without a GPU: the real pynvml loads it
 * and calls it through ctypes exactly as it would call NVIDIA's library.
 *
 * The GPUs it reports come from a JSON fixture named by FAKE_NVML_CONFIG, read at
 * nvmlInitWithFlags: one flat object whose keys are the dotted names below and whose values are
 * strings, numbers or booleans (true: 1, false: 0; null: as if the key were absent), e.g.
 *
 *   {"gpus": 2, "driver": "550.54.15", "gpu0.name": "NVIDIA H100 80GB HBM3", "gpu0.procs": "1234:1073741824"}
 *
 * The keys (written key=value here for brevity):
 *
 *   gpus=2                     driver=550.54.15          cuda=12040
 *   init_error=9               (nvmlInit fails with this NVML error code)
 *   gpu0.name=NVIDIA H100 80GB HBM3   gpu0.uuid=GPU-...   gpu0.bus=00000000:18:00.0
 *   gpu0.temp=45  gpu0.slowdown_temp=87  gpu0.shutdown_temp=92   (either may be "unsupported")
 *   gpu0.clock_events=0x8      (nvmlClocksEventReason bits; a string for hex, or a number)
 *   gpu0.ecc_sbe=0  gpu0.ecc_dbe=0  gpu0.remap_corr=0  gpu0.remap_unc=0  gpu0.remap_pending=0  gpu0.remap_failure=0
 *   gpu0.power_limit=700000    gpu0.power_default=700000   (milliwatts)
 *   gpu0.pcie_gen=5  gpu0.pcie_gen_max=5  gpu0.pcie_gen_gpu_max=5  gpu0.pcie_width=16  gpu0.pcie_width_max=16
 *                              (gen_max: what the link can do in this slot; gen_gpu_max: what the GPU can)
 *   gpu0.retired_sbe=0  gpu0.retired_dbe=0  gpu0.retired_pending=0   (page retirement, pre-Ampere)
 *   gpu0.xid_event=79,13       (Xid critical-error events delivered to an event set registered for it)
 *   gpu0.persistence=1  gpu0.mig=0
 *   gpu0.procs=1234:1073741824,5678:2048   (pid:used bytes; 18446744073709551615 is
 *                              NVML_VALUE_NOT_AVAILABLE, which pynvml turns into None)
 *   gpu0.nvlinks=18  gpu0.nvlink_down=3,7   (links 0..17, two of them down; 0 links: not supported)
 *   gpu0.nvlink5.replay=9  gpu0.nvlink5.recovery=0  gpu0.nvlink5.crc_flit=400   (error counters)
 *   gpu0.hang_ms=5000          (every call about this GPU sleeps that long: a wedged driver)
 *   gpu0.error.<function>=3    (that function fails with this NVML error code; <function> is the C
 *                              entry point, e.g. nvmlDeviceGetHandleByIndex_v2=15: the GPU is lost)
 *
 * A fixture that is not such an object (bad JSON, a nested value, a duplicate key) or cannot be read
 * makes nvmlInit fail with NVML_ERROR_UNKNOWN after a line on stderr naming the file and byte offset.
 *
 * Only the entry points MegaTrace's probes use are implemented; the rest of the API is absent.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;

enum { OK = 0, ERR_UNINIT = 1, ERR_INVALID = 2, ERR_NOT_SUPPORTED = 3, ERR_INSUFFICIENT = 7, ERR_UNKNOWN = 999 };
enum { MAX_GPUS = 16, MAX_KEYS = 512 };

struct fake_device { int index; };

static char keys[MAX_KEYS][96];
static char values[MAX_KEYS][256];
static int n_keys;
static int initialized;
static struct fake_device devices[MAX_GPUS];

static const char *get(const char *key) {
    for (int i = 0; i < n_keys; i++)
        if (strcmp(keys[i], key) == 0) return values[i];
    return NULL;
}

static const char *gpu_get(int gpu, const char *field) {
    char key[96];
    snprintf(key, sizeof key, "gpu%d.%s", gpu, field);
    return get(key);
}

static unsigned long long gpu_num(int gpu, const char *field, unsigned long long dflt) {
    const char *v = gpu_get(gpu, field);
    return v ? strtoull(v, NULL, 0) : dflt;
}

static int n_gpus(void) {
    const char *v = get("gpus");
    int n = v ? atoi(v) : 0;
    return n < 0 ? 0 : n > MAX_GPUS ? MAX_GPUS : n;
}

/* Common entry checks for a device call: initialised, a valid handle, the wedge and the injected error. */
static nvmlReturn_t enter(nvmlDevice_t dev, const char *function) {
    if (!initialized) return ERR_UNINIT;
    if (!dev || dev < devices || dev >= devices + n_gpus()) return ERR_INVALID;
    unsigned long long hang = gpu_num(dev->index, "hang_ms", 0);
    if (hang) {
        struct timespec ts = {(time_t)(hang / 1000), (long)(hang % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    char field[128];
    snprintf(field, sizeof field, "error.%s", function);
    return (nvmlReturn_t)gpu_num(dev->index, field, OK);
}

/* A strict parser of the fixture: one flat JSON object (RFC 8259 syntax) of strings, numbers, booleans and
 * nulls. Values are kept as text: a number as written, true as "1", false as "0"; a null is left out. */
struct parser { const char *path, *s; size_t n, i; };

static int syntax_error(struct parser *p, size_t at, const char *what) {
    fprintf(stderr, "fake_nvml: %s: JSON error at byte offset %zu: %s\n", p->path, at, what);
    return -1;
}

static void skip_ws(struct parser *p) {
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r'))
        p->i++;
}

static int hex4(struct parser *p, unsigned *out) {
    *out = 0;
    for (int k = 0; k < 4; k++, p->i++) {
        char c = p->i < p->n ? p->s[p->i] : 0;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return syntax_error(p, p->i, "expected 4 hex digits after \\u");
        *out = *out * 16 + (unsigned)d;
    }
    return 0;
}

/* Append the UTF-8 encoding of code point ``cp`` to out[*len]; -1 when it does not fit. */
static int put_utf8(char *out, size_t size, size_t *len, unsigned cp) {
    unsigned char b[4];
    size_t k = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    if (k == 1) b[0] = (unsigned char)cp;
    else if (k == 2) { b[0] = (unsigned char)(0xC0 | cp >> 6); b[1] = (unsigned char)(0x80 | (cp & 0x3F)); }
    else if (k == 3) { b[0] = (unsigned char)(0xE0 | cp >> 12); b[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
                       b[2] = (unsigned char)(0x80 | (cp & 0x3F)); }
    else { b[0] = (unsigned char)(0xF0 | cp >> 18); b[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
           b[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F)); b[3] = (unsigned char)(0x80 | (cp & 0x3F)); }
    if (*len + k >= size) return -1;
    memcpy(out + *len, b, k);
    *len += k;
    out[*len] = 0;
    return 0;
}

/* A string (p->i at its opening quote) into out (NUL-terminated, at most size - 1 bytes). */
static int parse_string(struct parser *p, char *out, size_t size) {
    size_t start = p->i++, len = 0;
    out[0] = 0;
    for (;;) {
        if (p->i >= p->n) return syntax_error(p, start, "unterminated string");
        unsigned char c = (unsigned char)p->s[p->i];
        unsigned cp = c;
        if (c == '"') { p->i++; return 0; }
        if (c < 0x20) return syntax_error(p, p->i, "control character in a string (escape it)");
        if (c == '\\') {
            char e = p->i + 1 < p->n ? p->s[p->i + 1] : 0;
            p->i += 2;
            switch (e) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u': {
                size_t at = p->i - 2;
                if (hex4(p, &cp)) return -1;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return syntax_error(p, at, "lone low surrogate in \\u escape");
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    unsigned lo;
                    if (p->i + 1 >= p->n || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u')
                        return syntax_error(p, at, "high surrogate without a low one in \\u escape");
                    p->i += 2;
                    if (hex4(p, &lo)) return -1;
                    if (lo < 0xDC00 || lo > 0xDFFF) return syntax_error(p, at, "bad surrogate pair in \\u escape");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                if (cp == 0) return syntax_error(p, at, "\\u0000 is not allowed");
                break;
            }
            default:
                return syntax_error(p, p->i - 2, "unknown escape (one of \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
            }
            if (put_utf8(out, size, &len, cp)) return syntax_error(p, start, "string too long");
            continue;
        }
        if (len + 1 >= size) return syntax_error(p, start, "string too long");
        out[len++] = (char)c;  /* (other bytes, UTF-8 included, as they are) */
        out[len] = 0;
        p->i++;
    }
}

static int is_digit(struct parser *p) { return p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9'; }

/* A number as JSON writes it: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, kept as its text. */
static int parse_number(struct parser *p, char *out, size_t size) {
    size_t start = p->i;
    if (p->s[p->i] == '-') p->i++;
    if (!is_digit(p)) return syntax_error(p, p->i, "expected a digit");
    if (p->s[p->i] == '0') p->i++;
    else while (is_digit(p)) p->i++;
    if (p->i < p->n && p->s[p->i] == '.') {
        p->i++;
        if (!is_digit(p)) return syntax_error(p, p->i, "expected a digit after the decimal point");
        while (is_digit(p)) p->i++;
    }
    if (p->i < p->n && (p->s[p->i] == 'e' || p->s[p->i] == 'E')) {
        p->i++;
        if (p->i < p->n && (p->s[p->i] == '+' || p->s[p->i] == '-')) p->i++;
        if (!is_digit(p)) return syntax_error(p, p->i, "expected a digit in the exponent");
        while (is_digit(p)) p->i++;
    }
    if (p->i - start >= size) return syntax_error(p, start, "number too long");
    memcpy(out, p->s + start, p->i - start);
    out[p->i - start] = 0;
    return 0;
}

static int literal(struct parser *p, const char *word) {
    size_t k = strlen(word);
    if (p->n - p->i < k || memcmp(p->s + p->i, word, k) != 0) return 0;
    p->i += k;
    return 1;
}

/* A value into out: 0, 1 for null (nothing stored), -1 on an error. */
static int parse_value(struct parser *p, char *out, size_t size) {
    skip_ws(p);
    char c = p->i < p->n ? p->s[p->i] : 0;
    if (c == '"') return parse_string(p, out, size);
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p, out, size);
    if (literal(p, "true")) { snprintf(out, size, "1"); return 0; }
    if (literal(p, "false")) { snprintf(out, size, "0"); return 0; }
    if (literal(p, "null")) return 1;
    if (c == '{' || c == '[')
        return syntax_error(p, p->i, "nested objects and arrays are not supported (a flat object of strings, "
                                     "numbers, booleans)");
    return syntax_error(p, p->i, p->i < p->n ? "expected a value" : "unexpected end of file");
}

static int parse_object(struct parser *p) {
    skip_ws(p);
    if (p->i >= p->n || p->s[p->i] != '{') return syntax_error(p, p->i, "expected '{' (a JSON object)");
    p->i++;
    skip_ws(p);
    if (p->i < p->n && p->s[p->i] == '}') p->i++;
    else for (;;) {
        char key[sizeof keys[0]], value[sizeof values[0]];
        skip_ws(p);
        size_t at = p->i;
        if (p->i >= p->n || p->s[p->i] != '"') return syntax_error(p, p->i, "expected a key (a string)");
        if (parse_string(p, key, sizeof key)) return -1;
        skip_ws(p);
        if (p->i >= p->n || p->s[p->i] != ':') return syntax_error(p, p->i, "expected ':' after the key");
        p->i++;
        int r = parse_value(p, value, sizeof value);
        if (r < 0) return -1;
        for (int k = 0; k < n_keys; k++)
            if (strcmp(keys[k], key) == 0) return syntax_error(p, at, "duplicate key");
        if (r == 0) {
            if (n_keys == MAX_KEYS) return syntax_error(p, at, "too many keys");
            memcpy(keys[n_keys], key, sizeof key);
            memcpy(values[n_keys], value, sizeof value);
            n_keys++;
        }
        skip_ws(p);
        if (p->i < p->n && p->s[p->i] == ',') { p->i++; continue; }
        if (p->i < p->n && p->s[p->i] == '}') { p->i++; break; }
        return syntax_error(p, p->i, "expected ',' or '}'");
    }
    skip_ws(p);
    if (p->i != p->n) return syntax_error(p, p->i, "unexpected data after the object");
    return 0;
}

/* Read the fixture named by FAKE_NVML_CONFIG (none: no keys, so no GPUs); -1 when it is unusable. */
static int load_config(void) {
    static char text[1 << 20];
    n_keys = 0;
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (!path) return 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fake_nvml: %s: cannot read the fixture\n", path);
        return -1;
    }
    size_t n = fread(text, 1, sizeof text, f);
    int too_big = n == sizeof text && fgetc(f) != EOF;
    fclose(f);
    if (too_big) {
        fprintf(stderr, "fake_nvml: %s: the fixture is larger than %zu bytes\n", path, sizeof text);
        return -1;
    }
    struct parser p = {path, text, n, 0};
    if (parse_object(&p)) {
        n_keys = 0;
        return -1;
    }
    return 0;
}

static nvmlReturn_t copy_string(const char *src, char *dst, unsigned int size) {
    if (!dst) return ERR_INVALID;
    if (strlen(src) + 1 > size) return ERR_INSUFFICIENT;
    memcpy(dst, src, strlen(src) + 1);
    return OK;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (load_config()) return ERR_UNKNOWN;
    const char *err = get("init_error");
    if (err && atoi(err)) return atoi(err);
    for (int i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    initialized = 1;
    return OK;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    if (!initialized) return ERR_UNINIT;
    initialized = 0;
    return OK;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case OK: return "Success";
    case ERR_UNINIT: return "Uninitialized";
    case ERR_INVALID: return "Invalid Argument";
    case ERR_NOT_SUPPORTED: return "Not Supported";
    case ERR_INSUFFICIENT: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 15: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialized) return ERR_UNINIT;
    const char *v = get("driver");
    return copy_string(v ? v : "550.54.15", version, length);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    if (!initialized) return ERR_UNINIT;
    const char *v = get("cuda");
    *version = v ? atoi(v) : 12040;
    return OK;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) { return nvmlSystemGetCudaDriverVersion(version); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialized) return ERR_UNINIT;
    *count = (unsigned int)n_gpus();
    return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized) return ERR_UNINIT;
    if ((int)index >= n_gpus()) return ERR_INVALID;
    nvmlReturn_t r = (nvmlReturn_t)gpu_num((int)index, "error.nvmlDeviceGetHandleByIndex_v2", OK);
    if (r) return r;
    *device = &devices[index];
    return OK;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t dev, char *name, unsigned int length) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetName");
    if (r) return r;
    const char *v = gpu_get(dev->index, "name");
    return copy_string(v ? v : "NVIDIA H100 80GB HBM3", name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t dev, char *uuid, unsigned int length) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetUUID");
    if (r) return r;
    const char *v = gpu_get(dev->index, "uuid");
    char dflt[64];
    snprintf(dflt, sizeof dflt, "GPU-00000000-0000-0000-0000-%012d", dev->index);
    return copy_string(v ? v : dflt, uuid, length);
}

/* nvmlPciInfo_t as pynvml declares it: busIdLegacy[16], domain, bus, device, pciDeviceId, pciSubSystemId, busId[32]. */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetPciInfo_v3");
    if (r) return r;
    memset(pci, 0, sizeof *pci);
    const char *v = gpu_get(dev->index, "bus");
    char dflt[32];
    snprintf(dflt, sizeof dflt, "00000000:%02X:00.0", 0x18 + dev->index);
    snprintf(pci->busId, sizeof pci->busId, "%s", v ? v : dflt);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%.15s", v ? v : dflt);
    pci->bus = (unsigned int)(0x18 + dev->index);
    pci->pciDeviceId = 0x233010DE;
    return OK;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, int sensor, unsigned int *temp) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetTemperature");
    if (r) return r;
    if (sensor != 0) return ERR_NOT_SUPPORTED;
    *temp = (unsigned int)gpu_num(dev->index, "temp", 40);
    return OK;
}

nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t dev, int threshold, unsigned int *temp) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetTemperatureThreshold");
    if (r) return r;
    const char *given = gpu_get(dev->index, threshold == 0 ? "shutdown_temp" : "slowdown_temp");
    if (given && strcmp(given, "unsupported") == 0) return ERR_NOT_SUPPORTED;
    if (threshold == 0) *temp = (unsigned int)gpu_num(dev->index, "shutdown_temp", 92);
    else if (threshold == 1) *temp = (unsigned int)gpu_num(dev->index, "slowdown_temp", 87);
    else return ERR_NOT_SUPPORTED;
    return OK;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t dev, unsigned long long *reasons) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetCurrentClocksEventReasons");
    if (r) return r;
    *reasons = gpu_num(dev->index, "clock_events", 0);
    return OK;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t dev, unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(dev, reasons);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, int error_type, int counter_type,
                                         unsigned long long *count) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetTotalEccErrors");
    if (r) return r;
    (void)counter_type;
    *count = gpu_num(dev->index, error_type == 1 ? "ecc_dbe" : "ecc_sbe", 0);
    return OK;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetRemappedRows");
    if (r) return r;
    *corr = (unsigned int)gpu_num(dev->index, "remap_corr", 0);
    *unc = (unsigned int)gpu_num(dev->index, "remap_unc", 0);
    *pending = (unsigned int)gpu_num(dev->index, "remap_pending", 0);
    *failure = (unsigned int)gpu_num(dev->index, "remap_failure", 0);
    return OK;
}

#define UINT_GETTER(fn, field, dflt)                           \
    nvmlReturn_t fn(nvmlDevice_t dev, unsigned int *out) {     \
        nvmlReturn_t r = enter(dev, #fn);                      \
        if (r) return r;                                       \
        *out = (unsigned int)gpu_num(dev->index, field, dflt); \
        return OK;                                             \
    }

UINT_GETTER(nvmlDeviceGetPowerManagementLimit, "power_limit", 700000)
UINT_GETTER(nvmlDeviceGetPowerManagementDefaultLimit, "power_default", 700000)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, "pcie_gen", 5)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, "pcie_gen_max", 5)
UINT_GETTER(nvmlDeviceGetRetiredPagesPendingStatus, "retired_pending", 0)

nvmlReturn_t nvmlDeviceGetGpuMaxPcieLinkGeneration(nvmlDevice_t dev, unsigned int *out) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetGpuMaxPcieLinkGeneration");
    if (r) return r;
    *out = (unsigned int)gpu_num(dev->index, "pcie_gen_gpu_max", 5);
    return OK;
}

/* Page addresses retired for one cause (0: multiple single-bit errors, 1: a double-bit error). */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t dev, int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetRetiredPages");
    if (r) return r;
    if (cause != 0 && cause != 1) return ERR_INVALID;
    unsigned int n = (unsigned int)gpu_num(dev->index, cause ? "retired_dbe" : "retired_sbe", 0);
    if (!addresses || *count < n) {
        *count = n;
        return n ? ERR_INSUFFICIENT : OK;
    }
    for (unsigned int i = 0; i < n; i++) addresses[i] = 0x100000ull * (i + 1) + (unsigned long long)cause;
    *count = n;
    return OK;
}
UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, "pcie_width", 16)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, "pcie_width_max", 16)
UINT_GETTER(nvmlDeviceGetPersistenceMode, "persistence", 1)

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetMigMode");
    if (r) return r;
    *current = *pending = (unsigned int)gpu_num(dev->index, "mig", 0);
    return OK;
}

/* c_nvmlProcessInfo_v3_t as pynvml declares it. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t dev, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetComputeRunningProcesses_v3");
    if (r) return r;
    const char *spec = gpu_get(dev->index, "procs");
    nvmlProcessInfo_t found[64];
    unsigned int n = 0;
    if (spec && *spec) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", spec);
        for (char *tok = strtok(buf, ","); tok && n < 64; tok = strtok(NULL, ",")) {
            char *colon = strchr(tok, ':');
            found[n].pid = (unsigned int)strtoul(tok, NULL, 10);
            found[n].usedGpuMemory = colon ? strtoull(colon + 1, NULL, 10) : 0;
            found[n].gpuInstanceId = found[n].computeInstanceId = 0xFFFFFFFFu;
            n++;
        }
    }
    if (!infos || *count < n) {
        *count = n;
        return n ? ERR_INSUFFICIENT : OK;
    }
    memcpy(infos, found, n * sizeof *found);
    *count = n;
    return OK;
}

static int in_list(const char *list, unsigned int value) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list ? list : "");
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ","))
        if (strtoul(tok, NULL, 10) == value) return 1;
    return 0;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link, unsigned int *active) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetNvLinkState");
    if (r) return r;
    unsigned long long links = gpu_num(dev->index, "nvlinks", 0);
    if (!links) return ERR_NOT_SUPPORTED;
    if (link >= links) return ERR_INVALID;
    *active = in_list(gpu_get(dev->index, "nvlink_down"), link) ? 0 : 1;
    return OK;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t dev, unsigned int link, unsigned int counter,
                                             unsigned long long *value) {
    static const char *const names[] = {"replay", "recovery", "crc_flit", "crc_data"};
    nvmlReturn_t r = enter(dev, "nvmlDeviceGetNvLinkErrorCounter");
    if (r) return r;
    if (link >= gpu_num(dev->index, "nvlinks", 0)) return ERR_INVALID;
    if (counter > 3) return ERR_INVALID;
    char field[64];
    snprintf(field, sizeof field, "nvlink%u.%s", link, names[counter]);
    *value = gpu_num(dev->index, field, 0);
    return OK;
}

/* Events: one static set; Xid events of the registered GPUs are delivered once each, in GPU order. */
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

struct fake_event_set { int registered[MAX_GPUS]; int delivered[MAX_GPUS]; };
static struct fake_event_set event_set;

nvmlReturn_t nvmlEventSetCreate(struct fake_event_set **set) {
    if (!initialized) return ERR_UNINIT;
    memset(&event_set, 0, sizeof event_set);
    *set = &event_set;
    return OK;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t dev, unsigned long long types, struct fake_event_set *set) {
    nvmlReturn_t r = enter(dev, "nvmlDeviceRegisterEvents");
    if (r) return r;
    if (set != &event_set) return ERR_INVALID;
    if (types & 0x8ull) set->registered[dev->index] = 1;  /* nvmlEventTypeXidCriticalError */
    return OK;
}

nvmlReturn_t nvmlEventSetWait_v2(struct fake_event_set *set, nvmlEventData_t *data, unsigned int timeout_ms) {
    if (!initialized) return ERR_UNINIT;
    if (set != &event_set || !data) return ERR_INVALID;
    for (int g = 0; g < n_gpus(); g++) {
        if (!set->registered[g]) continue;
        const char *list = gpu_get(g, "xid_event");
        char buf[256];
        snprintf(buf, sizeof buf, "%s", list ? list : "");
        int k = 0;
        for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ","), k++) {
            if (k < set->delivered[g]) continue;
            set->delivered[g]++;
            memset(data, 0, sizeof *data);
            data->device = &devices[g];
            data->eventType = 0x8ull;
            data->eventData = strtoull(tok, NULL, 10);
            data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
            return OK;
        }
    }
    struct timespec ts = {(time_t)(timeout_ms / 1000), (long)(timeout_ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
    return 10;  /* NVML_ERROR_TIMEOUT */
}

nvmlReturn_t nvmlEventSetFree(struct fake_event_set *set) {
    if (set != &event_set) return ERR_INVALID;
    memset(&event_set, 0, sizeof event_set);
    return OK;
}
