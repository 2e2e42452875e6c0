/*
 * ferrocache: a CUDA caching allocator for PyTorch.
 *
 * Load it with torch.cuda.memory.CUDAPluggableAllocator(path, "rust_malloc", "rust_free").
 * Strings returned as `char *` belong to the caller: free them with ferrocache_string_free.
 * Strings returned as `const char *` belong to ferrocache: never free them.
 */

#ifndef FERROCACHE_H
#define FERROCACHE_H

/* Generated from src/ffi/ by build.rs (cbindgen); do not edit by hand. */

#include <stddef.h>
#include <stdint.h>
/* The CUDA runtime's stream handle; the same typedef as in <cuda_runtime_api.h>. */
typedef struct CUstream_st *cudaStream_t;

/* Returns an id for the calling thread's stack (0: none); event 0 is an allocation, 1 a free.
   See ferrocache_set_stack_gatherer. */
typedef uint64_t (*ferrocache_stack_gatherer)(int event);
/* Throws the C++ exception for an out-of-memory message. See ferrocache_set_oom_thrower. */
typedef void (*ferrocache_oom_thrower)(const char *message);
/* Returns the reserve class PyTorch's C++ API gave a stream, valid until the next call on the
   thread (NULL or empty: none). See ferrocache_set_reserve_class_lookup. */
typedef const char *(*ferrocache_reserve_class_lookup)(cudaStream_t stream);
/* Called at each out of memory, before the error: the device, the bytes that could not be
   allocated, the device's total (or the memory-fraction limit) and free bytes. See
   ferrocache_attach_oom_observer. */
typedef void (*ferrocache_oom_observer)(int device, size_t alloc_size, size_t device_total,
                                        size_t device_free);
/* Asks a capture's C++ stream filter: 1 yes, 0 no, -1 it threw (what it said in *error). See
   ferrocache_frontend_begin_allocate_to_pool. */
typedef int (*ferrocache_filter_accepts)(const void *filter, cudaStream_t stream, const char **error);
/* Destroys a capture's C++ stream filter. */
typedef void (*ferrocache_filter_drop)(void *filter);
/* Receive a snapshot's segments and their blocks. See ferrocache_snapshot_segments. */
struct ferrocache_segment_info;
struct ferrocache_block_info;
typedef void (*ferrocache_segment_visitor)(void *context, const struct ferrocache_segment_info *segment);
typedef void (*ferrocache_block_visitor)(void *context, const struct ferrocache_block_info *block);
/* A private pool's checkpoint, opaque: made by ferrocache_checkpoint_pool, given back with
   ferrocache_checkpoint_free. */
struct ferrocache_checkpoint;
/* Receives one allocator trace entry (PyTorch's TraceEntry) under the device's lock; returns 0,
   or -1 with why in *error. See ferrocache_attach_trace_tracker. */
struct ferrocache_trace_event;
typedef int (*ferrocache_trace_tracker)(const struct ferrocache_trace_event *event, const char **error);
/* Runs PyTorch's free-memory callbacks on a cache miss, with no allocator lock held: 1 one freed
   memory, 0 none did, -1 one failed (why in *error). See ferrocache_set_free_memory_callbacks. */
typedef int (*ferrocache_free_memory_callbacks)(const char **error);
/* A private pool's own allocator (torch.cuda.MemPool(allocator=...)), called on `context`. alloc:
   `size` bytes, or NULL with *error NULL when it has none, or NULL with why in *error when it
   failed. free: 0, or -1 with why in *error. release: the pool is gone. See
   ferrocache_create_pool_with_allocator. */
typedef void *(*ferrocache_pool_alloc)(void *context, size_t size, const char **error);
typedef int (*ferrocache_pool_free)(void *context, void *ptr, const char **error);
typedef void (*ferrocache_pool_release)(void *context);

