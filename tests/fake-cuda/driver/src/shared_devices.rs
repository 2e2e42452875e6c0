//! Device memory shared by the processes of one machine (`FAKE_LIBCUDA_SHARED_DEVICES=path`), as
//! a real GPU's memory is: what one process gives back, another can allocate.
//!
//! Without the variable each process has its own fake devices. With it, every process that
//! names the same file books there the bytes it holds on each device, one line `PID DEVICE
//! BYTES` per process and device, and counts the others' lines against the capacity: in
//! `cuMemGetInfo`'s free bytes, in the out-of-memory answer of `cuMemAlloc` and `cuMemCreate`,
//! and in NVML's list of the processes on a GPU. Each update takes an exclusive `flock` on the
//! file (opened afresh each time: a lock belongs to an open file description, which a forked
//! child would share), so checking the room and booking the bytes are one step, whichever
//! process comes first.
//!
//! A process that exits or crashes leaves its lines behind: they are dropped by the next reader
//! that finds the pid dead (`kill(pid, 0)` answers `ESRCH`, or `/proc/PID/stat` says zombie).
//! A process that exits normally removes its own lines. A child forked after the driver started
//! holds a copy of its parent's state (the fake's device memory is host memory, copied by the
//! fork), so from its first booking on it books, under its own pid, what that copy holds.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;

/// Where the processes of one machine book their device memory.
pub struct SharedDevices {
    path: PathBuf,
}

/// One line of the file: what process `pid` holds on `device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    pid: u32,
    device: i32,
    bytes: u64,
}

/// The file's lines, under its lock.
struct Table {
    entries: Vec<Entry>,
    changed: bool,
}

impl Table {
    fn parse(text: &str) -> Table {
        let entries = text
            .lines()
            .filter_map(|line| {
                let mut fields = line.split_whitespace();
                let entry = Entry {
                    pid: fields.next()?.parse().ok()?,
                    device: fields.next()?.parse().ok()?,
                    bytes: fields.next()?.parse().ok()?,
                };
                fields.next().is_none().then_some(entry)
            })
            .collect();
        Table {
            entries,
            changed: false,
        }
    }

    fn render(&self) -> String {
        self.entries
            .iter()
            .map(|e| format!("{} {} {}\n", e.pid, e.device, e.bytes))
            .collect()
    }

    /// Drops the lines of processes that are gone.
    fn drop_dead(&mut self) {
        let before = self.entries.len();
        self.entries.retain(|entry| process_alive(entry.pid));
        self.changed |= self.entries.len() != before;
    }

    /// What processes other than `me` hold on `device`.
    fn others(&self, me: u32, device: i32) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.entries
            .iter()
            .filter(move |e| e.pid != me && e.device == device)
            .map(|e| (e.pid, e.bytes))
    }

    /// Books `bytes` as what `me` holds on `device` (no line for 0).
    fn set(&mut self, me: u32, device: i32, bytes: u64) {
        let old = self.entries.clone();
        self.entries
            .retain(|e| !(e.pid == me && e.device == device));
        if bytes > 0 {
            self.entries.push(Entry {
                pid: me,
                device,
                bytes,
            });
        }
        self.changed |= self.entries != old;
    }
}

