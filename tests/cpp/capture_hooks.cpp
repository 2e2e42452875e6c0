// What PyTorch's CUDAGraph does with a plugged-in allocator's pool hooks
// (torch/csrc/cuda/CUDAGraph.cpp), for tests that have no PyTorch: capture_begin calls the
// begin hook with the graph's pool and a std::function filter that asks the driver whether a
// stream belongs to this capture (AT_CUDA_CHECK throws when that query fails); capture_end
// calls the end hook, reset the release hook. Rust cannot make a std::function, hence this file;
// the hooks are called through the addresses the test looked up in libferrocache.so, with
// PyTorch's exact types.

#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

namespace {

using MempoolId = std::pair<unsigned long long, unsigned long long>;
using BeginHook = void (*)(int, MempoolId, std::function<bool(cudaStream_t)>);
using PoolHook = void (*)(int, MempoolId);
// The fake driver's cuStreamGetCaptureInfo(stream, *status, *id).
using CaptureInfo = unsigned (*)(cudaStream_t, unsigned*, unsigned long long*);
constexpr unsigned kCaptureStatusActive = 1;

thread_local std::string begin_failure;

}  // namespace

// capture_begin: the begin hook with the filter of PyTorch's graphs. `capture_id` is read when
// the filter runs (PyTorch learns the id after the hook, from cudaStreamGetCaptureInfo). Returns
// NULL, or what the hook threw.
extern "C" const char* capture_hooks_begin(void* hook, int device, unsigned long long pool_first,
                                           unsigned long long pool_second, void* capture_info,
                                           const unsigned long long* capture_id) {
    auto info = reinterpret_cast<CaptureInfo>(capture_info);
    try {
        reinterpret_cast<BeginHook>(hook)(
            device, {pool_first, pool_second}, [info, capture_id](cudaStream_t stream) {
                unsigned status = 0;
                unsigned long long id = 0;
                unsigned result = info(stream, &status, &id);
                if (result != 0) {
                    throw std::runtime_error("CUDA error: cudaStreamGetCaptureInfo failed (" +
                                             std::to_string(result) + ")");
                }
                return status == kCaptureStatusActive && id == *capture_id;
            });
        return nullptr;
    } catch (const std::exception& e) {
        begin_failure = e.what();
    } catch (...) {
        begin_failure = "an exception that is not a std::exception";
    }
    return begin_failure.c_str();
}

// capture_end and reset: the end or the release hook.
extern "C" void capture_hooks_pool_call(void* hook, int device, unsigned long long pool_first,
                                        unsigned long long pool_second) {
    reinterpret_cast<PoolHook>(hook)(device, {pool_first, pool_second});
}
