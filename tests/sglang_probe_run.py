"""`megatron-dapo train` with a probe on its SGLang engines (run as a script by the tests).

Before every engine call it writes PROBE_DIR/call_<k>.json: the call's prompts, the server's
log-probs of PROBE_SEQUENCE (what weights it serves at that moment) and the server's pid. With
PROBE_BLOCK_AT=k it then blocks call k forever, so a test can kill the run at a known point.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_fixtures import fixed_sequence_logprobs  # noqa: E402

from megatron_dapo.cli import main  # noqa: E402
from megatron_dapo.sglang.client import SGLangEngine  # noqa: E402

OUT = Path(os.environ["PROBE_DIR"])
SEQUENCE = json.loads(os.environ["PROBE_SEQUENCE"])
BLOCK_AT = int(os.environ.get("PROBE_BLOCK_AT", "0"))
_calls = [0]
_lock = threading.Lock()
_original = SGLangEngine.generate


def _probed_generate(engine, requests, on_result=None):
    import ray

    with _lock:
        _calls[0] += 1
        k = _calls[0]
    record = {
        "engine": engine.name,
        "prompts": [list(r.prompt_ids) for r in requests],
        "logprobs": fixed_sequence_logprobs(engine.client.base_url, SEQUENCE),
        "server_pid": ray.get(engine.server.host.pid.remote(engine.server.index), timeout=120),
    }
    tmp = OUT / f".call_{k}.json"
    tmp.write_text(json.dumps(record))
    tmp.rename(OUT / f"call_{k}.json")  # whole or absent: the test polls for it
    if k == BLOCK_AT:
        threading.Event().wait()
    return _original(engine, requests, on_result)


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    SGLangEngine.generate = _probed_generate
    sys.exit(main(["train", *sys.argv[1:]]))
