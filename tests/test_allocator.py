"""tracerl.train.allocator: which malloc runs, freed memory held during a step and released after it, the relaunch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tracerl.train.allocator import find_jemalloc

# allocate ~256 MB in 64 KB blocks (below glibc's mmap threshold: they come from the heap), keep
# every 16th alive so the heap cannot simply shrink from its top, free the rest, then release
PROBE = textwrap.dedent("""
    import json, os, sys
    from tracerl.train import allocator

    def rss_mb():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024

    held = allocator.hold_freed_memory()
    blocks = [bytearray(b"x" * 65536) for _ in range(4096)]
    full = rss_mb()
    kept = blocks[::16]
    del blocks
    freed = rss_mb()
    allocator.release_freed_memory()
    released = rss_mb()
    print(json.dumps({"allocator": allocator.active_allocator(), "held": held, "full": full, "freed": freed,
                      "released": released, "pid": os.getpid(), "kept": len(kept)}))
""")


def run_probe(env: dict[str, str], code: str = PROBE) -> dict:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TRACERL_JEMALLOC", "TRACERL_JEMALLOC_RELAUNCHED")}
    env.update(extra)
    return env


def test_on_glibc_freed_heap_memory_is_trimmed_back_to_the_system() -> None:
    got = run_probe(clean_env())
    assert got["allocator"] == "glibc" and got["held"] is False
    assert got["full"] - got["freed"] < 100, got  # glibc keeps the fragmented heap's free memory ...
    assert got["freed"] - got["released"] > 150, got  # ... until release_freed_memory (malloc_trim) returns it


def test_the_override_turns_jemalloc_off_or_names_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACERL_JEMALLOC", "off")
    assert find_jemalloc() is None
    monkeypatch.setenv("TRACERL_JEMALLOC", str(tmp_path / "missing.so"))
    assert find_jemalloc() is None
    (tmp_path / "libjemalloc.so.2").write_bytes(b"")
    monkeypatch.setenv("TRACERL_JEMALLOC", str(tmp_path / "libjemalloc.so.2"))
    assert find_jemalloc() == tmp_path / "libjemalloc.so.2"


def test_off_means_no_relaunch() -> None:
    code = "from tracerl.train import allocator; allocator.relaunch_with_jemalloc(); print(allocator.active_allocator())"
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(TRACERL_JEMALLOC="off"), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "glibc", out.stderr


jemalloc = pytest.mark.skipif(find_jemalloc() is None, reason="no jemalloc here (apt-get install libjemalloc2)")


@jemalloc
def test_on_jemalloc_freed_memory_is_held_during_a_step_and_released_after_it() -> None:
    got = run_probe(clean_env(LD_PRELOAD=str(find_jemalloc())))
    assert got["allocator"] == "jemalloc" and got["held"] is True
    assert got["full"] - got["freed"] < 100, got  # decay off: the pages stay for reuse (no re-faulting) ...
    assert got["freed"] - got["released"] > 150, got  # ... and the purge gives them back


@jemalloc
def test_a_script_relaunches_itself_on_jemalloc_once_with_the_same_pid_and_arguments(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        from tracerl.train import allocator
        print("before", os.getpid(), flush=True)
        allocator.relaunch_with_jemalloc()
        allocator.relaunch_with_jemalloc()  # already on jemalloc: returns
        print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "allocator": allocator.active_allocator(),
                          "describe": allocator.describe()}))
    """))
    out = subprocess.run([sys.executable, str(script), "--flag", "value"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    befores = [line for line in lines if line.startswith("before")]
    got = json.loads(lines[-1])
    assert len(befores) == 2 and befores[0] == befores[1] == f"before {got['pid']}"  # the same process, run twice
    assert got["argv"] == ["--flag", "value"] and got["allocator"] == "jemalloc"
    assert got["describe"].startswith("allocator: jemalloc")
