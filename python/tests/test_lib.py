"""The library: its C signatures against include/ferrocache.h, where it is found, its version."""

from __future__ import annotations

import ctypes
import re
import shutil
from pathlib import Path

import ferrocache
import pytest
from conftest import HEADER, REPO, run_json, run_python
from ferrocache import _lib

#: C type (as cbindgen writes it) -> the ctypes type it must be declared with. An owned string
#: (``char *``) comes back as c_void_p so that it can be given back to ferrocache_string_free.
C_TO_CTYPES = {
    "void": None,
    "void *": ctypes.c_void_p,
    "size_t": ctypes.c_size_t,
    "size_t *": ctypes.POINTER(ctypes.c_size_t),
    "int": ctypes.c_int,
    "double": ctypes.c_double,
    "char *": ctypes.c_void_p,
    "const char *": ctypes.c_char_p,
    "cudaStream_t": ctypes.c_void_p,
    # Function pointers: the package passes ctypes callbacks' addresses.
    "ferrocache_stack_gatherer": ctypes.c_void_p,
    "ferrocache_oom_thrower": ctypes.c_void_p,
    "ferrocache_reserve_class_lookup": ctypes.c_void_p,
    "ferrocache_oom_observer": ctypes.c_void_p,
    "const char * const *": ctypes.POINTER(ctypes.c_char_p),
    "unsigned long long": ctypes.c_ulonglong,
    "uint64_t": ctypes.c_uint64,
    # What the front end (python/ferrocache/frontend.cpp) passes.
    "const char **": ctypes.POINTER(ctypes.c_char_p),
    "ferrocache_oom_thrower *": ctypes.POINTER(ctypes.c_void_p),
    "ferrocache_filter_accepts": ctypes.c_void_p,
    "ferrocache_filter_drop": ctypes.c_void_p,
    "struct ferrocache_device_stats *": ctypes.c_void_p,
    "void * const *": ctypes.POINTER(ctypes.c_void_p),
    "const cudaStream_t *": ctypes.c_void_p,
    "ferrocache_segment_visitor": ctypes.c_void_p,
    "ferrocache_block_visitor": ctypes.c_void_p,
    "struct ferrocache_checkpoint *": ctypes.c_void_p,
    "const struct ferrocache_checkpoint *": ctypes.c_void_p,
    "struct ferrocache_checkpoint_delta *": ctypes.c_void_p,
    # CUDA IPC's handle bytes, their offset and the token of an opened handle.
    "uint8_t *": ctypes.c_void_p,
    "const uint8_t *": ctypes.c_void_p,
    "int64_t *": ctypes.POINTER(ctypes.c_int64),
    "uint64_t *": ctypes.POINTER(ctypes.c_uint64),
    "int64_t": ctypes.c_int64,
    "ferrocache_trace_tracker": ctypes.c_void_p,
    "ferrocache_free_memory_callbacks": ctypes.c_void_p,
    "struct ferrocache_stream_segment_size *": ctypes.c_void_p,
    # A MemPool's own allocator: its alloc, free and release functions.
    "ferrocache_pool_alloc": ctypes.c_void_p,
    "ferrocache_pool_free": ctypes.c_void_p,
    "ferrocache_pool_release": ctypes.c_void_p,
}

_PROTOTYPE = re.compile(r"^\s*([A-Za-z_][\w\s]*?\**)\s*\b(\w+)\(([^)]*)\);", re.MULTILINE)


def _normalise(c_type: str) -> str:
    c_type = " ".join(c_type.replace("*", " * ").split())
    return c_type.replace(" *", " *").replace("* *", "**")


#: The header's C++-only part (the CUDA graph pool hooks, whose types are C++).
_CPP_ONLY = re.compile(r"#ifdef __cplusplus  /\* C\+\+ only \*/.*?#endif  /\* C\+\+ only \*/", re.DOTALL)


def header_prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """``name -> (return type, [parameter types])`` for every C function prototype in
    ``text`` (the C++-only part left out)."""
    text = _CPP_ONLY.sub("", text)
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)
    prototypes = {}
    for match in _PROTOTYPE.finditer(text):
        returns, name, params = match.groups()
        if returns.strip().startswith("typedef"):
            continue
        types = []
        for param in filter(None, (p.strip() for p in params.split(","))):
            if param == "void":
                continue
            # The last word is the parameter's name; stars may stick to it.
            head, _, tail = param.rpartition(" ")
            types.append(_normalise(head + " " + "*" * tail.count("*")))
        prototypes[name] = (_normalise(returns), types)
    return prototypes


def test_the_header_parser_reads_prototypes() -> None:
    sample = """
    // void *commented_out(int x);
    typedef struct CUstream_st *cudaStream_t;
    void *rust_malloc(size_t size, int device, cudaStream_t stream);
    const char *ferrocache_version(void);
    void *rust_base_alloc(void *ptr, size_t *size);
    """
    assert header_prototypes(sample) == {
        "rust_malloc": ("void *", ["size_t", "int", "cudaStream_t"]),
        "ferrocache_version": ("const char *", []),
        "rust_base_alloc": ("void *", ["void *", "size_t *"]),
    }


def test_every_function_of_the_header_is_declared_with_its_signature() -> None:
    prototypes = header_prototypes(HEADER.read_text())
    assert len(prototypes) >= 20, "the header parser found too few prototypes"
    assert sorted(prototypes) == sorted(_lib.SIGNATURES), "declared functions differ from the header"
    for name, (returns, params) in prototypes.items():
        restype, argtypes = _lib.SIGNATURES[name]
        assert restype == C_TO_CTYPES[returns], f"{name} returns {returns}"
        assert list(argtypes) == [C_TO_CTYPES[p] for p in params], f"{name}({', '.join(params)})"


