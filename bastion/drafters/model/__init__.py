"""The ``model`` drafter: a small Hugging Face causal LM drafting candidate trees depth by depth."""

from bastion.drafters.model.drafter import ModelDrafter, load_causal_lm
from bastion.drafters.model.stopping import predicted_gain, worth_expanding

__all__ = ["ModelDrafter", "load_causal_lm", "predicted_gain", "worth_expanding"]
