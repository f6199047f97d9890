"""The generic decoder model driven by ``runtime.spec.ModelSpec``."""
