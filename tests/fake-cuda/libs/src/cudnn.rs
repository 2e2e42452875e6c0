//! cuDNN 9: the version queries, handles with their stream, and the backend API that PyTorch's
//! convolutions use through cudnn-frontend (descriptors whose attributes are kept as set;
//! heuristics that offer three engines; execution plans with workspace sizes that grow with the
//! tensors; `cudnnBackendExecute` as pending work on the handle's stream). So
//! `torch.backends.cudnn.benchmark = True` tries every plan, each with the workspace it reports,
//! which PyTorch asks its allocator for, as on a GPU. Batch normalization's legacy calls and
//! tensor descriptors are here too; the rest of the legacy API (RNN, CTC, spatial transformers,
//! `cudnnFind*`) stays a generated stub that answers `CUDNN_STATUS_NOT_SUPPORTED`.

use std::collections::HashMap;
use std::ffi::{c_double, c_int, c_void};

use crate::{Range, Registry, guard, put, work};

type Status = c_int;
const SUCCESS: Status = 0;
const NOT_INITIALIZED: Status = 1;
const BAD_PARAM: Status = 3;
const EXECUTION_FAILED: Status = 8;

/// cuDNN 9.26.0, the version the installed PyTorch names (`nvidia-cudnn-cu13==9.26.0.51`).
const VERSION: [c_int; 3] = [9, 26, 0];

/// How many engines the heuristics offer for any operation graph.
const ENGINES: i64 = 3;

// `cudnnBackendDescriptorType_t` values.
const ENGINE_DESCRIPTOR: i32 = 2;
const ENGINECFG_DESCRIPTOR: i32 = 3;
const ENGINEHEUR_DESCRIPTOR: i32 = 4;
const EXECUTION_PLAN_DESCRIPTOR: i32 = 5;
const OPERATIONGRAPH_DESCRIPTOR: i32 = 15;
const VARIANT_PACK_DESCRIPTOR: i32 = 16;
const TENSOR_DESCRIPTOR: i32 = 17;

// `cudnnBackendAttributeType_t` values.
const TYPE_INT64: i32 = 3;
const TYPE_VOID_PTR: i32 = 6;
const TYPE_BACKEND_DESCRIPTOR: i32 = 15;
const TYPE_CHAR: i32 = 24;

// `cudnnBackendAttributeName_t` values.
const ENGINEHEUR_OPERATION_GRAPH: i32 = 201;
const ENGINEHEUR_RESULTS: i32 = 202;
const ENGINECFG_ENGINE: i32 = 300;
const ENGINECFG_WORKSPACE_SIZE: i32 = 303;
const EXECUTION_PLAN_ENGINE_CONFIG: i32 = 401;
const EXECUTION_PLAN_WORKSPACE_SIZE: i32 = 402;
const EXECUTION_PLAN_JSON_REPRESENTATION: i32 = 405;
const OPERATIONGRAPH_OPS: i32 = 801;
const OPERATIONGRAPH_ENGINE_GLOBAL_COUNT: i32 = 802;
const TENSOR_DATA_TYPE: i32 = 901;
const TENSOR_DIMENSIONS: i32 = 902;
const TENSOR_STRIDES: i32 = 903;
const TENSOR_UNIQUE_ID: i32 = 906;
const VARIANT_PACK_UNIQUE_IDS: i32 = 1000;
const VARIANT_PACK_DATA_POINTERS: i32 = 1001;
const VARIANT_PACK_WORKSPACE: i32 = 1003;
const ENGINE_OPERATION_GRAPH: i32 = 1300;
const ENGINE_GLOBAL_INDEX: i32 = 1301;
/// The operations' outputs: convolution forward Y, backward data DX, backward filter DW,
/// pointwise Y.
const OUTPUT_ATTRIBUTES: [i32; 4] = [705, 710, 715, 753];

#[derive(Default)]
struct Handle {
    stream: usize,
}

static HANDLES: Registry<Handle> = Registry::new(0xd22);

/// One attribute as set: its type, element count and bytes; for descriptors, a copy of each
/// as it was when set (cuDNN keeps what it needs of them: the caller may destroy its own).
#[derive(Clone)]
struct Attribute {
    kind: i32,
    count: i64,
    bytes: Vec<u8>,
    snapshots: Vec<Descriptor>,
}

