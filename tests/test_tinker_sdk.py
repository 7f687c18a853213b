"""The official ``tinker`` SDK (PyPI, unmodified) driving ``tracerl serve --tinker`` with the real model.

One server for the module, started as a user would (the CLI in its own process).  The SDK
loads its tokenizer from the local folder ``get_info`` names (``HF_HUB_OFFLINE=1``)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types

KEY = "tml-tracerl-test-key"  # tenant alice
OTHER_KEY = "tml-tracerl-other-tenant"  # tenant bob
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    port = free_port()
    data = tmp_path_factory.mktemp("serve")
    env = {**os.environ, "TRACERL_SERVE_TOKEN": "owner-token-not-a-tenant-key", "HF_HUB_OFFLINE": "1"}
    keys = data / "keys.json"
    keys.write_text(json.dumps({KEY: "alice", OTHER_KEY: "bob"}))
    log = open(data / "serve.log", "w")  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "tracerl", "serve", "--tinker", "--inference", "none", "--port", str(port), "--path", str(data), "--tinker-keys", str(keys), "--max-models", "8"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, (data / "serve.log").read_text()
        try:
            if httpx.get(f"{base}/api/v1/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        pytest.fail("tracerl serve --tinker did not start: " + (data / "serve.log").read_text())
    yield base
    process.terminate()
    process.wait(timeout=60)
    log.close()


@pytest.fixture(scope="module")
def service(url, monkeypatch_module):
    client = tinker.ServiceClient(base_url=url, api_key=KEY)
    yield client


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield patch


def datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """Next-token prediction of ``answer`` after ``prompt`` (prompt tokens weighted 0)."""
    p = tokenizer.encode(prompt, add_special_tokens=False)
    a = tokenizer.encode(answer, add_special_tokens=False)
    tokens = p + a
    weights = [0.0] * (len(p) - 1) + [1.0] * len(a)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def test_capabilities_offer_the_embedded_model(service):
    names = [m.model_name for m in service.get_server_capabilities().supported_models]
    assert names == ["HuggingFaceTB/SmolLM2-135M-Instruct"]


def test_supervised_loop_lowers_the_loss_and_samples_from_the_new_weights(service, url):
    training = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=8, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt, answer = "The secret word is", " zebra-lantern."
    batch = [datum(tokenizer, prompt, answer)]
    losses = []
    for _ in range(8):
        backward = training.forward_backward(batch, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=3e-3))
        out = backward.result()
        step.result()
        losses.append(out.metrics["loss:sum"])
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == batch[0].model_input.length
    assert losses[-1] < 0.2 * losses[0], losses
    saved = training.save_weights_for_sampler(name="after-sft").result().path
    sampler = service.create_sampling_client(model_path=saved).result()
    prompt_ids = types.ModelInput.from_ints(tokenizer.encode(prompt, add_special_tokens=False))
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)
    result = sampler.sample(prompt_ids, num_samples=2, sampling_params=types.SamplingParams(max_tokens=len(answer_ids), temperature=0.0)).result()
    for sequence in result.sequences:
        assert sequence.tokens == answer_ids  # the new weights answer what they were taught
        assert len(sequence.logprobs) == len(answer_ids) and all(lp <= 0 for lp in sequence.logprobs)
    base = service.create_sampling_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct").result()
    untaught = base.sample(prompt_ids, num_samples=1, sampling_params=types.SamplingParams(max_tokens=len(answer_ids), temperature=0.0)).result()
    assert untaught.sequences[0].tokens != answer_ids
    path = training.save_state("after-sft").result().path
    rest = tinker.RestClient(base_url=url, api_key=KEY)
    ids = {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert {"weights/after-sft", "sampler_weights/after-sft"} <= ids
    rest.delete_checkpoint_from_tinker_path(path).result()
    ids = {c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert "weights/after-sft" not in ids


def test_an_rl_step_with_importance_sampling(service):
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=1, train_unembed=False).result()  # the chunked projection
    tokenizer = training.get_tokenizer()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tokenizer.encode("Count: one, two,", add_special_tokens=False)
    samples = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    ).result().sequences
    rewards = [float(" three" in tokenizer.decode(s.tokens)) + 0.1 * i for i, s in enumerate(samples)]
    mean = sum(rewards) / len(rewards)
    batch = []
    for sequence, reward in zip(samples, rewards):
        tokens = prompt + sequence.tokens
        n_prompt = len(prompt) - 1
        batch.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": tokens[1:],
                "logprobs": [0.0] * n_prompt + list(sequence.logprobs),
                "advantages": [0.0] * n_prompt + [reward - mean] * len(sequence.tokens),
            },
        ))  # fmt: skip
    out = training.forward_backward(batch, "importance_sampling").result()
    assert math.isfinite(out.metrics["loss:sum"])
    for sequence, result in zip(samples, out.loss_fn_outputs):
        trainer = result["logprobs"].tolist()[-len(sequence.tokens):]
        # same weights, same model: the trainer's logprobs are the sampler's (fp32 on both sides)
        assert max(abs(a - b) for a, b in zip(trainer, sequence.logprobs)) < 1e-3
    assert training.optim_step(types.AdamParams(learning_rate=1e-4)).result() is not None


def test_errors_come_back_as_the_sdks_exceptions(service, url):
    with pytest.raises(tinker.BadRequestError, match="not offered here"):
        service.create_lora_training_client(base_model="meta-llama/Llama-3.1-8B", rank=8).result()
    training = service.create_lora_training_client(base_model="HuggingFaceTB/SmolLM2-135M-Instruct", rank=4).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'dpo2'"):
        training.forward_backward([bad], "dpo2").result()  # type: ignore[arg-type]
    with pytest.raises(tinker.RequestFailedError, match="weights"):
        training.forward_backward([bad], "cross_entropy").result()  # the client stays usable after a failure
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").get_server_capabilities()


@pytest.fixture(scope="module")
def other(url, monkeypatch_module):
    return tinker.ServiceClient(base_url=url, api_key=OTHER_KEY)


def test_a_tenant_gets_404_on_every_operation_on_another_tenants_objects(service, other, url):
    alice = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    state = alice.save_state("mine").result().path
    sampler_path = alice.save_weights_for_sampler("mine").result().path
    future = alice.forward([types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})], "cross_entropy")
    future.result()
    bob_rest = tinker.RestClient(base_url=url, api_key=OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        bob_rest.list_checkpoints(alice.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(alice.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_training_client_from_state(state).result()
    assert alice.model_id not in {r.training_run_id for r in bob_rest.list_training_runs().result().training_runs}
    # what the SDK cannot aim at another's run, a raw client can: every training route refuses it
    bob = {"X-API-Key": OTHER_KEY}
    alice_session = alice.model_id.split(":")[0]
    calls = {
        "get_info": {"model_id": alice.model_id, "type": "get_info"},
        "optim_step": {"model_id": alice.model_id, "seq_id": 99, "adam_params": {"learning_rate": 1.0}, "type": "optim_step"},
        "save_weights": {"model_id": alice.model_id, "seq_id": 99, "path": "stolen", "type": "save_weights"},
        "save_weights_for_sampler": {"model_id": alice.model_id, "seq_id": 99, "path": "stolen", "type": "save_weights_for_sampler"},
        "load_weights": {"model_id": alice.model_id, "seq_id": 99, "path": state, "optimizer": False, "type": "load_weights"},
        "create_model": {"session_id": alice_session, "model_seq_id": 50, "base_model": BASE, "lora_config": {"rank": 4}, "type": "create_model"},
        "session_heartbeat": {"session_id": alice_session, "type": "session_heartbeat"},
        "create_sampling_session": {"session_id": alice_session, "sampling_session_seq_id": 50, "base_model": BASE, "type": "create_sampling_session"},
    }
    for route, body in calls.items():
        answer = httpx.post(f"{url}/api/v1/{route}", json=body, headers=bob, timeout=30)
        assert answer.status_code == 404, (route, answer.text)  # as if it did not exist
    from tinker.proto import tinker_public_pb2 as pb

    request = pb.ForwardBackwardRequest(model_id=alice.model_id, seq_id=99, loss_fn="cross_entropy", forward_only=True)
    answer = httpx.post(f"{url}/api/v1/forward_backward", content=request.SerializeToString(), headers={**bob, "content-type": "application/x-protobuf"}, timeout=30)
    assert answer.status_code == 404, answer.text
    assert alice.get_info().model_id == alice.model_id  # alice's own still work
    assert httpx.post(f"{url}/api/v1/get_info", json=calls["get_info"], headers={"X-API-Key": "tml-not-a-tenant-key"}, timeout=30).status_code == 401


def test_a_tenant_that_floods_the_queue_does_not_starve_another(service, other):
    """alice queues 50 operations first; bob's next one completes before alice's 10th (order, not timing)."""
    alice = service.create_lora_training_client(base_model=BASE, rank=4).result()
    bob = other.create_lora_training_client(base_model=BASE, rank=4).result()
    tokens = list(range(100, 228))
    batch = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 127})]
    queued = [alice.forward(batch, "cross_entropy") for _ in range(50)]
    bob.forward(batch[:1], "cross_entropy").result()
    with pytest.raises(TimeoutError):
        queued[9].result(timeout=0)  # alice's 10th has not finished
    for future in queued:
        future.result()


def test_a_sigkilled_server_restarts_with_every_tenants_saved_states(tmp_path, monkeypatch_module):
    """Both tenants save states; the server is SIGKILLed while alice's next step runs; after a restart
    every saved state is listed and loads to the same weights (same logprobs), and the old runs continue."""
    port = free_port()
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY: "alice", OTHER_KEY: "bob"}))
    command = [sys.executable, "-m", "tracerl", "serve", "--tinker", "--inference", "none", "--port", str(port), "--path", str(tmp_path), "--tinker-keys", str(keys)]
    env = {**os.environ, "TRACERL_SERVE_TOKEN": "owner-token-not-a-tenant-key", "HF_HUB_OFFLINE": "1"}
    url = f"http://127.0.0.1:{port}"

    def start() -> subprocess.Popen:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        for _ in range(360):
            assert process.poll() is None
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                    return process
            except httpx.HTTPError:
                time.sleep(0.5)
        pytest.fail("tracerl serve --tinker did not start")

    probe = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4})
    process = start()
    try:
        saved, logprobs, runs = {}, {}, {}
        for key in (KEY, OTHER_KEY):
            client = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
            for step in range(2):
                client.forward_backward([probe], "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                saved[key] = client.save_state(f"step-{step + 1}").result().path
            logprobs[key] = client.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            runs[key] = client
        runs[KEY].forward_backward([probe] * 8, "cross_entropy")  # in flight when the kill lands
        process.kill()
        process.wait(timeout=30)
        process = start()
        for key in (KEY, OTHER_KEY):
            rest = tinker.RestClient(base_url=url, api_key=key)
            listed = {c.tinker_path for c in rest.list_checkpoints(runs[key].model_id).result().checkpoints}
            assert saved[key] in listed and saved[key].replace("step-2", "step-1") in listed
            restored = tinker.ServiceClient(base_url=url, api_key=key).create_training_client_from_state_with_optimizer(saved[key]).result()
            again = restored.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            assert again == pytest.approx(logprobs[key], abs=1e-5)
            # the killed server's clients go on: the resumed run takes the next request in its numbering
            assert runs[key].forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(logprobs[key], abs=1e-5)
    finally:
        process.kill()
        process.wait(timeout=30)


def test_tinker_backend_trains_a_tracerl_group_and_serves_each_step_as_name_at_step(url, tmp_path, monkeypatch_module):
    """tracerl's loop through TinkerBackend: sampled turns (their token ids, through /v1) -> a GRPO step on
    the service -> ``name@1`` answers on /v1 with the tenant's key; another tenant cannot reach it."""
    import asyncio

    import openai

    import tracerl

    async def run() -> None:
        backend = tracerl.TinkerBackend(url, KEY)
        model = tracerl.TrainableModel("agent", "tinker-test", "smollm2-135m", base_path=tmp_path, lora_config={"r": 8})
        await model.register(backend)
        client = model.openai_client()
        messages = [{"role": "user", "content": "Say a color."}]
        group = []
        for seed in range(4):
            completion = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=8, temperature=1.0, seed=seed
            )
            assert completion.model == "agent@0"
            choice = tracerl.Choice.from_openai(completion.choices[0], completion)
            assert choice.token_ids and len(choice.logprobs or []) == len(choice.token_ids)
            group.append(tracerl.Trajectory(messages_and_choices=[*messages, choice], reward=float(seed)))
        result = await backend.train(model, [tracerl.TrajectoryGroup(group)], learning_rate=1e-4)
        assert result.step == 1 and math.isfinite(result.metrics["loss"]) and result.metrics["trained_tokens"] > 0
        assert await backend.get_step(model) == 1 and await backend.list_checkpoints(model) == [1]
        answer = await client.chat.completions.create(model=model.get_inference_name(), messages=messages, max_tokens=4)
        assert answer.model == "agent@1"
        other = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=OTHER_KEY, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await other.chat.completions.create(model="agent@1", messages=messages, max_tokens=4)
        await backend.close()

    asyncio.run(run())


