"""The soak of ``bench/tinker_soak.py`` (``make soak-tinker``), short: 2 tenants x 5 iterations of
forward_backward, optim_step, an unnamed save for sampling and a sample, through the real ``tinker``
SDK against a ``tracerl serve --tinker`` process with a sampler cap of one adapter, and a third
tenant flooding ``sample`` with the largest requests allowed.  Only bounds and counts are asserted,
never timings: the cap held (the service's own count), no 5xx, no lost future, every iteration
done, each new adapter loaded, the usage counted per tenant."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("psutil")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "tinker_soak.py"


def test_a_short_soak_keeps_every_bound(tmp_path):
    spec = importlib.util.spec_from_file_location("tinker_soak", BENCH)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    args = soak.parse_args([
        "--tenants", "2", "--iterations", "5", "--warmup", "1", "--rank", "4", "--datums", "1", "--tokens", "8", "--samples", "2",
        "--sample-tokens", "4", "--flood-threads", "1", "--max-sampler-adapters", "1", "--max-num-samples", "2",
        "--max-sample-tokens", "4", "--max-prompt-tokens", "16",
    ])  # fmt: skip
    result = soak.soak(args, tmp_path)
    assert result["lost_futures"] == []
    assert result["iterations_done"] == {"t0": 5, "t1": 5}
    assert result["server_errors_5xx"] == 0 and result["server_log_errors"] == 0
    assert result["sampler_adapters_max_seen"] <= 1 and result["sampler_adapters_peak"] <= 1
    assert result["sampler_adapter_loads"] >= 10  # every unnamed save is a new adapter, loaded when sampled
    assert result["checks"]["adapters_within_cap"] and result["checks"]["no_5xx"] and result["checks"]["no_lost_future"]
    for tenant in ("t0", "t1"):
        usage = result["usage"][tenant]
        assert usage["tokens_trained"] == 5 * 8
        assert 0 < usage["tokens_sampled"] <= 5 * 2 * 4
    assert result["usage"]["flood"]["tokens_trained"] == 0
