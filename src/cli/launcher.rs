//! `ferrocache run [options] -- COMMAND [ARGS...]`: runs COMMAND with ferrocache installed in
//! every Python process of it that imports torch, and a report from each at its exit.
//!
//! Nothing here touches the program: the launcher only prepares the child's environment.
//! - `PYTHONPATH` starts with the package's `_startup/` folder, whose `sitecustomize.py` arms an
//!   import hook on `torch` (and chains the environment's own `sitecustomize`); once `torch` is
//!   imported, `ferrocache._run` calls `install()` and registers the report at exit. Every
//!   Python process of the command inherits it: `torchrun`'s ranks, `multiprocessing`'s spawned
//!   children, console scripts, `python -m`.
//! - `FERROCACHE_LIBRARY` names this very library, so that the child's package loads the build
//!   the launcher came from (a wheel, `pip install .`, or `cargo run`).
//! - The options become the variables `install()` reads ([`forwarded_variables`]).
//!
//! The settings are checked here, before the command starts, with PyTorch's words. The child's
//! exit status is the launcher's; a signal that kills it is raised again on the launcher. Signals
//! sent to the launcher (a scheduler's SIGTERM) are passed to the child; a Ctrl-C from the
//! terminal reaches the child directly (the terminal signals the whole foreground group), so the
//! launcher passes on only those sent to it alone.

use super::USAGE_ERROR;
use super::rows::JobRow;
use super::table::{aligned_lines, job_table};
use crate::config::{self, Config, LogLevel};
use crate::env::{self, Variable};
use crate::replay::JobSummary;
use clap::Args;
use serde::Deserialize;
use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::SystemTime;

