"""An agent in another process, without tracerl: one chat call through a rollout's gateway.

    python gateway_agent.py MARKER openai   # the OpenAI SDK; OPENAI_BASE_URL / OPENAI_API_KEY from r.gateway_env()
    python gateway_agent.py MARKER urllib   # the standard library on the plain /v1 route, with the rollout's header

``MODEL`` names the model; ``PLAIN_BASE_URL`` and ``ROLLOUT_HEADER`` (``name: value``) serve the urllib form.
Prints the answer's text.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

marker, mode = sys.argv[1], sys.argv[2]
messages = [{"role": "user", "content": f"Repeat after me: {marker}"}]
if mode == "openai":
    from openai import OpenAI

    client = OpenAI(max_retries=0, timeout=300)
    answer = client.chat.completions.create(model=os.environ["MODEL"], messages=messages, max_tokens=6, temperature=1.0)
    print(answer.choices[0].message.content)
else:
    name, _, value = os.environ["ROLLOUT_HEADER"].partition(": ")
    request = urllib.request.Request(
        os.environ["PLAIN_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": os.environ["MODEL"], "messages": messages, "max_tokens": 6}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", name: value},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        print(json.loads(response.read())["choices"][0]["message"]["content"])
