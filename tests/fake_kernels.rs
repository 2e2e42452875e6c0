//! Kernels on the fake CUDA driver (tests/fake-cuda/README.md, "Kernels and libraries"): a module
//! loaded at run time, as Triton loads one, whose kernel launches as pending work on its stream,
//! touches the device memory its pointer argument points into, is refused beyond the device's
//! limits, and is kept by a capture and replayed by a graph launch. Each scenario runs in a
//! process of its own.

mod support;

use std::ffi::{c_int, c_uint, c_void};
use std::ptr;

use support::{FakeCuda, in_own_process, new_stream_on};

const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_NOT_FOUND: c_int = 500;
const COUNT_VIOLATIONS: [(&str, &str); 2] = [
    ("FAKE_CUDA_ORDER_FATAL", "0"),
    ("FAKE_CUDA_ORDER_REPORT", ""),
];
const NON_BLOCKING: u32 = 1;

/// A cubin (64-bit ELF) with one kernel `k(char *data, int n)`: its `.nv.info.k` section lists
/// the two parameters (`EIATTR_KPARAM_INFO`: ordinal, offset, size), as `ptxas` writes it.
fn cubin() -> Vec<u8> {
    let names = b"\0.shstrtab\0.nv.info.k\0";
    let mut info = Vec::new();
    for (ordinal, offset, size) in [(0u16, 0u16, 8u32), (1, 8, 4)] {
        info.extend_from_slice(&[4, 0x17, 12, 0]);
        info.extend_from_slice(&0u32.to_le_bytes());
        info.extend_from_slice(&ordinal.to_le_bytes());
        info.extend_from_slice(&offset.to_le_bytes());
        info.extend_from_slice(&((size << 18) | 0x1f000).to_le_bytes());
    }
    let mut elf = vec![0u8; 64];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2;
    let names_at = elf.len();
    elf.extend_from_slice(names);
    let info_at = elf.len();
    elf.extend_from_slice(&info);
    let table = elf.len() as u64;
    elf[0x28..0x30].copy_from_slice(&table.to_le_bytes());
    elf[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
    elf[0x3C..0x3E].copy_from_slice(&3u16.to_le_bytes());
    elf[0x3E..0x40].copy_from_slice(&1u16.to_le_bytes());
    for (name, at, len) in [
        (0u32, 0, 0),
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

struct Kernel<'a> {
    fake: &'a FakeCuda,
    function: *mut c_void,
}

impl Kernel<'_> {
    fn load(fake: &FakeCuda) -> Kernel<'_> {
        let load: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int =
            fake.function("cuModuleLoadData");
        let get: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const std::ffi::c_char) -> c_int =
            fake.function("cuModuleGetFunction");
        let image = cubin();
        let (mut module, mut function) = (ptr::null_mut(), ptr::null_mut());
        // SAFETY: a whole cubin; live out pointers; NUL-terminated names.
        unsafe {
            assert_eq!(load(&mut module, image.as_ptr().cast()), 0);
            assert_eq!(get(&mut function, module, c"k".as_ptr()), 0);
            let mut missing = ptr::null_mut();
            assert_eq!(
                get(&mut missing, module, c"absent".as_ptr()),
                CUDA_ERROR_NOT_FOUND
            );
        }
        Kernel { fake, function }
    }

    /// Launches `k(data, 7)` on `stream` with `threads` threads and `shared` bytes of dynamic
    /// shared memory.
    fn launch(&self, data: u64, stream: u64, threads: c_uint, shared: c_uint) -> c_int {
        type Launch = unsafe extern "C" fn(
            *mut c_void,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            c_uint,
            *mut c_void,
            *mut *mut c_void,
            *mut *mut c_void,
        ) -> c_int;
        let launch: Launch = self.fake.function("cuLaunchKernel");
        let (mut pointer, mut n) = (data, 7i32);
        let mut params = [
            (&raw mut pointer).cast::<c_void>(),
            (&raw mut n).cast::<c_void>(),
        ];
        let stream = ptr::without_provenance_mut(stream as usize);
        // SAFETY: one pointer per parameter of `k`; a stream handle the fake checks.
        unsafe {
            launch(
                self.function,
                4,
                1,
                1,
                threads,
                1,
                1,
                shared,
                stream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        }
    }
}

fn device_alloc(fake: &FakeCuda, size: usize) -> u64 {
    let alloc: unsafe extern "C" fn(*mut u64, usize) -> c_int = fake.function("cuMemAlloc_v2");
    let mut ptr = 0;
    // SAFETY: a live out pointer.
    assert_eq!(unsafe { alloc(&mut ptr, size) }, 0);
    ptr
}

