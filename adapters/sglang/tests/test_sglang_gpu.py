"""The conformance suite against a real SGLang server on CUDA (``make test-gpu``; skipped without CUDA or SGLang).

Written against SGLang 0.5.23 by reading its source; it has not run yet (no
GPU was available where it was written), so a failure here may be the
test's as well as the adapter's. Every test launches its own server
(``python -m sglang.launch_server`` on 127.0.0.1, through the adapter's
``launch``) serving the suite's tiny random Llama, whose Hugging Face copy is
the suite's log-prob oracle. What it needs: one GPU and ``pip install
"sglang>=0.5.20,<0.5.24"`` in this environment.

Choices, each from SGLang's source:

- ``--skip-tokenizer-init``: the tiny model ships no tokenizer; the engine
  sends and reads token ids only.
- ``--attention-backend triton``: the suite's model is float32, which
  SGLang's default backends (FlashInfer, FA3) do not run.
- ``weight_sync.mode: tensor`` (CUDA IPC into the server on the same GPU):
  an NCCL group needs a GPU per rank, and this class assumes one GPU.
- ``keep_mode: retract``: the mode that offers in-flight weight updates.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (pip install \"sglang>=0.5.20,<0.5.24\" on a CUDA host)")

from asyncflow_spec import RolloutEngineSpec  # noqa: E402
from asyncflow_spec.rollout import CONVENTION_CASES  # noqa: E402

from asyncflow_core.types import FinishReason  # noqa: E402


@pytest.mark.gpu
@pytest.mark.timeout(1200)  # above each test's own 900 s deadline, which a server launch counts against
class TestSGLangServerOnGPU(RolloutEngineSpec):
    """The rollout spec against ``sglang.launch_server`` started by the engine (one server per test)."""

    backend = "sglang"
    max_new_tokens = 8
    timeout_s: ClassVar[float] = 900.0  # a launch (model load, warm-up) is inside each test's deadline
    options: ClassVar[dict] = {
        "launch": {
            "mem_fraction_static": 0.3,
            "startup_timeout_s": 600.0,
            "extra_args": ["--skip-tokenizer-init", "--attention-backend", "triton", "--disable-cuda-graph"],
        },
        "weight_sync": {"mode": "tensor"},
        "keep_mode": "retract",
    }

    @pytest.mark.parametrize("case", list(CONVENTION_CASES))
    def test_logprobs_follow_the_sampling_convention(self, make_backend, case):
        """A top_p < 1 case is refused with its reason: SGLang cuts top-p on the distribution before top-k and
        returns no log-prob renormalised after a top-p cut it can support (docs/adapters/sglang.md). Every other
        case is the suite's own test."""
        params = CONVENTION_CASES[case]
        if params.get("top_p", 1.0) >= 1.0:
            super().test_logprobs_follow_the_sampling_convention(make_backend, case)
            return

        async def body():
            engine = await self.started(make_backend)
            try:
                return [r async for r in engine.generate([self.request("top-p", **params)])]
            finally:
                await engine.shutdown()

        (res,) = self.run(body())
        assert res.finish_reason is FinishReason.ERROR and f"top_p={params['top_p']}" in res.error