/// Whether `pid` is a live process (a zombie is not: it holds nothing any more).
fn process_alive(pid: u32) -> bool {
    let Ok(pid_t) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 checks only that the process exists; nothing is sent.
    if unsafe { libc::kill(pid_t, 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    // "PID (comm) STATE ...": the state follows the last ')'.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_none_or(|(_, rest)| !rest.trim_start().starts_with('Z')),
        Err(_) => true,
    }
}

impl SharedDevices {
    /// The file `FAKE_LIBCUDA_SHARED_DEVICES` names, if it is set and can be opened (said on
    /// stderr otherwise: each process then has its own devices).
    pub fn from_environment() -> Option<SharedDevices> {
        let path = std::env::var_os("FAKE_LIBCUDA_SHARED_DEVICES").filter(|p| !p.is_empty())?;
        let shared = SharedDevices { path: path.into() };
        match shared.open() {
            Ok(_) => Some(shared),
            Err(error) => {
                eprintln!(
                    "fake-cuda: FAKE_LIBCUDA_SHARED_DEVICES={}: {error}; this process's devices \
                     are its own",
                    shared.path.display()
                );
                None
            }
        }
    }

    fn open(&self) -> std::io::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&self.path)
    }

    /// Runs `body` on the table under an exclusive lock, dead processes dropped; writes the
    /// table back if it changed. An I/O error is said on stderr and answers `None`.
    fn with_table<R>(&self, body: impl FnOnce(&mut Table) -> R) -> Option<R> {
        let result = (|| -> std::io::Result<R> {
            let mut file = self.open()?;
            // SAFETY: a plain syscall on our own open fd; the lock goes when `file` is closed.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut text = String::new();
            file.read_to_string(&mut text)?;
            let mut table = Table::parse(&text);
            table.drop_dead();
            let answer = body(&mut table);
            if table.changed {
                file.seek(SeekFrom::Start(0))?;
                file.set_len(0)?;
                file.write_all(table.render().as_bytes())?;
            }
            Ok(answer)
        })();
        result
            .map_err(|error| {
                eprintln!(
                    "fake-cuda: FAKE_LIBCUDA_SHARED_DEVICES={}: {error}; other processes' memory \
                     not counted",
                    self.path.display()
                );
            })
            .ok()
    }

    /// The other live processes on `device` and the bytes each holds there.
    pub fn others(&self, device: i32) -> Vec<(u32, u64)> {
        let me = std::process::id();
        self.with_table(|table| table.others(me, device).collect())
            .unwrap_or_default()
    }

    /// Books `ours + size` bytes as this process's on `device` if, with the other processes'
    /// bytes and `outside` more (bytes no process here books), that fits in `capacity`; whether
    /// it did. One step under the lock, so two processes cannot both take the last bytes.
    pub fn try_book(&self, device: i32, ours: u64, size: u64, outside: u64, capacity: u64) -> bool {
        let me = std::process::id();
        self.with_table(|table| {
            let others: u64 = table.others(me, device).map(|(_, bytes)| bytes).sum();
            let free = capacity
                .saturating_sub(ours)
                .saturating_sub(others)
                .saturating_sub(outside);
            if free < size {
                return false;
            }
            table.set(me, device, ours + size);
            true
        })
        // The file failed us (said on stderr): the process goes on with its own devices.
        .unwrap_or(ours + size + outside <= capacity)
    }

    /// Books `bytes` as what this process holds on `device`.
    pub fn book(&self, device: i32, bytes: u64) {
        let me = std::process::id();
        self.with_table(|table| table.set(me, device, bytes));
    }

    /// Removes this process's lines: it is exiting.
    pub fn leave(&self) {
        let me = std::process::id();
        self.with_table(|table| {
            let before = table.entries.len();
            table.entries.retain(|e| e.pid != me);
            table.changed |= table.entries.len() != before;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_and_written_back_alike() {
        let table = Table::parse("12 0 4096\nbad line\n13 1 8192\n14 0 1 extra\n");
        assert_eq!(
            table.entries,
            vec![
                Entry {
                    pid: 12,
                    device: 0,
                    bytes: 4096
                },
                Entry {
                    pid: 13,
                    device: 1,
                    bytes: 8192
                },
            ]
        );
        assert_eq!(table.render(), "12 0 4096\n13 1 8192\n");
    }

    #[test]
    fn a_dead_process_holds_nothing() {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("run true");
        let dead = child.id();
        child.wait().expect("wait for true");
        let me = std::process::id();
        let mut table = Table::parse(&format!("{dead} 0 4096\n{me} 0 8192\n"));
        table.drop_dead();
        assert!(table.changed);
        assert_eq!(table.others(0, 0).collect::<Vec<_>>(), vec![(me, 8192)]);
    }

    #[test]
    fn a_zombie_holds_nothing() {
        let child = std::process::Command::new("true")
            .spawn()
            .expect("run true");
        let zombie = child.id();
        // Not waited for: it stays a zombie once it has exited.
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!process_alive(zombie));
        assert!(process_alive(std::process::id()));
        drop(child);
    }

    #[test]
    fn booking_checks_the_room_left_by_the_others() {
        let path = std::env::temp_dir().join(format!("fake-cuda-shared-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        // A live process other than this one: the parent of the test harness.
        // SAFETY: getppid has no preconditions.
        let parent = unsafe { libc::getppid() };
        std::fs::write(&path, format!("{parent} 0 600\n")).expect("write the table");
        let shared = SharedDevices { path: path.clone() };
        assert_eq!(shared.others(0), vec![(parent as u32, 600)]);
        assert!(!shared.try_book(0, 0, 500, 0, 1000), "600 + 500 > 1000");
        assert!(shared.try_book(0, 0, 400, 0, 1000));
        assert!(!shared.try_book(0, 400, 1, 0, 1000), "full");
        shared.book(0, 100);
        assert!(!shared.try_book(0, 100, 250, 100, 1000), "100 held outside");
        assert!(shared.try_book(0, 100, 200, 100, 1000));
        let text = std::fs::read_to_string(&path).expect("read the table");
        assert!(
            text.contains(&format!("{} 0 300\n", std::process::id())),
            "{text}"
        );
        shared.leave();
        let text = std::fs::read_to_string(&path).expect("read the table");
        assert_eq!(text, format!("{parent} 0 600\n"));
        let _ = std::fs::remove_file(&path);
    }
}
