"""``bastion bench``: the side-by-side comparison of ar, chain, static, fixed-budget best-first trees
and the adaptive bastion controller on one target and drafter, interleaved per prompt."""

from bastion.bench.datasets import Prompt, load_dataset
from bastion.bench.methods import ARDecoder, MethodSpec, default_methods, parse_method
from bastion.bench.metrics import DatasetSummary, MethodStats, PromptRun, aggregate, summarize
from bastion.bench.runner import QUICK, BenchConfig, BenchRun, run_bench

__all__ = [
    "ARDecoder",
    "BenchConfig",
    "BenchRun",
    "DatasetSummary",
    "MethodSpec",
    "MethodStats",
    "Prompt",
    "PromptRun",
    "QUICK",
    "aggregate",
    "default_methods",
    "load_dataset",
    "parse_method",
    "run_bench",
    "summarize",
]
