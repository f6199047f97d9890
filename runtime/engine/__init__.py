"""The serving engine: scheduler, block manager, sequences, sampling, detokenizing."""
