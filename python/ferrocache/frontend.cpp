// ferrocache's own CUDAAllocator object: what PyTorch calls in place of its caching allocator
// once ferrocache.install() swapped it in (torch::cuda::CUDAPluggableAllocator::
// changeCurrentAllocator, the swap PyTorch's pluggable object uses). Built by
// ferrocache.frontend against the running PyTorch's headers, libc10, libc10_cuda and
// libtorch_cuda, and libferrocache, cached per PyTorch version; never shipped prebuilt (the
// class layout is PyTorch's, per version).
//
// Each method converts C++ types and calls the C ABI (include/ferrocache.h): every decision is
// made in Rust. Unlike PyTorch's CUDAPluggableAllocator, it keeps no map of pointers: the core
// knows each block's size, device and stream, so allocate() and the deleter go straight to it.
//
// FERROCACHE_TORCH_MINOR (given by the build, with FERROCACHE_TORCH_MAJOR) selects the virtuals
// of the PyTorch it is built for: checked against 2.11 and 2.15 (between them, a virtual this
// file has wrong fails the build, and install() falls back to CUDAPluggableAllocator).
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#ifndef FERROCACHE_TORCH_MAJOR
#define FERROCACHE_TORCH_MAJOR 2
#endif
#ifndef FERROCACHE_TORCH_MINOR
#define FERROCACHE_TORCH_MINOR 15
#endif
#define FERROCACHE_TORCH_AT_LEAST(major, minor) \
    (FERROCACHE_TORCH_MAJOR > (major) ||        \
     (FERROCACHE_TORCH_MAJOR == (major) && FERROCACHE_TORCH_MINOR >= (minor)))

// libferrocache's C ABI (include/ferrocache.h; that header is not installed with the package).
extern "C" {
typedef void (*ferrocache_oom_thrower)(const char* message);
typedef void (*ferrocache_oom_observer)(int device, size_t alloc_size, size_t device_total,
                                        size_t device_free);
typedef int (*ferrocache_filter_accepts)(const void* filter, cudaStream_t stream,
                                         const char** error);
typedef void (*ferrocache_filter_drop)(void* filter);
struct ferrocache_stat {
    int64_t current, peak, allocated, freed;
};
struct ferrocache_device_stats {
    ferrocache_stat allocation[3], segment[3], active[3], inactive_split[3], allocated_bytes[3],
        reserved_bytes[3], active_bytes[3], inactive_split_bytes[3], requested_bytes[3];
    int64_t num_alloc_retries, num_ooms;
    ferrocache_stat oversize_allocations, oversize_segments;
    int64_t num_sync_all_streams, num_device_alloc, num_device_free, num_oom_rejections,
        max_split_size;
};

struct ferrocache_segment_info {
    int device;
    uint64_t address, total_size, requested_size, allocated_size, active_size, stream;
    int is_large, is_expandable;
    unsigned long long pool_first, pool_second;
    uint64_t registration_counter;
};
struct ferrocache_block_info {
    uint64_t size, requested_size;
    int allocated, active;
};
typedef void (*ferrocache_segment_visitor)(void* context, const ferrocache_segment_info* segment);
typedef void (*ferrocache_block_visitor)(void* context, const ferrocache_block_info* block);
int ferrocache_snapshot_segments(unsigned long long pool_first, unsigned long long pool_second,
                                 void* context, ferrocache_segment_visitor segment,
                                 ferrocache_block_visitor block);

void* ferrocache_frontend_malloc(size_t size, int device, cudaStream_t stream, const char** error,
                                 ferrocache_oom_thrower* thrower);
int ferrocache_free(void* ptr);
const char* ferrocache_last_error(void);
void ferrocache_string_free(char* string);
void rust_init(int device_count);
int ferrocache_empty_cache_with_current_streams(const cudaStream_t* current_streams, int count);
int ferrocache_set_memory_fraction(double fraction, int device);
double ferrocache_get_memory_fraction(int device);
void rust_record_stream(void* ptr, cudaStream_t stream);
void* rust_base_alloc(void* ptr, size_t* size);
int ferrocache_cache_info(int device, size_t* largest);
int ferrocache_read_device_stats(int device, struct ferrocache_device_stats* out);
int ferrocache_reset_peak_stats(int device);
int ferrocache_reset_accumulated_stats(int device);
int ferrocache_set_caching_enabled(int enabled);
int ferrocache_caching_enabled(void);
int ferrocache_record_history(int enabled, size_t max_entries);
int ferrocache_history_enabled(void);
int ferrocache_set_memory_metadata(const char* metadata);
char* ferrocache_get_memory_metadata(void);
int ferrocache_attach_oom_observer(ferrocache_oom_observer observer);
const char* ferrocache_frontend_begin_allocate_to_pool(int device, unsigned long long pool_first,
                                                       unsigned long long pool_second,
                                                       void* filter,
                                                       ferrocache_filter_accepts accepts,
                                                       ferrocache_filter_drop drop);
int ferrocache_end_allocate_to_pool(int device, unsigned long long first, unsigned long long second);
int ferrocache_release_pool(int device, unsigned long long first, unsigned long long second);
int ferrocache_create_or_incref_pool(int device, unsigned long long first,
                                     unsigned long long second);
typedef void* (*ferrocache_pool_alloc)(void* context, size_t size, const char** error);
typedef int (*ferrocache_pool_free)(void* context, void* ptr, const char** error);
typedef void (*ferrocache_pool_release)(void* context);
int ferrocache_create_pool_with_allocator(int device, unsigned long long first,
                                          unsigned long long second, void* context,
                                          ferrocache_pool_alloc alloc_fn,
                                          ferrocache_pool_free free_fn,
                                          ferrocache_pool_release release_fn);
int ferrocache_pool_use_count(int device, unsigned long long first, unsigned long long second);
int ferrocache_empty_pool_cache(int device, unsigned long long first, unsigned long long second);
int ferrocache_set_pool_use_on_oom(int device, unsigned long long first, unsigned long long second,
                                   int use_on_oom);
int ferrocache_set_pool_no_split(int device, unsigned long long first, unsigned long long second);
int ferrocache_check_pool_live_allocations(int device, unsigned long long first,
                                           unsigned long long second, void* const* expected,
                                           size_t count);
struct ferrocache_checkpoint;
struct ferrocache_checkpoint_delta {
    void** freed;
    size_t freed_count;
    void** allocated;
    size_t allocated_count;
};
ferrocache_checkpoint* ferrocache_checkpoint_pool(int device, unsigned long long pool_first,
                                                  unsigned long long pool_second);
void ferrocache_checkpoint_free(ferrocache_checkpoint* checkpoint);
int ferrocache_restore_pool_checkpoint(int device, const ferrocache_checkpoint* checkpoint,
                                       ferrocache_checkpoint_delta* delta);
void ferrocache_checkpoint_delta_free(ferrocache_checkpoint_delta* delta);
}

