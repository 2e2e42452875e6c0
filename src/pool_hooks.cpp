// The CUDA graph pool hooks of PyTorch's CUDAPluggableAllocator, with the C++ types that
// torch/csrc/cuda/Module.cpp casts the hook addresses to:
//
//   set_begin_allocate_to_pool   void(int, c10::cuda::MempoolId_t, std::function<bool(cudaStream_t)>)
//   set_end_allocate_to_pool_fn  void(int, c10::cuda::MempoolId_t)
//   set_release_pool             void(int, c10::cuda::MempoolId_t)
//
// where MempoolId_t is std::pair<unsigned long long, unsigned long long>. Rust cannot take a
// std::function, call one, or throw, hence these few lines. Every decision (which pool, what a
// refusal says, what a failing filter means) is made in Rust, in src/ffi/pools.rs.

#include <exception>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

namespace {

using MempoolId = std::pair<unsigned long long, unsigned long long>;
// The CUDA runtime's cudaStream_t, without its headers: the filter's type must be exactly
// PyTorch's std::function<bool(cudaStream_t)>.
using StreamFilter = std::function<bool(cudaStream_t)>;

// What the last failed filter call said, per thread: the pointer handed to Rust stays valid
// until this thread's next call.
thread_local std::string filter_failure;

}  // namespace

extern "C" {

// Asks a capture's filter whether `stream` belongs to the capture: 1 yes, 0 no, -1 when the
// filter threw (PyTorch's filter calls cudaStreamGetCaptureInfo, which may fail), with `*error`
// pointing at what it said.
static int ferrocache_filter_accepts(const void* filter, cudaStream_t stream, const char** error) {
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

// Destroys a filter that ferrocache_internal_begin_allocate_to_pool was given.
static void ferrocache_filter_drop(void* filter) { delete static_cast<StreamFilter*>(filter); }

// src/ffi/pools.rs. `filter` (owned by Rust from here on, NULL when it could not be copied) is asked
// through `accepts` and destroyed through `drop`. Returns NULL, or why the capture is refused.
const char* ferrocache_internal_begin_allocate_to_pool(
    int device, unsigned long long pool_first, unsigned long long pool_second, void* filter,
    int (*accepts)(const void*, cudaStream_t, const char**), void (*drop)(void*));
void ferrocache_internal_end_allocate_to_pool(int device, unsigned long long pool_first,
                                              unsigned long long pool_second);
void ferrocache_internal_release_pool(int device, unsigned long long pool_first,
                                      unsigned long long pool_second);

__attribute__((visibility("default"))) void rust_begin_allocate_to_pool(
    int device, MempoolId pool, std::function<bool(cudaStream_t)> filter) {
    StreamFilter* kept = new (std::nothrow) StreamFilter(std::move(filter));
    const char* refused = ferrocache_internal_begin_allocate_to_pool(
        device, pool.first, pool.second, kept, &ferrocache_filter_accepts, &ferrocache_filter_drop);
    if (refused != nullptr) {
        // A capture that ferrocache cannot serve from its pool must not start: its memory
        // would land in the ordinary pools.
        throw std::runtime_error(refused);
    }
}

__attribute__((visibility("default"))) void rust_end_allocate_to_pool(int device, MempoolId pool) {
    ferrocache_internal_end_allocate_to_pool(device, pool.first, pool.second);
}

__attribute__((visibility("default"))) void rust_release_pool(int device, MempoolId pool) {
    ferrocache_internal_release_pool(device, pool.first, pool.second);
}

}  // extern "C"
