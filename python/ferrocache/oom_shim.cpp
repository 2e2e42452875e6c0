// ferrocache's out-of-memory shim, built by ferrocache.torch_api against the installed PyTorch's
// headers and libc10 (never shipped prebuilt: c10::Error's layout is PyTorch's, per version).
// PyTorch raises a C++ c10::OutOfMemoryError as torch.OutOfMemoryError; rust_malloc
// (src/oom.cpp) calls this when the Rust allocator says the allocation failed for lack of
// memory. The message is the allocator's, unchanged.
//
// It also answers ferrocache's question for expandable_segments_reserve_by_class: the reserve
// class that C++ code gave a stream with PyTorch 2.15's setExpandableSegmentReserveClassForStream
// (PyTorch keeps it; it does not tell a plugged-in allocator).
#include <c10/util/Exception.h>

#include <string>

struct CUstream_st;

namespace c10::cuda::CUDACachingAllocator {
// PyTorch 2.15's, in libc10_cuda.so (its header needs CUDA's headers, which the wheel lacks).
// Weak: with an older PyTorch it is null, and every stream is untagged.
__attribute__((weak)) std::string getExpandableSegmentReserveClassForStream(CUstream_st* stream);
}  // namespace c10::cuda::CUDACachingAllocator

extern "C" __attribute__((visibility("default"))) void ferrocache_throw_oom(const char* message) {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__},
                                std::string(message));
}

// The reserve class of `stream`, valid until the next call on this thread; "" when it has none
// or this PyTorch has no reserve classes. Never throws.
extern "C" __attribute__((visibility("default"))) const char* ferrocache_stream_reserve_class(
    CUstream_st* stream) {
    thread_local std::string answer;
    answer.clear();
    if (&c10::cuda::CUDACachingAllocator::getExpandableSegmentReserveClassForStream != nullptr) {
        try {
            answer = c10::cuda::CUDACachingAllocator::getExpandableSegmentReserveClassForStream(
                stream);
        } catch (...) {
            answer.clear();
        }
    }
    return answer.c_str();
}
