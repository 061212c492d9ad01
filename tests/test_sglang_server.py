"""SGLang server supervision with stand-in server processes (no sglang, no GPU): launch flags,
readiness polling, crash and timeout errors carrying the log tail, process-group stop."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from megatron_dapo.ports import free_port
from megatron_dapo.sglang.server import (
    SGLangServer,
    SGLangServerConfig,
    SGLangStartupError,
    build_launch_command,
)

FLAGS = json.loads((Path(__file__).parent / "fixtures" / "sglang" / "server_args.json").read_text())

STANDIN = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, unhealthy = int(sys.argv[1]), int(sys.argv[2])
    print("loading weights ...", flush=True)
    seen = [0]
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            seen[0] += 1
            ok = self.path == "/health_generate" and 0 <= unhealthy < seen[0]
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
    HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def standin(tmp_path, unhealthy_polls):
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    port = free_port()
    cfg = SGLangServerConfig(model_path="/m", port=port, log_file=str(tmp_path / "server.log"))
    return SGLangServer(
        cfg, command=[sys.executable, str(script), str(port), str(unhealthy_polls)], poll_s=0.1
    )


def test_launch_command_uses_only_sglang_flags():
    cfg = SGLangServerConfig(
        model_path="/ckpt",
        tp_size=2,
        port=31000,
        api_key="k",
        enable_memory_saver=True,
        dtype="bfloat16",
        base_gpu_id=4,
        extra_args=["--context-length", "4096"],
    )
    cmd = build_launch_command(cfg, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    assert cmd[-2:] == ["--context-length", "4096"]
    args = cmd[3:-2]
    flags = [a for a in args if a.startswith("--")]
    assert set(flags) <= set(FLAGS["value_flags"]) | set(FLAGS["switches"])
    pairs = {a: args[i + 1] for i, a in enumerate(args) if a in FLAGS["value_flags"]}
    assert pairs == {
        "--model-path": "/ckpt",
        "--tp-size": "2",
        "--host": "127.0.0.1",
        "--port": "31000",
        "--mem-fraction-static": "0.7",
        "--dtype": "bfloat16",
        "--api-key": "k",
        "--base-gpu-id": "4",
    }
    assert "--enable-memory-saver" in args and "--skip-server-warmup" in args


def test_waits_until_health_generate_answers(tmp_path):
    with standin(tmp_path, unhealthy_polls=3) as server:
        server.wait_healthy(timeout_s=30)
        assert server.alive()
        proc = server.proc
    assert proc.poll() is not None  # stopped with its process group


def test_crash_during_startup_reports_exit_code_and_log_tail(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "print('RuntimeError: CUDA out of memory while loading', flush=True)\nraise SystemExit(3)\n"
    )
    cfg = SGLangServerConfig(model_path="/m", port=free_port(), log_file=str(tmp_path / "crash.log"))
    server = SGLangServer(cfg, command=[sys.executable, str(script)], poll_s=0.1)
    with server, pytest.raises(SGLangStartupError, match=r"(?s)exited with code 3.*CUDA out of memory"):
        server.wait_healthy(timeout_s=30)


def _wait_until_answering(url: str, deadline_s: float = 120.0) -> None:
    """Block until the stand-in answers HTTP at all (its start-up is slow on a loaded machine)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            httpx.get(f"{url}/health_generate", timeout=5.0)
            return
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError(f"stand-in at {url} never answered in {deadline_s:g}s")


def test_never_healthy_times_out_with_log_tail(tmp_path):
    server = standin(tmp_path, unhealthy_polls=-1)
    with server:
        # The short timeout is the behaviour under test; start it only once the stand-in answers,
        # so the error always carries its 503 and its log line, however loaded the machine is.
        _wait_until_answering(server.cfg.url)
        with pytest.raises(
            SGLangStartupError, match=r"(?s)not healthy after 1.5s.*HTTP 503.*loading weights"
        ):
            server.wait_healthy(timeout_s=1.5)


