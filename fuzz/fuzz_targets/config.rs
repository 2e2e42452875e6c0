//! `PYTORCH_CUDA_ALLOC_CONF` (and `TORCH_CUDA_ALLOC_LOG_LEVEL`) as the process environment hands
//! them to ferrocache: any bytes, read lossily as the library reads the environment.
//! Properties: no panic, no hang, memory within the bound, the same answer twice, and an
//! accepted setting can be described and exported as PyTorch's snapshot settings.
#![no_main]

use ferrocache::config::{Config, LogLevel};
use ferrocache_fuzz::{CountingAllocator, within_memory_bound};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data).into_owned();
    let lookup = |name: &str| (name == "PYTORCH_CUDA_ALLOC_CONF").then(|| text.clone());
    let first = within_memory_bound(data.len(), || {
        let config = Config::from_vars(lookup);
        if let Ok(config) = &config {
            let _ = config.describe();
            let _ = config.to_pytorch_settings();
        }
        let _ = LogLevel::parse(&text);
        config
    });
    assert_eq!(
        first,
        Config::from_vars(lookup),
        "two reads of one setting differ"
    );
});
