"""The console's paged reads: which open approvals and which runs a page shows, found
with one indexed query each (a page then reads its own rows through the store, seals
checked). Nothing here decides or acts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onceonly.checkpoint import Store

from .accounts import Role, User


def open_approvals(
    store: Store,
    user: User,
    filters: Mapping[str, str],
    *,
    now: float,
    min_age_s: float,
    snoozed: bool,
    offset: int,
    limit: int,
) -> tuple[list[tuple[str, str, int, str]], int]:
    """One page of open, unexpired approvals the user may see, oldest first, as
    ``(run_id, name, instance, flow)``, and how many there are in all.

    An approver sees the approvals its grants name; with ``snoozed`` False, approvals
    snoozed until after ``now`` are left out."""
    q = store.param
    where = [
        "w.status = 'open'",
        "w.kind = 'approval'",
        f"(w.due_at IS NULL OR w.due_at > {q})",
    ]
    params: list[Any] = [now]
    for key, column in (("flow", "r.flow"), ("name", "w.name"), ("requester", "w.requested_by")):
        if filters.get(key):
            where.append(f"{column} = {q}")
            params.append(filters[key])
    if min_age_s > 0:
        where.append(f"w.created_at <= {q}")
        params.append(now - min_age_s)
    if user.role is Role.APPROVER and "*" not in user.grants:
        terms: list[str] = []
        for grant in user.grants:
            flow, sep, name = grant.partition(":")
            if sep:
                terms.append(f"(r.flow = {q} AND w.name = {q})")
                params += [flow, name]
            else:
                terms.append(f"r.flow = {q}")
                params.append(flow)
        where.append("(" + " OR ".join(terms) + ")" if terms else "1 = 0")
    if not snoozed:
        where.append(
            "NOT EXISTS (SELECT 1 FROM oo_console_snoozes s WHERE s.run_id = w.run_id "
            f"AND s.name = w.name AND s.instance = w.instance AND s.until_at > {q})"
        )
        params.append(now)
    body = "FROM oo_waits w JOIN oo_runs r ON r.run_id = w.run_id WHERE " + " AND ".join(where)

    def read(cur: Any) -> tuple[list[tuple[str, str, int, str]], int]:
        cur.execute(f"SELECT COUNT(*) {body}", params)
        total = int(cur.fetchone()[0])
        cur.execute(
            f"SELECT w.run_id, w.name, w.instance, r.flow {body} "
            f"ORDER BY w.created_at, w.run_id, w.name, w.instance "
            f"LIMIT {int(limit)} OFFSET {int(offset)}",
            params,
        )
        rows = [(str(a), str(b), int(c), str(d)) for a, b, c, d in cur.fetchall()]
        return rows, total

    return store.read(read)


def run_ids(
    store: Store,
    *,
    status: str | None,
    flow: str | None,
    search: str,
    offset: int,
    limit: int,
) -> tuple[list[str], int]:
    """One page of run ids, most recently updated first, and how many match in all;
    ``search`` matches a part of the run id or the flow name."""
    q = store.param
    where: list[str] = []
    params: list[Any] = []
    if status:
        where.append(f"status = {q}")
        params.append(status)
    if flow:
        where.append(f"flow = {q}")
        params.append(flow)
    if search:
        pattern = "%" + _escape_like(search) + "%"
        where.append(f"(run_id LIKE {q} ESCAPE '!' OR flow LIKE {q} ESCAPE '!')")
        params += [pattern, pattern]
    body = "FROM oo_runs" + (" WHERE " + " AND ".join(where) if where else "")

    def read(cur: Any) -> tuple[list[str], int]:
        cur.execute(f"SELECT COUNT(*) {body}", params)
        total = int(cur.fetchone()[0])
        cur.execute(
            f"SELECT run_id {body} ORDER BY updated_at DESC, run_id "
            f"LIMIT {int(limit)} OFFSET {int(offset)}",
            params,
        )
        return [str(r[0]) for r in cur.fetchall()], total

    return store.read(read)


def in_doubt_keys(store: Store, *, now: float, offset: int, limit: int) -> tuple[list[str], int]:
    """One page of the key ids of effects that need a person (unknown, needs human, or
    claimed with a lapsed lease), oldest first, and how many there are: one scan."""
    q = store.param
    body = (
        "FROM oo_effects WHERE status IN ('unknown', 'needs_human', 'claimed') AND "
        f"(status <> 'claimed' OR lease_expires_at IS NULL OR lease_expires_at <= {q})"
    )

    def read(cur: Any) -> tuple[list[str], int]:
        cur.execute(
            f"SELECT key_id {body} ORDER BY created_at, key_id",
            (now,),
        )
        keys = [str(r[0]) for r in cur.fetchall()]
        return keys[offset : offset + limit], len(keys)

    return store.read(read)


def _escape_like(text: str) -> str:
    return text.replace("!", "!!").replace("%", "!%").replace("_", "!_")


def pages(total: int, size: int, asked: int | None) -> tuple[int, int, int]:
    """``(page, pages, offset)`` for page ``asked`` (1-based, clamped)."""
    count = max(1, -(-total // size))
    page = min(max(1, asked or 1), count)
    return page, count, (page - 1) * size


__all__: Sequence[str] = ()
