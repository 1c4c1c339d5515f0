"""The tune cache: one JSON file of choices, keyed by everything that can change the answer.

Key fields: op, shape, dtype(s), layout, GPU name and compute capability, and the torch / triton / CUDA / novatune
versions. The key is a hash of those fields; each entry also stores them in clear (plus every candidate's timings,
errors and verdicts) so the file is readable and `novatune tune` can explain a choice later.

Location: $NOVATUNE_TUNE_CACHE, else ~/.cache/novatune/tune.json. Writes are atomic (temp file + rename), so a
crash mid-write never leaves half a file. A file that does not parse, or has another format version, raises
CacheError naming the file and the fix; `novatune tune` then moves it aside (`<name>.corrupt-<time>`) and starts a
new one, and `patch` reports it and runs the defaults.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

FORMAT = 1


class CacheError(RuntimeError):
    pass


def default_path() -> Path:
    env = os.environ.get("NOVATUNE_TUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "novatune" / "tune.json"


def environment(device) -> dict:
    """The device and software fields of every key (the device given as a torch.device or string)."""
    from novatune.version import __version__

    device = torch.device(device)
    env = {"device": "cpu", "capability": None, "torch": torch.__version__, "cuda": torch.version.cuda,
           "novatune": __version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def entry_key(op: str, shape, dtype: str, layout: str, env: dict) -> str:
    fields = {"op": op, "shape": list(shape), "dtype": dtype, "layout": layout, **env}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


class TuneCache:
    def __init__(self, path: Path | str | None = None, entries: dict | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.entries: dict[str, dict] = entries or {}

    @classmethod
    def load(cls, path: Path | str | None = None) -> TuneCache:
        """The cache at `path` (empty when the file does not exist). Raises CacheError when it is unreadable."""
        p = Path(path) if path is not None else default_path()
        if not p.exists():
            return cls(p)
        try:
            data = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CacheError(f"tune cache {p} is unreadable ({type(e).__name__}: {e}); delete it or run "
                             f"`novatune tune CONFIG` (which moves it aside)") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise CacheError(f"tune cache {p} has an unknown format (expected format {FORMAT}); delete it or run "
                             f"`novatune tune CONFIG` (which moves it aside)")
        return cls(p, data["entries"])

    @classmethod
    def load_or_reset(cls, path: Path | str | None = None) -> tuple[TuneCache, str | None]:
        """(cache, note): an unreadable file is renamed to <name>.corrupt-<time> and an empty cache returned."""
        try:
            return cls.load(path), None
        except CacheError as e:
            p = Path(path) if path is not None else default_path()
            aside = p.with_name(f"{p.name}.corrupt-{int(time.time())}")
            p.rename(aside)
            return cls(p), f"{e}; moved aside to {aside}, starting a new cache"

    def get(self, op: str, shape, dtype: str, layout: str, env: dict) -> dict | None:
        return self.entries.get(entry_key(op, shape, dtype, layout, env))

    def put(self, entry: dict) -> str:
        """Store an entry (must hold op, shape, dtype, layout, env); returns its key."""
        key = entry_key(entry["op"], entry["shape"], entry["dtype"], entry["layout"], entry["env"])
        self.entries[key] = dict(entry, key=key)
        return key

    def matching(self, env: dict) -> list[dict]:
        """Entries recorded for exactly this device and these versions."""
        return [e for e in self.entries.values() if e.get("env") == env]

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "entries": self.entries}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
        return self.path


def selection_from_cache(cache: TuneCache, device) -> tuple[dict, list[dict], list[str]]:
    """(dispatch table, the entries used, notes) for the kept, non-default choices recorded for this device and
    these versions. An entry whose candidate no longer exists (or cannot be built) is skipped with a note."""
    from novatune.ops.registry import OPS
    from novatune.tune.calls import candidates, model_level

    env = environment(device)
    table, used, notes = {}, [], []
    dev_type = torch.device(device).type
    for e in cache.matching(env):
        if not e.get("kept", False) or e.get("choice") in (None, "novatune_default"):
            continue
        if model_level(e["op"]) or e["op"] not in OPS:
            continue  # model-level settings (CE mode, attention backend): novatune.tune.model_choices
        dtype = getattr(torch, e["dtype"].split("/")[0])
        found = [c for c in candidates(e["op"], e["shape"], dtype, dev_type) if c.name == e["choice"]]
        if not found or found[0].params != e.get("params", {}):
            notes.append(f"tune cache: {e['op']} {e['shape']}: candidate {e['choice']} is not in this registry "
                         f"(or its parameters changed); default used")
            continue
        try:
            fn = found[0].functional()
        except Exception as err:  # noqa: BLE001 - an automatic choice falls back, and says so
            notes.append(f"tune cache: {e['op']} {e['shape']}: {e['choice']} could not be loaded "
                         f"({type(err).__name__}: {str(err)[:200]}); default used")
            continue
        table[OPS[e["op"]].table_key(e["shape"], e["dtype"], dev_type)] = fn
        used.append(e)
    return table, used, notes