#ifdef __cplusplus
extern "C" {
#endif

// CUDAPluggableAllocator's allocation function. Returns device memory for `stream` on `device`;
// size 0 gives NULL. On failure it throws a C++ std::runtime_error (PyTorch: RuntimeError), or
// on out of memory the registered ferrocache_oom_thrower's exception, and never returns NULL:
// on out of memory the message is PyTorch's, starting
// "CUDA out of memory. Tried to allocate"; on a driver failure it starts "CUDA error: "; when
// the driver or device is unusable or the settings are invalid, it says why. Defined in
// src/oom.cpp.
void *rust_malloc(size_t size, int device, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#ifdef __cplusplus  /* C++ only */
#include <functional>
#include <utility>

// CUDAPluggableAllocator's CUDA graph pool hooks, with the C++ types PyTorch casts them to
// (torch/csrc/cuda/Module.cpp); the pool id is c10::cuda::MempoolId_t. Defined in
// src/pool_hooks.cpp. They exist for PyTorch (set_begin_allocate_to_pool,
// set_end_allocate_to_pool_fn, set_release_pool); C callers use the ferrocache_*_pool functions.
extern "C" {

// beginAllocateToPool: until the end hook, allocations on `device` whose stream `filter` accepts
// come from the private pool `pool` (created, or given one more reference). Throws
// std::runtime_error when the capture cannot be served from its own pool (a capture already
// records into `pool`; the device is unusable).
void rust_begin_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> pool, std::function<bool(cudaStream_t)> filter);

// endAllocateToPool: allocations stop going to `pool`. Never throws; bad input is logged.
void rust_end_allocate_to_pool(int device, std::pair<unsigned long long, unsigned long long> pool);

// releasePool (g.reset(), or a graph's deletion): drops one reference to `pool`; once none is left
// and no block in it is live, empty_cache gives its memory back. Never throws; bad input is logged.
void rust_release_pool(int device, std::pair<unsigned long long, unsigned long long> pool);

}  // extern "C"
#endif  /* C++ only */


// What `ferrocache_restore_pool_checkpoint` changed (PyTorch's `CheckpointDelta`): the
// addresses of the allocations it freed (their tensors must lose their deleter) and of the
// checkpoint's allocations, live again (their `DataPtr`s get the front end's deleter). The
// arrays are ferrocache's, valid until `ferrocache_checkpoint_delta_free`.
typedef struct ferrocache_checkpoint_delta {
  void **freed;
  size_t freed_count;
  void **allocated;
  size_t allocated_count;
} ferrocache_checkpoint_delta;

// One of PyTorch's `Stat`s.
typedef struct ferrocache_stat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} ferrocache_stat;

// PyTorch's `DeviceStats`, its `StatArray`s as [all, small pool, large pool], in its order.
typedef struct ferrocache_device_stats {
  struct ferrocache_stat allocation[3];
  struct ferrocache_stat segment[3];
  struct ferrocache_stat active[3];
  struct ferrocache_stat inactive_split[3];
  struct ferrocache_stat allocated_bytes[3];
  struct ferrocache_stat reserved_bytes[3];
  struct ferrocache_stat active_bytes[3];
  struct ferrocache_stat inactive_split_bytes[3];
  struct ferrocache_stat requested_bytes[3];
  int64_t num_alloc_retries;
  int64_t num_ooms;
  struct ferrocache_stat oversize_allocations;
  struct ferrocache_stat oversize_segments;
  int64_t num_sync_all_streams;
  int64_t num_device_alloc;
  int64_t num_device_free;
  int64_t num_oom_rejections;
  int64_t max_split_size;
} ferrocache_device_stats;

// One expandable segment's size, as PyTorch's `StreamSegmentSize` holds it.
typedef struct ferrocache_stream_segment_size {
  cudaStream_t stream;
  // 1 when its pages are the small pool's (2 MiB), else 0.
  int is_small_pool;
  // Bytes mapped in it now.
  uint64_t total_size;
} ferrocache_stream_segment_size;

// One segment of a snapshot, as PyTorch's `SegmentInfo` holds it (without its blocks).
typedef struct ferrocache_segment_info {
  int device;
  uint64_t address;
  uint64_t total_size;
  uint64_t requested_size;
  uint64_t allocated_size;
  uint64_t active_size;
  uint64_t stream;
  int is_large;
  int is_expandable;
  unsigned long long pool_first;
  unsigned long long pool_second;
  // The order in which the segment was made (PyTorch's `registration_counter`).
  uint64_t registration_counter;
} ferrocache_segment_info;

// One block of a snapshot's segment, as PyTorch's `BlockInfo` holds it.
typedef struct ferrocache_block_info {
  uint64_t size;
  uint64_t requested_size;
  int allocated;
  int active;
} ferrocache_block_info;

