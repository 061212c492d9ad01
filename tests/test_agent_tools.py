"""Tools in processes that can be killed (megatron_dapo/agent/tools/): the tool YAML, ToolHost
with well-behaved and hostile tools, verl class tools, the calculator and python builtins.

One ToolHost serves most tests (module scope, 2 s timeout); each hostile call is followed by a
normal one on the same host, which must still work.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import function_tool_spec

from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.tools.builtin import (
    PythonLimits,
    PythonTool,
    calculator,
    run_python,
)
from megatron_dapo.agent.tools.host import ToolHost, ToolHostClosed, ToolResult
from megatron_dapo.agent.tools.spec import (
    ToolConfigError,
    ToolSpec,
    builtin_spec,
    load_tool_config,
)
from megatron_dapo.config.schema import MultiTurnConfig

FIX = Path(__file__).parent / "fixtures" / "agent_tools"
TIMEOUT = 2.0
# a killed call returns within the timeout plus this (kill, reap, JSON), on a loaded 2-core machine
SLACK = 1.0
PYTHON_TIMEOUT = 1.2  # tools.yaml's python builtin: below TIMEOUT, so it answers its own time-out


def _spec(fn: str, file: str = "hostile_tools.py", **params: str) -> ToolSpec:
    return function_tool_spec(fn, FIX / file, **params)


HOSTILE = [
    _spec("sleep_forever", pid_file="string"),
    _spec("fork_and_hang", pid_file="string"),
    _spec("raise_error", message="string"),
    _spec("allocate", mb="integer"),
    _spec("print_lots", mb="integer"),
    _spec("return_lots", mb="integer"),
    _spec("return_none"),
    _spec("return_dict"),
    _spec("exit_now", code="integer"),
    _spec("segfault"),
    _spec("heavy_modules", file="plain_tools.py"),
]


@pytest.fixture(scope="module")
def host():
    specs = load_tool_config(FIX / "tools.yaml") + HOSTILE
    with ToolHost(specs, timeout_s=TIMEOUT, workers=2, memory_mb=512) as h:
        h.start()
        yield h


def _still_works(host: ToolHost) -> None:
    assert host.call("after", ToolCall("add", {"a": 2, "b": 3})) == ToolResult("5", "ok")


def _timed(host: ToolHost, name: str, episode: str = "ep", **arguments) -> tuple[ToolResult, float]:
    start = time.monotonic()
    result = host.call(episode, ToolCall(name, arguments))
    return result, time.monotonic() - start


def _gone(pid: int, wait_s: float = 2.0) -> bool:
    """The process no longer runs (absent, or a zombie nobody reaped yet)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


# -- the tool YAML --------------------------------------------------------------------------


def test_yaml_loads_functions_verl_classes_and_builtins():
    specs = {s.name: s for s in load_tool_config(FIX / "tools.yaml")}
    assert specs["add"].kind == "function"
    assert specs["add"].target == f"{(FIX / 'plain_tools.py').resolve()}:add"  # against the YAML's dir
    assert specs["add"].required == ["a", "b"]
    assert specs["counter"].kind == "verl_class"
    assert specs["counter"].target == "tests.fixtures.agent_tools.verl_counter.CounterTool"
    assert specs["counter"].config == {"type": "native", "start": 0}
    assert specs["legacy"].schema["function"]["parameters"] == {
        "type": "object",
        "properties": {},
        "required": [],
    }
    assert (specs["calculator"].kind, specs["calculator"].target) == ("builtin", "calculator")
    assert specs["calculator"].required == ["expression"]
    assert specs["python"].config == {"timeout_s": PYTHON_TIMEOUT, "memory_mb": 256}


