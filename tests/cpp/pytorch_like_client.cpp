// A client that uses libferrocache.so the way PyTorch's CUDAPluggableAllocator does: dlopen, then
// rust_malloc / rust_free (and the hooks) through function pointers, with C++ exceptions
// expected from rust_malloc on failure. tests/cpp_client.rs builds it with g++ and runs it
// against the fake libcuda (tests/fake-cuda/driver), once per scenario:
//
//   pytorch_like_client LIBRARY stress THREADS OPS   random allocations on several threads and
//                                                    streams; a pattern checked before each free
//   pytorch_like_client LIBRARY oom                  out of memory arrives as std::exception
//   pytorch_like_client LIBRARY driver-failure       another driver failure: std::exception too
//   pytorch_like_client LIBRARY no-driver            no libcuda: std::exception naming it
//   pytorch_like_client LIBRARY bad-config           invalid PYTORCH_CUDA_ALLOC_CONF: std::exception
//   pytorch_like_client LIBRARY bad-input            bad frees and wrong arguments: logged only
//   pytorch_like_client LIBRARY graph                CUDA graph captures through the pool hooks,
//                                                    called with PyTorch's C++ types
//
// It prints what it saw on stdout, and exits 0 when every check passed, 1 otherwise.

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// The CUDA runtime's stream type, as PyTorch's std::function<bool(cudaStream_t)> has it.
struct CUstream_st;
typedef CUstream_st* cudaStream_t;

namespace {

using Stream = void*;
using AllocFn = void* (*)(size_t, int, Stream);
using FreeFn = void (*)(void*, size_t, int, Stream);
using InitFn = void (*)(int);
using ResetFn = void (*)();
using RecordStreamFn = void (*)(void*, Stream);
using BaseAllocFn = void* (*)(void*, size_t*);
using StatsFn = char* (*)(int);
using StringFreeFn = void (*)(char*);
using SnapshotFn = char* (*)();
// torch/csrc/cuda/Module.cpp casts the pool hooks' addresses to exactly these types.
using MempoolId = std::pair<unsigned long long, unsigned long long>;
using BeginPoolFn = void (*)(int, MempoolId, std::function<bool(cudaStream_t)>);
using EndPoolFn = void (*)(int, MempoolId);
using ReleasePoolFn = void (*)(int, MempoolId);

std::atomic<int> failures{0};

void fail(const std::string& what) {
    std::printf("FAILED: %s\n", what.c_str());
    std::fflush(stdout);
    failures.fetch_add(1);
}

void check(bool ok, const std::string& what) {
    if (!ok) fail(what);
}

void* symbol(void* library, const char* name) {
    void* found = dlsym(library, name);
    if (found == nullptr) {
        std::printf("FAILED: %s is not exported: %s\n", name, dlerror());
        std::exit(1);
    }
    return found;
}

// The functions PyTorch is given, looked up as PyTorch looks them up.
struct Ferrocache {
    AllocFn alloc;
    FreeFn free;
    InitFn init;
    ResetFn reset;
    RecordStreamFn record_stream;
    BaseAllocFn base_alloc;
    StatsFn memory_stats;
    StringFreeFn string_free;
    SnapshotFn snapshot;
    BeginPoolFn begin_allocate_to_pool;
    EndPoolFn end_allocate_to_pool;
    ReleasePoolFn release_pool;

    explicit Ferrocache(const char* path) {
        void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (library == nullptr) {
            std::printf("FAILED: dlopen %s: %s\n", path, dlerror());
            std::exit(1);
        }
        alloc = reinterpret_cast<AllocFn>(symbol(library, "rust_malloc"));
        free = reinterpret_cast<FreeFn>(symbol(library, "rust_free"));
        init = reinterpret_cast<InitFn>(symbol(library, "rust_init"));
        reset = reinterpret_cast<ResetFn>(symbol(library, "rust_reset"));
        record_stream = reinterpret_cast<RecordStreamFn>(symbol(library, "rust_record_stream"));
        base_alloc = reinterpret_cast<BaseAllocFn>(symbol(library, "rust_base_alloc"));
        memory_stats = reinterpret_cast<StatsFn>(symbol(library, "ferrocache_memory_stats"));
        string_free = reinterpret_cast<StringFreeFn>(symbol(library, "ferrocache_string_free"));
        snapshot = reinterpret_cast<SnapshotFn>(symbol(library, "ferrocache_snapshot"));
        begin_allocate_to_pool =
            reinterpret_cast<BeginPoolFn>(symbol(library, "rust_begin_allocate_to_pool"));
        end_allocate_to_pool =
            reinterpret_cast<EndPoolFn>(symbol(library, "rust_end_allocate_to_pool"));
        release_pool = reinterpret_cast<ReleasePoolFn>(symbol(library, "rust_release_pool"));
    }