// CUDA IPC (src/ffi/ipc.rs): PyTorch's shareable handles, written and opened in Rust.
extern "C" {
uint8_t* ferrocache_ipc_share(void* ptr, int version, size_t* len, int64_t* offset);
void ferrocache_ipc_bytes_free(uint8_t* bytes, size_t len);
void* ferrocache_ipc_open(const uint8_t* handle, size_t len, int device, uint64_t* token);
int ferrocache_ipc_close(uint64_t token);
struct ferrocache_trace_event {
    int action, device;
    uint64_t addr, size;
    cudaStream_t stream;
    unsigned long long pool_first, pool_second;
};
typedef int (*ferrocache_trace_tracker)(const ferrocache_trace_event* event, const char** error);
int ferrocache_attach_trace_tracker(ferrocache_trace_tracker tracker);
typedef int (*ferrocache_free_memory_callbacks)(const char** error);
int ferrocache_set_free_memory_callbacks(ferrocache_free_memory_callbacks callbacks);
struct ferrocache_stream_segment_size {
    cudaStream_t stream;
    int is_small_pool;
    uint64_t total_size;
};
int64_t ferrocache_expandable_segment_sizes(int device, ferrocache_stream_segment_size* out,
                                            size_t capacity);
}

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using MempoolId = c10::MempoolId_t;

// What a failed ferrocache call said, as PyTorch's error (RuntimeError in Python).
[[noreturn]] void fail(const char* call) {
    TORCH_CHECK(false, call, ": ", ferrocache_last_error());
}

void check(int status, const char* call) {
    if (status < 0) {
        fail(call);
    }
}

// The deleter of every DataPtr ferrocache hands out: the core finds the block by its address.
// A pointer it does not know is logged there; a deleter must not throw.
void delete_block(void* ptr) { (void)ferrocache_free(ptr); }

c10::DeviceIndex current_device() {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return device;
}

