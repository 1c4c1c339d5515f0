"""The op contract: every registered op declares its whole story once (novatune.ops.contract / registry), the
tuner iterates the registry without naming an op, and patch receives a selection instead of importing tune."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

from novatune.ops.registry import OPS

ROOT = pathlib.Path(__file__).resolve().parents[2] / "novatune"


def test_every_spec_is_complete_and_its_cases_run():
    gen = torch.Generator().manual_seed(0)
    for name, spec in OPS.items():
        assert spec.name == name and spec.signature and spec.reference and spec.stock
        cands = spec.candidates(_key(name), torch.float32, "cpu")
        assert {"hf_eager", "novatune_default"} <= {c.name for c in cands}
        for label, inputs in spec.call_cases(torch.float32, "cpu", gen):
            assert set(spec.tensor_args) <= set(inputs), (name, label)


def _key(name):
    return {"rms_norm": (7, 32), "offset_rms_norm": (7, 32), "swiglu": (7, 32), "geglu": (7, 32),
            "clamped_swiglu": (7, 32), "linear_cross_entropy": (9, 8, 33),
            "attention": (13, 2, 1, 8, 3), "rope": (13, 2, 1, 8), "qk_norm_rope": (13, 2, 1, 8),
            "moe_experts": (13, 64, 32, 5, 2)}[name]


@pytest.mark.parametrize("op", ["rms_norm", "offset_rms_norm", "swiglu", "geglu", "clamped_swiglu", "rope",
                                "qk_norm_rope"])
def test_kernel_candidates_use_the_ops_own_autograd_wrapper(op, monkeypatch):
    """make_function(fwd, bwd) builds both the op's eager path and every kernel candidate's functional."""
    import importlib

    mod = importlib.import_module(f"novatune.ops.{op}")
    seen = []
    real = mod.make_function

    def spy(fwd, bwd):
        seen.append((fwd, bwd))
        return real(fwd, bwd)
    monkeypatch.setattr(mod, "make_function", spy)
    key = _key(op)
    candidates = mod.SPEC.candidates(key, torch.float32, "cpu")
    kernel = [c for c in candidates if c.kernels is not None and c.family == "triton"]
    assert kernel
    for c in kernel:
        c._fn = None
        c.make()
    assert len(seen) == len(kernel)


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_patch_and_ops_never_import_tune():
    for folder in ("patch", "ops", "kernels", "reference"):
        for path in (ROOT / folder).rglob("*.py"):
            bad = [m for m in _imports(path) if m.startswith("novatune.tune")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_reference_imports_no_kernel():
    for path in (ROOT / "reference").rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith(("novatune.kernels", "novatune.ops", "triton"))]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_every_candidate_takes_the_keyword_only_flags_by_keyword():
    """Dispatch, the validator and the checker call every implementation through OpSpec.call (keyword-only flags
    by keyword): each built-in candidate that runs here accepts that call (torch.compile ones: the same
    functional compiled, skipped for time)."""
    gen = torch.Generator().manual_seed(0)
    for name, spec in OPS.items():
        if not spec.keyword_args:
            continue
        inputs = spec.make_inputs(_key(name), torch.float32, "cpu", gen)
        for c in spec.candidates(_key(name), torch.float32, "cpu"):
            if c.unavailable or c.family == "compile":
                continue
            out = spec.call(c.functional(), inputs)
            assert isinstance(out, torch.Tensor), (name, c.name)


def test_kernels_import_no_oracle():
    """reference/ is the one home of the oracles: a kernel module neither imports nor re-exports one, so a kernel
    and the oracle it is checked with share no code and each oracle has one import path."""
    for path in (ROOT / "kernels").rglob("*.py"):
        bad = [m for m in _imports(path) if m.startswith("novatune.reference")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    import importlib
    for path in (ROOT / "kernels").glob("*.py"):
        mod = importlib.import_module(f"novatune.kernels.{path.stem}")
        foreign = [n for n, v in vars(mod).items() if callable(v) and getattr(v, "__module__", "") and
                   v.__module__.startswith("novatune.reference")]
        assert not foreign, f"kernels/{path.name} re-exports oracles {foreign}"


def test_tune_engine_names_no_op():
    names = [re.escape(n) for n in OPS]
    pattern = re.compile(r"[\"'](" + "|".join(names) + r")[\"']")
    for path in (ROOT / "tune").rglob("*.py"):
        # the profiler's kernel-name taxonomy (regex rows) names trace kinds, one of which is also called "attention"
        hits = [line for line in path.read_text().splitlines() if pattern.search(line) and ', r"' not in line]
        assert not hits, f"{path.relative_to(ROOT)} names an op: {hits}"


def test_each_formula_is_written_once():
    defs = []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        defs += [(path.name, m) for m in re.findall(r"def (_?rotate_half)\(", text)]
        if "pow(2).mean(-1, keepdim=True)" in text and "rsqrt" in text and path.parent.name != "tune":
            defs.append((path.name, "rms formula"))
    assert sorted(defs) == [("rms_norm.py", "rms formula"), ("rope.py", "rotate_half")], defs
