"""The conformance suite against this engine: one spec subclass."""

from asyncflow_myengine.model import build
from asyncflow_spec import RolloutEngineSpec


class TestMyEngine(RolloutEngineSpec):
    backend = "myengine"
    options = {"vocab_size": 32, "hidden_size": 16}

    def weights(self):
        """A complete update the engine accepts (runs the suite's weight-update tests): other weights, same shapes."""
        return build(vocab_size=32, hidden_size=16, seed=1, device="cpu").state_dict()
