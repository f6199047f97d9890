"""The demo's stages are valid `compress` command lines (the demo itself runs for minutes on the
default model: see BENCHMARKS.md for its stage times)."""
from __future__ import annotations

from cli import demo
from cli.main import build_parser


def test_every_stage_parses_and_outputs_under_out_demo():
    parser = build_parser()
    commands = []
    for _, argv in demo.stages():
        args = parser.parse_args(argv)
        commands.append(args.command)
        out = getattr(args, "out", None) or getattr(args, "output", None)
        if out is not None:
            assert str(out).startswith(str(demo.OUT))
            assert args.force
    assert commands[:4] == ["quantize", "quantize", "convert", "convert"]
    assert commands[-1] == "report" and commands.count("eval") == 5


def test_eval_stages_run_on_the_kvslim_runtime_with_the_report_settings():
    parser = build_parser()
    evals = [parser.parse_args(a) for _, a in demo.stages() if a[0] == "eval"]
    report = parser.parse_args(demo.stages()[-1][1])
    for e in evals:
        assert e.backend == "kvslim"
        assert e.limit == report.limit and e.ppl_tokens == report.ppl_tokens
        assert e.ctx == report.ctx == demo.CONTEXT  # the cached evals are the ones the report reads
        assert e.retrieval_contexts == [report.ctx]  # the report runs retrieval at its context
        assert e.ppl_tokens >= 4 * e.ctx  # several full contexts per row
        assert ",".join(e.tasks) == report.tasks
    assert sorted(e.checkpoint for e in evals) == sorted(report.checkpoints)
