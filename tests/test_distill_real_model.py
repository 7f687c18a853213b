"""On-policy context distillation on the real SmolLM2-135M, served by the transformers server.

The student sees the calculator task with no worked example; the teacher is the same base
model, served by tracerl, with the demo's two worked examples prepended.  One distillation
step must train (a group of equal rewards, so on the token advantages alone), commit and serve
``student@1``, and bring the student's logprobs on the same sampled tokens closer to the
teacher's (mean ``|log π_student − log π_teacher|`` on that batch; the printed reverse-KL
estimate is the same mean without the absolute value, which a step need not lower on a fixed
batch of tokens).  A teacher asked for a model the server does not know is a real 404:
``TeacherError``, nothing written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import tracerl
from tracerl.train.distill import TeacherQuery

pytestmark = [pytest.mark.real_model, pytest.mark.asyncio(loop_scope="session")]

_spec = importlib.util.spec_from_file_location("demo", Path(__file__).resolve().parents[1] / "examples" / "demo.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)  # type: ignore[union-attr]

TASK = {"a": 341, "b": 275}
STUDENT_VIEW = [{"role": "system", "content": demo.SYSTEM}, {"role": "user", "content": "What is 341 + 275?"}]


async def sample_group(model: tracerl.TrainableModel, n: int) -> tracerl.TrajectoryGroup:
    client = model.openai_client()
    completion = await client.chat.completions.create(
        model=model.get_inference_name(), messages=STUDENT_VIEW, tools=[demo.ADD_TOOL], n=n, max_tokens=24,
        temperature=1.0, logprobs=True, seed=7, extra_body={"return_token_ids": True},
    )
    return tracerl.TrajectoryGroup(
        tracerl.Trajectory(messages_and_choices=[*STUDENT_VIEW, tracerl.Choice.from_openai(c, completion)], tools=[demo.ADD_TOOL])
        for c in completion.choices
    )


def queries(group: tracerl.TrajectoryGroup) -> list[TeacherQuery]:
    return [
        TeacherQuery(list(STUDENT_VIEW), [demo.ADD_TOOL], choice.prompt_token_ids, list(choice.token_ids))
        for t in group for choice in t.sampled_turns()
    ]


async def test_context_distillation_step_moves_the_student_towards_the_teacher(tmp_path):
    backend = tracerl.LocalBackend(inference="transformers")
    model = tracerl.TrainableModel("student", "distill", "smollm2-135m", base_path=tmp_path)
    await model.register(backend)
    try:
        group = await sample_group(model, 4)

        # the same model in the same context agrees with the sampler: the scoring is aligned token for token
        itself = tracerl.served_teacher(model)
        for query, t in zip(queries(group), group):
            scored = await itself.score(query)
            assert scored == pytest.approx(t.sampled_turns()[0].logprobs, abs=2e-3)

        echoed = tracerl.CompletionsTeacher(model.inference_base_url, model.name, api_key=model.inference_api_key, protocol="echo")
        first = queries(group)[0]
        assert await echoed.score(first) == pytest.approx(await itself.score(first), abs=1e-5)  # both wire forms agree

        tokenizer = backend.tokenizer(model)
        teacher = tracerl.served_teacher(model, context=tracerl.with_worked_examples(demo.worked_examples()), tokenizer=tokenizer)
        before = await tracerl.add_teacher_advantages([group], teacher, kl_coef=1.0)
        student_old = [lp for t in group for lp in t.sampled_turns()[0].logprobs]
        advantages = [a for t in group for a in t.sampled_turns()[0].token_advantages]
        teacher_lp = [s + a for s, a in zip(student_old, advantages)]  # A = -(s - t) with kl_coef 1
        assert before["teacher_scored_tokens"] == len(student_old) > 0
        assert abs(before["teacher_reverse_kl"]) > 0.05  # the worked examples change what the model expects

        result = await backend.train(model, [group], learning_rate=5e-4)
        assert result.step == 1 and model.get_inference_name() == "student@1"
        assert group.rewards == [0.0] * 4  # equal rewards: no reward signal, the token advantages alone trained
        assert result.metrics["num_groups_trainable"] == result.metrics["num_groups_with_token_advantages"] == 1
        assert result.metrics["trained_tokens"] == len(student_old)
        assert (tmp_path / "distill" / "models" / "student" / "checkpoints" / "0001" / "adapter_model.safetensors").exists()

        student_now = tracerl.served_teacher(model, model_name="student@1")  # the served new adapter, student's view
        student_new = [lp for query in queries(group) for lp in await student_now.score(query)]
        gap_before = sum(abs(s - q) for s, q in zip(student_old, teacher_lp)) / len(teacher_lp)
        gap_after = sum(abs(s - q) for s, q in zip(student_new, teacher_lp)) / len(teacher_lp)
        kl_after = sum(s - q for s, q in zip(student_new, teacher_lp)) / len(teacher_lp)
        print(f"mean |log π_student - log π_teacher| on the batch: {gap_before:.3f} -> {gap_after:.3f}; "
              f"reverse KL estimate {before['teacher_reverse_kl']:.3f} -> {kl_after:.3f}")
        assert gap_after < gap_before

        wrong = tracerl.served_teacher(model, model_name="no-such-model")  # a real 404 from the server
        fresh = await sample_group(model, 1)
        with pytest.raises(tracerl.TeacherError, match="answered 404"):
            await tracerl.add_teacher_advantages([fresh], wrong)
        assert fresh.trajectories[0].sampled_turns()[0].token_advantages is None
    finally:
        await backend.close()

