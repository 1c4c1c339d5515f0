"""novatune: faster, leaner LLM fine-tuning on the GPUs you already have.

One line in an existing Hugging Face / TRL script::

    import novatune
    report = novatune.patch(model)      # or novatune.patch(trainer)
    print(report)                       # what was replaced, what was skipped and why
    report.revert()                     # back to stock

Data flows one way: data -> train -> patch -> ops -> kernels (see ARCHITECTURE in the README).
"""
__version__ = "0.1.0"


def patch(target, **options):
    """Swap fused kernels and packed-row attention into a transformers model, PEFT model or Trainer.

    Returns a :class:`novatune.patch.PatchReport`. See :func:`novatune.patch.apply.patch` for options.
    """
    from novatune.patch.apply import patch as _patch

    return _patch(target, **options)


__all__ = ["patch", "__version__"]
