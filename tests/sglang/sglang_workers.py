"""Rank workers for ``test_attnres_plugin.py``: SGLang's real selector, decided by
the attnres plugin, in two processes checked by :func:`attnres.distributed.verify_consensus`.

Spawned (not forked) so each rank is a fresh process; they find this module and
the stand-ins on ``sys.path`` (``tests/sglang``). A rank imports SGLang, installs
the plugin, makes its decisions through SGLang's own ``get_attn_backend`` inside
SGLang's component contexts, and only then joins the gloo group, so the group's
rendezvous timeout covers the other rank's SGLang import.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: dist_workers (the suite's group helpers)

from dist_workers import join_group  # noqa: E402


def _server_args(backend: str | None, *, explicit: bool) -> None:
    """SGLang's global server args with ``--attention-backend`` (SGLang's own tests
    build them this way)."""
    from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args

    class _ServerArgs(ServerArgs):
        def __init__(self) -> None:
            self.attention_backend = backend
            self._explicit_arg_names = {"attention_backend"} if explicit else set()

    set_global_server_args(_ServerArgs())


def decide(rank: int, *, differ: bool) -> None:
    """The decisions a pipeline's layers make at load time; with ``differ``, rank 1
    runs with ``--attention-backend sage_attn`` set explicitly (another request)."""
    import torch
    from sglang.multimodal_gen.runtime.layers.attention import selector
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum as E

    other = differ and rank == 1
    _server_args("sage_attn" if other else None, explicit=other)
    supported = (E.FA, E.TORCH_SDPA)
    with selector.component_attn_backend_context_manager(E.TORCH_SDPA, "transformer"):
        for _ in range(4):
            selector.get_attn_backend(128, torch.bfloat16, supported)
            selector.get_attn_backend(128, torch.bfloat16, supported, is_cross_attention=True)
    with selector.component_attn_backend_context_manager(None, "vae"):
        selector.get_attn_backend(64, torch.float32, supported)


def decide_on_another_platform(rank: int) -> None:
    """Rank 1's platform serves flash-attn for its default (a simulated GPU, the way
    SGLang's own selector tests patch ``_cached_get_attn_backend``); rank 0 is the CPU."""
    import torch
    from sglang.multimodal_gen.runtime.layers.attention import selector
    from sglang.multimodal_gen.runtime.layers.attention.backends.flash_attn import (
        FlashAttentionBackend,
    )
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum as E

    _server_args(None, explicit=False)  # the same request on every rank
    if rank == 1:
        selector._cached_get_attn_backend = lambda *args: FlashAttentionBackend
    with selector.component_attn_backend_context_manager(None, "vae"):
        selector.get_attn_backend(64, torch.float32, (E.FA, E.TORCH_SDPA))


def worker(rank: int, world_size: int, tmpdir: str, timeout_s: float, rendezvous_s: float) -> None:
    import sglang_standins  # noqa: F401  (triton/torchvision stand-ins before SGLang)

    import attnres
    from attnres.distributed import ConsensusError, verify_consensus
    from attnres.integrations import sglang as plugin

    plugin.install()
    decide(rank, differ=False)
    agreed = attnres.decisions()
    decide(rank, differ=True)
    differing = attnres.decisions()[len(agreed) :]
    decide_on_another_platform(rank)
    platform = attnres.decisions()[len(agreed) + len(differing) :]
    every = (*agreed, *differing, *platform)
    result: dict[str, Any] = {
        "decided": plugin.stats()["decided"],
        "in_ledger": len(every),
        "replayed": sum(attnres.replay(d.trace).ok for d in every),
        "origins": sorted({d.outcome.origin.value for d in differing}),
    }
    plugin.uninstall()
    import torch.distributed as dist

    join_group(rank, world_size, Path(tmpdir), timeout_s=rendezvous_s)
    try:
        report = verify_consensus(agreed, timeout=timeout_s)
        result["agreed"] = {"layers": report.layers, "digest": report.digest}
        try:
            verify_consensus(differing, timeout=timeout_s)
            result["differing"] = "agreed"
        except ConsensusError as exc:
            result["differing"] = f"ConsensusError: {exc}"
        try:
            verify_consensus(platform, timeout=timeout_s)
            result["platform"] = "agreed"
        except ConsensusError as exc:
            result["platform"] = f"ConsensusError: {exc}"
    finally:
        dist.destroy_process_group()
    path = Path(tmpdir) / f"result.{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result, sort_keys=True))
    os.replace(path.with_suffix(".tmp"), path)
