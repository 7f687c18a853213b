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


@pytest.fixture(scope="module")
def served_fake():
    """A loopback OpenAI-compatible server registered as tracerl-served, with the OpenAI hook on.

    Stands in for a remote model server in the capture tests (real HTTP, real SDK)."""
    import tracerl.integrations as ti
    from capture_fake_server import FakeOpenAIServer

    ti.instrument("openai")
    with FakeOpenAIServer() as srv:
        ti.register_endpoint(srv.base_url)
        yield srv
        ti.unregister_endpoint(srv.base_url)


@pytest.fixture(scope="module")
def unserved_fake():
    """A loopback OpenAI-compatible server *not* marked tracerl-served (no token ids asked), OpenAI hook on."""
    import tracerl.integrations as ti
    from capture_fake_server import FakeOpenAIServer

    ti.instrument("openai")
    with FakeOpenAIServer(token_truth=False) as srv:
        yield srv


@pytest.fixture()
def own_provider():
    """Capture on a tracer provider of its own (the session's shared one may have exporters attached)."""
    from opentelemetry.sdk.trace import TracerProvider

    import tracerl.integrations as ti

    previous = ti.get_tracer_provider()
    provider = TracerProvider()
    ti.configure_tracing(provider)
    yield provider
    ti.configure_tracing(previous)


@pytest.fixture()
def served_client(served_fake):
    """An ``AsyncOpenAI`` client of :func:`served_fake`."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=served_fake.base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real two-node Ray cluster on loopback, started once per test session (Ray is process-wide).

    Two logical CPUs per node: an inference replica and a rollout task fit on each."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 80 * 2**20})
    nodes.add_node(num_cpus=2, object_store_memory=80 * 2**20)
    ray.init(address=nodes.address, include_dashboard=False, log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny randomly initialised Llama with a word-level tokenizer (bench/gpu_check.py's)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_check

    folder = tmp_path_factory.mktemp("tiny-llama")
    gpu_check.write_random_model(gpu_check.TINY_SHAPES["tiny-llama-shape"], folder, "cpu")
    return folder


SHARP_WINDOW = 8
"""The window the windowed families' random models get: conversations of a few dozen tokens run past it."""


@pytest.fixture(scope="session")
def sharp_family_model(tmp_path_factory):
    """``get(family)``: the family's random model (``tracerl.families.models``), its logits sharp
    (``initializer_range`` 0.2) and, for Gemma 3 and gpt-oss, its sliding window shrunk to
    :data:`SHARP_WINDOW`; written once a session (Gemma 3's takes seconds) and only ever read.
    Skips the test when the family's files are not installed."""
    from tracerl.families.files import is_installed, last_failure
    from tracerl.families.models import write_random_model

    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            if not is_installed(family):
                pytest.skip(f"the {family} tokenizer is not installed ({last_failure(family)}); run make install-model-files")
            overrides = {"initializer_range": 0.2, **({"sliding_window": SHARP_WINDOW} if family in ("gemma3", "gptoss") else {})}
            folders[family] = write_random_model(family, tmp_path_factory.mktemp(family.replace(".", "")), overrides=overrides)
        return folders[family]

    return get
