//! The layout of kernels' parameters, read from the code the program hands the driver: a cubin
//! (the ELF file `ptxas` writes; Triton's `cuModuleLoadData` passes one) or a fat binary (what
//! `nvcc` embeds in a library and registers with `__cudaRegisterFatBinary`), whose cubins may be
//! compressed with zstd (PyTorch's CUDA 13 wheels are).
//!
//! A cubin has one section `.nv.info.<kernel>` per kernel: records of a format byte, an attribute
//! byte and a value; `EIATTR_KPARAM_INFO` (0x17) gives one parameter's ordinal, offset in the
//! parameter buffer and size. The formats (no value, byte, half-word: 4 bytes in all; sized:
//! 4 bytes then the size given) and the fields are those `cuobjdump -elf` prints; the
//! parameters' extents add up to the size in `EIATTR_PARAM_CBANK` for every kernel of torch
//! 2.15's libraries we looked at. What this cannot read (PTX, an LZ4-compressed entry, a
//! malformed file) leaves the kernel without parameter information: it still launches, and its
//! arguments are not scanned.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

/// One kernel parameter: where it lies in the parameter buffer and how big it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    pub offset: u32,
    pub size: u32,
}

/// Parameters of each kernel of one cubin, by the kernel's (mangled) name, in ordinal order.
pub type ParamTable = HashMap<String, Arc<[Param]>>;

const ELF_MAGIC: &[u8] = b"\x7fELF";
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const FATBIN_WRAPPER_MAGIC: u32 = 0x4662_43B1;
const ZSTD_MAGIC: &[u8] = &[0x28, 0xB5, 0x2F, 0xFD];
const FATBIN_KIND_ELF: u16 = 2;
const EIFMT_SVAL: u8 = 4;
const EIATTR_KPARAM_INFO: u8 = 0x17;
const INFO_PREFIX: &str = ".nv.info.";

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// The length of the 64-bit ELF file at `image`: the end of its section header table or of its
/// furthest section, whichever is later. None if it is not one.
///
/// # Safety
/// `image` points to readable memory that holds a whole ELF file, or at least 64 bytes.
pub unsafe fn elf_len(image: *const u8) -> Option<usize> {
    // SAFETY: the caller promises the 64 bytes of an ELF header.
    let header = unsafe { std::slice::from_raw_parts(image, 64) };
    if &header[..4] != ELF_MAGIC || header[4] != 2 {
        return None;
    }
    let table = usize::try_from(u64_at(header, 0x28)?).ok()?;
    let entry = usize::from(u16_at(header, 0x3A)?);
    let count = usize::from(u16_at(header, 0x3C)?);
    let mut end = table.checked_add(entry.checked_mul(count)?)?;
    // SAFETY: the section header table lies within the file the caller promises.
    let headers = unsafe { std::slice::from_raw_parts(image.add(table), entry * count) };
    for k in 0..count {
        let kind = u32_at(headers, k * entry + 4)?;
        let offset = usize::try_from(u64_at(headers, k * entry + 24)?).ok()?;
        let size = usize::try_from(u64_at(headers, k * entry + 32)?).ok()?;
        // SHT_NOBITS (8) takes no room in the file.
        if kind != 8 {
            end = end.max(offset.checked_add(size)?);
        }
    }
    Some(end)
}

/// The parameters of every kernel of the cubin `elf`.
pub fn cubin_params(elf: &[u8]) -> Option<ParamTable> {
    if elf.get(..4)? != ELF_MAGIC || elf[4] != 2 {
        return None;
    }
    let table = usize::try_from(u64_at(elf, 0x28)?).ok()?;
    let entry = usize::from(u16_at(elf, 0x3A)?);
    let count = usize::from(u16_at(elf, 0x3C)?);
    let names_index = usize::from(u16_at(elf, 0x3E)?);
    let section = |k: usize| -> Option<(u32, usize, usize)> {
        let at = table.checked_add(k.checked_mul(entry)?)?;
        let name = u32_at(elf, at)?;
        let offset = usize::try_from(u64_at(elf, at + 24)?).ok()?;
        let size = usize::try_from(u64_at(elf, at + 32)?).ok()?;
        Some((name, offset, size))
    };
    let (_, names_at, names_len) = section(names_index)?;
    let names = elf.get(names_at..names_at.checked_add(names_len)?)?;
    let mut kernels = ParamTable::new();
    for k in 0..count {
        let (name_at, offset, size) = section(k)?;
        let name = names.get(name_at as usize..)?;
        let name = &name[..name.iter().position(|&b| b == 0)?];
        let Some(kernel) = std::str::from_utf8(name)
            .ok()
            .and_then(|n| n.strip_prefix(INFO_PREFIX))
        else {
            continue;
        };
        let records = elf.get(offset..offset.checked_add(size)?)?;
        kernels.insert(kernel.to_owned(), kernel_params(records)?.into());
    }
    Some(kernels)
}

