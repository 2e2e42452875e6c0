//! Builds the C++ entry points (`src/oom.cpp`: the `rust_malloc` that throws; `src/pool_hooks.cpp`:
//! the CUDA graph pool hooks, whose types are C++), limits the library's exports to the C ABI,
//! and regenerates `include/ferrocache.h` with cbindgen.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

/// Exported from the C++ side; rustc's own export list covers the Rust functions.
const CPP_EXPORTS: &[&str] = &[
    "rust_malloc",
    "rust_begin_allocate_to_pool",
    "rust_end_allocate_to_pool",
    "rust_release_pool",
];
/// `#[no_mangle]` Rust functions that only the C++ side calls: rustc would export them.
const INTERNAL_SYMBOLS: &[&str] = &[
    "ferrocache_internal_malloc",
    "ferrocache_internal_begin_allocate_to_pool",
    "ferrocache_internal_end_allocate_to_pool",
    "ferrocache_internal_release_pool",
];
/// The C++ sources, each a few lines around a Rust function.
const CPP_SOURCES: &[&str] = &["src/oom.cpp", "src/pool_hooks.cpp"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-env-changed=CI");

    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));

    cc::Build::new()
        .cpp(true)
        .files(CPP_SOURCES.iter().map(|source| manifest_dir.join(source)))
        // Both files exist to throw C++ exceptions (and std::function needs C++11 or later).
        .flag("-std=c++17")
        .flag("-fexceptions")
        .flag("-fvisibility=hidden")
        .warnings(true)
        .extra_warnings(true)
        .compile("ferrocache_cpp");

    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        limit_exports(&out_dir);
        link_binary_to_library(&out_dir);
    }

    generate_header(&manifest_dir);
}

/// rustc exports every `#[no_mangle]` Rust function and nothing from C++. A second version
/// script, merged with rustc's by the linker, adds the C++ entry points and hides the internal
/// ones; `--undefined` makes the linker take the C++ objects from the archive although nothing
/// in Rust calls them. `tests/library_surface.rs` checks the result with `nm -D`.
fn limit_exports(out_dir: &Path) {
    let script = out_dir.join("exports.map");
    let mut text = String::from("{\n  global:\n");
    for symbol in CPP_EXPORTS {
        text.push_str(&format!("    {symbol};\n"));
    }
    text.push_str("  local:\n");
    for symbol in INTERNAL_SYMBOLS {
        text.push_str(&format!("    {symbol};\n"));
    }
    text.push_str("    *;\n};\n");
    fs::write(&script, text).expect("write the linker version script");
    for symbol in CPP_EXPORTS {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--undefined={symbol}");
    }
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        script.display()
    );
}

/// The `ferrocache` binary calls the command in `libferrocache.so` (src/bin/ferrocache.rs). The
/// linker finds the library in cargo's `deps` directory of this profile, beside which `OUT_DIR`
/// lies (`<target>/<profile>/build/ferrocache-<hash>/out`); at run time the binary looks in that
/// `deps/` directory first (always the latest build; the copy beside the binary, in
/// `target/release/`, is refreshed only by builds that ask for the library), then beside itself.
/// maturin adds to the run path: the wheel's `ferrocache.libs/`, or for `pip install -e .` this
/// build's directories.
fn link_binary_to_library(out_dir: &Path) {
    let Some(profile_dir) = out_dir.ancestors().nth(3) else {
        println!(
            "cargo:warning=OUT_DIR {} is not inside a cargo profile directory; the ferrocache \
             binary may not link",
            out_dir.display()
        );
        return;
    };
    println!(
        "cargo:rustc-link-search=native={}",
        profile_dir.join("deps").display()
    );
    println!("cargo:rustc-link-arg-bins=-Wl,-rpath,$ORIGIN/deps:$ORIGIN");
}

/// Regenerates `include/ferrocache.h` when it differs. Never fails the build: where cbindgen
/// cannot run, a warning says so. Under CI (`CI` set) the committed header is left as it is, so
/// that `tests/library_surface.rs` catches a stale one.
fn generate_header(manifest_dir: &Path) {
    let header = manifest_dir.join("include/ferrocache.h");
    let generated = cbindgen::Config::from_file(manifest_dir.join("cbindgen.toml"))
        .map_err(|e| e.to_string())
        .and_then(|config| {
            cbindgen::Builder::new()
                .with_crate(manifest_dir)
                .with_config(config)
                .generate()
                .map_err(|e| e.to_string())
        });
    let bindings = match generated {
        Ok(bindings) => bindings,
        Err(err) => {
            println!("cargo:warning=include/ferrocache.h not regenerated: cbindgen failed: {err}");
            return;
        }
    };
    let mut text = Vec::new();
    bindings.write(&mut text);
    if fs::read(&header).ok().as_deref() == Some(text.as_slice()) {
        return;
    }
    if env::var_os("CI").is_some() {
        println!(
            "cargo:warning=include/ferrocache.h is stale; run cargo build outside CI and commit it"
        );
        return;
    }
    if let Err(err) =
        fs::create_dir_all(manifest_dir.join("include")).and_then(|()| fs::write(&header, &text))
    {
        println!("cargo:warning=include/ferrocache.h could not be written: {err}");
    }
}
