"""The trainer attends as the model does: sliding windows per layer type, measured on positions.

Gemma 3 and gpt-oss alternate sliding-window and full layers (windows 512 and 128 in their real
configs; shrunk to 8 here so short sequences cross them).  Random weights are made sharp
(``initializer_range``) so that ignoring the window moves logprobs well past the tolerance: the
comparison below would fail if the trainer attended to the whole context, as it did when it
handed every layer one full-causal mask.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tracerl.errors import ConfigError
from tracerl.families.files import is_installed
from tracerl.families.models import write_random_model
from tracerl.train.attention import AttentionLayout, allowed
from tracerl.train.forward import LogitProcessing
from tracerl.train.packing import pack_sequences
from tracerl.train.tokenization import TrainingSequence

WINDOW = 8
"""The windowed families' shrunk window (``conftest.sharp_family_model``, ``SHARP_WINDOW``)."""


def _sequences() -> list[TrainingSequence]:
    """A 6-token shared prompt, then suffixes of 14 and 18 tokens (both past the window)."""
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    prefix, suffixes = ids[:6], (ids[6:20], ids[20:38])
    return [TrainingSequence(prefix + s, [0.0] * 6 + [1.0] * len(s), [0.0] * (6 + len(s)), i, 0) for i, s in enumerate(suffixes)]


def _own_forward(folder, sequences: list[TrainingSequence]) -> torch.Tensor:
    """Each trained token's logprob from the model's own unpacked forward (its default attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq.token_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append(logprobs[5:].gather(-1, ids[0, 6:, None])[:, 0])
    return torch.cat(out)


@pytest.fixture(scope="module", params=["gemma3", "gptoss"])
def windowed(request, sharp_family_model):
    family = request.param
    from tracerl.train.trainer import LoRATrainer

    folder = sharp_family_model(family)  # sharp logits, a window of WINDOW
    return family, folder, LoRATrainer(folder, device="cpu")


def test_the_mask_measures_the_window_on_positions_and_keeps_siblings_apart():
    """Segment 0 is the shared prompt; a suffix's token sees its own context's last WINDOW
    positions, prompt included, even placed after a sibling in the row."""
    [batch] = pack_sequences(_sequences(), [1.0, 1.0], max_tokens=512)
    segments, positions = batch.segment_ids_BT[0], batch.position_ids_BT[0]
    mask = allowed(batch.segment_ids_BT, batch.position_ids_BT, WINDOW)[0, 0]
    q = int((segments == 2).nonzero()[0])  # the second suffix's first token: index 20, position 6
    assert int(positions[q]) == 6
    assert {k for k in range(mask.shape[-1]) if mask[q, k]} == set(range(6)) | {q}  # the prompt and itself, no sibling
    last = int((segments == 2).nonzero()[-1])
    pos = int(positions[last])
    seen = {int(positions[k]) for k in range(mask.shape[-1]) if mask[last, k]}
    assert seen == set(range(pos - WINDOW + 1, pos + 1))  # exactly the window: pos - WINDOW is out, pos - WINDOW + 1 in
    full = allowed(batch.segment_ids_BT, batch.position_ids_BT, None)[0, 0]
    assert full[last, (positions == pos - WINDOW).nonzero()[-1]] and not mask[last, (positions == pos - WINDOW).nonzero()[-1]]


def test_packed_trainer_logprobs_equal_the_models_own_forward(windowed):
    family, folder, trainer = windowed
    assert trainer.policy_forward.layout.windows == {"full_attention": None, "sliding_attention": WINDOW}
    sequences = _sequences()
    [batch] = pack_sequences(sequences, [1.0, 1.0], max_tokens=512)
    reference = _own_forward(folder, sequences)
    packed = trainer.token_logprobs(batch)
    assert float((packed - reference).abs().max()) <= 1e-5, family
    # what the trainer computed before: one full-causal mask for every layer
    forward = trainer.policy_forward
    unwindowed = dataclasses.replace(forward.layout, windows=dict.fromkeys(forward.layout.windows), keyed=False)
    object.__setattr__(forward, "layout", unwindowed)
    try:
        ignored = trainer.token_logprobs(batch)
    finally:
        object.__setattr__(forward, "layout", AttentionLayout.of(forward.causal_lm.config, forward.layout.implementation))
    assert float((ignored - reference).abs().max()) > 0.05, family


def test_logits_go_through_the_models_own_output_path(windowed):
    """The family's soft-capping reaches the trainer's logprobs; a processing the model does not do is refused at load."""
    family, folder, trainer = windowed
    forward = trainer.policy_forward
    sequences = _sequences()
    [batch] = pack_sequences(sequences, [1.0, 1.0], max_tokens=512)
    capped = LogitProcessing(softcap=2.0)
    original = forward.processing
    object.__setattr__(forward, "processing", capped)
    try:
        with torch.no_grad():
            ours = trainer.token_logprobs(batch)
        forward.causal_lm.config.final_logit_softcapping = 2.0
        with pytest.raises(ConfigError, match="own forward by a mean KL") if family == "gptoss" else _nothing():
            # gpt-oss's forward does not soft-cap: the probe refuses a processing the model does not do
            forward.check_against_model(trainer.model.get_input_embeddings().num_embeddings)
    finally:
        object.__setattr__(forward, "processing", original)
        forward.causal_lm.config.final_logit_softcapping = None
    if family == "gemma3":  # Gemma's own forward soft-caps when its config says so
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, final_logit_softcapping=2.0)
        with torch.no_grad():
            ids = torch.tensor([sequences[0].token_ids])
            own = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)[5:].gather(-1, ids[0, 6:, None])[:, 0]
        assert float((ours[: len(own)] - own).abs().max()) <= 1e-5


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_unknown_layer_type_is_refused():
    class Config:
        layer_types = ["full_attention", "chunked_attention"]
        sliding_window = None

    with pytest.raises(ConfigError, match="chunked_attention"):
        AttentionLayout.of(Config(), "sdpa")


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_the_load_probe_shrinks_a_long_window_and_still_sees_it_dropped(family, tmp_path, monkeypatch):
    """Gemma 3's real 512-token window and Mistral's 4096 are shrunk to 8 for the load-time probe
    (a 12k-token probe otherwise), in the model's configuration and the route's masks alike: the
    probe passes, the configuration is restored, and a route whose masks drop the window is refused."""
    if not is_installed(family):
        pytest.skip(f"the {family} tokenizer is not installed (make install-model-files)")
    from transformers import AutoModelForCausalLM

    from tracerl.train import attention
    from tracerl.train.forward import PROBE_WINDOW, PolicyForward

    folder = write_random_model(family, tmp_path, overrides={"initializer_range": 0.2})
    model = AutoModelForCausalLM.from_pretrained(folder)
    window = model.config.sliding_window
    assert window > 4 * PROBE_WINDOW
    route = PolicyForward(model, implementation="sdpa", device="cpu", dtype=torch.float32)
    assert route.check_against_model(model.config.vocab_size) <= 1e-6
    assert model.config.sliding_window == window and max(w or 0 for w in route.layout.windows.values()) == window

    full = attention.rule
    monkeypatch.setattr(attention, "rule", lambda *tokens_and_window: full(*tokens_and_window[:-1], None))
    with pytest.raises(ConfigError, match="does not reproduce"):
        route.check_against_model(model.config.vocab_size)
    assert model.config.sliding_window == window