// One trace entry, as PyTorch's `TraceEntry` holds it.
typedef struct ferrocache_trace_event {
  // PyTorch's `TraceEntry::Action`: 0 alloc, 1 free_requested, 2 free_completed,
  // 3 segment_alloc, 4 segment_free, 5 segment_map, 6 segment_unmap, 7 snapshot, 8 oom.
  int action;
  int device;
  // The address; for an `oom`, the device's free bytes.
  uint64_t addr;
  uint64_t size;
  cudaStream_t stream;
  // The pool's id: (0, 0) for the ordinary pools, else the private pool's.
  unsigned long long pool_first;
  unsigned long long pool_second;
} ferrocache_trace_event;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// Which `PYTORCH_CUDA_ALLOC_CONF` to set (`ferrocache.advise()`): the settings space searched
// with the replay engine, as `ferrocache tune` does, on a snapshot or on this process's
// recorded history. Returns one JSON object (`ferrocache tune --json`'s keys, plus `table`: the
// text the command prints) to free with `ferrocache_string_free`, or NULL (last error set: no
// history recorded, with how to record it; a snapshot that cannot be read).
//
// - `snapshot`, `length`: a snapshot's bytes (pickle or JSON, as `ferrocache tune` reads
//   them); NULL for this process's recorded history.
// - `device`: the device whose history to search (required for the history); for a snapshot,
//   -1 searches every device in it.
// - `capacity_bytes`: the GPU's memory to fit in; 0: for the history, the device's memory (or
//   the memory fraction's limit), for a snapshot what its out-of-memory entries tell, else
//   80 GiB. A capacity given also tries `garbage_collection_threshold`.
// - `max_candidates`: try at most this many settings, the simplest first (0: all).
//
// # Safety
// `snapshot` is NULL or points to `length` readable bytes.
char *ferrocache_advise(const char *snapshot, size_t length, int device, unsigned long long capacity_bytes, size_t max_candidates);

// Registers `gatherer` (NULL: none), which every allocation (and every free too when
// `on_free` is non-zero) calls before it takes any lock; the id it returns is kept with the
// block and the trace entries, and `ferrocache_snapshot` reports it as `stack_id`. The Python
// package uses it to record Python stacks. `gatherer` must stay callable for the life of the
// process, be callable from any thread and never unwind. Returns 0.
int ferrocache_set_stack_gatherer(ferrocache_stack_gatherer gatherer, int on_free);

// Registers `thrower` (NULL: none), which `rust_malloc` calls with PyTorch's message when an
// allocation fails for lack of memory. It must throw a C++ exception (the Python package's
// shim throws `c10::OutOfMemoryError`, which PyTorch raises as `torch.OutOfMemoryError`); if
// it returns, `rust_malloc` throws `std::runtime_error`. It must stay callable for the life of
// the process. Returns 0.
int ferrocache_set_oom_thrower(ferrocache_oom_thrower thrower);

// Registers `lookup` (NULL: none), which the allocator asks for a stream's reserve class when
// it makes an expandable segment for the stream or reports an out of memory on it, so that
// `expandable_segments_reserve_by_class` applies to the streams PyTorch's C++ API tagged (the
// Python package's shim asks PyTorch 2.15's `getExpandableSegmentReserveClassForStream`). It is
// called with an allocator lock held: it must not call ferrocache, must stay callable for the
// life of the process and never unwind. Returns 0.
int ferrocache_set_reserve_class_lookup(ferrocache_reserve_class_lookup lookup);

// Attaches `observer`, PyTorch's out-of-memory observer
// (`torch._C._cuda_attach_out_of_memory_observer`): at each out of memory, before the
// exception reaches the caller, every attached observer is called on the allocating thread
// with the device, the size that could not be allocated, the device's total memory (or the
// limit `set_per_process_memory_fraction` set) and its free memory. No allocator lock is held
// then, so it may call any `ferrocache_*` function (take a snapshot); an allocation it makes
// can run out of memory again and call it again. It must stay callable for the life of the
// process (or until detached) and never unwind. Returns 0; -1 for NULL (last error set).
int ferrocache_attach_oom_observer(ferrocache_oom_observer observer);

// Detaches every attachment of `observer`; an observer not attached is no error. Returns 0.
int ferrocache_detach_oom_observer(ferrocache_oom_observer observer);

// `CUDAAllocator::getCheckpointState` (CUDA graph trees, after each recording): the blocks
// of private pool `(pool_first, pool_second)` on `device`, segment by segment. Returns the
// checkpoint, owned by the caller (`ferrocache_checkpoint_free`), or NULL (last error set)
// for an unknown pool, one whose references were all released, or a block of it that waits
// for other streams.
struct ferrocache_checkpoint *ferrocache_checkpoint_pool(int device, unsigned long long pool_first, unsigned long long pool_second);

