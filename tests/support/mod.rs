//! Running a test against the fake driver (`tests/fake-cuda/driver`) in a process of its own.
//!
//! cudarc loads libcuda once per process, at the first driver call, from the library search
//! path as it was when the process started. So each scenario reruns the test binary itself,
//! filtered to that one test, with `LD_LIBRARY_PATH` leading to the fake (or to nothing) and
//! the fake's settings in the environment; the parent checks that the child passed.

#![allow(
    dead_code,
    reason = "each test binary uses its own part of the helpers"
)]

use std::ffi::{CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Variables that would change what a C++ client or a benchmark sees (PyTorch's settings, the
/// fake's size and device count): removed from the environment of the programs they run.
pub const INHERITED_SETTINGS: [&str; 6] = [
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TORCH_CUDA_ALLOC_LOG_LEVEL",
    "FAKE_LIBCUDA_TOTAL_MEM",
    "FAKE_LIBCUDA_DEVICE_COUNT",
];

/// Set in a child process to the name of the one test it runs.
const CHILD_VARIABLE: &str = "FERROCACHE_TEST_CHILD";

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Runs `body` in a child process whose libcuda is the fake one, with `env` set (e.g.
/// `FAKE_LIBCUDA_TOTAL_MEM`). `test` must be the name of the calling `#[test]` function.
pub fn in_own_process(test: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    let library_path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(existing) if !existing.is_empty() => {
            format!("{}:{existing}", fake_libcuda_dir().display())
        }
        _ => fake_libcuda_dir().display().to_string(),
    };
    run(test, &library_path, env, body);
}

/// Runs `body` in a child process whose libcuda is the fake one but which finds no NVML
/// (`libnvidia-ml.so.1`), as on a machine whose driver installation lacks it.
pub fn in_own_process_without_nvml(test: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libcuda-without-nvml");
    std::fs::create_dir_all(&dir).expect("create a library directory");
    link_names(
        &dir,
        &fake_libcuda_dir().join("libcuda.so"),
        &["libcuda.so", "libcuda.so.1"],
    );
    run(test, &dir.display().to_string(), env, body);
}

/// Runs `body` in a child process whose library search path holds no libcuda at all.
pub fn in_own_process_without_libcuda(test: &str, body: impl FnOnce()) {
    let empty = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-libcuda");
    std::fs::create_dir_all(&empty).expect("create an empty library directory");
    run(test, &empty.display().to_string(), &[], body);
}

/// Runs `body` in a child process whose library search path is `dirs`, in order (e.g. a stub
/// libcuda's directory ahead of the fake's).
pub fn in_own_process_with_library_path(
    test: &str,
    dirs: &[&Path],
    env: &[(&str, &str)],
    body: impl FnOnce(),
) {
    let path: Vec<String> = dirs.iter().map(|dir| dir.display().to_string()).collect();
    run(test, &path.join(":"), env, body);
}

/// Builds, once per test process, a stand-in for a CUDA toolkit's `stubs/libcuda.so`: every
/// driver function ferrocache calls answers `CUDA_ERROR_STUB_LIBRARY` (34), as NVIDIA's stub
/// does. Its soname is `libcuda.so.1`, like the stub's. Returns its directory, which holds
/// `libcuda.so` only.
pub fn stub_libcuda_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("libcuda-stub");
        std::fs::create_dir_all(&dir).expect("create the stub's directory");
        let mut source = String::from("/* CUDA_ERROR_STUB_LIBRARY for every call. */\n");
        for symbol in ferrocache::device::cuda::REQUIRED_SYMBOLS {
            source.push_str(&format!("int {symbol}(void) {{ return 34; }}\n"));
        }
        let id = std::process::id();
        let c_file = dir.join(format!("stub-{id}.c"));
        std::fs::write(&c_file, source).expect("write the stub's source");
        let partial = dir.join(format!("libcuda.so.partial-{id}"));
        let cc = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
        let status = Command::new(&cc)
            .args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
            .arg(&partial)
            .arg(&c_file)
            .status()
            .unwrap_or_else(|e| panic!("run {} (a C compiler is needed): {e}", cc.display()));
        assert!(status.success(), "building the stub libcuda failed");
        std::fs::rename(&partial, dir.join("libcuda.so")).expect("move the stub into place");
        let _ = std::fs::remove_file(&c_file);
        dir
    })
}

