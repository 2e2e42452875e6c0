// rust_malloc, the allocation function PyTorch's CUDAPluggableAllocator calls.
//
// PyTorch does not check the pointer it gets back: a NULL would become a tensor at address 0 and
// a crash later. So a failed allocation must be a C++ exception, which PyTorch turns into a
// Python exception carrying the message. Rust cannot throw one, hence these few lines. Every
// decision (what failed, the message, which exception) is made in Rust, in
// ferrocache_internal_malloc: for an out of memory it may hand back a thrower registered by the
// Python package (a shim built against PyTorch's libc10 that throws c10::OutOfMemoryError, which
// PyTorch raises as torch.OutOfMemoryError); otherwise std::runtime_error (a RuntimeError).

#include <cstddef>
#include <stdexcept>

extern "C" {

using ferrocache_oom_thrower = void (*)(const char* message);

// src/ffi/entry.rs. Returns the pointer with *error = NULL, or NULL with *error = the reason (valid
// until the next ferrocache call on this thread) and *thrower = what to throw it with (or NULL).
// Size 0 gives NULL with no error.
void* ferrocache_internal_malloc(std::size_t size, int device, void* stream, const char** error,
                                 ferrocache_oom_thrower* thrower);

__attribute__((visibility("default"))) void* rust_malloc(std::size_t size, int device,
                                                         void* stream) {
    const char* error = nullptr;
    ferrocache_oom_thrower thrower = nullptr;
    void* ptr = ferrocache_internal_malloc(size, device, stream, &error, &thrower);
    if (error != nullptr) {
        if (thrower != nullptr) {
            thrower(error);  // throws; returning means it could not
        }
        // std::runtime_error copies the message before anything else can overwrite it.
        throw std::runtime_error(error);
    }
    return ptr;
}

}  // extern "C"
