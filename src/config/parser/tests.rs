//! The parser's tests: PyTorch's own cases, each key's rules, the order of the passes, the
//! run-time settings of each PyTorch version, and malformed settings.

use crate::config::modelled::NEWEST_PYTORCH;
use crate::config::provenance::PYTORCH_VERSION_VAR;
use crate::config::test_support::{KMB, divisions_at, err, ok, vars};
use crate::config::{
    ACCELERATOR_KEYS, Backend, CUDA_KEYS, Config, ExpandableReserve, HONOURED_KEYS, MB,
};

#[test]
fn settings_changed_at_run_time_keep_what_pytorch_keeps_and_reset_what_it_resets() {
    let start = Config::parse(
        "max_split_size_mb:64,roundup_power2_divisions:4,garbage_collection_threshold:0.6,\
         max_non_split_rounding_mb:40,throw_on_cudamalloc_oom:True",
    )
    .unwrap();
    let changed = start
        .with_runtime_settings("expandable_segments:True")
        .unwrap();
    assert!(changed.expandable_segments);
    // Reset at every parse by PyTorch's AcceleratorAllocatorConfig::parseArgs.
    assert_eq!(changed.max_split_size, usize::MAX);
    assert_eq!(changed.roundup_power2_divisions, [0; 16]);
    assert_eq!(changed.garbage_collection_threshold, 0.0);
    assert_eq!(changed.max_non_split_rounding_size, 20 * MB);
    // Kept: a CUDA key not named.
    assert!(changed.throw_on_cudamalloc_oom);
    assert_eq!(
        changed.provenance.source,
        Some((
            "PYTORCH_CUDA_ALLOC_CONF".into(),
            "expandable_segments:True".into()
        ))
    );
    let again = changed
        .with_runtime_settings("expandable_segments:False,max_split_size_mb:40")
        .unwrap();
    assert!(!again.expandable_segments);
    assert_eq!(again.max_split_size, 40 * MB);
}

/// The settings in effect under PyTorch `version` after `start` from the environment and
/// `runtime` from `_set_allocator_settings`.
fn after_runtime_parse(version: &str, start: &str, runtime: &str) -> Config {
    let config = Config::from_vars(vars(&[
        ("PYTORCH_CUDA_ALLOC_CONF", start),
        (PYTORCH_VERSION_VAR, version),
    ]))
    .unwrap();
    config.with_runtime_settings(runtime).unwrap()
}

#[test]
fn every_version_resets_the_same_three_keys_at_each_runtime_parse() {
    for version in [
        "2.4.1", "2.8.0", "2.9.1", "2.12.1", "2.13.0", "2.15.0", "2.16.0a0",
    ] {
        let changed = after_runtime_parse(
            version,
            "max_split_size_mb:64,roundup_power2_divisions:4,\
             garbage_collection_threshold:0.6,release_lock_on_cudamalloc:True",
            "expandable_segments:True",
        );
        assert_eq!(changed.max_split_size, usize::MAX, "{version}");
        assert_eq!(changed.roundup_power2_divisions, [0; 16], "{version}");
        assert_eq!(changed.garbage_collection_threshold, 0.0, "{version}");
        assert!(changed.release_lock_on_cudamalloc, "{version}: kept");
        assert!(changed.expandable_segments, "{version}");
    }
}

#[test]
fn max_non_split_rounding_is_kept_before_the_large_segment_pass_and_put_back_after() {
    let start = "max_split_size_mb:30,max_non_split_rounding_mb:40";
    for (version, rounding_mb) in [
        ("2.4.1", 40),
        ("2.8.0", 40),
        ("2.10.0", 40),
        ("2.11.0", 20),
        ("2.12.1", 20),
        ("2.13.0", 20),
        ("2.14.1", 20),
        ("2.15.0", 20),
        ("2.16.0a0", 20),
    ] {
        let changed = after_runtime_parse(version, start, "max_split_size_mb:30");
        assert_eq!(
            changed.max_non_split_rounding_size,
            rounding_mb * MB,
            "torch {version}"
        );
        assert_eq!(changed.max_split_size, 30 * MB);
        // Named again, it is taken on every version.
        let named = after_runtime_parse(version, start, "max_non_split_rounding_mb:50");
        assert_eq!(
            named.max_non_split_rounding_size,
            50 * MB,
            "torch {version}"
        );
    }
    // Where the pass exists, the rounding follows a large segment size given in the same
    // text, and one given before.
    let larger = after_runtime_parse("2.15.0", start, "large_segment_size_mb:40");
    assert_eq!(larger.max_non_split_rounding_size, 40 * MB);
    let kept = larger.with_runtime_settings("").unwrap();
    assert_eq!(kept.large_segment_size, 40 * MB);
    assert_eq!(kept.max_non_split_rounding_size, 40 * MB);
}

