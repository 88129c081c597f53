"""Logging for humans: rank 0 speaks, other ranks only warn; no torch import here."""

from __future__ import annotations

import logging
import re
import sys

_NOISY = ("httpx", "urllib3", "filelock", "datasets", "torch.distributed", "DeepSpeed", "mlflow")


class _DropLines(logging.Filter):
    """Drops a library's records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


# DeepSpeed's logger has its own handler (stdout) and sets its own level when deepspeed is first
# imported (by transformers or accelerate, whatever the strategy); a filter on it stays. Its
# accelerator line is a warning on every CPU run: the CPU is what the config asked for.
_DEEPSPEED_ACCELERATOR = _DropLines("Setting accelerator to CPU", "Setting ds_accelerator to")


# scheme://user:password@host (a tracking URI, a proxy, a data URL): the password is a secret
_URI_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*):[^\s/]*@")


def redact(text: str) -> str:
    """`text` with the password of every `scheme://user:password@host` in it replaced by ***."""
    return _URI_PASSWORD.sub(r"\1:***@", text)


class RedactingFormatter(logging.Formatter):
    """Every line logged, tracebacks too, with the passwords of URIs in it redacted."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


# Libraries that log at import what no user can act on: bitsandbytes' CPU backend that an optional
# kernel package is absent; torchao (bf16_pure's optimizer, which transformers imports whenever it
# is installed) the GPU kernels a CPU build lacks; torch that two of torchao's enums need no
# registration. Quieted as soon as this module is imported: before anything imports them.
_IMPORT_CHATTER = ("bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree")
for _name in _IMPORT_CHATTER:
    logging.getLogger(_name).setLevel(logging.ERROR)
# Errors that our own one line says again, with the key to fix: datasets' unreadable parquet file.
_SAID_AGAIN = ("datasets.packaged_modules.parquet.parquet",)
for _name in _SAID_AGAIN:
    logging.getLogger(_name).setLevel(logging.CRITICAL)


def setup_logging(rank: int = 0, world_size: int = 1) -> None:
    """(Re)configure the root logger: one stderr handler; ranks tagged when there are several."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank{rank}] " if world_size > 1 else ""
    handler.setFormatter(RedactingFormatter(f"{prefix}%(message)s"))
    handler.addFilter(_RankFilter(rank))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    deepspeed = logging.getLogger("DeepSpeed")
    if _DEEPSPEED_ACCELERATOR not in deepspeed.filters:
        deepspeed.addFilter(_DEEPSPEED_ACCELERATOR)