void copy_stat(const ferrocache_stat& from, c10::CachingAllocator::Stat& to) {
    to.current = from.current;
    to.peak = from.peak;
    to.allocated = from.allocated;
    to.freed = from.freed;
}

void copy_stats(const ferrocache_stat (&from)[3], c10::CachingAllocator::StatArray& to) {
    for (size_t i = 0; i < 3; ++i) {
        copy_stat(from[i], to[i]);
    }
}

// A capture's stream filter, asked from Rust: 1 yes, 0 no, -1 it threw.
using StreamFilter = std::function<bool(cudaStream_t)>;
thread_local std::string filter_failure;

int filter_accepts(const void* filter, cudaStream_t stream, const char** error) noexcept {
    try {
        return (*static_cast<const StreamFilter*>(filter))(stream) ? 1 : 0;
    } catch (const std::exception& e) {
        filter_failure = e.what();
    } catch (...) {
        filter_failure = "an exception that is not a std::exception";
    }
    *error = filter_failure.c_str();
    return -1;
}

void filter_drop(void* filter) noexcept { delete static_cast<StreamFilter*>(filter); }

// A MemPool's own allocator (MemPool(allocator=...): NCCL's pool, symmetric memory's), kept alive
// by the core for as long as the pool and called from Rust: nothing may unwind through it. What
// an exception said goes back in *error; the core decides what it means (out of memory for an
// allocation, the segment kept for a give-back).
using PoolAllocator = std::shared_ptr<alloc::CUDAAllocator>;
thread_local std::string pool_allocator_failure;

const char* pool_allocator_failed(const std::exception* e) noexcept {
    try {
        pool_allocator_failure =
            e != nullptr ? e->what() : "an exception that is not a std::exception";
    } catch (...) {
        return "an exception (its message could not be kept: out of host memory)";
    }
    return pool_allocator_failure.c_str();
}

void* pool_alloc(void* context, size_t size, const char** error) noexcept {
    try {
        auto& allocator = *static_cast<PoolAllocator*>(context);
        // As PyTorch's allocPrimitive under a capture: the allocator may call cudaMalloc.
        if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
            return allocator->raw_alloc(size);
        }
        c10::cuda::CUDAStreamCaptureModeGuard relaxed{cudaStreamCaptureModeRelaxed};
        return allocator->raw_alloc(size);
    } catch (const std::exception& e) {
        *error = pool_allocator_failed(&e);
    } catch (...) {
        *error = pool_allocator_failed(nullptr);
    }
    return nullptr;
}

int pool_free(void* context, void* ptr, const char** error) noexcept {
    try {
        (*static_cast<PoolAllocator*>(context))->raw_delete(ptr);
        return 0;
    } catch (const std::exception& e) {
        *error = pool_allocator_failed(&e);
    } catch (...) {
        *error = pool_allocator_failed(nullptr);
    }
    return -1;
}

void pool_release(void* context) noexcept { delete static_cast<PoolAllocator*>(context); }

// A snapshot's segments and blocks, as the core gives them, into PyTorch's SegmentInfo. The
// visitors are called from Rust: nothing may unwind through them (out of host memory is noted).
struct SnapshotSegments {
    std::vector<c10::CachingDeviceAllocator::SegmentInfo> segments;
    bool out_of_memory = false;
};

// SegmentInfo::registration_counter (NCCL's registerMemPool orders a pool's segments by it, and
// refuses one left at -1), where this PyTorch has it.
template <typename Segment>
void set_registration_counter(Segment& segment, uint64_t counter) {
    if constexpr (requires { segment.registration_counter; }) {
        segment.registration_counter =
            static_cast<decltype(segment.registration_counter)>(counter);
    }
}

void add_segment(void* context, const ferrocache_segment_info* from) noexcept {
    auto& taken = *static_cast<SnapshotSegments*>(context);
    try {
        c10::CachingDeviceAllocator::SegmentInfo segment;
        segment.device = static_cast<c10::DeviceIndex>(from->device);
        segment.address = from->address;
        segment.total_size = from->total_size;
        segment.requested_size = from->requested_size;
        segment.allocated_size = from->allocated_size;
        segment.active_size = from->active_size;
        segment.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(from->stream));
        segment.is_large = from->is_large != 0;
        segment.is_expandable = from->is_expandable != 0;
        segment.owner_private_pool_id = {from->pool_first, from->pool_second};
        set_registration_counter(segment, from->registration_counter);
        taken.segments.push_back(std::move(segment));
    } catch (...) {
        taken.out_of_memory = true;
    }
}

