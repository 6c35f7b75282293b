"""`ServerArgs.from_kwargs`: `model=` is SGLang's alias of `model_path`, and never hides it."""

from __future__ import annotations

import pytest

from arborlm.entrypoints.engine import Engine
from arborlm.runtime.config import ServerArgs, ignored_options


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"model": None, "model_path": "/ckpt"}, "/ckpt"),  # Engine(model_path=...) passes model=None too
    ({"model": "/ckpt"}, "/ckpt"),
    ({"model_path": "/ckpt"}, "/ckpt"),
    ({"model": "/ckpt", "model_path": "/ckpt"}, "/ckpt"),
    ({"model": None}, None),
    ({}, None),
])
def test_model_alias(kwargs, expected):
    assert ServerArgs.from_kwargs(**kwargs).model.model_path == expected


def test_model_and_model_path_that_differ_are_refused():
    with pytest.raises(TypeError, match="model='/a' and model_path='/b'"):
        ServerArgs.from_kwargs(model="/a", model_path="/b")


def test_engine_model_path_keyword_is_the_checkpoint_loaded(tmp_path):
    # SGLang's programs write sgl.Engine(model_path=...): a missing folder must fail, not load the default.
    from arborlm.errors import ModelLoadError

    with pytest.raises((ModelLoadError, ValueError, OSError)):
        Engine(model_path=str(tmp_path / "no-such-model"))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"router_policy": "round_robin"}, ["router_policy='round_robin' is ignored: it needs dp_size > 1 (--dp-size)"]),
        ({"router_policy": "round_robin", "dp_size": 2}, []),
        ({"hicache_size": 4}, ["hicache_size=4 is ignored: it needs enable_hierarchical_cache "
                               "(--enable-hierarchical-cache)"]),
        ({"hicache_ratio": 3.0, "hicache_storage_backend": "file"},
         ["hicache_ratio=3.0 is ignored: it needs enable_hierarchical_cache (--enable-hierarchical-cache)",
          "hicache_storage_backend='file' is ignored: it needs enable_hierarchical_cache "
          "(--enable-hierarchical-cache)"]),
        ({"hicache_size": 4, "enable_hierarchical_cache": True}, []),
        ({}, []),
    ],
)
def test_options_without_the_option_they_need_are_named(kwargs, expected):
    assert ignored_options(ServerArgs.from_kwargs(**kwargs)) == expected


def test_router_balance_options_reach_sglang_router():
    # sglang-router's RouterArgs takes them under its own names (no `router_` prefix).
    from sglang_router.router_args import RouterArgs

    from arborlm.entrypoints.data_parallel import router_kwargs, worker_specs

    args = ServerArgs.from_kwargs(dp_size=2, router_cache_threshold=0.5, router_balance_abs_threshold=2,
                                  router_balance_rel_threshold=1.2)
    kwargs = router_kwargs(args, worker_specs(args, [31001, 31002]), metrics_port=31003)
    router = RouterArgs(**kwargs)
    assert (router.cache_threshold, router.balance_abs_threshold, router.balance_rel_threshold) == (0.5, 2, 1.2)
    assert ignored_options(ServerArgs.from_kwargs(router_balance_abs_threshold=2)) == [
        "router_balance_abs_threshold=2 is ignored: it needs dp_size > 1 (--dp-size)"]


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"router_cache_threshold": 1.5}, ValueError),
    ({"router_balance_abs_threshold": -1}, ValueError),
    ({"router_balance_rel_threshold": 0.5}, ValueError),
    ({"router_balance_abs_threshold": "2"}, TypeError),
])
def test_bad_router_balance_options_are_refused_by_name(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        ServerArgs.from_kwargs(**kwargs)
