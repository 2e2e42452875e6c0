// The C++ half of benches/torch_alloc.py: allocation pairs through PyTorch's own C++ entry points,
// c10::cuda::CUDACachingAllocator::raw_alloc_with_stream / raw_delete, whichever allocator the
// process made current (PyTorch's native one, or a CUDAPluggableAllocator). Also the same pairs
// through a pluggable allocator's two C functions called directly, which leaves out PyTorch's
// wrapper, and a do-nothing allocator (floor_malloc / floor_free) that measures the wrapper
// alone. Built by torch_alloc.py against the installed torch's headers and libc10/libc10_cuda;
// loaded with ctypes. Times come back in nanoseconds per pair: the median of chunks of pairs, so
// that a chunk the scheduler interrupted on a shared machine does not count.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

namespace torch_allocator = c10::cuda::CUDACachingAllocator;

using PluggableMalloc = void* (*)(size_t size, int device, cudaStream_t stream);
using PluggableFree = void (*)(void* ptr, size_t size, int device, cudaStream_t stream);

// Runs `pair` chunks * chunk_pairs times and returns the median chunk's nanoseconds per pair.
template <typename Pair>
double median_chunk_ns(size_t chunks, size_t chunk_pairs, Pair pair) {
    std::vector<double> per_pair;
    per_pair.reserve(chunks);
    for (size_t chunk = 0; chunk < chunks; ++chunk) {
        auto began = std::chrono::steady_clock::now();
        for (size_t i = 0; i < chunk_pairs; ++i) {
            pair();
        }
        std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - began;
        per_pair.push_back(took.count() / static_cast<double>(chunk_pairs));
    }
    std::sort(per_pair.begin(), per_pair.end());
    return per_pair.empty() ? 0.0 : per_pair[per_pair.size() / 2];
}

// Blocks held live through PyTorch's allocator between calls from Python.
std::vector<void*> torch_live;

// Compilers must not drop a pair whose pointer nobody reads.
void keep(void* ptr) { asm volatile("" : : "r"(ptr) : "memory"); }

// The do-nothing allocator's state: per power-of-two size class, a stack of freed addresses;
// fresh addresses come from one reservation nobody touches (the fake's tensors are never read
// in these benchmarks). Single-threaded, no lock: the cheapest pluggable allocator there can be,
// so that what it costs through PyTorch is PyTorch's wrapper.
constexpr int kFloorClasses = 64;
std::vector<void*> floor_free_lists[kFloorClasses];
char* floor_next = nullptr;
char* floor_end = nullptr;
constexpr size_t kFloorReservation = size_t{1} << 40;

int floor_class(size_t size) {
    return size <= 1 ? 0 : 64 - __builtin_clzll(static_cast<unsigned long long>(size - 1));
}

}  // namespace

extern "C" {

// Allocates `count` blocks of `bytes` on `stream` through PyTorch's allocator and keeps them.
// Returns 0, or -1 when PyTorch threw (the message is on stderr).
__attribute__((visibility("default"))) int torch_hold(size_t count, size_t bytes,
                                                      void* stream) {
    try {
        for (size_t i = 0; i < count; ++i) {
            torch_live.push_back(
                torch_allocator::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream)));
        }
        return 0;
    } catch (const c10::Error& err) {
        fprintf(stderr, "torch_hold: %s\n", err.what_without_backtrace());
        return -1;
    }
}

// Frees the held block at `index` (leaving a hole between its neighbours), or all of them when
// `index` is SIZE_MAX.
__attribute__((visibility("default"))) int torch_release(size_t index) {
    try {
        if (index == SIZE_MAX) {
            for (void* ptr : torch_live) {
                if (ptr != nullptr) {
                    torch_allocator::raw_delete(ptr);
                }
            }
            torch_live.clear();
        } else if (index < torch_live.size() && torch_live[index] != nullptr) {
            torch_allocator::raw_delete(torch_live[index]);
            torch_live[index] = nullptr;
        }
        return 0;
    } catch (const c10::Error& err) {
        fprintf(stderr, "torch_release: %s\n", err.what_without_backtrace());
        return -1;
    }
}

// Median ns per raw_alloc_with_stream + raw_delete pair of `bytes`, through whichever
// allocator PyTorch has current; -1 when PyTorch threw.
__attribute__((visibility("default"))) double torch_pairs_ns(size_t bytes, void* stream,
                                                             size_t chunks, size_t chunk_pairs) {
    auto cuda_stream = static_cast<cudaStream_t>(stream);
    try {
        return median_chunk_ns(chunks, chunk_pairs, [&] {
            void* ptr = torch_allocator::raw_alloc_with_stream(bytes, cuda_stream);
            keep(ptr);
            torch_allocator::raw_delete(ptr);
        });
    } catch (const c10::Error& err) {
        fprintf(stderr, "torch_pairs_ns: %s\n", err.what_without_backtrace());
        return -1.0;
    }
}

// Median ns per pair of a pluggable allocator's own functions called directly, as
// CUDAPluggableAllocator calls them but without its wrapper around them.
__attribute__((visibility("default"))) double direct_pairs_ns(PluggableMalloc alloc_fn,
                                                              PluggableFree free_fn, size_t bytes,
                                                              int device, void* stream,
                                                              size_t chunks, size_t chunk_pairs) {
    auto cuda_stream = static_cast<cudaStream_t>(stream);
    return median_chunk_ns(chunks, chunk_pairs, [&] {
        void* ptr = alloc_fn(bytes, device, cuda_stream);
        keep(ptr);
        free_fn(ptr, bytes, device, cuda_stream);
    });
}

// Median ns of c10::cuda::GetDevice, which both PyTorch's allocator and its pluggable wrapper
// call once per raw_alloc_with_stream (on the fake it is a thread-local read, as on CUDA).
__attribute__((visibility("default"))) double get_device_ns(size_t chunks, size_t chunk_pairs) {
    return median_chunk_ns(chunks, chunk_pairs, [] {
        c10::DeviceIndex device = -1;
        C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
        keep(&device);
    });
}

// The do-nothing pluggable allocator: O(1) malloc and free, no lock (see floor_free_lists).
__attribute__((visibility("default"))) void* floor_malloc(size_t size, int /*device*/,
                                                          cudaStream_t /*stream*/) {
    if (size == 0) {
        return nullptr;
    }
    int size_class = floor_class(size);
    std::vector<void*>& free_list = floor_free_lists[size_class];
    if (!free_list.empty()) {
        void* ptr = free_list.back();
        free_list.pop_back();
        return ptr;
    }
    if (floor_next == nullptr) {
        // Address space only: MAP_NORESERVE and never touched, so it costs no memory.
        void* base = mmap(nullptr, kFloorReservation, PROT_NONE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (base == MAP_FAILED) {
            return nullptr;
        }
        floor_next = static_cast<char*>(base);
        floor_end = floor_next + kFloorReservation;
    }
    size_t rounded = size_t{1} << size_class;
    size_t aligned = std::max<size_t>(rounded, 512);
    if (static_cast<size_t>(floor_end - floor_next) < aligned) {
        return nullptr;
    }
    void* ptr = floor_next;
    floor_next += aligned;
    // Enough room on each list that a pop and a push never reallocate in the timed loops.
    if (free_list.capacity() < 1024) {
        free_list.reserve(1 << 17);
    }
    return ptr;
}

__attribute__((visibility("default"))) void floor_free(void* ptr, size_t size, int /*device*/,
                                                       cudaStream_t /*stream*/) {
    if (ptr != nullptr) {
        floor_free_lists[floor_class(size)].push_back(ptr);
    }
}

}  // extern "C"
