"""Throughput, MFU and where the numbers go: a live rich bar, metrics.jsonl, TensorBoard events.

Model FLOPs per token (BENCHMARKS.md): 6 x matmul parameters (attention and MLP projections + lm_head) plus the
attention term 3 x 4 x avg attended keys x q_heads x head_dim x layers, causal within documents (the collator
counts sum L^2/2 per document). LoRA: the frozen base weights do forward + input-gradient work (4 x N) and the
adapters the full 6 x; recompute from gradient checkpointing is not useful work and is not counted.
MFU = tokens/s x FLOPs/token / peak bf16 dense rate (logging.peak_tflops, or measured with
logging.measure_peak, or the table below by GPU name). On the CPU MFU is shown as n/a.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

# dense bf16 tensor-core peaks, TFLOP/s (vendor datasheets, no sparsity)
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "H20": 148.0, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.0,
                    "B200": 2250.0}


def peak_tflops(device: torch.device, configured: float | None = None, measure: bool = False) -> float | None:
    """The MFU denominator, or None where it is unknown (CPU, an unlisted GPU without a configured value)."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    if measure:
        from novatune.measure.timing import matmul_tflops

        return matmul_tflops()
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "H100" before "H10", "A100" before "A10"
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    return None


def flops_per_token(config, avg_keys: float, trainable_matmul_frac: float = 1.0) -> float:
    """Model FLOPs per token; trainable_matmul_frac < 1 (LoRA) counts frozen matmul weights at 4 x instead of 6 x."""
    from novatune.train.arch import attention_flops_per_token, count_matmul_params

    n = count_matmul_params(config)
    dense = (4 + 2 * trainable_matmul_frac) * n
    return dense + attention_flops_per_token(config, avg_keys)


def gpu_mem_gib(device: torch.device) -> tuple[float, float] | None:
    """(allocated now, peak since start) in GiB, or None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device) / 2**30, torch.cuda.max_memory_allocated(device) / 2**30


class MetricsLog:
    """metrics.jsonl (one JSON object per logged step) and, when tensorboard is installed, event files.

    The file is only ever appended to, one complete line per write, and every line is strict JSON (NaN/inf are
    written as null). At start, rows past the step the run resumes from (a fresh run: all rows) and a torn last
    line (a disk that filled mid-write) are dropped, with a warning, by writing the kept rows to a temporary file
    and renaming it over the old one: a kill at any moment leaves the old file or the new one, never less."""

    def __init__(self, output_dir: str | Path, tensorboard: bool, console=None, resume_step: int = 0):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.console = console
        if self.path.exists():
            self._keep_rows_up_to(resume_step)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"), purge_step=resume_step + 1)
            except ImportError:
                self._warn("tensorboard is not installed: no event files (metrics.jsonl is written); "
                           "pip install tensorboard")

    def _warn(self, msg: str) -> None:
        (self.console.print(f"[yellow]{msg}[/]") if self.console is not None else print(msg))

    def _keep_rows_up_to(self, step: int) -> None:
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        keep, torn = [], 0
        for ln in lines:
            if not ln.strip():
                continue
            try:
                row = json.loads(ln)
            except ValueError:
                torn += 1
                continue
            if isinstance(row, dict) and row.get("step", 0) <= step:
                keep.append(ln)
        if torn:
            self._warn(f"{self.path}: dropped {torn} unreadable line(s) (a write cut short, e.g. by a full disk)")
        if len(keep) == len(lines):
            return  # nothing to drop: the file stays as it is
        tmp = self.path.with_name(f".tmp-{self.path.name}-{os.getpid()}")
        tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean, allow_nan=False) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(f"train/{k}", v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _num(value, spec: str) -> str:
    return "nan" if value is None else format(value, spec)  # None: a non-finite value (JSON null)


def fmt_row(row: dict) -> str:
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
    mem = f"{row['mem_gib']:.1f} GiB" if row.get("mem_gib") is not None else "n/a"
    skipped = "  (update skipped: non-finite)" if row.get("skipped") else ""
    return (f"step {row['step']}/{row['total_steps']}  loss {_num(row['loss'], '.4f')}  lr {row['lr']:.2e}  "
            f"grad {_num(row['grad_norm'], '.2f')}  {row['tokens_per_s']:,.0f} tok/s  MFU {mfu}  mem {mem}"
            f"{skipped}")


class Progress:
    """A rich progress bar on a terminal; plain log lines elsewhere (CI logs, pipes)."""

    def __init__(self, total: int, start: int, enabled: bool, console):
        self.console = console
        self.live = enabled and console.is_terminal
        self.t0 = time.perf_counter()
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RP
            from rich.table import Column

            # the counters and times keep their width; the bar and the description give way on narrow terminals
            # (the full row is printed above the bar anyway)
            self.bar = RP(TextColumn("[bold]train"), BarColumn(bar_width=None, table_column=Column(ratio=1)),
                          MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                          TextColumn("{task.description}", table_column=Column(ratio=2, no_wrap=True,
                                                                                overflow="ellipsis")),
                          console=console, expand=True)
            self.task = self.bar.add_task("", total=total, completed=start)
            self.bar.start()

    def update(self, step: int, row: dict | None = None) -> None:
        if self.live:
            desc = None
            if row is not None:
                mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
                mem = f"{row['mem_gib']:.1f}GiB" if row.get("mem_gib") is not None else "n/a"
                desc = (f"loss {_num(row['loss'], '.4f')} lr {row['lr']:.2e} {row['tokens_per_s']:,.0f} tok/s "
                        f"MFU {mfu} mem {mem}")
            self.bar.update(self.task, completed=step, **({"description": desc} if desc else {}))
            if row is not None:  # the history stays on screen above the live bar
                self.bar.console.print(fmt_row(row), highlight=False)
        elif row is not None:
            self.console.print(fmt_row(row), highlight=False)

    def print(self, msg: str) -> None:
        self.console.print(msg, highlight=False)

    def close(self) -> None:
        if self.live:
            self.bar.stop()