#[test]
fn without_a_version_the_newest_rules_apply() {
    let config = Config::parse("max_non_split_rounding_mb:40").unwrap();
    assert_eq!(config.modelled.version, NEWEST_PYTORCH);
    let changed = config.with_runtime_settings("").unwrap();
    assert_eq!(changed.max_non_split_rounding_size, 20 * MB);
    let unreadable = Config::from_vars(vars(&[
        ("PYTORCH_CUDA_ALLOC_CONF", "max_non_split_rounding_mb:40"),
        (PYTORCH_VERSION_VAR, "nightly"),
    ]))
    .unwrap();
    assert_eq!(unreadable.modelled.version, NEWEST_PYTORCH);
}

#[test]
fn a_refused_runtime_setting_names_pytorchs_reason() {
    let start = Config::parse("max_split_size_mb:64").unwrap();
    let err = start
        .with_runtime_settings("max_split_size_mb:10")
        .unwrap_err();
    assert_eq!(
        err.message,
        "CachingAllocator option max_split_size_mb too small, must be >= 20"
    );
    let err = start
        .with_runtime_settings("expandable_segments:true")
        .unwrap_err();
    assert!(err.message.contains("Expected 'True' or 'False'"), "{err}");
}

// --- PyTorch's own test (c10/test/core/AllocatorConfig_test.cpp) -----------------------

#[test]
fn pytorch_allocator_config_test_first_setting() {
    let c = ok("max_split_size_mb:40,\
                max_non_split_rounding_mb:30,\
                garbage_collection_threshold:0.5,\
                roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],\
                expandable_segments:True,\
                pinned_use_background_threads:True");
    assert_eq!(c.max_split_size, 40 * KMB);
    assert_eq!(c.max_non_split_rounding_size, 30 * KMB);
    assert_eq!(c.garbage_collection_threshold, 0.5);
    for (mb, expected) in [
        (32, 8),
        (64, 8),
        (128, 2),
        (256, 4),
        (512, 2),
        (1024, 4),
        (2048, 1),
        (4096, 1),
        (8192, 1),
    ] {
        assert_eq!(divisions_at(&c, mb), expected, "{mb} MiB");
    }
    assert!(c.expandable_segments);
    assert_eq!(c.provenance.ignored_keys, ["pinned_use_background_threads"]);
    assert!(
        c.provenance.warnings.is_empty(),
        "{:?}",
        c.provenance.warnings
    );
}

#[test]
fn pytorch_allocator_config_test_limits_of_twenty() {
    let c =
        ok("max_split_size_mb:20,max_non_split_rounding_mb:40,garbage_collection_threshold:0.8");
    assert_eq!(c.max_split_size, 20 * KMB);
    assert_eq!(c.max_non_split_rounding_size, 40 * KMB);
    assert_eq!(c.garbage_collection_threshold, 0.8);
}

#[test]
fn pytorch_allocator_config_test_list_with_gap_and_greater() {
    let c = ok("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]");
    for (mb, expected) in [
        (64, 8),
        (128, 8),
        (256, 16),
        (512, 1),
        (1024, 0),
        (2048, 8),
        (4096, 2),
    ] {
        assert_eq!(divisions_at(&c, mb), expected, "{mb} MiB");
    }
}

#[test]
fn pytorch_allocator_config_test_single_value_and_trailing_comma() {
    let c = ok("roundup_power2_divisions:4");
    for mb in [64, 256, 2048] {
        assert_eq!(divisions_at(&c, mb), 4);
    }
    assert_eq!(c.roundup_power2_divisions, [4; 16]);
    let c = ok("expandable_segments:False,");
    assert!(!c.expandable_segments);
    assert!(c.provenance.warnings.is_empty());
}