impl Attribute {
    fn new(kind: i32, count: i64, bytes: Vec<u8>) -> Attribute {
        let snapshots = if kind == TYPE_BACKEND_DESCRIPTOR {
            bytes
                .chunks_exact(8)
                .filter_map(|c| descriptor(u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))))
                .collect()
        } else {
            Vec::new()
        };
        Attribute {
            kind,
            count,
            bytes,
            snapshots,
        }
    }
}

#[derive(Clone, Default)]
struct Descriptor {
    kind: i32,
    attributes: HashMap<i32, Attribute>,
    finalized: bool,
}

static DESCRIPTORS: Registry<Descriptor> = Registry::new(0xd2b);

/// Bytes per element of a backend attribute type.
fn element_size(kind: i32) -> usize {
    match kind {
        // BOOLEAN, CHAR
        2 | TYPE_CHAR => 1,
        // HANDLE, INT64, DOUBLE, VOID_PTR, BACKEND_DESCRIPTOR
        0 | TYPE_INT64 | 5 | TYPE_VOID_PTR | TYPE_BACKEND_DESCRIPTOR => 8,
        // FRACTION: two int64
        26 => 16,
        // FLOAT, INT32 and the enumerations
        _ => 4,
    }
}

/// Bytes per element of a `cudnnDataType_t`.
fn data_type_size(data_type: i64) -> u64 {
    match data_type {
        1 | 10 => 8,
        2 | 9 => 2,
        3 | 6 | 11 | 12 | 13 => 1,
        8 => 32,
        _ => 4,
    }
}

fn int64s(attribute: &Attribute) -> Vec<i64> {
    attribute
        .bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect()
}

fn descriptor(handle: u64) -> Option<Descriptor> {
    DESCRIPTORS.with(handle as *const c_void, |d| d.clone())
}

fn attribute_int64s(handle: u64, name: i32) -> Vec<i64> {
    descriptor(handle)
        .and_then(|d| d.attributes.get(&name).map(int64s))
        .unwrap_or_default()
}

fn first(handle: u64, name: i32) -> Option<u64> {
    attribute_int64s(handle, name).first().map(|&v| v as u64)
}

/// The extent in bytes of a backend tensor: the furthest element its dimensions and strides
/// reach, plus one.
fn tensor_bytes(tensor: &Descriptor) -> u64 {
    let get = |name| tensor.attributes.get(&name).map(int64s).unwrap_or_default();
    let (dims, strides) = (get(TENSOR_DIMENSIONS), get(TENSOR_STRIDES));
    let size = data_type_size(get(TENSOR_DATA_TYPE).first().copied().unwrap_or(0));
    if dims.iter().any(|&d| d <= 0) {
        return 0;
    }
    let last: i64 = dims
        .iter()
        .zip(strides.iter().chain(std::iter::repeat(&1)))
        .map(|(&d, &s)| (d - 1) * s.max(0))
        .sum();
    (last as u64 + 1) * size
}

/// The tensors of an operation graph, by unique id: their extent and whether an operation
/// writes them.
fn graph_tensors(graph: &Descriptor) -> HashMap<i64, (u64, bool)> {
    let mut tensors = HashMap::new();
    let ops = graph.attributes.get(&OPERATIONGRAPH_OPS);
    for op in ops.map(|a| a.snapshots.as_slice()).unwrap_or_default() {
        for (&name, attribute) in &op.attributes {
            for tensor in attribute
                .snapshots
                .iter()
                .filter(|t| t.kind == TENSOR_DESCRIPTOR)
            {
                let uid = tensor
                    .attributes
                    .get(&TENSOR_UNIQUE_ID)
                    .and_then(|a| int64s(a).first().copied())
                    .unwrap_or(0);
                let written = OUTPUT_ATTRIBUTES.contains(&name);
                let entry = tensors.entry(uid).or_insert((0, false));
                entry.0 = entry.0.max(tensor_bytes(tensor));
                entry.1 |= written;
            }
        }
    }
    tensors
}