void add_block(void* context, const ferrocache_block_info* from) noexcept {
    auto& taken = *static_cast<SnapshotSegments*>(context);
    if (taken.segments.empty()) {
        return;  // its segment could not be kept
    }
    try {
        c10::CachingDeviceAllocator::BlockInfo block;
        block.size = from->size;
        block.requested_size = from->requested_size;
        block.allocated = from->allocated != 0;
        block.active = from->active != 0;
        taken.segments.back().blocks.push_back(std::move(block));
    } catch (...) {
        taken.out_of_memory = true;
    }
}

// PyTorch's out-of-memory observers, called by the core (with no allocator lock held).
std::mutex observers_lock;
std::vector<alloc::OutOfMemoryObserver> observers;

void notify_observers(int device, size_t alloc_size, size_t device_total,
                      size_t device_free) noexcept {
    std::vector<alloc::OutOfMemoryObserver> now;
    {
        std::lock_guard<std::mutex> guard(observers_lock);
        now = observers;
    }
    for (const auto& observer : now) {
        try {
            observer(device, alloc_size, device_total, device_free);
        } catch (...) {
            // The out-of-memory error that follows matters more than an observer's failure.
        }
    }
}

// PyTorch's allocator trace trackers (NCCL's register hook), called by the core for every trace
// entry with the device's lock held, as PyTorch calls them. The core numbers the actions as
// PyTorch's TraceEntry::Action does; a tracker's exception is handed back to the core (logged
// there), since it cannot pass through Rust.
static_assert(alloc::TraceEntry::ALLOC == 0 && alloc::TraceEntry::FREE_REQUESTED == 1 &&
                  alloc::TraceEntry::FREE_COMPLETED == 2 && alloc::TraceEntry::SEGMENT_ALLOC == 3 &&
                  alloc::TraceEntry::SEGMENT_FREE == 4 && alloc::TraceEntry::SEGMENT_MAP == 5 &&
                  alloc::TraceEntry::SEGMENT_UNMAP == 6 && alloc::TraceEntry::SNAPSHOT == 7 &&
                  alloc::TraceEntry::OOM == 8,
              "TraceEntry::Action is numbered as src/ffi/trace_tracker.rs sends it");
using Trackers = std::vector<alloc::AllocatorTraceTracker>;
std::mutex trackers_lock;
std::shared_ptr<const Trackers> trackers;  // replaced whole when one is attached
thread_local std::string tracker_failure;

int send_trace_event(const ferrocache_trace_event* event, const char** error) noexcept {
    try {
        std::shared_ptr<const Trackers> now;
        {
            std::lock_guard<std::mutex> guard(trackers_lock);
            now = trackers;
        }
        if (now == nullptr) {
            return 0;
        }
        alloc::TraceEntry entry(static_cast<alloc::TraceEntry::Action>(event->action),
                                static_cast<c10::DeviceIndex>(event->device), event->addr,
                                event->size, event->stream, {event->pool_first, event->pool_second},
                                c10::getApproximateTime());
        for (const auto& tracker : *now) {
            tracker(entry);
        }
        return 0;
    } catch (const c10::Error& e) {
        tracker_failure = e.what_without_backtrace();
    } catch (const std::exception& e) {
        tracker_failure = e.what();
    } catch (...) {
        tracker_failure = "an exception that is not a std::exception";
    }
    *error = tracker_failure.c_str();
    return -1;
}

// PyTorch's free-memory callbacks (c10::FreeCudaMemoryCallbacksRegistry; libtorch_python
// registers "cuda_ipc_collect", which frees the CUDA IPC limbo's blocks whose receivers let go),
// run as PyTorch's trigger_free_memory_callbacks runs them. The core calls this when the first
// search of the cache misses, with no allocator lock held, so the frees they make come back to
// ferrocache as any free does (src/ffi/free_memory.rs). An exception is handed back (the core
// logs it, and searches again).
thread_local std::string callbacks_failure;

int run_free_memory_callbacks(const char** error) noexcept {
    try {
        bool freed = false;
        for (const auto& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys()) {
            freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
        }
        return freed ? 1 : 0;
    } catch (const c10::Error& e) {
        callbacks_failure = e.what_without_backtrace();
    } catch (const std::exception& e) {
        callbacks_failure = e.what();
    } catch (...) {
        callbacks_failure = "an exception that is not a std::exception";
    }
    *error = callbacks_failure.c_str();
    return -1;
}

