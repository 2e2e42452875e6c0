//! PyTorch's shareable handle: the bytes `CUDACachingAllocator::shareIpcHandle` writes and
//! `getIpcDevPtr` reads, so that a tensor travels between ferrocache and PyTorch's own
//! allocator in both directions.
//!
//! ```text
//! [version: u8][kind: u8][payload]
//! kind 'c': the 64-byte cudaIpcMemHandle_t of a cudaMalloc allocation's base
//! kind 'e': an expandable segment's pages, a header then one shareable handle per page:
//!   version 2 (torch <= 2.12): { pid: i32, (4 bytes padding), page_size: u64, pages: u64 }
//!   version 3 (torch 2.13 on): the same, then { handle_type: u32, (4 bytes padding) }
//!   each page: an i32 file descriptor of process `pid` (handle type 1, POSIX), or a 64-byte
//!   CUmemFabricHandle (handle type 8, fabric)
//! ```
//!
//! The header is PyTorch's `ShareHeader` struct written whole, in the machine's byte order
//! (little-endian on every platform CUDA runs on): its padding is whatever was in memory, so
//! the parser ignores it, and the writer writes zeros. Version 2 carries no handle type: the
//! receiver takes its own, which is POSIX descriptors unless fabric handles were configured.
//! Exactly 64 bytes is a handle from a PyTorch older than the versions: a bare
//! `cudaIpcMemHandle_t`.

/// The version PyTorch 2.13 and later write (2.15 is the spec); 2.11 and 2.12 write 2.
pub(crate) const CURRENT_VERSION: u8 = 3;
/// The version before the expandable header carried its handle type.
pub(crate) const UNTYPED_VERSION: u8 = 2;

