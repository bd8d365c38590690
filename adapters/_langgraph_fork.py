"""Where a tool call in a forked super-step sits: ``ToolGuard(forks="replay")``.

``invoke(None, past_config)`` (time travel) makes LangGraph write a *fork* checkpoint
(metadata ``source="fork"``): a copy of the past checkpoint with a new id, whose parent
is the checkpoint it copies. Task ids derive from the checkpoint id, so every fork of the
same checkpoint gives its tasks new ids, and a guard keyed by the task id alone would act
again on every fork — the same fork taken twice would send twice.

:func:`origin_namespace` gives the task's ``checkpoint_ns`` as it is (or was) when the
task runs straight from the copied checkpoint: LangGraph's task id recomputed with the
copied checkpoint's id and step. It checks the recipe first by recomputing the forked
task's own id from the fork's; when that does not match (a LangGraph release that derives
ids otherwise), it answers None and the call keeps the fork's own position (it acts
anew), with a warning. Only the innermost graph's checkpoint is looked at: a call in a
subgraph that a forked parent starts again gets new enclosing task ids and acts anew.

Imports LangGraph's private task-id helpers lazily (the module imports without LangGraph).
"""

from __future__ import annotations

import binascii
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["origin_namespace"]

log = logging.getLogger("onceonly.adapters")

_MAX_HOPS = 64  # forks of forks followed back to the checkpoint they copy


def _config(thread_id: str, ns: str, checkpoint_id: str) -> Any:
    ids = {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}
    return {"configurable": ids}


def _source(tup: Any) -> str:
    return str((getattr(tup, "metadata", None) or {}).get("source", ""))


def _step(tup: Any) -> int:
    return int((getattr(tup, "metadata", None) or {}).get("step", 0))


def origin_namespace(
    get_tuple: Callable[[Any], Any],
    thread_id: str,
    graph_ns: str,
    checkpoint_id: str,
    checkpoint_ns: str,
    metadata: Mapping[str, Any],
) -> str | None:
    """The task's namespace from the checkpoint its fork copies; None when the task's
    checkpoint is not a fork (or the recipe cannot be checked: see the module docstring).

    Args:
        get_tuple: The saver's ``get_tuple``.
        thread_id: The thread.
        graph_ns: The namespace of the task's graph (a key of ``checkpoint_map``).
        checkpoint_id: The checkpoint the task's super-step was planned from.
        checkpoint_ns: The task's namespace (``...<node>:<task id>``).
        metadata: The task's run metadata (``langgraph_step``, ``_node``, ``_triggers``,
            ``_path``).
    """
    fork = get_tuple(_config(thread_id, graph_ns, checkpoint_id))
    if fork is None or _source(fork) != "fork":
        return None
    origin = fork
    for _ in range(_MAX_HOPS):
        if _source(origin) != "fork" or origin.parent_config is None:
            break
        parent = get_tuple(origin.parent_config)
        if parent is None:
            break
        origin = parent
    if origin is fork:
        return None
    origin_id = str(origin.config["configurable"]["checkpoint_id"])
    prefix, _, own_task = checkpoint_ns.rpartition(":")
    try:
        step = int(metadata["langgraph_step"])
        node = str(metadata["langgraph_node"])
    except (KeyError, TypeError, ValueError):
        return None
    shift = _step(origin) - _step(fork)
    for derive in _recipes(metadata):
        if derive(checkpoint_id, prefix, step, node) == own_task:
            return f"{prefix}:{derive(origin_id, prefix, step + shift, node)}"
    log.warning(
        "a forked tool call's position could not be derived from the checkpoint it copies "
        "(LangGraph derives task ids otherwise); it acts as a new call"
    )
    return None


def _recipes(metadata: Mapping[str, Any]) -> list[Callable[[str, str, int, str], str]]:
    """LangGraph's task-id recipes that may have made this task's id (checked in turn)."""
    try:
        from langgraph._internal._constants import PULL, PUSH  # noqa: PLC0415
        from langgraph.pregel._algo import (  # noqa: PLC0415  (private, checked before use)
            _uuid5_str,
            _xxhash_str,
            task_path_str,
        )
    except ImportError:
        return []
    path: Sequence[Any] = tuple(metadata.get("langgraph_path") or ())
    triggers = tuple(sorted(str(t) for t in metadata.get("langgraph_triggers") or ()))
    rests: list[tuple[str, ...]] = [(PULL, *triggers)]
    # A push: a Send's index, or a functional-API call's path and index.
    if len(path) >= 2:
        rests.append((PUSH, str(path[1])))
        if len(path) >= 3:
            rests.append((PUSH, task_path_str(path[1]), str(path[2])))
    recipes: list[Callable[[str, str, int, str], str]] = []
    for func in (_xxhash_str, _uuid5_str):
        for rest in rests:

            def derive(
                checkpoint_id: str,
                ns: str,
                step: int,
                node: str,
                func: Callable[..., str] = func,
                rest: tuple[str, ...] = rest,
            ) -> str:
                raw = binascii.unhexlify(checkpoint_id.replace("-", ""))
                return func(raw, ns, str(step), node, *rest)

            recipes.append(derive)
    return recipes
