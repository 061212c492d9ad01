"""The tool process: runs tool calls for :class:`~megatron_dapo.agent.tools.host.ToolHost`.

Run as ``python -m megatron_dapo.agent.tools.worker --in-fd R --out-fd W --memory-mb M``. It
talks JSON lines over two pipes of its own (fds ``R`` and ``W``), never over stdout: fd 1 is
pointed at /dev/null at start, so a tool that prints cannot corrupt the protocol. At start it
caps its address space at ``M`` MiB (RLIMIT_AS: a tool that allocates too much gets MemoryError
or dies, not the machine) and leads a process group of its own (the host kills the whole group,
children a tool started included).

Protocol. The host first sends ``{"op": "init", "specs": [ToolSpec as dict], "max_output_chars":
N, "python": {"timeout_s": T, "memory_mb": M}}``; the worker answers ``{"ready": true, "pid": ...}``. Then:

- ``{"op": "call", "episode": E, "tool": NAME, "arguments": {...}, "tools_kwargs": {...}}`` ->
  ``{"text", "status": "ok"|"error", "reward", "metrics"[, "traceback"]}``;
- ``{"op": "release", "episode": E}`` -> no answer: the episode's verl tool instances are released.

Tools load at their first call (user code runs only here): a function tool from its file (as
``reward.custom_fn``), a verl class by its dotted name (with verl's interface provided by
:mod:`.verl_shim` when verl is not installed), a builtin from :mod:`.builtin`. The worker stays
light: no torch, megatron or transformers.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import importlib
import importlib.util
import inspect
import json
import math
import os
import resource
import signal
import sys
import threading
import time
import traceback
from typing import Any

from megatron_dapo.agent.tools import builtin, sandbox, verl_shim
from megatron_dapo.pyfile import import_file

# one line to the model: an exception's message past this is cut (the traceback goes to the log)
_MESSAGE_CHARS = 500
_PARENT_POLL_S = 0.5


class _ToolFailed(Exception):
    """A call that ends with an error observation (``str(self)``) and no traceback worth logging."""


class ToolWorker:
    """The tools of one worker process: loaded on first use, verl instances per episode."""

    def __init__(self, specs: list[dict], *, max_output_chars: int, python_defaults: dict | None = None):
        self.specs = {spec["name"]: spec for spec in specs}
        self.max_output_chars = int(max_output_chars)
        self.python_defaults = python_defaults or {}  # the python builtin's limits its config leaves out
        self.loaded: dict[str, Any] = {}
        self.modules: dict[str, Any] = {}  # function tool files, by path: loaded once
        self.instances: dict[tuple[str, str], str] = {}  # (episode, tool) -> verl instance id
        # one loop for the worker's life: a verl tool may keep loop-bound state (aiohttp sessions)
        self.loop = asyncio.new_event_loop()

    # -- requests ------------------------------------------------------------------------

    def call(self, episode: str, name: str, arguments: dict, tools_kwargs: dict | None = None) -> dict:
        spec = self.specs.get(name)
        if spec is None:
            return _error(f"Error: unknown tool {name!r}; tools: {', '.join(sorted(self.specs))}")
        try:
            tool = self._load(spec)
        except BaseException as e:
            return _error(f"Error: tool {name} could not be loaded: {_one_line(e)}", traceback.format_exc())
        try:
            if spec["kind"] == "verl_class":
                kwargs = (tools_kwargs or {}).get(name) or {}
                text, reward, metrics = self._run_verl(tool, episode, name, arguments, kwargs)
            elif spec["kind"] == "builtin":
                text, status, metrics = tool(**arguments)
                return self._answer(text, 0.0, metrics, status)
            elif "sandbox" in spec.get("config", {}):
                text, reward, metrics = self._sandboxed(spec, arguments), 0.0, {"isolation": "bwrap"}
            else:
                text, reward, metrics = self._run(tool(**arguments)), 0.0, {}
        except _ToolFailed as e:
            return _error(str(e))
        except BaseException as e:  # the model sees one line; the host logs the traceback
            return _error(f"Error: {_one_line(e)}", traceback.format_exc())
        return self._answer(text, reward, metrics)

    def release(self, episode: str) -> None:
        for key in [k for k in self.instances if k[0] == episode]:
            instance_id = self.instances.pop(key)
            try:
                self._run(self.loaded[key[1]].release(instance_id))
            except BaseException:  # a failed release must not stop the worker; stderr (the host's) has it
                print(f"tool {key[1]}: release({instance_id!r}) failed:", file=sys.stderr)
                traceback.print_exc()

    # -- loading -------------------------------------------------------------------------

    def _load(self, spec: dict) -> Any:
        name = spec["name"]
        if name in self.loaded:
            return self.loaded[name]
        kind, target, config = spec["kind"], spec["target"], spec.get("config") or {}
        if kind == "builtin":
            tool = builtin.make_builtin(
                target, {**self.python_defaults, **config} if target == "python" else config
            )
        elif kind == "function" and "sandbox" in config:
            # loaded inside each call's sandbox, never here; the boundary is probed now (fail closed)
            box = config["sandbox"]
            # built once (its cgroup set-up too), not per call
            tool = sandbox.function_sandbox(
                sandbox.Sandbox(
                    self.sandbox_limits(),
                    packages=tuple(box.get("packages") or ()),
                    read=tuple(box.get("read") or ()),
                ),
                target,
            )
            found = sandbox.probe(tool)
            if not found.ok:
                raise sandbox.SandboxUnavailable(found.detail)
        elif kind == "function":
            path, _, fn_name = target.rpartition(":")
            module = self._module(path)
            tool = getattr(module, fn_name, None)
            if not callable(tool):
                raise AttributeError(f"{path} has no function {fn_name!r}")
        elif kind == "verl_class":
            verl_shim.install()
            module_name, _, class_name = target.rpartition(".")
            cls = getattr(importlib.import_module(module_name), class_name, None)
            if cls is None:
                raise AttributeError(f"module {module_name} has no class {class_name!r}")
            schema_cls = importlib.import_module("verl.tools.schemas").OpenAIFunctionToolSchema
            tool = cls(config=dict(config), tool_schema=schema_cls.model_validate(spec["schema"]))
        else:
            raise ValueError(f"unknown tool kind {kind!r}")
        self.loaded[name] = tool
        return tool

    def sandbox_limits(self) -> sandbox.SandboxLimits:
        """A sandboxed function tool's limits: the python builtin's defaults the host passes."""
        limits = builtin.PythonLimits(
            **{k: v for k, v in self.python_defaults.items() if k in ("timeout_s", "memory_mb")}
        )
        return limits.sandbox_limits()

    def _sandboxed(self, spec: dict, arguments: dict) -> Any:
        value, printed, done = sandbox.function_in_sandbox(
            self.loaded[spec["name"]], spec["target"], arguments
        )
        if done.timed_out:
            raise _ToolFailed(
                f"Error: the tool ran longer than {self.sandbox_limits().timeout_s:g} s and was stopped"
            )
        if done.exit_code != 0:
            last = (printed.strip().splitlines() or [f"exit code {done.exit_code}"])[-1]
            raise _ToolFailed(f"Error: {last[:_MESSAGE_CHARS]}")
        return value

    def _module(self, path: str):
        if path not in self.modules:
            self.modules[path] = import_file(path, "megatron_dapo_tool")
        return self.modules[path]

    # -- running -------------------------------------------------------------------------

    def _run(self, value: Any) -> Any:
        return self.loop.run_until_complete(value) if inspect.isawaitable(value) else value

    def _run_verl(self, tool: Any, episode: str, name: str, arguments: dict, kwargs: dict):
        key = (episode, name)
        if key not in self.instances:
            created = self._run(tool.create(create_kwargs=kwargs.get("create_kwargs") or {}))
            # verl's create returns (instance_id, ToolResponse); before 0.5 it returned the id alone
            instance_id = created[0] if isinstance(created, tuple) else created
            if not isinstance(instance_id, str):
                raise _ToolFailed(
                    f"Error: tool {name}'s create() returned {_type(created)}, not an instance id"
                )
            self.instances[key] = instance_id
        result = self._run(
            tool.execute(self.instances[key], arguments, **(kwargs.get("execute_kwargs") or {}))
        )
        if not (isinstance(result, tuple) and len(result) == 3):
            raise _ToolFailed(
                f"Error: tool {name}'s execute() returned {_type(result)}, not (ToolResponse, reward, metrics)"
            )
        response, reward, metrics = result
        if isinstance(response, str):  # verl before 0.5: a plain string
            text = response
        elif all(hasattr(response, a) for a in ("text", "image", "video")):
            media = [a for a in ("image", "video") if getattr(response, a)]
            if not isinstance(response.text, str) or (media and not response.text):
                what = f"{' and '.join(media)} and no text" if media else "no text"
                raise _ToolFailed(
                    f"Error: tool {name} returned a ToolResponse with {what}; only text reaches the model"
                )
            text = response.text
            if media:
                metrics = {**(metrics or {}), "media_dropped": len(media)}
        else:
            text = response  # _answer says what it is
        try:
            reward = 0.0 if reward is None else float(reward)
        except (TypeError, ValueError):
            raise _ToolFailed(
                f"Error: tool {name} returned a step reward of type {_type(reward)}, not a number"
            ) from None
        return text, reward, metrics

    def _answer(self, text: Any, reward: float, metrics: Any, status: str = "ok") -> dict:
        if not isinstance(text, str):
            return _error(f"Error: the tool returned {_type(text)}, not text (a tool's answer must be a str)")
        if not isinstance(metrics, dict):
            metrics = {"metrics_dropped": _type(metrics)} if metrics is not None else {}
        if len(text) > self.max_output_chars:
            total = len(text)
            text = text[: self.max_output_chars] + f"\n... [cut: {total} characters in all]"
            metrics = {**metrics, "truncated": 1, "output_chars": total}
        if not math.isfinite(reward):
            reward = 0.0
        return {"text": text, "status": status, "reward": reward, "metrics": metrics}


def _error(text: str, tb: str | None = None) -> dict:
    out: dict[str, Any] = {"text": text, "status": "error", "reward": 0.0, "metrics": {}}
    if tb:
        out["traceback"] = tb
    return out


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    if len(message) > _MESSAGE_CHARS:
        message = message[:_MESSAGE_CHARS] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _type(value: Any) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    return f"a {name}" + (f" of {len(value)} items" if isinstance(value, (tuple, list, dict)) else "")


def _watch_parent(parent: int) -> None:
    """Kill this worker's group when the host is gone (SIGKILLed hosts close no pipes cleanly
    while a tool hangs)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent:
            os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-fd", type=int, required=True)
    parser.add_argument("--out-fd", type=int, required=True)
    parser.add_argument("--memory-mb", type=int, required=True)
    args = parser.parse_args(argv)

    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    limit = args.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing tool leaves no core files
    # Ctrl-C and Slurm's SIGTERM are the host's to handle; it ends this worker by closing its input
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    faulthandler.enable()  # a segfaulting tool leaves its stack on stderr, in the host's log
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()

    requests = os.fdopen(args.in_fd, "rb")
    replies = os.fdopen(args.out_fd, "wb")

    def send(obj: dict) -> None:
        replies.write(json.dumps(obj, default=str).encode() + b"\n")
        replies.flush()

    init = json.loads(requests.readline() or b"{}")
    if init.get("op") != "init":
        send({"ready": False, "error": f"expected an init request, got {init!r:.200}"})
        return 1
    worker = ToolWorker(
        init["specs"], max_output_chars=init["max_output_chars"], python_defaults=init.get("python")
    )
    send({"ready": True, "pid": os.getpid()})
    for line in requests:
        request = json.loads(line)
        if request["op"] == "release":
            worker.release(request["episode"])
            continue
        reply = worker.call(
            request["episode"], request["tool"], request["arguments"], request.get("tools_kwargs")
        )
        try:
            send(reply)
        except (TypeError, ValueError) as e:  # metrics that JSON cannot carry
            send(_error(f"Error: the tool's answer could not be sent: {_one_line(e)}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
