"""``ferrocache run -- COMMAND`` with real PyTorch on the fake CUDA: scripts that never import
ferrocache (``launcher_scripts/``) get it as their allocator, through ``python script.py``,
``torchrun``, ``python -m``, a console script and ``multiprocessing``'s spawn; each process
reports at exit; settings are checked before the command starts; the exit status and SIGTERM
pass through.

The command is the installed package's (``scripts/with-fake-cuda`` installs it with ``pip
install .`` and puts its ``bin/`` first on PATH); one test runs the cargo build's instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

from conftest import REPO
from torch_env import require_real_torch, torch_env

require_real_torch()

SCRIPTS = Path(__file__).resolve().parent / "launcher_scripts"
TRAIN = SCRIPTS / "train.py"
#: A job's limit: torch's import costs seconds per process on two shared cores.
LIMIT_S = 300
#: The first line of a process's report, with the rank prefix of a job's logs.
REPORT_HEAD = re.compile(r"^(\[rank(\d+)\]:)?ferrocache: pid (\d+) ", re.MULTILINE)


def ferrocache_command() -> str:
    found = shutil.which("ferrocache")
    if found is None:
        pytest.fail("no `ferrocache` command on PATH: run under scripts/with-fake-cuda")
    return found


def launch(
    args: Sequence[str],
    tmp_path: Path,
    ranks: int = 1,
    env: Optional[dict[str, str]] = None,
    command: Optional[str] = None,
) -> subprocess.CompletedProcess[str]:
    """Runs ``ferrocache ARGS`` in ``tmp_path`` with ``ranks`` fake GPUs."""
    full_env = dict(os.environ)
    full_env.pop("FERROCACHE_LIBRARY", None)
    full_env.update(torch_env(FAKE_LIBCUDA_DEVICE_COUNT=str(ranks), OMP_NUM_THREADS="1"))
    full_env.update(env or {})
    return subprocess.run(
        [command or ferrocache_command(), *args], env=full_env, cwd=tmp_path,
        capture_output=True, text=True, timeout=LIMIT_S,
    )  # fmt: skip


def explain(process: subprocess.CompletedProcess[str]) -> str:
    return f"exit {process.returncode}\n--- stdout\n{process.stdout}\n--- stderr\n{process.stderr}"


def answer(path: Path) -> dict:
    return json.loads(path.read_text())


def assert_served_by_ferrocache(result: dict) -> None:
    assert result["ferrocache_loaded"] and result["installed"], result
    assert result["allocated_current"] == result["kept_bytes"], result
    assert result["peak_reserved"] > 0 and result["stats_are_ferrocache"], result


def report_blocks(stderr: str) -> list[re.Match[str]]:
    return list(REPORT_HEAD.finditer(stderr))


def test_a_python_script_allocates_through_ferrocache_and_reports_at_exit(tmp_path):
    process = launch(["run", "--", sys.executable, str(TRAIN), "out.json"], tmp_path)
    assert process.returncode == 0, explain(process)
    assert_served_by_ferrocache(answer(tmp_path / "out.json"))
    blocks = report_blocks(process.stderr)
    assert len(blocks) == 1 and blocks[0].group(1) is None, explain(process)
    for column in ("peak allocated", "peak reserved", "utilization", "device allocs", "retries", "OOMs"):
        assert column in process.stderr, explain(process)
    assert re.search(r"^  cuda:0 +\d+\.\d+ MiB +\d+\.\d+ MiB +\d+\.\d% +\d+ +0 +0$", process.stderr,
                     re.MULTILINE), explain(process)  # fmt: skip


def test_quiet_writes_no_report_and_json_writes_the_same_figures(tmp_path):
    process = launch(["run", "--quiet", "--report", "json:report.json", "--", sys.executable,
                      str(TRAIN), "out.json"], tmp_path)  # fmt: skip
    assert process.returncode == 0, explain(process)
    assert report_blocks(process.stderr) == [], explain(process)
    report = answer(tmp_path / "report.json")
    result = answer(tmp_path / "out.json")
    assert report["rank"] == 0 and report["world_size"] == 1
    (device,) = report["devices"]
    assert device["device"] == 0 and device["peak_reserved_bytes"] == result["peak_reserved"]
    assert device["ooms"] == 0 and device["device_allocs"] > 0


def test_torchrun_ranks_each_run_on_ferrocache_and_report_with_their_prefix(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"  # torchrun is itself a console script
    process = launch(
        ["run", "--report", "json:report.json", "--", str(torchrun), "--standalone",
         "--nproc-per-node", "2", str(TRAIN), "out_{rank}.json"],
        tmp_path, ranks=2,
    )  # fmt: skip
    assert process.returncode == 0, explain(process)
    for rank in (0, 1):
        result = answer(tmp_path / f"out_{rank}.json")
        assert result["rank"] == rank and result["device"] == rank
        assert_served_by_ferrocache(result)
    blocks = report_blocks(process.stderr)
    assert sorted(int(b.group(2)) for b in blocks) == [0, 1], explain(process)
    for rank in (0, 1):
        report = answer(tmp_path / f"report_rank{rank}.json")
        assert report["rank"] == rank and report["world_size"] == 2
        assert report["devices"][0]["device"] == rank
        # Every line of a rank's block carries its prefix.
        block = [l for l in process.stderr.splitlines() if l.startswith(f"[rank{rank}]:")]
        assert any(f"cuda:{rank} " in l for l in block), explain(process)
    assert "job (2 ranks)" in process.stderr, explain(process)


def test_python_dash_m_with_expandable_segments(tmp_path):
    package = tmp_path / "trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(textwrap.dedent(
        """
        import ctypes, json, sys
        import torch
        x = torch.empty(50 << 20, dtype=torch.uint8, device="cuda")
        fake = ctypes.CDLL("libcuda.so.1")
        fake.fake_cuda_stat.restype = ctypes.c_int64
        reserves = fake.fake_cuda_stat(b"cuMemAddressReserve")
        ferrocache = sys.modules.get("ferrocache")
        with open("out.json", "w") as f:
            json.dump({"installed": bool(ferrocache and ferrocache.is_installed()),
                       "address_reserves": reserves,
                       "allocated": torch.cuda.memory_allocated()}, f)
        """
    ))  # fmt: skip
    process = launch(["run", "--conf", "expandable_segments:True", "--", sys.executable, "-m",
                      "trainer.main"], tmp_path)  # fmt: skip
    assert process.returncode == 0, explain(process)
    result = answer(tmp_path / "out.json")
    # Expandable segments reserve an address range and map pages into it.
    assert result["installed"] and result["address_reserves"] > 0, result
    assert result["allocated"] == 50 << 20
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'" in process.stderr, explain(process)


def test_a_console_script_entry_point(tmp_path):
    (tmp_path / "mytool.py").write_text(textwrap.dedent(
        """
        import runpy, sys
        def main():
            sys.argv = [%r, "out.json"]
            runpy.run_path(sys.argv[0], run_name="__main__")
            return 0
        """ % str(TRAIN)
    ))  # fmt: skip
    # What pip writes for an entry point `mytool = mytool:main`.
    script = tmp_path / "mytool"
    script.write_text(
        f"#!{sys.executable}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
        "from mytool import main\nif __name__ == '__main__':\n"
        "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
        "    sys.exit(main())\n"
    )
    script.chmod(0o755)
    process = launch(["run", "--", str(script)], tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert process.returncode == 0, explain(process)
    assert_served_by_ferrocache(answer(tmp_path / "out.json"))
    assert len(report_blocks(process.stderr)) == 1, explain(process)


def test_an_existing_sitecustomize_still_runs(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import os\nopen(os.path.join(os.getcwd(), 'their_sitecustomize_ran'), 'w').close()\n"
    )
    process = launch(["run", "--", sys.executable, str(TRAIN), "out.json"], tmp_path,
                     env={"PYTHONPATH": str(hooks)})  # fmt: skip
    assert process.returncode == 0, explain(process)
    assert (tmp_path / "their_sitecustomize_ran").exists(), explain(process)
    assert_served_by_ferrocache(answer(tmp_path / "out.json"))


def test_multiprocessing_spawn_children_run_on_ferrocache(tmp_path):
    process = launch(["run", "--", sys.executable, str(SCRIPTS / "spawn_workers.py"), "out.json"],
                     tmp_path)  # fmt: skip
    assert process.returncode == 0, explain(process)
    result = answer(tmp_path / "out.json")
    assert result["exit_codes"] == [0, 0]
    assert all(c["installed"] and c["allocated_current"] == 8 << 20 for c in result["children"])
    # Two reports, one per child; the parent used no CUDA and reports nothing.
    assert len(report_blocks(process.stderr)) == 2, explain(process)


def test_the_exit_status_passes_through(tmp_path):
    process = launch(["run", "--", sys.executable, str(TRAIN), "out.json", "--exit", "3"], tmp_path)
    assert process.returncode == 3, explain(process)
    assert len(report_blocks(process.stderr)) == 1, explain(process)


@pytest.mark.parametrize("handled", [True, False], ids=["handled", "default"])
def test_sigterm_reaches_the_child(tmp_path, handled):
    args = ["run", "--", sys.executable, str(TRAIN), str(tmp_path / "out.json"), "--wait-for-sigterm"]
    if not handled:
        args.append("--default-sigterm")
    env = dict(os.environ)
    env.pop("FERROCACHE_LIBRARY", None)
    env.update(torch_env(FAKE_LIBCUDA_DEVICE_COUNT="1"))
    launcher = subprocess.Popen([ferrocache_command(), *args], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (tmp_path / "ready").exists():
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the script never got ready"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)  # to the launcher alone, as a scheduler does
        stdout, stderr = launcher.communicate(timeout=LIMIT_S)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    if handled:
        assert (tmp_path / "sigterm").exists() and launcher.returncode == 42, stderr
        assert len(report_blocks(stderr)) == 1, stderr
    else:
        # Killed by SIGTERM, the child's end is the launcher's.
        assert launcher.returncode == -signal.SIGTERM, stderr


def test_a_bad_conf_is_refused_before_the_command_starts(tmp_path):
    check = launch(["check-config", "max_split_size_mb:lots"], tmp_path)
    assert check.returncode == 2
    pytorch_words = check.stderr.split("PyTorch rejects", 1)[1].split(": ", 1)[1].strip()
    marker = tmp_path / "started"
    process = launch(["run", "--conf", "max_split_size_mb:lots", "--", sys.executable, "-c",
                      f"open({str(marker)!r}, 'w')"], tmp_path)  # fmt: skip
    assert process.returncode == 2, explain(process)
    assert pytorch_words in process.stderr and "not started" in process.stderr, explain(process)
    assert not marker.exists()


def test_record_gives_the_recommended_setting_and_the_line_to_paste(tmp_path):
    process = launch(["run", "--record", "--report", "json:report.json", "--", sys.executable,
                      str(TRAIN), "out.json"], tmp_path)  # fmt: skip
    assert process.returncode == 0, explain(process)
    assert re.search(r"^  advice for cuda:0: .* would have reserved ", process.stderr, re.MULTILINE), explain(process)
    assert re.search(r"^  paste: export PYTORCH_CUDA_ALLOC_CONF=\S*$", process.stderr, re.MULTILINE), explain(process)
    advice = answer(tmp_path / "report.json")["devices"][0]["advice"]
    assert advice["exports"] and advice["recommended_peak_reserved_bytes"] > 0, advice


def test_the_cargo_build_runs_the_checkout_package(tmp_path):
    """`cargo run -- run ...`: no package installed for that build; the launcher points the
    child at the checkout's python/ and the build's library."""
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target")
    built = [target / profile / "ferrocache" for profile in ("debug", "release")]
    built = [b for b in built if b.is_file() and (b.parent / "libferrocache.so").is_file()]
    if not built:
        pytest.skip("no cargo build of the ferrocache command (cargo build)")
    newest = max(built, key=lambda b: (b.parent / "libferrocache.so").stat().st_mtime)
    process = launch(["run", "--", sys.executable, str(TRAIN), "out.json"], tmp_path,
                     command=str(newest))  # fmt: skip
    assert process.returncode == 0, explain(process)
    assert_served_by_ferrocache(answer(tmp_path / "out.json"))
    assert len(report_blocks(process.stderr)) == 1, explain(process)