def _fake_python(tmp_path, version: str) -> str:
    """An 'interpreter' whose installed sglang reports ``version`` (answers the metadata probe)."""
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\necho {version}\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize("version", ["0.4.6.post5", "0.6.0"])
def test_launch_refuses_unsupported_sglang(tmp_path, version):
    cfg = SGLangServerConfig(model_path="m", port=free_port(), log_file=str(tmp_path / "s.log"))
    cfg.python = _fake_python(tmp_path, version)
    with pytest.raises(SGLangStartupError, match=r"not supported; this release needs sglang>=0.5.21,<0.6"):
        SGLangServer(cfg).start()
    assert not (tmp_path / "s.log").exists()  # refused before anything started


def test_launch_accepts_the_supported_release(tmp_path):
    from megatron_dapo.sglang.server import check_launchable

    assert check_launchable(_fake_python(tmp_path, "0.5.23")) == (0, 5, 23)


def test_default_server_python_is_the_repo_sglang_venv_when_built():
    from megatron_dapo.sglang.server import REPO_SGLANG_PYTHON, default_server_python

    expected = str(REPO_SGLANG_PYTHON) if REPO_SGLANG_PYTHON.exists() else sys.executable
    assert default_server_python() == expected
    cfg = SGLangServerConfig(model_path="m", python="/opt/sg/bin/python", max_total_tokens=4096)
    cmd = build_launch_command(cfg)
    assert cmd[0] == "/opt/sg/bin/python" and cmd[cmd.index("--max-total-tokens") + 1] == "4096"