fn run(test: &str, library_path: &str, env: &[(&str, &str)], body: impl FnOnce()) {
    run_capturing(test, library_path, env, body);
}

/// Like [`in_own_process`], and gives the parent the child's stderr (where ferrocache logs);
/// `None` in the child.
pub fn in_own_process_stderr(
    test: &str,
    env: &[(&str, &str)],
    body: impl FnOnce(),
) -> Option<String> {
    let library_path = fake_libcuda_dir().display().to_string();
    run_capturing(test, &library_path, env, body)
}

fn run_capturing(
    test: &str,
    library_path: &str,
    env: &[(&str, &str)],
    body: impl FnOnce(),
) -> Option<String> {
    if is_child_for(test) {
        // Panics that something catches (cudarc's, under catch_unwind) must not go unnoticed.
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            default_hook(info);
        }));
        body();
        assert_eq!(PANICS.load(Ordering::SeqCst), 0, "something panicked");
        return None;
    }
    let output = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_VARIABLE, test)
        .env("LD_LIBRARY_PATH", library_path)
        // Every use of memory that work of another stream may still touch aborts the child
        // (tests/fake-cuda/README.md, "Asynchrony"); a test of the check itself turns it off.
        .env("FAKE_CUDA_ORDER_FATAL", "1")
        .envs(env.iter().copied())
        .output()
        .expect("run the test binary again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "the child process for {test} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    Some(stderr.into_owned())
}

/// Whether this process is the child that runs `test` (see [`in_own_process`]): for a test
/// that starts several children itself and compares what they wrote.
pub fn is_child_for(test: &str) -> bool {
    std::env::var(CHILD_VARIABLE).as_deref() == Ok(test)
}

/// Builds the fake libcuda once per test process; returns the directory that holds
/// `libcuda.so` and `libcuda.so.1` (the name a driver installation provides).
pub fn fake_libcuda_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| build_fake_libcuda("debug"))
}

/// Set in a benchmark's rerun, whose libcuda is the fake.
const BENCH_CHILD_VARIABLE: &str = "FERROCACHE_BENCH_CHILD";

/// For a benchmark's `main`: unless this process is already the rerun, runs this program again
/// in its place (`exec`) with the fake libcuda first on `LD_LIBRARY_PATH` (libcuda is loaded
/// from the search path the process started with), `env` added and
/// [`INHERITED_SETTINGS`] removed. A measuring run (`--bench`) gets the fake built with
/// optimisations, so that its own cost stays out of figures that call it; a test run (`cargo
/// test --benches`) the tests' debug build, which it already has.
pub fn rerun_benchmark_on_the_fake_libcuda(env: &[(&str, String)]) {
    use std::os::unix::process::CommandExt;
    if std::env::var_os(BENCH_CHILD_VARIABLE).is_some() {
        return;
    }
    let fake = if std::env::args().any(|arg| arg == "--bench") {
        build_fake_libcuda("release")
    } else {
        fake_libcuda_dir().to_path_buf()
    };
    let mut command = Command::new(std::env::current_exe().expect("this program's path"));
    for variable in INHERITED_SETTINGS {
        command.env_remove(variable);
    }
    let error = command
        .args(std::env::args_os().skip(1))
        .env(BENCH_CHILD_VARIABLE, "1")
        .env("LD_LIBRARY_PATH", fake)
        .envs(env.iter().map(|(name, value)| (name, value)))
        .exec();
    panic!("could not run the benchmark again on the fake libcuda: {error}");
}

/// Builds the fake libcuda with cargo's `profile` (`debug`, or `release` for a measuring run);
/// the directory that holds it.
pub fn build_fake_libcuda(profile: &str) -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake-cuda/Cargo.toml");
    // A target directory of its own, inside ours: the fake is not part of this workspace.
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake-libcuda");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .arg("build")
        .arg("--quiet")
        .args((profile == "release").then_some("--release"))
        .args(["--package", "fake-libcuda"])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("run cargo to build the fake libcuda");
    assert!(status.success(), "building {} failed", manifest.display());
    let dir = target.join(profile);
    // The names a driver installation provides: the driver, and NVML, which the fake driver
    // exports too (one state, as on a real machine).
    link_names(
        &dir,
        Path::new("libcuda.so"),
        &["libcuda.so.1", "libnvidia-ml.so.1"],
    );
    dir
}

