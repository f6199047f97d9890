"""`compress serve` refuses bad input with one line and exit code 2, before listening."""
from __future__ import annotations

import pytest

from compress.cli import main


@pytest.mark.parametrize("argv, message", [
    (["serve", "/nonexistent/checkpoint"], "nonexistent"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_no_tokenizer_is_refused(tmp_path, capsys):
    from tests.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "no-tok", "llama")
    assert main(["serve", str(ckpt)]) == 2
    assert "tokenizer" in capsys.readouterr().err
