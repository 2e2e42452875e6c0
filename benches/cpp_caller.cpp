// Host cost as a C++ caller sees it: libferrocache.so opened with dlopen(RTLD_NOW | RTLD_LOCAL),
// as PyTorch opens a CUDAPluggableAllocator's library, and rust_malloc / rust_free called through
// the pointers dlsym gives, timed with std::chrono::steady_clock over whole runs of pairs. Next
// to it, in the same process: glibc's malloc + free of the same size. benches/cpp_caller.rs
// builds it (as the tests build C++) and runs it against the fake libcuda; see
// docs/performance.md.
//
//   cpp_caller LIBRARY [--rounds N] [--pairs N] [--live N] [--size BYTES] [--only KIND]
//
// Each round, in this order (the pairs are of SIZE bytes, 4 KiB unless `--size` says):
//   glibc          malloc + free, through function pointers the compiler cannot see into
//   64 sizes       LIVE live blocks of 1 KiB, 2 KiB, ... 64 KiB in turn on the default stream,
//                  then PAIRS pairs of rust_malloc + rust_free on it: a cache hit that splits
//                  the free tail of the last segment and merges it back
//   all 4 KiB      the same with LIVE live blocks of 4 KiB (the same split and merge)
//   a hole         LIVE live blocks of 4 KiB with one freed in the middle: the pairs reuse it,
//                  neither splitting nor merging (what benches/c_abi.rs times)
//   one thread     a worker thread, on a stream of its own with LIVE/2 live blocks of 64 sizes,
//                  makes PAIRS pairs alone
//   two threads    that worker and a second one, each on its own stream and with its own LIVE/2
//                  live blocks, make PAIRS pairs each at the same time: per pair, the time from
//                  the first start to the last finish divided by PAIRS
// The live blocks of the first three are made and freed within the round; the workers' stay.
// At the end, the median of each over the rounds and the ratios. The worker threads exist from
// the start, as in every PyTorch process: glibc's malloc skips its arena locks only in a
// process that never had a second thread. Exit status 0 when every allocation succeeded and
// ferrocache's invariants hold at the end. `--only glibc|sizes|small|hole|one|two` runs one
// kind alone (for a profiler: `valgrind --tool=callgrind`, `perf record`), without the table.

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Stream = void*;
using AllocFn = void* (*)(size_t, int, Stream);
using FreeFn = void (*)(void*, size_t, int, Stream);
using CheckFn = int (*)();
using LastErrorFn = const char* (*)();
using Clock = std::chrono::steady_clock;

constexpr size_t kSmall = 4096;
// The size of the timed pairs (`--size`, 4 KiB unless told).
size_t pair_size = kSmall;
constexpr size_t kSizes = 64;

[[noreturn]] void die(const std::string& why) {
    std::printf("FAILED: %s\n", why.c_str());
    std::fflush(stdout);
    std::exit(1);
}

void* symbol(void* library, const char* name) {
    void* found = dlsym(library, name);
    if (found == nullptr) die(std::string(name) + " is not exported: " + dlerror());
    return found;
}

// The library as PyTorch's CUDAPluggableAllocator is given it.
struct Ferrocache {
    AllocFn alloc;
    FreeFn free;
    CheckFn check_invariants;
    LastErrorFn last_error;

    explicit Ferrocache(const char* path) {
        void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (library == nullptr) die(std::string("dlopen ") + path + ": " + dlerror());
        alloc = reinterpret_cast<AllocFn>(symbol(library, "rust_malloc"));
        free = reinterpret_cast<FreeFn>(symbol(library, "rust_free"));
        check_invariants = reinterpret_cast<CheckFn>(symbol(library, "ferrocache_check_invariants"));
        last_error = reinterpret_cast<LastErrorFn>(symbol(library, "ferrocache_last_error"));
    }
};