    // ferrocache_snapshot() as a string.
    std::string snapshot_json() const {
        char* json = snapshot();
        if (json == nullptr) {
            fail("ferrocache_snapshot() returned NULL");
            return "";
        }
        std::string text = json;
        string_free(json);
        return text;
    }

    // One figure of ferrocache_memory_stats(0), e.g. "allocated_bytes.all.current".
    long long stat(const char* key) const {
        char* json = memory_stats(0);
        if (json == nullptr) {
            fail("ferrocache_memory_stats(0) returned NULL");
            return -1;
        }
        std::string quoted = std::string("\"") + key + "\":";
        const char* at = std::strstr(json, quoted.c_str());
        long long value = at ? std::atoll(at + quoted.size()) : -1;
        if (at == nullptr) fail(std::string("no ") + key + " in " + json);
        string_free(json);
        return value;
    }
};

// The fake driver: streams to allocate on, and its counters.
struct FakeDriver {
    void* library;

    FakeDriver() {
        library = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
        if (library == nullptr) {
            std::printf("FAILED: dlopen libcuda.so (the fake): %s\n", dlerror());
            std::exit(1);
        }
        using CuInit = int (*)(unsigned);
        using CuRetain = int (*)(void**, int);
        using CuSetCurrent = int (*)(void*);
        void* context = nullptr;
        check(reinterpret_cast<CuInit>(symbol(library, "cuInit"))(0) == 0, "cuInit");
        check(reinterpret_cast<CuRetain>(symbol(library, "cuDevicePrimaryCtxRetain"))(&context, 0) == 0,
              "cuDevicePrimaryCtxRetain");
        check(reinterpret_cast<CuSetCurrent>(symbol(library, "cuCtxSetCurrent"))(context) == 0,
              "cuCtxSetCurrent");
    }

    Stream new_stream() const {
        using CuStreamCreate = int (*)(void**, unsigned);
        void* stream = nullptr;
        check(reinterpret_cast<CuStreamCreate>(symbol(library, "cuStreamCreate"))(&stream, 0) == 0,
              "cuStreamCreate");
        return stream;
    }

    // The next call of driver function `name` fails with `code`.
    void fail_next(const char* name, unsigned code) const {
        using FailFn = void (*)(const char*, unsigned);
        reinterpret_cast<FailFn>(symbol(library, "fake_cuda_fail_next"))(name, code);
    }