def test_tinker_backend_sft_lowers_the_held_out_loss_and_logs_its_row(url, tmp_path, monkeypatch_module):
    """``TinkerBackend.train_sft`` (cross_entropy through the SDK): the examples' loss falls, one new step
    ``name@1`` is served, and its ``sft`` row is in the history as LocalBackend writes it."""
    import asyncio

    import tracerl

    examples = [
        {"messages": [{"role": "user", "content": f"Code word {i}?"}, {"role": "assistant", "content": "The code word is zebra."}]}
        for i in range(4)
    ]

    async def run() -> None:
        backend = tracerl.TinkerBackend(url, KEY)
        model = tracerl.TrainableModel("sft-agent", "tinker-test", "smollm2-135m", base_path=tmp_path, lora_config={"r": 8})
        await model.register(backend)
        config = {"learning_rate": 1e-3, "batch_size": 2, "epochs": 2, "show_progress": False}
        result = await backend.train_sft(model, examples, config, val_trajectories=examples[:2])
        assert result.step == 1 and result.metrics["optimizer_steps"] == 4
        assert result.metrics["val_loss"] < 0.8 * result.metrics["val_loss_before"], result.metrics
        rows = [row for row in model.run_dir.read_history() if "sft/val_loss" in row]
        assert [row["step"] for row in rows] == [1]
        answer = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=examples[0]["messages"][:1], max_tokens=8, temperature=0
        )
        assert answer.model == "sft-agent@1"
        await backend.close()

    asyncio.run(run())