// Streams made by the fake driver, as PyTorch would pass them.
std::vector<Stream> new_streams(int count) {
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == nullptr) die(std::string("dlopen libcuda.so.1 (the fake): ") + dlerror());
    using CuInit = int (*)(unsigned);
    using CuRetain = int (*)(void**, int);
    using CuSetCurrent = int (*)(void*);
    using CuStreamCreate = int (*)(void**, unsigned);
    void* context = nullptr;
    if (reinterpret_cast<CuInit>(symbol(cuda, "cuInit"))(0) != 0 ||
        reinterpret_cast<CuRetain>(symbol(cuda, "cuDevicePrimaryCtxRetain"))(&context, 0) != 0 ||
        reinterpret_cast<CuSetCurrent>(symbol(cuda, "cuCtxSetCurrent"))(context) != 0) {
        die("the fake driver did not start");
    }
    std::vector<Stream> streams(count, nullptr);
    for (Stream& stream : streams) {
        if (reinterpret_cast<CuStreamCreate>(symbol(cuda, "cuStreamCreate"))(&stream, 0) != 0) {
            die("cuStreamCreate failed");
        }
    }
    return streams;
}

// Compilers must not drop an allocation whose pointer nobody reads.
void keep(void* ptr) { asm volatile("" : : "r"(ptr) : "memory"); }

void* allocate(const Ferrocache& lib, size_t size, Stream stream) {
    void* ptr = nullptr;
    try {
        ptr = lib.alloc(size, 0, stream);
    } catch (const std::exception& err) {
        die(std::string("rust_malloc threw: ") + err.what());
    }
    if (ptr == nullptr) die("rust_malloc gave NULL");
    return ptr;
}

// Live blocks on `stream`: `count` of them, 1 KiB, 2 KiB, ... 64 KiB in turn, or all 4 KiB.
// The list of live blocks lives in `storage`, which the caller keeps from round to round:
// a list made and freed each round would move glibc's heap (its top chunk and trim threshold)
// under the glibc pairs measured next to ferrocache's, which then varied from 30 to 140 ns.
struct LiveBlocks {
    const Ferrocache* lib;
    Stream stream;
    std::vector<std::pair<void*, size_t>>& blocks;

    LiveBlocks(const Ferrocache& lib_, Stream stream_, size_t count, bool all_small,
               std::vector<std::pair<void*, size_t>>& storage)
        : lib(&lib_), stream(stream_), blocks(storage) {
        blocks.clear();
        blocks.reserve(count);
        for (size_t i = 0; i < count; ++i) {
            size_t size = all_small ? kSmall : (i % kSizes + 1) * 1024;
            blocks.emplace_back(allocate(*lib, size, stream), size);
        }
    }
    ~LiveBlocks() {
        for (auto& [ptr, size] : blocks) lib->free(ptr, size, 0, stream);
        blocks.clear();
    }
    LiveBlocks(const LiveBlocks&) = delete;
    LiveBlocks& operator=(const LiveBlocks&) = delete;
};

// `pairs` pairs of `pair_size` bytes through ferrocache on `stream`.
void ferrocache_pairs(const Ferrocache& lib, Stream stream, size_t pairs) {
    AllocFn alloc = lib.alloc;
    FreeFn release = lib.free;
    for (size_t i = 0; i < pairs; ++i) {
        void* ptr = alloc(pair_size, 0, stream);
        keep(ptr);
        release(ptr, pair_size, 0, stream);
    }
}

double ns_per_pair(Clock::duration took, size_t pairs) {
    return std::chrono::duration<double, std::nano>(took).count() / static_cast<double>(pairs);
}

double timed(size_t pairs, const std::function<void()>& run) {
    auto began = Clock::now();
    run();
    return ns_per_pair(Clock::now() - began, pairs);
}

