//! How every property test runs (the integration tests' and the library's unit proptests, which
//! include this file): the same cases on every run unless asked otherwise, so that a green CI
//! means the same thing each time.
//!
//! - By default, proptest's generator starts from [`CI_SEED`]: every run draws the same
//!   programs, the property's own number of them (`cases`).
//! - `PROPTEST_CASES=N` runs N cases instead; `PROPTEST_RNG_SEED=S` draws them from seed S.
//!   proptest reads both from the environment over this configuration. `scripts/properties
//!   CASES` sets both, with a fresh random seed that it prints, so a failure can be rerun.
//! - Cases that failed once are kept in the `.proptest-regressions` file beside the test, and
//!   proptest runs them first, before the drawn ones, whatever the seed.

#![allow(
    dead_code,
    reason = "each test binary uses its own part of the configuration"
)]

use proptest::test_runner::{Config, RngAlgorithm, RngSeed};

/// The seed CI draws every property's cases from.
pub const CI_SEED: u64 = 0x00fe_77ca_c4e2_1021;

/// The configuration of a property with `cases` cases in CI.
pub fn config(cases: u32) -> Config {
    Config {
        cases,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(CI_SEED),
        ..Config::default()
    }
}

/// For the tests that draw their cases from numbered seeds by hand: `cases` seeds from 1 in CI,
/// or `PROPTEST_CASES` of them after `PROPTEST_RNG_SEED`, as for the proptest properties.
pub fn numbered_seeds(cases: u64) -> impl Iterator<Item = u64> {
    let from_env = |name| {
        std::env::var(name).ok().map(|value: String| {
            value
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("{name}={value} is not a number"))
        })
    };
    let cases = from_env("PROPTEST_CASES").unwrap_or(cases);
    let start = from_env("PROPTEST_RNG_SEED").unwrap_or(0);
    (1..=cases).map(move |i| start.wrapping_add(i))
}
