"""A config that needs Transformer Engine where it is missing or broken: one line naming the cause; with
transformer_impl=auto a broken install is a warning, never a silent fall-back."""

import logging
import sys

import pytest
import torch

from dapo_mcore.mcore.provider import resolve_transformer_impl
from dapo_mcore.utils.errors import ConfigError

BROKEN = "libtransformer_engine.so: undefined symbol: cudaGetDriverEntryPointByVersion"


@pytest.fixture
def broken_te(tmp_path, monkeypatch):
    """A transformer_engine package that is installed (found on sys.path) but fails to import."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n.startswith("transformer_engine")]:
        del sys.modules[name]


@pytest.fixture
def missing_te(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else find_spec(name, *a)
    )


@pytest.mark.parametrize(
    "choice, fp8", [("transformer_engine", "none"), ("auto", "e4m3"), ("transformer_engine", "hybrid")]
)
def test_a_config_that_needs_it_stops_with_the_import_error(broken_te, choice, fp8):
    with pytest.raises(ConfigError, match="does not import: ImportError: libtransformer_engine.so: undefined symbol"):
        resolve_transformer_impl(choice, on_cpu=False, fp8=fp8)


def test_a_missing_install_is_named_with_how_to_get_it(missing_te):
    with pytest.raises(ConfigError, match=r"model.transformer_impl=transformer_engine needs Transformer Engine: "
                                          r"transformer_engine is not installed \(pip install"):  # fmt: skip
        resolve_transformer_impl("transformer_engine", on_cpu=False)


def test_auto_with_a_broken_install_warns_with_the_cause_and_uses_local_layers(broken_te, caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_transformer_impl("auto", on_cpu=False) is False
    assert any(BROKEN in r.getMessage() and "local layers" in r.getMessage() for r in caplog.records)


def test_auto_without_an_install_uses_local_layers_quietly(missing_te, caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_transformer_impl("auto", on_cpu=False) is False
    assert not caplog.records


def test_on_the_cpu_asking_for_it_is_refused_and_auto_is_local():
    with pytest.raises(ConfigError, match="needs CUDA"):
        resolve_transformer_impl("transformer_engine", on_cpu=True)
    assert resolve_transformer_impl("auto", on_cpu=True) is False


def test_the_local_spec_builds_no_transformer_engine_norm_when_te_imports(monkeypatch):
    """Megatron takes a block's final norm from its LayerNormImpl, which is TE's norm whenever TE imports, even
    for the local spec: CPU mode then failed on a machine with TE installed (first H100 run). Stand in for TE's
    norm with a class that must never be built."""
    import megatron.core.transformer.transformer_block as block

    from dapo_mcore.config.model_spec import read_model_spec
    from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config
    from dapo_mcore.parallel import destroy_parallel, init_parallel
    from tests.helpers import tiny_hf_config

    class TransformerEngineNorm(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError("the local spec built Transformer Engine's norm")

    monkeypatch.setattr(block, "LayerNormImpl", TransformerEngineNorm)
    spec = read_model_spec(tiny_hf_config("llama").to_dict())
    ctx = init_parallel(1, 1, "cpu")
    try:
        config = build_transformer_config(spec, tp=1, pp=1, dtype="float32", on_cpu=True, use_te=False)
        (model,) = build_gpt_chunks(spec, config, ctx=ctx, use_te=False)
    finally:
        destroy_parallel()
    # the block's final norm is the local spec's own, like the layers' norms (LNImpl: apex's or torch's)
    assert type(model.decoder.final_layernorm) is type(model.decoder.layers[0].input_layernorm)


def test_cpu_offload_without_it_is_one_line_naming_the_cause(missing_te):
    """Megatron's precision-aware optimizer (optimizer.cpu_offload's path) failed with a TypeError deep in its config
    without TE (seen on an H200); `train` and `check` now name the cause first."""
    from dapo_mcore.mcore.provider import cpu_offload_problem

    problem = cpu_offload_problem(on_cpu=False)
    assert problem.startswith("optimizer.cpu_offload (Megatron's precision-aware optimizer) needs Transformer Engine: ")
    assert "transformer_engine is not installed" in problem
    assert cpu_offload_problem(on_cpu=True).startswith("optimizer.cpu_offload needs a GPU")
