"""Atomic directory writes: build in a sibling temp dir, rename into place at the end."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from compress.errors import KvslimError


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse to overwrite an existing output unless ``force`` is set."""
    if out.exists() and not force:
        raise KvslimError(f"output {out} already exists (pass --force to overwrite)")


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike[str], force: bool = False) -> Iterator[Path]:
    """Yield a temp directory next to ``out``; on success rename it to ``out``.

    On any exception the temp directory is removed and ``out`` is left as it was, so a failed
    run never leaves a half-written checkpoint behind.
    """
    out = Path(out).expanduser().resolve()
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
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