/// The workspace engine `index` needs for `graph`: none for engine 0; for engine 1 the size of
/// the outputs (an implicit GEMM's split reduction); for engine 2 all the tensors again, rounded
/// up to 1 MiB (a transform-based algorithm's copies). Real engines differ by shape the same way.
fn workspace_size(graph: &Descriptor, index: i64) -> i64 {
    let tensors = graph_tensors(graph);
    let outputs: u64 = tensors.values().filter(|t| t.1).map(|t| t.0).sum();
    let all: u64 = tensors.values().map(|t| t.0).sum();
    let bytes = match index {
        0 => 0,
        1 => outputs,
        _ => all.div_ceil(1 << 20) * (1 << 20),
    };
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The operation graph and the index of the engine a configuration names (as they were when
/// set).
fn engine_of_config(config: &Descriptor) -> Option<(Descriptor, i64)> {
    let engine = config
        .attributes
        .get(&ENGINECFG_ENGINE)?
        .snapshots
        .first()?;
    let graph = engine
        .attributes
        .get(&ENGINE_OPERATION_GRAPH)?
        .snapshots
        .first()?
        .clone();
    let index = *int64s(engine.attributes.get(&ENGINE_GLOBAL_INDEX)?).first()?;
    Some((graph, index))
}

/// The configuration of an execution plan, as it was when set.
fn config_of_plan(plan: &Descriptor) -> Option<&Descriptor> {
    plan.attributes
        .get(&EXECUTION_PLAN_ENGINE_CONFIG)?
        .snapshots
        .first()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetProperty(property: c_int, value: *mut c_int) -> Status {
    guard(BAD_PARAM, || {
        let Some(&answer) = usize::try_from(property).ok().and_then(|p| VERSION.get(p)) else {
            return BAD_PARAM;
        };
        // SAFETY: an out pointer from the caller.
        if unsafe { put(value, answer) } {
            SUCCESS
        } else {
            BAD_PARAM
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnGetVersion() -> usize {
    (VERSION[0] * 10000 + VERSION[1] * 100 + VERSION[2]) as usize
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnCreate(handle: *mut *mut c_void) -> Status {
    guard(BAD_PARAM, || {
        // SAFETY: an out pointer from the caller.
        if unsafe { put(handle, HANDLES.add(Handle::default())) } {
            SUCCESS
        } else {
            BAD_PARAM
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnDestroy(handle: *mut c_void) -> Status {
    guard(BAD_PARAM, || {
        HANDLES.remove(handle).map_or(BAD_PARAM, |_| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnSetStream(handle: *mut c_void, stream: *mut c_void) -> Status {
    guard(BAD_PARAM, || {
        HANDLES
            .with(handle, |h| h.stream = stream as usize)
            .map_or(BAD_PARAM, |()| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetStream(handle: *mut c_void, stream: *mut *mut c_void) -> Status {
    guard(BAD_PARAM, || {
        let Some(value) = HANDLES.with(handle, |h| h.stream as *mut c_void) else {
            return BAD_PARAM;
        };
        // SAFETY: an out pointer from the caller.
        if unsafe { put(stream, value) } {
            SUCCESS
        } else {
            BAD_PARAM
        }
    })
}

/// Books work on the handle's stream.
fn on_stream(handle: *mut c_void, ranges: &[Range], what: &'static std::ffi::CStr) -> Status {
    let Some(stream) = HANDLES.with(handle, |h| h.stream as *mut c_void) else {
        return NOT_INITIALIZED;
    };
    if work(stream, ranges, what) == 0 {
        SUCCESS
    } else {
        EXECUTION_FAILED
    }
}

// ---- The backend API ----------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnBackendCreateDescriptor(
    kind: c_int,
    out: *mut *mut c_void,
) -> Status {
    guard(BAD_PARAM, || {
        let new = Descriptor {
            kind,
            ..Descriptor::default()
        };
        // SAFETY: an out pointer from the caller.
        if unsafe { put(out, DESCRIPTORS.add(new)) } {
            SUCCESS
        } else {
            BAD_PARAM
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnBackendDestroyDescriptor(handle: *mut c_void) -> Status {
    guard(BAD_PARAM, || {
        DESCRIPTORS.remove(handle).map_or(BAD_PARAM, |_| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnBackendSetAttribute(
    handle: *mut c_void,
    name: c_int,
    kind: c_int,
    count: i64,
    elements: *const c_void,
) -> Status {
    guard(BAD_PARAM, || {
        if count < 0 || (count > 0 && elements.is_null()) {
            return BAD_PARAM;
        }
        let len = count as usize * element_size(kind);
        let bytes = if len == 0 {
            Vec::new()
        } else {
            // SAFETY: `count` elements of `kind` at `elements`, by the API contract.
            unsafe { std::slice::from_raw_parts(elements.cast::<u8>(), len) }.to_vec()
        };
        let attribute = Attribute::new(kind, count, bytes);
        DESCRIPTORS
            .with(handle, |d| {
                d.attributes.insert(name, attribute);
            })
            .map_or(BAD_PARAM, |()| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnBackendFinalize(handle: *mut c_void) -> Status {
    guard(BAD_PARAM, || {
        DESCRIPTORS
            .with(handle, |d| d.finalized = true)
            .map_or(BAD_PARAM, |()| SUCCESS)
    })
}

/// What the fake answers for an attribute it computes rather than keeps.
enum Answer {
    Int64s(Vec<i64>),
    /// Descriptors to copy into the caller's (already created) descriptors.
    Descriptors(Vec<Descriptor>),
    Text(Vec<u8>),
}

fn computed(this: &Descriptor, name: i32) -> Option<Answer> {
    match (this.kind, name) {
        (OPERATIONGRAPH_DESCRIPTOR, OPERATIONGRAPH_ENGINE_GLOBAL_COUNT) => {
            Some(Answer::Int64s(vec![ENGINES]))
        }
        (ENGINEHEUR_DESCRIPTOR, ENGINEHEUR_RESULTS) => {
            let graph = this.attributes.get(&ENGINEHEUR_OPERATION_GRAPH)?.clone();
            let configs = (0..ENGINES)
                .map(|index| {
                    let mut engine = Descriptor {
                        kind: ENGINE_DESCRIPTOR,
                        finalized: true,
                        ..Descriptor::default()
                    };
                    engine
                        .attributes
                        .insert(ENGINE_OPERATION_GRAPH, graph.clone());
                    let index = Attribute::new(TYPE_INT64, 1, index.to_le_bytes().to_vec());
                    engine.attributes.insert(ENGINE_GLOBAL_INDEX, index);
                    let mut config = Descriptor {
                        kind: ENGINECFG_DESCRIPTOR,
                        finalized: true,
                        ..Descriptor::default()
                    };
                    let chosen = Attribute {
                        kind: TYPE_BACKEND_DESCRIPTOR,
                        count: 1,
                        bytes: vec![0; 8],
                        snapshots: vec![engine],
                    };
                    config.attributes.insert(ENGINECFG_ENGINE, chosen);
                    config
                })
                .collect();
            Some(Answer::Descriptors(configs))
        }
        (ENGINECFG_DESCRIPTOR, ENGINECFG_ENGINE) => {
            let engine = this.attributes.get(&ENGINECFG_ENGINE)?.snapshots.first()?;
            Some(Answer::Descriptors(vec![engine.clone()]))
        }
        (ENGINECFG_DESCRIPTOR, ENGINECFG_WORKSPACE_SIZE) => {
            let (graph, index) = engine_of_config(this)?;
            Some(Answer::Int64s(vec![workspace_size(&graph, index)]))
        }
        (EXECUTION_PLAN_DESCRIPTOR, EXECUTION_PLAN_WORKSPACE_SIZE) => {
            let (graph, index) = engine_of_config(config_of_plan(this)?)?;
            Some(Answer::Int64s(vec![workspace_size(&graph, index)]))
        }
        (EXECUTION_PLAN_DESCRIPTOR, EXECUTION_PLAN_JSON_REPRESENTATION) => {
            let index = config_of_plan(this)
                .and_then(engine_of_config)
                .map_or(0, |(_, index)| index);
            Some(Answer::Text(
                format!("{{\"engineId\":{index}}}\0").into_bytes(),
            ))
        }
        _ => None,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnBackendGetAttribute(
    handle: *mut c_void,
    name: c_int,
    kind: c_int,
    requested: i64,
    count: *mut i64,
    elements: *mut c_void,
) -> Status {
    guard(BAD_PARAM, || {
        let Some(this) = descriptor(handle as u64) else {
            return BAD_PARAM;
        };
        let wanted = usize::try_from(requested).unwrap_or(0);
        let (available, written) = match computed(&this, name) {
            Some(Answer::Int64s(values)) => {
                let n = values.len().min(wanted);
                if !elements.is_null() && kind == TYPE_INT64 {
                    // SAFETY: room for `requested` int64 at `elements`, by the API contract.
                    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), elements.cast(), n) };
                }
                (values.len(), n)
            }
            Some(Answer::Descriptors(sources)) => {
                let available = sources.len();
                let n = available.min(wanted);
                for (k, source) in sources.into_iter().take(n).enumerate() {
                    if elements.is_null() {
                        break;
                    }
                    // SAFETY: `requested` descriptors the caller created, by the API contract.
                    let target = unsafe { *elements.cast::<*mut c_void>().add(k) };
                    DESCRIPTORS.with(target, |d| {
                        let own_kind = d.kind;
                        *d = Descriptor {
                            kind: own_kind,
                            ..source
                        };
                    });
                }
                (available, n)
            }
            Some(Answer::Text(text)) => {
                let n = text.len().min(wanted);
                if !elements.is_null() {
                    // SAFETY: room for `requested` chars at `elements`, by the API contract.
                    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), elements.cast(), n) };
                }
                (text.len(), n)
            }
            None => match this.attributes.get(&name) {
                Some(attribute) => {
                    let size = element_size(attribute.kind);
                    let n = (attribute.count as usize).min(wanted);
                    if !elements.is_null() {
                        // SAFETY: room for `requested` elements of the kind at `elements`.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                attribute.bytes.as_ptr(),
                                elements.cast::<u8>(),
                                n * size,
                            )
                        };
                    }
                    (attribute.count as usize, n)
                }
                // Lists the fake keeps empty: knobs, notes, intermediates, layouts.
                None => (0, 0),
            },
        };
        let reported = if elements.is_null() {
            available
        } else {
            written
        };
        // SAFETY: an optional out pointer from the caller.
        unsafe { put(count, reported as i64) };
        SUCCESS
    })
}

/// Runs an execution plan: pending work on the handle's stream that reads the plan's inputs,
/// writes its outputs (their extents from the operation graph's tensors, by unique id) and its
/// workspace.
#[unsafe(no_mangle)]
pub extern "C" fn cudnnBackendExecute(
    handle: *mut c_void,
    plan: *mut c_void,
    pack: *mut c_void,
) -> Status {
    guard(BAD_PARAM, || {
        let (Some(plan_descriptor), Some(pack_descriptor)) =
            (descriptor(plan as u64), descriptor(pack as u64))
        else {
            return BAD_PARAM;
        };
        if plan_descriptor.kind != EXECUTION_PLAN_DESCRIPTOR
            || pack_descriptor.kind != VARIANT_PACK_DESCRIPTOR
        {
            return BAD_PARAM;
        }
        let (graph, index) = config_of_plan(&plan_descriptor)
            .and_then(engine_of_config)
            .unwrap_or_default();
        let tensors = graph_tensors(&graph);
        let uids = attribute_int64s(pack as u64, VARIANT_PACK_UNIQUE_IDS);
        let pointers = attribute_int64s(pack as u64, VARIANT_PACK_DATA_POINTERS);
        let mut ranges: Vec<Range> = uids
            .iter()
            .zip(&pointers)
            .map(|(uid, &pointer)| {
                let (len, written) = tensors.get(uid).copied().unwrap_or((1, true));
                Range {
                    start: pointer as u64,
                    len: len.max(1),
                    write: u32::from(written),
                }
            })
            .collect();
        if let Some(workspace) = first(pack as u64, VARIANT_PACK_WORKSPACE) {
            let size = workspace_size(&graph, index).max(0) as u64;
            ranges.push(Range::write(workspace as *const c_void, size));
        }
        on_stream(handle, &ranges, c"a cuDNN execution plan")
    })
}

// ---- Legacy tensor descriptors and batch normalization ------------------------------------

#[derive(Clone, Default)]
struct TensorDescriptor {
    data_type: c_int,
    dims: Vec<c_int>,
    strides: Vec<c_int>,
}

impl TensorDescriptor {
    fn bytes(&self) -> u64 {
        if self.dims.iter().any(|&d| d <= 0) {
            return 0;
        }
        let last: i64 = self
            .dims
            .iter()
            .zip(&self.strides)
            .map(|(&d, &s)| i64::from(d - 1) * i64::from(s.max(0)))
            .sum();
        (last as u64 + 1) * data_type_size(i64::from(self.data_type))
    }
}

static TENSORS: Registry<TensorDescriptor> = Registry::new(0xd27);

fn tensor_len(descriptor: *mut c_void) -> u64 {
    TENSORS.with(descriptor, |t| t.bytes()).unwrap_or(1).max(1)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnCreateTensorDescriptor(out: *mut *mut c_void) -> Status {
    // SAFETY: an out pointer from the caller.
    guard(BAD_PARAM, || {
        if unsafe { put(out, TENSORS.add(TensorDescriptor::default())) } {
            SUCCESS
        } else {
            BAD_PARAM
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cudnnDestroyTensorDescriptor(descriptor: *mut c_void) -> Status {
    guard(BAD_PARAM, || {
        TENSORS.remove(descriptor).map_or(BAD_PARAM, |_| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnSetTensorNdDescriptor(
    descriptor: *mut c_void,
    data_type: c_int,
    count: c_int,
    dims: *const c_int,
    strides: *const c_int,
) -> Status {
    guard(BAD_PARAM, || {
        if !(1..=8).contains(&count) || dims.is_null() || strides.is_null() {
            return BAD_PARAM;
        }
        // SAFETY: `count` dimensions and strides, by the API contract.
        let (dims, strides) = unsafe {
            (
                std::slice::from_raw_parts(dims, count as usize).to_vec(),
                std::slice::from_raw_parts(strides, count as usize).to_vec(),
            )
        };
        TENSORS
            .with(descriptor, |t| {
                *t = TensorDescriptor {
                    data_type,
                    dims,
                    strides,
                }
            })
            .map_or(BAD_PARAM, |()| SUCCESS)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetTensorNdDescriptor(
    descriptor: *mut c_void,
    requested: c_int,
    data_type: *mut c_int,
    count: *mut c_int,
    dims: *mut c_int,
    strides: *mut c_int,
) -> Status {
    guard(BAD_PARAM, || {
        let Some(t) = TENSORS.with(descriptor, |t| t.clone()) else {
            return BAD_PARAM;
        };
        let n = t.dims.len().min(usize::try_from(requested).unwrap_or(0));
        // SAFETY: out pointers from the caller, with room for `requested` dimensions.
        unsafe {
            put(data_type, t.data_type);
            put(count, t.dims.len() as c_int);
            if !dims.is_null() {
                std::ptr::copy_nonoverlapping(t.dims.as_ptr(), dims, n);
            }
            if !strides.is_null() {
                std::ptr::copy_nonoverlapping(t.strides.as_ptr(), strides, n);
            }
        }
        SUCCESS
    })
}

/// Batch normalization needs no workspace and no reserve space here (a size of 0, which cuDNN
/// reports for many shapes too).
unsafe fn no_bytes(size: *mut usize) -> Status {
    // SAFETY: an out pointer from the caller.
    if unsafe { put(size, 0) } {
        SUCCESS
    } else {
        BAD_PARAM
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
    _handle: *mut c_void,
    _mode: c_int,
    _ops: c_int,
    _x: *mut c_void,
    _z: *mut c_void,
    _y: *mut c_void,
    _scale_bias: *mut c_void,
    _activation: *mut c_void,
    size: *mut usize,
) -> Status {
    // SAFETY: the caller's out pointer.
    guard(BAD_PARAM, || unsafe { no_bytes(size) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
    _handle: *mut c_void,
    _mode: c_int,
    _ops: c_int,
    _activation: *mut c_void,
    _x: *mut c_void,
    size: *mut usize,
) -> Status {
    // SAFETY: the caller's out pointer.
    guard(BAD_PARAM, || unsafe { no_bytes(size) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnGetBatchNormalizationBackwardExWorkspaceSize(
    _handle: *mut c_void,
    _mode: c_int,
    _ops: c_int,
    _x: *mut c_void,
    _y: *mut c_void,
    _dy: *mut c_void,
    _dz: *mut c_void,
    _dx: *mut c_void,
    _dscale_bias: *mut c_void,
    _activation: *mut c_void,
    size: *mut usize,
) -> Status {
    // SAFETY: the caller's out pointer.
    guard(BAD_PARAM, || unsafe { no_bytes(size) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnBatchNormalizationForwardTrainingEx(
    handle: *mut c_void,
    _mode: c_int,
    _ops: c_int,
    _alpha: *const c_void,
    _beta: *const c_void,
    x_desc: *mut c_void,
    x: *const c_void,
    _z_desc: *mut c_void,
    _z: *const c_void,
    y_desc: *mut c_void,
    y: *mut c_void,
    scale_desc: *mut c_void,
    scale: *const c_void,
    bias: *const c_void,
    _factor: c_double,
    running_mean: *mut c_void,
    running_var: *mut c_void,
    _epsilon: c_double,
    save_mean: *mut c_void,
    save_inv_var: *mut c_void,
    _activation: *mut c_void,
    _workspace: *mut c_void,
    _workspace_size: usize,
    _reserve: *mut c_void,
    _reserve_size: usize,
) -> Status {
    guard(BAD_PARAM, || {
        let param = tensor_len(scale_desc);
        let ranges = [
            Range::read(x, tensor_len(x_desc)),
            Range::write(y, tensor_len(y_desc)),
            Range::read(scale, param),
            Range::read(bias, param),
            Range::write(running_mean, param),
            Range::write(running_var, param),
            Range::write(save_mean, param),
            Range::write(save_inv_var, param),
        ];
        on_stream(handle, &ranges, c"a cuDNN batch normalization")
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnBatchNormalizationForwardInference(
    handle: *mut c_void,
    _mode: c_int,
    _alpha: *const c_void,
    _beta: *const c_void,
    x_desc: *mut c_void,
    x: *const c_void,
    y_desc: *mut c_void,
    y: *mut c_void,
    scale_desc: *mut c_void,
    scale: *const c_void,
    bias: *const c_void,
    mean: *const c_void,
    var: *const c_void,
    _epsilon: c_double,
) -> Status {
    guard(BAD_PARAM, || {
        let param = tensor_len(scale_desc);
        let ranges = [
            Range::read(x, tensor_len(x_desc)),
            Range::write(y, tensor_len(y_desc)),
            Range::read(scale, param),
            Range::read(bias, param),
            Range::read(mean, param),
            Range::read(var, param),
        ];
        on_stream(handle, &ranges, c"a cuDNN batch normalization")
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudnnBatchNormalizationBackwardEx(
    handle: *mut c_void,
    _mode: c_int,
    _ops: c_int,
    _alpha_data: *const c_void,
    _beta_data: *const c_void,
    _alpha_param: *const c_void,
    _beta_param: *const c_void,
    x_desc: *mut c_void,
    x: *const c_void,
    _y_desc: *mut c_void,
    _y: *const c_void,
    dy_desc: *mut c_void,
    dy: *const c_void,
    _dz_desc: *mut c_void,
    _dz: *mut c_void,
    dx_desc: *mut c_void,
    dx: *mut c_void,
    dscale_desc: *mut c_void,
    scale: *const c_void,
    _bias: *const c_void,
    dscale: *mut c_void,
    dbias: *mut c_void,
    _epsilon: c_double,
    save_mean: *const c_void,
    save_inv_var: *const c_void,
    _activation: *mut c_void,
    _workspace: *mut c_void,
    _workspace_size: usize,
    _reserve: *mut c_void,
    _reserve_size: usize,
) -> Status {
    guard(BAD_PARAM, || {
        let param = tensor_len(dscale_desc);
        let ranges = [
            Range::read(x, tensor_len(x_desc)),
            Range::read(dy, tensor_len(dy_desc)),
            Range::write(dx, tensor_len(dx_desc)),
            Range::read(scale, param),
            Range::write(dscale, param),
            Range::write(dbias, param),
            Range::read(save_mean, param),
            Range::read(save_inv_var, param),
        ];
        on_stream(handle, &ranges, c"a cuDNN batch normalization")
    })
}
