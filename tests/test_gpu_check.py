"""``bench/gpu_check.py --device cpu --tiny`` (Llama shapes, and ``--families``) keeps working until a GPU
machine runs the full check.

``make test`` runs ``--families gptoss`` (the family path of the check: a family's architecture, its real
tokenizer and chat template; gpt-oss, the one with experts and the harmony template, ~14 s); every family's
random model also trains and serves in ``test_family_training.py``.  ``TRACERL_FULL=1`` (``make test-long``)
runs ``--families all``, the six (~1 min)."""

from __future__ import annotations

import json
import os

import pytest
import subprocess
import sys
from pathlib import Path

from suite_size import tiny_or_full

ROOT = Path(__file__).resolve().parents[1]


FAMILIES = ["qwen3", "qwen2.5", "gemma3", "gptoss", "llama3", "mistral"]
CHECKED = tiny_or_full(["gptoss"], FAMILIES)
"""The families ``--families`` runs: one in the suite, the six under ``TRACERL_FULL=1``."""


@pytest.mark.parametrize(
    "selection, expected, dtype",
    [
        (["--shapes", "tiny-llama-shape", "--dtype", "bfloat16"], ["tiny-llama-shape"], "bfloat16"),  # as a GPU runs it
        # the families without the agreement stage: test_family_training.py samples and trains each family end to end
        (["--families", "all" if CHECKED == FAMILIES else ",".join(CHECKED), "--agreement-groups", "0"],
         [f"{family}:tiny" for family in CHECKED], "float32"),
    ],
    ids=["llama-shape-bf16", "families"],
)
def test_gpu_check_tiny_on_cpu_writes_every_field(tmp_path, selection, expected, dtype):
    if "--families" in selection:
        from tracerl.families.files import is_installed, last_failure

        missing = [f for f in CHECKED if not is_installed(f)]
        if missing:
            pytest.skip(f"family files not installed ({missing}: {last_failure(missing[0])}); run make install-model-files")
    out = tmp_path / "gpu_check.json"
    env = {
        **os.environ,
        # any request that leaves the machine fails (loopback to our own server still works)
        "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--tiny", *selection, "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| shape | params | dtype | GRPO s/step |" in proc.stdout
    report = json.loads(out.read_text())
    assert report["vllm_imported"] is False
    assert report["environment"]["device"] == "cpu"
    assert [s["shape"] for s in report["shapes"]] == expected
    for shape in report["shapes"]:
        train, decode, agreement = shape["train"], shape["decode"], shape["agreement"]
        assert shape["parameters"] > 0
        assert train["dtype"] == decode["dtype"] == dtype
        assert train["step_s_median"] > 0 and len(train["step_s"]) == report["args"]["steps"]
        # packing runs each group's prompt once: fewer computed than logical tokens
        assert 0 < train["computed_tokens"] < train["logical_tokens"]
        assert train["logical_tokens_per_s"] > train["computed_tokens_per_s"] > 0
        assert train["trained_tokens"] == train["sequences"] * report["args"]["completion_tokens"]
        assert train["peak_gpu_mb"] is None and train["peak_rss_mb"] > 0
        assert train["plan_trainer_peak_mb"] > 0 and "plan_vs_measured" not in train  # a ratio only where allocator bytes are measured
        assert train["merge"]["merge_s"] > 0 and train["merge"]["merged_mb"] > 0  # the streamed merge of the trained adapter ran
        assert [r["concurrency"] for r in decode["rounds"]] == [1, 8, 32]
        for r in decode["rounds"]:
            assert r["completion_tokens"] == r["concurrency"] * report["args"]["decode_tokens"]
            assert r["tokens_per_s"] > 0
        assert decode["max_batch_rows"] > 1  # concurrent requests were decoded together
        if report["args"]["agreement_groups"] == 0:
            assert agreement is None
            continue
        # LocalBackend end to end: every sampled token re-scored by the trainer, within the dtype's agreement
        assert agreement["dtype"] == dtype
        assert agreement["mismatch_tokens"] == agreement["trained_tokens"] == report["args"]["group_size"] * report["args"]["agreement_tokens"]
        assert agreement["mismatch_kl"] < (5e-3 if dtype == "bfloat16" else 1e-6)
        assert agreement["registered"]["measured_mb"] > 0 and agreement["step"]["measured_peak_mb"] > 0
        assert agreement["step"]["plan_mb"] > 0 and "plan_vs_measured" not in agreement