/// test_cuda.py `test_allocator_settings`: 84 MiB rounds with 8 divisions, 400 MiB with 2.
#[test]
fn pytorch_test_cuda_allocator_settings_list() {
    let c = ok("garbage_collection_threshold:0.5,\
                roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]");
    assert_eq!(divisions_at(&c, 84), 8);
    assert_eq!(divisions_at(&c, 400), 2);
    assert_eq!(
        err("foo:1,bar:2"),
        "Unrecognized key 'foo' in Accelerator allocator config."
    );
    assert_eq!(
        err("garbage_collection_threshold:1.2"),
        "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"
    );
    assert_eq!(
        err("max_split_size_mb:2"),
        "CachingAllocator option max_split_size_mb too small, must be >= 20"
    );
}

// --- max_split_size_mb / max_non_split_rounding_mb / large_segment_size_mb -------------

#[test]
fn max_split_size_is_kept_in_bytes_and_clamped() {
    assert_eq!(ok("max_split_size_mb:40").max_split_size, 40 * KMB);
    assert_eq!(ok("max_split_size_mb:+40").max_split_size, 40 * KMB);
    let huge = ok("max_split_size_mb:18446744073709551615");
    assert_eq!(huge.max_split_size, usize::MAX / KMB * KMB);
    assert_eq!(
        err("max_split_size_mb:19"),
        "CachingAllocator option max_split_size_mb too small, must be >= 20"
    );
    assert_eq!(
        err("max_split_size_mb:0"),
        "CachingAllocator option max_split_size_mb too small, must be >= 20"
    );
}

#[test]
fn max_non_split_rounding_limits() {
    assert_eq!(
        ok("max_non_split_rounding_mb:20").max_non_split_rounding_size,
        20 * KMB
    );
    assert_eq!(
        err("max_non_split_rounding_mb:19"),
        "CachingAllocator option max_non_split_rounding_mb too small, must be >= 20"
    );
}

#[test]
fn large_segment_size_sets_the_other_limits() {
    let c = ok("max_split_size_mb:12,large_segment_size_mb:12");
    assert_eq!(c.large_segment_size, 12 * KMB);
    assert_eq!(c.max_split_size, 12 * KMB);
    // max_non_split_rounding_mb defaults to the large segment size.
    assert_eq!(c.max_non_split_rounding_size, 12 * KMB);
    assert!(c.provenance.ignored_keys.is_empty());
    assert_eq!(
        err("large_segment_size_mb:40,max_non_split_rounding_mb:30"),
        "CachingAllocator option max_non_split_rounding_mb too small, must be >= 40"
    );
    assert_eq!(
        err("large_segment_size_mb:10"),
        "CachingAllocator option large_segment_size_mb must be > 10 MB"
    );
    assert_eq!(ok("large_segment_size_mb:11").large_segment_size, 11 * KMB);
}

// --- garbage_collection_threshold -------------------------------------------------------

#[test]
fn garbage_collection_threshold_is_strictly_between_0_and_1() {
    assert_eq!(
        ok("garbage_collection_threshold:0.25").garbage_collection_threshold,
        0.25
    );
    for bad in ["0", "1", "1.0", "-0.5", "2", "nan", "inf"] {
        assert_eq!(
            err(&format!("garbage_collection_threshold:{bad}")),
            "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
            "{bad}"
        );
    }
}

// --- roundup_power2_divisions -----------------------------------------------------------

#[test]
fn roundup_single_value_must_be_a_power_of_two() {
    let message = "For roundups, the divisions has to be power of 2 ";
    assert_eq!(err("roundup_power2_divisions:3"), message);
    assert_eq!(err("roundup_power2_divisions:0"), message);
    assert_eq!(
        ok("roundup_power2_divisions:1").roundup_power2_divisions,
        [1; 16]
    );
}

