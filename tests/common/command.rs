//! The `ferrocache` command as cargo built it for the integration tests, and its output.

use std::process::{Command, Output};

/// Runs `ferrocache ARGS` and waits for it.
pub fn ferrocache(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrocache"))
        .args(args)
        .output()
        .expect("the ferrocache binary runs")
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}
