"""asyncflow-sglang: the ``sglang`` rollout engine, an SGLang server behind the RolloutEngine contract.

See docs/adapters/sglang.md. The engine lives in :mod:`asyncflow_sglang.engine`;
:mod:`asyncflow_sglang.testing` is a protocol fake of the server for tests
without a GPU (not SGLang).
"""

from asyncflow_sglang.config import DECLARED_FEATURES, SGLANG_INSTALL, SUPPORTED_SGLANG, SGLangRolloutConfig

__all__ = ["DECLARED_FEATURES", "SGLANG_INSTALL", "SUPPORTED_SGLANG", "SGLangRolloutConfig"]
