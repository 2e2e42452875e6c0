//! The one table of environment variables (`src/env.rs`): the Python package keeps the same
//! one, no other file spells ferrocache's names, and every on/off variable reads the same words.

mod cdylib;
mod support;

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr;

use cdylib::Ferrocache;
use ferrocache::env;
use serde_json::Value;
use support::in_own_process;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn files_under(dir: &Path, extension: &str, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read a source folder") {
        let path = entry.expect("a folder entry").path();
        if path.is_dir() {
            files_under(&path, extension, found);
        } else if path.extension().is_some_and(|e| e == extension) {
            found.push(path);
        }
    }
}

#[test]
fn the_python_package_keeps_the_same_table_as_the_library() {
    let module = root().join("python/ferrocache/_env.py");
    let script = "import json, runpy, sys; \
                  print(json.dumps(runpy.run_path(sys.argv[1])['table']()))";
    let output = Command::new("python3")
        .args(["-c", script])
        .arg(&module)
        .output()
        .expect("run python3");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let python: Value = serde_json::from_slice(&output.stdout).expect("JSON from _env.py");
    let library = env::table_json();
    let rows = |table: &Value| table.as_array().cloned().unwrap_or_default();
    for (python_row, library_row) in rows(&python).iter().zip(rows(&library).iter()) {
        assert_eq!(python_row, library_row, "python/ferrocache/_env.py differs");
    }
    assert_eq!(python, library, "python/ferrocache/_env.py has other rows");
}

/// A string literal that starts with `FERROCACHE_` (a `"` or `'` just before it).
fn spells_a_ferrocache_name(line: &str) -> bool {
    line.contains("\"FERROCACHE_") || line.contains("'FERROCACHE_")
}

#[test]
fn only_the_table_modules_spell_ferrocache_variable_names() {
    let mut spelt = Vec::new();
    for (dir, extension, table, comment) in [
        ("src", "rs", "src/env.rs", "//"),
        ("python/ferrocache", "py", "python/ferrocache/_env.py", "#"),
    ] {
        let mut files = Vec::new();
        files_under(&root().join(dir), extension, &mut files);
        for file in files {
            if file.ends_with(table) {
                continue;
            }
            let text = std::fs::read_to_string(&file).expect("read a source file");
            for (number, line) in text.lines().enumerate() {
                if !line.trim_start().starts_with(comment) && spells_a_ferrocache_name(line) {
                    spelt.push(format!("{}:{}: {line}", file.display(), number + 1));
                }
            }
        }
    }
    assert!(
        spelt.is_empty(),
        "take these names from src/env.rs or python/ferrocache/_env.py:\n{}",
        spelt.join("\n")
    );
}

#[test]
fn every_variable_that_ferrocache_run_sets_is_a_row_of_the_table() {
    let options: Vec<&str> = env::TABLE.iter().filter_map(|v| v.run_option).collect();
    for option in [
        "--conf",
        "--cross-stream",
        "--log-level",
        "--snapshot-on-oom",
        "--record",
        "--quiet",
        "--report",
    ] {
        assert!(options.contains(&option), "{option}");
    }
    assert_eq!(env::ALLOC_CONF_VARS[0], env::ALLOC_CONF.name);
}

type MallocFn = unsafe extern "C" fn(usize, c_int, *mut c_void) -> *mut c_void;
type SleepFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_char;
type StringFreeFn = unsafe extern "C" fn(*mut c_char);

/// Allocates 3 MiB outside any region through the C ABI, sleeps everything, and returns how
/// many segments slept: all of them when `FERROCACHE_SLEEP` is on, none when it is off.
fn segments_that_sleep() -> u64 {
    let library = Ferrocache::open();
    let malloc: MallocFn = library.function("rust_malloc");
    // SAFETY: plain values; stream 0 is the default stream.
    let ptr = unsafe { malloc(3 << 20, 0, ptr::null_mut()) };
    assert!(!ptr.is_null(), "{}", library.last_error());
    let sleep: SleepFn = library.function("ferrocache_sleep");
    // SAFETY: NULL asks for every tag; no backup.
    let text = unsafe { sleep(ptr::null(), 0) };
    assert!(!text.is_null(), "{}", library.last_error());
    // SAFETY: a string from ferrocache, freed once below.
    let json = unsafe { CStr::from_ptr(text) }.to_str().unwrap().to_owned();
    let free: StringFreeFn = library.function("ferrocache_string_free");
    // SAFETY: returned by ferrocache, not freed before.
    unsafe { free(text) };
    let report: Value = serde_json::from_str(&json).unwrap();
    report["segments"].as_u64().unwrap()
}

#[test]
fn ferrocache_sleep_is_on_for_true_as_for_1() {
    let test = "ferrocache_sleep_is_on_for_true_as_for_1";
    in_own_process(test, &[("FERROCACHE_SLEEP", "true")], || {
        assert_eq!(segments_that_sleep(), 1);
    });
}

#[test]
fn ferrocache_sleep_is_on_for_yes_and_on_in_any_case() {
    let test = "ferrocache_sleep_is_on_for_yes_and_on_in_any_case";
    in_own_process(test, &[("FERROCACHE_SLEEP", " On ")], || {
        assert_eq!(segments_that_sleep(), 1);
    });
}

#[test]
fn ferrocache_sleep_is_off_for_off() {
    let test = "ferrocache_sleep_is_off_for_off";
    in_own_process(test, &[("FERROCACHE_SLEEP", "off")], || {
        assert_eq!(segments_that_sleep(), 0);
    });
}
