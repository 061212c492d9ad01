"""A CPU SGLang server forks its scheduler and detokenizer instead of spawning them.

SGLang forces the ``spawn`` start method (``sglang/srt/entrypoints/engine.py``) because a CUDA
context cannot cross a fork. A CPU server has no CUDA context, and a spawned child imports SGLang,
torch and transformers again: 17 s of CPU per server start against 7 s forked, measured on the
2-core machine (``tools/bench_sglang_start.py``), and the test suite starts ~15 servers. The launcher has only its main thread when it starts them (checked: no other
thread to leave a lock held in the child), and the children run the same code either way.

Python imports ``sitecustomize`` from this directory because it is on the server's PYTHONPATH and
nowhere else (``megatron_dapo.sglang.engines.cpu_server_env``); GPU servers never see it.
"""

import multiprocessing

_set_start_method = multiprocessing.set_start_method


def _fork_instead_of_spawn(method, force=False):
    return _set_start_method("fork" if method == "spawn" else method, force=force)


multiprocessing.set_start_method = _fork_instead_of_spawn
