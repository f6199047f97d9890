"""`compress convert --heal-steps S`: convert, then heal the conversion with the original as teacher.

The unhealed conversion lives in a temp dir beside the output and is removed once healing is done,
so only the healed checkpoint is published.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from attention_variants.convert import ConvertResult, ConvertSpec, convert
from attention_variants.heal import HealResult, HealSpec, heal
from foundation.atomic import check_output_dir
from foundation.errors import KvslimError


def convert_and_heal(
    source: Path, spec: ConvertSpec, heal_steps: int, out: str | Path, force: bool = False,
    on_converted: Callable[[ConvertResult], None] | None = None,
) -> tuple[ConvertResult, HealResult]:
    """Convert ``source`` per ``spec``, then heal it ``heal_steps`` steps (``HealSpec``'s other
    defaults) into ``out``. ``on_converted`` sees the unhealed conversion before healing starts."""
    if heal_steps < 1:
        raise KvslimError("--heal-steps must be at least 1")
    out = Path(out).expanduser().resolve()
    check_output_dir(out, force)  # before the conversion, not after it
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.unhealed-", dir=out.parent) as tmp:
        converted = convert(source, spec, Path(tmp) / "converted")
        if on_converted is not None:
            on_converted(converted)
        healed = heal(converted.out, source, HealSpec(steps=heal_steps), out, force=force)
    return converted, healed
