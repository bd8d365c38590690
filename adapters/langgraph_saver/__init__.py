"""A LangGraph checkpointer on onceonly's checkpoint core (the ``onceonly[langgraph]`` extra).

Swap LangGraph's checkpointer for :class:`OnceOnlySaver` and a graph's checkpoints get
compact storage (deltas and keyframes, content-addressed blobs), integrity checks on
every read, and live in the same database as the effects ledger::

    saver = OnceOnlySaver.from_url("sqlite:///agent.db")
    graph = builder.compile(checkpointer=saver)
    graph.invoke(inputs, {"configurable": {"thread_id": "t-1"}})

**What is stored how.** Each ``(thread_id, checkpoint_ns)`` is one run of the checkpoint
core, and each LangGraph checkpoint one checkpoint of that run whose state is the
checkpoint's ``channel_values``: a channel unchanged since the previous checkpoint costs
nothing, a dict channel costs the keys that changed, a list channel (messages) the
appended items; every so often a keyframe stores the whole state, large dicts split into
pages and long lists into sealed chunks, each a content-addressed (blake3) blob shared by
every checkpoint that refers to it. Values are stored in onceonly's canonical codec where
it is exact (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, and lists, tuples
and string-keyed dicts of them); every other value inside them (LangChain messages,
Pydantic models, LangGraph's markers) is serialised by the saver's ``serde`` and its
bytes stored inside the canonical JSON, so a list of messages is still stored message by
message. The rest of a checkpoint (id, parent, timestamp, channel versions, versions seen)
and its metadata are one record row, pending writes one row each (tables ``oo_lg_*``,
schema component ``langgraph``).

**Integrity.** Every row carries a digest (accidents) and, with integrity keys, a keyed
seal (deliberate edits): thread rows, checkpoint records, pending writes here, and the
store's runs and checkpoints under them (:mod:`checkpoint.integrity`). The keys come from
the keyring (``keyring=``, else ``ONCEONLY_SECRETS``); a saver without them must be asked
for (``unkeyed=True``) and says what it cannot detect (:attr:`OnceOnlySaver.integrity_note`).
Seals are checked before anything of a row is decoded. A row, delta, blob or write that
fails a check raises :class:`~checkpoint.CorruptRecord` and is never returned.

**No code from stored bytes.** The default ``serde`` is :class:`StrictSerializer`:
LangGraph's encoding, and a decoder that builds only allow-listed types (LangChain
messages, LangGraph's markers, the types you register) and refuses any other with
:class:`UnregisteredType` before anything is constructed.

**Durability.** Each ``put`` commits the channel values and the checkpoint record in one
transaction, durable when ``put`` returns: on the store :meth:`OnceOnlySaver.from_url`
opens and on a store you pass in, whatever its durability mode (``sync``, ``async`` or
``exit``). ``copy_thread``, ``prune`` and ``delete_for_runs`` commit the values they
write with their rows the same way.

**Deletion.** ``delete_thread``, ``prune`` and ``delete_for_runs`` rewrite or drop the
affected namespaces' store runs, so deleted channel values and the blobs only they used
are removed from the database, not merely hidden.

LangGraph is imported by this module: import it only with the extra installed
(``import adapters`` does not import it).
"""

from onceonly.adapters import _langgraph_schema as _schema
from onceonly.adapters._langgraph_serde import StrictSerializer, UnregisteredType

from .saver import OnceOnlySaver, copy_threads

__all__ = ["OnceOnlySaver", "StrictSerializer", "UnregisteredType", "copy_threads", "migrate"]

migrate = _schema.migrate
