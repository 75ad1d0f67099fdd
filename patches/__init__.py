"""The few places where hf_cascade changes transformers' behaviour (installed as ``hf_cascade.patches``).

Each patch is guarded by the transformers version it was written against and acts only on models
whose ``config._attn_implementation`` is "cascade"; each has a test that fails if upstream changes
under it (tests/test_patches.py).

- ``generate``: cascade models run hf_cascade's decoding entry with no extra argument.
- ``loading``: a clear error instead of ``KeyError: 'cascade'`` for models with their own attention tables
  that ``families`` does not serve.
- ``families``: attention modules that route through AttentionInterface for families whose own code does not:
  Falcon with rotary positions and GPT-Neo (a "cascade" entry in their tables), XGLM's self-attention; GPT-J
  and CodeGen before transformers routed them.
- ``t5_mask``: T5-family decoder stacks take a static decode step's self-attention mask from their cache.
"""
from .generate import apply as apply_generate_patch, is_applied as generate_patch_applied  # noqa: F401
from .loading import apply as apply_loading_patch, is_applied as loading_patch_applied  # noqa: F401
from .families import apply as apply_families_patch, is_applied as families_patch_applied  # noqa: F401
from .positions import apply as apply_positions_patch, is_applied as positions_patch_applied  # noqa: F401
from .whisper_encoder import apply as apply_whisper_encoder_patch, is_applied as whisper_encoder_patch_applied  # noqa: F401,E501
from .t5_mask import apply as apply_t5_mask_patch, is_applied as t5_mask_patch_applied  # noqa: F401


def apply() -> None:
    apply_generate_patch()
    apply_loading_patch()
    apply_families_patch()
    apply_positions_patch()
    apply_whisper_encoder_patch()
    apply_t5_mask_patch()