def test_the_loaded_library_exports_every_declared_function() -> None:
    library = _lib.load()
    for name, (restype, argtypes) in _lib.SIGNATURES.items():
        function = getattr(library, name)
        assert function.restype == restype and list(function.argtypes) == list(argtypes), name


def test_rust_malloc_is_never_callable_through_ctypes() -> None:
    with pytest.raises(ValueError, match="C\\+\\+ exceptions"):
        _lib.function("rust_malloc")
    assert _lib.address("rust_malloc") > 0


def test_the_cpp_pool_hooks_are_in_the_header_and_only_given_by_address() -> None:
    text = HEADER.read_text()
    cpp_only = _CPP_ONLY.search(text)
    assert cpp_only is not None, "the header has no C++-only part"
    declared = set(re.findall(r"^void (rust_\w+)\(int device, std::pair", cpp_only.group(0), re.M))
    assert declared == set(_lib.CPP_HOOKS)
    for name in _lib.CPP_HOOKS:
        assert name not in _lib.SIGNATURES
        with pytest.raises(ValueError, match="C\\+\\+ types"):
            _lib.function(name)
        assert _lib.address(name) > 0


def test_versions_agree() -> None:
    cargo = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "Cargo.toml").read_text(), re.M)
    assert cargo is not None
    assert ferrocache.__version__ == cargo.group(1)
    assert ferrocache.library_version() == ferrocache.__version__


def test_a_library_of_another_version_is_refused() -> None:
    out = run_json(
        """
        import ferrocache._lib as lib
        lib.__version__ = "9.9.9"
        try:
            lib.load()
        except ImportError as err:
            result([type(err).__name__, str(err)])
        """
    )
    assert out[0] == "LibraryVersionError"
    assert "is ferrocache 0." in out[1] and "the Python package is 9.9.9" in out[1]


def test_the_library_override_is_used(tmp_path: Path) -> None:
    copy = tmp_path / "libferrocache-dev.so"
    shutil.copy(ferrocache.library_path(), copy)
    out = run_json(
        "import ferrocache; result([str(ferrocache.library_path()), ferrocache.library_version()])",
        env={"FERROCACHE_LIBRARY": str(copy)},
    )
    assert out == [str(copy), ferrocache.__version__]


def test_a_missing_override_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.so"
    out = run_json(
        """
        import ferrocache
        try:
            ferrocache.memory_stats()
        except ImportError as err:
            result([type(err).__name__, str(err)])
        """,
        env={"FERROCACHE_LIBRARY": str(missing)},
    )
    assert out == ["LibraryNotFoundError", f"FERROCACHE_LIBRARY={str(missing)!r} is not a file"]


def test_without_its_library_the_package_imports_and_says_how_to_get_one(tmp_path: Path) -> None:
    package = tmp_path / "ferrocache"
    shutil.copytree(Path(ferrocache.__file__).parent, package, ignore=shutil.ignore_patterns("*.so"))
    out = run_json(
        """
        import ferrocache
        assert ferrocache.__file__.startswith(%r)
        try:
            ferrocache.memory_summary()
        except ImportError as err:
            result(str(err))
        """
        % str(tmp_path),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert "library was not found" in out and "pip install ." in out


def test_the_installed_package_finds_the_library_its_wheel_carried() -> None:
    """Under scripts/python-tests the package comes from a wheel (`pip install .`, or
    FERROCACHE_WHEEL) in a fresh venv: the library lies beside it in ferrocache.libs/."""
    package_dir = Path(ferrocache.__file__).resolve().parent
    if REPO / "python" in package_dir.parents or package_dir == REPO / "python" / "ferrocache":
        pytest.skip("ferrocache is imported from the source tree, not from an installation")
    libraries = list((package_dir.parent / "ferrocache.libs").glob("libferrocache-*.so"))
    assert len(libraries) == 1, libraries
    assert ferrocache.library_path() == libraries[0]
    assert libraries[0].stat().st_size > 100_000


def test_two_libraries_beside_the_package_are_refused(tmp_path: Path) -> None:
    shutil.copytree(Path(ferrocache.__file__).parent, tmp_path / "ferrocache",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    libs = tmp_path / "ferrocache.libs"
    libs.mkdir()
    for name in ("libferrocache-00000000.so", "libferrocache-11111111.so"):
        shutil.copy(ferrocache.library_path(), libs / name)
    out = run_json(
        """
        import ferrocache
        try:
            ferrocache.library_path()
        except ImportError as err:
            result(str(err))
        """,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert "several ferrocache libraries" in out and "libferrocache-11111111.so" in out


def test_the_command_line_entry_point_runs_in_process() -> None:
    """ferrocache_cli_main is the whole command: the binary only forwards its arguments."""
    out = run_json(
        """
        import ctypes, ferrocache._lib as lib
        def main(*args):
            argv = (ctypes.c_char_p * len(args))(*[a.encode() for a in args])
            return lib.function("ferrocache_cli_main")(len(args), argv)
        result([main("ferrocache", "check-config", "expandable_segments:True"),
                main("ferrocache", "check-config", "expandable_segments:yes"),
                main("ferrocache", "--no-such-option"),
                main("ferrocache", "--version"),
                lib.function("ferrocache_cli_main")(0, None)])
        """
    )
    # Accepted, rejected by PyTorch's rules, a usage error, the version, no arguments at all.
    assert out == [0, 2, 2, 0, 2]


def test_loading_reads_no_settings() -> None:
    """Loading the library and asking its version must not make it read its settings (install()
    sets them first)."""
    out = run_json(
        """
        import ferrocache, ferrocache._lib as lib
        lib.load(); ferrocache.library_version()
        result(lib.settings_may_be_read())
        """
    )
    assert out is False
    run_python("import ferrocache; ferrocache.check_config('')")
