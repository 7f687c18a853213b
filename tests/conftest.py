"""Shared fixtures. The real SmolLM2-135M model is resolved once per session (offline)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smol_path() -> Path:
    from tracerl.base_models import resolve_base_model

    return resolve_base_model("smollm2-135m")


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_path)