#[test]
fn roundup_list_rejections() {
    assert_eq!(
        err("roundup_power2_divisions:[64:3]"),
        "For roundups, the divisions has to be power of 2 or 0 to disable roundup "
    );
    assert_eq!(
        err("roundup_power2_divisions:[65:8]"),
        "For roundups, the intervals have to be power of 2 "
    );
    assert_eq!(
        err("roundup_power2_divisions:[0:8]"),
        "For roundups, the intervals have to be power of 2 "
    );
    // The division is checked before the interval.
    assert_eq!(
        err("roundup_power2_divisions:[65:3]"),
        "For roundups, the divisions has to be power of 2 or 0 to disable roundup "
    );
    assert_eq!(
        err("roundup_power2_divisions:[64:8,"),
        "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
    );
    let out_of_bounds = "Index out of bounds in ConfigTokenizer (the value of \
                         roundup_power2_divisions is missing or incomplete)";
    assert_eq!(err("roundup_power2_divisions:[64:8"), out_of_bounds);
    assert_eq!(err("roundup_power2_divisions:[64]"), out_of_bounds);
    assert_eq!(err("roundup_power2_divisions:"), out_of_bounds);
    assert_eq!(
        err("roundup_power2_divisions:[abc:8]"),
        "Invalid value 'abc' for roundup_power2_divisions: expected an unsigned integer \
         (PyTorch fails with std::invalid_argument: stoull)"
    );
}

#[test]
fn roundup_list_semantics() {
    // An empty list changes nothing.
    assert_eq!(
        ok("roundup_power2_divisions:[]").roundup_power2_divisions,
        [0; 16]
    );
    // 0 is allowed in a list; interval 1 MB is entry 0; a huge interval is the last entry.
    let c = ok("roundup_power2_divisions:[1:4,2:0,1048576:16]");
    let mut expected = [0; 16];
    expected[0] = 4;
    expected[15] = 16;
    assert_eq!(c.roundup_power2_divisions, expected);
    // `>` first: last_index is 0, so entry 0 keeps its value (the newest PyTorch).
    let c = ok("roundup_power2_divisions:[>:4]");
    let mut expected = [4; 16];
    expected[0] = 0;
    assert_eq!(c.roundup_power2_divisions, expected);
    // A later setting replaces the whole list.
    let c = ok("roundup_power2_divisions:4,roundup_power2_divisions:[256:2]");
    let mut expected = [2; 16];
    expected[9..].fill(4);
    assert_eq!(c.roundup_power2_divisions, expected);
}

// --- booleans ---------------------------------------------------------------------------

#[test]
fn booleans_are_exactly_true_or_false() {
    assert!(ok("expandable_segments:True").expandable_segments);
    assert!(!ok("expandable_segments:False").expandable_segments);
    assert_eq!(
        err("expandable_segments:true"),
        "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'"
    );
    assert_eq!(
        err("max_split_size_mb:40,release_lock_on_cudamalloc:1"),
        "Expected 'True' or 'False' at index 6 in ConfigTokenizer but got '1'"
    );
    for key in [
        "pinned_use_background_threads",
        "release_lock_on_hipmalloc",
        "pinned_use_cuda_host_register",
        "pinned_use_hip_host_register",
        "graph_capture_record_stream_reuse",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    ] {
        assert_eq!(
            err(&format!("{key}:yes")),
            "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'yes'",
            "{key}"
        );
        if key != "throw_on_cudamalloc_oom" {
            assert_eq!(ok(&format!("{key}:True")).provenance.ignored_keys, [key]);
        }
    }
}

#[test]
fn throw_on_cudamalloc_oom_is_honoured() {
    let c = ok("throw_on_cudamalloc_oom:True");
    assert!(c.throw_on_cudamalloc_oom);
    assert!(c.provenance.ignored_keys.is_empty());
    assert!(!ok("throw_on_cudamalloc_oom:False").throw_on_cudamalloc_oom);
    // PyTorch's toBool: `true` is refused (the comment in PyTorch's parser says otherwise).
    assert_eq!(
        err("throw_on_cudamalloc_oom:true"),
        "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'"
    );
    assert!(
        ok("throw_on_cudamalloc_oom:True,per_process_memory_fraction:0.5")
            .describe()
            .contains("past 0.5 of the device is refused at once")
    );
}

