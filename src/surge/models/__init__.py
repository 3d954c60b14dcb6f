from surge.models.hf import ModelSpec, load_model_spec
from surge.models.bundled import bundled_model_dir

__all__ = ["ModelSpec", "load_model_spec", "bundled_model_dir"]
