"""Training ranks as Ray actors form one torch.distributed world (gloo), and a failing or slow
rank surfaces as an error naming the method instead of a hang."""

import os
import time

import pytest
import ray  # a hard dependency: a missing Ray fails the suite instead of skipping it

from megatron_dapo.driver.rank_group import RankCallError, RayRankGroup


class SumWorker:
    def setup(self):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return int(os.environ["RANK"])

    def all_reduce(self, value):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value) * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    def fail_on_rank1(self):
        if int(os.environ["RANK"]) == 1:
            raise ValueError("rank one is broken")
        return 0

    def sleep(self, s):
        time.sleep(s)


@pytest.fixture(scope="module")
def ray_local():
    # workers import this test module by name
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    ray.init(
        address="local",  # never join a cluster another process left running on this machine
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
        runtime_env={"env_vars": env},
    )
    yield
    ray.shutdown()


def test_ray_ranks_form_a_world_and_report_errors(ray_local):
    from ray.util.placement_group import placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready())
    group = RayRankGroup(SumWorker, 2, placement_group=pg)
    assert group.call("setup") == [0, 1]
    assert group.call("all_reduce", 2.0) == [6.0, 6.0]  # 2*1 + 2*2
    with pytest.raises(
        RankCallError, match="fail_on_rank1 failed on 1 rank.*rank 1: ValueError: rank one is broken"
    ):
        group.call("fail_on_rank1")
    with pytest.raises(RankCallError, match=r"sleep: ranks \[0, 1\] did not finish within 1s"):
        group.call("sleep", 5, timeout_s=1)
    group.shutdown()


def _spmd_main(rank, world_size):
    import torch.distributed as dist

    from megatron_dapo.driver.rank_group import SPMDRankGroup

    dist.init_process_group("gloo")
    worker = SumWorker()
    if rank == 0:
        group = SPMDRankGroup(worker)
        out = group.call("all_reduce", 3.0)
        group.shutdown()
        return out
    SPMDRankGroup.follow(worker)
    return "followed"


def test_spmd_group_under_torchrun_style_world():
    from megatron_dapo.actor.spawn import run_ranks

    assert run_ranks(_spmd_main, 2, timeout_s=120) == [[9.0, 9.0], "followed"]


class SlowEngineHost:
    """Takes the update start, then never finishes taking bucket 1."""

    def begin_weight_update(self, version):
        return version

    def receive_bucket(self, index, bucket):
        if index == 1:
            time.sleep(30)
        return index

    def finish_weight_update(self):
        return 0

    def generate(self, requests):
        raise RuntimeError("CUDA error: device-side assert")

    def generate_each(self, requests):
        from megatron_dapo.rollout.types import GenerationResult

        yield ("some", [GenerationResult("r0", [1], [-0.5], "stop", 0)])
        raise RuntimeError("CUDA error: device-side assert")


def test_weight_sync_timeout_and_engine_failure_name_the_engine(ray_local):
    import torch

    from megatron_dapo.driver.engine_host import RemoteEngine
    from megatron_dapo.rollout.engine import EngineError
    from megatron_dapo.sync.protocol import WeightSyncTimeoutError
    from megatron_dapo.sync.transports import RayObjectTransport

    handle = ray.remote(SlowEngineHost).options(num_cpus=0, max_concurrency=2).remote()
    ray.get(handle.begin_weight_update.remote(0))  # the actor is up before deadlines start
    # the calls that must succeed get a deadline no load reaches (2 s once failed bucket 0 under
    # make test); the one that must time out gets 2 s
    transport = RayObjectTransport([("hf-7", handle)], timeout_s=120)
    transport.begin(3)
    transport.send(0, {"model.embed_tokens.weight": torch.zeros(4, 2)})
    transport.timeout_s = 2
    start = time.monotonic()
    with pytest.raises(
        WeightSyncTimeoutError, match=r"engine hf-7 did not take bucket 1 \(1 tensors.*lm_head.weight"
    ):
        transport.send(1, {"lm_head.weight": torch.zeros(4, 2)})
    # well short of the host's 30 s hang (a loaded machine stretches the 2 s deadline, not the hang)
    assert time.monotonic() - start < 20
    with pytest.raises(EngineError, match="engine hf-7: generate .* failed: .*device-side assert"):
        RemoteEngine("hf-7", handle, timeout_s=10).generate([])
    handed = []  # streamed: what came before the failure was handed over, then the same error
    with pytest.raises(EngineError, match="engine hf-7: generate .* failed: .*device-side assert"):
        RemoteEngine("hf-7", handle, timeout_s=10).generate([], on_result=handed.append)
    assert [r.request_id for r in handed] == ["r0"]
    ray.kill(handle)
    from ray.exceptions import RayActorError

    for _ in range(100):  # ray.kill is asynchronous: wait until the actor is really gone
        try:
            ray.get(handle.begin_weight_update.remote(0), timeout=5)
        except RayActorError:
            break
        time.sleep(0.1)
    with pytest.raises(EngineError, match="engine hf-7 died during generate"):
        RemoteEngine("hf-7", handle, timeout_s=10).generate([])
    with pytest.raises(EngineError, match="engine hf-7 died during generate"):
        RemoteEngine("hf-7", handle, timeout_s=10).generate([], on_result=handed.append)