#[test]
fn release_lock_is_recorded_and_listed_as_ignored() {
    let c = ok("release_lock_on_cudamalloc:True");
    assert!(c.release_lock_on_cudamalloc);
    assert_eq!(c.provenance.ignored_keys, ["release_lock_on_cudamalloc"]);
    assert!(ok("release_lock_on_hipmalloc:True").release_lock_on_cudamalloc);
}

// --- CUDA settings ----------------------------------------------------------------------

#[test]
fn backend_is_native_or_cuda_malloc_async() {
    assert_eq!(ok("backend:native").backend, Backend::Native);
    let c = ok("backend:cudaMallocAsync");
    assert_eq!(c.backend, Backend::CudaMallocAsync);
    assert_eq!(c.provenance.ignored_keys, ["backend"]);
    let message = "Unknown allocator backend, options are native and cudaMallocAsync";
    assert_eq!(err("backend:hipMallocAsync"), message);
    assert_eq!(err("backend:Native"), message);
}

#[test]
fn pinned_register_threads_and_reserve_segment() {
    let c = ok("pinned_num_register_threads:8");
    assert_eq!(c.pinned_num_register_threads, 8);
    assert_eq!(
        ok("pinned_num_register_threads:128").pinned_num_register_threads,
        128
    );
    assert_eq!(
        err("pinned_num_register_threads:3"),
        "Number of register threads has to be power of 2, got 3"
    );
    assert_eq!(
        err("pinned_num_register_threads:0"),
        "Number of register threads has to be power of 2, got 0"
    );
    assert_eq!(
        err("pinned_num_register_threads:256"),
        "Number of register threads should be less than or equal to 128, got 256"
    );
    ok("pinned_reserve_segment_size_mb:64");
    assert_eq!(
        err("pinned_reserve_segment_size_mb:0"),
        "Pinned reserve segment size has to be greater than 0"
    );
    ok("pinned_max_round_threshold_mb:4,pinned_max_cached_size_mb:1024");
}

#[test]
fn per_process_memory_fraction_is_from_0_to_1() {
    assert_eq!(
        ok("per_process_memory_fraction:0.5").per_process_memory_fraction,
        Some(0.5)
    );
    assert_eq!(
        ok("per_process_memory_fraction:0").per_process_memory_fraction,
        Some(0.0)
    );
    assert_eq!(
        ok("per_process_memory_fraction:1").per_process_memory_fraction,
        Some(1.0)
    );
    for bad in ["1.5", "-0.1", "nan"] {
        assert_eq!(
            err(&format!("per_process_memory_fraction:{bad}")),
            "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"
        );
    }
    assert!(
        ok("per_process_memory_fraction:0.5")
            .provenance
            .ignored_keys
            .is_empty()
    );
}