class FerrocacheAllocator final : public alloc::CUDAAllocator {
   public:
    void* malloc(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
        const char* error = nullptr;
        ferrocache_oom_thrower thrower = nullptr;
        void* ptr = ferrocache_frontend_malloc(size, device, stream, &error, &thrower);
        if (C10_UNLIKELY(error != nullptr)) {
            if (thrower != nullptr) {
                thrower(error);  // throws c10::OutOfMemoryError
            }
            TORCH_CHECK(false, error);
        }
        return ptr;
    }

    c10::DataPtr allocate(size_t size) override {
        c10::DeviceIndex device = current_device();
        void* ptr = malloc(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
        return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
    }

    c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

    void copy_data(void* dest, const void* src, std::size_t count) const override {
        C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
    }

    void* raw_alloc(size_t nbytes) override {
        c10::DeviceIndex device = current_device();
        return malloc(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
    }

    void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
        return malloc(nbytes, current_device(), stream);
    }

    void raw_delete(void* ptr) override { check(ferrocache_free(ptr), "raw_delete"); }

    void init(int device_count) override {
        rust_init(device_count);
        initialized_.store(true);
    }

    // PyTorch's rule for changeCurrentAllocator: once CUDA was initialised with this allocator
    // (init), memory may have been handed out, and no other allocator may take over.
    bool initialized() override { return initialized_.load(); }

    double getMemoryFraction(c10::DeviceIndex device) override {
        double fraction = ferrocache_get_memory_fraction(device);
        if (fraction < 0) {
            fail("getMemoryFraction");
        }
        return fraction;
    }

    void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
        check(ferrocache_set_memory_fraction(fraction, device), "setMemoryFraction");
    }

    std::vector<alloc::StreamSegmentSize> getExpandableSegmentSizes(
        c10::DeviceIndex device) override {
        std::vector<ferrocache_stream_segment_size> taken(8);
        int64_t count = 0;
        while ((count = ferrocache_expandable_segment_sizes(device, taken.data(), taken.size())) >
               static_cast<int64_t>(taken.size())) {
            taken.resize(static_cast<size_t>(count));
        }
        if (count < 0) {
            fail("getExpandableSegmentSizes");
        }
        std::vector<alloc::StreamSegmentSize> sizes;
        for (int64_t i = 0; i < count; ++i) {
            sizes.emplace_back(taken[i].stream, taken[i].is_small_pool != 0, taken[i].total_size);
        }
        return sizes;
    }

    void emptyCache(MempoolId mempool_id) override {
        if (mempool_id.first == 0 && mempool_id.second == 0) {
            // PyTorch asks each device's current stream whether it captures (is_capture_context).
            std::vector<cudaStream_t> current;
            for (int device = 0; device < c10::cuda::device_count(); ++device) {
                current.push_back(c10::cuda::getCurrentCUDAStream(device).stream());
            }
            check(ferrocache_empty_cache_with_current_streams(current.data(),
                                                              static_cast<int>(current.size())),
                  "emptyCache");
            return;
        }
        for (int device = 0; device < c10::cuda::device_count(); ++device) {
            check(ferrocache_empty_pool_cache(device, mempool_id.first, mempool_id.second),
                  "emptyCache");
        }
    }

    void enable(bool value) override { (void)ferrocache_set_caching_enabled(value ? 1 : 0); }

    bool isEnabled() const override { return ferrocache_caching_enabled() != 0; }

    void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override {
        check(ferrocache_cache_info(device, largestBlock), "cacheInfo");
    }

    void* getBaseAllocation(void* ptr, size_t* size) override { return rust_base_alloc(ptr, size); }

