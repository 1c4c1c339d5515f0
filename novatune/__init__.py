"""novatune: faster, leaner LLM fine-tuning on the GPUs you already have.

One line in an existing Hugging Face / TRL script::

    import novatune
    report = novatune.patch(model)      # or novatune.patch(trainer)
    print(report)                       # what was replaced, what was skipped and why
    report.revert()                     # back to stock

Imports point down the layers described in docs/ARCHITECTURE.md; nothing inside the package imports this face.
"""
# Bound after the subpackage import on purpose: `novatune.patch` must be the function (the public surface), and
# importing the subpackage novatune/patch/ would otherwise leave the module object under that name.
from novatune.patch.apply import patch
from novatune.patch.report import PatchReport
from novatune.version import __version__

__all__ = ["patch", "PatchReport", "__version__"]