#[derive(Args)]
#[command(trailing_var_arg = true)]
pub(super) struct RunArgs {
    /// A PYTORCH_CUDA_ALLOC_CONF value for the command (as install(conf=...)); one PyTorch
    /// rejects stops here, before the command starts.
    #[arg(long, value_name = "CONF")]
    conf: Option<String>,
    /// Cross-stream reuse on (FERROCACHE_CROSS_STREAM=1; as install(cross_stream=True)).
    #[arg(long)]
    cross_stream: bool,
    /// TORCH_CUDA_ALLOC_LOG_LEVEL for the command: OFF, ERROR, WARN, INFO, DEBUG, TRACE.
    #[arg(long, value_name = "LEVEL")]
    log_level: Option<String>,
    /// Record the allocation history and write a snapshot here at the first out-of-memory
    /// (FERROCACHE_SNAPSHOT_ON_OOM). {rank}, {local_rank} and {pid} are replaced; without
    /// them, each rank of a job of several writes <stem>_rank<N><ext>.
    #[arg(long, value_name = "PATH")]
    snapshot_on_oom: Option<String>,
    /// Keep the allocation history, so that the report says which PYTORCH_CUDA_ALLOC_CONF
    /// would have reserved least (ferrocache.advise()) and what it would have saved.
    #[arg(long)]
    record: bool,
    /// Also write each process's report as JSON: json:PATH (one file per rank, named as
    /// --snapshot-on-oom names them).
    #[arg(long, value_name = "json:PATH", value_parser = parse_report)]
    report: Option<String>,
    /// No report at exit.
    #[arg(long)]
    quiet: bool,
    /// The command and its arguments (after --).
    #[arg(value_name = "COMMAND", required = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// The folder of the package that holds the startup hook.
const STARTUP_DIR: &str = "_startup";
/// The exit status when COMMAND is not found, and when it cannot be run (a shell's).
const NOT_FOUND: u8 = 127;
const NOT_EXECUTABLE: u8 = 126;

fn parse_report(text: &str) -> Result<String, String> {
    match text.strip_prefix("json:") {
        Some(path) if !path.is_empty() => check_placeholders(path).map(|()| path.to_string()),
        _ => Err(format!(
            "expected json:PATH (a file for each process's report), got {text:?}"
        )),
    }
}

/// The placeholders a per-rank path may hold (`python/ferrocache/_ranks.py`, `PLACEHOLDERS`).
const PLACEHOLDERS: [&str; 3] = ["rank", "local_rank", "pid"];

/// Refuses a path with a placeholder other than `{rank}`, `{local_rank}` and `{pid}`, or an
/// unmatched brace (`{{` and `}}` are braces), in the words of `_ranks.check_path`.
fn check_placeholders(path: &str) -> Result<(), String> {
    let mut rest = path;
    while let Some(at) = rest.find(['{', '}']) {
        let (brace, after) = (&rest[at..at + 1], &rest[at + 1..]);
        if after.starts_with(brace) {
            rest = &after[1..];
            continue;
        }
        if brace == "}" {
            return Err(format!(
                "path {path:?}: Single '}}' encountered in format string (write {{{{ and }}}} \
                 for braces)"
            ));
        }
        let Some(end) = after.find('}') else {
            return Err(format!(
                "path {path:?}: expected '}}' before end of string (write {{{{ and }}}} for \
                 braces)"
            ));
        };
        let field = &after[..end];
        if !PLACEHOLDERS.contains(&field) {
            return Err(format!(
                "path {path:?} has unknown placeholder(s) {{{field}}}; the placeholders are \
                 {{rank}}, {{local_rank}} and {{pid}}"
            ));
        }
        rest = &after[end + 1..];
    }
    Ok(())
}

/// The variables the options set in the child, each the one `install()` reads for its
/// argument of the same name.
/// Each is a row of [`env::TABLE`] whose `run_option` names the option.
fn forwarded_variables(args: &RunArgs, run_dir: &Path) -> Vec<(&'static str, OsString)> {
    let mut vars: Vec<(&'static str, OsString)> = Vec::new();
    let mut set = |variable: Variable, value: OsString| vars.push((variable.name, value));
    if let Some(conf) = &args.conf {
        set(env::ALLOC_CONF, conf.into());
    }
    if args.cross_stream {
        set(env::CROSS_STREAM, "1".into());
    }
    if let Some(level) = &args.log_level {
        set(env::LOG_LEVEL, level.into());
    }
    if let Some(path) = &args.snapshot_on_oom {
        set(env::SNAPSHOT_ON_OOM, path.into());
    }
    if args.record {
        set(env::RUN_RECORD, "1".into());
    }
    set(env::RUN_REPORT, if args.quiet { "0" } else { "1" }.into());
    if let Some(path) = &args.report {
        set(env::RUN_REPORT_JSON, path.into());
    }
    set(env::RUN_DIR, run_dir.into());
    vars
}

/// Refuses, before anything starts, the settings the child would fail on: PyTorch's
/// `PYTORCH_CUDA_ALLOC_CONF` (as the child will see it: `--conf` or the environment's), the log
/// level, and the snapshot path's placeholders.
fn check_settings(vars: &[(&'static str, OsString)]) -> Result<(), String> {
    let lookup = |name: &str| {
        let given = vars
            .iter()
            .find(|(var, _)| *var == name)
            .map(|(_, v)| v.clone());
        given
            .or_else(|| env::lookup_os(name))
            .map(|value| value.to_string_lossy().into_owned())
    };
    Config::from_vars(lookup).map_err(|err| {
        let (name, value) = config::selected_alloc_conf(lookup).unwrap_or_default();
        format!("PyTorch rejects {name}={value:?}: {err}")
    })?;
    LogLevel::from_vars(lookup).map_err(|err| err.to_string())?;
    let snapshot_on_oom = env::SNAPSHOT_ON_OOM.name;
    if let Some(path) = lookup(snapshot_on_oom).filter(|p| !p.trim().is_empty()) {
        check_placeholders(&path).map_err(|err| format!("{snapshot_on_oom}: snapshot {err}"))?;
    }
    Ok(())
}

pub(super) fn run_command(args: &RunArgs) -> u8 {
    let Some((program, program_args)) = args.command.split_first() else {
        complain!("error: ferrocache run: no COMMAND given (ferrocache run -- python train.py)");
        return USAGE_ERROR;
    };
    let startup = match startup_dir() {
        Ok(dir) => dir,
        Err(message) => {
            complain!("error: ferrocache run: {message}");
            return USAGE_ERROR;
        }
    };
    let run_dir = RunDir::create();
    let vars = forwarded_variables(args, run_dir.path());
    if let Err(message) = check_settings(&vars) {
        complain!("error: ferrocache run: {message}; the command was not started");
        return USAGE_ERROR;
    }
    let mut command = Command::new(program);
    command
        .args(program_args)
        .envs(vars.iter().map(|(k, v)| (k, v)));
    command.env(env::PYTHONPATH.name, python_path(&startup));
    if env::lookup_os(env::LIBRARY.name).is_none()
        && let Some(library) = own_library()
    {
        command.env(env::LIBRARY.name, library);
    }
    let started = SystemTime::now();
    forward_signals();
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => return not_started(program, &err),
    };
    let pid = i32::try_from(child.id()).unwrap_or(0);
    CHILD.store(pid, Ordering::SeqCst);
    let early = PENDING.swap(0, Ordering::SeqCst);
    if early > 0 {
        // SAFETY: `pid` is the child just spawned and not yet reaped.
        unsafe {
            libc::kill(pid, early);
        }
    }
    let status = child.wait();
    CHILD.store(0, Ordering::SeqCst);
    let status = match status {
        Ok(status) => status,
        Err(err) => {
            complain!("error: ferrocache run: waiting for the command failed: {err}");
            return 1;
        }
    };
    if !args.quiet {
        print_job_rows(run_dir.path(), args.conf.as_deref(), started);
    }
    drop(run_dir);
    exit_status(status)
}

/// One line for a command that cannot be started, and the shell's status for it.
fn not_started(program: &OsStr, err: &std::io::Error) -> u8 {
    let name = program.to_string_lossy();
    if err.kind() == std::io::ErrorKind::NotFound {
        complain!(
            "error: ferrocache run: command not found: {name:?} (not a file, and not on PATH)"
        );
        NOT_FOUND
    } else {
        complain!("error: ferrocache run: cannot run {name:?}: {err}");
        NOT_EXECUTABLE
    }
}

/// The child's exit status as the launcher's; a signal that ended the child ends the launcher
/// the same way (so that a shell or a scheduler sees what happened), else 128 + the signal.
fn exit_status(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        return u8::try_from(code & 0xff).unwrap_or(1);
    }
    let signal = status.signal().unwrap_or(0);
    if signal > 0 {
        // SAFETY: restoring the default disposition and raising a signal on this process are
        // plain libc calls with valid arguments; nothing else runs in between that relies on
        // the handler.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
    }
    128u8.wrapping_add(u8::try_from(signal).unwrap_or(0))
}

/// The child's pid while it runs (0 before and after): the signal handler's state, with
/// [`PENDING`].
static CHILD: AtomicI32 = AtomicI32::new(0);
/// A signal that came before the child's pid was known (between spawn and the store), passed
/// on as soon as it is.
static PENDING: AtomicI32 = AtomicI32::new(0);
/// The signals passed to the child.
const FORWARDED_SIGNALS: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// The handler: passes the signal to the child. SIGINT and SIGQUIT that the terminal sent
/// (si_code > 0, from the kernel) already reached the child, which is in the same foreground
/// process group: passed again, Python would see a second KeyboardInterrupt. Only
/// async-signal-safe calls here (an atomic load and kill).
extern "C" fn pass_to_child(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    _context: *mut libc::c_void,
) {
    // SAFETY: the kernel hands a valid siginfo_t to an SA_SIGINFO handler.
    let from_terminal = !info.is_null() && unsafe { (*info).si_code } > 0;
    if from_terminal && (signal == libc::SIGINT || signal == libc::SIGQUIT) {
        return;
    }
    let child = CHILD.load(Ordering::SeqCst);
    if child <= 0 {
        PENDING.store(signal, Ordering::SeqCst);
        return;
    }
    // SAFETY: kill is async-signal-safe; `child` is the pid of the child not yet reaped.
    unsafe {
        libc::kill(child, signal);
    }
}

fn forward_signals() {
    for signal in FORWARDED_SIGNALS {
        // SAFETY: a zeroed sigaction is valid; it gets a handler of the SA_SIGINFO type, an
        // empty mask and SA_RESTART so that waitpid resumes after the handler.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = pass_to_child as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The library this code runs in (`libferrocache.so`), asked of the dynamic loader.
fn own_library() -> Option<PathBuf> {
    // SAFETY: dladdr only reads the loader's tables; `info` is written by it before use.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let address = own_library as *const () as *const libc::c_void;
    // SAFETY: `address` is a function of this object and `info` a valid out-parameter.
    if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr succeeded, so dli_fname is a NUL-terminated path owned by the loader.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
    let is_library = path.extension().is_some_and(|extension| extension == "so");
    is_library.then(|| path.canonicalize().unwrap_or(path))
}

/// Where the Python package is, beside the library: a wheel (and `pip install .`) puts the
/// library in `site-packages/ferrocache.libs/` next to `site-packages/ferrocache/`; a cargo
/// build runs from the checkout, whose package is `python/ferrocache`.
fn package_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(library) = own_library()
        && let Some(libs) = library.parent()
        && libs
            .file_name()
            .is_some_and(|name| name == "ferrocache.libs")
        && let Some(site) = libs.parent()
    {
        dirs.push(site.join("ferrocache"));
    }
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/ferrocache"));
    dirs
}

/// The folder with the startup hook, or why there is none.
fn startup_dir() -> Result<PathBuf, String> {
    let candidates = package_dirs();
    candidates
        .iter()
        .map(|package| package.join(STARTUP_DIR))
        .find(|dir| dir.join("sitecustomize.py").is_file())
        .ok_or_else(|| {
            let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            format!(
                "ferrocache's Python package was not found (looked in {}): install it with \
                 `pip install .` or from a wheel",
                looked.join(", ")
            )
        })
}

/// The child's `PYTHONPATH`: the startup hook first, then what the environment had.
fn python_path(startup: &Path) -> OsString {
    let mut path = OsString::from(startup);
    if let Some(existing) = env::lookup_os(env::PYTHONPATH.name).filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(existing);
    }
    path
}

/// The launcher's folder for the processes' JSON reports, removed when dropped.
struct RunDir(PathBuf);

impl RunDir {
    fn create() -> RunDir {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = env::temp_dir().join(format!("ferrocache-run-{}-{nanos:09}", std::process::id()));
        // Without the folder there are no job rows; the command still runs.
        let _ = std::fs::create_dir_all(&dir);
        RunDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the launcher reads of a process's JSON report (`python/ferrocache/_run.py`).
#[derive(Deserialize)]
struct ProcessReport {
    rank: u32,
    world_size: u32,
    devices: Vec<DeviceReport>,
}

#[derive(Deserialize)]
struct DeviceReport {
    peak_reserved_bytes: u64,
    ooms: u64,
}

/// With reports from several ranks, the job's row as `ferrocache replay --job` prints it: the
/// worst rank, the spread and the sum of the ranks' peaks.
fn print_job_rows(run_dir: &Path, conf: Option<&str>, started: SystemTime) {
    let reports: Vec<ProcessReport> = std::fs::read_dir(run_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|modified| modified >= started)
        })
        .filter_map(|entry| std::fs::read(entry.path()).ok())
        .filter_map(|bytes| serde_json::from_slice(&bytes).ok())
        .filter(|report: &ProcessReport| report.world_size > 1)
        .collect();
    let peaks: Vec<(u32, u64)> = reports
        .iter()
        .map(|r| {
            let peak = r.devices.iter().map(|d| d.peak_reserved_bytes).max();
            (r.rank, peak.unwrap_or(0))
        })
        .collect();
    if peaks.len() < 2 {
        return;
    }
    let Some(summary) = JobSummary::of(&peaks) else {
        return;
    };
    let job = JobRow {
        conf: conf.unwrap_or_default().to_string(),
        summary,
        ooms: reports
            .iter()
            .flat_map(|r| &r.devices)
            .map(|d| d.ooms)
            .sum(),
    };
    complain!("ferrocache: the job, from the ranks' reports:");
    for line in aligned_lines(&job_table(&[job]), 1) {
        complain!("  {line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_paths_take_the_three_placeholders_and_doubled_braces() {
        for good in [
            "run.pickle",
            "r{rank}.pickle",
            "{local_rank}-{pid}",
            "a{{b}}c",
        ] {
            assert_eq!(check_placeholders(good), Ok(()), "{good}");
        }
        for bad in ["{host}.json", "a{rank", "a}b", "{}"] {
            assert!(check_placeholders(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn report_takes_json_and_a_path() {
        assert_eq!(parse_report("json:out.json"), Ok("out.json".to_string()));
        assert!(parse_report("out.json").is_err());
        assert!(parse_report("json:").is_err());
        assert!(parse_report("json:{nope}.json").is_err());
    }

    #[test]
    fn the_options_set_exactly_the_rows_of_the_environment_table_that_name_them() {
        use clap::Parser;
        #[derive(Parser)]
        struct Run {
            #[command(flatten)]
            args: RunArgs,
        }
        let every_option = [
            "run",
            "--conf=max_split_size_mb:40",
            "--cross-stream",
            "--log-level=INFO",
            "--snapshot-on-oom=oom.pickle",
            "--record",
            "--report=json:r.json",
            "--",
            "python",
        ];
        let run = Run::try_parse_from(every_option).expect("the options parse");
        let mut set: Vec<&str> = forwarded_variables(&run.args, Path::new("/run"))
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        set.push(env::PYTHONPATH.name); // set beside them, by run_command
        let mut rows: Vec<&str> = env::TABLE
            .iter()
            .filter(|v| v.run_option.is_some())
            .map(|v| v.name)
            .collect();
        set.sort_unstable();
        rows.sort_unstable();
        assert_eq!(set, rows);
    }

    #[test]
    fn exit_codes_pass_through() {
        for code in [0, 1, 3, 255] {
            assert_eq!(exit_status(ExitStatus::from_raw(code << 8)), code as u8);
        }
    }
}
