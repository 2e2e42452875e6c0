//! `ferrocache run -- COMMAND` as a shell or a scheduler sees it, without PyTorch: what the child
//! is given, its exit status and signals passed through, a missing command and refused settings.
//! With real PyTorch: python/tests/real_torch/test_launcher.py.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

#[path = "common/command.rs"]
mod command;
use command::{ferrocache, stderr, stdout};

fn scratch(test: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ferrocache-launcher-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

fn run_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrocache"))
        .args(args)
        .current_dir(dir)
        .envs(env.iter().copied())
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("FERROCACHE_LIBRARY")
        .output()
        .expect("the ferrocache binary runs")
}

#[test]
fn the_options_become_the_variables_install_reads() {
    let dir = scratch("variables");
    let output = run_in(
        &dir,
        &[
            "run",
            "--conf",
            "expandable_segments:True",
            "--cross-stream",
            "--log-level",
            "info",
            "--snapshot-on-oom",
            "oom_{rank}.pickle",
            "--record",
            "--",
            "sh",
            "-c",
            "env | grep -E '^(PYTORCH_CUDA_ALLOC_CONF|FERROCACHE_[A-Z_]*|TORCH_CUDA_ALLOC_LOG_LEVEL|PYTHONPATH)=' | sort",
        ],
        &[("PYTHONPATH", "/theirs")],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let text = stdout(&output);
    for line in [
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "FERROCACHE_CROSS_STREAM=1",
        "TORCH_CUDA_ALLOC_LOG_LEVEL=info",
        "FERROCACHE_SNAPSHOT_ON_OOM=oom_{rank}.pickle",
        "FERROCACHE_RUN_RECORD=1",
        "FERROCACHE_RUN_REPORT=1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
    }
    let python_path = text
        .lines()
        .find_map(|l| l.strip_prefix("PYTHONPATH="))
        .expect("PYTHONPATH");
    let (startup, rest) = python_path.split_once(':').expect("two entries");
    assert!(
        Path::new(startup).join("sitecustomize.py").is_file(),
        "{startup}"
    );
    assert_eq!(
        rest, "/theirs",
        "the environment's PYTHONPATH stays after the hook"
    );
    let library = text
        .lines()
        .find_map(|l| l.strip_prefix("FERROCACHE_LIBRARY="))
        .expect("FERROCACHE_LIBRARY");
    assert!(
        library.ends_with("libferrocache.so") && Path::new(library).is_file(),
        "{library}"
    );
}

#[test]
fn the_exit_status_is_the_commands() {
    let dir = scratch("status");
    for code in [0, 1, 3, 255] {
        let script = format!("exit {code}");
        let output = run_in(&dir, &["run", "--", "sh", "-c", &script], &[]);
        assert_eq!(output.status.code(), Some(code), "{}", stderr(&output));
    }
    // Without `--` too.
    let output = run_in(&dir, &["run", "sh", "-c", "exit 4"], &[]);
    assert_eq!(output.status.code(), Some(4), "{}", stderr(&output));
}

#[test]
fn a_command_killed_by_a_signal_ends_the_launcher_the_same_way() {
    let dir = scratch("killed");
    let output = run_in(&dir, &["run", "--", "sh", "-c", "kill -KILL $$"], &[]);
    assert_eq!(output.status.signal(), Some(9), "{output:?}");
}

#[test]
fn sigterm_to_the_launcher_reaches_the_command() {
    let dir = scratch("sigterm");
    let script = "trap 'touch got_term; exit 9' TERM; touch ready; while :; do sleep 0.05; done";
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_ferrocache"))
        .args(["run", "--", "sh", "-c", script])
        .current_dir(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the ferrocache binary runs");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dir.join("ready").exists() {
        assert!(Instant::now() < deadline, "the command never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = i32::try_from(launcher.id()).expect("a pid");
    // SAFETY: a signal to the launcher this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = launcher.wait().expect("the launcher ends");
    assert!(dir.join("got_term").exists(), "the command saw no SIGTERM");
    assert_eq!(status.code(), Some(9));
}

#[test]
fn a_missing_command_is_one_clear_error() {
    let dir = scratch("missing");
    let output = run_in(&dir, &["run", "--", "no-such-command-xyz", "arg"], &[]);
    assert_eq!(output.status.code(), Some(127));
    let err = stderr(&output);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("command not found") && err.contains("no-such-command-xyz"),
        "{err}"
    );
    assert!(!err.contains("panicked"));
}

/// Options, environment, and the words of the refusal.
type RefusedCase = (
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static str,
);

#[test]
fn refused_settings_stop_before_the_command_starts() {
    let dir = scratch("refused");
    let start = "touch started";
    let cases: [RefusedCase; 5] = [
        (
            &["--conf", "max_split_size_mb:lots"],
            &[],
            "max_split_size_mb",
        ),
        (
            &[],
            &[("PYTORCH_CUDA_ALLOC_CONF", "no_such_key:1")],
            "no_such_key",
        ),
        (
            &["--log-level", "loud"],
            &[],
            "Unknown TORCH_CUDA_ALLOC_LOG_LEVEL value 'loud'",
        ),
        (
            &["--snapshot-on-oom", "oom_{host}.pickle"],
            &[],
            "unknown placeholder(s) {host}",
        ),
        (&["--report", "oom.json"], &[], "expected json:PATH"),
    ];
    for (options, env, words) in cases {
        let mut args = vec!["run"];
        args.extend_from_slice(options);
        args.extend_from_slice(&["--", "sh", "-c", start]);
        let output = Command::new(env!("CARGO_BIN_EXE_ferrocache"))
            .args(&args)
            .current_dir(&dir)
            .env_remove("PYTORCH_CUDA_ALLOC_CONF")
            .envs(env.iter().copied())
            .output()
            .expect("the ferrocache binary runs");
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
        let err = stderr(&output);
        assert!(err.contains(words), "{args:?}: {err}");
        assert!(
            !dir.join("started").exists(),
            "{args:?} started the command"
        );
    }
    // The words are PyTorch's, as check-config gives them.
    let check = ferrocache(&["check-config", "max_split_size_mb:lots"]);
    let pytorch = stderr(&check);
    let message = pytorch.split_once(": ").map(|(_, m)| m).unwrap_or("");
    let message = message.split_once(": ").map_or(message, |(_, m)| m).trim();
    let output = run_in(
        &dir,
        &["run", "--conf", "max_split_size_mb:lots", "--", "true"],
        &[],
    );
    assert!(
        !message.is_empty() && stderr(&output).contains(message),
        "{message:?} in {}",
        stderr(&output)
    );
}

fn python() -> Option<&'static str> {
    ["python3", "python"].into_iter().find(|name| {
        Command::new(name)
            .args(["-c", "pass"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

#[test]
fn a_python_process_without_torch_gets_the_hook_and_its_own_sitecustomize() {
    let Some(python) = python() else {
        eprintln!("skipped: no python on PATH");
        return;
    };
    let dir = scratch("python");
    std::fs::create_dir_all(dir.join("theirs")).expect("a folder");
    std::fs::write(
        dir.join("theirs/sitecustomize.py"),
        "import builtins\nbuiltins.THEIR_HOOK_RAN = True\n",
    )
    .expect("a sitecustomize");
    let theirs = dir.join("theirs").display().to_string();
    let code = "import builtins, sys; print(getattr(builtins, 'THEIR_HOOK_RAN', False), \
                'ferrocache' in sys.modules, 'torch' in sys.modules)";
    let output = run_in(
        &dir,
        &["run", "--", python, "-c", code],
        &[("PYTHONPATH", &theirs)],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    // Their hook ran; ferrocache was not even imported, and no report was written.
    assert_eq!(stdout(&output).trim(), "True False False");
    assert_eq!(stderr(&output), "");
}

#[test]
fn a_process_where_ferrocache_cannot_be_installed_runs_on_with_one_warning() {
    let Some(python) = python() else {
        eprintln!("skipped: no python on PATH");
        return;
    };
    let dir = scratch("cpu-torch");
    // A PyTorch built without CUDA, as far as install() asks.
    std::fs::create_dir_all(dir.join("cpu/torch")).expect("a folder");
    std::fs::write(
        dir.join("cpu/torch/__init__.py"),
        "__version__ = '2.15.0+cpu'\nclass version:\n    cuda = None\n",
    )
    .expect("a fake torch");
    let cpu = dir.join("cpu").display().to_string();
    let output = run_in(
        &dir,
        &[
            "run",
            "--",
            python,
            "-c",
            "import torch, sys; print(torch.__version__); sys.exit(5)",
        ],
        &[("PYTHONPATH", &cpu)],
    );
    assert_eq!(output.status.code(), Some(5), "{}", stderr(&output));
    assert_eq!(stdout(&output).trim(), "2.15.0+cpu");
    let err = stderr(&output);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("[WARN] Allocator: ferrocache run: ferrocache is not installed")
            && err.contains("without CUDA"),
        "{err}"
    );
    // A log level above WARN silences it, as it silences ferrocache's other warnings.
    let output = run_in(
        &dir,
        &[
            "run",
            "--log-level",
            "error",
            "--",
            python,
            "-c",
            "import torch",
        ],
        &[("PYTHONPATH", &cpu)],
    );
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert_eq!(stderr(&output), "");
}
