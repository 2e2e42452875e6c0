"""The package's table of environment variables (``ferrocache._env``): the same words for on/off
as the library, and the names every other module takes from it. ``tests/env.rs`` checks that
the table is the library's."""

import importlib
import pathlib
import re

from ferrocache import _env, _lib, _run, config, oom, torch_api

#: The module, not the function ``ferrocache.install`` that the package exports under its name.
install = importlib.import_module("ferrocache.install")


def test_on_and_off_read_the_same_words_as_the_library():
    for word in ("1", "true", "TRUE", "yes", "On", " on "):
        assert _env.parse_flag(word) is True, word
    for word in ("", "0", "false", "No", "OFF", " 0 "):
        assert _env.parse_flag(word) is False, word
    for word in ("2", "enabled", "y"):
        assert _env.parse_flag(word) is None, word


def test_an_unset_or_unreadable_flag_gives_its_default(monkeypatch):
    monkeypatch.delenv(_env.RUN_REPORT.name, raising=False)
    assert _env.flag_is_on(_env.RUN_REPORT, default=True)
    monkeypatch.setenv(_env.RUN_REPORT.name, "off")
    assert not _env.flag_is_on(_env.RUN_REPORT, default=True)
    monkeypatch.setenv(_env.RUN_REPORT.name, "perhaps")
    assert _env.flag_is_on(_env.RUN_REPORT, default=True)
    monkeypatch.setenv(_env.RUN_RECORD.name, "yes")
    assert _env.flag_is_on(_env.RUN_RECORD)


def test_the_modules_take_their_names_from_the_table():
    assert install.CROSS_STREAM_VAR == _env.CROSS_STREAM.name
    assert install.PYTORCH_VERSION_VAR == _env.PYTORCH_VERSION.name
    assert oom.SNAPSHOT_ON_OOM_VAR == _env.SNAPSHOT_ON_OOM.name
    assert _lib.LIBRARY_ENV == _env.LIBRARY.name
    assert torch_api.OOM_SHIM_ENV == _env.OOM_SHIM.name
    assert _run.RUN_DIR_VAR == _env.RUN_DIR.name
    assert config.ALLOC_CONF_VARS == tuple(v.name for v in _env.TABLE[:3])


def test_no_other_module_spells_a_ferrocache_variable():
    package = pathlib.Path(_env.__file__).parent
    spelt = [
        f"{path.name}:{number}"
        for path in package.rglob("*.py")
        if path.name != "_env.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if not line.lstrip().startswith("#") and re.search(r"[\"']FERROCACHE_", line)
    ]
    assert spelt == []


def test_every_variable_has_a_meaning_and_a_way_of_reading():
    parsings = {"flag", "alloc_conf", "log_level", "pytorch_version", "number", "path",
                "rank_path", "path_list"}
    for variable in _env.TABLE:
        assert variable.meaning, variable.name
        assert variable.parsing in parsings, variable.name
        assert variable.read_by in ("library", "package", "library_and_package"), variable.name
