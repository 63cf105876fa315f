"""``tiered-offload train``: fine-tune a local Hugging Face model directory from one command and a
YAML file (:mod:`.config`), with its data tokenised once (:mod:`.data`) and the run resumable by
default (:mod:`.run`)."""

from .config import RunConfig, load_config
from .run import train

__all__ = ["RunConfig", "load_config", "train"]