/// The parameters listed in one `.nv.info.<kernel>` section, by ordinal.
fn kernel_params(records: &[u8]) -> Option<Vec<Param>> {
    let mut by_ordinal = Vec::new();
    let mut at = 0;
    while at + 4 <= records.len() {
        let (format, attribute) = (records[at], records[at + 1]);
        if format != EIFMT_SVAL {
            at += 4;
            continue;
        }
        let len = usize::from(u16_at(records, at + 2)?);
        let value = records.get(at + 4..at + 4 + len)?;
        at += 4 + len;
        if attribute == EIATTR_KPARAM_INFO && len >= 12 {
            let ordinal = u16_at(value, 4)?;
            let offset = u32::from(u16_at(value, 6)?);
            let size = u32_at(value, 8)? >> 18;
            by_ordinal.push((ordinal, Param { offset, size }));
        }
    }
    by_ordinal.sort_by_key(|&(ordinal, _)| ordinal);
    Some(by_ordinal.into_iter().map(|(_, param)| param).collect())
}

/// One cubin of a fat binary, by the architecture it was built for.
struct Entry<'a> {
    arch: u32,
    payload: &'a [u8],
    uncompressed: usize,
}

/// The cubins of the fat binary whose data starts at `fatbin`, highest architecture first.
///
/// # Safety
/// `fatbin` points to a fat binary's header and the entries its size covers.
unsafe fn fatbin_entries<'a>(fatbin: *const u8) -> Option<Vec<Entry<'a>>> {
    // SAFETY: the caller promises the 16-byte header.
    let header = unsafe { std::slice::from_raw_parts(fatbin, 16) };
    if u32_at(header, 0)? != FATBIN_MAGIC {
        return None;
    }
    let header_len = usize::from(u16_at(header, 6)?);
    let body_len = usize::try_from(u64_at(header, 8)?).ok()?;
    // SAFETY: the header says how long the entries are; the caller promises them.
    let body = unsafe { std::slice::from_raw_parts(fatbin.add(header_len), body_len) };
    let mut entries = Vec::new();
    let mut at = 0;
    while at + 64 <= body.len() {
        let kind = u16_at(body, at)?;
        let entry_header = usize::try_from(u32_at(body, at + 4)?).ok()?;
        let padded = usize::try_from(u64_at(body, at + 8)?).ok()?;
        let stored = usize::try_from(u64_at(body, at + 16)?).ok()?;
        let arch = u32_at(body, at + 28)?;
        let uncompressed = usize::try_from(u64_at(body, at + 56)?).ok()?;
        let start = at.checked_add(entry_header)?;
        let len = if stored > 0 && stored <= padded {
            stored
        } else {
            padded
        };
        if kind == FATBIN_KIND_ELF {
            entries.push(Entry {
                arch,
                payload: body.get(start..start.checked_add(len)?)?,
                uncompressed,
            });
        }
        at = start.checked_add(padded)?;
    }
    entries.sort_by_key(|e| std::cmp::Reverse(e.arch));
    Some(entries)
}

/// The kernels' parameters of a fat binary registered with `__cudaRegisterFatBinary`, from its
/// first cubin that can be read (the layout is the same for every architecture).
///
/// # Safety
/// `wrapper` is the argument `__cudaRegisterFatBinary` received, whose fat binary is still
/// loaded.
pub unsafe fn fatbin_params(wrapper: *const c_void) -> Option<ParamTable> {
    if wrapper.is_null() {
        return None;
    }
    // SAFETY: the wrapper is { int magic; int version; const void *data; void *filename }.
    let (magic, data) = unsafe {
        (
            wrapper.cast::<u32>().read_unaligned(),
            wrapper
                .cast::<u8>()
                .add(8)
                .cast::<*const u8>()
                .read_unaligned(),
        )
    };
    if magic != FATBIN_WRAPPER_MAGIC || data.is_null() {
        return None;
    }
    // SAFETY: the wrapper's data is the fat binary, still loaded by the caller's promise.
    let entries = unsafe { fatbin_entries(data) }?;
    entries.iter().find_map(|entry| {
        if entry.payload.starts_with(ELF_MAGIC) {
            cubin_params(entry.payload)
        } else if entry.payload.starts_with(ZSTD_MAGIC) {
            cubin_params(&zstd_decompress(entry.payload, entry.uncompressed)?)
        } else {
            None
        }
    })
}

/// The parameters of a module image handed to `cuModuleLoadData` or `cuLibraryLoadData`: a
/// cubin or a fat binary (PTX has none that this reads).
///
/// # Safety
/// `image` points to a whole cubin, fat binary or NUL-terminated PTX text.
pub unsafe fn image_params(image: *const c_void) -> Option<ParamTable> {
    let bytes = image.cast::<u8>();
    // SAFETY: every image the driver accepts is at least 4 bytes long.
    let head = unsafe { std::slice::from_raw_parts(bytes, 4) };
    if head == ELF_MAGIC {
        // SAFETY: an ELF file, whose length its headers tell.
        let len = unsafe { elf_len(bytes) }?;
        // SAFETY: as above.
        cubin_params(unsafe { std::slice::from_raw_parts(bytes, len) })
    } else if u32_at(head, 0) == Some(FATBIN_MAGIC) {
        // SAFETY: a fat binary, by its magic.
        let entries = unsafe { fatbin_entries(bytes) }?;
        entries.iter().find_map(|entry| {
            if entry.payload.starts_with(ZSTD_MAGIC) {
                cubin_params(&zstd_decompress(entry.payload, entry.uncompressed)?)
            } else {
                cubin_params(entry.payload)
            }
        })
    } else {
        None
    }
}