    long long stat(const char* name) const {
        using StatFn = long long (*)(const char*);
        return reinterpret_cast<StatFn>(symbol(library, "fake_cuda_stat"))(name);
    }
};

bool starts_with(const char* text, const char* prefix) {
    return std::strncmp(text, prefix, std::strlen(prefix)) == 0;
}

// ---------------------------------------------------------------------------------------------
// stress
// ---------------------------------------------------------------------------------------------

struct Live {
    unsigned char* ptr;
    size_t size;
    Stream stream;
    uint64_t tag;
};

// The tag every 256 bytes and in the last 8 (the strided copies stop short of those, so that
// none overwrites part of another). Two blocks that overlap share a 512-byte aligned stretch,
// so one of them finds the other's tag. Blocks under 8 bytes get the tag's first byte.
std::vector<size_t> pattern_offsets(size_t size) {
    std::vector<size_t> offsets;
    if (size < 8) return {0};
    for (size_t offset = 0; offset + 16 <= size; offset += 256) offsets.push_back(offset);
    offsets.push_back(size - 8);
    return offsets;
}

size_t pattern_width(size_t size) { return size < 8 ? 1 : 8; }

void write_pattern(const Live& block) {
    for (size_t offset : pattern_offsets(block.size))
        std::memcpy(block.ptr + offset, &block.tag, pattern_width(block.size));
}

// Where the pattern of `block` was overwritten, and by which tag; "" when it is intact.
std::string overwritten(const Live& block) {
    auto check_at = [&](size_t offset) -> std::string {
        uint64_t seen = 0;
        uint64_t expected = 0;
        std::memcpy(&seen, block.ptr + offset, pattern_width(block.size));
        std::memcpy(&expected, &block.tag, pattern_width(block.size));
        if (seen == expected) return "";
        char text[160];
        std::snprintf(text, sizeof text,
                      "block %p (%zu bytes) holds tag %#llx at offset %zu instead of %#llx",
                      static_cast<void*>(block.ptr), block.size,
                      static_cast<unsigned long long>(seen), offset,
                      static_cast<unsigned long long>(block.tag));
        return text;
    };
    for (size_t offset : pattern_offsets(block.size)) {
        std::string found = check_at(offset);
        if (!found.empty()) return found;
    }
    return "";
}

size_t random_size(std::mt19937_64& rng) {
    unsigned kind = rng() % 100;
    if (kind < 70) return 1 + rng() % (1 << 20);           // small pool
    if (kind < 97) return (1 << 20) + rng() % (9 << 20);   // large pool, shared 20 MiB segments
    return (10 << 20) + rng() % (22 << 20);                // segments of their own
}

void stress_thread(const Ferrocache& ferrocache, const std::vector<Stream>& streams, int thread,
                   int operations) {
    std::mt19937_64 rng(0x5eed + thread);
    std::vector<Live> live;
    uint64_t counter = 0;
    auto release = [&](size_t index) {
        Live block = live[index];
        live[index] = live.back();
        live.pop_back();
        std::string damage = overwritten(block);
        if (!damage.empty()) fail("thread " + std::to_string(thread) + ": " + damage);
        ferrocache.free(block.ptr, block.size, 0, block.stream);
    };
    for (int op = 0; op < operations; ++op) {
        bool allocate = live.empty() || (live.size() < 24 && rng() % 100 < 55);
        if (!allocate) {
            release(rng() % live.size());
            continue;
        }
        Live block;
        block.size = random_size(rng);
        block.stream = streams[rng() % streams.size()];
        block.tag = (uint64_t(thread) << 48) | ++counter;
        try {
            block.ptr = static_cast<unsigned char*>(ferrocache.alloc(block.size, 0, block.stream));
        } catch (const std::exception& e) {
            fail(std::string("an allocation threw: ") + e.what());
            return;
        }
        if (block.ptr == nullptr || reinterpret_cast<uintptr_t>(block.ptr) % 512 != 0) {
            fail("rust_malloc returned a NULL or misaligned pointer");
            return;
        }
        write_pattern(block);
        if (rng() % 10 == 0) {
            // Used on another stream too, as Tensor.record_stream says.
            ferrocache.record_stream(block.ptr, streams[rng() % streams.size()]);
        }
        live.push_back(block);
    }
    while (!live.empty()) release(live.size() - 1);
}

int stress(const Ferrocache& ferrocache, int threads, int operations) {
    FakeDriver driver;
    std::vector<Stream> streams = {nullptr, driver.new_stream(), driver.new_stream(),
                                   driver.new_stream()};
    ferrocache.init(1);
    std::vector<std::thread> workers;
    for (int thread = 0; thread < threads; ++thread) {
        workers.emplace_back(stress_thread, std::cref(ferrocache), std::cref(streams), thread,
                             operations);
    }
    for (auto& worker : workers) worker.join();

    check(ferrocache.stat("allocated_bytes.all.current") == 0, "bytes still allocated at the end");
    check(ferrocache.stat("num_ooms") == 0, "an out-of-memory happened");
    long long reserved = ferrocache.stat("reserved_bytes.all.current");
    check(reserved > 0, "nothing is cached before empty_cache");
    ferrocache.reset();
    check(ferrocache.stat("reserved_bytes.all.current") == 0, "empty_cache left segments");
    check(driver.stat("bytes_in_use") == 0, "the driver still holds memory after empty_cache");
    std::printf("stress: %d threads x %d operations, %lld bytes were cached before empty_cache\n",
                threads, operations, reserved);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// failures that must arrive as exceptions
// ---------------------------------------------------------------------------------------------

// Calls rust_malloc, which must throw; returns the message ("" when it did not throw).
std::string expect_throw(const Ferrocache& ferrocache, size_t size, int device = 0) {
    try {
        void* ptr = ferrocache.alloc(size, device, nullptr);
        fail("rust_malloc(" + std::to_string(size) + ") returned " +
             std::to_string(reinterpret_cast<uintptr_t>(ptr)) + " instead of throwing");
        return "";
    } catch (const std::exception& e) {
        std::printf("caught std::exception: %s\n", e.what());
        return e.what();
    }
}

// FAKE_LIBCUDA_TOTAL_MEM is 64 MiB.
int oom(const Ferrocache& ferrocache) {
    void* held = ferrocache.alloc(40 << 20, 0, nullptr);
    check(held != nullptr, "40 MiB of 64 should fit");
    std::string message = expect_throw(ferrocache, 40 << 20);
    check(starts_with(message.c_str(), "CUDA out of memory. Tried to allocate 40.00 MiB"),
          "the message is PyTorch's: " + message);
    message = expect_throw(ferrocache, size_t(1) << 40);
    check(starts_with(message.c_str(), "CUDA out of memory."), "a 1 TiB request: " + message);
    check(ferrocache.stat("num_ooms") == 2, "num_ooms counts both");
    // The allocator is still usable afterwards.
    ferrocache.free(held, 40 << 20, 0, nullptr);
    void* again = nullptr;
    try {
        again = ferrocache.alloc(40 << 20, 0, nullptr);
    } catch (const std::exception& e) {
        fail(std::string("40 MiB after freeing 40 MiB threw: ") + e.what());
    }
    check(again != nullptr, "40 MiB fit again after the free");
    ferrocache.free(again, 40 << 20, 0, nullptr);
    return 0;
}

// Any other driver failure is an exception too, with the driver's words.
int driver_failure(const Ferrocache& ferrocache) {
    FakeDriver driver;
    void* first = ferrocache.alloc(4096, 0, nullptr);  // opens the device
    driver.fail_next("cuMemAlloc_v2", 999);
    std::string message = expect_throw(ferrocache, 8 << 20);
    check(message == "CUDA error: cuMemAlloc_v2 failed with error 999: unknown error",
          "the driver's error: " + message);
    ferrocache.free(first, 4096, 0, nullptr);
    return 0;
}

// The library search path holds no libcuda.
int no_driver(const Ferrocache& ferrocache) {
    for (int attempt = 0; attempt < 2; ++attempt) {
        std::string message = expect_throw(ferrocache, 1 << 20);
        check(message.find("libcuda.so") != std::string::npos, "the message names libcuda.so");
    }
    check(ferrocache.alloc(0, 0, nullptr) == nullptr, "size 0 gives NULL without a driver too");
    ferrocache.free(nullptr, 0, 0, nullptr);
    ferrocache.reset();
    return 0;
}

// PYTORCH_CUDA_ALLOC_CONF=foo:1
int bad_config(const Ferrocache& ferrocache) {
    for (int attempt = 0; attempt < 2; ++attempt) {
        std::string message = expect_throw(ferrocache, 1 << 20);
        check(message == "PYTORCH_CUDA_ALLOC_CONF is invalid: Unrecognized key 'foo' in "
                         "Accelerator allocator config.",
              "the configuration error: " + message);
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// bad input: logged, nothing changes, nothing throws or aborts
// ---------------------------------------------------------------------------------------------

int bad_input(const Ferrocache& ferrocache) {
    FakeDriver driver;
    Stream other_stream = driver.new_stream();
    void* kept = ferrocache.alloc(4096, 0, nullptr);
    void* block = ferrocache.alloc(1000, 0, nullptr);
    void* unknown = reinterpret_cast<void*>(uintptr_t(0xdead000));

    ferrocache.free(nullptr, 123, 0, nullptr);
    ferrocache.free(unknown, 64, 0, nullptr);
    ferrocache.record_stream(unknown, other_stream);
    size_t base_size = 12345;
    check(ferrocache.base_alloc(unknown, &base_size) == unknown && base_size == 0,
          "rust_base_alloc of an unknown pointer gives it back with size 0");
    check(ferrocache.stat("allocated_bytes.all.current") == 4096 + 1024,
          "bad input changed nothing");

    // Wrong size and stream: logged, and the block is freed as it was recorded.
    ferrocache.free(block, 999, 0, other_stream);
    check(ferrocache.stat("allocated_bytes.all.current") == 4096, "the block was freed");
    // A second time: refused.
    ferrocache.free(block, 1000, 0, nullptr);
    check(ferrocache.stat("allocated_bytes.all.current") == 4096, "a double free changed nothing");
    // The wrong device: logged, and freed where it was allocated.
    ferrocache.free(kept, 4096, 3, nullptr);
    check(ferrocache.stat("allocated_bytes.all.current") == 0, "freed on its own device");
    // A device that cannot be: an exception, as for any failed allocation.
    std::string message = expect_throw(ferrocache, 1024, -1);
    check(message == "invalid device ordinal -1", "the device number: " + message);
    std::printf("bad-input: every call returned\n");
    return 0;
}

// ---------------------------------------------------------------------------------------------
// graph: what torch.cuda.graph does through the pool hooks
// ---------------------------------------------------------------------------------------------

// The filter PyTorch's CUDAGraph gives beginAllocateToPool: "is this stream capturing for me?"
std::function<bool(cudaStream_t)> capturing_on(Stream capture_stream) {
    return [capture_stream](cudaStream_t stream) {
        return static_cast<void*>(stream) == capture_stream;
    };
}

// A filter that counts its live copies, to see that ferrocache destroys what it keeps.
struct CountedFilter {
    static int live;
    Stream capture_stream;
    explicit CountedFilter(Stream stream) : capture_stream(stream) { ++live; }
    CountedFilter(const CountedFilter& other) : capture_stream(other.capture_stream) { ++live; }
    CountedFilter(CountedFilter&& other) noexcept : capture_stream(other.capture_stream) { ++live; }
    ~CountedFilter() { --live; }
    bool operator()(cudaStream_t stream) const {
        return static_cast<void*>(stream) == capture_stream;
    }
};
int CountedFilter::live = 0;

bool inside(void* ptr, void* base, size_t size) {
    auto p = reinterpret_cast<uintptr_t>(ptr);
    auto b = reinterpret_cast<uintptr_t>(base);
    return p >= b && p < b + size;
}

int graph(const Ferrocache& ferrocache) {
    FakeDriver driver;
    Stream capture = driver.new_stream();
    Stream other = driver.new_stream();
    ferrocache.init(1);
    const MempoolId pool{1, 0};

    // Graph 1: an output kept, a scratch buffer freed during capture.
    ferrocache.begin_allocate_to_pool(0, pool, CountedFilter(capture));
    check(CountedFilter::live == 1, "ferrocache keeps one copy of the filter during the capture");
    void* output = ferrocache.alloc(1 << 20, 0, capture);
    void* scratch = ferrocache.alloc(4096, 0, capture);
    ferrocache.free(scratch, 4096, 0, capture);
    void* again = ferrocache.alloc(4096, 0, capture);
    check(again == scratch, "inside the capture the pool reuses its freed block");
    ferrocache.free(again, 4096, 0, capture);
    size_t pool_size = 0;
    void* pool_base = ferrocache.base_alloc(output, &pool_size);
    check(pool_size == (2 << 20) && inside(scratch, pool_base, pool_size),
          "the capture's small allocations share one pool segment");
    void* ordinary = ferrocache.alloc(4096, 0, other);
    check(!inside(ordinary, pool_base, pool_size), "another stream's allocation is not the pool's");
    ferrocache.end_allocate_to_pool(0, pool);
    check(CountedFilter::live == 0, "the filter is destroyed when the capture ends");

    // After the capture, the graph may replay into `scratch`: nobody else gets it.
    void* after = ferrocache.alloc(4096, 0, capture);
    check(!inside(after, pool_base, pool_size), "an allocation after the capture is not the pool's");
    std::string json = ferrocache.snapshot_json();
    check(json.find("\"segment_pool_id\":[1,0]") != std::string::npos,
          "the snapshot marks the pool's segment: " + json);

    // Graph 2 shares the pool (torch.cuda.graph_pool_handle()): it reuses graph 1's free block.
    ferrocache.begin_allocate_to_pool(0, pool, capturing_on(capture));
    void* shared = ferrocache.alloc(4096, 0, capture);
    check(shared == scratch, "a capture into a shared pool reuses the blocks earlier ones freed");
    ferrocache.end_allocate_to_pool(0, pool);

    // empty_cache keeps a referenced pool, even its free 20 MiB segment; g.reset() of both
    // graphs, then it goes.
    ferrocache.begin_allocate_to_pool(0, pool, capturing_on(capture));
    ferrocache.free(ferrocache.alloc(8 << 20, 0, capture), 8 << 20, 0, capture);
    ferrocache.end_allocate_to_pool(0, pool);
    long long reserved = ferrocache.stat("reserved_bytes.all.current");
    // The ordinary allocations are on two streams: a segment each.
    check(reserved == (2 << 20) + (20 << 20) + 2 * (2 << 20), "pool: 2 + 20 MiB, ordinary: 4 MiB");
    ferrocache.reset();
    check(ferrocache.stat("reserved_bytes.all.current") == reserved,
          "empty_cache keeps the memory of a pool that graphs hold");
    for (int graph = 0; graph < 3; ++graph) ferrocache.release_pool(0, pool);
    ferrocache.free(shared, 4096, 0, capture);
    ferrocache.free(output, 1 << 20, 0, capture);
    ferrocache.free(ordinary, 4096, 0, other);
    ferrocache.free(after, 4096, 0, capture);
    ferrocache.reset();
    check(ferrocache.stat("reserved_bytes.all.current") == 0, "nothing reserved once nothing is live");
    check(driver.stat("bytes_in_use") == 0, "the driver holds nothing");

    // Refusals: logged (and thrown where a capture must not go on), never an abort.
    ferrocache.release_pool(0, MempoolId{9, 9});
    ferrocache.end_allocate_to_pool(0, MempoolId{9, 9});
    const MempoolId failing{2, 0};
    ferrocache.begin_allocate_to_pool(0, failing, [](cudaStream_t) -> bool {
        throw std::runtime_error("cudaStreamGetCaptureInfo failed");
    });
    try {
        ferrocache.begin_allocate_to_pool(0, failing, CountedFilter(capture));
        fail("a second capture into the same pool did not throw");
    } catch (const std::exception& e) {
        check(std::string(e.what()).find("already recording to mempool_id (2, 0)") !=
                  std::string::npos,
              std::string("the refusal says why: ") + e.what());
    }
    check(CountedFilter::live == 0, "a refused capture's filter is destroyed");
    try {
        void* ptr = ferrocache.alloc(4096, 0, capture);
        fail("an allocation whose filter throws returned " +
             std::to_string(reinterpret_cast<uintptr_t>(ptr)));
    } catch (const std::exception& e) {
        check(std::string(e.what()).find("cudaStreamGetCaptureInfo failed") != std::string::npos,
              std::string("the filter's failure is in the message: ") + e.what());
    }
    ferrocache.end_allocate_to_pool(0, failing);
    ferrocache.release_pool(0, failing);
    ferrocache.reset();
    check(ferrocache.stat("reserved_bytes.all.current") == 0, "the refusals left nothing behind");
    std::printf("graph: captures, a shared pool and refusals went through the pool hooks\n");
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::printf("usage: %s LIBRARY stress THREADS OPS | oom | driver-failure | no-driver | bad-config | "
                    "bad-input | graph\n",
                    argv[0]);
        return 2;
    }
    Ferrocache ferrocache(argv[1]);
    std::string scenario = argv[2];
    if (scenario == "stress" && argc == 5) {
        stress(ferrocache, std::atoi(argv[3]), std::atoi(argv[4]));
    } else if (scenario == "oom") {
        oom(ferrocache);
    } else if (scenario == "driver-failure") {
        driver_failure(ferrocache);
    } else if (scenario == "no-driver") {
        no_driver(ferrocache);
    } else if (scenario == "bad-config") {
        bad_config(ferrocache);
    } else if (scenario == "bad-input") {
        bad_input(ferrocache);
    } else if (scenario == "graph") {
        graph(ferrocache);
    } else {
        std::printf("unknown scenario %s\n", scenario.c_str());
        return 2;
    }
    if (failures.load() != 0) {
        std::printf("%d check(s) failed\n", failures.load());
        return 1;
    }
    std::printf("all checks passed\n");
    return 0;
}
