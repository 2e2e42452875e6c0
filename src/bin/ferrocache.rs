//! The `ferrocache` command. The program is `ferrocache::cli`, in the library: this binary
//! hands its arguments to `ferrocache_cli_main` in `libferrocache.so`, to which it is linked
//! dynamically (see `build.rs`). So the cargo binary and the wheel's console command are one
//! program, and maturin, which packages binaries, copies the library the binary needs into the
//! wheel (docs/python.md, "Packaging").

use std::ffi::{CString, c_char, c_int};
use std::os::unix::ffi::OsStringExt;
use std::process::ExitCode;

#[link(name = "ferrocache", kind = "dylib")]
unsafe extern "C" {
    /// `src/ffi/strings.rs`: runs the command line and returns its exit status.
    fn ferrocache_cli_main(argc: c_int, argv: *const *const c_char) -> c_int;
}

fn main() -> ExitCode {
    // An argument from the operating system never holds a NUL byte, so none is dropped here.
    let args: Vec<CString> = std::env::args_os()
        .filter_map(|arg| CString::new(arg.into_vec()).ok())
        .collect();
    let argv: Vec<*const c_char> = args.iter().map(|arg| arg.as_ptr()).collect();
    let argc = c_int::try_from(argv.len()).unwrap_or(c_int::MAX);
    // SAFETY: `argv` holds `argc` pointers to NUL-terminated strings that outlive the call.
    let status = unsafe { ferrocache_cli_main(argc, argv.as_ptr()) };
    ExitCode::from(u8::try_from(status).unwrap_or(1))
}
