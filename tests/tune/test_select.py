"""Selection with injected timings (noise margin, simpler wins within it).
The dispatch table: tests/ops/test_dispatch.py."""
from __future__ import annotations

import pytest

from novatune.tune.select import Measured, choose


def m(name, complexity, median, spread):
    return Measured(name, complexity, median, spread)


def test_clear_winner_beyond_the_spread_wins():
    c = choose([m("hf_eager", 0, 500.0, 5.0), m("novatune_default", 2, 35.6, 0.4), m("cuda_v1", 5, 28.0, 0.5)])
    assert c.name == "cuda_v1" and c.runner_up == "novatune_default"
    assert c.margin_us == pytest.approx(0.5) and c.gain_us == pytest.approx(7.6)
    assert "fastest" in c.reason


def test_within_noise_the_simpler_candidate_wins():
    # cuda_v1 is 0.3 µs faster but the runner-up's spread is 0.8 µs: a tie, and the default is simpler
    c = choose([m("novatune_default", 2, 30.3, 0.8), m("cuda_v1", 5, 30.0, 0.2), m("hf_eager", 0, 480.0, 3.0)])
    assert c.name == "novatune_default"
    assert "within noise" in c.reason and "cuda_v1" in c.reason


def test_margin_is_the_larger_spread_of_the_two_leaders():
    assert choose([m("a", 3, 10.0, 0.1), m("b", 2, 10.5, 0.6)]).name == "b"   # 0.5 <= 0.6: tie -> simpler b
    assert choose([m("a", 3, 10.0, 0.1), m("b", 2, 10.7, 0.6)]).name == "a"   # 0.7 > 0.6: a wins outright


def test_tie_among_several_picks_the_simplest_then_fastest():
    c = choose([m("t1", 3, 20.0, 1.0), m("t2", 3, 20.5, 1.0), m("d", 2, 20.7, 1.0), m("c", 5, 19.8, 1.0),
                m("slow", 0, 25.0, 1.0)])
    assert c.name == "d"  # c, t1, t2, d are within 1 µs of c; "slow" is not, though it is simplest


def test_single_and_empty():
    assert choose([m("only", 4, 1.0, 0.0)]).name == "only"
    with pytest.raises(ValueError):
        choose([])