// Gives back a checkpoint; NULL is nothing.
//
// # Safety
// `checkpoint` is NULL or came from `ferrocache_checkpoint_pool` and is given back once.
void ferrocache_checkpoint_free(struct ferrocache_checkpoint *checkpoint);

// `CUDAAllocator::setCheckpointPoolState` (CUDA graph trees, before recording a new branch):
// frees every allocation of the checkpoint's pool, then puts the checkpoint's blocks back at
// their addresses, the checkpoint's allocations live again. Fills `*delta` (its arrays are
// given back with `ferrocache_checkpoint_delta_free`) and returns 0; or returns -1 (last
// error set, `*delta` empty, nothing changed) for another device's checkpoint, a pool gone
// or unreferenced, or a checkpointed segment that is gone or was carved otherwise since.
//
// # Safety
// `checkpoint` came from `ferrocache_checkpoint_pool` and is not given back meanwhile;
// `delta` is valid for one write.
int ferrocache_restore_pool_checkpoint(int device, const struct ferrocache_checkpoint *checkpoint, struct ferrocache_checkpoint_delta *delta);

// Gives back the arrays of a delta that `ferrocache_restore_pool_checkpoint` filled, and
// empties it; NULL, or an empty delta, is nothing.
//
// # Safety
// `delta` is NULL or a delta filled by `ferrocache_restore_pool_checkpoint` (or emptied by
// this function), its fields unchanged since.
void ferrocache_checkpoint_delta_free(struct ferrocache_checkpoint_delta *delta);

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

// Registers `callbacks` (NULL: none), as PyTorch's allocator runs its free-memory callbacks
// (`c10::FreeCudaMemoryCallbacksRegistry`): from now on, when the first search of a device's
// cached blocks misses, the allocation runs `callbacks` with no allocator lock held, then
// searches again only if they freed memory, before asking the device for more. `callbacks`
// returns 1 when one of them freed memory, 0 when none did, -1 when one failed (why in
// `*error`, valid until its next call on the thread: logged at ERROR, and the cache is
// searched again); it may call ferrocache (to free, above all) and must never unwind. It
// replaces an earlier one and must stay callable until replaced. Returns 0, or -1 (last error
// set).
int ferrocache_set_free_memory_callbacks(ferrocache_free_memory_callbacks callbacks);

// `CUDAAllocator::allocate` and `raw_alloc`: what `rust_malloc` does, for a caller outside
// the library. Returns the pointer with `*error` set to NULL, or NULL with `*error` pointing
// at the reason (valid until this thread's next ferrocache call) and `*thrower` at the
// registered out-of-memory thrower when memory ran out (else NULL). Size 0 gives NULL with no
// error.
//
// # Safety
// `error` and `thrower` are NULL or valid for one pointer write each.
void *ferrocache_frontend_malloc(size_t size, int device, cudaStream_t stream, const char **error, ferrocache_oom_thrower *thrower);

// `CUDAAllocator::beginAllocateToPool`: from now until `ferrocache_end_allocate_to_pool`,
// allocations on `device` whose stream `filter` accepts come from the private pool
// `(pool_first, pool_second)`. Takes ownership of `filter` (NULL: it could not be copied).
// Returns NULL, or why the capture is refused (logged at ERROR), which the C++ side throws.
//
// # Safety
// `filter` is NULL or an object that `accepts` and `drop` work on, not used by the caller
// afterwards.
const char *ferrocache_frontend_begin_allocate_to_pool(int device, unsigned long long pool_first, unsigned long long pool_second, void *filter, ferrocache_filter_accepts accepts, ferrocache_filter_drop drop);

// `CUDAAllocator::cacheInfo` as PyTorch's allocator answers it (cuDNN sizes its benchmark
// workspaces by it): `*largest` becomes the largest of itself and every cached block of
// `device`, private pools included; a `*largest` of 0 starts from the device's free memory.
// Returns 0, or -1 (last error set).
//
// # Safety
// `largest` is valid for one `size_t` read and write.
int ferrocache_cache_info(int device, size_t *largest);

