"""The rank group moved to the core, where every train engine and launcher shares it.

:mod:`asyncflow_core.launchers.ranks` holds :class:`RankGroup` (ranks as
child processes), :class:`RankError` and the spawner hook that lets a
launcher run the ranks elsewhere (the ``ray`` launcher: one actor per rank).
This module keeps the old import path working.
"""

from __future__ import annotations

from asyncflow_core.launchers.ranks import RankError, RankGroup

__all__ = ["RankError", "RankGroup"]
