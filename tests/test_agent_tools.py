"""Tools for multi-turn episodes (megatron_dapo/agent/tools/): the tool YAML, the calculator and
python builtins."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.agent.tools.builtin import (
    PythonLimits,
    PythonTool,
    calculator,
    network_isolation,
    run_python,
)
from megatron_dapo.agent.tools.spec import (
    ToolConfigError,
    load_tool_config,
)

FIX = Path(__file__).parent / "fixtures" / "agent_tools"
PYTHON_TIMEOUT = 1.2  # tools.yaml's python builtin


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


# -- python ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("import os\nos.system('true')", "starting or signalling other processes is not allowed (os.system)"),
        (
            "import subprocess\nsubprocess.run(['true'])",
            "starting or signalling other processes is not allowed",
        ),
        ("import os\nos.fork()", "(os.fork)"),
        ("import ctypes", "ImportError: _ctypes is not available"),
        ("open('/tmp/mdapo_escape', 'w')", "writing outside the working directory is not allowed"),
        ("import os\nprint(sorted(os.environ))", "['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS'"),
        ("open('f.txt', 'w').write('kept')\nprint(open('f.txt').read())", "kept"),
        ("import asyncio\nprint(asyncio.run(asyncio.sleep(0, 'loop ok')))", "loop ok"),
    ],
)
def test_python_sandbox_refuses_processes_and_outside_writes(code, says):
    run = run_python(code, PythonLimits(timeout_s=5, memory_mb=512), network_isolation())
    assert says in run.output, run.output
    assert not Path("/tmp/mdapo_escape").exists()


def test_python_accepts_code_in_a_markdown_fence():
    text, metrics = PythonTool(PythonLimits(timeout_s=5))("```python\nprint(6 * 7)\n```")
    assert (text, metrics["exit_code"]) == ("42\n", 0)


def test_python_output_is_cut_keeping_its_end():
    run = run_python(
        "print('a' * 100000)\nraise ValueError('the end')", PythonLimits(timeout_s=5, max_output_chars=1000)
    )
    assert run.truncated and len(run.output) < 1100
    assert run.output.startswith("a" * 500) and run.output.rstrip().endswith("ValueError: the end")
