"""Launch scripts: shellcheck (or bash -n), #SBATCH headers, and the sbatch logic run against stub
`srun` / `scontrol` / `ray` / `megatron-dapo` commands (repo discovery, readiness wait with the
missing node named, SIGTERM -> checkpoint -> requeue)."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import find_tool

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = sorted([*LAUNCH.rglob("*.sh"), *LAUNCH.rglob("*.sbatch")])
SBATCH = sorted(LAUNCH.rglob("*.sbatch"))


def test_the_scripts_are_there():
    names = {p.relative_to(LAUNCH).as_posix() for p in SCRIPTS}
    assert {
        "slurm/dapo_qwen2.5_32b.sbatch",
        "slurm/retool_qwen2.5_32b.sbatch",
        "slurm/single_node.sbatch",
        "torchrun_multinode.sh",
        "start_sglang_servers.sh",
        "ray_job_submit.sh",
    } <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_shellcheck_or_parse(path):
    shellcheck = find_tool("shellcheck")
    if shellcheck:
        cmd = [shellcheck, "-x", str(path.relative_to(REPO))]
    else:
        cmd = ["bash", "-n", str(path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def sbatch_headers(path: Path) -> dict[str, str]:
    """#SBATCH --key=value lines up to the first command (sbatch stops reading there too)."""
    out = {}
    for line in path.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH"):
            m = re.match(r"#SBATCH\s+--([\w-]+)(?:[= ](.*))?$", line)
            assert m, f"{path.name}: cannot parse {line!r}"
            out[m.group(1)] = (m.group(2) or "").strip()
        elif line.strip() and not line.startswith("#"):
            break
    return out


@pytest.mark.parametrize("path", SBATCH, ids=lambda p: p.name)
def test_sbatch_headers_have_what_a_requeueable_gpu_job_needs(path):
    h = sbatch_headers(path)
    for key in ("nodes", "ntasks-per-node", "time", "requeue", "signal"):
        assert key in h, f"{path.name} lacks #SBATCH --{key}"
    assert "gpus-per-node" in h or "gres" in h
    assert re.fullmatch(r"B:TERM@\d+", h["signal"])
    assert re.fullmatch(r"\d+(-\d+)?(:\d\d){0,2}", h["time"])


def test_32b_template_asks_for_16_nodes_of_8_gpus():
    h = sbatch_headers(LAUNCH / "slurm" / "dapo_qwen2.5_32b.sbatch")
    assert (h["nodes"], h["gpus-per-node"], h["ntasks-per-node"]) == ("16", "8", "1")
    assert sbatch_headers(LAUNCH / "slurm" / "single_node.sbatch")["nodes"] == "1"


STUBS = {
    "scontrol": """
echo "scontrol $*" >>"$FAKE_LOG"
if [[ $1 == show ]]; then for n in $FAKE_NODES; do echo "$n"; done; fi
""",
    "srun": """
echo "srun $*" >>"$FAKE_LOG"
node=""; prev=""
for a in "$@"; do [[ $prev == -w ]] && node=$a; prev=$a; done
case "$*" in
  *hostname*) echo "${FAKE_HOST_IPS:-10.0.0.${node#n}}" ;;
  *"ray start"*) exec sleep 30 ;;
esac
""",
    "ray": """
echo "ray $*" >>"$FAKE_LOG"
case "$1" in
  status) echo " 0.0/${FAKE_GPUS}.0 GPU" ;;
  list) for ip in $FAKE_ALIVE; do echo "- node_ip: $ip"; echo "  state: ALIVE"; done ;;
esac
""",
    "megatron-dapo": """
echo "megatron-dapo $*" >>"$FAKE_LOG"
if [[ -n ${FAKE_REAL_CLI:-} && ( $1 == config || $1 == plan ) ]]; then exec "$FAKE_REAL_CLI" -m megatron_dapo.cli "$@"; fi
if [[ $1 == config && -n ${FAKE_CONFIG_YAML:-} ]]; then cat "$FAKE_CONFIG_YAML"; fi
if [[ $1 == train && -n ${FAKE_TRAIN_SLEEP:-} ]]; then
  trap 'echo "trainer: checkpoint saved" >>"$FAKE_LOG"; exit 0' TERM
  echo "trainer: ready" >>"$FAKE_LOG"
  for _ in $(seq 1 200); do sleep 0.1; done
fi
""",
}


