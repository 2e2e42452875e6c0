//! A long loop of cache-hit malloc/free pairs with 10,000 live blocks, for profilers:
//! `cargo build --release --example profile_cache_hit && perf record -g
//! target/release/examples/profile_cache_hit`. (The measured figures come from
//! `cargo bench --bench allocator`.)

use ferrocache::allocator::DeviceAllocator;
use ferrocache::config::Config;
use ferrocache::device::sim::SimDevice;
use std::hint::black_box;
fn main() {
    let mut a = DeviceAllocator::new(SimDevice::new(1 << 40), 0, Config::default());
    let live = 10_000;
    let ptrs: Vec<u64> = (0..live + 2).map(|_| a.malloc(4096, 0).unwrap()).collect();
    a.free(ptrs[live / 2]).unwrap();
    let t = std::time::Instant::now();
    let n = 20_000_000;
    for _ in 0..n {
        let p = a.malloc(black_box(4096), 0).unwrap();
        a.free(black_box(p)).unwrap();
    }
    println!("{:.1} ns/pair", t.elapsed().as_nanos() as f64 / n as f64);
}