// `CUDAAllocator::getDeviceStats`: `device`'s statistics, what `torch.cuda.memory_stats`
// reports, into `*out` (all zero for a device not used yet). Returns 0, or -1 (last error
// set).
//
// # Safety
// `out` is valid for one `ferrocache_device_stats` write.
int ferrocache_read_device_stats(int device, struct ferrocache_device_stats *out);

// `CUDAAllocator::checkPoolLiveAllocations` (CUDA graph trees): 1 when the allocations live
// in private pool `(pool_first, pool_second)` of `device` are exactly the `count` addresses at
// `expected`, 0 when not, -1 for an unknown pool or device (last error set).
//
// # Safety
// `expected` is valid for `count` pointer reads (or `count` is 0).
int ferrocache_check_pool_live_allocations(int device, unsigned long long pool_first, unsigned long long pool_second, void *const *expected, size_t count);

// `CUDAAllocator::setUseOnOOM`, as `torch.cuda.MemPool(use_on_oom=True)` calls it: with
// `use_on_oom` non-zero, an allocation outside every private pool that would run out of memory
// may take one of the pool's cached blocks. Returns 0, or -1 (last error set) when there is no
// such pool.
int ferrocache_set_pool_use_on_oom(int device, unsigned long long pool_first, unsigned long long pool_second, int use_on_oom);

// `CUDAAllocator::setNoSplit`, as `torch.cuda.MemPool(no_split=True)` calls it: the pool's
// blocks are handed out whole. Returns 0, or -1 (last error set) when there is no such pool.
int ferrocache_set_pool_no_split(int device, unsigned long long pool_first, unsigned long long pool_second);

// `CUDAAllocator::isHistoryEnabled`: 1 while allocator events are recorded
// (`ferrocache_record_history`), else 0.
int ferrocache_history_enabled(void);

// `CUDAAllocator::snapshot` from C++ (what PyTorch's NCCL process groups and the profiler
// ask): every segment of every device in use, in device then address order, each followed by
// its blocks, given to `segment` and `block` with `context`. With a pool id other than
// `(0, 0)`, only that private pool's segments. The trace entries are not given (ferrocache's
// history reaches Python through `ferrocache_snapshot`). No allocator lock is held while the
// visitors run. Returns 0, or -1 (last error set).
//
// # Safety
// `segment` and `block` are callable with `context`, and never unwind.
int ferrocache_snapshot_segments(unsigned long long pool_first, unsigned long long pool_second, void *context, ferrocache_segment_visitor segment, ferrocache_block_visitor block);

// This thread's last error: empty when the latest `ferrocache_*` call that can fail succeeded.
// Never NULL. Owned by ferrocache; valid until the next ferrocache call on this thread.
const char *ferrocache_last_error(void);

// `set_init_fn`: PyTorch tells the device count. Reads the settings and sets up logging; device
// allocators are still created on first use.
void rust_init(int device_count);

// `set_reset_fn`, which PyTorch calls for `torch.cuda.empty_cache()`: gives every wholly free
// cached segment of every device back to the driver. Errors are logged.
void rust_reset(void);

// `torch.cuda.empty_cache()`: gives every wholly free cached segment of every device back to
// the driver. Returns 0, or -1 (last error set).
int ferrocache_empty_cache(void);

// [`ferrocache_empty_cache`] as PyTorch's `emptyCache` runs it: `current_streams[d]` is
// device d's current stream (`getCurrentCUDAStream(d)`), for the `count` first devices. Inside
// `torch.cuda.use_mem_pool` with no graph capture on it, the ordinary pools are then released
// as PyTorch 2.13+ releases them; without it a recording pool counts as a capture. Returns 0,
// or -1 (last error set).
//
// # Safety
// `current_streams` points to `count` streams, or `count` is 0.
int ferrocache_empty_cache_with_current_streams(const cudaStream_t *current_streams, int count);

// `set_memory_fraction_fn`: `torch.cuda.set_per_process_memory_fraction(fraction, device)`.
// Errors (a fraction outside [0, 1], an unusable device) are logged.
void rust_memory_fraction(double fraction, int device);

// `torch.cuda.set_per_process_memory_fraction(fraction, device)`. Returns 0, or -1 (last error
// set: a fraction outside [0, 1], an unusable device).
int ferrocache_set_memory_fraction(double fraction, int device);

// `torch.cuda.get_per_process_memory_fraction(device)`: the limit
// `set_per_process_memory_fraction` (or `per_process_memory_fraction`) set on `device`, as a
// share of its memory; 1 when none was set. Returns -1 when the device cannot be used (last
// error set).
double ferrocache_get_memory_fraction(int device);

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

