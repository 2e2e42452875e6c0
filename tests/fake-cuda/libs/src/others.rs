//! cuSPARSE, cuSOLVER and cuFFT, as far as PyTorch's calls need an answer: handles (and cuFFT
//! plans) with their stream; every other cuSPARSE and cuSOLVER function that takes the handle
//! first is generated as pending work on the handle's stream (`fake_cusparse_generic`,
//! `fake_cusolver_generic`), except the size queries (`*_bufferSize`) and descriptor
//! constructors, which stay stubs that answer an error: an answer the fake cannot know would be
//! worse than none. cuFFT plans need no work area, and `cufftXtExec` reads the input and writes
//! the output on the plan's stream.

use std::ffi::{c_char, c_int, c_longlong, c_void};

use crate::{Range, Registry, guard, put, work};

const SUCCESS: c_int = 0;
const NOT_INITIALIZED: c_int = 1;
/// cuSPARSE's and cuSOLVER's `*_STATUS_INVALID_VALUE`.
const INVALID_VALUE: c_int = 3;
const EXECUTION_FAILED: c_int = 6;

#[derive(Default)]
struct Handle {
    stream: usize,
}

static SPARSE: Registry<Handle> = Registry::new(0x5ba);
static SOLVER: Registry<Handle> = Registry::new(0x501);

fn create(registry: &Registry<Handle>, handle: *mut *mut c_void) -> c_int {
    // SAFETY: an out pointer from the caller.
    guard(INVALID_VALUE, || {
        if unsafe { put(handle, registry.add(Handle::default())) } {
            SUCCESS
        } else {
            INVALID_VALUE
        }
    })
}

fn destroy(registry: &Registry<Handle>, handle: *mut c_void) -> c_int {
    guard(INVALID_VALUE, || {
        registry.remove(handle).map_or(NOT_INITIALIZED, |_| SUCCESS)
    })
}

fn set_stream(registry: &Registry<Handle>, handle: *mut c_void, stream: *mut c_void) -> c_int {
    guard(INVALID_VALUE, || {
        registry
            .with(handle, |h| h.stream = stream as usize)
            .map_or(NOT_INITIALIZED, |()| SUCCESS)
    })
}

