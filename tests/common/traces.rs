//! Where the shared PyTorch snapshots are: `../shared/traces/` beside the checkout. They are read
//! in place (never copied into the project); tests and benchmarks that need them skip, with a
//! note, where that folder is absent.

use std::path::{Path, PathBuf};

/// The shared traces folder, or `None` (with a note on stderr) where this checkout has none.
pub fn traces_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/traces");
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!("note: ../shared/traces not found; skipping what needs the real snapshots");
        None
    }
}