// `torch.cuda.memory_stats(device)`: one JSON object with PyTorch's flat keys
// (`allocated_bytes.all.current`, `num_ooms`, ...). Returns a string to free with
// `ferrocache_string_free`, or NULL (last error set).
char *ferrocache_memory_stats(int device);

// `torch.cuda.reset_peak_memory_stats(device)`. Returns 0, or -1 (last error set).
int ferrocache_reset_peak_stats(int device);

// `torch.cuda.reset_accumulated_memory_stats(device)`. Returns 0, or -1 (last error set).
int ferrocache_reset_accumulated_stats(int device);

// `torch.cuda.memory._snapshot()`: PyTorch's structure as JSON (`segments` of every device,
// `device_traces` indexed by device, `allocator_settings`). Returns a string to free with
// `ferrocache_string_free`, or NULL (last error set).
char *ferrocache_snapshot(void);

// `torch.cuda.memory._record_memory_history`: `enabled` non-zero starts recording allocator
// events (at most `max_entries`, the newest kept) on every device, including devices used
// later; zero stops and clears. Returns 0.
int ferrocache_record_history(int enabled, size_t max_entries);

// Checks every device allocator's structural invariants and recomputes its statistics from its
// block table (a full walk: for tests and debugging). Returns 0, or -1 with what is wrong in
// the last error.
int ferrocache_check_invariants(void);

// `CUDAAllocator::shareIpcHandle`: the handle of the allocation that starts at `ptr`, in the
// format of PyTorch `version` (3 for 2.13 and later, 2 before), as a buffer of `*len` bytes
// that `ferrocache_ipc_bytes_free` gives back; the allocation's offset in the shared memory
// in `*offset`. NULL when it cannot be shared, with the reason in the last error.
//
// # Safety
// `len` and `offset` are valid for one write each.
uint8_t *ferrocache_ipc_share(void *ptr, int version, size_t *len, int64_t *offset);

// Gives back a buffer of `len` bytes that `ferrocache_ipc_share` returned.
//
// # Safety
// `bytes` came from `ferrocache_ipc_share` with this `len`, and is given back once.
void ferrocache_ipc_bytes_free(uint8_t *bytes, size_t len);

// `CUDAAllocator::getIpcDevPtr`: maps the memory that the `len` bytes of `handle` name (from
// ferrocache or PyTorch's allocator) on `device`, or finds it mapped already. Returns where
// it starts, with `*token` for `ferrocache_ipc_close`; NULL with the reason in the last error.
//
// # Safety
// `handle` is valid for `len` bytes; `token` for one write.
void *ferrocache_ipc_open(const uint8_t *handle, size_t len, int device, uint64_t *token);

// The end of one `ferrocache_ipc_open`'s use: the last user of a mapping unmaps it (after
// the device's work is done, as PyTorch). 0, or -1 with the reason in the last error (logged:
// it runs in a deleter, which must not throw).
int ferrocache_ipc_close(uint64_t token);

// PyTorch's `_cuda_beginAllocateCurrentThreadToPool` (what `torch.cuda.use_mem_pool` calls):
// allocations this thread makes on `device` come from the private pool `(pool_first,
// pool_second)` (created, or given one more reference) until
// `ferrocache_end_allocate_to_pool`. Returns 0, or -1 (last error set) when a capture already
// records into that pool.
int ferrocache_begin_allocate_current_thread_to_pool(int device, unsigned long long pool_first, unsigned long long pool_second);

// PyTorch's `_cuda_endAllocateToPool`: allocations stop going to the pool; it keeps its
// memory and references. Returns 0, or -1 (last error set) when nothing records into it.
int ferrocache_end_allocate_to_pool(int device, unsigned long long pool_first, unsigned long long pool_second);

// PyTorch's `_cuda_releasePool`: drops one reference to the pool. Once none is left and no
// block in it is live, `empty_cache` gives its memory back to the driver. Returns 0, or -1
// (last error set) for an unknown pool, one without references, or the last reference of a
// pool that something still records into.
int ferrocache_release_pool(int device, unsigned long long pool_first, unsigned long long pool_second);