/// Makes each of `names` in `dir` a symbolic link to `target`, unless it exists.
fn link_names(dir: &Path, target: &Path, names: &[&str]) {
    for name in names {
        let link = dir.join(name);
        if !link.exists() {
            // Another test binary may be doing the same at the same moment.
            let _ = std::os::unix::fs::symlink(target, &link);
        }
    }
}

/// Compiles the C++ test helper `source` (under `tests/cpp/`) with g++ (or `$CXX`) into the
/// target's temporary directory as `output`; `extra` comes after the source (`-shared`, `-ldl`).
/// Written under a temporary name and renamed, since several test processes may build it at once.
pub fn compile_cpp(source: &str, output: &str, extra: &[&str]) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(source);
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join(output);
    let partial = target.with_extension(format!("partial-{}", std::process::id()));
    let cxx = std::env::var_os("CXX").unwrap_or_else(|| "g++".into());
    let result = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-g",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pthread",
        ])
        .arg(&source)
        .args(extra)
        .arg("-o")
        .arg(&partial)
        .output()
        .unwrap_or_else(|e| panic!("run {} (a C++ compiler is needed): {e}", cxx.display()));
    assert!(
        result.status.success(),
        "building {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&result.stderr)
    );
    std::fs::rename(&partial, &target).expect("move the compiled helper into place");
    target
}

/// The fake's test-only exports, looked up in the libcuda that cudarc loaded.
pub struct FakeCuda {
    library: libloading::Library,
}

impl FakeCuda {
    pub fn open() -> FakeCuda {
        // SAFETY: in a child process libcuda.so.1 is the fake (the name a driver installs and
        // ferrocache prefers, never a stub), already loaded or safe to load (it has no
        // initialisers); dlopen hands back the same library.
        let library = unsafe { libloading::Library::new("libcuda.so.1") }.expect("load the fake");
        FakeCuda { library }
    }

    /// Makes `device`'s primary context current on this thread (retaining it), as the CUDA
    /// runtime does for a call on that device.
    pub fn make_current(&self, device: c_int) {
        let init: unsafe extern "C" fn(u32) -> c_int = self.function("cuInit");
        let retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int =
            self.function("cuDevicePrimaryCtxRetain");
        let set_current: unsafe extern "C" fn(*mut c_void) -> c_int =
            self.function("cuCtxSetCurrent");
        let mut context = std::ptr::null_mut();
        // SAFETY: the driver API's signatures; a live out pointer.
        unsafe {
            assert_eq!(init(0), 0);
            assert_eq!(retain(&mut context, device), 0);
            assert_eq!(set_current(context), 0);
        }
    }

    /// `cuCtxEnablePeerAccess` from the current context to `peer`'s primary context: the driver
    /// call under `cudaDeviceEnablePeerAccess(peer)`. The driver's code.
    pub fn enable_peer_access(&self, peer: c_int) -> u32 {
        let retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int =
            self.function("cuDevicePrimaryCtxRetain");
        let enable: unsafe extern "C" fn(*mut c_void, u32) -> u32 =
            self.function("cuCtxEnablePeerAccess");
        let mut context = std::ptr::null_mut();
        // SAFETY: the driver API's signatures; a live out pointer.
        unsafe {
            assert_eq!(retain(&mut context, peer), 0);
            enable(context, 0)
        }
    }

    /// `cuMemsetD8` of `len` bytes at device address `ptr` in the current context: device-side
    /// access, as a kernel or copy engine of the current context's device makes it. The
    /// driver's code.
    pub fn memset(&self, ptr: u64, value: u8, len: usize) -> u32 {
        let memset: unsafe extern "C" fn(u64, u8, usize) -> u32 = self.function("cuMemsetD8_v2");
        // SAFETY: the driver checks the range.
        unsafe { memset(ptr, value, len) }
    }

    /// `cuMemcpyDtoD` in the current context; the driver's code.
    pub fn copy(&self, dst: u64, src: u64, len: usize) -> u32 {
        let copy: unsafe extern "C" fn(u64, u64, usize) -> u32 = self.function("cuMemcpyDtoD_v2");
        // SAFETY: the driver checks both ranges.
        unsafe { copy(dst, src, len) }
    }

    /// The fake's export `name`, with the C signature `T` the caller gives.
    pub fn function<T: Copy>(&self, name: &str) -> T {
        // SAFETY: each caller names a fake export and gives its exact C signature.
        *unsafe { self.library.get::<T>(name.as_bytes()) }
            .unwrap_or_else(|e| panic!("the fake libcuda lacks {name}: {e}"))
    }

