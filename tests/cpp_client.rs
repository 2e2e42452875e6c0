//! `libferrocache.so` from C++, as PyTorch uses it: `tests/cpp/pytorch_like_client.cpp`, built
//! here with g++, loads the library with dlopen and calls `rust_malloc`/`rust_free` through
//! function pointers. Each scenario is one run of that program (a process of its own) against
//! the fake libcuda; this file checks its exit status, its output and ferrocache's log lines.

mod cdylib;
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use regex::Regex;

const CLIENT_SOURCE: &str = "tests/cpp/pytorch_like_client.cpp";

/// Builds the client once per test process.
fn client() -> &'static Path {
    static CLIENT: OnceLock<PathBuf> = OnceLock::new();
    CLIENT.get_or_init(|| support::compile_cpp(CLIENT_SOURCE, "pytorch_like_client", &["-ldl"]))
}

enum Driver {
    Fake,
    Missing,
}

/// Runs the client on `args` (after the library path), under `wrapper` if given (valgrind).
fn run_client(wrapper: &[&str], driver: Driver, env: &[(&str, &str)], args: &[&str]) -> Output {
    let library_dir = match driver {
        Driver::Fake => support::fake_libcuda_dir().to_path_buf(),
        Driver::Missing => cdylib::empty_library_dir(),
    };
    let mut command = match wrapper.split_first() {
        Some((program, wrapper_args)) => {
            let mut command = Command::new(program);
            command.args(wrapper_args).arg(client());
            command
        }
        None => Command::new(client()),
    };
    for variable in support::INHERITED_SETTINGS {
        command.env_remove(variable);
    }
    command
        .arg(cdylib::library_path())
        .args(args)
        .env("LD_LIBRARY_PATH", library_dir)
        .envs(env.iter().copied())
        .output()
        .expect("run the C++ client")
}

