"""Where a tool call in a time-travel fork's lineage sits: ``ToolGuard(forks="replay")``.

``invoke(None, past_config)`` (time travel) makes LangGraph write a *fork* checkpoint
(metadata ``source="fork"``): a copy of the past checkpoint with a new id, whose parent
is the checkpoint it copies. Task ids derive from the checkpoint id, so every fork of the
same checkpoint gives its tasks new ids, and so does every later super-step of the
fork's lineage; a guard keyed by the task id alone would act again on every fork — the
same fork taken twice would send twice.

:class:`Lineage` places a checkpoint of a fork's lineage at its *equivalent*: the
checkpoint the same tasks were (or would be) planned from without the fork. A fork's
equivalent is the checkpoint it copies (or that one's equivalent, for a fork of a fork's
lineage); the equivalent of the checkpoint ``d`` super-steps below a fork is the
checkpoint ``d`` super-steps below the fork's equivalent along the lineage that was there
when the fork was made (children written later are not looked at, so the answer never
changes once given: a resumed fork finds the position its first run used). Where that
lineage had not gone so far, the position is a synthetic checkpoint id derived from the
equivalent and the distance, the same for every fork of that checkpoint.

:func:`origin_namespace` gives the task's ``checkpoint_ns`` as it is (or was) when the
task runs from its checkpoint's equivalent: LangGraph's task id recomputed with the
equivalent's id and step. It checks the recipe first by recomputing the task's own id
from its checkpoint; when that does not match (a LangGraph release that derives ids
otherwise), it answers None and the call keeps its own position (it acts anew), with a
warning. Only the innermost graph's checkpoints are looked at: a call in a subgraph that
a forked parent starts again gets new enclosing task ids and acts anew.

Imports LangGraph's private task-id helpers lazily (the module imports without LangGraph).
"""

from __future__ import annotations

import binascii
import logging
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Equivalent", "Lineage", "origin_namespace"]

log = logging.getLogger("onceonly.adapters")

_CACHED = 4096  # checkpoints whose equivalent a lineage remembers
_SYNTHETIC = uuid.UUID("5b0c3f0e-6f1d-4d1e-9a57-0f0e1c2b3a4d")  # names synthetic positions


@dataclass(frozen=True)
class Equivalent:
    """The checkpoint a fork's checkpoint stands for: ``checkpoint_id`` (a synthetic id
    when ``real`` is False) at super-step ``step``; ``bound``: the id of the nearest fork
    above (the lineage's children written after it are not looked at)."""

    checkpoint_id: str
    step: int
    real: bool
    bound: str


def _id(tup: Any) -> str:
    return str(tup.config["configurable"]["checkpoint_id"])


def _source(tup: Any) -> str:
    return str((getattr(tup, "metadata", None) or {}).get("source", ""))


def _step(tup: Any) -> int:
    return int((getattr(tup, "metadata", None) or {}).get("step", 0))


def _parent_id(tup: Any) -> str | None:
    parent = getattr(tup, "parent_config", None)
    if not parent:
        return None
    return str(parent["configurable"].get("checkpoint_id") or "") or None