const CUDA_MALLOC: u8 = b'c';
const EXPANDABLE_SEGMENT: u8 = b'e';
const MEMORY_HANDLE_SIZE: usize = 64;
const FABRIC_HANDLE_SIZE: usize = 64;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` and `CU_MEM_HANDLE_TYPE_FABRIC`.
const POSIX_FILE_DESCRIPTOR: u32 = 1;
const FABRIC: u32 = 8;
/// `sizeof(ShareHeader)`: pid, padding, page size, page count; version 3 adds the handle type
/// and padding.
const UNTYPED_HEADER_SIZE: usize = 24;
const TYPED_HEADER_SIZE: usize = 32;

/// One page's shareable handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PageHandle {
    /// A file descriptor number in the sending process.
    FileDescriptor(i32),
    Fabric([u8; FABRIC_HANDLE_SIZE]),
}

/// What a handle names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SharedMemory {
    /// A `cuMemAlloc` allocation, by its memory handle.
    Allocation([u8; MEMORY_HANDLE_SIZE]),
    /// Pages of `page_size` bytes, mapped in this order, of process `pid`.
    Pages {
        pid: i32,
        page_size: u64,
        pages: Vec<PageHandle>,
    },
}

/// The bytes of `memory` in the format of PyTorch `version` (2 or 3). Pages must all be of
/// one kind (a sender uses one handle type).
pub(crate) fn write(memory: &SharedMemory, version: u8) -> Vec<u8> {
    let mut out = vec![version];
    match memory {
        SharedMemory::Allocation(handle) => {
            out.push(CUDA_MALLOC);
            out.extend_from_slice(handle);
        }
        SharedMemory::Pages {
            pid,
            page_size,
            pages,
        } => {
            out.push(EXPANDABLE_SEGMENT);
            out.extend_from_slice(&pid.to_ne_bytes());
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&page_size.to_ne_bytes());
            out.extend_from_slice(&(pages.len() as u64).to_ne_bytes());
            if version >= CURRENT_VERSION {
                let handle_type = match pages.first() {
                    Some(PageHandle::Fabric(_)) => FABRIC,
                    _ => POSIX_FILE_DESCRIPTOR,
                };
                out.extend_from_slice(&handle_type.to_ne_bytes());
                out.extend_from_slice(&[0; 4]);
            }
            for page in pages {
                match page {
                    PageHandle::FileDescriptor(fd) => out.extend_from_slice(&fd.to_ne_bytes()),
                    PageHandle::Fabric(bytes) => out.extend_from_slice(bytes),
                }
            }
        }
    }
    out
}

/// Reads a handle PyTorch (any version up to [`CURRENT_VERSION`]) or ferrocache wrote.
/// `fabric_by_default`: how a version-2 expandable handle's pages are read (the receiver's
/// own handle type, as PyTorch reads them).
pub(crate) fn parse(bytes: &[u8], fabric_by_default: bool) -> Result<SharedMemory, String> {
    if bytes.len() == MEMORY_HANDLE_SIZE {
        return Ok(SharedMemory::Allocation(array(bytes)));
    }
    let mut reader = Reader { bytes, at: 0 };
    let version = reader.u8()?;
    if version > CURRENT_VERSION {
        return Err(format!(
            "received sharable handle from a future version of torch that this version does not \
             know how to handle (handle version {version}, this one reads up to \
             {CURRENT_VERSION})"
        ));
    }
    let memory = match reader.u8()? {
        CUDA_MALLOC => SharedMemory::Allocation(array(reader.take(MEMORY_HANDLE_SIZE)?)),
        EXPANDABLE_SEGMENT => {
            let typed = version >= CURRENT_VERSION;
            let header = reader.take(if typed {
                TYPED_HEADER_SIZE
            } else {
                UNTYPED_HEADER_SIZE
            })?;
            let pid = i32::from_ne_bytes(array(&header[0..4]));
            let page_size = u64::from_ne_bytes(array(&header[8..16]));
            let count = u64::from_ne_bytes(array(&header[16..24]));
            let handle_type = if typed {
                u32::from_ne_bytes(array(&header[24..28]))
            } else if fabric_by_default {
                FABRIC
            } else {
                POSIX_FILE_DESCRIPTOR
            };
            let page_bytes = match handle_type {
                POSIX_FILE_DESCRIPTOR => 4,
                FABRIC => FABRIC_HANDLE_SIZE,
                other => return Err(format!("unknown shareable handle type {other}")),
            };
            // The count is checked against the bytes there before anything is allocated.
            let room = (bytes.len() - reader.at) / page_bytes;
            if count > room as u64 || page_size == 0 {
                return Err(format!(
                    "an expandable segment handle of {count} pages of {page_size} bytes, in {} \
                     bytes",
                    bytes.len()
                ));
            }
            let mut pages = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let page = reader.take(page_bytes)?;
                pages.push(if handle_type == FABRIC {
                    PageHandle::Fabric(array(page))
                } else {
                    PageHandle::FileDescriptor(i32::from_ne_bytes(array(page)))
                });
            }
            SharedMemory::Pages {
                pid,
                page_size,
                pages,
            }
        }
        other => {
            return Err(format!(
                "unexpected or ill-formed shareable handle type {other:#04x}"
            ));
        }
    };
    if reader.at != bytes.len() {
        return Err(format!(
            "{} bytes after the end of a shareable handle",
            bytes.len() - reader.at
        ));
    }
    Ok(memory)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(len)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "a shareable handle cut short: {} bytes, more expected",
                    self.bytes.len()
                )
            })?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
}

/// The first `N` bytes of `bytes` (which has at least that many).
fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(&bytes[..N]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from_hex(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn an_expandable_handle_written_by_pytorch_2_15_parses_padding_and_all() {
        // torch 2.15's shareIpcHandle for a 24 MiB tensor under expandable_segments:True on
        // the fake CUDA (storage._share_cuda_()[1]): pid 6710, two 20 MiB pages, POSIX
        // descriptors 9 and 11.
        let bytes = from_hex(concat!(
            "0365",
            "361a0000",
            "00000000",
            "0000400100000000",
            "0200000000000000",
            "01000000",
            "00000000",
            "09000000",
            "0b000000"
        ));
        assert_eq!(
            parse(&bytes, false),
            Ok(SharedMemory::Pages {
                pid: 6710,
                page_size: 20 << 20,
                pages: vec![
                    PageHandle::FileDescriptor(9),
                    PageHandle::FileDescriptor(11)
                ],
            })
        );
        // Its padding held whatever was in memory; it is ignored.
        let bytes = from_hex(concat!(
            "0365361a0000207f0000000020000000000001000000000000000100",
            "0000207f000005000000"
        ));
        assert_eq!(
            parse(&bytes, false),
            Ok(SharedMemory::Pages {
                pid: 6710,
                page_size: 2 << 20,
                pages: vec![PageHandle::FileDescriptor(5)],
            })
        );
    }

    #[test]
    fn a_cuda_malloc_handle_written_by_pytorch_2_15_parses() {
        let mut bytes = vec![3, b'c'];
        let memory_handle: Vec<u8> = (0..64).collect();
        bytes.extend_from_slice(&memory_handle);
        assert_eq!(
            parse(&bytes, false),
            Ok(SharedMemory::Allocation(array(&memory_handle)))
        );
        // Older versions, and a bare handle from before the versions.
        bytes[0] = 2;
        assert!(matches!(
            parse(&bytes, false),
            Ok(SharedMemory::Allocation(_))
        ));
        assert!(matches!(
            parse(&memory_handle, false),
            Ok(SharedMemory::Allocation(_))
        ));
    }

    #[test]
    fn what_is_written_parses_back_in_both_versions() {
        let memories = [
            SharedMemory::Allocation([7; 64]),
            SharedMemory::Pages {
                pid: 1234,
                page_size: 2 << 20,
                pages: (3..40).map(PageHandle::FileDescriptor).collect(),
            },
            SharedMemory::Pages {
                pid: 99,
                page_size: 1 << 30,
                pages: vec![PageHandle::Fabric([5; 64]), PageHandle::Fabric([6; 64])],
            },
        ];
        for memory in &memories {
            assert_eq!(
                parse(&write(memory, CURRENT_VERSION), false).as_ref(),
                Ok(memory)
            );
        }
        // Version 2 carries no handle type: the receiver's own decides.
        for (memory, fabric) in [
            (&memories[0], false),
            (&memories[1], false),
            (&memories[2], true),
        ] {
            assert_eq!(
                parse(&write(memory, UNTYPED_VERSION), fabric).as_ref(),
                Ok(memory)
            );
        }
    }

    #[test]
    fn the_header_is_pytorchs_struct_with_zeroed_padding() {
        let bytes = write(
            &SharedMemory::Pages {
                pid: 0x0102_0304,
                page_size: 2 << 20,
                pages: vec![PageHandle::FileDescriptor(5)],
            },
            CURRENT_VERSION,
        );
        let expected = from_hex(concat!(
            "0365",
            "04030201",
            "00000000",
            "0000200000000000",
            "0100000000000000",
            "01000000",
            "00000000",
            "05000000"
        ));
        assert_eq!(bytes, expected);
    }

    #[test]
    fn broken_handles_are_refused_with_a_reason() {
        let cases: [(&[u8], &str); 6] = [
            (&[], "cut short"),
            (&[4, b'c'], "future version"),
            (&[3, b'x', 0], "shareable handle type 0x78"),
            (&[3, b'c', 1, 2, 3], "cut short"),
            (
                &[
                    3, b'e', 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0, 0, 0, 0, 255, 255, 255, 255,
                    255, 255, 255, 255, 1, 0, 0, 0, 0, 0, 0, 0,
                ],
                "pages of",
            ),
            (
                &[
                    3, b'e', 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0,
                    0, 2, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0,
                ],
                "handle type 2",
            ),
        ];
        for (bytes, why) in cases {
            let refused = parse(bytes, false).expect_err("refused");
            assert!(refused.contains(why), "{bytes:?}: {refused}");
        }
        let mut trailing = write(&SharedMemory::Allocation([1; 64]), CURRENT_VERSION);
        trailing.push(0);
        assert!(
            parse(&trailing, false)
                .unwrap_err()
                .contains("after the end")
        );
    }
}