def _env(tmp_path, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        f = bin_dir / name
        f.write_text("#!/bin/bash\n" + body)
        f.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_LOG": str(tmp_path / "log"),
        "SLURM_JOB_ID": "123",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_SUBMIT_DIR": str(REPO / "configs"),  # a subfolder: the script must find the repo above it
        "VENV_DIR": str(tmp_path / "no-venv"),
        "RAY_HEAD_SETTLE_S": "0",
        "RAY_POLL_S": "0.2",
        "HOME": str(tmp_path),
    }
    env.update(extra)
    return env


def _log(tmp_path) -> str:
    return (tmp_path / "log").read_text()


def test_single_node_runs_ray_then_the_trainer_from_the_repo(tmp_path):
    env = _env(tmp_path, FAKE_NODES="n1", FAKE_GPUS="8", FAKE_ALIVE="10.0.0.1")
    script = LAUNCH / "slurm" / "single_node.sbatch"
    r = subprocess.run(
        ["bash", str(script), "configs/dapo_qwen2.5_7b.yaml", "trainer.total_steps=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    log = _log(tmp_path)
    assert "ray start --head --node-ip-address=10.0.0.1 --port=6379" in log
    assert (
        "megatron-dapo train configs/dapo_qwen2.5_7b.yaml trainer.ray_address=10.0.0.1:6379 "
        "trainer.resume=auto trainer.total_steps=3"
    ) in log
    assert "Ray cluster ready: 8/8 GPUs" in r.stderr
    assert "requeue" not in log


def test_readiness_wait_names_the_node_that_did_not_join(tmp_path):
    env = _env(tmp_path, FAKE_NODES="n1 n2", FAKE_GPUS="8", FAKE_ALIVE="10.0.0.1", RAY_WAIT_TIMEOUT_S="1")
    r = subprocess.run(
        ["bash", str(LAUNCH / "slurm" / "dapo_qwen2.5_32b.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "8/16 GPUs" in r.stderr and "did not join: n2 (10.0.0.2)." in r.stderr
    assert "ray start --address=10.0.0.1:6379" in _log(tmp_path)
    assert "megatron-dapo train" not in _log(tmp_path)


def test_retool_template_asks_for_its_recipes_gpus():
    from megatron_dapo.config import load_config

    h = sbatch_headers(LAUNCH / "slurm" / "retool_qwen2.5_32b.sbatch")
    cfg = load_config(REPO / "configs" / "retool_qwen2.5_32b.yaml")
    assert (h["ntasks-per-node"], h["gpus-per-node"]) == ("1", "8")
    assert int(h["nodes"]) * int(h["gpus-per-node"]) == cfg.parallel.actor_world_size == 128
    assert (
        'CONFIG="${CONFIG:-configs/retool_qwen2.5_32b.yaml}"'
        in (LAUNCH / "slurm" / "retool_qwen2.5_32b.sbatch").read_text()
    )


def _resolved(tmp_path, *overrides: str) -> str:
    """What `megatron-dapo config` prints for the retool recipe, for the stub to print."""
    from megatron_dapo.config import load_config, to_yaml

    f = tmp_path / "resolved.yaml"
    f.write_text(to_yaml(load_config(REPO / "configs" / "retool_qwen2.5_32b.yaml", list(overrides))))
    return str(f)


def _run_retool(tmp_path, **extra) -> subprocess.CompletedProcess:
    env = _env(tmp_path, FAKE_NODES="n1", FAKE_GPUS="8", FAKE_ALIVE="10.0.0.1", **extra)
    return subprocess.run(
        ["bash", str(LAUNCH / "slurm" / "retool_qwen2.5_32b.sbatch"), "trainer.total_steps=3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_retool_job_checks_the_tool_host_then_trains_the_recipe(tmp_path):
    # the tools run on the head node: its YAML is found there and the cores are counted
    r = _run_retool(
        tmp_path,
        FAKE_CONFIG_YAML=_resolved(tmp_path, "rollout.multi_turn.tool_workers=1"),
        TOOL_CPU_RESERVE="0",
    )
    assert r.returncode == 0, r.stderr
    tools = str(REPO / "configs" / "tools" / "python_sandbox.yaml")
    assert "tools run here: rollout.multi_turn.tool_workers=1," in r.stderr and tools in r.stderr
    assert "WARNING: rollout.multi_turn.tool_workers" not in r.stderr
    assert (
        "megatron-dapo train configs/retool_qwen2.5_32b.yaml trainer.ray_address=10.0.0.1:6379 "
        "trainer.resume=auto trainer.total_steps=3"
    ) in _log(tmp_path)
    # more tool workers than the node has cores: a warning naming the setting that fits
    (tmp_path / "log").unlink()
    cores = len(os.sched_getaffinity(0))
    r = _run_retool(tmp_path, FAKE_CONFIG_YAML=_resolved(tmp_path), TOOL_CPU_RESERVE=str(cores))
    assert r.returncode == 0, r.stderr
    assert f"WARNING: rollout.multi_turn.tool_workers=96 + {cores} for this node's GPU work" in r.stderr
    assert "set rollout.multi_turn.tool_workers=1 " in r.stderr


def test_retool_job_stops_before_ray_when_the_tool_yaml_is_missing(tmp_path):
    missing = tmp_path / "no" / "tools.yaml"
    resolved = _resolved(tmp_path, f"rollout.multi_turn.tool_config_path={missing}")
    r = _run_retool(tmp_path, FAKE_CONFIG_YAML=resolved)
    assert r.returncode != 0
    assert f"rollout.multi_turn.tool_config_path={missing} is not a file on the head node" in r.stderr
    assert "ray start" not in _log(tmp_path) and "megatron-dapo train" not in _log(tmp_path)


def test_sigterm_checkpoints_then_requeues(tmp_path):
    env = _env(tmp_path, FAKE_NODES="n1", FAKE_GPUS="8", FAKE_ALIVE="10.0.0.1", FAKE_TRAIN_SLEEP="1")
    proc = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm" / "single_node.sbatch")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # the stub trainer says "ready" once its TERM trap is set: signal only then
        deadline = time.monotonic() + 120
        while "trainer: ready" not in (_log(tmp_path) if (tmp_path / "log").exists() else ""):
            assert proc.poll() is None, "the job script ended before the trainer started"
            assert time.monotonic() < deadline, "trainer never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    log = _log(tmp_path)
    assert log.index("trainer: checkpoint saved") < log.index("scontrol requeue 123")
    assert "configs/dapo_qwen2.5_1.5b_1node.yaml" in log


def _stub(bin_dir: Path, name: str, body: str = 'echo "$0 $*" >>"$FAKE_LOG"') -> None:
    f = bin_dir / name
    f.write_text(f"#!/bin/bash\n{body}\n")
    f.chmod(0o755)


def test_torchrun_script_passes_the_rendezvous_flags(tmp_path):
    (tmp_path / "bin").mkdir()
    _stub(tmp_path / "bin", "torchrun", 'echo "torchrun $*" >>"$FAKE_LOG"')
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "FAKE_LOG": str(tmp_path / "log"),
        "NNODES": "2",
        "NPROC_PER_NODE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "RDZV_ID": "job7",
        "VENV_DIR": str(tmp_path / "none"),
    }
    r = subprocess.run(
        ["bash", str(LAUNCH / "torchrun_multinode.sh"), "configs/dapo_qwen2.5_7b.yaml", "a.b=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert _log(tmp_path).strip() == (
        "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 "
        "--rdzv-id job7 -m megatron_dapo.train configs/dapo_qwen2.5_7b.yaml trainer.resume=auto a.b=1"
    )


def _dry_run(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "NNODES": "2", "NPROC_PER_NODE": "4", "MASTER_ADDR": "10.0.0.1",
            "RDZV_ID": "job7", "VENV_DIR": str(tmp_path / "none"), "DRY_RUN": "1"}  # fmt: skip
    return subprocess.run(
        ["bash", str(LAUNCH / "torchrun_multinode.sh"), "configs/dapo_qwen2.5_7b.yaml", *args],
        cwd=tmp_path,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_torchrun_script_start_sglang_leaves_the_servers_to_the_trainer(tmp_path):
    # the trainer starts every node's servers itself: the script starts none and passes no URLs,
    # only the knobs that were set, as overrides (before: it ran start_sglang_servers.sh and
    # nvidia-smi, and handed the trainer URLs of servers it could not restart)
    (tmp_path / "bin").mkdir()
    r = _dry_run(tmp_path, "trainer.placement=disaggregated", START_SGLANG="1", SGLANG_TP="2",
                 SGLANG_BASE_PORT="31000", SGLANG_FIRST_GPU="4")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 "
        "--rdzv-id job7 -m megatron_dapo.train configs/dapo_qwen2.5_7b.yaml trainer.resume=auto "
        "trainer.placement=disaggregated rollout.tensor_parallel_size=2 rollout.sglang.base_port=31000"
    )
    # given URLs are passed as they are
    r = _dry_run(tmp_path, "rollout.sglang.urls=[http://h:30000]")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("rollout.sglang.urls=[http://h:30000]"), r


def test_torchrun_script_refuses_knobs_it_cannot_honour(tmp_path):
    r = _dry_run(tmp_path, "rollout.sglang.urls=[http://h:30000]", START_SGLANG="1")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "START_SGLANG=1 and rollout.sglang.urls" in r.stderr
    r = _dry_run(tmp_path, SGLANG_FIRST_GPU="6")  # the plan puts engines after the actor's 4 GPUs
    assert r.returncode == 2 and "SGLANG_FIRST_GPU=6" in r.stderr and "unset SGLANG_FIRST_GPU" in r.stderr


def test_ray_job_submit_uploads_the_repo_and_runs_train(tmp_path):
    (tmp_path / "bin").mkdir()
    _stub(tmp_path / "bin", "ray", 'echo "ray $*  [cwd=$PWD]" >>"$FAKE_LOG"')
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "FAKE_LOG": str(tmp_path / "log"),
        "RAY_ADDRESS": "http://10.0.0.1:8265",
        "JOB_ID": "j1",
    }
    r = subprocess.run(
        ["bash", str(LAUNCH / "ray_job_submit.sh"), "configs/dapo_qwen2.5_32b.yaml", "x=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    log = _log(tmp_path)
    assert log.startswith("ray job submit --address http://10.0.0.1:8265 --submission-id j1 --working-dir . ")
    assert "-- megatron-dapo train configs/dapo_qwen2.5_32b.yaml x=1 trainer.ray_address=auto" in log
    assert f"[cwd={REPO}]" in log


def test_a_loopback_head_address_stops_the_job_naming_the_fix(tmp_path):
    # Debian/Ubuntu: `hostname --ip-address` gives 127.0.1.1 first; a real address after it is used
    env = _env(
        tmp_path, FAKE_NODES="n1", FAKE_GPUS="8", FAKE_ALIVE="10.0.0.1", FAKE_HOST_IPS="127.0.1.1 10.0.0.9"
    )
    r = subprocess.run(["bash", str(LAUNCH / "slurm" / "single_node.sbatch")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "ray start --head --node-ip-address=10.0.0.9 " in _log(tmp_path)
    # only loopback: one line with the fix, and no Ray
    (tmp_path / "log").unlink()
    env["FAKE_HOST_IPS"] = "127.0.1.1"
    r = subprocess.run(["bash", str(LAUNCH / "slurm" / "single_node.sbatch")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "resolves its host name only to loopback (127.0.1.1)" in errors[0]
    assert "RAY_NODE_IP_CMD" in errors[0]
    assert "ray start" not in _log(tmp_path) and "megatron-dapo train" not in _log(tmp_path)


QWEN25_32B = {  # Qwen/Qwen2.5-32B's config.json, the fields the checks read
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
    "intermediate_size": 27648, "num_attention_heads": 40, "num_key_value_heads": 8,
    "num_hidden_layers": 64, "vocab_size": 152064, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
}  # fmt: skip


@pytest.fixture(scope="module")
def recipe_inputs(tmp_path_factory) -> list[str]:
    """Overrides giving the 32B recipe inputs that pass the pre-check: a directory with the 32B
    config.json, a one-tensor safetensors file and a tokenizer file; data files."""
    import json

    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("recipe")
    model = root / "Qwen2.5-32B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_32B))
    save_file({"lm_head.weight": torch.zeros(1)}, str(model / "model.safetensors"))
    (model / "tokenizer.json").write_text("{}")
    data = root / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    return [f"model.path={model}", f"data.train_files=[{data}]", f"data.val_files=[{data}]"]


@pytest.mark.parametrize("nodes", [1, 4, 16])
def test_the_32b_job_is_sized_to_its_allocation_before_ray_starts(tmp_path, recipe_inputs, nodes):
    import sys

    names = " ".join(f"n{i}" for i in range(1, nodes + 1))
    ips = " ".join(f"10.0.0.{i}" for i in range(1, nodes + 1))
    env = _env(tmp_path, FAKE_NODES=names, FAKE_GPUS=str(8 * nodes), FAKE_ALIVE=ips,
               FAKE_REAL_CLI=sys.executable, PYTHONPATH=str(REPO))  # fmt: skip
    script = str(LAUNCH / "slurm" / "dapo_qwen2.5_32b.sbatch")
    r = subprocess.run(["bash", script, *recipe_inputs], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    log = _log(tmp_path)
    if nodes == 16:  # the recipe's own allocation: trains as it is
        assert r.returncode == 0, r.stderr
        assert "Ray cluster ready: 128/128 GPUs" in r.stderr and "megatron-dapo train" in log
        return
    # another allocation: one line naming both numbers and the overrides, and nothing started
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith(("[launch", " "))]  # fmt: skip
    assert len(lines) == 1, r.stderr
    assert (
        f"places 128 GPUs (parallel.actor_world_size=128, trainer.placement=colocated) but the allocation has {8 * nodes}"
        in lines[0]
    )
    assert "ray start" not in log and "megatron-dapo train" not in log
    if nodes == 4:
        assert (
            "add parallel.actor_world_size=32 rollout.sglang.mem_fraction_static=0.65 rollout.num_engines=8"
            in lines[0]
        )
        # RESIZE=1: the job applies them, and trains the resized layout on the 32 GPUs
        (tmp_path / "log").unlink()
        r = subprocess.run(["bash", script, *recipe_inputs], cwd=tmp_path, env={**env, "RESIZE": "1"},
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "Ray cluster ready: 32/32 GPUs" in r.stderr
        train = next(line for line in _log(tmp_path).splitlines() if line.startswith("megatron-dapo train"))
        assert train.endswith(
            "parallel.actor_world_size=32 rollout.sglang.mem_fraction_static=0.65 rollout.num_engines=8"
        )
    else:
        assert "the planner found no complete fix" in lines[0]


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_with_a_container_the_driver_runs_in_it_too(tmp_path, runtime):
    # before: config and train ran in the batch shell, outside the image the Ray nodes ran in
    env = _env(tmp_path, FAKE_NODES="n1 n2", FAKE_GPUS="16", FAKE_ALIVE="10.0.0.1 10.0.0.2",
               CONTAINER_IMAGE="/img/dapo.sqsh", CONTAINER_RUNTIME=runtime, CONTAINER_MOUNTS="/shared:/shared")  # fmt: skip
    r = subprocess.run(["bash", str(LAUNCH / "slurm" / "dapo_qwen2.5_32b.sbatch"), "trainer.total_steps=3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    steps = [line for line in _log(tmp_path).splitlines() if line.startswith("srun ")]
    flags = (
        f"--container-image=/img/dapo.sqsh --container-workdir={REPO} --container-mounts=/shared:/shared"
        if runtime == "pyxis"
        else f"apptainer exec --nv --pwd {REPO} /img/dapo.sqsh"
    )
    driver = f"srun --nodes=1 --ntasks=1 --overlap -w n1 {flags} megatron-dapo "
    assert any(
        s.startswith(driver + "config configs/dapo_qwen2.5_32b.yaml trainer.total_steps=3 --num-gpus 16")
        for s in steps
    )
    assert any(
        s.startswith(driver + "train configs/dapo_qwen2.5_32b.yaml trainer.ray_address=10.0.0.1:6379")
        for s in steps
    )
    for node in ("n1", "n2"):
        ray = next(s for s in steps if f"-w {node} " in s and "ray start" in s)
        assert flags in ray