LAUNCHER = textwrap.dedent(
    """
    import sys
    from megatron_dapo.sglang.server import SGLangServer, SGLangServerConfig
    script, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    cfg = SGLangServerConfig(model_path="/m", port=port, log_file=log)
    server = SGLangServer(cfg, command=[sys.executable, script, str(port), "0"], poll_s=0.1).start()
    server.wait_healthy(timeout_s=300)
    print(server.proc.pid, flush=True)
    sys.stdin.read()  # until killed
    """
)


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_server_dies_with_the_process_that_launched_it(tmp_path):
    """SIGKILL of the launching process (a trainer killed by the OOM killer or `kill -9`) takes its
    server with it, although the server runs in its own session (out of the trainer's group)."""
    import os
    import signal
    import subprocess

    (tmp_path / "standin.py").write_text(STANDIN)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    port = free_port()
    launcher = subprocess.Popen(
        [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "standin.py"), str(port),
         str(tmp_path / "server.log")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    server_pid = None
    try:
        server_pid = int(launcher.stdout.readline())  # printed once the stand-in serves
        assert os.getsid(server_pid) == server_pid != os.getsid(launcher.pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 120
        while not _gone(server_pid):
            assert time.monotonic() < deadline, f"server {server_pid} outlived its launcher"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if server_pid is not None and not _gone(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


def test_server_does_not_inherit_the_torchrun_environment(tmp_path, monkeypatch):
    """A rank under torchrun launches the servers (torchrun mode); with torchrun's variables SGLang's
    own process-group init joins the agent's store as a client and hangs at start-up."""
    torchrun_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                    "GROUP_RANK": "0", "ROLE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
    for k, v in torchrun_env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("KEEP_ME", "1")
    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\nprint('ENV=' + json.dumps(dict(os.environ)), flush=True)\n")
    cfg = SGLangServerConfig(
        model_path="/m",
        port=free_port(),
        log_file=str(tmp_path / "env.log"),
        env={"SGLANG_USE_CPU_ENGINE": "1"},
    )
    server = SGLangServer(cfg, command=[sys.executable, str(script)]).start()
    assert server.proc.wait(timeout=120) == 0
    server.stop()
    line = next(x for x in (tmp_path / "env.log").read_text().splitlines() if x.startswith("ENV="))
    env = json.loads(line[4:])
    assert not set(torchrun_env) & set(env), sorted(set(torchrun_env) & set(env))
    assert env["KEEP_ME"] == "1" and env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_a_stopped_server_skips_sglang_s_crash_diagnostics_unless_the_user_asks(tmp_path, monkeypatch):
    """stop() SIGTERMs the server's group; SGLang takes its scheduler's death for a crash and, with
    its crash diagnostics on, sleeps 5 s (then py-spy, a CUDA core dump) before it exits: on every
    stop. The launched process gets them off; a user's own setting is kept."""
    monkeypatch.delenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", raising=False)
    monkeypatch.setenv("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "1")
    script = tmp_path / "env.py"
    script.write_text("import json, os, sys\nprint('ENV=' + json.dumps(dict(os.environ)), flush=True)\n")
    cfg = SGLangServerConfig(model_path="/m", port=free_port(), log_file=str(tmp_path / "env.log"))
    server = SGLangServer(cfg, command=[sys.executable, str(script)]).start()
    assert server.proc.wait(timeout=120) == 0
    server.stop()
    line = next(x for x in (tmp_path / "env.log").read_text().splitlines() if x.startswith("ENV="))
    env = json.loads(line[4:])
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "0"
    assert env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "1"


def test_servers_sleep_on_idle_unless_the_config_says_not():
    """An idle SGLang scheduler polls its sockets in a loop: a CPU core per server at 100% for
    the whole actor update and sync. `--sleep-on-idle` (a real server's idle CPU is checked in
    test_sglang_real_server.py) is the default, and `rollout.sglang.sleep_on_idle=false` drops it."""
    from megatron_dapo.config.loader import load_config
    from megatron_dapo.sglang.engines import server_config

    def command(*overrides):
        cfg = load_config(None, ["model.path=/m", *overrides])
        return build_launch_command(server_config(cfg, 0, (), "/tmp", cpu=True), python="python")

    assert "--sleep-on-idle" in command()
    assert "--sleep-on-idle" not in command("rollout.sglang.sleep_on_idle=false")


def test_a_start_up_error_carries_the_cause_not_sglang_s_argument_dump(tmp_path):
    """A server killed during start-up: its error line (what the console shows) names the last
    lines that say something, not the ~15,000-character ``server_args=`` dump and the platform
    warnings SGLang prints first (measured: one console line of 15 kB)."""
    script = tmp_path / "crash.py"
    script.write_text(
        "import sys\n"
        "print('UserWarning: Only CUDA, HIP and XPU support AWQ currently.')\n"
        "print('  warnings.warn(f\"Only CUDA, HIP and XPU support AWQ currently.\")')\n"
        "print('[2026-12-07 01:10:53] server_args=' + repr({f'knob_{i}': None for i in range(800)}))\n"
        "print('[2026-12-07 01:10:54] Load weight begin. ' + 'x' * 1000)\n"
        "print('RuntimeError: out of memory while loading the weights', flush=True)\n"
        "raise SystemExit(3)\n"
    )
    cfg = SGLangServerConfig(model_path="/m", port=free_port(), log_file=str(tmp_path / "crash.log"))
    server = SGLangServer(cfg, command=[sys.executable, str(script)], poll_s=0.1)
    with server, pytest.raises(SGLangStartupError) as e:
        server.wait_healthy(timeout_s=30)
    message = str(e.value)
    assert "out of memory while loading the weights" in message and "Load weight begin" in message
    assert "server_args" not in message and "AWQ" not in message
    assert len(message) < 1000


def test_stopping_a_server_whose_process_died_kills_the_children_it_left(tmp_path):
    """A server killed during start-up (measured: SIGKILL of the launch process of a reward server
    being started): its detokenizer child lived on for the rest of the session, orphaned, after the
    run had stopped. Stopping the server takes its process group, leader dead or not."""
    script = tmp_path / "leader.py"
    pidfile = tmp_path / "child.pid"
    script.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "raise SystemExit(9)\n"
    )
    cfg = SGLangServerConfig(model_path="/m", port=free_port(), log_file=str(tmp_path / "s.log"))
    server = SGLangServer(cfg, command=[sys.executable, str(script)], poll_s=0.1)
    with server, pytest.raises(SGLangStartupError):
        server.wait_healthy(timeout_s=30)
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.05)
    assert not _running(child), "the dead server's child is still running"


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by whoever is PID 1, perhaps late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
