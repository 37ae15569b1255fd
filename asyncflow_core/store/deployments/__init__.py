"""Out-of-process deployments of the streaming store, behind the same StreamStore API.

- ``multiprocess`` (:mod:`.multiprocess`): a server (controller + arena index)
  hosted by one process, clients in any local process; tensors through a
  shared-memory arena, control over an authenticated Unix socket.

Shared pieces: :mod:`.core` (the asyncio control core around
:class:`~asyncflow_core.store.controller.Controller`), :mod:`.channel`
(authenticated, persistent control connections), :mod:`.codec` (pickle-free
control messages), :mod:`.arena` / :mod:`.arena_storage` (shared memory).
``distributed`` (torch.distributed data plane) and ``ray`` are planned and
not registered yet.
"""
