"""zero3_nvme without libaio: one config line naming the fix, not DeepSpeed's build failure deep
inside its engine. (Where libaio is installed, tests/trainer/test_distributed.py trains on it.)"""

from __future__ import annotations

import pytest

from trainer.backends.deepspeed import _require_async_io
from trainer.core.config import ConfigError


def test_without_libaio_zero3_nvme_is_one_config_error(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    builder = type(get_accelerator().create_op_builder("AsyncIOBuilder"))
    # libaio cannot be uninstalled for a test: its absence is what DeepSpeed's check reports
    monkeypatch.setattr(builder, "is_compatible", lambda self, verbose=False: False)
    with pytest.raises(ConfigError) as err:
        _require_async_io()
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("config error: strategy: zero3_nvme needs DeepSpeed's async_io op")
    assert "apt-get install libaio-dev" in line