    void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
        // As PyTorch's allocator: memory it did not hand out is not its business.
        if (ptr.get() == nullptr || ptr.get_deleter() != &delete_block) {
            return;
        }
        rust_record_stream(ptr.get(), stream.stream());
    }

    DeviceStats getDeviceStats(c10::DeviceIndex device) override {
        struct ferrocache_device_stats from {};
        check(ferrocache_read_device_stats(device, &from), "getDeviceStats");
        DeviceStats stats;
        copy_stats(from.allocation, stats.allocation);
        copy_stats(from.segment, stats.segment);
        copy_stats(from.active, stats.active);
        copy_stats(from.inactive_split, stats.inactive_split);
        copy_stats(from.allocated_bytes, stats.allocated_bytes);
        copy_stats(from.reserved_bytes, stats.reserved_bytes);
        copy_stats(from.active_bytes, stats.active_bytes);
        copy_stats(from.inactive_split_bytes, stats.inactive_split_bytes);
        copy_stats(from.requested_bytes, stats.requested_bytes);
        stats.num_alloc_retries = from.num_alloc_retries;
        stats.num_ooms = from.num_ooms;
        copy_stat(from.oversize_allocations, stats.oversize_allocations);
        copy_stat(from.oversize_segments, stats.oversize_segments);
        stats.num_sync_all_streams = from.num_sync_all_streams;
        stats.num_device_alloc = from.num_device_alloc;
        stats.num_device_free = from.num_device_free;
#if FERROCACHE_TORCH_AT_LEAST(2, 15)
        stats.num_oom_rejections = from.num_oom_rejections;
#endif
        stats.max_split_size = from.max_split_size;
        return stats;
    }

    void resetAccumulatedStats(c10::DeviceIndex device) override {
        check(ferrocache_reset_accumulated_stats(device), "resetAccumulatedStats");
    }

    void resetPeakStats(c10::DeviceIndex device) override {
        check(ferrocache_reset_peak_stats(device), "resetPeakStats");
    }

    // The segments and blocks; the trace entries reach Python through
    // torch.cuda.memory._snapshot(), which ferrocache answers there.
    alloc::SnapshotInfo snapshot(MempoolId mempool_id, bool /*include_traces*/) override {
        alloc::SnapshotInfo info;
        SnapshotSegments taken;
        check(ferrocache_snapshot_segments(mempool_id.first, mempool_id.second, &taken,
                                           &add_segment, &add_block),
              "snapshot");
        if (taken.out_of_memory) {
            throw std::bad_alloc();
        }
        info.segments = std::move(taken.segments);
        info.device_traces.resize(c10::cuda::device_count());
        return info;
    }

    void beginAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id,
                             std::function<bool(cudaStream_t)> filter) override {
        StreamFilter* kept = new (std::nothrow) StreamFilter(std::move(filter));
        const char* refused = ferrocache_frontend_begin_allocate_to_pool(
            device, mempool_id.first, mempool_id.second, kept, &filter_accepts, &filter_drop);
        TORCH_CHECK(refused == nullptr, refused);
    }

    void endAllocateToPool(c10::DeviceIndex device, MempoolId mempool_id) override {
        check(ferrocache_end_allocate_to_pool(device, mempool_id.first, mempool_id.second),
              "endAllocateToPool");
    }

    void releasePool(c10::DeviceIndex device, MempoolId mempool_id) override {
        // MemPool's destructor calls it: a warning, never an exception out of a destructor.
        if (ferrocache_release_pool(device, mempool_id.first, mempool_id.second) < 0) {
            TORCH_WARN("ferrocache: releasePool: ", ferrocache_last_error());
        }
    }

    int getPoolUseCount(c10::DeviceIndex device, MempoolId mempool_id) override {
        int count = ferrocache_pool_use_count(device, mempool_id.first, mempool_id.second);
        check(count, "getPoolUseCount");
        return count;
    }

    void createOrIncrefPool(c10::DeviceIndex device, MempoolId mempool_id,
                            std::shared_ptr<alloc::CUDAAllocator> allocator) override {
        if (allocator == nullptr || allocator.get() == this) {
            check(ferrocache_create_or_incref_pool(device, mempool_id.first, mempool_id.second),
                  "createOrIncrefPool");
            return;
        }
        // The pool's segments come from its own allocator; the core owns the copy from here on.
        auto* kept = new PoolAllocator(std::move(allocator));
        check(ferrocache_create_pool_with_allocator(device, mempool_id.first, mempool_id.second,
                                                    kept, &pool_alloc, &pool_free, &pool_release),
              "createOrIncrefPool");
    }

    void setUseOnOOM(c10::DeviceIndex device, MempoolId mempool_id, bool use_on_oom) override {
        check(ferrocache_set_pool_use_on_oom(device, mempool_id.first, mempool_id.second,
                                             use_on_oom ? 1 : 0),
              "setUseOnOOM");
    }

    void setNoSplit(c10::DeviceIndex device, MempoolId mempool_id) override {
        check(ferrocache_set_pool_no_split(device, mempool_id.first, mempool_id.second),
              "setNoSplit");
    }

    bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId mempool_id,
                                  const std::unordered_set<void*>& expected) override {
        std::vector<void*> pointers(expected.begin(), expected.end());
        int answer = ferrocache_check_pool_live_allocations(
            device, mempool_id.first, mempool_id.second, pointers.data(), pointers.size());
        check(answer, "checkPoolLiveAllocations");
        return answer == 1;
    }

    // PyTorch's SHAREABLE_HANDLE_VERSION: 3 from 2.13 on (its expandable header names the
    // handle type), 2 before.
    static constexpr int kShareableHandleVersion = FERROCACHE_TORCH_AT_LEAST(2, 13) ? 3 : 2;

    // The bytes ferrocache_ipc_share made, given back however the method ends.
    struct SharedBytes {
        uint8_t* bytes;
        size_t len;
        ~SharedBytes() { ferrocache_ipc_bytes_free(bytes, len); }
    };

    alloc::ShareableHandle shareIpcHandle(void* ptr) override {
        size_t len = 0;
        int64_t offset = 0;
        uint8_t* bytes = ferrocache_ipc_share(ptr, kShareableHandleVersion, &len, &offset);
        if (bytes == nullptr) {
            fail("shareIpcHandle");
        }
        SharedBytes kept{bytes, len};
        return {static_cast<ptrdiff_t>(offset), std::string(reinterpret_cast<char*>(bytes), len)};
    }

    // The mapping lives as long as the returned pointer: its deleter is the Rust close (which
    // logs a failure; a deleter must not throw). Should the shared_ptr fail to allocate, it
    // calls the deleter itself.
    std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
        uint64_t token = 0;
        void* ptr = ferrocache_ipc_open(reinterpret_cast<const uint8_t*>(handle.data()),
                                        handle.size(), current_device(), &token);
        if (ptr == nullptr) {
            fail("getIpcDevPtr");
        }
        return std::shared_ptr<void>(ptr, [token](void*) { (void)ferrocache_ipc_close(token); });
    }

    bool isHistoryEnabled() override { return ferrocache_history_enabled() != 0; }

    void recordHistory(bool enabled, alloc::CreateContextFn /*context_recorder*/,
                       size_t alloc_trace_max_entries, alloc::RecordContext /*when*/,
                       bool /*clearHistory*/,
                       const std::vector<std::string>& /*skip_actions*/) override {
        // Stacks come from the Python package's gatherer (ferrocache.snapshot).
        check(ferrocache_record_history(enabled ? 1 : 0, alloc_trace_max_entries),
              "recordHistory");
    }