#[test]
fn a_kernel_is_pending_work_that_touches_what_its_pointer_argument_points_into() {
    let test = "a_kernel_is_pending_work_that_touches_what_its_pointer_argument_points_into";
    in_own_process(test, &COUNT_VIOLATIONS, || {
        let fake = FakeCuda::open();
        let a = new_stream_on(0, NON_BLOCKING);
        let b = new_stream_on(0, NON_BLOCKING);
        let kernel = Kernel::load(&fake);
        let data = device_alloc(&fake, 1 << 20);
        assert_eq!(kernel.launch(data, a, 256, 0), 0);
        assert_eq!(fake.stat("kernel_launches"), 1);
        assert_eq!(fake.stat("kernel_pointer_arguments"), 1);
        assert_eq!(fake.stat("order_pending_uses"), 1);
        // Another stream writes what the kernel may still be writing: nothing orders them.
        assert_eq!(fake.memset_async(data, 4096, b), 0);
        assert_eq!(fake.stat("order_violations"), 1);
        // Once the host learns the kernel finished, another stream may use the memory.
        assert_eq!(fake.call_with_handle("cuStreamSynchronize", a), 0);
        assert_eq!(fake.call_with_handle("cuStreamSynchronize", b), 0);
        assert_eq!(fake.stat("order_pending_uses"), 0);
        assert_eq!(kernel.launch(data, b, 256, 0), 0);
        assert_eq!(fake.stat("order_violations"), 1);
        // A number that is no live device memory is no pointer argument.
        assert_eq!(kernel.launch(12345, a, 256, 0), 0);
        assert_eq!(fake.stat("kernel_pointer_arguments"), 2);
    });
}

#[test]
fn a_launch_beyond_the_devices_limits_is_refused() {
    in_own_process("a_launch_beyond_the_devices_limits_is_refused", &[], || {
        // Opened first: the library stays loaded (and its state with it) while the test runs.
        let fake = FakeCuda::open();
        let stream = new_stream_on(0, NON_BLOCKING);
        let kernel = Kernel::load(&fake);
        let data = device_alloc(&fake, 4096);
        assert_eq!(
            kernel.launch(data, stream, 2048, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(kernel.launch(data, stream, 0, 0), CUDA_ERROR_INVALID_VALUE);
        // More than 48 KiB of dynamic shared memory only once the function opts in.
        assert_eq!(
            kernel.launch(data, stream, 128, 64 << 10),
            CUDA_ERROR_INVALID_VALUE
        );
        let set: unsafe extern "C" fn(*mut c_void, c_int, c_int) -> c_int =
            fake.function("cuFuncSetAttribute");
        const MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
        // SAFETY: a function handle the fake gave; plain values.
        unsafe {
            assert_eq!(
                set(kernel.function, MAX_DYNAMIC_SHARED_SIZE_BYTES, 228 << 10),
                CUDA_ERROR_INVALID_VALUE
            );
            assert_eq!(
                set(kernel.function, MAX_DYNAMIC_SHARED_SIZE_BYTES, 100 << 10),
                0
            );
        }
        assert_eq!(kernel.launch(data, stream, 128, 64 << 10), 0);
        assert_eq!(fake.stat("kernel_launches"), 1);
    });
}

#[test]
fn a_captured_kernel_runs_when_the_graph_is_launched() {
    in_own_process(
        "a_captured_kernel_runs_when_the_graph_is_launched",
        &[],
        || {
            // Opened first: the library stays loaded (and its state with it) while the test runs.
            let fake = FakeCuda::open();
            let stream = new_stream_on(0, NON_BLOCKING);
            let kernel = Kernel::load(&fake);
            let data = device_alloc(&fake, 4096);
            let begin: unsafe extern "C" fn(*mut c_void, u32) -> c_int =
                fake.function("cuStreamBeginCapture_v2");
            let end: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int =
                fake.function("cuStreamEndCapture");
            let instantiate: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> c_int =
                fake.function("cuGraphInstantiateWithFlags");
            let launch: unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int =
                fake.function("cuGraphLaunch");
            let handle = ptr::without_provenance_mut(stream as usize);
            let (mut graph, mut exec) = (ptr::null_mut(), ptr::null_mut());
            // SAFETY: a stream the fake made; live out pointers.
            unsafe { assert_eq!(begin(handle, 0), 0) };
            assert_eq!(kernel.launch(data, stream, 64, 0), 0);
            assert_eq!(
                fake.stat("order_kernels"),
                0,
                "a captured kernel does not run"
            );
            // SAFETY: as above.
            unsafe {
                assert_eq!(end(handle, &mut graph), 0);
                assert_eq!(instantiate(&mut exec, graph, 0), 0);
                assert_eq!(launch(exec, handle), 0);
                assert_eq!(launch(exec, handle), 0);
            }
            assert_eq!(fake.stat("order_kernels"), 2);
            assert_eq!(fake.stat("order_pending_uses"), 1);
        },
    );
}
