"""The decision cache: one JSON file of tuning decisions, kept across processes.

Location: ``$MLX_BRICKS_HOME/tune/decisions.json`` (``MLX_BRICKS_HOME`` defaults to
``~/.cache/mlx_bricks``, the root that also holds the converted models). Layout::

    {"format": 1,
     "contexts": {"<context id>": {"context": {device, architecture, mlx, mlx_bricks, kernels},
                                   "updated": <unix time>,
                                   "decisions": {"<backend>|<key>": {decision}, ...}}}}

A context is what makes a measurement valid: the device (name and architecture as
``mx.device_info()`` reports them), the MLX version, the mlx-bricks version and a hash of every
kernel source and op module (``kernel_source_hash``). Decisions of another context are kept but
never used; the oldest contexts beyond :data:`MAX_CONTEXTS` are dropped on write.

Writes are atomic (a temporary file in the same directory, ``fsync``, ``os.replace``) and merge
under an exclusive ``flock`` on ``decisions.json.lock``: two processes tuning at once both keep
their decisions. A file that is not valid JSON or has another format is ignored with one line on
stderr (and replaced by the next write); nothing here raises for a bad or unwritable file.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.resources
import json
import os
import pkgutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

#: Version of the file layout this code reads and writes.
FORMAT = 1
FILE_NAME = "decisions.json"
#: Contexts kept in the file (the most recently updated ones).
MAX_CONTEXTS = 16

_WARNED: set[tuple[str, str]] = set()


def warn_once(path, problem: str) -> None:
    """One line on stderr, once per process for each (file, kind of problem)."""
    key = (str(path), problem.split(":")[0])
    if key in _WARNED:
        return
    _WARNED.add(key)
    print(f"mlx-bricks: warning: tuning cache {path}: {problem}", file=sys.stderr)


def default_path() -> Path:
    """``$MLX_BRICKS_HOME/tune/decisions.json`` (``mlx_bricks.home``)."""
    from mlx_bricks.home import home

    return home() / "tune" / FILE_NAME


#: Packages whose modules decide what runs (tile rules, launch geometry, kernel inputs and
#: template parameters): hashed beside the kernel sources.
HASHED_PACKAGES = ("mlx_bricks.bricks", "mlx_bricks.formats")


@lru_cache(maxsize=None)
def kernel_source_hash() -> str:
    """12 hex digits of SHA-256 over every registered kernel's source as given to MLX
    (``mlx_bricks.kernels.kernel_source``, MSL and each CUDA twin) and over the modules of
    :data:`HASHED_PACKAGES` (the bricks' tile rules and launch geometry, the weight formats'
    kernel inputs). Any edit changes it, so a decision measured on other kernels is never used.
    The packages are imported by name here (importing them registers every kernel), so this
    module does not depend on them."""
    from mlx_bricks import kernels

    h = hashlib.sha256()
    for package in HASHED_PACKAGES:
        pkg = importlib.import_module(package)
        for info in sorted(pkgutil.walk_packages(pkg.__path__, package + "."),
                           key=lambda i: i.name):
            mod = importlib.import_module(info.name)  # registers its kernels
            if mod.__file__:
                h.update(info.name.encode() + b"\0" + Path(mod.__file__).read_bytes())
    for name in kernels.registered():
        for backend in ("metal", "cuda"):
            if kernels.has_kernel(name, backend):
                try:
                    _, header, body = kernels.kernel_source(name, backend)
                except (OSError, ValueError) as e:
                    # A spec whose files are missing cannot be built either: hash the fact, the
                    # cache must work (and never raise) regardless.
                    header, body = "", f"unreadable: {e}"
                h.update(f"{name}/{backend}\0{header}\0{body}\0".encode())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class Context:
    """What a decision's measurement depends on besides the op and shape (module docstring)."""

    device: str
    architecture: str
    mlx: str
    mlx_bricks: str
    kernels: str

    @property
    def id(self) -> str:
        return (f"{self.device} ({self.architecture}) | mlx {self.mlx} | "
                f"mlx-bricks {self.mlx_bricks} | kernels {self.kernels}")