def test_a_ray_hosted_engine_streams_each_result_as_its_row_stops(ray_local, tiny_hf_checkpoint):
    """``RemoteEngine.generate(..., on_result)`` reads the host's stream: each row's result reaches
    the driver in the order the rows stop (shortest budget first), and the call's results equal
    an unstreamed call's."""
    from megatron_dapo.driver.engine_host import EngineHost, RemoteEngine
    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams

    handle = (
        ray.remote(EngineHost)
        .options(num_cpus=0, max_concurrency=4)
        .remote(str(tiny_hf_checkpoint()), "hf-0", 0)
    )
    engine = RemoteEngine("hf-0", handle, timeout_s=120)
    reqs = [
        GenerationRequest(f"r{i}", [5 + i] * 3, SamplingParams(0.9, max_new_tokens=k, seed=100 + i))
        for i, k in enumerate([6, 2, 9, 4])
    ]
    handed = []
    results = engine.generate(reqs, on_result=handed.append)
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]
    assert [len(r.output_ids) for r in results] == [6, 2, 9, 4]  # each row ran to its budget
    by_length = sorted(results, key=lambda r: len(r.output_ids))
    assert [(r.request_id, r.output_ids) for r in handed] == [(r.request_id, r.output_ids) for r in by_length]
    plain = engine.generate(reqs)
    assert [(r.output_ids, r.logprobs, r.finish_reason) for r in results] == [
        (r.output_ids, r.logprobs, r.finish_reason) for r in plain
    ]
    ray.kill(handle)


GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:56495: "
    "Connection reset by peer"
)


def test_a_reset_read_before_the_killed_peer_shows_as_dead_still_names_it():
    """The race behind a flaky one-line check: rank 1 is SIGKILLed, rank 0's collective reads the
    reset while rank 1 still shows as running; the failure must still name the dead rank."""
    import socket
    import subprocess
    import sys

    from megatron_dapo.driver.rank_failures import dead_peers, dead_peers_after_failure

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    peers = [(socket.gethostname(), os.getpid()), (socket.gethostname(), child.pid)]
    polls = []

    def poll(p):
        polls.append(1)
        if len(polls) == 1:  # the reset arrives first; the kill lands only after this look
            found = dead_peers(p)
            child.kill()
            return found
        return dead_peers(p)

    try:
        assert dead_peers_after_failure(peers, RuntimeError(GLOO_RESET), poll=poll) == [(1, child.pid)]
        assert len(polls) >= 2
        # rank 0's own error (not a dropped connection) is raised at once, without waiting
        polls.clear()
        assert dead_peers_after_failure(peers[:1], ValueError("bad batch"), poll=poll) == []
        assert len(polls) == 1
    finally:
        child.kill()
        child.wait()


def test_a_stop_with_a_dead_peer_is_reported_as_its_death():
    """torchrun's agent SIGTERMs rank 0 when rank 1 dies: rank 0 may stop cleanly (a preemption,
    as it sees it) before any collective shows the death (seen in CI: the run then failed in the
    export with no resume hint). The driver names the dead rank and where a resume continues."""
    import socket
    import subprocess
    import sys
    from types import SimpleNamespace

    from megatron_dapo.driver.launch import _fail_if_a_rank_died

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    host = socket.gethostname()
    trainer = SimpleNamespace(
        state=SimpleNamespace(step=1), last_checkpoint=lambda: "/runs/r/checkpoints/step_00000001"
    )
    alive = SimpleNamespace(peers=[(host, os.getpid())])
    _fail_if_a_rank_died(alive, trainer)  # nobody died: the stop stands
    _fail_if_a_rank_died(SimpleNamespace(), trainer)  # the Ray path has no peers to look at
    with pytest.raises(RankCallError) as err:
        _fail_if_a_rank_died(SimpleNamespace(peers=[(host, os.getpid()), (host, child.pid)]), trainer)
    assert f"training rank 1 (pid {child.pid}) died during step 2" in str(err.value)
    assert err.value.megatron_dapo_context == (
        "after step 1; trainer.resume=auto continues from /runs/r/checkpoints/step_00000001"
    )


def test_the_hosts_stream_raises_the_engines_error_after_what_it_handed_over():
    from megatron_dapo.driver.engine_host import EngineHost
    from megatron_dapo.rollout.types import GenerationResult

    first = GenerationResult("r0", [1], [-0.5], "stop", 0)

    class Failing:
        name = "hf-0"

        def generate(self, requests, on_result=None):
            on_result(first)
            raise RuntimeError("CUDA error: device-side assert")

    host = EngineHost.__new__(EngineHost)  # the stream only, without loading a model
    host.engine = Failing()
    stream = host.generate_each([])
    assert next(stream) == ("some", [first])
    with pytest.raises(RuntimeError, match="device-side assert"):
        next(stream)
