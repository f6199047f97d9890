"""`kvslim-lm-eval`: lm-eval's own command line with the ``kvslim`` model registered.

lm-eval finds models only in its registry (no plugin discovery), so this entry point registers
``kvslim`` and hands over to ``lm_eval.__main__.cli_evaluate`` unchanged:

    kvslim-lm-eval run --model kvslim --model_args pretrained=out/ckpt,kv_cache_dtype=fp8 \\
        --tasks arc_easy_local --include_path "$(python -c 'from eval.task_pack import ensure_pack; print(ensure_pack())')"
"""
from __future__ import annotations

import os


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.__main__ import cli_evaluate

    from eval.lm_eval_adapter import register

    register()
    cli_evaluate()


if __name__ == "__main__":
    main()
