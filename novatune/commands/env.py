"""`novatune env`: what novatune sees - versions, the GPU, which kernels import, which attention backends exist.

Everything optional is imported lazily and its absence (or failure) is reported, never raised: this command must
work on a broken install, since that is when people run it.
"""
from __future__ import annotations

import importlib
import pkgutil
import platform


def _version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
        return getattr(m, "__version__", "installed")
    except Exception as e:  # noqa: BLE001 - report, never raise
        return "absent" if isinstance(e, ImportError) else f"broken ({type(e).__name__})"


def _ops() -> list[tuple[str, str]]:
    out = []
    try:
        import novatune.ops as ops_pkg
    except Exception as e:  # noqa: BLE001
        return [("novatune.ops", f"import failed: {e}")]
    for info in pkgutil.iter_modules(ops_pkg.__path__):
        if info.name.startswith("_"):
            continue
        try:
            importlib.import_module(f"novatune.ops.{info.name}")
            out.append((info.name, "ok"))
        except Exception as e:  # noqa: BLE001
            out.append((info.name, f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:100]}"))
    return out


def _attention_backends() -> list[tuple[str, str]]:
    try:
        backends = importlib.import_module("novatune.attention.backends")
    except Exception as e:  # noqa: BLE001
        return [("novatune.attention.backends", f"not available ({type(e).__name__}: {str(e)[:80]})")]
    for fn_name in ("available_backends", "available", "list_backends"):
        fn = getattr(backends, fn_name, None)
        if callable(fn):
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001
                return [(fn_name, f"failed: {e}")]
            if isinstance(res, dict):
                return [(str(k), str(v)) for k, v in res.items()]
            return [(str(r), "available") for r in res]
    names = getattr(backends, "BACKENDS", None)
    if names:
        return [(str(n), "listed") for n in names]
    return [("novatune.attention.backends", "imported (no backend list exposed)")]


def _torch_attention() -> list[tuple[str, str]]:
    import torch

    rows = []
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        rows.append(("torch flex_attention", "available"))
    except Exception:  # noqa: BLE001
        rows.append(("torch flex_attention", "absent"))
    try:
        from torch.nn.attention import varlen  # noqa: F401

        rows.append(("torch varlen_attn", "available"))
    except Exception:  # noqa: BLE001
        rows.append(("torch varlen_attn", "absent"))
    rows.append(("flash_attn (FA2 package)", _version("flash_attn")))
    try:  # the fa4 attention backend's package: its version without importing its compiler runtime
        from importlib.metadata import version
        rows.append(("flash-attn-4 (the fa4 attention backend)", version("flash-attn-4")))
    except Exception:  # noqa: BLE001 - report, never raise
        rows.append(("flash-attn-4 (the fa4 attention backend)", "absent (pip install flash-attn-4)"))
    if torch.cuda.is_available():
        b = torch.backends.cuda
        rows.append(("sdpa flash / mem-efficient / cudnn",
                     f"{b.flash_sdp_enabled()} / {b.mem_efficient_sdp_enabled()} / "
                     f"{getattr(b, 'cudnn_sdp_enabled', lambda: 'n/a')()}"))
    return rows


def collect() -> dict:
    import torch

    from novatune.version import __version__

    info = {"novatune": __version__, "python": platform.python_version(), "platform": platform.platform(),
            "torch": torch.__version__, "cuda (torch build)": torch.version.cuda or "cpu build"}
    for mod in ("triton", "transformers", "peft", "datasets", "tokenizers", "safetensors", "liger_kernel",
                "bitsandbytes", "tensorboard"):
        info[mod] = _version(mod)
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}")
    info["gpus"] = gpus or ["none (CPU only: ops run their PyTorch references)"]
    info["threads"] = torch.get_num_threads()
    info["ops"] = _ops()
    info["attention"] = _attention_backends() + _torch_attention()
    return info


def render_env() -> str:
    info = collect()
    lines = ["novatune env"]
    for k, v in info.items():
        if k in ("gpus", "ops", "attention"):
            continue
        lines.append(f"  {k:22s} {v}")
    lines.append("  GPUs")
    lines += [f"    {g}" for g in info["gpus"]]
    lines.append("  kernels (novatune.ops)")
    lines += [f"    {n:20s} {s}" for n, s in info["ops"]] or ["    none"]
    lines.append("  attention backends")
    lines += [f"    {n:34s} {s}" for n, s in info["attention"]]
    return "\n".join(lines)