#if FERROCACHE_TORCH_AT_LEAST(2, 15)
    bool supportsUserMetadata() override { return true; }
#endif

    void setUserMetadata(const std::string& metadata) override {
        check(ferrocache_set_memory_metadata(metadata.c_str()), "setUserMetadata");
    }

    std::string getUserMetadata() override {
        char* metadata = ferrocache_get_memory_metadata();
        if (metadata == nullptr) {
            fail("getUserMetadata");
        }
        std::string answer(metadata);
        ferrocache_string_free(metadata);
        return answer;
    }

    void attachOutOfMemoryObserver(alloc::OutOfMemoryObserver observer) override {
        std::lock_guard<std::mutex> guard(observers_lock);
        if (observers.empty()) {
            check(ferrocache_attach_oom_observer(&notify_observers), "attachOutOfMemoryObserver");
        }
        observers.push_back(std::move(observer));
    }

#if FERROCACHE_TORCH_AT_LEAST(2, 15)
    // ferrocache never refuses an allocation in advance (throw_on_cudamalloc_oom is ignored),
    // so such an observer is never called.
    void attachOomRejectionObserver(alloc::OomRejectionObserver /*observer*/) override {}

#endif

    // Every trace entry from now on goes to `tracker` too (src/ffi/trace_tracker.rs).
    void attachAllocatorTraceTracker(alloc::AllocatorTraceTracker tracker) override {
        bool first = false;
        {
            std::lock_guard<std::mutex> guard(trackers_lock);
            auto more = std::make_shared<Trackers>(trackers ? *trackers : Trackers{});
            more->push_back(std::move(tracker));
            first = trackers == nullptr;
            trackers = std::move(more);
        }
        if (first) {  // not under trackers_lock: the core takes the devices' locks
            check(ferrocache_attach_trace_tracker(&send_trace_event), "attachAllocatorTraceTracker");
        }
    }

    void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
        c10::cuda::CUDAGuard device_guard(dev);
        cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
            (void)cudaGetLastError();  // already enabled is no error
        } else {
            C10_CUDA_CHECK(err);
        }
    }

    cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                            cudaStream_t stream, bool p2p_enabled) override {
        // ferrocache's memory comes from cuMemAlloc or cuMemMap; without peer access, a copy
        // between devices must be the peer kind (PyTorch's rule for its own allocator).
        if (p2p_enabled || dstDevice == srcDevice) {
            return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
        }
        return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
    }

    // A private pool's checkpoint (getCheckpointState), as PyTorch keeps it: the C++ object
    // owns the core's checkpoint and gives it back when the graph tree lets it go.
    class Checkpoint final : public alloc::AllocatorState {
       public:
        explicit Checkpoint(ferrocache_checkpoint* taken) : taken_(taken) {}
        ~Checkpoint() override { ferrocache_checkpoint_free(taken_); }
        Checkpoint(const Checkpoint&) = delete;
        Checkpoint& operator=(const Checkpoint&) = delete;
        const ferrocache_checkpoint* taken() const { return taken_; }

       private:
        ferrocache_checkpoint* taken_;
    };

    std::shared_ptr<alloc::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                              MempoolId id) override {
        ferrocache_checkpoint* taken = ferrocache_checkpoint_pool(device, id.first, id.second);
        if (taken == nullptr) {
            fail("getCheckpointState");
        }
        try {
            return std::make_shared<Checkpoint>(taken);
        } catch (...) {
            ferrocache_checkpoint_free(taken);
            throw;
        }
    }

    // The freed pointers as they are; the re-allocated blocks as DataPtrs with this object's
    // deleter, so that their later free comes back here.
    alloc::CheckpointDelta setCheckpointPoolState(
        c10::DeviceIndex device, std::shared_ptr<alloc::AllocatorState> pps) override {
        auto checkpoint = std::dynamic_pointer_cast<Checkpoint>(pps);
        TORCH_CHECK(checkpoint != nullptr, "setCheckpointPoolState: not a checkpoint that "
                                           "ferrocache's getCheckpointState made");
        ferrocache_checkpoint_delta restored{};
        check(ferrocache_restore_pool_checkpoint(device, checkpoint->taken(), &restored),
              "setCheckpointPoolState");
        std::unique_ptr<ferrocache_checkpoint_delta, void (*)(ferrocache_checkpoint_delta*)>
            owned(&restored, &ferrocache_checkpoint_delta_free);
        alloc::CheckpointDelta delta;
        delta.ptrs_freed.assign(restored.freed, restored.freed + restored.freed_count);
        for (size_t i = 0; i < restored.allocated_count; ++i) {
            void* ptr = restored.allocated[i];
            delta.dataptrs_allocd.emplace_back(ptr, ptr, &delete_block,
                                               c10::Device(c10::DeviceType::CUDA, device));
        }
        return delta;
    }

    std::string name() override { return "ferrocache"; }

   private:
    std::atomic<bool> initialized_{false};
};

