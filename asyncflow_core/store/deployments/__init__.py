"""Out-of-process deployments of the streaming store, behind the same StreamStore API.

- ``multiprocess`` (:mod:`.multiprocess`): a server (controller + arena index)
  hosted by one process, clients in any local process; tensors through a
  shared-memory arena, control over an authenticated Unix socket.
- ``distributed`` (:mod:`.distributed`): controller and storage on one rank;
  tensors point to point by torch.distributed (gloo/NCCL).
- ``ray`` (:mod:`.ray_store`): controller and storage units as Ray actors.

Shared pieces: :mod:`.core` (the asyncio control core around
:class:`~asyncflow_core.store.controller.Controller`), :mod:`.channel`
(authenticated, persistent control connections), :mod:`.codec` (pickle-free
control messages), :mod:`.arena` / :mod:`.arena_storage` (shared memory),
:mod:`.features` (what each deployment declares; :mod:`.plugin` registers
the deployments with them, and no store imports the plugin).
"""