#[test]
fn expandable_segments_reserve_warns_on_bad_values() {
    let c = ok("expandable_segments_reserve:0.5,expandable_segments_reserve:40G");
    assert!(
        c.provenance.warnings.is_empty(),
        "{:?}",
        c.provenance.warnings
    );
    assert!(c.provenance.ignored_keys.is_empty());
    assert_eq!(
        c.expandable_segments_reserve,
        Some(ExpandableReserve::GiB(40.0))
    );
    assert_eq!(
        ok("expandable_segments_reserve:0.25").expandable_segments_reserve,
        Some(ExpandableReserve::Fraction(0.25))
    );
    // A bad value keeps what was there: the default, or an earlier good value.
    let c = ok("expandable_segments_reserve:0.5,expandable_segments_reserve:abc");
    assert_eq!(
        c.expandable_segments_reserve,
        Some(ExpandableReserve::Fraction(0.5))
    );
    for bad in ["0", "-0.5", "inf", "nan", "G", "1e", "0x10", "1GG"] {
        let c = ok(&format!("expandable_segments_reserve:{bad}"));
        assert_eq!(c.expandable_segments_reserve, None, "{bad}");
        assert_eq!(c.provenance.warnings.len(), 1, "{bad}");
    }
    assert_eq!(
        ExpandableReserve::Fraction(0.5).resolve_bytes(1 << 30),
        1 << 29
    );
    assert_eq!(ExpandableReserve::GiB(1.5).resolve_bytes(0), 3 << 29);
    assert_eq!(ExpandableReserve::GiB(1e20).resolve_bytes(0), usize::MAX);
    assert_eq!(
        ExpandableReserve::Fraction(1e-300).resolve_bytes(1 << 30),
        0
    );
    let c = ok("expandable_segments_reserve:-1");
    assert_eq!(
        c.provenance.warnings,
        [
            "Ignoring invalid expandable-segment reserve value '-1' in PYTORCH_CUDA_ALLOC_CONF \
          (expected a positive, finite fraction like 0.5 or an absolute size like 40G); \
          using default."
        ]
    );
    let c = ok("expandable_segments_reserve_by_class:[a:0.5,b:8g],max_split_size_mb:40");
    assert!(
        c.provenance.warnings.is_empty(),
        "{:?}",
        c.provenance.warnings
    );
    assert_eq!(c.max_split_size, 40 * KMB);
    assert_eq!(
        c.expandable_segments_reserve_by_class,
        [
            ("a".to_string(), ExpandableReserve::Fraction(0.5)),
            ("b".to_string(), ExpandableReserve::GiB(8.0))
        ]
    );
    assert!(c.provenance.ignored_keys.is_empty());
    let c = ok("expandable_segments_reserve_by_class:[a:x,b:0.1,b:0.2]");
    assert_eq!(c.provenance.warnings.len(), 1);
    assert_eq!(
        c.expandable_segments_reserve_by_class,
        [("b".to_string(), ExpandableReserve::Fraction(0.2))]
    );
    ok("expandable_segments_reserve_by_class:[]");
    // The accelerator pass skips the list first and finds no `]`.
    assert_eq!(
        err("expandable_segments_reserve_by_class:[a:0.5"),
        "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
    );
    // A list that closes too early fails in the CUDA pass.
    assert_eq!(
        err("expandable_segments_reserve_by_class:[a]"),
        "Index out of bounds in ConfigTokenizer (the value of \
         expandable_segments_reserve_by_class is missing or incomplete)"
    );
}

// --- keys, order, separators -------------------------------------------------------------

#[test]
fn unknown_keys_are_rejected() {
    assert_eq!(
        err("foo:1"),
        "Unrecognized key 'foo' in Accelerator allocator config."
    );
    assert_eq!(
        err("max_split_size_mb:40,,expandable_segments:True"),
        "Unrecognized key ',' in Accelerator allocator config."
    );
    assert_eq!(
        err("Expandable_segments:True"),
        "Unrecognized key 'Expandable_segments' in Accelerator allocator config."
    );
}

#[test]
fn ignored_keys_are_in_order_without_duplicates() {
    let c = ok(
        "pinned_num_register_threads:8,max_split_size_mb:40,backend:native,\
                pinned_num_register_threads:4,graph_capture_record_stream_reuse:True,\
                pinned_use_cuda_host_register:True",
    );
    assert_eq!(
        c.provenance.ignored_keys,
        [
            "pinned_num_register_threads",
            "backend",
            "graph_capture_record_stream_reuse",
            "pinned_use_cuda_host_register"
        ]
    );
    assert_eq!(c.pinned_num_register_threads, 4);
}

#[test]
fn every_accepted_key_parses() {
    let c = ok(
        "large_segment_size_mb:20,max_split_size_mb:40,max_non_split_rounding_mb:40,\
                garbage_collection_threshold:0.5,roundup_power2_divisions:[256:2,>:4],\
                expandable_segments:True,pinned_use_background_threads:True,\
                pinned_max_round_threshold_mb:8,pinned_max_cached_size_mb:64,\
                backend:native,release_lock_on_cudamalloc:True,\
                pinned_use_cuda_host_register:True,release_lock_on_hipmalloc:False,\
                pinned_use_hip_host_register:False,graph_capture_record_stream_reuse:True,\
                pinned_reserve_segment_size_mb:8,pinned_num_register_threads:8,\
                per_process_memory_fraction:0.9,pinned_free_catch_all:True,\
                throw_on_cudamalloc_oom:True,expandable_segments_reserve:0.5,\
                expandable_segments_reserve_by_class:[x:1G]",
    );
    assert!(
        c.provenance.warnings.is_empty(),
        "{:?}",
        c.provenance.warnings
    );
    let expected_ignored: Vec<&str> = ACCELERATOR_KEYS
        .iter()
        .chain(CUDA_KEYS.iter())
        .copied()
        .filter(|k| !HONOURED_KEYS.contains(k))
        .collect();
    let mut ignored = c.provenance.ignored_keys.clone();
    ignored.sort();
    let mut expected = expected_ignored.clone();
    expected.sort();
    assert_eq!(ignored, expected);
    assert!(
        !c.release_lock_on_cudamalloc,
        "the later hipmalloc spelling wins"
    );
    assert!(!c.pinned_use_cuda_host_register);
    assert!(c.graph_capture_record_stream_reuse);
}

