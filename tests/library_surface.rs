//! What `libferrocache.so` shows the world: exactly the C ABI as exports (no Rust or C++ symbols
//! leaking), libstdc++ linked dynamically, and a committed header that matches the code.

mod cdylib;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use regex::Regex;

/// The C ABI: `rust_malloc` and the CUDA graph pool hooks (C++), `rust_free` and the other hooks
/// PyTorch takes, the `ferrocache_*` functions of the Python package, and the command line the
/// `ferrocache` binary runs, and what ferrocache's own allocator object for PyTorch
/// (python/ferrocache/frontend.cpp) asks.
const EXPORTS: [&str; 72] = [
    "ferrocache_alloc",
    "ferrocache_attach_oom_observer",
    "ferrocache_begin_allocate_current_thread_to_pool",
    "ferrocache_check_config",
    "ferrocache_cli_main",
    "ferrocache_create_or_incref_pool",
    "ferrocache_create_pool_with_allocator",
    "ferrocache_check_invariants",
    "ferrocache_describe_config",
    "ferrocache_detach_oom_observer",
    "ferrocache_empty_cache",
    "ferrocache_empty_cache_with_current_streams",
    "ferrocache_end_allocate_to_pool",
    "ferrocache_free",
    "ferrocache_last_error",
    "ferrocache_memory_stats",
    "ferrocache_pool_use_count",
    "ferrocache_record_history",
    "ferrocache_advise",
    "ferrocache_release_pool",
    "ferrocache_reset_accumulated_stats",
    "ferrocache_reset_peak_stats",
    "ferrocache_set_memory_fraction",
    "ferrocache_get_memory_fraction",
    "ferrocache_set_allocator_settings",
    "ferrocache_set_memory_metadata",
    "ferrocache_get_memory_metadata",
    "ferrocache_set_caching_enabled",
    "ferrocache_caching_enabled",
    "ferrocache_set_pool_options",
    "ferrocache_frontend_malloc",
    "ferrocache_frontend_begin_allocate_to_pool",
    "ferrocache_cache_info",
    "ferrocache_read_device_stats",
    "ferrocache_check_pool_live_allocations",
    "ferrocache_checkpoint_pool",
    "ferrocache_checkpoint_free",
    "ferrocache_restore_pool_checkpoint",
    "ferrocache_checkpoint_delta_free",
    "ferrocache_set_pool_use_on_oom",
    "ferrocache_set_pool_no_split",
    "ferrocache_history_enabled",
    "ferrocache_snapshot_segments",
    "ferrocache_ipc_share",
    "ferrocache_ipc_bytes_free",
    "ferrocache_ipc_open",
    "ferrocache_ipc_close",
    "ferrocache_attach_trace_tracker",
    "ferrocache_set_free_memory_callbacks",
    "ferrocache_expandable_segment_sizes",
    "ferrocache_empty_pool_cache",
    "ferrocache_set_oom_thrower",
    "ferrocache_set_reserve_class_lookup",
    "ferrocache_set_stack_gatherer",
    "ferrocache_set_thread_tag",
    "ferrocache_release_host_memory",
    "ferrocache_sleep",
    "ferrocache_last_sleep_report",
    "ferrocache_snapshot",
    "ferrocache_string_free",
    "ferrocache_version",
    "ferrocache_wake",
    "rust_base_alloc",
    "rust_begin_allocate_to_pool",
    "rust_end_allocate_to_pool",
    "rust_free",
    "rust_init",
    "rust_malloc",
    "rust_memory_fraction",
    "rust_record_stream",
    "rust_release_pool",
    "rust_reset",
];