// A thread that waits for orders; each order is `pairs` pairs on its stream, started when every
// worker of the order has arrived at the barrier.
class Worker {
public:
    Worker(const Ferrocache& lib, Stream stream, size_t live)
        : lib_(lib), stream_(stream), thread_([this, live] { run(live); }) {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [this] { return ready_; });
    }
    ~Worker() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            quit_ = true;
        }
        changed_.notify_all();
        thread_.join();
    }

    void order(size_t pairs, std::function<void()> start_together) {
        std::lock_guard<std::mutex> lock(mutex_);
        pairs_ = pairs;
        start_together_ = std::move(start_together);
        done_ = false;
        ++orders_;
        changed_.notify_all();
    }

    std::pair<Clock::time_point, Clock::time_point> wait_done() {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [this] { return done_; });
        return {began_, finished_};
    }

private:
    void run(size_t live) {
        std::vector<std::pair<void*, size_t>> storage;
        LiveBlocks blocks(lib_, stream_, live, false, storage);
        size_t seen = 0;
        std::unique_lock<std::mutex> lock(mutex_);
        ready_ = true;
        changed_.notify_all();
        while (true) {
            changed_.wait(lock, [&] { return quit_ || orders_ != seen; });
            if (quit_) break;
            seen = orders_;
            size_t pairs = pairs_;
            auto start_together = start_together_;
            lock.unlock();
            start_together();
            auto began = Clock::now();
            ferrocache_pairs(lib_, stream_, pairs);
            auto finished = Clock::now();
            lock.lock();
            began_ = began;
            finished_ = finished;
            done_ = true;
            changed_.notify_all();
        }
    }

    const Ferrocache& lib_;
    Stream stream_;
    std::mutex mutex_;
    std::condition_variable changed_;
    bool ready_ = false, quit_ = false, done_ = false;
    size_t orders_ = 0, pairs_ = 0;
    std::function<void()> start_together_;
    Clock::time_point began_, finished_;
    std::thread thread_;  // last: started once everything above is set up
};

// Makes each worker in `workers` run `pairs` pairs, started together; ns per pair from the first
// start to the last finish.
double together(const std::vector<Worker*>& workers, size_t pairs) {
    std::mutex mutex;
    std::condition_variable all_there;
    size_t arrived = 0;
    auto start_together = [&] {
        std::unique_lock<std::mutex> lock(mutex);
        if (++arrived == workers.size()) {
            all_there.notify_all();
        } else {
            all_there.wait(lock, [&] { return arrived == workers.size(); });
        }
    };
    for (Worker* worker : workers) worker->order(pairs, start_together);
    Clock::time_point first = Clock::time_point::max(), last = Clock::time_point::min();
    for (Worker* worker : workers) {
        auto [began, finished] = worker->wait_done();
        first = std::min(first, began);
        last = std::max(last, finished);
    }
    return ns_per_pair(last - first, pairs);
}

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
}

