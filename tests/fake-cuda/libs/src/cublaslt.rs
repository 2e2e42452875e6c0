//! cuBLASLt: matmul, matrix-layout and preference descriptors (kept, for the extents of the
//! matrices), heuristics that return one algorithm needing no workspace, and `cublasLtMatmul`
//! as pending work on the stream it is given: reads A, B (and C), writes D and the workspace.
//! PyTorch passes its cuBLAS handle as the cuBLASLt handle; any non-NULL handle serves.

use std::ffi::{c_int, c_void};

use crate::{Range, Registry, data_type_size, guard, matrix_elements, put, work};

type Status = c_int;
const SUCCESS: Status = 0;
const NOT_INITIALIZED: Status = 1;
const INVALID_VALUE: Status = 7;
const EXECUTION_FAILED: Status = 13;

/// `CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT` (int32) and `..._STRIDED_BATCH_OFFSET` (int64).
const LAYOUT_BATCH_COUNT: c_int = 5;
const LAYOUT_STRIDED_BATCH_OFFSET: c_int = 6;

#[derive(Clone, Copy)]
struct Layout {
    element: u64,
    rows: u64,
    cols: u64,
    ld: i64,
    batch: i64,
    stride: i64,
}

impl Layout {
    fn bytes(&self) -> u64 {
        let rows = i64::try_from(self.rows).unwrap_or(0);
        let cols = i64::try_from(self.cols).unwrap_or(0);
        let one = matrix_elements(rows, cols, self.ld);
        let rest = u64::try_from(self.stride.max(0) * (self.batch - 1).max(0)).unwrap_or(0);
        (one + if one > 0 { rest } else { 0 }) * self.element
    }
}

static LAYOUTS: Registry<Layout> = Registry::new(0x1a70);
static MATMUL_DESCS: Registry<()> = Registry::new(0x1a7d);
static PREFERENCES: Registry<()> = Registry::new(0x1a7e);
static LT_HANDLES: Registry<()> = Registry::new(0x1a71);

