"""The data-parallel flags across nodes (vLLM's spelling): what each node runs, and the combinations that
cannot work refused naming the flag, before anything loads. (Two nodes serving: tests/server/test_dp_multinode.py.)"""
from __future__ import annotations

import pytest

from vllite_core.engine.dp_layout import DEFAULT_RPC_PORT, data_parallel_layout
from vllite_core.entrypoints.cli import build_parser
from vllite_core.entrypoints.cli_serve import _data_parallel
from vllite_core.errors import ConfigError


def test_the_head_and_a_headless_node():
    head = data_parallel_layout(4, 2, address="10.0.0.1", rpc_port=13345)
    assert list(head.local_ranks) == [0, 1] and head.spans_nodes and head.front_end == "tcp://10.0.0.1:13345"
    node = data_parallel_layout(4, 2, start_rank=2, address="10.0.0.1", headless=True)
    assert list(node.local_ranks) == [2, 3] and node.rpc_port == DEFAULT_RPC_PORT == 29550
    assert list(data_parallel_layout(4, start_rank=1, address="h", headless=True).local_ranks) == [1, 2, 3]
    ray_head = data_parallel_layout(2, 1, backend="ray")  # the address: this node's, from the Ray cluster
    assert ray_head.spans_nodes and ray_head.address is None and ray_head.backend == "ray"
    one_node = data_parallel_layout(2)
    assert list(one_node.local_ranks) == [0, 1] and not one_node.spans_nodes
    assert data_parallel_layout(2, 1, address="::1").front_end == f"tcp://[::1]:{DEFAULT_RPC_PORT}"


@pytest.mark.parametrize("kwargs, flag", [
    (dict(size=0), "--data-parallel-size"),
    (dict(size=2, size_local=3), "--data-parallel-size-local"),
    (dict(size=2, size_local=-1), "--data-parallel-size-local"),
    (dict(size=2, start_rank=1, headless=True), "--data-parallel-start-rank needs --data-parallel-address"),
    (dict(size=2, start_rank=1, address="h"), "--data-parallel-start-rank: only a --headless node"),
    (dict(size=2, start_rank=2, address="h", headless=True), "--data-parallel-start-rank"),
    (dict(size=4, size_local=2, start_rank=3, address="h", headless=True), "--data-parallel-start-rank 3 + "),
    (dict(size=2, size_local=1), "needs --data-parallel-address"),
    (dict(size=2, headless=True), "--headless needs --data-parallel-address"),
    (dict(size=2, size_local=0, address="h", headless=True), "--headless: --data-parallel-size-local"),
    (dict(size=2, size_local=1, address="h", rpc_port=70000), "--data-parallel-rpc-port"),
    (dict(size=2, size_local=1, backend="ray", address="h", start_rank=1, headless=True),
     "--data-parallel-backend ray: the API server's node places"),
    (dict(size=2, size_local=1, backend="grpc"), "--data-parallel-backend: 'mp' or 'ray'"),
])
def test_combinations_that_cannot_work_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as e:
        data_parallel_layout(**kwargs)
    assert flag in str(e.value)


def serve_args(*argv: str):
    return build_parser().parse_args(["serve", "--model", "m", *argv])


def test_serve_flags_are_vllms_and_a_headless_node_takes_no_api_server_option():
    ns = serve_args("-dp", "2", "-dpl", "1", "-dpr", "1", "-dpa", "127.0.0.1", "-dpp", "13345", "--headless",
                    "--engine-restart-max", "5")
    dp = _data_parallel(ns)
    assert (dp.size, dp.size_local, dp.start_rank, dp.front_end, dp.headless) == (2, 1, 1, "tcp://127.0.0.1:13345",
                                                                                  True)
    for server_option in (["--port", "9000"], ["--api-key", "k"], ["--served-model-name", "x"]):
        with pytest.raises(SystemExit) as e:
            _data_parallel(serve_args("-dp", "2", "-dpr", "1", "-dpa", "h", "--headless", *server_option))
        assert f"--headless runs no API server: {server_option[0]}" in str(e.value)
    with pytest.raises(SystemExit) as e:
        _data_parallel(serve_args("--data-parallel-size", "2", "--data-parallel-start-rank", "1"))
    assert "vllite serve: --data-parallel-start-rank" in str(e.value)
