"""minigpt: a small GPT, its data, and its arithmetic.

Kept light on purpose: `import minigpt.config` must not import torch.
"""

from minigpt.errors import ConfigError

__all__ = ["ConfigError"]
