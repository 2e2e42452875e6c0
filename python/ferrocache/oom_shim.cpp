// ferrocache's out-of-memory shim, built by ferrocache.torch_api against the installed PyTorch's
// headers and libc10 (never shipped prebuilt: c10::Error's layout is PyTorch's, per version).
// PyTorch raises a C++ c10::OutOfMemoryError as torch.OutOfMemoryError; rust_malloc
// (src/oom.cpp) calls this when the Rust allocator says the allocation failed for lack of
// memory. The message is the allocator's, unchanged.
#include <c10/util/Exception.h>

#include <string>

extern "C" __attribute__((visibility("default"))) void ferrocache_throw_oom(const char* message) {
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__},
                                std::string(message));
}
