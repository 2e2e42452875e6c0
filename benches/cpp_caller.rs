//! Host cost as a C++ caller sees it (`benches/cpp_caller.cpp`): `libferrocache.so` opened with
//! `dlopen(RTLD_NOW | RTLD_LOCAL)`, `rust_malloc` / `rust_free` called through `dlsym`'s pointers,
//! whole runs of pairs timed with `steady_clock`, glibc's `malloc` + `free` in the same process,
//! two threads each on its own stream. This program builds the C++ harness as the tests build
//! C++ (`support::compile_cpp`, g++), and runs it against this build's `libferrocache.so` on the
//! fake libcuda; the harness prints a table of medians over rounds and the ratios (see
//! `docs/performance.md`).
//!
//! ```sh
//! cargo bench --bench cpp_caller                       # 7 rounds of 2,000,000 pairs, ~1 minute
//! cargo bench --bench cpp_caller -- --rounds 3 --pairs 500000 --live 10000
//! ```
//!
//! Without `--bench` (`cargo test --benches`, `cargo test --all-targets`) it runs the harness for
//! a few thousand pairs and checks that it worked (every allocation served, ferrocache's
//! invariants intact, the summary printed); it times nothing.

#[path = "../tests/cdylib/mod.rs"]
mod cdylib;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "benches/cpp_caller.cpp";
/// What a test run asks of the harness: every kind of measurement, briefly.
const TEST_RUN: [&str; 6] = ["--rounds", "1", "--pairs", "2000", "--live", "640"];

fn main() {
    let measuring = std::env::args().any(|arg| arg == "--bench");
    // A measuring run gets the caller built with optimisations, as a C++ program would be,
    // and the fake libcuda built with them (it serves the live blocks' segments).
    let harness = support::compile_cpp(SOURCE, "cpp_caller", &["-O2", "-ldl"]);
    let fake: PathBuf = if measuring {
        support::build_fake_libcuda("release")
    } else {
        support::fake_libcuda_dir().to_path_buf()
    };
    let arguments: Vec<String> = if measuring {
        // cargo bench passes `--bench`; everything else is for the harness.
        std::env::args()
            .skip(1)
            .filter(|a| a != "--bench")
            .collect()
    } else {
        TEST_RUN.iter().map(|a| a.to_string()).collect()
    };
    let mut command = Command::new(&harness);
    for variable in support::INHERITED_SETTINGS {
        command.env_remove(variable);
    }
    command
        .arg(cdylib::library_path())
        .args(&arguments)
        .env("LD_LIBRARY_PATH", &fake);
    if measuring {
        let status = command.status().expect("run the C++ harness");
        assert!(status.success(), "the C++ harness failed ({status})");
        return;
    }
    let output = command.output().expect("run the C++ harness");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success()
            && stdout.contains("invariants hold")
            && stdout.contains("two threads, each on its own stream"),
        "the C++ harness failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        output.status
    );
    println!(
        "cpp_caller: the C++ harness ran ({} lines of output)",
        stdout.lines().count()
    );
}