fn run(program: &str, args: &[&str], library: &Path) -> String {
    let output = Command::new(program)
        .args(args)
        .arg(library)
        .output()
        .unwrap_or_else(|e| panic!("run {program} (binutils): {e}"));
    assert!(
        output.status.success(),
        "{program} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn the_library_exports_exactly_the_c_abi() {
    let listing = run("nm", &["-D", "--defined-only"], &cdylib::library_path());
    let exported: BTreeSet<&str> = listing
        .lines()
        .filter_map(|line| line.split_whitespace().nth(2))
        .collect();
    let mut intended: BTreeSet<&str> = EXPORTS.into_iter().collect();
    // The fault that tests/ffi.rs injects, in debug builds only (never in a wheel).
    #[cfg(debug_assertions)]
    intended.insert("ferrocache_debug_panic_at_next_reserve_class_lookup");
    assert_eq!(
        exported,
        intended,
        "exported but not intended: {:?}; intended but missing: {:?}",
        exported.difference(&intended).collect::<Vec<_>>(),
        intended.difference(&exported).collect::<Vec<_>>()
    );
    // All of them are functions in the text section.
    for line in listing.lines() {
        assert!(line.contains(" T "), "not a plain function: {line}");
    }
}

#[test]
fn libstdcxx_is_linked_dynamically() {
    let library = cdylib::library_path();
    let dynamic = run("objdump", &["-p"], &library);
    assert!(
        dynamic
            .lines()
            .any(|l| l.contains("NEEDED") && l.contains("libstdc++.so")),
        "libstdc++ is not a dependency:\n{dynamic}"
    );
    // The exception machinery comes from libstdc++ itself, so that PyTorch (which links the same
    // libstdc++) recognises the exception as a std::exception.
    let undefined = run("nm", &["-D", "--undefined-only"], &library);
    for symbol in [
        "__cxa_throw",
        "__cxa_allocate_exception",
        "_ZTISt13runtime_error",
    ] {
        assert!(
            undefined
                .lines()
                .filter_map(|line| line.split_whitespace().last())
                .any(|name| name.split('@').next() == Some(symbol)),
            "{symbol} is not taken from libstdc++:\n{undefined}"
        );
    }
}

fn generated_header() -> String {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header");
    let mut text = Vec::new();
    bindings.write(&mut text);
    String::from_utf8(text).expect("the header is UTF-8")
}

fn committed_header() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/ferrocache.h");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn the_committed_header_is_up_to_date() {
    let generated = generated_header();
    let committed = committed_header();
    if generated != committed {
        let first_difference = generated
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(generated.lines().count().min(committed.lines().count()));
        panic!(
            "include/ferrocache.h is stale (first difference at line {}): run `cargo build` \
             without CI set, which regenerates it, and commit it.\n--- generated\n{generated}",
            first_difference + 1
        );
    }
}

#[test]
fn the_header_declares_every_export_and_nothing_else() {
    let declaration =
        Regex::new(r"(?m)^(?:const )?(?:struct )?\w+ \*?(\w+)\(.*\);$").expect("a valid pattern");
    let declared: BTreeSet<String> = declaration
        .captures_iter(&committed_header())
        .map(|c| c[1].to_string())
        .collect();
    let intended: BTreeSet<String> = EXPORTS.iter().map(|s| s.to_string()).collect();
    assert_eq!(declared, intended);
}

#[test]
fn the_binary_runs_the_command_of_the_library() {
    // One program: the `ferrocache` binary is linked to libferrocache.so and only calls
    // ferrocache_cli_main there, so that maturin copies the library into the wheel beside it.
    let binary = Path::new(env!("CARGO_BIN_EXE_ferrocache"));
    let dynamic = run("objdump", &["-p"], binary);
    assert!(
        dynamic
            .lines()
            .any(|l| l.contains("NEEDED") && l.trim_end().ends_with("libferrocache.so")),
        "the binary is not linked to libferrocache.so:\n{dynamic}"
    );
    let symbols = run("nm", &["-D", "--undefined-only"], binary);
    assert!(
        symbols.contains("ferrocache_cli_main"),
        "the binary does not call ferrocache_cli_main:\n{symbols}"
    );
    let defined = run("nm", &["--defined-only", "--demangle"], binary);
    assert!(
        !defined.contains("ferrocache::cli::"),
        "the binary carries its own copy of the command"
    );
}

/// The header is valid C, and valid C++ with the pool hooks' C++ declarations.
#[test]
fn the_header_compiles_as_c_and_as_cpp() {
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    for (compiler, file, std) in [
        ("cc", "header_check.c", "-std=c99"),
        ("c++", "header_check.cpp", "-std=c++17"),
    ] {
        let source = dir.join(file);
        std::fs::write(
            &source,
            "#include \"ferrocache.h\"\nint main(void) { return 0; }\n",
        )
        .expect("write a source file");
        let output = Command::new(compiler)
            .args([std, "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I"])
            .arg(&include)
            .arg(&source)
            .output()
            .unwrap_or_else(|e| panic!("run {compiler}: {e}"));
        assert!(
            output.status.success(),
            "{compiler} rejects include/ferrocache.h:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
