"""The `compress` entry point itself: what it does with errors no command raises."""
from __future__ import annotations

import subprocess
import sys


def test_reader_leaving_the_pipe_is_not_a_traceback(tiny_llama):
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "inspect", str(tiny_llama)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head -0`: the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err, err