// PyTorch's `createOrIncrefPool` (what `torch.cuda.MemPool()` calls): creates the private
// pool with one reference, or gives an existing one another. Returns 0, or -1 (last error set)
// when the device is unusable or the id is `(0, 0)` (the ordinary pools').
int ferrocache_create_or_incref_pool(int device, unsigned long long pool_first, unsigned long long pool_second);

// PyTorch's `setUseOnOOM` and `setNoSplit`, as `torch.cuda.MemPool(use_on_oom=...,
// no_split=...)` calls them: with `use_on_oom` non-zero, an allocation outside every private
// pool that would run out of memory may take one of the pool's cached blocks; with `no_split`
// non-zero, the pool's blocks are handed out whole. Returns 0, or -1 (last error set) when
// there is no such pool.
int ferrocache_set_pool_options(int device, unsigned long long pool_first, unsigned long long pool_second, int use_on_oom, int no_split);

// PyTorch's `emptyCache(mempool_id)`, as `torch.cuda.MemPool`'s destructor calls it: the
// private pool's cached memory goes back to the device once nothing refers to the pool and
// none of its blocks is live. Returns 0, or -1 (last error set).
int ferrocache_empty_pool_cache(int device, unsigned long long pool_first, unsigned long long pool_second);

// PyTorch's `getPoolUseCount`: the references the private pool holds. Returns -1 (last error
// set) when there is no such pool (never created, or gone after `empty_cache`).
int ferrocache_pool_use_count(int device, unsigned long long pool_first, unsigned long long pool_second);

// PyTorch's `createOrIncrefPool` with an allocator (`torch.cuda.MemPool(allocator=...)`, as
// NCCL's pool and symmetric memory make it): creates the private pool `(pool_first,
// pool_second)` on `device` with one reference; its segments come from `alloc_fn` and go back
// through `free_fn` (in place of the device's `cudaMalloc` and `cudaFree`), as PyTorch's do;
// when `alloc_fn` has no memory, or failed, the allocation takes the out-of-memory path. Takes
// ownership of `context`: `release_fn(context)` is called once the pool is gone (its last
// segment given back), or before returning when the pool is refused. Returns 0, or -1 (last
// error set) when the pool exists already (a pool's allocator is given when it is made), the id
// is `(0, 0)`, `alloc_fn` or `free_fn` is NULL, or the device is unusable.
//
// # Safety
// `context` is what the three functions work on, callable from any thread, and not used by
// the caller afterwards; `release_fn` may be NULL (nothing to release).
int ferrocache_create_pool_with_allocator(int device, unsigned long long pool_first, unsigned long long pool_second, void *context, ferrocache_pool_alloc alloc_fn, ferrocache_pool_free free_fn, ferrocache_pool_release release_fn);

// `CUDAAllocator::getExpandableSegmentSizes(device)`: writes up to `capacity` of the device's
// expandable segments to `out`, in address order (those of the legacy default stream left out,
// as PyTorch leaves them out), and returns how many there are (call again
// with more room when that is more than `capacity`); 0 for a device not used yet (not opened
// for the question). Returns -1 (last error set) for a bad device or a NULL `out` with a
// non-zero `capacity`.
//
// # Safety
// `out` is valid for `capacity` writes (or `capacity` is 0).
int64_t ferrocache_expandable_segment_sizes(int device, struct ferrocache_stream_segment_size *out, size_t capacity);

// `torch.cuda.memory._set_allocator_settings(text)`: parses `text` as PyTorch's
// `setAllocatorSettings` does, over the settings in effect (a key not named keeps its value,
// except `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold`,
// which go back to their defaults), and applies the result from each device's next decision
// on. Returns 0, or -1 with PyTorch's wording in the last error, nothing changed.
//
// # Safety
// `text` is a NUL-terminated string.
int ferrocache_set_allocator_settings(const char *text);

// `torch.cuda.memory.caching_allocator_enable(enabled)` (PyTorch's `enable`): with 0, the
// allocations made from now on go to the driver at their exact size and back at their free,
// outside the cache and its statistics; with non-zero, caching resumes (allocations made
// meanwhile still go back to the driver). Returns 0.
int ferrocache_set_caching_enabled(int enabled);

// Whether caching is on (PyTorch's `isEnabled`): 1 or 0.
int ferrocache_caching_enabled(void);

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

