"""Hugging Face checkpoint conversion: export our ``torch_dist`` checkpoints, import dense HF models.

See ``README.md`` beside this file for which Hugging Face architecture each model family maps to.
"""

from megatron_md.convert.mappings import ConversionError, Family, choose_family

__all__ = ["ConversionError", "Family", "choose_family"]