thread_local std::string install_failure;

}  // namespace

// Makes a FerrocacheAllocator PyTorch's CUDA allocator, with PyTorch's free-memory callbacks
// run on a cache miss. Returns NULL, or why PyTorch refused (valid until the next call on this
// thread): "Can't swap an already initialized allocator" once CUDA was initialised; the
// callbacks are then withdrawn (CUDAPluggableAllocator's path runs none). Never throws.
extern "C" __attribute__((visibility("default"))) const char* ferrocache_frontend_install() {
    if (ferrocache_set_free_memory_callbacks(&run_free_memory_callbacks) < 0) {
        install_failure = ferrocache_last_error();
        return install_failure.c_str();
    }
    try {
        auto allocator = std::make_shared<FerrocacheAllocator>();
        torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
        return nullptr;
    } catch (const c10::Error& e) {
        install_failure = e.what_without_backtrace();
    } catch (const std::exception& e) {
        install_failure = e.what();
    } catch (...) {
        install_failure = "an exception that is not a std::exception";
    }
    (void)ferrocache_set_free_memory_callbacks(nullptr);
    return install_failure.c_str();
}

// Whether PyTorch's current CUDA allocator is ferrocache's front end (its name()). Never throws.
extern "C" __attribute__((visibility("default"))) int ferrocache_frontend_installed() {
    try {
        auto* current = alloc::get();
        return current != nullptr && dynamic_cast<FerrocacheAllocator*>(current) != nullptr;
    } catch (...) {
        return 0;
    }
}