def test_verl_tool_yaml_loads_unchanged(tmp_path):
    # verl's examples/sglang_multiturn/config/tool_config/*.yaml, as verl writes them: quoted
    # strings, `config: ` with a trailing space, extra config keys, a property with `item:`
    (tmp_path / "gsm8k_tool_config.yaml").write_text(
        "tools:\n"
        '  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n'
        "    config: \n"
        "      type: native\n"
        "    tool_schema:\n"
        '      type: "function"\n'
        "      function:\n"
        '        name: "calc_gsm8k_reward"\n'
        '        description: "Scores a GSM8K answer"\n'
        "        parameters:\n"
        '          type: "object"\n'
        "          properties:\n"
        "            answer:\n"
        '              type: "string"\n'
        '              description: "the answer, digits"\n'
        '          required: ["answer"]\n'
        "  - class_name: verl.tools.search_tool.SearchTool\n"
        "    config:\n"
        "      retrieval_service_url: http://127.0.0.1:8000/retrieve\n"
        "      num_workers: 120\n"
        "      type: native\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: search\n"
        "        description: Searches the web.\n"
        "        parameters:\n"
        "          type: object\n"
        "          properties:\n"
        "            query_list:\n"
        "              type: array\n"
        "              item:\n"
        "                type: string\n"
        "          required: \n"
        "            - query_list\n"
    )
    gsm8k, search = load_tool_config(tmp_path / "gsm8k_tool_config.yaml")
    assert (gsm8k.name, gsm8k.kind, gsm8k.target) == (
        "calc_gsm8k_reward",
        "verl_class",
        "verl.tools.gsm8k_tool.Gsm8kTool",
    )
    assert gsm8k.config == {"type": "native"} and gsm8k.required == ["answer"]
    assert search.config["num_workers"] == 120
    assert search.schema["function"]["parameters"]["properties"]["query_list"]["item"] == {"type": "string"}


def test_loading_runs_no_user_code(tmp_path):
    (tmp_path / "loud.py").write_text("raise SystemExit('imported!')\n\ndef tool(x):\n    return x\n")
    (tmp_path / "t.yaml").write_text(
        "tools:\n  - function: loud.py:tool\n    tool_schema: {function: {name: loud}}\n"
    )
    (spec,) = load_tool_config(tmp_path / "t.yaml")
    assert spec.target.endswith("loud.py:tool") and spec.schema["type"] == "function"