    /// How many times the driver function `name` was called, or a state counter of the fake
    /// (`bytes_in_use`, `live_allocations`, `live_mappings`, ... see its README).
    pub fn stat(&self, name: &str) -> i64 {
        let stat: unsafe extern "C" fn(*const c_char) -> i64 = self.function("fake_cuda_stat");
        let name = CString::new(name).expect("no NUL in a stat name");
        // SAFETY: a valid NUL-terminated string.
        let value = unsafe { stat(name.as_ptr()) };
        assert!(value >= 0, "the fake has no counter {name:?}");
        value
    }

    /// Events recorded from now on report "not ready" to their first `queries` queries.
    pub fn set_event_delay(&self, queries: u32) {
        let set: extern "C" fn(u32) = self.function("fake_cuda_set_event_delay");
        set(queries);
    }

    /// The next call of driver function `name` fails with `code`.
    pub fn fail_next(&self, name: &str, code: u32) {
        let fail: unsafe extern "C" fn(*const c_char, u32) = self.function("fake_cuda_fail_next");
        let name = CString::new(name).expect("no NUL in a function name");
        // SAFETY: a valid NUL-terminated string.
        unsafe { fail(name.as_ptr(), code) };
    }

    /// A context that is not a primary context, as another library would have made.
    pub fn foreign_context(&self) -> *mut c_void {
        let get: extern "C" fn() -> *mut c_void = self.function("fake_cuda_foreign_context");
        get()
    }

    pub fn set_capturing(&self, stream: u64, capturing: bool) {
        let set: extern "C" fn(*mut c_void, c_int) -> u32 =
            self.function("fake_cuda_set_capturing");
        assert_eq!(
            set(stream as usize as *mut c_void, c_int::from(capturing)),
            0
        );
    }

    /// The start of the fake's block of device addresses (`fake_cuda_address_base`).
    pub fn address_base(&self) -> u64 {
        let get: extern "C" fn() -> u64 = self.function("fake_cuda_address_base");
        get()
    }

    /// The calling thread's stream capture mode (0 global, 1 thread-local, 2 relaxed).
    pub fn capture_mode(&self) -> u32 {
        let get: extern "C" fn() -> u32 = self.function("fake_cuda_capture_mode");
        get()
    }

    /// `cuCtxSynchronize`: waits for all work of the current context; the driver's result.
    pub fn synchronize(&self) -> c_int {
        let synchronize: unsafe extern "C" fn() -> c_int = self.function("cuCtxSynchronize");
        // SAFETY: no arguments.
        unsafe { synchronize() }
    }

    /// `cuMemsetD8Async`: work on `stream` that writes `[ptr, ptr + len)` (a context must be
    /// current for the default streams); the driver's result.
    pub fn memset_async(&self, ptr: u64, len: usize, stream: u64) -> c_int {
        let memset: unsafe extern "C" fn(u64, u8, usize, *mut c_void) -> c_int =
            self.function("cuMemsetD8Async");
        // SAFETY: plain values; the fake checks the range and the stream.
        unsafe { memset(ptr, 0x5a, len, stream as usize as *mut c_void) }
    }

    /// A driver function of the fake that takes one handle (`cuStreamSynchronize`,
    /// `cuEventQuery`, ...); its result.
    pub fn call_with_handle(&self, name: &str, handle: u64) -> c_int {
        let function: unsafe extern "C" fn(*mut c_void) -> c_int = self.function(name);
        // SAFETY: a plain handle value; the fake checks it.
        unsafe { function(handle as usize as *mut c_void) }
    }
}

/// A stream made with the fake driver (in a child process, after `cuInit` and with device 0's
/// primary context current), as PyTorch would pass one.
pub fn new_stream() -> u64 {
    new_stream_on(0, 0)
}

/// A stream of `device` (its primary context is left current on this thread), made with
/// `flags` (1: `CU_STREAM_NON_BLOCKING`, as PyTorch makes its streams).
pub fn new_stream_on(device: c_int, flags: u32) -> u64 {
    let fake = FakeCuda::open();
    fake.make_current(device);
    let create: unsafe extern "C" fn(*mut *mut c_void, u32) -> c_int =
        fake.function("cuStreamCreate");
    let mut stream = std::ptr::null_mut();
    // SAFETY: a live out pointer; a primary context is current.
    assert_eq!(unsafe { create(&mut stream, flags) }, 0);
    stream.addr() as u64
}
