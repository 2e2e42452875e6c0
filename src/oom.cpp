// rust_malloc, the allocation function PyTorch's CUDAPluggableAllocator calls.
//
// PyTorch does not check the pointer it gets back: a NULL would become a tensor at address 0 and
// a crash later. So a failed allocation must be a C++ exception, which PyTorch turns into a
// Python RuntimeError carrying the message. Rust cannot throw one, hence these few lines. Every
// decision (what failed, the message) is made in Rust, in ferrocache_internal_malloc.

#include <cstddef>
#include <stdexcept>

extern "C" {

// src/ffi.rs. Returns the pointer with *error = NULL, or NULL with *error = the reason (valid
// until the next ferrocache call on this thread). Size 0 gives NULL with no error.
void* ferrocache_internal_malloc(std::size_t size, int device, void* stream, const char** error);

__attribute__((visibility("default"))) void* rust_malloc(std::size_t size, int device,
                                                         void* stream) {
    const char* error = nullptr;
    void* ptr = ferrocache_internal_malloc(size, device, stream, &error);
    if (error != nullptr) {
        // std::runtime_error copies the message before anything else can overwrite it.
        throw std::runtime_error(error);
    }
    return ptr;
}

}  // extern "C"