_SCHEMA = "tool_schema: {type: function, function: {name: add, parameters: {type: object, properties: {a: {type: integer}}, required: [a]}}}"


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        (
            [f"function: plain_tools.py:add\n    {_SCHEMA}", f"function: plain_tools.py:add\n    {_SCHEMA}"],
            "tools[1]: tool_schema.function.name: 'add' is also the name of tools[0]",
        ),
        (
            ["function: plain_tools.py:add\n    tool_schema: {type: function, function: {description: x}}"],
            "tools[0]: tool_schema.function.name: missing",
        ),
        ([f"function: no_such_file.py:add\n    {_SCHEMA}"], "tools[0]: function: file"),
        ([f"function: plain_tools.py:subtract\n    {_SCHEMA}"], "tools[0]: function: "),
        ([f"function: plain_tools.py\n    {_SCHEMA}"], "must look like 'path/to/file.py:function_name'"),
        (["function: plain_tools.py:add"], "tools[0]: tool_schema: missing"),
        (["builtin: ruby"], "tools[0]: builtin: 'ruby' is not a builtin tool; builtins: calculator, python"),
        (
            ["builtin: python\n    config: {timeout: 5}"],
            "tools[0]: config.timeout: not an option of builtin python",
        ),
        (
            ["builtin: python\n    config: {timeout_s: -1}"],
            "tools[0]: config.timeout_s: must be a positive number",
        ),
        (
            [
                "builtin: calculator\n    tool_schema: {function: {name: calc, parameters: {properties: {expr: {type: string}}}}}"
            ],
            "keep it under that name",
        ),
        (
            ["class_name: Gsm8kTool\n    tool_schema: {function: {name: g}}"],
            "tools[0]: class_name: 'Gsm8kTool' must be the dotted path",
        ),
        (
            ["class_name: a.B\n    config: {type: mcp}\n    tool_schema: {function: {name: g}}"],
            "tools[0]: config.type: 'mcp' is not supported",
        ),
        (
            ["class_name: a.B\n    config: {type: native}"],
            "tools[0]: tool_schema: missing; the schema is read from the YAML",
        ),
        (["class_name: a.B\n    function: plain_tools.py:add"], "give exactly one of"),
        (
            ["builtin: python\n    timeout_s: 3"],
            "tools[0]: unknown key(s) ['timeout_s'] for a `builtin` entry",
        ),
        (
            [
                "function: plain_tools.py:add\n    tool_schema: {function: {name: add, parameters: {properties: {}, required: [a]}}}"
            ],
            "tool_schema.function.parameters.required: ['a'] are not in properties",
        ),
        (
            ["function: plain_tools.py:add\n    tool_schema: {function: {name: 'add two'}}"],
            "is not a valid tool name",
        ),
    ],
)
def test_yaml_errors_name_the_file_the_entry_and_the_field(tmp_path, entries, says):
    (tmp_path / "plain_tools.py").write_text((FIX / "plain_tools.py").read_text())
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n" + "".join(f"  - {e}\n" for e in entries))
    with pytest.raises(ToolConfigError) as info:
        load_tool_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: tools["), message
    assert says in message, message


def test_yaml_file_level_errors(tmp_path):
    with pytest.raises(ToolConfigError, match="does not exist"):
        load_tool_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("tools: {add: 1}\n")
    with pytest.raises(ToolConfigError, match="bad.yaml: the file must hold a mapping with a `tools:` list"):
        load_tool_config(tmp_path / "bad.yaml")


def test_host_refuses_a_python_timeout_that_the_host_would_cut():
    with pytest.raises(
        ToolConfigError, match=r"config.timeout_s=5 must be below rollout.multi_turn.tool_timeout_s=2"
    ):
        ToolHost([builtin_spec("python", {"timeout_s": 5})], timeout_s=2, workers=1, memory_mb=512)
    with pytest.raises(ToolConfigError, match="tool_memory_mb"):
        ToolHost([builtin_spec("python", {"memory_mb": 4096})], timeout_s=2, workers=1, memory_mb=512)
    with pytest.raises(ToolConfigError, match="tool_workers"):
        ToolHost([], timeout_s=2, workers=0, memory_mb=512)


# -- well-behaved tools ---------------------------------------------------------------------


def test_sync_and_async_function_tools(host):
    assert host.call("e", ToolCall("add", {"a": 20, "b": 22})) == ToolResult("42", "ok")
    assert host.call("e", ToolCall("echo", {"text": "hi", "delay": 0.01})) == ToolResult("hi", "ok")
    assert [s["function"]["name"] for s in host.schemas][:3] == ["add", "echo", "slow_echo"]


def test_the_worker_imports_no_heavy_package(host):
    result = host.call("e", ToolCall("heavy_modules", {}))
    assert result.status == "ok"
    assert not {"torch", "megatron", "transformers", "omegaconf"} & set(result.text.split(",")), result.text


def test_calls_that_must_not_run_return_errors_at_once(host):
    cases = [
        (ToolCall("", {}, error="tool call is not valid JSON"), "Error: tool call is not valid JSON"),
        (ToolCall("rm_rf", {}), "Error: unknown tool 'rm_rf'; the tools are: add, echo"),
        (ToolCall("sleep_forever", {}), "Error: tool sleep_forever needs the argument(s) 'pid_file'"),
    ]
    for call, says in cases:
        start = time.monotonic()
        result = host.call("e", call)
        assert time.monotonic() - start < 0.1
        assert result.status == "error" and result.text.startswith(says), result


def test_concurrent_calls_get_their_own_answers(host):
    results: dict[int, ToolResult] = {}

    def one(i: int) -> None:
        results[i] = host.call(f"ep{i}", ToolCall("slow_echo", {"text": f"call {i}", "delay": 0.2}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    assert [results[i].text.split(" pid=")[0] for i in range(8)] == [f"call {i}" for i in range(8)]
    assert len({results[i].text.split(" pid=")[1] for i in range(8)}) == 2  # both workers ran calls
    assert elapsed < 8 * 0.2  # in parallel (4 rounds of 0.2 s on 2 workers)


# -- verl class tools -----------------------------------------------------------------------


def test_verl_tool_keeps_state_per_episode_and_releases_it():
    specs = load_tool_config(FIX / "tools.yaml")
    with ToolHost(specs, timeout_s=TIMEOUT, workers=1, memory_mb=512) as host:
        kwargs = {"counter": {"create_kwargs": {"target": 5}}}

        def count(episode, step, **kw):
            return host.call(episode, ToolCall("counter", {"step": step}), **kw)

        assert count("A", 2, tools_kwargs=kwargs) == ToolResult(
            "total=2 live=1 released=0", "ok", 0.0, {"calls": 1}
        )
        # the same episode's instance: its state kept, and its create_kwargs (target 5) read at create
        assert count("A", 3, tools_kwargs=kwargs) == ToolResult(
            "total=5 live=1 released=0", "ok", 1.0, {"calls": 1}
        )
        assert count("B", 1).text == "total=1 live=2 released=0"  # another episode: its own instance
        host.release("A")
        assert count("B", 1).text == "total=2 live=1 released=1"
        # a released id used again is a new episode: it starts afresh
        assert count("A", 4).text == "total=4 live=2 released=1"

        # verl before 0.5 (create returns the id, execute a string), and a response with no text
        assert host.call("A", ToolCall("legacy", {"x": 7})) == ToolResult("legacy 7", "ok", 0.5)
        image = host.call("A", ToolCall("image_only", {}))
        assert image.status == "error" and "ToolResponse with image and no text" in image.text

        # a kill takes the worker's instances along: those episodes are told, others go on
        hung, elapsed = _timed(host, "slow_echo", episode="C", text="x", delay=30)
        assert hung.status == "timeout" and elapsed < TIMEOUT + SLACK
        lost = count("A", 1)
        assert lost.status == "error" and "lost this episode's state" in lost.text
        assert count("D", 1).text == "total=1 live=1 released=0"
        stats = host.stats()
        assert (stats["worker_restarts"], stats["timeouts"], stats["lost_instances"]) == (1, 1, 1)


def test_a_verl_class_that_needs_verl_itself_says_so(host, tmp_path):
    (tmp_path / "t.yaml").write_text(
        "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n"
        "    tool_schema: {function: {name: calc_gsm8k_reward}}\n"
    )
    with ToolHost(load_tool_config(tmp_path / "t.yaml"), timeout_s=TIMEOUT, workers=1, memory_mb=512) as h:
        result = h.call("e", ToolCall("calc_gsm8k_reward", {"answer": "4"}))
    assert result.status == "error"
    assert result.text.startswith("Error: tool calc_gsm8k_reward could not be loaded: ModuleNotFoundError")
    assert "verl.tools.gsm8k_tool" in result.text


# -- hostile tools --------------------------------------------------------------------------


def test_a_tool_that_never_returns_is_killed_at_the_timeout(host, tmp_path):
    pid_file = tmp_path / "pid"
    restarts = host.stats()["worker_restarts"]
    result, elapsed = _timed(host, "sleep_forever", pid_file=str(pid_file))
    assert result == ToolResult(f"Error: tool sleep_forever timed out after {TIMEOUT:g} s", "timeout")
    assert TIMEOUT <= elapsed < TIMEOUT + SLACK
    assert _gone(int(pid_file.read_text()))
    assert host.stats()["worker_restarts"] == restarts + 1
    _still_works(host)


def test_a_child_process_dies_with_its_tool(host, tmp_path):
    pid_file = tmp_path / "pids"
    result, elapsed = _timed(host, "fork_and_hang", pid_file=str(pid_file))
    assert result.status == "timeout" and elapsed < TIMEOUT + SLACK
    worker_pid, child_pid = map(int, pid_file.read_text().split())
    assert _gone(worker_pid) and _gone(child_pid)
    _still_works(host)


def test_an_exception_is_one_line_to_the_model_and_a_traceback_to_the_log(host, caplog):
    result, elapsed = _timed(host, "raise_error", message="boom")
    assert result == ToolResult("Error: ValueError: boom second line", "error")
    assert elapsed < SLACK
    assert "Traceback" in caplog.text and "hostile_tools.py" in caplog.text
    _still_works(host)


@pytest.mark.parametrize(
    ("name", "arguments", "status", "says"),
    [
        ("allocate", {"mb": 1024}, "error", "Error: MemoryError"),  # beyond the 512 MiB limit
        ("return_none", {}, "error", "Error: the tool returned None, not text"),
        ("return_dict", {}, "error", "Error: the tool returned a dict of 1 items, not text"),
        ("exit_now", {"code": 3}, "error", "Error: tool exit_now crashed: its process exited with code 3"),
        ("segfault", {}, "error", "Error: tool segfault crashed: its process was killed by SIGSEGV"),
        ("print_lots", {"mb": 10}, "ok", "ok"),  # 10 MB on stdout: the protocol survives
    ],
)
def test_hostile_tools_end_in_one_line_and_the_run_goes_on(host, name, arguments, status, says):
    result, elapsed = _timed(host, name, **arguments)
    assert result.status == status and result.text.startswith(says), result
    assert "\n" not in result.text
    assert elapsed < TIMEOUT
    _still_works(host)


def test_a_huge_answer_is_cut_before_it_is_sent(host):
    before = host.stats()["truncated"]
    result, elapsed = _timed(host, "return_lots", mb=10)
    assert result.status == "ok" and result.metrics["truncated"] == 1
    assert result.metrics["output_chars"] == 10 << 20
    assert result.text.startswith("y" * 65536) and len(result.text) < 65536 + 100
    assert elapsed < TIMEOUT
    assert host.stats()["truncated"] == before + 1
    _still_works(host)


def test_a_closed_host_refuses_calls():
    h = ToolHost([builtin_spec("calculator")], timeout_s=TIMEOUT, workers=1, memory_mb=512)
    assert h.call("e", ToolCall("calculator", {"expression": "1+1"})).text == "2"
    h.close()
    with pytest.raises(ToolHostClosed):
        h.call("e", ToolCall("calculator", {"expression": "1+1"}))
    assert h.stats()["workers"] == 0


# -- calculator -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "answer"),
    [
        ("347*28", "9716"),
        ("(2+3)*4", "20"),
        ("7/2", "3.5"),
        ("1/3", "1/3"),
        ("-4/6", "-2/3"),
        ("0.1+0.2", "0.3"),
        ("10//3", "3"),
        ("-5%3", "1"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("-2**2", "-4"),
        ("(1/3)**-2", "9"),
        ("1_000 * 1e3", "1000000"),
        ("2**3000", str(2**3000)),
        ("2**4000", "Error: the result would have more than 1000 digits"),
        ("10**999", "1" + "0" * 999),
        ("1/0", "Error: division by zero"),
        ("5 % 0", "Error: division by zero"),
        ("2**0.5", "Error: only integer exponents give exact results"),
        ("2^10", "Error: ^ is not a power here: write ** (2**10)"),
        ("hello world", "Error: cannot parse the expression"),
        ("x + 1", "Error: names are not allowed ('x')"),
        ("__import__('os')", "Error: function calls are not allowed"),
        ("", "Error: empty expression"),
        ("1e5000", "Error: the number '1e5000' has more than 1000 digits"),
    ],
)
def test_calculator(expression, answer):
    assert calculator(expression).startswith(answer)


def test_calculator_through_the_host(host):
    assert host.call("e", ToolCall("calculator", {"expression": "347*28"})) == ToolResult("9716", "ok")
    refused = host.call("e", ToolCall("calculator", {"expression": "9**9**9"}))
    assert refused.status == "error" and refused.text.startswith("Error: the result would have more than")


# -- python ---------------------------------------------------------------------------------


def test_python_prints_its_result(host):
    result = host.call("e", ToolCall("python", {"code": "print(347*28)"}))
    assert (result.text, result.status, result.metrics["exit_code"]) == ("9716\n", "ok", 0)
    assert result.metrics["isolation"] == "bwrap"


def test_python_stops_an_infinite_loop_itself(host):
    restarts = host.stats()["worker_restarts"]
    result, elapsed = _timed(host, "python", code="print('start', flush=True)\nwhile True:\n    pass")
    assert result.status == "timeout" and result.metrics["timed_out"]
    assert result.text == f"start\nError: the code ran longer than {PYTHON_TIMEOUT:g} s and was stopped"
    assert PYTHON_TIMEOUT <= elapsed < TIMEOUT  # its own limit, before the host's
    assert host.stats()["worker_restarts"] == restarts
    _still_works(host)


def test_python_memory_bomb_is_an_error(host):
    result = host.call("e", ToolCall("python", {"code": "x = bytearray(10**10)\nprint('survived')"}))
    assert result.status == "error" and result.text.rstrip().endswith("MemoryError"), result.text
    assert "survived" not in result.text and 'File "main.py", line 1' in result.text
    _still_works(host)


def test_python_has_no_network(host):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
        )
        result = host.call("e", ToolCall("python", {"code": code}))
        assert result.status == "error" and "connected" not in result.text, result.text
        with pytest.raises(BlockingIOError):  # nothing arrived
            listener.accept()


# What the model's code can use (the hostile cases are tests/test_sandbox.py's).
@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("import sympy\nx = sympy.symbols('x')\nprint(sympy.solve(x**2 - 4, x))", "[-2, 2]"),
        ("import numpy as np\nprint(np.linalg.det(np.eye(3) * 2))", "7.99999"),
        # a last bare expression shows its value, as in a notebook cell
        ("x = 347\nx * 28", "9716"),
        ("import os\nprint(sorted(os.environ))", "['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS'"),
        ("open('f.txt', 'w').write('kept')\nprint(open('f.txt').read())", "kept"),
        ("import tempfile\nwith tempfile.TemporaryFile() as f: print('tmp ok')", "tmp ok"),
        ("import asyncio\nprint(asyncio.run(asyncio.sleep(0, 'loop ok')))", "loop ok"),
        (
            "import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(6*7)'], "
            "capture_output=True, text=True).stdout)",
            "42",
        ),
        ("import multiprocessing as mp\nwith mp.Pool(2) as p: print(p.map(abs, [-1, -2]))", "[1, 2]"),
    ],
)
def test_python_offers_what_the_model_needs(code, says):
    run = run_python(code, PythonLimits(timeout_s=5, memory_mb=512))
    assert says in run.output, run.output


