//! C strings in and out, the library's version, and the `ferrocache` command run in-process.

use std::ffi::{CStr, CString, OsStr, OsString, c_char, c_int};
use std::os::unix::ffi::OsStrExt;

use super::guard::guarded;

/// Hands a string to C; the caller gives it back with [`ferrocache_string_free`].
pub(crate) fn into_c_string(text: String) -> *mut c_char {
    CString::new(text.replace('\0', " "))
        .unwrap_or_default()
        .into_raw()
}

/// A string argument, named `what` in the error for NULL or text that is not UTF-8.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string that outlives the returned reference.
pub(crate) unsafe fn text_argument<'a>(text: *const c_char, what: &str) -> Result<&'a str, String> {
    if text.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: non-NULL, and the caller promises a NUL-terminated string.
    unsafe { CStr::from_ptr(text) }
        .to_str()
        .map_err(|_| format!("{what} is not valid UTF-8"))
}

/// Frees a string that a `ferrocache_*` function returned. NULL does nothing. Never pass it
/// anything else (in particular not `ferrocache_last_error`'s pointer), nor free those with
/// `free()`.
///
/// # Safety
/// `text` is NULL or a string returned by a `ferrocache_*` function and not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_string_free(text: *mut c_char) {
    if text.is_null() {
        return;
    }
    guarded("ferrocache_string_free", (), || {
        // SAFETY: the caller promises `text` came from `into_c_string` (CString::into_raw) and
        // has not been freed.
        drop(unsafe { CString::from_raw(text) });
    });
}

/// The library's version, e.g. `0.1.0`. A static string; do not free it.
#[unsafe(no_mangle)]
pub extern "C" fn ferrocache_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(version) => version,
            Err(_) => panic!("the package version has no NUL inside"),
        };
    guarded("ferrocache_version", c"".as_ptr(), || VERSION.as_ptr())
}

/// The exit status of the command when it panicked, as a Rust program's would be.
const CLI_PANIC_STATUS: c_int = 101;

/// The `ferrocache` command (`replay`, `check-config`; see `docs/replay.md`), run in this
/// process: `argv[0]` is the program's name, output goes to stdout and stderr, and the return
/// value is the exit status. It never exits the process. The `ferrocache` binary is this call
/// and nothing else, so that cargo's binary and the wheel's command are one program.
///
/// # Safety
/// `argv` is NULL (with `argc` 0) or points to `argc` pointers, each NULL or a NUL-terminated
/// string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferrocache_cli_main(argc: c_int, argv: *const *const c_char) -> c_int {
    guarded("ferrocache_cli_main", CLI_PANIC_STATUS, || {
        let count = usize::try_from(argc).unwrap_or(0);
        let mut args: Vec<OsString> = Vec::with_capacity(count);
        for index in 0..count {
            if argv.is_null() {
                break;
            }
            // SAFETY: the caller promises `argc` readable pointers behind a non-NULL `argv`.
            let arg = unsafe { *argv.add(index) };
            if arg.is_null() {
                // Like C's argv, the list ends at a NULL entry.
                break;
            }
            // SAFETY: the caller promises NUL-terminated strings.
            let bytes = unsafe { CStr::from_ptr(arg) }.to_bytes();
            args.push(OsStr::from_bytes(bytes).to_os_string());
        }
        if args.is_empty() {
            args.push("ferrocache".into());
        }
        c_int::from(crate::cli::run(args))
    })
}