/// The client's stdout and stderr, for assertion messages.
fn describe(output: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn assert_passed(output: &Output) {
    assert!(
        output.status.success()
            && String::from_utf8_lossy(&output.stdout).contains("all checks passed"),
        "the client failed: {}",
        describe(output)
    );
}

fn stderr_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn many_threads_and_streams_get_blocks_that_never_overlap() {
    let output = run_client(&[], Driver::Fake, &[], &["stress", "4", "3000"]);
    assert_passed(&output);
    // At the default level (WARN) a clean run says nothing.
    assert_eq!(
        stderr_lines(&output),
        Vec::<String>::new(),
        "{}",
        describe(&output)
    );
}

/// The forms of every INFO line a run without failures may print, by name.
fn info_forms() -> Vec<(&'static str, Regex)> {
    let ptr = "0x[0-9a-f]+";
    let size = r"\d+(\.\d+)? (bytes|KB|MB)";
    let stream = "(0|0x[0-9a-f]+)";
    [
        ("allocated", format!(r"^\[INFO\] Allocator: block {ptr} \(size {size}\) allocated to stream {stream}$")),
        ("freed", format!(r"^\[INFO\] Allocator: block {ptr} freed, returning to pool$")),
        ("merged", format!(r"^\[INFO\] Allocator: merging block {ptr} with adjacent free block$")),
        ("new free block", format!(r"^\[INFO\] Allocator: new free block size {size}$")),
        ("split", format!(r"^\[INFO\] Allocator: splitting block {ptr}: {size} allocated, {size} remains free$")),
        ("waits", format!(r"^\[INFO\] Allocator: block {ptr} freed, waiting for \d+ other stream\(s\) before reuse$")),
        ("segment", format!(r"^\[INFO\] Allocator: new segment {ptr} \(size {size}\) from the device for stream {stream}$")),
        ("released", format!(r"^\[INFO\] Allocator: segment {ptr} \(size {size}\) released to the device$")),
        ("setting", r"^\[INFO\] Allocator: settings in effect: all allocator settings are PyTorch's defaults$".to_string()),
        ("init", r"^\[INFO\] Allocator: ferrocache \d+\.\d+\.\d+\S* initialised for 1 device\(s\); TORCH_CUDA_ALLOC_LOG_LEVEL=INFO$".to_string()),
        ("driver", r"^\[INFO\] Allocator: CUDA driver library /\S*/libcuda\.so\S*$".to_string()),
    ]
    .into_iter()
    .map(|(name, pattern)| (name, Regex::new(&pattern).expect("a valid pattern")))
    .collect()
}

#[test]
fn info_log_lines_have_the_readme_forms() {
    let env = [("TORCH_CUDA_ALLOC_LOG_LEVEL", "INFO")];
    let output = run_client(&[], Driver::Fake, &env, &["stress", "2", "400"]);
    assert_passed(&output);
    let forms = info_forms();
    let mut seen = vec![0usize; forms.len()];
    for line in stderr_lines(&output) {
        let form = forms.iter().position(|(_, regex)| regex.is_match(&line));
        let form = form.unwrap_or_else(|| panic!("a line of no known form: {line:?}"));
        seen[form] += 1;
    }
    for ((name, _), count) in forms.iter().zip(&seen) {
        assert!(*count > 0, "no {name} line in {}", describe(&output));
    }
    // The settings are described once, at start-up.
    let setting = forms.iter().position(|(name, _)| *name == "setting");
    assert_eq!(seen[setting.expect("a setting form")], 1);
}

#[test]
fn the_settings_in_effect_are_logged_once_at_start_up() {
    let env = [
        ("TORCH_CUDA_ALLOC_LOG_LEVEL", "info"),
        (
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size_mb:64,pinned_use_background_threads:True,expandable_segments,False",
        ),
    ];
    let output = run_client(&[], Driver::Fake, &env, &["stress", "2", "50"]);
    assert_passed(&output);
    let events = info_forms();
    let lines = stderr_lines(&output);
    let config_lines: Vec<&String> = lines
        .iter()
        .filter(|line| {
            !events
                .iter()
                .any(|(name, regex)| *name != "setting" && regex.is_match(line))
        })
        .collect();
    let expected = [
        r#"^\[INFO\] Allocator: settings from PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64,pinned_use_background_threads:True,expandable_segments,False"$"#,
        r"^\[INFO\] Allocator: settings in effect: max_split_size: 64 MiB .*$",
        r"^\[INFO\] Allocator: keys accepted as PyTorch does but not used by ferrocache: pinned_use_background_threads$",
        r"^\[WARN\] Allocator: Expected ':' at index 9 of the allocator settings but got ',';.*$",
    ];
    assert_eq!(
        config_lines.len(),
        expected.len(),
        "the start-up lines: {config_lines:#?}"
    );
    for (line, pattern) in config_lines.iter().zip(expected) {
        let regex = Regex::new(pattern).expect("a valid pattern");
        assert!(regex.is_match(line), "{line:?} does not match {pattern}");
    }
}

#[test]
fn out_of_memory_arrives_as_a_cpp_exception_with_pytorchs_message() {
    let env = [("FAKE_LIBCUDA_TOTAL_MEM", "67108864")];
    let output = run_client(&[], Driver::Fake, &env, &["oom"]);
    assert_passed(&output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("caught std::exception: CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 64.00 MiB"),
        "{stdout}"
    );
    // Logged at ERROR (the default level shows it), once per failed allocation; after the
    // first, once per process, how to learn which setting would have served the program.
    let errors: Vec<String> = stderr_lines(&output);
    assert_eq!(errors.len(), 3, "{}", describe(&output));
    for line in [&errors[0], &errors[2]] {
        assert!(
            line.starts_with("[ERROR] Allocator: CUDA out of memory. Tried to allocate"),
            "{line}"
        );
    }
    assert!(
        errors[1].starts_with(
            "[ERROR] Allocator: to learn which PYTORCH_CUDA_ALLOC_CONF would have served this \
             program, record its allocation history"
        ),
        "{}",
        errors[1]
    );
}

#[test]
fn a_driver_failure_arrives_as_a_cpp_exception_with_the_drivers_words() {
    let output = run_client(&[], Driver::Fake, &[], &["driver-failure"]);
    assert_passed(&output);
    assert_eq!(
        stderr_lines(&output),
        vec![
            "[ERROR] Allocator: allocation failed: CUDA error: cuMemAlloc_v2 failed with error \
             999: unknown error"
                .to_string()
        ]
    );
}

#[test]
fn without_libcuda_the_exception_names_the_library() {
    if let Some(reason) = cdylib::real_driver_installed() {
        println!("skipped: {reason}, so a process cannot be without one");
        return;
    }
    let output = run_client(&[], Driver::Missing, &[], &["no-driver"]);
    assert_passed(&output);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(
            "caught std::exception: ferrocache could not load the CUDA driver library libcuda.so"
        ),
        "{stdout}"
    );
    // Said once at ERROR, not once per allocation.
    let lines = stderr_lines(&output);
    assert_eq!(lines.len(), 1, "{}", describe(&output));
    assert!(
        lines[0].starts_with("[ERROR] Allocator: device 0 is unavailable, so its allocations will fail: ferrocache could not load the CUDA driver library libcuda.so"),
        "{}",
        lines[0]
    );
}

#[test]
fn invalid_settings_fail_every_allocation_with_pytorchs_words() {
    let env = [("PYTORCH_CUDA_ALLOC_CONF", "foo:1")];
    let output = run_client(&[], Driver::Fake, &env, &["bad-config"]);
    assert_passed(&output);
    assert_eq!(
        stderr_lines(&output),
        vec![
            "[ERROR] Allocator: PYTORCH_CUDA_ALLOC_CONF is invalid, so every allocation will fail: \
             Unrecognized key 'foo' in Accelerator allocator config."
                .to_string()
        ],
        "logged once"
    );
}

