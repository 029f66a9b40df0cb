"""The adapters' framework versions: the extras accept ranges (pyproject.toml), the test
set-up installs exactly the tested versions (scripts/setup_env.sh), and importing an adapter
warns on a version outside the supported range (naming the tested versions) and raises a
clear error where a private method it overrides has other parameters."""

import importlib.metadata
import importlib.util
import re
import sys
import warnings
from pathlib import Path

import pytest

import dlion.integrations
from dlion.integrations import SUPPORTED_VERSIONS, TESTED_VERSIONS
from dlion.integrations import _common
from integrations_support import need

ROOT = Path(__file__).resolve().parents[1]
TESTED = "transformers==5.23.0, accelerate==1.15.0, lightning==2.6.6"


def fake_versions(monkeypatch, **versions):
    """importlib.metadata.version answers ``versions`` for those packages, the truth otherwise."""
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions.get(name) or real(name))
    monkeypatch.setattr(_common, "_warned", set())  # each test sees its own first warning


def import_adapter(name: str):
    """Execute ``dlion/integrations/<name>.py`` as a fresh module (its import-time checks run
    again) without replacing the one in sys.modules."""
    path = Path(dlion.integrations.__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"dlion.integrations._probe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extras_accept_the_supported_ranges_and_the_test_setup_pins_the_tested_versions():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    want = {k: f"{k}>={low},<{high}" for k, (low, high) in SUPPORTED_VERSIONS.items()}
    assert extras["hf"] == [want["transformers"], want["accelerate"]]
    assert extras["lightning"] == [want["lightning"]]
    assert not any("==" in r for r in extras["hf"] + extras["lightning"])  # no exact pins for users
    pins = re.search(r"^PINS=\((.*)\)$", (ROOT / "scripts" / "setup_env.sh").read_text(), re.M).group(1)
    pinned = dict(p.strip('"').split("==") for p in pins.split())
    assert {k: pinned[k] for k in TESTED_VERSIONS} == TESTED_VERSIONS and "torch" in pinned
    for package, version in TESTED_VERSIONS.items():
        assert _common.in_supported_range(package, version), package


@pytest.mark.parametrize("have, inside", [("5.3.0", True), ("5.23.0", True), ("5.24.1", True), ("5.30.0.dev0", True),
                                          ("5.2.9", False), ("4.57.6", False), ("6.0.0", False), ("6.0.0rc1", False)])
def test_the_supported_range_of_transformers(have, inside):
    assert _common.in_supported_range("transformers", have) is inside


def test_a_version_outside_the_range_warns_once_naming_the_tested_versions(monkeypatch):
    fake_versions(monkeypatch, lightning="3.0.1", accelerate="1.16.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _common.check_version("accelerate")  # inside accelerate>=1.14.0,<2: silent
    with pytest.warns(UserWarning) as caught:
        _common.check_version("lightning")
    message = str(caught[0].message)
    assert message.startswith("dlion.integrations supports lightning>=2.1.0,<3 and was tested with "
                              f"{TESTED}; you have lightning 3.0.1.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _common.check_version("lightning")  # once


def test_importing_the_hf_adapter_warns_on_a_transformers_outside_the_range(monkeypatch):
    need("transformers")
    need("accelerate")
    fake_versions(monkeypatch, transformers="6.1.0")
    with pytest.warns(UserWarning, match=re.escape(f"supports transformers>=5.3.0,<6 and was tested with {TESTED}; "
                                                   "you have transformers 6.1.0")):
        module = import_adapter("hf")
    assert module.DLionTrainer.__mro__[1].__name__ == "Trainer"


def test_importing_the_hf_adapter_refuses_a_changed_private_method(monkeypatch):
    need("transformers")
    need("accelerate")
    from transformers import Trainer

    have = importlib.metadata.version("transformers")
    monkeypatch.setattr(Trainer, "_wrap_model", lambda self, model, training=True: model)  # no `dataloader`
    with pytest.raises(RuntimeError, match=re.escape(
            f"dlion.integrations: Trainer._wrap_model has parameters ['self', 'model', 'training'] in transformers "
            f"{have}, the adapter that overrides it expects ['self', 'model', 'training', 'dataloader'] "
            f"(tested versions: {TESTED}).")):
        import_adapter("hf")
    monkeypatch.delattr(Trainer, "_save_optimizer_and_scheduler")
    monkeypatch.setattr(Trainer, "_wrap_model", lambda self, model, training=True, dataloader=None: model)
    with pytest.raises(RuntimeError, match=re.escape(
            "transformers.trainer.Trainer._save_optimizer_and_scheduler no longer exists in transformers")):
        import_adapter("hf")


@pytest.fixture
def strategy_registry():
    """Lightning's strategy registry, put back as it was after the test (the probe registers its own
    class). Its entries are read with dict.__getitem__: the registry's get() builds a strategy."""
    need("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    names = ("dlion", "dlion_spawn", "dlion_fork")
    saved = {n: dict.__getitem__(StrategyRegistry, n) for n in names if n in StrategyRegistry}
    yield StrategyRegistry
    for n in names:
        StrategyRegistry.pop(n, None)
    StrategyRegistry.update(saved)


def test_importing_the_lightning_adapter_warns_and_refuses_a_changed_private_method(monkeypatch, strategy_registry):
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    fake_versions(monkeypatch, lightning="2.0.9")
    with pytest.warns(UserWarning, match=re.escape("supports lightning>=2.1.0,<3 and was tested with")):
        probe = import_adapter("lightning")
    assert StrategyRegistry["dlion"]["strategy"] is probe.DLionStrategy
    monkeypatch.setattr(DDPStrategy, "load_optimizer_state_dict", lambda self, checkpoint, strict=True: None)
    with pytest.raises(RuntimeError, match=re.escape(
            "DDPStrategy.load_optimizer_state_dict has parameters ['self', 'checkpoint', 'strict'] in lightning "
            "2.0.9, the adapter that overrides it expects ['self', 'checkpoint']")):
        import_adapter("lightning")


def test_the_lightning_registry_holds_the_adapters_own_class_again():
    """(After the probe above, the fixture restored the registry.)"""
    need("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    from dlion.integrations import lightning as dlion_lightning

    assert StrategyRegistry["dlion"]["strategy"] is dlion_lightning.DLionStrategy
