"""``bastion run``: decode a whole prompt file (JSON Lines), resumably, data parallel under torchrun.

- :mod:`bastion.run.inputs`: parse and validate input rows (per-line errors)
- :mod:`bastion.run.encode`: chat template and token ids, prompt-length checks
- :mod:`bastion.run.journal`: output rows, append-only files, torn-line repair, atomic rewrite
- :mod:`bastion.run.job`: shards, decoding in batches, resume, the merge on rank 0
"""

from bastion.run.inputs import InputRow, ParsedInput, RowError
from bastion.run.parse import parse_input
from bastion.run.job import RunConfig, RunSummary, part_path, run_prompts

__all__ = ["InputRow", "ParsedInput", "RowError", "parse_input", "RunConfig", "RunSummary", "part_path", "run_prompts"]