def current_context() -> Context:
    """The context of this process (default device as MLX reports it)."""
    import mlx.core as mx

    import mlx_bricks

    info = mx.device_info()
    return Context(str(info.get("device_name", "unknown")), str(info.get("architecture", "unknown")),
                   mx.__version__, mlx_bricks.__version__, kernel_source_hash())


@contextlib.contextmanager
def _locked(lock_path: Path):
    """Exclusive advisory lock (``flock``) on ``lock_path`` while the block runs. Where
    ``fcntl`` does not exist the block runs unlocked (still atomic, last writer wins)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _empty() -> dict:
    return {"format": FORMAT, "contexts": {}}


def read_file(path: Path) -> dict:
    """The file's content in the current layout; an empty layout (and one warning line) when
    it is missing, unreadable, not JSON, of another format or of an unexpected structure."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return _empty()
    except (OSError, UnicodeDecodeError) as e:
        warn_once(path, f"unreadable, ignored: {' '.join(str(e).split())}")
        return _empty()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        warn_once(path, f"corrupt (not valid JSON: {e}), ignored; the next tuning rewrites it")
        return _empty()
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        fmt = data.get("format") if isinstance(data, dict) else None
        warn_once(path, f"foreign format {fmt!r} (this mlx-bricks reads format {FORMAT}), "
                        "ignored; the next tuning rewrites it")
        return _empty()
    contexts = data.get("contexts")
    if not isinstance(contexts, dict) or not all(
            isinstance(c, dict) and isinstance(c.get("decisions"), dict)
            for c in contexts.values()):
        warn_once(path, "unexpected structure (no contexts/decisions objects), ignored")
        return _empty()
    return data


class DecisionCache:
    """Decisions of one context in one file (module docstring).

    Args:
        path: the JSON file (default :func:`default_path`).
        context: the context whose decisions are read and written (default
            :func:`current_context`).
    """

    def __init__(self, path: str | os.PathLike | None = None, context: Context | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.context = context if context is not None else current_context()
        self._stamp = None
        self._decisions: dict[str, dict] = {}

    def _file_stamp(self):
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def decisions(self) -> dict[str, dict]:
        """This context's decisions, ``"<backend>|<key>" -> decision dict`` (re-read when the
        file changed since the last read)."""
        stamp = self._file_stamp()
        if stamp != self._stamp:
            self._stamp = stamp
            ctx = read_file(self.path)["contexts"].get(self.context.id, {})
            self._decisions = dict(ctx.get("decisions", {}))
        return self._decisions

    def get(self, key: str) -> dict | None:
        """The decision stored under ``key``, or None."""
        value = self.decisions().get(key)
        return value if isinstance(value, dict) else None

    def put(self, entries: dict[str, dict]) -> bool:
        """Merge ``entries`` into this context's decisions on disk (lock, read, merge, atomic
        replace). Returns False (after one warning line) when the file cannot be written; the
        entries then stay in this object only."""
        self._decisions.update(entries)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path.with_name(self.path.name + ".lock")):
                data = read_file(self.path)
                contexts = data["contexts"]
                ctx = contexts.setdefault(self.context.id, {"context": asdict(self.context),
                                                            "decisions": {}})
                ctx["decisions"].update(entries)
                ctx["updated"] = time.time()
                for old in sorted(contexts, key=lambda c: contexts[c].get("updated", 0))[
                        :max(0, len(contexts) - MAX_CONTEXTS)]:
                    del contexts[old]
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".decisions-",
                                           suffix=".tmp")
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as fh:
                        json.dump(data, fh, indent=1, sort_keys=True)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, self.path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                self._decisions = dict(ctx["decisions"])
                self._stamp = self._file_stamp()
        except OSError as e:
            warn_once(self.path, f"cannot be written: {' '.join(str(e).split())}; decisions "
                                 "are kept for this process only")
            return False
        return True

    def clear(self) -> bool:
        """Delete the file (every context). Returns whether there was one."""
        self._decisions, self._stamp = {}, None
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        return True