class Lineage:
    """Equivalents of checkpoints (see the module docstring), cached per saver, thread,
    namespace and checkpoint; answers are final, so the cache is never invalidated.

    Args:
        get_tuple: The saver's ``get_tuple``.
        list_checkpoints: The saver's ``list``.
    """

    def __init__(
        self,
        get_tuple: Callable[[Any], Any],
        list_checkpoints: Callable[..., Iterable[Any]],
    ) -> None:
        self._get = get_tuple
        self._list = list_checkpoints
        self._cache: OrderedDict[tuple[str, str, str], Equivalent | None] = OrderedDict()
        self._lock = threading.Lock()

    def known(self, thread_id: str, ns: str, checkpoint_id: str) -> bool:
        """Whether the checkpoint is known to be in no fork's lineage (no I/O)."""
        with self._lock:
            key = (thread_id, ns, checkpoint_id)
            return key in self._cache and self._cache[key] is None

    def equivalent(self, thread_id: str, ns: str, checkpoint_id: str) -> Equivalent | None:
        """The checkpoint's equivalent; None when it is in no fork's lineage."""
        hit, found = self._remembered((thread_id, ns, checkpoint_id))
        if hit:
            return found
        tup = self._get(_config(thread_id, ns, checkpoint_id))
        return None if tup is None else self._of(thread_id, ns, tup)

    def get(self, thread_id: str, ns: str, checkpoint_id: str) -> Any:
        """The saver's tuple of the checkpoint (None when it holds none)."""
        return self._get(_config(thread_id, ns, checkpoint_id))

    def _remembered(self, key: tuple[str, str, str]) -> tuple[bool, Equivalent | None]:
        with self._lock:
            if key in self._cache:
                return True, self._cache[key]
        return False, None

    def _remember(self, key: tuple[str, str, str], value: Equivalent | None) -> None:
        with self._lock:
            self._cache[key] = value
            while len(self._cache) > _CACHED:
                self._cache.popitem(last=False)

    def _of(self, thread_id: str, ns: str, tup: Any) -> Equivalent | None:
        # Climb to a remembered checkpoint, a fork or the thread's first checkpoint; then
        # come back down, one super-step at a time.
        hit, found = self._remembered((thread_id, ns, _id(tup)))
        if hit:
            return found
        parent = _parent_id(tup)
        oldest = ""  # the thread's oldest fork: nothing older is in a fork's lineage
        if (
            _source(tup) != "fork"
            and parent is not None
            and not self._remembered((thread_id, ns, parent))[0]
        ):
            oldest = self._oldest_fork(thread_id, ns)
            if not oldest:
                # No fork in the thread (one filtered list): no climb.
                self._remember((thread_id, ns, _id(tup)), None)
                return None
        climbed: list[Any] = []
        cur: Any = tup
        while True:
            key = (thread_id, ns, _id(cur))
            hit, found = self._remembered(key)
            if hit:
                break
            if oldest and _id(cur) < oldest:  # ids are time-ordered: older than any fork
                found = None
                self._remember(key, None)
                break
            if _source(cur) == "fork":
                found = self._of_fork(thread_id, ns, cur)
                self._remember(key, found)
                break
            parent = _parent_id(cur)
            nxt = None if parent is None else self._get(_config(thread_id, ns, parent))
            if nxt is None:  # the first checkpoint (or one the saver no longer holds)
                found = None
                self._remember(key, None)
                break
            climbed.append(cur)
            cur = nxt
        for hop in reversed(climbed):
            if found is not None:
                found = self._child(thread_id, ns, found)
            self._remember((thread_id, ns, _id(hop)), found)
        return found

    def _oldest_fork(self, thread_id: str, ns: str) -> str:
        """The id of the thread's oldest fork checkpoint; "" when it has none."""
        cfg = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns}}
        forks = self._list(cfg, filter={"source": "fork"})
        return min((_id(t) for t in forks if _source(t) == "fork"), default="")

    def _of_fork(self, thread_id: str, ns: str, fork: Any) -> Equivalent | None:
        parent = _parent_id(fork)
        origin = None if parent is None else self._get(_config(thread_id, ns, parent))
        if origin is None:
            return None
        eq = self._of(thread_id, ns, origin)
        if eq is None:
            return Equivalent(_id(origin), _step(origin), real=True, bound=_id(fork))
        return Equivalent(eq.checkpoint_id, eq.step, real=eq.real, bound=_id(fork))

    def _child(self, thread_id: str, ns: str, eq: Equivalent) -> Equivalent:
        """The equivalent one super-step below ``eq``: its child in the lineage as it was
        before the fork ``eq.bound`` was made, else a synthetic position."""
        if eq.real:
            cfg = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ns}}
            children = [
                t
                for t in self._list(cfg, filter={"step": eq.step + 1})
                if _parent_id(t) == eq.checkpoint_id and _source(t) != "fork" and _id(t) < eq.bound
            ]
            if children:
                # The loop's own child first (an update_state branch only without one).
                best = min(children, key=lambda t: (_source(t) != "loop", _id(t)))
                return Equivalent(_id(best), eq.step + 1, real=True, bound=eq.bound)
        name = uuid.uuid5(_SYNTHETIC, f"{eq.checkpoint_id}+1")
        return Equivalent(str(name), eq.step + 1, real=False, bound=eq.bound)


def _config(thread_id: str, ns: str, checkpoint_id: str) -> Any:
    ids = {"thread_id": thread_id, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}
    return {"configurable": ids}


def origin_namespace(
    lineage: Lineage,
    thread_id: str,
    graph_ns: str,
    checkpoint_id: str,
    checkpoint_ns: str,
    metadata: Mapping[str, Any],
) -> str | None:
    """The task's namespace when run from its checkpoint's equivalent; None when the
    task's checkpoint is in no fork's lineage (or the recipe cannot be checked: see the
    module docstring).

    Args:
        lineage: The saver's lineage.
        thread_id: The thread.
        graph_ns: The namespace of the task's graph (a key of ``checkpoint_map``).
        checkpoint_id: The checkpoint the task's super-step was planned from.
        checkpoint_ns: The task's namespace (``...<node>:<task id>``).
        metadata: The task's run metadata (``langgraph_step``, ``_node``, ``_triggers``,
            ``_path``).
    """
    eq = lineage.equivalent(thread_id, graph_ns, checkpoint_id)
    if eq is None:
        return None
    tup = lineage.get(thread_id, graph_ns, checkpoint_id)
    if tup is None:
        return None
    try:
        step = int(metadata["langgraph_step"])
        node = str(metadata["langgraph_node"])
    except (KeyError, TypeError, ValueError):
        return None
    shift = eq.step - _step(tup)
    # The task's namespace: the graph's, then one ``name:task id`` per task of this graph
    # level (an entrypoint's task, then the @task it calls), each id derived from the
    # namespace before it: recomputed in turn from the equivalent.
    segments = checkpoint_ns.split("|")
    mapped = segments[: len(graph_ns.split("|")) if graph_ns else 0]
    last = len(segments) - 1
    for i in range(len(mapped), len(segments)):
        name, _, own = segments[i].rpartition(":")
        recipes = _recipes(metadata) if i == last else _pull_recipes(name)
        if i == last and name != node:
            recipes = []
        own_ns = "|".join([*segments[:i], name])
        new_ns = "|".join([*mapped, name])
        for derive in recipes:
            if derive(checkpoint_id, own_ns, step, name) == own:
                mapped.append(f"{name}:{derive(eq.checkpoint_id, new_ns, step + shift, name)}")
                break
        else:
            log.warning(
                "a forked tool call's position could not be derived from the checkpoint "
                "it copies (LangGraph derives task ids otherwise); it acts as a new call"
            )
            return None
    return "|".join(mapped)


def _pull_recipes(name: str) -> list[Callable[[str, str, int, str], str]]:
    """Recipes of an enclosing task of the same graph level (a node, or an entrypoint),
    whose triggers the call's metadata does not name: its usual trigger channels."""
    candidates = (("__start__",), (f"branch:to:{name}",), (f"start:{name}",))
    return [r for t in candidates for r in _recipes({"langgraph_triggers": t})]


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