#[test]
fn bad_input_is_logged_and_changes_nothing() {
    let output = run_client(&[], Driver::Fake, &[], &["bad-input"]);
    assert_passed(&output);
    let ptr = "0x[0-9a-f]+";
    let unknown = r"invalid device pointer: 0xdead000 \(never allocated by ferrocache, or already freed\); nothing changed";
    let expected = [
        format!(r"^\[ERROR\] Allocator: rust_free: {unknown}$"),
        format!(r"^\[ERROR\] Allocator: rust_record_stream: {unknown}$"),
        format!(r"^\[ERROR\] Allocator: rust_base_alloc: {unknown}$"),
        format!(
            r"^\[WARN\] Allocator: rust_free of block {ptr} was given size 999, but the block was allocated with size 1000; using the recorded one$"
        ),
        format!(
            r"^\[WARN\] Allocator: rust_free of block {ptr} was given stream 0x[0-9a-f]+, but the block was allocated with stream 0; using the recorded one$"
        ),
        format!(
            r"^\[ERROR\] Allocator: rust_free: invalid device pointer: {ptr} \(never allocated by ferrocache, or already freed\); nothing changed$"
        ),
        format!(
            r"^\[WARN\] Allocator: rust_free of block {ptr} was given device 3, but the block was allocated with device 0; using the recorded one$"
        ),
        r"^\[ERROR\] Allocator: invalid device ordinal -1; nothing changed$".to_string(),
    ];
    let lines = stderr_lines(&output);
    assert_eq!(lines.len(), expected.len(), "{}", describe(&output));
    for (line, pattern) in lines.iter().zip(&expected) {
        let regex = Regex::new(pattern).expect("a valid pattern");
        assert!(regex.is_match(line), "{line:?} does not match {pattern}");
    }

    // OFF silences even errors.
    let env = [("TORCH_CUDA_ALLOC_LOG_LEVEL", "OFF")];
    let output = run_client(&[], Driver::Fake, &env, &["bad-input"]);
    assert_passed(&output);
    assert_eq!(stderr_lines(&output), Vec::<String>::new());
}

#[test]
fn cuda_graph_pool_hooks_work_with_pytorchs_cpp_types() {
    let output = run_client(&[], Driver::Fake, &[], &["graph"]);
    assert_passed(&output);
    let expected = [
        r"^\[ERROR\] Allocator: rust_release_pool: no private pool has mempool_id \(9, 9\); nothing changed$",
        r"^\[ERROR\] Allocator: rust_end_allocate_to_pool: endAllocateToPool: not currently recording to mempool_id \(9, 9\); nothing changed$",
        r"^\[ERROR\] Allocator: rust_begin_allocate_to_pool: beginAllocateToPool: already recording to mempool_id \(2, 0\); nothing changed$",
        r"^\[ERROR\] Allocator: allocation failed: the stream filter of the CUDA graph capture into pool \(2, 0\) failed \(cudaStreamGetCaptureInfo failed\); the allocation is refused$",
    ];
    let lines = stderr_lines(&output);
    assert_eq!(lines.len(), expected.len(), "{}", describe(&output));
    for (line, pattern) in lines.iter().zip(expected) {
        let regex = Regex::new(pattern).expect("a valid pattern");
        assert!(regex.is_match(line), "{line:?} does not match {pattern}");
    }
}

#[test]
fn the_client_runs_clean_under_valgrind() {
    let found = Command::new("valgrind").arg("--version").output();
    if !found.is_ok_and(|o| o.status.success()) {
        println!("skipped: valgrind is not installed");
        return;
    }
    let valgrind = [
        "valgrind",
        "--tool=memcheck",
        "--error-exitcode=1",
        "--leak-check=no",
        "--quiet",
    ];
    let output = run_client(&valgrind, Driver::Fake, &[], &["stress", "3", "300"]);
    assert_passed(&output);
    assert_eq!(
        stderr_lines(&output),
        Vec::<String>::new(),
        "{}",
        describe(&output)
    );

    // The pool hooks move, call and destroy PyTorch's std::function across the library.
    let output = run_client(&valgrind, Driver::Fake, &[], &["graph"]);
    assert_passed(&output);
    let lines = stderr_lines(&output);
    assert!(
        lines.len() == 4 && lines.iter().all(|l| l.starts_with("[ERROR] Allocator: ")),
        "{}",
        describe(&output)
    );

    let env = [("FAKE_LIBCUDA_TOTAL_MEM", "67108864")];
    let output = run_client(&valgrind, Driver::Fake, &env, &["oom"]);
    assert_passed(&output);
    // Only ferrocache's ERROR lines (two out-of-memory, one advice hint); valgrind said
    // nothing.
    let lines = stderr_lines(&output);
    assert!(
        lines.len() == 3
            && lines.iter().all(|l| l.starts_with("[ERROR] Allocator: "))
            && lines
                .iter()
                .filter(|l| l.starts_with("[ERROR] Allocator: CUDA out of memory."))
                .count()
                == 2,
        "{}",
        describe(&output)
    );
}
