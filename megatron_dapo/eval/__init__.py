"""Evaluation: avg@k / pass@k / maj@k with the DAPO reward, from an engine or an HTTP endpoint."""

from megatron_dapo.eval.metrics import ProblemSamples, aggregate, avg_at_k, maj_at_k, pass_at_k

__all__ = ["ProblemSamples", "aggregate", "avg_at_k", "maj_at_k", "pass_at_k"]