// `ferrocache.sleep`: gives back the physical memory of the tags in `tags` (names separated by
// newlines; NULL: all memory that can sleep), copied to host memory first when `backup` is
// non-zero. Returns a JSON report to free with `ferrocache_string_free`: the sums (segments,
// bytes, blocks, copied_bytes, skipped_bytes, host_memory_pinned, host_allocations,
// host_synchronizations, host_memory_bytes, seconds; docs/sleep.md), `devices` (the same per device, with
// `device`) and `failed` (null). Or NULL (last error set, `device N: why`): what slept stays
// asleep, `ferrocache_last_sleep_report` says what and where, and the call can be repeated.
//
// # Safety
// `tags` is NULL or a NUL-terminated string.
char *ferrocache_sleep(const char *tags, int backup);

// `ferrocache.wake`: maps the memory of `tags` (as for `ferrocache_sleep`) back at the same
// addresses and restores its backup. Returns a JSON report as `ferrocache_sleep` does, or
// NULL (last error set; what woke stays awake, `ferrocache_last_sleep_report` says what and
// where, and the call can be repeated).
//
// # Safety
// `tags` is NULL or a NUL-terminated string.
char *ferrocache_wake(const char *tags);

// The report of this thread's latest `ferrocache_sleep` or `ferrocache_wake`, failed or not,
// as the JSON they return; after a failure, `devices` holds what each device did up to the one
// that failed (included), and `failed` that device and why (`{"device": N, "error": "..."}`).
// Returns a string to free with `ferrocache_string_free`, or NULL (last error set) before
// this thread made either call.
char *ferrocache_last_sleep_report(void);

// `ferrocache.release_host_memory`: gives back the pinned host memory that sleep keeps for its
// backups on every device, except what holds the backup of memory still asleep. Returns the
// bytes given back (what the driver refuses is logged and kept for the next try).
uint64_t ferrocache_release_host_memory(void);

// Frees a string that a `ferrocache_*` function returned. NULL does nothing. Never pass it
// anything else (in particular not `ferrocache_last_error`'s pointer), nor free those with
// `free()`.
//
// # Safety
// `text` is NULL or a string returned by a `ferrocache_*` function and not yet freed.
void ferrocache_string_free(char *text);

// The library's version, e.g. `0.1.0`. A static string; do not free it.
const char *ferrocache_version(void);

// The `ferrocache` command (`replay`, `check-config`; see `docs/replay.md`), run in this
// process: `argv[0]` is the program's name, output goes to stdout and stderr, and the return
// value is the exit status. It never exits the process. The `ferrocache` binary is this call
// and nothing else, so that cargo's binary and the wheel's command are one program.
//
// # Safety
// `argv` is NULL (with `argc` 0) or points to `argc` pointers, each NULL or a NUL-terminated
// string.
int ferrocache_cli_main(int argc, const char *const *argv);

// Makes this thread's allocations from now on go under tag `tag` (NULL: no tag), on every
// device. The first tag makes every device's new segments sleep-able. Returns 0, or -1 (last
// error set).
//
// # Safety
// `tag` is NULL or a NUL-terminated string.
int ferrocache_set_thread_tag(const char *tag);

// `torch.cuda.memory._set_memory_metadata(text)`: the trace entries that this thread's
// allocations and frees record from now on carry `text` as `user_metadata`; an empty `text`
// clears it. Returns 0, or -1 (last error set) for a NULL or non-UTF-8 `text`.
//
// # Safety
// `text` is a NUL-terminated string.
int ferrocache_set_memory_metadata(const char *text);

// `torch.cuda.memory._get_memory_metadata()`: this thread's metadata ("" when none). Returns
// a string to free with `ferrocache_string_free`.
char *ferrocache_get_memory_metadata(void);

// `CUDAAllocator::attachAllocatorTraceTracker`: from now on `tracker` (NULL: none) receives
// every trace entry of every device, those opened later included, as PyTorch's trackers
// receive its own: the `segment_alloc` after the device gave the memory, the `segment_free`
// before it takes it back, a `segment_map` / `segment_unmap` per range of an expandable
// segment, and each `alloc`, `free_requested`, `free_completed` and `oom`, whether history is
// recorded or not. It replaces an earlier one (the C++ side keeps PyTorch's list of trackers
// and calls each). It is called with the device's lock held, on the thread that allocates or
// frees: it must stay callable for the life of the process (or until replaced), never call
// ferrocache for the same device, and never unwind. Returns 0, or -1 (last error set).
int ferrocache_attach_trace_tracker(ferrocache_trace_tracker tracker);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* FERROCACHE_H */
