"""The torch.distributed facade: launcher environment, device choice, sharding, one-process contexts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bastion.contract.errors import InvalidInputError
from bastion.distributed import DistContext, env_ranks, gather_objects, resolve_device, setup, shard, teardown


def test_env_ranks_reads_torchrun_variables_and_defaults_to_one_process() -> None:
    assert env_ranks({}) == (0, 1, 0)
    assert env_ranks({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4, 1)


@pytest.mark.parametrize("env", [{"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "0"}, {"RANK": "x"}])
def test_env_ranks_rejects_an_inconsistent_environment(env: dict[str, str]) -> None:
    with pytest.raises(InvalidInputError):
        env_ranks(env)


def test_one_process_setup_starts_no_process_group() -> None:
    ctx = setup("cpu", environ={})
    assert ctx == DistContext() and ctx.is_main and not ctx.distributed
    assert not torch.distributed.is_initialized()
    assert gather_objects({"a": 1}, ctx) == [{"a": 1}]
    teardown(ctx)


def test_cpu_device_is_kept_and_cuda_without_gpu_is_a_clear_error() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(InvalidInputError, match="CUDA"):
            resolve_device("cuda", 1)


@given(n=st.integers(0, 40), world=st.integers(1, 6))
def test_shards_partition_the_items_in_round_robin(n: int, world: int) -> None:
    items = list(range(n))
    parts = [shard(items, DistContext(rank=r, world_size=world)) for r in range(world)]
    assert sorted(x for p in parts for x in p) == items
    assert all(x % world == r for r, p in enumerate(parts) for x in p)


def _recording_dist(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import bastion.distributed as bd

    calls: list[str] = []
    monkeypatch.setattr(bd.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(bd.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(bd.dist, "destroy_process_group", lambda: calls.append("destroy"))
    return calls


def test_teardown_meets_the_other_ranks_before_destroying_the_group_on_a_normal_exit(monkeypatch) -> None:
    calls = _recording_dist(monkeypatch)
    teardown(DistContext(0, 2, 0, torch.device("cpu"), "gloo"))
    assert calls == ["barrier", "destroy"]


def test_teardown_during_an_exception_leaves_at_once_without_waiting_for_the_others(monkeypatch) -> None:
    calls = _recording_dist(monkeypatch)
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("this rank failed")
        finally:
            teardown(DistContext(1, 2, 1, torch.device("cpu"), "gloo"))
    assert calls == ["destroy"]


def test_a_rank_of_a_multi_process_launch_exits_without_the_interpreters_final_clean_up(monkeypatch) -> None:
    import bastion.__main__ as entry

    class Left(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Left(code)

    monkeypatch.setattr(entry.os, "_exit", fake_exit)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Left) as left:
        entry._exit(3)
    assert left.value.args == (3,)
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: the usual exit, clean-up included
    with pytest.raises(SystemExit) as done:
        entry._exit(0)
    assert done.value.code == 0
