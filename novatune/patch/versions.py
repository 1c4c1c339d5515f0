"""The transformers releases the patch is built for.

The patched forwards rely on transformers internals that change between releases: the keyword names of the KV
cache (`cache`; `past_key_values` until 5.40 removes it), the decoder handing `position_embeddings` to each attention
module, attention modules carrying `head_dim` / `scaling` / their window, and the mask builder returning a 4-D mask
unchanged. Inside the tested range those hold; outside it `novatune.patch` refuses instead of guessing.
"""
from __future__ import annotations

TRANSFORMERS_MIN = "5.17"  # the oldest release the GPU suite runs against
TRANSFORMERS_BELOW = "5.40"  # removes the deprecated `past_key_values` keyword; the next internals change
SUPPORTED = f">={TRANSFORMERS_MIN},<{TRANSFORMERS_BELOW}"


def installed_transformers() -> str:
    import transformers

    return transformers.__version__


def check_transformers(version: str | None = None) -> None:
    """Raise RuntimeError naming the supported range when the installed transformers is outside it."""
    from packaging.version import Version

    version = installed_transformers() if version is None else version
    v = Version(version)
    if not Version(TRANSFORMERS_MIN) <= Version(v.base_version) < Version(TRANSFORMERS_BELOW):
        raise RuntimeError(f"novatune.patch supports transformers {SUPPORTED} (found {version}): its forwards depend "
                           f"on internals outside that range; install one with pip install 'transformers{SUPPORTED}'")