fn generic(
    registry: &Registry<Handle>,
    handle: *mut c_void,
    what: &'static std::ffi::CStr,
) -> c_int {
    guard(INVALID_VALUE, || {
        let Some(stream) = registry.with(handle, |h| h.stream as *mut c_void) else {
            return NOT_INITIALIZED;
        };
        if work(stream, &[], what) == 0 {
            SUCCESS
        } else {
            EXECUTION_FAILED
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cusparseCreate(handle: *mut *mut c_void) -> c_int {
    create(&SPARSE, handle)
}

#[unsafe(no_mangle)]
pub extern "C" fn cusparseDestroy(handle: *mut c_void) -> c_int {
    destroy(&SPARSE, handle)
}

#[unsafe(no_mangle)]
pub extern "C" fn cusparseSetStream(handle: *mut c_void, stream: *mut c_void) -> c_int {
    set_stream(&SPARSE, handle, stream)
}

#[unsafe(no_mangle)]
pub extern "C" fn cusparseSetPointerMode(handle: *mut c_void, _mode: c_int) -> c_int {
    guard(INVALID_VALUE, || {
        if SPARSE.contains(handle) {
            SUCCESS
        } else {
            NOT_INITIALIZED
        }
    })
}

/// The other handle-first cuSPARSE functions (generated stubs call this).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cusparse_generic(handle: *mut c_void, _name: *const c_char) -> c_int {
    generic(&SPARSE, handle, c"a cuSPARSE call")
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cusolverDnCreate(handle: *mut *mut c_void) -> c_int {
    create(&SOLVER, handle)
}

#[unsafe(no_mangle)]
pub extern "C" fn cusolverDnDestroy(handle: *mut c_void) -> c_int {
    destroy(&SOLVER, handle)
}

#[unsafe(no_mangle)]
pub extern "C" fn cusolverDnSetStream(handle: *mut c_void, stream: *mut c_void) -> c_int {
    set_stream(&SOLVER, handle, stream)
}

/// The other handle-first cuSOLVER functions (generated stubs call this).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fake_cusolver_generic(handle: *mut c_void, _name: *const c_char) -> c_int {
    generic(&SOLVER, handle, c"a cuSOLVER call")
}

// ---- cuFFT ---------------------------------------------------------------------------------

const CUFFT_INVALID_PLAN: c_int = 1;
const CUFFT_INVALID_VALUE: c_int = 4;
const CUFFT_EXEC_FAILED: c_int = 6;

#[derive(Default)]
struct Plan {
    stream: usize,
    /// Bytes of one input and one output batch, and the batch count (from the plan).
    input_bytes: u64,
    output_bytes: u64,
}

static PLANS: Registry<Plan> = Registry::new(0xff7);

/// cuFFT plans are `int`s: the registry's numbers, shifted down.
fn plan_key(plan: c_int) -> *const c_void {
    ((0xff7usize << 40) | ((plan as usize) << 4)) as *const c_void
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cufftCreate(plan: *mut c_int) -> c_int {
    guard(CUFFT_INVALID_VALUE, || {
        let handle = PLANS.add(Plan::default()) as usize;
        let number = ((handle & ((1 << 40) - 1)) >> 4) as c_int;
        // SAFETY: an out pointer from the caller.
        if unsafe { put(plan, number) } {
            SUCCESS
        } else {
            CUFFT_INVALID_VALUE
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cufftDestroy(plan: c_int) -> c_int {
    guard(CUFFT_INVALID_PLAN, || {
        PLANS
            .remove(plan_key(plan).cast_mut())
            .map_or(CUFFT_INVALID_PLAN, |_| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cufftSetStream(plan: c_int, stream: *mut c_void) -> c_int {
    guard(CUFFT_INVALID_PLAN, || {
        PLANS
            .with(plan_key(plan), |p| p.stream = stream as usize)
            .map_or(CUFFT_INVALID_PLAN, |()| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cufftSetAutoAllocation(plan: c_int, _auto: c_int) -> c_int {
    guard(CUFFT_INVALID_PLAN, || {
        if PLANS.contains(plan_key(plan)) {
            SUCCESS
        } else {
            CUFFT_INVALID_PLAN
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cufftSetWorkArea(plan: c_int, _area: *mut c_void) -> c_int {
    guard(CUFFT_INVALID_PLAN, || {
        if PLANS.contains(plan_key(plan)) {
            SUCCESS
        } else {
            CUFFT_INVALID_PLAN
        }
    })
}

/// Bytes per element of a `cudaDataType` as cuFFT uses them (real or complex, 16, 32, 64 bit).
fn fft_element(data_type: c_int) -> u64 {
    crate::data_type_size(data_type).max(1)
}

/// Makes the plan: it needs no work area (`*work_size = 0`, which cuFFT answers for small
/// transforms too).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cufftXtMakePlanMany(
    plan: c_int,
    rank: c_int,
    n: *const c_longlong,
    _inembed: *const c_longlong,
    _istride: c_longlong,
    idist: c_longlong,
    input_type: c_int,
    _onembed: *const c_longlong,
    _ostride: c_longlong,
    odist: c_longlong,
    output_type: c_int,
    batch: c_longlong,
    work_size: *mut usize,
    _execution_type: c_int,
) -> c_int {
    guard(CUFFT_INVALID_VALUE, || {
        if n.is_null() || !(1..=3).contains(&rank) {
            return CUFFT_INVALID_VALUE;
        }
        // SAFETY: `rank` sizes, by the API contract.
        let sizes = unsafe { std::slice::from_raw_parts(n, rank as usize) };
        let points: i64 = sizes.iter().product();
        let span = |dist: c_longlong| u64::try_from(dist.max(points) * batch.max(1)).unwrap_or(0);
        let found = PLANS.with(plan_key(plan), |p| {
            p.input_bytes = span(idist) * fft_element(input_type);
            p.output_bytes = span(odist) * fft_element(output_type);
        });
        if found.is_none() {
            return CUFFT_INVALID_PLAN;
        }
        // SAFETY: an optional out pointer from the caller.
        unsafe { put(work_size, 0) };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cufftXtExec(
    plan: c_int,
    input: *mut c_void,
    output: *mut c_void,
    _direction: c_int,
) -> c_int {
    guard(CUFFT_INVALID_VALUE, || {
        let Some((stream, input_bytes, output_bytes)) = PLANS.with(plan_key(plan), |p| {
            (p.stream as *mut c_void, p.input_bytes, p.output_bytes)
        }) else {
            return CUFFT_INVALID_PLAN;
        };
        let ranges = [
            Range::read(input, input_bytes),
            Range::write(output, output_bytes),
        ];
        if work(stream, &ranges, c"a cuFFT transform") == 0 {
            SUCCESS
        } else {
            CUFFT_EXEC_FAILED
        }
    })
}