#[test]
fn accelerator_errors_come_before_cuda_errors() {
    // PyTorch parses the shared settings over the whole string before the CUDA ones.
    assert_eq!(
        err("backend:foo,max_split_size_mb:2"),
        "CachingAllocator option max_split_size_mb too small, must be >= 20"
    );
    // large_segment_size_mb is read before everything else.
    assert_eq!(
        err("max_split_size_mb:2,large_segment_size_mb:1"),
        "CachingAllocator option large_segment_size_mb must be > 10 MB"
    );
}

#[test]
fn wrong_separators_pass_with_a_warning_as_in_pytorch() {
    let c = ok("max_split_size_mb,40");
    assert_eq!(c.max_split_size, 40 * KMB);
    assert_eq!(
        c.provenance.warnings,
        [
            "Expected ':' at index 1 of the allocator settings but got ','; PyTorch reads on \
          as if it were there, and so does ferrocache"
        ]
    );
    let c = ok("max_split_size_mb:40:expandable_segments:True");
    assert!(c.expandable_segments);
    assert_eq!(c.provenance.warnings.len(), 1);
    let c = ok("roundup_power2_divisions:[64,8]");
    assert_eq!(divisions_at(&c, 64), 8);
}

// --- no panics ------------------------------------------------------------------------------

/// Feeds many malformed settings built from PyTorch's own words and separators (and some
/// noise); every one must give a value or an error, never a panic or a hang.
#[test]
fn malformed_settings_never_panic() {
    const PIECES: [&str; 32] = [
        ",",
        ":",
        "[",
        "]",
        ">",
        " ",
        "True",
        "False",
        "true",
        "0",
        "1",
        "2",
        "20",
        "64",
        "-1",
        "0.5",
        "1e999",
        "nan",
        "abc",
        "é",
        "\u{0}",
        "40MB",
        "18446744073709551616",
        "max_split_size_mb",
        "roundup_power2_divisions",
        "garbage_collection_threshold",
        "expandable_segments",
        "backend",
        "large_segment_size_mb",
        "expandable_segments_reserve_by_class",
        "per_process_memory_fraction",
        "pinned_num_register_threads",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut accepted = 0;
    for _ in 0..20_000 {
        let len = (next() % 12) as usize;
        let text: String = (0..len)
            .map(|_| PIECES[(next() % PIECES.len() as u64) as usize])
            .collect();
        if let Ok(config) = Config::parse(&text) {
            accepted += 1;
            let _ = config.describe();
            let _ = config.to_pytorch_settings();
        }
    }
    assert!(accepted > 0);
    for text in [
        "[",
        "]",
        ":",
        ",",
        "[[[",
        "]]]",
        ":::",
        ",,,",
        "roundup_power2_divisions:[",
        "roundup_power2_divisions:[>",
        "roundup_power2_divisions:[>:",
        "roundup_power2_divisions:[>:1",
        "roundup_power2_divisions:[:]",
        "expandable_segments_reserve_by_class:",
        "expandable_segments_reserve_by_class:[",
        "expandable_segments_reserve_by_class:[a",
        "expandable_segments_reserve_by_class:[a:",
        "backend",
        "backend:",
        "max_split_size_mb:18446744073709551615",
        "max_non_split_rounding_mb:-1",
        "large_segment_size_mb:-1",
    ] {
        let _ = Config::parse(text);
    }
}