fn status(created: bool) -> Status {
    if created { SUCCESS } else { INVALID_VALUE }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtCreate(handle: *mut *mut c_void) -> Status {
    // SAFETY: an out pointer from the caller.
    guard(INVALID_VALUE, || {
        status(unsafe { put(handle, LT_HANDLES.add(())) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasLtDestroy(handle: *mut c_void) -> Status {
    guard(INVALID_VALUE, || {
        LT_HANDLES
            .remove(handle)
            .map_or(NOT_INITIALIZED, |()| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatmulDescCreate(
    desc: *mut *mut c_void,
    _compute: c_int,
    _scale: c_int,
) -> Status {
    // SAFETY: an out pointer from the caller.
    guard(INVALID_VALUE, || {
        status(unsafe { put(desc, MATMUL_DESCS.add(())) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasLtMatmulDescDestroy(desc: *mut c_void) -> Status {
    guard(INVALID_VALUE, || {
        MATMUL_DESCS
            .remove(desc)
            .map_or(INVALID_VALUE, |()| SUCCESS)
    })
}

/// Transposition, epilogue, bias pointers, scales: kept by none (the fake computes nothing).
#[unsafe(no_mangle)]
pub extern "C" fn cublasLtMatmulDescSetAttribute(
    desc: *mut c_void,
    _attribute: c_int,
    value: *const c_void,
    _size: usize,
) -> Status {
    guard(INVALID_VALUE, || {
        if MATMUL_DESCS.contains(desc) && !value.is_null() {
            SUCCESS
        } else {
            INVALID_VALUE
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatrixLayoutCreate(
    layout: *mut *mut c_void,
    data_type: c_int,
    rows: u64,
    cols: u64,
    ld: i64,
) -> Status {
    guard(INVALID_VALUE, || {
        let new = Layout {
            element: data_type_size(data_type),
            rows,
            cols,
            ld,
            batch: 1,
            stride: 0,
        };
        // SAFETY: an out pointer from the caller.
        status(unsafe { put(layout, LAYOUTS.add(new)) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasLtMatrixLayoutDestroy(layout: *mut c_void) -> Status {
    guard(INVALID_VALUE, || {
        LAYOUTS.remove(layout).map_or(INVALID_VALUE, |_| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatrixLayoutSetAttribute(
    layout: *mut c_void,
    attribute: c_int,
    value: *const c_void,
    size: usize,
) -> Status {
    guard(INVALID_VALUE, || {
        if value.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: `size` bytes at `value`, by the API contract; read as the attribute's type.
        let number = unsafe {
            match size {
                4 => i64::from(value.cast::<i32>().read_unaligned()),
                8 => value.cast::<i64>().read_unaligned(),
                _ => 0,
            }
        };
        LAYOUTS
            .with(layout, |l| match attribute {
                LAYOUT_BATCH_COUNT => l.batch = number,
                LAYOUT_STRIDED_BATCH_OFFSET => l.stride = number,
                _ => {}
            })
            .map_or(INVALID_VALUE, |()| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatmulPreferenceCreate(preference: *mut *mut c_void) -> Status {
    // SAFETY: an out pointer from the caller.
    guard(INVALID_VALUE, || {
        status(unsafe { put(preference, PREFERENCES.add(())) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasLtMatmulPreferenceDestroy(preference: *mut c_void) -> Status {
    guard(INVALID_VALUE, || {
        PREFERENCES
            .remove(preference)
            .map_or(INVALID_VALUE, |()| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasLtMatmulPreferenceSetAttribute(
    preference: *mut c_void,
    _attribute: c_int,
    value: *const c_void,
    _size: usize,
) -> Status {
    guard(INVALID_VALUE, || {
        if PREFERENCES.contains(preference) && !value.is_null() {
            SUCCESS
        } else {
            INVALID_VALUE
        }
    })
}

/// `cublasLtMatmulAlgo_t`: 8 opaque words.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Algo {
    data: [u64; 8],
}

/// `cublasLtMatmulHeuristicResult_t`.
#[repr(C)]
pub struct HeuristicResult {
    algo: Algo,
    workspace_size: usize,
    state: Status,
    waves_count: f32,
    reserved: [c_int; 4],
}

/// One algorithm, needing no workspace.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatmulAlgoGetHeuristic(
    _handle: *mut c_void,
    desc: *mut c_void,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: *mut c_void,
    _d: *mut c_void,
    _preference: *mut c_void,
    requested: c_int,
    results: *mut HeuristicResult,
    returned: *mut c_int,
) -> Status {
    guard(INVALID_VALUE, || {
        if !MATMUL_DESCS.contains(desc) || requested < 1 || results.is_null() {
            return INVALID_VALUE;
        }
        let one = HeuristicResult {
            algo: Algo {
                data: [1, 0, 0, 0, 0, 0, 0, 0],
            },
            workspace_size: 0,
            state: SUCCESS,
            waves_count: 1.0,
            reserved: [0; 4],
        };
        // SAFETY: out pointers from the caller: `requested` results (at least one), a count.
        unsafe { status(put(results, one) && put(returned, 1)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatmulAlgoInit(
    _handle: *mut c_void,
    _compute: c_int,
    _scale: c_int,
    _a: c_int,
    _b: c_int,
    _c: c_int,
    _d: c_int,
    id: c_int,
    algo: *mut Algo,
) -> Status {
    guard(INVALID_VALUE, || {
        let mut new = Algo::default();
        new.data[0] = u64::from(id.unsigned_abs());
        // SAFETY: an out pointer from the caller.
        status(unsafe { put(algo, new) })
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatmulAlgoCheck(
    _handle: *mut c_void,
    _desc: *mut c_void,
    _a: *mut c_void,
    _b: *mut c_void,
    _c: *mut c_void,
    _d: *mut c_void,
    algo: *const Algo,
    result: *mut HeuristicResult,
) -> Status {
    guard(INVALID_VALUE, || {
        if algo.is_null() {
            return INVALID_VALUE;
        }
        let checked = HeuristicResult {
            // SAFETY: not NULL; the caller's algorithm.
            algo: unsafe { algo.read() },
            workspace_size: 0,
            state: SUCCESS,
            waves_count: 1.0,
            reserved: [0; 4],
        };
        // SAFETY: an out pointer from the caller.
        status(unsafe { put(result, checked) })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cublasLtMatmulAlgoConfigSetAttribute(
    algo: *mut Algo,
    _attribute: c_int,
    value: *const c_void,
    _size: usize,
) -> Status {
    guard(INVALID_VALUE, || {
        status(!algo.is_null() && !value.is_null())
    })
}

/// Every configuration attribute of the fake's algorithm is 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatmulAlgoConfigGetAttribute(
    algo: *const Algo,
    _attribute: c_int,
    value: *mut c_void,
    size: usize,
    written: *mut usize,
) -> Status {
    guard(INVALID_VALUE, || {
        if algo.is_null() {
            return INVALID_VALUE;
        }
        if !value.is_null() {
            // SAFETY: `size` writable bytes at `value`, by the API contract.
            unsafe { std::ptr::write_bytes(value.cast::<u8>(), 0, size) };
        }
        // SAFETY: an optional out pointer from the caller.
        unsafe { put(written, size) };
        SUCCESS
    })
}

fn layout(handle: *mut c_void) -> Option<Layout> {
    LAYOUTS.with(handle, |l| *l)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cublasLtMatmul(
    handle: *mut c_void,
    desc: *mut c_void,
    _alpha: *const c_void,
    a: *const c_void,
    a_layout: *mut c_void,
    b: *const c_void,
    b_layout: *mut c_void,
    _beta: *const c_void,
    c: *const c_void,
    c_layout: *mut c_void,
    d: *mut c_void,
    d_layout: *mut c_void,
    _algo: *const Algo,
    workspace: *mut c_void,
    workspace_size: usize,
    stream: *mut c_void,
) -> Status {
    guard(INVALID_VALUE, || {
        if handle.is_null() {
            return NOT_INITIALIZED;
        }
        let (Some(la), Some(lb), Some(lc), Some(ld)) = (
            layout(a_layout),
            layout(b_layout),
            layout(c_layout),
            layout(d_layout),
        ) else {
            return INVALID_VALUE;
        };
        if !MATMUL_DESCS.contains(desc) {
            return INVALID_VALUE;
        }
        let mut ranges = vec![
            Range::read(a, la.bytes()),
            Range::read(b, lb.bytes()),
            Range::write(d, ld.bytes()),
            Range::write(workspace, workspace_size as u64),
        ];
        if c != d.cast_const() {
            ranges.push(Range::read(c, lc.bytes()));
        }
        if work(stream, &ranges, c"a cuBLASLt matmul") == 0 {
            SUCCESS
        } else {
            EXECUTION_FAILED
        }
    })
}
