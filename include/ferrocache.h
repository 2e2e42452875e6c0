/*
 * ferrocache: a CUDA caching allocator for PyTorch.
 *
 * Load it with torch.cuda.memory.CUDAPluggableAllocator(path, "rust_malloc", "rust_free").
 * Strings returned as `char *` belong to the caller: free them with ferrocache_string_free.
 * Strings returned as `const char *` belong to ferrocache: never free them.
 */

#ifndef FERROCACHE_H
#define FERROCACHE_H

/* Generated from src/ffi.rs by build.rs (cbindgen); do not edit by hand. */

#include <stddef.h>
/* The CUDA runtime's stream handle; the same typedef as in <cuda_runtime_api.h>. */
typedef struct CUstream_st *cudaStream_t;

#ifdef __cplusplus
extern "C" {
#endif

// CUDAPluggableAllocator's allocation function. Returns device memory for `stream` on `device`;
// size 0 gives NULL. On failure it throws a C++ std::runtime_error (PyTorch: RuntimeError) and
// never returns NULL: on out of memory the message is PyTorch's, starting
// "CUDA out of memory. Tried to allocate"; on a driver failure it starts "CUDA error: "; when
// the driver or device is unusable or the settings are invalid, it says why. Defined in
// src/oom.cpp.
void *rust_malloc(size_t size, int device, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif


#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// `CUDAPluggableAllocator`'s free function. NULL does nothing. A pointer ferrocache did not give
// out, or one already freed, is logged at ERROR and nothing changes. A `size`, `device` or
// `stream` that differs from what the allocation recorded is logged at WARN and the recorded
// value is used.
void rust_free(void *ptr, size_t size, int device, cudaStream_t stream);

// Allocates `size` bytes on `device` for `stream` (0 is the default stream). Returns NULL when
// `size` is 0 (last error empty) or on failure (last error set: PyTorch's out-of-memory
// message, a driver error, or why the device or the settings are unusable). Never throws.
void *ferrocache_alloc(size_t size, int device, cudaStream_t stream);

// Frees an allocation from `ferrocache_alloc` or `rust_malloc`, on whichever device it is.
// Returns 0, or -1 (last error set, logged at ERROR, nothing changed) for a pointer ferrocache
// did not give out or already freed. NULL returns 0 and does nothing.
int ferrocache_free(void *ptr);

// This thread's last error: empty when the latest `ferrocache_*` call that can fail succeeded.
// Never NULL. Owned by ferrocache; valid until the next ferrocache call on this thread.
const char *ferrocache_last_error(void);

// `set_init_fn`: PyTorch tells the device count. Reads the settings and sets up logging; device
// allocators are still created on first use.
void rust_init(int device_count);

// `set_reset_fn`, which PyTorch calls for `torch.cuda.empty_cache()`: gives every wholly free
// cached segment of every device back to the driver. Errors are logged.
void rust_reset(void);

// `set_memory_fraction_fn`: `torch.cuda.set_per_process_memory_fraction(fraction, device)`.
// Errors (a fraction outside [0, 1], an unusable device) are logged.
void rust_memory_fraction(double fraction, int device);

// `set_record_stream_fn`: `Tensor.record_stream(stream)`. The allocation at `ptr` is not reused
// after its free until the work queued on `stream` by then has completed. An unknown pointer is
// logged at ERROR.
void rust_record_stream(void *ptr, cudaStream_t stream);

// `set_base_alloc_fn`: the start of the segment that holds the allocation at `ptr`, with the
// segment's size in `*size` (used for CUDA IPC). An unknown pointer is logged at ERROR and
// gives `ptr` itself with `*size` = 0.
//
// # Safety
// `size` is NULL or valid for one `size_t` write.
void *rust_base_alloc(void *ptr, size_t *size);

// Frees a string that a `ferrocache_*` function returned. NULL does nothing. Never pass it
// anything else (in particular not `ferrocache_last_error`'s pointer), nor free those with
// `free()`.
//
// # Safety
// `text` is NULL or a string returned by a `ferrocache_*` function and not yet freed.
void ferrocache_string_free(char *text);

// `torch.cuda.memory_stats(device)`: one JSON object with PyTorch's flat keys
// (`allocated_bytes.all.current`, `num_ooms`, ...). Returns a string to free with
// `ferrocache_string_free`, or NULL (last error set).
char *ferrocache_memory_stats(int device);

// `torch.cuda.memory._snapshot()`: PyTorch's structure as JSON (`segments` of every device,
// `device_traces` indexed by device, `allocator_settings`). Returns a string to free with
// `ferrocache_string_free`, or NULL (last error set).
char *ferrocache_snapshot(void);

// `torch.cuda.memory._record_memory_history`: `enabled` non-zero starts recording allocator
// events (at most `max_entries`, the newest kept) on every device, including devices used
// later; zero stops and clears. Returns 0.
int ferrocache_record_history(int enabled, size_t max_entries);

// `torch.cuda.reset_peak_memory_stats(device)`. Returns 0, or -1 (last error set).
int ferrocache_reset_peak_stats(int device);

// `torch.cuda.reset_accumulated_memory_stats(device)`. Returns 0, or -1 (last error set).
int ferrocache_reset_accumulated_stats(int device);

// `torch.cuda.empty_cache()`: gives every wholly free cached segment of every device back to
// the driver. Returns 0, or -1 (last error set).
int ferrocache_empty_cache(void);

// `torch.cuda.set_per_process_memory_fraction(fraction, device)`. Returns 0, or -1 (last error
// set: a fraction outside [0, 1], an unusable device).
int ferrocache_set_memory_fraction(double fraction, int device);

// Checks every device allocator's structural invariants and recomputes its statistics from its
// block table (a full walk: for tests and debugging). Returns 0, or -1 with what is wrong in
// the last error.
int ferrocache_check_invariants(void);

// Checks a `PYTORCH_CUDA_ALLOC_CONF` value (NULL: the one in the process environment, read as
// PyTorch reads it). Returns 1 when PyTorch would accept it, 0 when not, with PyTorch's
// wording in the last error.
//
// # Safety
// `text` is NULL or a NUL-terminated string.
int ferrocache_check_config(const char *text);

// What a `PYTORCH_CUDA_ALLOC_CONF` value (NULL: the process environment's) sets: one line per
// setting that differs from PyTorch's defaults, then the keys ferrocache does not use and the
// warnings. Returns a string to free with `ferrocache_string_free`, or NULL when the value is
// invalid (last error set, with PyTorch's wording).
//
// # Safety
// `text` is NULL or a NUL-terminated string.
char *ferrocache_describe_config(const char *text);

// The library's version, e.g. `0.1.0`. A static string; do not free it.
const char *ferrocache_version(void);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* FERROCACHE_H */