type ZstdDecompress = unsafe extern "C" fn(*mut c_void, usize, *const c_void, usize) -> usize;
type ZstdIsError = unsafe extern "C" fn(usize) -> u32;

/// The system's zstd library (`libzstd.so.1`), loaded on first use; None without one, and the
/// compressed cubins are then not read.
fn zstd() -> Option<(ZstdDecompress, ZstdIsError)> {
    static ZSTD: OnceLock<Option<(usize, usize)>> = OnceLock::new();
    let found = ZSTD.get_or_init(|| {
        // SAFETY: loading a system library by name, and looking up two of its functions.
        unsafe {
            let library = libc::dlopen(c"libzstd.so.1".as_ptr(), libc::RTLD_NOW);
            if library.is_null() {
                return None;
            }
            let decompress = libc::dlsym(library, c"ZSTD_decompress".as_ptr());
            let is_error = libc::dlsym(library, c"ZSTD_isError".as_ptr());
            (!decompress.is_null() && !is_error.is_null())
                .then_some((decompress as usize, is_error as usize))
        }
    });
    // SAFETY: the addresses of functions with these signatures (zstd.h).
    found.map(|(d, e)| unsafe {
        (
            std::mem::transmute::<usize, ZstdDecompress>(d),
            std::mem::transmute::<usize, ZstdIsError>(e),
        )
    })
}

fn zstd_decompress(compressed: &[u8], size: usize) -> Option<Vec<u8>> {
    let (decompress, is_error) = zstd()?;
    let mut out = vec![0u8; size];
    // SAFETY: buffers of the lengths given.
    let written = unsafe {
        decompress(
            out.as_mut_ptr().cast(),
            out.len(),
            compressed.as_ptr().cast(),
            compressed.len(),
        )
    };
    // SAFETY: a plain function of a number.
    if unsafe { is_error(written) } != 0 {
        return None;
    }
    out.truncate(written);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cubin with one kernel `k` of two parameters, a pointer at 0 and an int at 8.
    fn tiny_cubin() -> Vec<u8> {
        let names = b"\0.shstrtab\0.nv.info.k\0";
        let mut info = Vec::new();
        for (ordinal, offset, size) in [(1u16, 8u16, 4u32), (0, 0, 8)] {
            info.extend_from_slice(&[EIFMT_SVAL, EIATTR_KPARAM_INFO, 12, 0]);
            info.extend_from_slice(&0u32.to_le_bytes());
            info.extend_from_slice(&ordinal.to_le_bytes());
            info.extend_from_slice(&offset.to_le_bytes());
            info.extend_from_slice(&((size << 18) | 0x1f000).to_le_bytes());
        }
        info.extend_from_slice(&[3, 0x19, 12, 0]);
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(ELF_MAGIC);
        elf[4] = 2;
        let names_at = elf.len();
        elf.extend_from_slice(names);
        let info_at = elf.len();
        elf.extend_from_slice(&info);
        let table = elf.len();
        elf[0x28..0x30].copy_from_slice(&(table as u64).to_le_bytes());
        elf[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3C..0x3E].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3E..0x40].copy_from_slice(&1u16.to_le_bytes());
        for (name, at, len) in [
            (0u32, 0usize, 0usize),
            (1, names_at, names.len()),
            (11, info_at, info.len()),
        ] {
            let mut header = [0u8; 64];
            header[..4].copy_from_slice(&name.to_le_bytes());
            header[4] = 1;
            header[24..32].copy_from_slice(&(at as u64).to_le_bytes());
            header[32..40].copy_from_slice(&(len as u64).to_le_bytes());
            elf.extend_from_slice(&header);
        }
        elf
    }

    #[test]
    fn a_cubin_tells_each_kernels_parameters_in_ordinal_order() {
        let cubin = tiny_cubin();
        let table = cubin_params(&cubin).expect("a readable cubin");
        assert_eq!(
            &*table["k"],
            &[Param { offset: 0, size: 8 }, Param { offset: 8, size: 4 }]
        );
        // SAFETY: a whole ELF file.
        assert_eq!(unsafe { elf_len(cubin.as_ptr()) }, Some(cubin.len()));
    }

    #[test]
    fn what_is_not_a_cubin_has_no_parameters() {
        assert!(cubin_params(b"// PTX text, not an ELF file").is_none());
        let text = c".version 8.0\n.target sm_90\n";
        // SAFETY: NUL-terminated text.
        assert!(unsafe { image_params(text.as_ptr().cast()) }.is_none());
    }
}
