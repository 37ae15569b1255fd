"""The capture endpoint: train black-box agents written against the OpenAI SDK.

An agent is pointed at a session's ``base_url``; each of its
``/v1/chat/completions`` calls (streamed or not) is sampled by the run's
engines and recorded token-in/token-out, and closing the session gives the
episode as a :class:`~asyncflow_core.types.episode.Trajectory` (see
``docs/agents.md``). aiohttp (the ``agents`` extra) is imported only when a
server starts.
"""

from asyncflow_core.capture.recorder import (
    Answer,
    CaptureError,
    CaptureSession,
    ChatCall,
    ChatRenderer,
    SampleFn,
    TextCall,
)
from asyncflow_core.capture.server import CaptureServer
from asyncflow_core.capture.toolcalls import parse_tool_calls

__all__ = ["Answer", "CaptureError", "CaptureServer", "CaptureSession", "ChatCall", "ChatRenderer", "SampleFn",
           "TextCall", "parse_tool_calls"]
