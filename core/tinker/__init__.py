"""The Tinker API, self-hosted: ``tracerl serve --tinker`` answers the official ``tinker`` SDK.

- :mod:`.losses`: Tinker's four losses (sums), on tracerl's GRPO where they coincide;
- :mod:`.lora_pool`: many LoRA adapters on one copy of the base model, each with its Adam state;
- :mod:`.wire`: the protobuf messages (forward_backward, its results, sampling results);
- :mod:`.service`: sessions, training runs in ``seq_id`` order, sampling sessions, futures;
- :mod:`.routes`: the ``/api/v1`` HTTP routes the SDK calls.
"""