def test_python_accepts_code_in_a_markdown_fence():
    text, metrics = PythonTool(PythonLimits(timeout_s=5))("```python\nprint(6 * 7)\n```")
    assert (text, metrics["exit_code"]) == ("42\n", 0)


def test_python_output_is_cut_keeping_its_end():
    run = run_python(
        "print('a' * 100000)\nraise ValueError('the end')", PythonLimits(timeout_s=5, max_output_chars=1000)
    )
    assert run.truncated and len(run.output) < 1100
    assert run.output.startswith("a" * 500) and run.output.rstrip().endswith("ValueError: the end")


# -- the cost of a call ---------------------------------------------------------------------


def test_calculator_call_overhead_through_the_host(host):
    """Median round trip of a calculator call over 200 calls on one warm host (the number the
    report quotes comes from this measurement; the bound only catches a gross regression)."""
    call = ToolCall("calculator", {"expression": "347*28"})
    host.call("e", call)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        host.call("e", call)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"calculator via ToolHost: median {median * 1e3:.3f} ms over 200 calls")
    assert median < 0.05


def test_the_worker_module_alone_imports_no_heavy_package():
    code = (
        "import sys, json, megatron_dapo.agent.tools.worker\n"
        "print(json.dumps([m for m in ('torch', 'megatron', 'transformers', 'omegaconf', 'pydantic') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_host_from_the_multi_turn_config():
    assert ToolHost.from_config(MultiTurnConfig()) is None
    config = MultiTurnConfig(tool_config_path=str(FIX / "tools.yaml"), tool_timeout_s=3.0, tool_workers=3)
    with ToolHost.from_config(config) as h:
        assert (h.timeout_s, h.workers, h.memory_mb) == (3.0, 3, 2048)
        assert "counter" in [s["function"]["name"] for s in h.schemas]
