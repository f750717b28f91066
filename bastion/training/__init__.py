"""Training recipe for a small demo pair: a byte-level BPE tokenizer, a Qwen3-architecture target and a
DFlash-format block-diffusion drafter for it.

The stages are separate modules with one job each; ``bastion train`` (``bastion/cli/train_cmd.py``)
drives them:

- :mod:`bastion.training.corpus`    documents from the mixed corpus (code, math, chat) and the chat format
- :mod:`bastion.training.tokenizer` the tokenizer trainer (special tokens incl. the drafter's mask token)
- :mod:`bastion.training.target_model`    the target trainer (resumable, seeded)
- :mod:`bastion.training.distill`   the target's own greedy continuations of training prompts
- :mod:`bastion.training.drafter`   the drafter trainer (blocks ``[anchor, MASK x (B-1)]`` over target features)
- :mod:`bastion.training.export`    half-precision copies for shipping inside the package
"""
