"""kvslim.eval: what compression cost (perplexity, lm-eval tasks, reports)."""