size_t number_after(int& index, int argc, char** argv) {
    if (index + 1 >= argc) die(std::string(argv[index]) + " needs a number");
    char* end = nullptr;
    unsigned long long value = std::strtoull(argv[++index], &end, 10);
    if (end == nullptr || *end != '\0' || value == 0) die(std::string("bad number: ") + argv[index]);
    return static_cast<size_t>(value);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        die("usage: cpp_caller LIBRARY [--rounds N] [--pairs N] [--live N] [--size BYTES] "
            "[--only KIND]");
    }
    size_t rounds = 7, pairs = 2'000'000, live = 10'000;
    const char* only = nullptr;
    for (int i = 2; i < argc; ++i) {
        if (std::strcmp(argv[i], "--rounds") == 0) {
            rounds = number_after(i, argc, argv);
        } else if (std::strcmp(argv[i], "--pairs") == 0) {
            pairs = number_after(i, argc, argv);
        } else if (std::strcmp(argv[i], "--live") == 0) {
            live = number_after(i, argc, argv);
        } else if (std::strcmp(argv[i], "--size") == 0) {
            pair_size = number_after(i, argc, argv);
        } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
            only = argv[++i];
        } else {
            die(std::string("unknown argument ") + argv[i]);
        }
    }

    Ferrocache lib(argv[1]);
    std::vector<Stream> streams = new_streams(2);
    Worker first(lib, streams[0], live / 2);
    Worker second(lib, streams[1], live / 2);

    // Through pointers, as the allocator is called, so that neither call is inlined away.
    void* (*volatile libc_malloc)(size_t) = std::malloc;
    void (*volatile libc_free)(void*) = std::free;
    auto glibc_pairs = [&] {
        auto malloc_fn = libc_malloc;
        auto free_fn = libc_free;
        for (size_t i = 0; i < pairs; ++i) {
            void* ptr = malloc_fn(pair_size);
            keep(ptr);
            free_fn(ptr);
        }
    };
    std::vector<std::pair<void*, size_t>> storage;
    storage.reserve(live);
    auto ferrocache_with_live = [&](bool all_small, bool hole) {
        LiveBlocks blocks(lib, nullptr, live, all_small, storage);
        if (hole) {
            // A cached 4 KiB block between two live ones: the best fit, which neither splits
            // nor merges (what benches/c_abi.rs times).
            auto [ptr, size] = blocks.blocks[live / 2];
            lib.free(ptr, size, 0, nullptr);
            blocks.blocks.erase(blocks.blocks.begin() + static_cast<std::ptrdiff_t>(live / 2));
        }
        return timed(pairs, [&] { ferrocache_pairs(lib, nullptr, pairs); });
    };

    struct Kind {
        const char* name;
        const char* option;
        std::function<double()> run;
        std::vector<double> figures;
    };
    Kind kinds[] = {
        {"glibc", "glibc", [&] { return timed(pairs, glibc_pairs); }, {}},
        {"64 sizes", "sizes", [&] { return ferrocache_with_live(false, false); }, {}},
        {"all 4 KiB", "small", [&] { return ferrocache_with_live(true, false); }, {}},
        {"a hole", "hole", [&] { return ferrocache_with_live(true, true); }, {}},
        {"one thread", "one", [&] { return together({&first}, pairs); }, {}},
        {"two threads", "two", [&] { return together({&first, &second}, pairs); }, {}},
    };
    if (only != nullptr) {
        for (Kind& kind : kinds) {
            if (std::strcmp(kind.option, only) == 0) {
                for (size_t round = 0; round < rounds; ++round) {
                    std::printf("%s: %.1f ns per pair\n", kind.name, kind.run());
                }
                return 0;
            }
        }
        die(std::string("--only takes glibc, sizes, small, hole, one or two, not ") + only);
    }

    std::printf("%zu rounds of %zu pairs of %zu bytes, %zu live blocks (workers: %zu each); "
                "ns per pair\n",
                rounds, pairs, pair_size, live, live / 2);
    std::printf("%6s", "round");
    for (Kind& kind : kinds) std::printf(" %11s", kind.name);
    std::printf("\n");
    for (size_t round = 0; round < rounds; ++round) {
        std::printf("%6zu", round + 1);
        for (Kind& kind : kinds) {
            kind.figures.push_back(kind.run());
            std::printf(" %11.1f", kind.figures.back());
        }
        std::printf("\n");
        std::fflush(stdout);
    }

    double glibc = median(kinds[0].figures), one = median(kinds[4].figures);
    std::printf("\nmedians over %zu rounds, ns per pair:\n", rounds);
    std::printf("  %-36s %7.1f\n", "glibc malloc+free", glibc);
    const char* labels[] = {"ferrocache, 64 sizes live", "ferrocache, all 4 KiB live",
                            "ferrocache, into a hole", "one thread on its own stream"};
    for (size_t kind = 1; kind <= 4; ++kind) {
        double figure = median(kinds[kind].figures);
        std::printf("  %-36s %7.1f   / glibc %.2f\n", labels[kind - 1], figure, figure / glibc);
    }
    double two = median(kinds[5].figures);
    std::printf("  %-36s %7.1f   / one thread %.2f\n", "two threads, each on its own stream", two,
                two / one);

    if (lib.check_invariants() != 0) die(std::string("invariants: ") + lib.last_error());
    std::printf("invariants hold\n");
    return 0;
}
