/* The runtime of the simulated libnvidia-ml.so.1: one connection per process to the node's
 * simulator (migsim.nvml.server), Init/Shutdown reference counting, handles, marshalling.
 * The per-function code that uses it is generated from migsim/nvml/abi.py (migsim.nvml.cgen). */
#ifndef MIG_AGENT_NVML_SIM_H
#define MIG_AGENT_NVML_SIM_H

#include <stddef.h>
#include <stdint.h>

#define SIM_HIDDEN __attribute__((visibility("hidden")))

typedef struct sim_call {
    char *buf;          /* request, then reply */
    size_t len, cap;    /* request length / reply length, allocated size */
    size_t pos;         /* read position in the reply */
    int failed;         /* out of memory, I/O error or malformed reply */
} sim_call;

/* Locks the library and checks nvmlInit; on anything but NVML_SUCCESS nothing is held. */
SIM_HIDDEN int sim_start(sim_call *c, const char *name);
/* Sends the request and reads the reply: the reply's nvmlReturn_t, or an error code. */
SIM_HIDDEN int sim_send(sim_call *c);
/* Frees and unlocks; a malformed reply turns rc into NVML_ERROR_UNKNOWN. */
SIM_HIDDEN int sim_finish(sim_call *c, int rc);

SIM_HIDDEN void sim_put_u8(sim_call *c, uint8_t v);
SIM_HIDDEN void sim_put_u32(sim_call *c, uint32_t v);
SIM_HIDDEN void sim_put_handle(sim_call *c, const void *handle);
SIM_HIDDEN void sim_put_text(sim_call *c, const char *text);
/* present flag and, if p, size bytes; returns the offset of the bytes in the request (or 0). */
SIM_HIDDEN size_t sim_put_ptr(sim_call *c, const void *p, size_t size);
SIM_HIDDEN void sim_put_bytes(sim_call *c, const void *p, size_t size);
/* The pointer-sized field at offset off of the request becomes its handle's token. */
SIM_HIDDEN void sim_tokenize(sim_call *c, size_t off);

SIM_HIDDEN void sim_get_ptr(sim_call *c, void *p, size_t size);
SIM_HIDDEN void sim_get_handle(sim_call *c, void **out);
/* u32 k, then k elements of elem bytes into p (at most max elements). */
SIM_HIDDEN void sim_get_array(sim_call *c, void *p, size_t elem, size_t max);
SIM_HIDDEN void sim_get_handles(sim_call *c, void **p, size_t max);
/* The token stored at p (pointer-sized) becomes the library's handle for it. */
SIM_HIDDEN void sim_untokenize(void *p);

SIM_HIDDEN const char *sim_error_string(int code);   /* generated */
/* The simulator's event poll (migsim.nvml.abi.POLL_EVENTS) and its interval (generated). */
SIM_HIDDEN extern const char sim_poll_events[];
SIM_HIDDEN extern const unsigned int sim_event_poll_ms;
/* The simulator's GPU reset (migsim.nvml.abi.RESET_GPU) and the visibility count meaning "all". */
SIM_HIDDEN extern const char sim_reset_gpu[];
SIM_HIDDEN extern const uint32_t sim_visible_everything;
/* The simulator's hold of the devices a process sees (migsim.nvml.abi.HOLD_DEVICES). */
SIM_HIDDEN extern const char sim_hold_devices[];

#endif
