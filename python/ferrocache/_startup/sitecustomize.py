"""``ferrocache run``'s startup hook: the launcher puts this folder first on ``PYTHONPATH``, so
Python's ``site`` imports this module at the start of every Python process of the command.

It does two small things and imports nothing heavy:
- it arms an import hook on ``torch``: when ``torch`` has been imported (and before anything can
  have used CUDA), ``ferrocache._run.start()`` installs ferrocache. A process that never imports
  torch pays a list append and one string comparison per top-level import;
- it runs the ``sitecustomize`` the environment already had (the next one on ``sys.path``), so
  that both hooks run.
"""

import os
import sys

#: This folder, left out when the environment's own ``sitecustomize`` is looked for.
_HERE = os.path.dirname(os.path.abspath(__file__))


def _install_ferrocache():
    """Imports the ferrocache beside this hook (the one whose launcher started the process) and
    starts it; a failure is one warning line, never the program's end."""
    try:
        if "ferrocache" not in sys.modules:
            site = os.path.dirname(os.path.dirname(_HERE))
            sys.path.insert(0, site)
            try:
                import ferrocache  # noqa: F401
            finally:
                sys.path.remove(site)
        from ferrocache import _run

        _run.start()
    except Exception as err:  # the program runs on, with PyTorch's own allocator
        if os.environ.get("TORCH_CUDA_ALLOC_LOG_LEVEL", "").strip().upper() in ("OFF", "ERROR"):
            return
        prefix = ""
        if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
            prefix = "[rank%s]:" % os.environ.get("RANK", "?").strip()
        sys.stderr.write(
            "%s[WARN] Allocator: ferrocache run: ferrocache is not installed in this process "
            "(pid %d): %s\n" % (prefix, os.getpid(), err)
        )


class _TorchImportHook:
    """A meta path finder that answers nothing itself: when ``torch`` is about to be imported,
    it finds torch's spec through the other finders and makes its loader install ferrocache
    right after torch's ``__init__`` has run."""

    def __init__(self):
        self._finding = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._finding:
            return None
        self._finding = True
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        hook = self
        run_torch_init = spec.loader.exec_module

        def exec_module(module):
            run_torch_init(module)
            if hook in sys.meta_path:
                sys.meta_path.remove(hook)
            _install_ferrocache()

        spec.loader.exec_module = exec_module
        return spec


def _chain_existing_sitecustomize():
    """Runs the ``sitecustomize`` that Python would have imported without this hook (the next
    ``sitecustomize.py`` on ``sys.path``) as the module ``sitecustomize``. A file test per path
    entry: importlib's finders would cost a start-up more than the rest of the hook."""
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        if folder == _HERE:
            continue
        path = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(path):
            break
    else:
        return
    module = type(sys)("sitecustomize")
    module.__file__ = path
    sys.modules["sitecustomize"] = module
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec")
    exec(code, module.__dict__)


if "torch" in sys.modules:  # imported already (a .pth file): too late for a hook
    _install_ferrocache()
else:
    sys.meta_path.insert(0, _TorchImportHook())
_chain_existing_sitecustomize()
