"""Colocated offload: parameters can leave only when megatron keeps them in a contiguous buffer
(the distributed optimizer); otherwise the offload is refused instead of freeing nothing."""

from __future__ import annotations

import pytest

from megatron_dapo.actor.offload import check_params_offloadable, offload_actor, onload_actor


class _Buffer:
    def __init__(self, param_data):
        self.param_data = param_data
        self.calls = []

    def offload_to_cpu(self, move_params, move_grads):
        self.calls.append(("offload", move_params, move_grads))

    def reload_from_cpu(self, move_params, move_grads):
        self.calls.append(("reload", move_params, move_grads))


class _Chunk:
    def __init__(self, buffers):
        self.buffers = buffers
        self.expert_parallel_buffers = []
        self.calls = []

    def offload_grad_buffers(self, synchronize, empty_cache):
        self.calls.append("grads_out")

    def restore_grad_buffers(self, synchronize):
        self.calls.append("grads_in")


class _Optimizer:
    def __init__(self):
        self.calls = []

    def offload_to_cpu(self):
        self.calls.append("out")

    def restore_from_cpu(self):
        self.calls.append("in")


def test_params_without_contiguous_buffer_are_refused():
    # What megatron-core 0.16 builds with use_distributed_optimizer=False: param_data is None.
    chunk, opt = _Chunk([_Buffer(None)]), _Optimizer()
    with pytest.raises(ValueError, match="use_distributed_optimizer=true"):
        offload_actor([chunk], opt, params=True)
    assert chunk.calls == [] and opt.calls == []  # nothing half-done


def test_grads_and_optimizer_offload_without_distributed_optimizer():
    buf = _Buffer(None)
    chunk, opt = _Chunk([buf]), _Optimizer()
    offload_actor([chunk], opt, params=False)
    assert chunk.calls == ["grads_out"] and opt.calls == ["out"] and buf.calls == []


def test_round_trip_with_param_buffer():
    buf = _Buffer(object())
    chunk, opt = _Chunk([buf]), _Optimizer()
    check_params_offloadable([chunk])
    offload_actor([chunk], opt, params=True)
    onload_actor([chunk], opt)
    assert buf.calls == [("offload", True, False), ("reload", True, False)]
    assert chunk.calls == ["grads_out", "grads_in"] and opt.calls == ["out", "in"]
