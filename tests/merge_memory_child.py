"""Run ``tracerl export`` (:func:`export_policy`) in this process and print its peak anonymous memory as JSON.

``python tests/merge_memory_child.py BASE_PATH PROJECT NAME OUT``, run by ``test_merged_streaming.py``.

What is measured: the process's anonymous resident memory (``RssAnon`` of ``/proc/self/status``:
heap and anonymous mappings, i.e. every tensor the export makes), sampled every 0.5 ms by a thread,
minus its value just before the export (after torch, transformers, peft and tracerl are imported).
Not ``VmHWM``: that high-water mark also counts file-backed pages, and reading the base's
safetensors through ``mmap`` maps whole files (page cache the kernel can drop, not memory the export
holds). Sampling can miss a peak only if memory is allocated and freed again within 0.5 ms; the
tensors here take longer than that to fill (tens of MB each, written to before they are freed).
The GGUF converter runs in a child process of its own and is not counted.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    base_path, project, name, out = sys.argv[1:5]
    import peft  # noqa: F401  # imported before the baseline: what every export pays anyway
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from peft import PeftModel  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    from tracerl.train.export import export_policy
    from tracerl.train.merged_weights import write_merged_model  # noqa: F401

    gc.collect()
    baseline = rss_anon()
    peak = baseline
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_anon())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    result = export_policy(base_path, project, name, out, gguf_type="f32")
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    peak = max(peak, rss_anon())
    print(json.dumps({
        "baseline": baseline, "peak": peak, "peak_above_baseline": peak - baseline, "seconds": seconds,
        "hf": str(result.hf_folder), "gguf": str(result.gguf_file),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
