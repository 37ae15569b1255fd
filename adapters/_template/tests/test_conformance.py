"""The conformance suite against this engine: one spec subclass.

The engine declares a ``model`` option, so the suite serves it its own tiny
Hugging Face model and checks every log-prob against a float64 forward pass
of the same weights; the weight-update tests push weights the suite makes,
and the pairing test pushes what the ``fsdp`` trainer exports (when
asyncflow-fsdp is installed).
"""

from asyncflow_spec import RolloutEngineSpec


class TestMyEngine(RolloutEngineSpec):
    backend = "myengine"
    options = {"device": "cpu"}
