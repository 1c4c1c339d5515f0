"""Cost analysis from a measured throughput pair (the report's "business impact" tables).

With the same GPU, the same $/GPU-hour, utilisation and workload shape, cost is proportional to GPU time, and GPU
time per token to 1 / tokens/s. So for a speedup s = tok/s(after) / tok/s(before):

    cost per 1M tokens  = $/GPU-hour / (tok/s x 3600) x 1e6
    GPU-hours for B tokens = B / (tok/s x 3600)
    cost reduction      = 1 - 1/s                      (1.564x -> 36.1% lower cost per token)
    monthly spend S     -> S / s after, saving S - S/s  (1.564x: $100,000 -> $63,939, saving $36,061)

Only the per-token and per-budget dollar figures need a price; the reduction and the monthly table need only s.

GPU prices: `--gpu-price` wins. Otherwise DEFAULT_PRICES by GPU name: ASSUMED on-demand prices for one GPU, in the
range US clouds listed publicly in 2025 for single-GPU on-demand instances (H100 ~$2.5-3/h, H200 ~$3.5/h, A100
~$1.8/h). They are assumptions for illustration, not quotes: the report prints the price it used and where it came
from, and reserved/spot contracts differ by 2x or more.
"""
from __future__ import annotations

DEFAULT_PRICES = {  # $ per GPU-hour, ASSUMED (see the module docstring); longest matching name wins
    "H200": 3.50, "H100": 2.99, "A100": 1.79, "L40S": 1.00, "A10G": 1.00, "L4": 0.80,
}
PRICE_SOURCE = ("assumed on-demand price for one GPU (novatune.report.cost.DEFAULT_PRICES, typical of public US "
                "cloud list prices in 2025; not a quote) - pass --gpu-price for your own rate")
DEFAULT_MONTHLY = (10_000, 50_000, 100_000, 250_000, 500_000, 1_000_000)
DEFAULT_TOKEN_BUDGET = 1_000_000_000


TOY_PARAMS = 100_000_000  # below this a model is a pipeline check, not a workload anyone pays GPUs for


def not_projectable(*rows: dict) -> str | None:
    """Why a pair of bench rows cannot back a cost projection (measured on the CPU, or a toy model), or None."""
    for r in rows:
        if str(r.get("device", "")).lower().startswith("cpu"):
            return f"the {r.get('stack')} row was measured on the CPU"
        if r.get("params") is not None and r["params"] < TOY_PARAMS:
            return f"the {r.get('stack')} row trained a toy model ({r['params'] / 1e6:,.1f}M parameters)"
    return None


def default_price(gpu_name: str | None) -> float | None:
    if not gpu_name:
        return None
    for key in sorted(DEFAULT_PRICES, key=len, reverse=True):  # "A100" is not "A10G"; "H100" before "H10"
        if key in gpu_name.upper():
            return DEFAULT_PRICES[key]
    return None


def resolve_price(gpu_name: str | None, given: float | None) -> tuple[float | None, str]:
    """(price $/GPU-hour or None, where it came from)."""
    if given is not None:
        if given <= 0:
            raise ValueError("--gpu-price must be > 0 ($ per GPU-hour)")
        return given, "given with --gpu-price"
    p = default_price(gpu_name)
    if p is None:
        return None, (f"no default price for {gpu_name or 'an unknown device'!r}: pass --gpu-price $/GPU-hour for the "
                      f"dollar figures")
    return p, PRICE_SOURCE


def cost_per_million(tok_s: float, price_per_hour: float) -> float:
    return price_per_hour / (tok_s * 3600.0) * 1e6


def gpu_hours(tokens: float, tok_s: float) -> float:
    return tokens / (tok_s * 3600.0)


def cost_reduction(speedup: float) -> float:
    """Fraction of the cost per token saved: 1 - 1/s."""
    return 1.0 - 1.0 / speedup


def monthly_table(speedup: float, spends=DEFAULT_MONTHLY) -> list[tuple[float, float, float]]:
    """[(monthly spend before, equivalent spend after, saving)] for the same token volume."""
    return [(s, s / speedup, s - s / speedup) for s in spends]


def analysis(tok_s_before: float, tok_s_after: float, price: float | None, token_budget: float,
             spends=DEFAULT_MONTHLY) -> dict:
    """Every cost figure the report prints, computed from the two measured throughputs."""
    if tok_s_before <= 0 or tok_s_after <= 0:
        raise ValueError("throughputs must be > 0")
    s = tok_s_after / tok_s_before
    out = {"speedup": s, "cost_reduction": cost_reduction(s), "token_budget": token_budget,
           "gpu_hours_before": gpu_hours(token_budget, tok_s_before),
           "gpu_hours_after": gpu_hours(token_budget, tok_s_after), "monthly": monthly_table(s, spends),
           "price": price}
    out["gpu_hours_saved"] = out["gpu_hours_before"] - out["gpu_hours_after"]
    if price is not None:
        out.update(cost_per_m_before=cost_per_million(tok_s_before, price),
                   cost_per_m_after=cost_per_million(tok_s_after, price),
                   budget_cost_before=out["gpu_hours_before"] * price,
                   budget_cost_after=out["gpu_hours_after"] * price)
    return out
