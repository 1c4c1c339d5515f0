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
from novatune.patch import apply as _apply  # noqa: E402
from novatune.patch.report import PatchReport  # noqa: E402


def patch(target, *, tune: bool | str = "cache", tune_tokens: int = 4096, selection=None,
          **options) -> PatchReport:
    """novatune.patch.apply.patch(target, **options) (its docstring lists the options), plus the tuned
    implementations:

    tune: "cache" (default) runs the implementations `novatune tune` recorded for this GPU, these versions and
    the shapes seen at run time (else the built-in defaults); True tunes this model's ops now, at tune_tokens
    tokens per micro-batch (validation, timing, a whole-step check; seconds to minutes), records the choices and
    uses them; False ignores the cache. selection: a novatune.ops.dispatch.Selection to install instead.
    Every choice in effect is listed in the report (report.choices).
    """
    model = _apply._unwrap(target)[0]
    existing = getattr(model, "_novatune_report", None)
    if existing is not None and not existing.reverted:
        return _apply.patch(target, **options)  # idempotent; over a trainer it puts the fused loss back on top
    report = _apply.patch(target, selection=selection, **options)
    if selection is None and tune and getattr(model, "_novatune_report", None) is report:  # not a refused model
        from novatune.tune.patching import selection_for

        selection_for(model, tune, tune_tokens).apply(model, report)
    return report


def _signature():
    """apply.patch's options plus tune / tune_tokens, so `inspect.signature(novatune.patch)` and help() list
    every option."""
    import inspect

    base = inspect.signature(_apply.patch)
    params = [p for p in base.parameters.values()]
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in (("tune", "cache"),
                                                                                            ("tune_tokens", 4096))]
    return base.replace(parameters=params + extra)


patch.__signature__ = _signature()

__all__ = ["patch", "PatchReport", "__version__"]
