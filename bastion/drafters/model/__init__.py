"""The ``model`` drafter: a small Hugging Face causal LM drafting candidate trees depth by depth."""

from bastion.drafters.model.drafter import ModelDrafter, load_causal_lm
from bastion.drafters.model.stopping import pays_for_depth, predicted_children, predicted_gain, worth_expanding

__all__ = ["ModelDrafter", "load_causal_lm", "pays_for_depth", "predicted_children", "predicted_gain", "worth_expanding"]
