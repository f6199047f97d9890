"""Atomic directory writes: build in a sibling temp dir, rename into place at the end."""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from foundation.errors import KvslimError


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse to overwrite an existing output unless ``force`` is set."""
    if out.exists() and not force:
        raise KvslimError(f"output {out} already exists (pass --force to overwrite)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_stale_temp_dirs(out: Path) -> list[Path]:
    """Remove the temp dirs of earlier writes to ``out`` whose process is gone (a SIGKILL or a
    power cut cannot clean up after itself); returns what was removed. The writer's PID is in
    the name, so a write still running in another process is left alone."""
    removed = []
    for kind in ("tmp", "old"):
        for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
            m = re.fullmatch(rf"\.{re.escape(out.name)}\.{kind}-(\d+)(-.*)?", path.name)
            if m and path.is_dir() and not _alive(int(m.group(1))):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike[str], force: bool = False, checked: bool = False) -> Iterator[Path]:
    """Yield a temp directory next to ``out``; on success rename it to ``out``.

    On any exception the temp directory is removed and ``out`` is left as it was, so a failed
    run never leaves a half-written checkpoint behind; what a killed run left is swept by the
    next write to the same ``out``. ``checked``: the caller already ran ``check_output_dir``.
    """
    out = Path(out).expanduser().resolve()
    if not checked:
        check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temp_dirs(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            trash = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a sibling temp file and a rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@contextlib.contextmanager
def atomic_output_file(path: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a sibling temp file path for ``path``; on success rename it to ``path``, on any
    exception remove it (``path`` is left as it was). Refuses an existing ``path`` without ``force``."""
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        raise KvslimError(f"output {path} is a directory; name a file")
    check_output_dir(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
