"""The console's routes (pages and the JSON API). Imports starlette and jinja2: only
when the console is built (:func:`onceonly.console.create_app`)."""

from __future__ import annotations

import contextlib
import json
import math
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from onceonly.checkpoint import (
    CodecError,
    ConcurrentWrite,
    ConfigurationError,
    NotFound,
    OnceOnlyError,
    Run,
    RunStatus,
    Wait,
    WaitKind,
    WaitRefused,
    WaitStatus,
)
from onceonly.errors import RunError, UpgradeRefused
from onceonly.flow import Flow
from onceonly.operator import Operator

from . import _queries, _session
from ._view import cut, readable, state_diff, when
from .accounts import Accounts, Role, User
from .app import ConsoleConfig
from .errors import LinkRefused, NotAllowed
from .links import SignedLink, read_link

_SECURITY_HEADERS = {
    # No script at all: every page works with forms alone.
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
MAX_FORM_BYTES = 1_000_000


@dataclass(frozen=True)
class Item:
    """An open approval as the inbox shows it."""

    run_id: str
    flow: str
    name: str
    instance: int
    subject: str
    subject_hash: str
    requested_by: str | None
    created_at: float
    due_at: float | None
    allow_self: bool
    may_decide: bool
    snoozed_until: float | None

    @property
    def token(self) -> str:
        """What a batch form's checkbox carries: the item and the hash it binds to."""
        return json.dumps([self.run_id, self.name, self.instance, self.subject_hash])


T = TypeVar("T")


@dataclass(frozen=True)
class Upgrade:
    """What a run page offers to move the run to: the deployed version of its flow.

    Attributes:
        target: The version offered (None: no upgrade offered).
        note: Why none is offered ("" when one is, or when there is nothing to say).
        refused: Why the upgrade just asked for was refused ("" if none was).
    """

    target: str | None
    note: str = ""
    refused: str = ""


#: What the run page and a refused request say when the console has no flow code.
NO_FLOW_CODE = (
    "This console was started without flow code, so upgrades are done with the command "
    "line: onceonly runs upgrade RUN --to VERSION --flows MODULE:ATTR --reason TEXT "
    "(or start the console with --flows MODULE:ATTR)."
)


_Page = Callable[[Request, User], Awaitable[Response]]
_Action = Callable[[Request, User, dict[str, Any]], Awaitable[Response]]
_Api = Callable[[Request, User, dict[str, Any]], Awaitable[Any]]


class _Denied(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)


def build(
    op: Operator,
    accounts: Accounts,
    config: ConsoleConfig,
    clock: Callable[[], float],
    flows: Mapping[str, Flow],
) -> Starlette:
    """The Starlette app (see :func:`onceonly.console.create_app`); ``flows``: the
    deployed flows by name (runs of other versions are offered an upgrade to them)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("onceonly.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.globals["when"] = lambda t: when(t, clock())
    codec = op.store.codec

    # -- who is asking -------------------------------------------------------------------
    def session_of(request: Request) -> _session.Session | None:
        return _session.load(config.session_key, request.cookies.get(_session.COOKIE), clock())

    def sso_user(request: Request) -> str | None:
        if config.trusted_header is None:
            return None
        host = request.client.host if request.client else None
        if host is None or host not in config.trusted_proxies:
            return None  # a header from anyone else is not believed
        name = request.headers.get(config.trusted_header, "").strip()
        return name or None

    def page_user(request: Request) -> User | None:
        name = sso_user(request)
        if name is None:
            s = session_of(request)
            name = None if s is None else s.user
        return None if name is None else accounts.get(name)

    def api_user(request: Request) -> User | None:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return accounts.token_user(token.strip())

    # -- responses ---------------------------------------------------------------------
    def render(
        request: Request,
        template: str,
        user: User | None,
        code: int = 200,
        **ctx: Any,
    ) -> HTMLResponse:
        s = session_of(request)
        fresh = s is None
        if s is None:
            s = _session.new_session(None, clock(), config.session_ttl_s)
        ctx.setdefault("msg", request.query_params.get("msg", "")[:300])
        html = env.get_template(template).render(
            user=user, csrf=s.csrf, path=request.url.path, Role=Role, **ctx
        )
        resp = HTMLResponse(html, status_code=code, headers=_SECURITY_HEADERS)
        if fresh:
            set_cookie(resp, s)
        return resp

    def set_cookie(resp: Response, s: _session.Session) -> None:
        resp.set_cookie(
            _session.COOKIE,
            _session.dump(config.session_key, s),
            max_age=int(config.session_ttl_s),
            httponly=True,
            samesite="strict",
            secure=config.secure_cookies,
            path="/",
        )

    def denied(request: Request, user: User | None, status: int, message: str) -> Response:
        return render(request, "error.html", user, code=status, message=message)

    def back(url: str, **params: str) -> RedirectResponse:
        sep = "&" if "?" in url else "?"
        q = urllib.parse.urlencode(params)
        return RedirectResponse(url + (sep + q if q else ""), status_code=303)

    async def form_of(request: Request) -> dict[str, Any]:
        if int(request.headers.get("content-length") or 0) > MAX_FORM_BYTES:
            raise _Denied(413, "the form is too large")
        form = await request.form(max_files=0, max_fields=2000)
        out: dict[str, Any] = {}
        for k, v in form.multi_items():
            if not isinstance(v, str):
                continue
            if k == "item":
                out.setdefault("item", []).append(v)
            else:
                out[k] = v
        return out

    def need(user: User, role: Role, action: str) -> None:
        if not user.role.at_least(role):
            raise NotAllowed(user.name, action, f"it needs the {role.value} role")

    # -- decorators: pages and API ---------------------------------------------------------

    def page(role: Role) -> Callable[[_Page], Callable[[Request], Awaitable[Response]]]:
        def wrap(fn: _Page) -> Callable[[Request], Awaitable[Response]]:
            async def endpoint(request: Request) -> Response:
                user = await run_in_threadpool(page_user, request)
                if user is None:
                    nxt = urllib.parse.quote(str(request.url.path))
                    return RedirectResponse(f"/login?next={nxt}", status_code=303)
                if not user.role.at_least(role):
                    return denied(request, user, 403, f"this page needs the {role.value} role")
                try:
                    return await fn(request, user)
                except NotFound as exc:
                    return denied(request, user, 404, str(exc))
                except _Denied as exc:
                    return denied(request, user, exc.status, exc.message)

            return endpoint

        return wrap

    def action(role: Role) -> Callable[[_Action], Callable[[Request], Awaitable[Response]]]:
        def wrap(fn: _Action) -> Callable[[Request], Awaitable[Response]]:
            async def endpoint(request: Request) -> Response:
                user = await run_in_threadpool(page_user, request)
                try:
                    form = await form_of(request)
                except _Denied as exc:
                    return denied(request, user, exc.status, exc.message)
                # CSRF first: a forged form is refused before anything is looked at.
                if not _session.csrf_ok(session_of(request), form.get("csrf")):
                    return denied(
                        request,
                        user,
                        403,
                        "the form's security token is missing or stale: reload the page "
                        "and submit it again",
                    )
                if user is None:
                    return denied(request, None, 403, "sign in first")
                if not user.role.at_least(role):
                    return denied(request, user, 403, f"this action needs the {role.value} role")
                try:
                    return await fn(request, user, form)
                except NotAllowed as exc:
                    return denied(request, user, 403, str(exc))
                except NotFound as exc:
                    return denied(request, user, 404, str(exc))
                except _Denied as exc:
                    return denied(request, user, exc.status, exc.message)
                except (WaitRefused, RunError, ConfigurationError, CodecError) as exc:
                    return denied(request, user, 409, str(exc))
                except ConcurrentWrite as exc:
                    return denied(request, user, 409, f"{exc} (look at the run again)")

            return endpoint

        return wrap

    def api(
        role: Role, *, post: bool
    ) -> Callable[[_Api], Callable[[Request], Awaitable[Response]]]:
        def wrap(fn: _Api) -> Callable[[Request], Awaitable[Response]]:
            async def endpoint(request: Request) -> Response:
                user = await run_in_threadpool(api_user, request)
                if user is None:
                    return _json_error(401, "unauthenticated", "send Authorization: Bearer TOKEN")
                if not user.role.at_least(role):
                    return _json_error(403, "forbidden", f"this needs the {role.value} role")
                body: dict[str, Any] = {}
                if post:
                    try:
                        raw = await request.body()
                        if len(raw) > MAX_FORM_BYTES:
                            return _json_error(413, "too_large", "the body is too large")
                        doc = json.loads(raw or b"{}")
                    except ValueError:
                        return _json_error(400, "bad_request", "the body is not JSON")
                    if not isinstance(doc, dict):
                        return _json_error(400, "bad_request", "the body is a JSON object")
                    body = doc
                try:
                    return JSONResponse(await fn(request, user, body))
                except NotAllowed as exc:
                    return _json_error(403, "forbidden", str(exc))
                except NotFound as exc:
                    return _json_error(404, "not_found", str(exc))
                except WaitRefused as exc:
                    doc = {"error": exc.reason, "message": str(exc)}
                    if exc.reason == "decided":
                        doc["wait"] = wait_doc(await run_in_threadpool(op.waits.get, *_rn(exc)))
                    return JSONResponse(doc, status_code=409)
                except _Denied as exc:
                    return _json_error(exc.status, "refused", exc.message)
                except (RunError, ConfigurationError, CodecError, ConcurrentWrite) as exc:
                    return _json_error(409, type(exc).__name__, str(exc))

            return endpoint

        return wrap

    # -- the data ----------------------------------------------------------------------
    def wait_item(
        w: Wait,
        run_id: str,
        flow: str,
        name: str,
        instance: int,
        *,
        may_decide: bool = True,
        snoozed_until: float | None = None,
    ) -> Item:
        """The approval ``w`` as the inbox shows it."""
        return Item(
            run_id,
            flow,
            name,
            instance,
            readable(codec, w.subject),
            w.subject_hash or "",
            w.requested_by,
            w.created_at,
            w.due_at,
            w.allow_self,
            may_decide=may_decide,
            snoozed_until=snoozed_until,
        )

    def inbox_items(
        user: User, filters: Mapping[str, str], show_snoozed: bool, page: int | None
    ) -> tuple[list[Item], int, int, int]:
        """One page of the inbox: its items, the page, the pages, the total."""
        now = clock()
        min_age_s = _hours(filters.get("min_age_h")) or 0.0

        def query(offset: int) -> tuple[list[tuple[str, str, int, str]], int]:
            return _queries.open_approvals(
                op.store,
                user,
                filters,
                now=now,
                min_age_s=min_age_s,
                snoozed=show_snoozed,
                offset=offset,
                limit=config.page_size,
            )

        rows, pg, count, total = _page_of(query, config.page_size, page)
        snoozes = accounts.snoozes() if show_snoozed else {}
        out: list[Item] = []
        for run_id, name, instance, flow in rows:
            try:
                w = op.waits.get(run_id, name, instance)  # its seal checked
            except NotFound:
                continue  # gone since the page's query
            if w.status is not WaitStatus.OPEN:
                continue
            sz = snoozes.get((run_id, name, instance))
            out.append(
                wait_item(
                    w,
                    run_id,
                    flow,
                    name,
                    instance,
                    may_decide=user.may_decide(flow, name),
                    snoozed_until=None if sz is None else sz.until,
                )
            )
        return out, pg, count, total

    def wait_doc(w: Wait) -> dict[str, Any]:
        return {
            "run_id": w.run_id,
            "name": w.name,
            "instance": w.instance,
            "kind": w.kind.value,
            "status": w.status.value,
            "subject": codec.readable(w.subject) if w.kind is WaitKind.APPROVAL else None,
            "subject_hash": w.subject_hash,
            "requested_by": w.requested_by,
            "due_at": w.due_at,
            "decided_by": w.decided_by,
            "decided_at": w.decided_at,
            "reason": w.reason,
            "created_at": w.created_at,
        }

    def item_doc(i: Item) -> dict[str, Any]:
        return {
            "run_id": i.run_id,
            "flow": i.flow,
            "name": i.name,
            "instance": i.instance,
            "subject": json.loads(i.subject) if i.subject.startswith(("{", "[", '"')) else None,
            "subject_hash": i.subject_hash,
            "requested_by": i.requested_by,
            "created_at": i.created_at,
            "due_at": i.due_at,
            "snoozed_until": i.snoozed_until,
        }

    def decide(
        user: User,
        run_id: str,
        name: str,
        instance: int | None,
        decision: str,
        subject_hash: str,
        reason: str,
        edited: Any = None,
    ) -> tuple[str, Wait]:
        """``(outcome, wait)``: ``approved``/``rejected``, or ``decided`` (someone
        decided first: the wait shows who and when)."""
        run = op.store.get_run(run_id)
        if not user.may_decide(run.flow, name):
            raise NotAllowed(
                user.name, f"decide {name!r} of run {run_id!r}", f"no grant for flow {run.flow!r}"
            )
        current = op.waits.get(run_id, name)
        if instance is not None and current.instance != instance:
            return "replaced", current
        if current.status is not WaitStatus.OPEN:
            return "decided", current
        try:
            if decision == "approve":
                w = op.approve(
                    run_id, name, actor=user.name, subject_hash=subject_hash, reason=reason
                )
            elif decision == "edit":
                w = op.approve_edited(
                    run_id,
                    name,
                    actor=user.name,
                    subject_hash=subject_hash,
                    subject=edited,
                    reason=reason,
                )
            elif decision == "reject":
                w = op.reject(run_id, name, actor=user.name, reason=reason)
            else:
                raise _Denied(400, f"unknown decision {decision!r}: approve or reject")
        except WaitRefused as exc:
            if exc.reason == "decided":
                return "decided", op.waits.get(run_id, name)
            raise
        return w.status.value, w

    # -- pages -------------------------------------------------------------------------
    async def login_page(request: Request) -> Response:
        return render(request, "login.html", None, next=_safe_next(request), error=None)

    async def login(request: Request) -> Response:
        form = await form_of(request)
        if not _session.csrf_ok(session_of(request), form.get("csrf")):
            return denied(request, None, 403, "the form's security token is missing or stale")
        name = str(form.get("username", ""))[:200]
        pw = str(form.get("password", ""))[:1000]
        user = await run_in_threadpool(accounts.authenticate, name, pw)
        nxt = _safe_next(request, form.get("next"))
        if user is None:
            return render(
                request,
                "login.html",
                None,
                code=401,
                next=nxt,
                error="unknown user or wrong password",
            )
        resp = RedirectResponse(nxt, status_code=303)
        set_cookie(resp, _session.new_session(user.name, clock(), config.session_ttl_s))
        return resp

    async def logout(request: Request) -> Response:
        form = await form_of(request)
        if not _session.csrf_ok(session_of(request), form.get("csrf")):
            return denied(request, None, 403, "the form's security token is missing or stale")
        resp = RedirectResponse("/login", status_code=303)
        set_cookie(resp, _session.new_session(None, clock(), config.session_ttl_s))
        return resp

    async def home(request: Request) -> Response:
        return RedirectResponse("/inbox", status_code=303)

    @page(Role.VIEWER)
    async def inbox(request: Request, user: User) -> Response:
        filters = {k: request.query_params.get(k, "") for k in ("flow", "name", "requester")}
        filters["min_age_h"] = request.query_params.get("min_age_h", "")
        show_snoozed = request.query_params.get("snoozed") == "1"
        items, pg, pages, total = await run_in_threadpool(
            inbox_items, user, filters, show_snoozed, _int(request.query_params.get("page"))
        )
        return render(
            request,
            "inbox.html",
            user,
            items=items,
            total=total,
            page=pg,
            pages=pages,
            filters=filters,
            show_snoozed=show_snoozed,
        )

    @action(Role.APPROVER)
    async def inbox_decide(request: Request, user: User, form: dict[str, Any]) -> Response:
        run_id, name = str(form.get("run_id", "")), str(form.get("name", ""))
        reason = str(form.get("reason", "")).strip()
        decision = str(form.get("decision", ""))
        if decision == "reject" and not reason:
            raise _Denied(400, "a rejection needs a reason")
        outcome, w = await run_in_threadpool(
            decide,
            user,
            run_id,
            name,
            _int(form.get("instance")),
            decision,
            str(form.get("subject_hash", "")),
            reason,
        )
        if outcome in ("decided", "replaced"):
            return render(request, "decided.html", user, wait=w, outcome=outcome)
        return back("/inbox", msg=f"{outcome}: {name} of run {run_id}")

    @action(Role.APPROVER)
    async def inbox_batch(request: Request, user: User, form: dict[str, Any]) -> Response:
        tokens = form.get("item") or []
        if not tokens:
            raise _Denied(400, "select at least one approval")
        reason = str(form.get("reason", "")).strip()
        results: list[tuple[str, str, str, Wait | None]] = []
        for tok in tokens:
            try:
                run_id, name, instance, digest = json.loads(tok)
            except (ValueError, TypeError):
                raise _Denied(400, "a selected item is malformed; reload the inbox") from None
            try:
                outcome, w = await run_in_threadpool(
                    decide,
                    user,
                    str(run_id),
                    str(name),
                    int(instance),
                    "approve",
                    str(digest),
                    reason,
                )
                results.append((str(run_id), str(name), outcome, w))
            except (NotAllowed, WaitRefused, NotFound) as exc:
                results.append((str(run_id), str(name), f"refused: {exc}", None))
        return render(request, "batch.html", user, results=results)

    @action(Role.APPROVER)
    async def inbox_snooze(request: Request, user: User, form: dict[str, Any]) -> Response:
        run_id, name = str(form.get("run_id", "")), str(form.get("name", ""))
        seconds = _hours(form.get("hours"))
        if seconds is None or seconds <= 0 or seconds > 365 * 86400:
            raise _Denied(400, "snooze for a number of hours between 0 and 8760")
        reason = str(form.get("reason", "")).strip() or "not now"

        def snooze() -> None:
            run = op.store.get_run(run_id)
            if not user.may_decide(run.flow, name):
                raise NotAllowed(user.name, f"snooze {name!r}", f"no grant for flow {run.flow!r}")
            w = op.waits.get(run_id, name)
            if w.status is not WaitStatus.OPEN:
                raise _Denied(409, f"{name!r} of run {run_id!r} is {w.status.value} already")
            until = clock() + seconds
            accounts.snooze(run_id, name, w.instance, until=until, by=user.name, reason=reason)
            # in the run's audit chain too (the console's own table says what is hidden)
            op.record(
                run_id,
                "snooze",
                {"approval": name, "instance": w.instance, "until": until, "reason": reason},
                actor=user.name,
            )

        await run_in_threadpool(snooze)
        return back("/inbox", msg=f"snoozed: {name} of run {run_id}")

    def open_item(user: User, run_id: str, name: str) -> Item:
        run = op.store.get_run(run_id)
        if not user.may_decide(run.flow, name):
            raise NotAllowed(user.name, f"decide {name!r}", f"no grant for flow {run.flow!r}")
        w = op.waits.get(run_id, name)
        if w.kind is not WaitKind.APPROVAL or w.status is not WaitStatus.OPEN:
            raise _Denied(409, f"{name!r} of run {run_id!r} is not an open approval")
        return wait_item(w, run_id, run.flow, name, w.instance)

    @page(Role.APPROVER)
    async def edit_page(request: Request, user: User) -> Response:
        qp = request.query_params
        try:
            item = await run_in_threadpool(
                open_item, user, qp.get("run_id", ""), qp.get("name", "")
            )
        except NotAllowed as exc:
            raise _Denied(403, str(exc)) from None
        return render(request, "edit.html", user, item=item)

    @action(Role.APPROVER)
    async def edit_approve(request: Request, user: User, form: dict[str, Any]) -> Response:
        run_id, name = str(form.get("run_id", "")), str(form.get("name", ""))
        subject = _json_value(str(form.get("subject", "")))
        reason = str(form.get("reason", "")).strip()
        if not reason:
            raise _Denied(400, "say why you changed it (recorded with your approval)")
        outcome, w = await run_in_threadpool(
            decide,
            user,
            run_id,
            name,
            _int(form.get("instance")),
            "edit",
            str(form.get("subject_hash", "")),
            reason,
            subject,
        )
        if outcome in ("decided", "replaced"):
            return render(request, "decided.html", user, wait=w, outcome=outcome)
        return back("/inbox", msg=f"edited and approved: {name} of run {run_id}")

    @page(Role.VIEWER)
    async def runs_page(request: Request, user: User) -> Response:
        qp = request.query_params
        status = qp.get("status") or None
        flow = qp.get("flow") or None
        needle = qp.get("q", "").strip()
        unserved_only = qp.get("unserved") == "1"
        if status is not None and status not in {s.value for s in RunStatus}:
            raise _Denied(400, f"unknown status {status!r}")

        asked = _int(qp.get("page"))

        def read() -> tuple[list[Any], set[str], int, int, int]:
            from onceonly.registry import WorkerRegistry, unserved  # noqa: PLC0415

            registry = WorkerRegistry(op.store, create=False)
            if unserved_only:  # every running or waiting run is looked at: on request
                rows = [
                    r
                    for r in unserved(op.store, registry)
                    if (status is None or r.status.value == status)
                    and flow in (None, r.flow)
                    and (not needle or needle in r.run_id or needle in r.flow)
                ]
                pg, count, offset = _queries.pages(len(rows), config.page_size, asked)
                shown = rows[offset : offset + config.page_size]
                return shown, {r.run_id for r in shown}, pg, count, len(rows)

            def query(offset: int) -> tuple[list[str], int]:
                return _queries.run_ids(
                    op.store,
                    status=status,
                    flow=flow,
                    search=needle,
                    offset=offset,
                    limit=config.page_size,
                )

            ids, pg, count, total = _page_of(query, config.page_size, asked)
            shown = []
            for rid in ids:
                with contextlib.suppress(NotFound):  # removed since the query
                    shown.append(op.store.get_run(rid))
            live = registry.live()
            lost = {
                r.run_id
                for r in shown
                if r.status in (RunStatus.RUNNING, RunStatus.WAITING)
                and not any(w.serves(r.flow, r.code_version) for w in live)
            }
            return shown, lost, pg, count, total

        shown, lost, pg, pages, total = await run_in_threadpool(read)
        return render(
            request,
            "runs.html",
            user,
            runs=shown,
            total=total,
            page=pg,
            pages=pages,
            unserved=lost,
            q=needle,
            status=status or "",
            flow=flow or "",
            unserved_only=unserved_only,
            statuses=[s.value for s in RunStatus],
        )

    def run_detail(run_id: str, verify: bool) -> dict[str, Any]:
        view = op.show(run_id)
        timeline = []
        before: dict[str, Any] = {}
        for info in view.history[-100:]:
            try:
                st = dict(op.store.load(run_id, info.seq, lazy=True).state)
            except OnceOnlyError as exc:
                timeline.append((info, [("(cannot be read)", str(exc))]))
                continue
            st.pop("__onceonly__", None)
            timeline.append((info, state_diff(before, st)))
            before = st
        channels = [(k, cut(readable(codec, v))) for k, v in sorted(view.state.items())]
        problems = None
        if verify:
            report = op.ledger.verify()
            problems = [p for p in report.problems if run_id in p]
        audit = op.ledger.audit_events(str(view.meta.get("key_run") or run_id))
        from onceonly.registry import WorkerRegistry  # noqa: PLC0415

        live = WorkerRegistry(op.store, create=False).live()
        lost = view.run.status in (RunStatus.RUNNING, RunStatus.WAITING) and not any(
            w.serves(view.run.flow, view.run.code_version) for w in live
        )
        return {
            "view": view,
            "channels": channels,
            "timeline": list(reversed(timeline)),
            "waits": [(w, readable(codec, w.subject)) for w in view.waits],
            "oplog": list(view.meta.get("operator_log") or []),
            "durability": view.meta.get("durability"),
            "problems": problems,
            "audit": audit[-50:],
            "unserved": lost,
        }

    @page(Role.VIEWER)
    async def run_page(request: Request, user: User) -> Response:
        run_id = request.path_params["run_id"]
        verify = request.query_params.get("verify") == "1"
        detail = await run_in_threadpool(run_detail, run_id, verify)
        offer = upgrade_offer(detail["view"].run)
        return render(request, "run.html", user, upgrade=offer, **detail)

    def confirmed(form: Mapping[str, Any]) -> str:
        if form.get("confirm") != "yes":
            raise _Denied(400, "tick the confirmation box to do this")
        reason = str(form.get("reason", "")).strip()
        if not reason:
            raise _Denied(400, "give a reason (it is recorded with your name)")
        return reason

    @action(Role.OPERATOR)
    async def run_action(request: Request, user: User, form: dict[str, Any]) -> Response:
        run_id = request.path_params["run_id"]
        what = request.path_params["what"]
        reason = confirmed(form)
        target = run_id
        if what == "cancel":
            await run_in_threadpool(lambda: op.cancel(run_id, actor=user.name, reason=reason))
        elif what == "retry":
            await run_in_threadpool(lambda: op.retry(run_id, actor=user.name, reason=reason))
        elif what == "fork":
            seq = _int(form.get("seq"))
            if seq is None:
                raise _Denied(400, "say which checkpoint to fork from")
            target = await run_in_threadpool(
                lambda: op.fork(run_id, seq, actor=user.name, reason=reason)
            )
        elif what == "restart":
            target = await run_in_threadpool(
                lambda: op.restart(run_id, actor=user.name, reason=reason)
            )
        elif what == "edit":
            channel = str(form.get("channel", "")).strip()
            value = _json_value(str(form.get("value", "")))
            if not channel:
                raise _Denied(400, "name the state channel to set")
            await run_in_threadpool(
                lambda: op.edit(run_id, channel, value, actor=user.name, reason=reason)
            )
        else:
            raise _Denied(404, f"no action {what!r}")
        return back(f"/runs/{urllib.parse.quote(target)}", msg=f"{what}: done")

    # -- upgrades: a run moved to the deployed version of its flow -------------------------
    def upgrade_offer(run: Run, refused: str = "") -> Upgrade:
        if not flows:
            return Upgrade(None, NO_FLOW_CODE, refused)
        flow = flows.get(run.flow)
        if flow is None:
            note = (
                f"This console's flow code has no flow {run.flow!r}: upgrade this run with "
                "onceonly runs upgrade."
            )
            return Upgrade(None, note, refused)
        if flow.version == run.code_version:
            note = f"The run is on the deployed version of its flow ({flow.version})."
        elif run.status in (RunStatus.COMPLETED, RunStatus.CANCELLED):
            note = f"The run is {run.status.value}: it stays on version {run.code_version}."
        else:
            return Upgrade(flow.version, "", refused)
        return Upgrade(None, note, refused)

    def upgrade_run(user: User, run_id: str, to: str, reason: str) -> tuple[str, Run]:
        """Move the run to version ``to`` (the version the page offered: the deployed
        one, or refused); ``(its version before, the run)``."""
        run = op.store.get_run(run_id)
        if not flows:
            raise _Denied(409, NO_FLOW_CODE)
        flow = flows.get(run.flow)
        if flow is None:
            raise _Denied(409, f"this console's flow code has no flow {run.flow!r}")
        if not to:
            raise _Denied(400, "say which version to move the run to")
        if flow.version != to:
            raise _Denied(
                409,
                f"this console's code is version {flow.version!r} of {run.flow!r}, not "
                f"{to!r}: look at the run again",
            )
        return run.code_version, op.upgrade(run_id, flow, actor=user.name, reason=reason)

    @action(Role.OPERATOR)
    async def run_upgrade(request: Request, user: User, form: dict[str, Any]) -> Response:
        run_id = request.path_params["run_id"]
        reason = confirmed(form)
        try:
            before, run = await run_in_threadpool(
                upgrade_run, user, run_id, str(form.get("to", "")).strip(), reason
            )
        except UpgradeRefused as exc:
            # the run page again, saying why: nothing changed, the operator sees the run
            detail = await run_in_threadpool(lambda: run_detail(run_id, verify=False))
            offer = upgrade_offer(detail["view"].run, refused=str(exc))
            return render(request, "run.html", user, code=409, upgrade=offer, **detail)
        done = (
            f"upgrade: from version {before} to {run.code_version}"
            if before != run.code_version
            else f"upgrade: the run is on version {run.code_version} already"
        )
        return back(f"/runs/{urllib.parse.quote(run_id)}", msg=done)

    def in_doubt(page: int | None, size: int) -> tuple[list[Any], int, int, int]:
        """One page of the effects that need a person, oldest first (each read through
        the ledger, flagged if it fails its seal), the page, the pages, the total."""

        def query(offset: int) -> tuple[list[str], int]:
            return _queries.in_doubt_keys(op.store, now=clock(), offset=offset, limit=size)

        keys, pg, count, total = _page_of(query, size, page)
        rows = []
        for key in keys:
            with contextlib.suppress(OnceOnlyError):  # removed or settled since the query
                rows.append(op.ledger.get(key))
        return rows, pg, count, total

    @page(Role.VIEWER)
    async def effects_page(request: Request, user: User) -> Response:
        rows, pg, pages, total = await run_in_threadpool(
            in_doubt, _int(request.query_params.get("page")), config.page_size
        )
        return render(
            request,
            "effects.html",
            user,
            effects=rows,
            total=total,
            page=pg,
            pages=pages,
        )

    @action(Role.OPERATOR)
    async def effect_resolve(request: Request, user: User, form: dict[str, Any]) -> Response:
        key_id = request.path_params["key_id"]
        evidence = confirmed({**form, "reason": form.get("evidence", "")})
        happened = {"happened": True, "not_happened": False}.get(str(form.get("outcome")))
        if happened is None:
            raise _Denied(400, "say whether it happened or not")
        await run_in_threadpool(
            lambda: op.resolve(key_id, happened=happened, evidence=evidence, actor=user.name)
        )
        return back("/effects", msg=f"resolved {key_id[:16]}")

    # -- signed approval links ----------------------------------------------------------
    def link_state(token: str) -> tuple[SignedLink, User, Item | None, Wait]:
        """The link, its approver, the open item it asks about (None: decided) and the
        wait; refused links raise ``LinkRefused`` or ``_Denied``."""
        if config.link_key is None:
            raise _Denied(404, "this console serves no approval links")
        link = read_link(config.link_key, token, clock())
        if accounts.link_used(link.digest):
            w = op.waits.get(link.run_id, link.name)
            raise _Denied(
                410,
                f"this link was used already: {link.name!r} of run {link.run_id!r} is "
                f"{w.status.value}" + (f" by {w.decided_by}" if w.decided_by else ""),
            )
        run = op.store.get_run(link.run_id)
        approver = accounts.get(link.approver)
        if approver is None or not approver.may_decide(run.flow, link.name):
            raise _Denied(
                403,
                f"{link.approver!r} may not decide {link.name!r} of flow {run.flow!r} "
                "(no account, or no grant any more)",
            )
        w = op.waits.get(link.run_id, link.name)
        if w.status is not WaitStatus.OPEN:
            return link, approver, None, w
        if w.subject_hash != link.subject_hash:
            raise _Denied(
                409,
                "the request changed since this link was sent: the link is void; "
                "look at the request in the console's inbox",
            )
        item = wait_item(w, w.run_id, run.flow, w.name, w.instance)
        return link, approver, item, w

    async def link_page(request: Request) -> Response:
        token = request.path_params["token"]
        try:
            _link, approver, item, w = await run_in_threadpool(link_state, token)
        except (LinkRefused, NotFound) as exc:
            return denied(request, None, 410 if isinstance(exc, LinkRefused) else 404, str(exc))
        except _Denied as exc:
            return denied(request, None, exc.status, exc.message)
        if item is None:
            return render(request, "decided.html", None, wait=w, outcome="decided")
        return render(request, "link.html", None, item=item, approver=approver, token=token)

    async def link_decide(request: Request) -> Response:
        token = request.path_params["token"]
        form = await form_of(request)
        if not _session.csrf_ok(session_of(request), form.get("csrf")):
            return denied(request, None, 403, "the form's security token is missing or stale")
        decision = str(form.get("decision", ""))
        reason = str(form.get("reason", "")).strip()
        if decision not in ("approve", "reject") or (decision == "reject" and not reason):
            return denied(request, None, 400, "approve, or reject with a reason")

        def decide_link() -> tuple[str, Wait]:
            link, approver, item, w = link_state(token)
            if item is None:
                return "decided", w
            outcome, w = decide(
                approver,
                link.run_id,
                link.name,
                item.instance,
                decision,
                link.subject_hash,
                reason or "through a signed approval link",
            )
            if outcome in ("approved", "rejected"):
                accounts.use_link(link.digest, by=approver.name, decision=outcome)
            return outcome, w

        try:
            outcome, w = await run_in_threadpool(decide_link)
        except (LinkRefused, NotFound) as exc:
            return denied(request, None, 410 if isinstance(exc, LinkRefused) else 404, str(exc))
        except _Denied as exc:
            return denied(request, None, exc.status, exc.message)
        except WaitRefused as exc:
            return denied(request, None, 409, str(exc))
        if outcome in ("decided", "replaced"):
            return render(request, "decided.html", None, wait=w, outcome=outcome)
        return render(request, "link_done.html", None, wait=w)

    # -- the JSON API ------------------------------------------------------------------
    @api(Role.VIEWER, post=False)
    async def api_me(request: Request, user: User, body: dict[str, Any]) -> Any:
        return {"name": user.name, "role": user.role.value, "grants": list(user.grants)}

    @api(Role.VIEWER, post=False)
    async def api_approvals(request: Request, user: User, body: dict[str, Any]) -> Any:
        qp = request.query_params
        filters = {k: qp.get(k, "") for k in ("flow", "name", "requester", "min_age_h")}
        items, _pg, _pages, _total = await run_in_threadpool(
            inbox_items, user, filters, qp.get("snoozed") == "1", _int(qp.get("page"))
        )
        return [item_doc(i) for i in items]

    @api(Role.APPROVER, post=True)
    async def api_decide(request: Request, user: User, body: dict[str, Any]) -> Any:
        run_id = request.path_params["run_id"]
        name = request.path_params["name"]
        decision = request.path_params["decision"]
        reason = str(body.get("reason") or "")
        if decision in ("reject", "edit") and not reason.strip():
            raise _Denied(400, f"{decision}: give a reason")
        if decision == "edit" and "subject" not in body:
            raise _Denied(400, "edit: give the new subject")
        outcome, w = await run_in_threadpool(
            decide,
            user,
            run_id,
            name,
            _int(body.get("instance")),
            decision,
            str(body.get("subject_hash") or ""),
            reason,
            body.get("subject"),
        )
        doc = wait_doc(w)
        doc["outcome"] = outcome
        return doc

    @api(Role.VIEWER, post=False)
    async def api_runs(request: Request, user: User, body: dict[str, Any]) -> Any:
        qp = request.query_params
        status = qp.get("status") or None
        limit = min(_int(qp.get("limit")) or 100, 1000)
        rows = await run_in_threadpool(
            lambda: op.store.list_runs(status=status, flow=qp.get("flow") or None, limit=limit)
        )
        return [_run_doc(r) for r in rows]

    @api(Role.VIEWER, post=False)
    async def api_run(request: Request, user: User, body: dict[str, Any]) -> Any:
        view = await run_in_threadpool(op.show, request.path_params["run_id"])
        return {
            **_run_doc(view.run),
            "state": codec.readable(view.state),
            "durability": view.meta.get("durability"),
            "waits": [wait_doc(w) for w in view.waits],
            "effects": [_effect_doc(e) for e in view.effects],
            "checkpoints": [
                {"seq": c.seq, "step": c.step, "source": str(c.source), "at": c.created_at}
                for c in view.history
            ],
        }

    @api(Role.OPERATOR, post=True)
    async def api_run_action(request: Request, user: User, body: dict[str, Any]) -> Any:
        run_id = request.path_params["run_id"]
        what = request.path_params["what"]
        reason = str(body.get("reason") or "").strip()
        if not reason:
            raise _Denied(400, "give a reason (it is recorded with your name)")
        if what == "cancel":
            run = await run_in_threadpool(lambda: op.cancel(run_id, actor=user.name, reason=reason))
            return _run_doc(run)
        if what == "retry":
            run = await run_in_threadpool(lambda: op.retry(run_id, actor=user.name, reason=reason))
            return _run_doc(run)
        if what == "fork":
            seq = _int(body.get("seq"))
            if seq is None:
                raise _Denied(400, "say which checkpoint to fork from (seq)")
            new = await run_in_threadpool(
                lambda: op.fork(run_id, seq, actor=user.name, reason=reason)
            )
            return {"run_id": new}
        if what == "restart":
            new = await run_in_threadpool(
                lambda: op.restart(run_id, actor=user.name, reason=reason)
            )
            return {"run_id": new}
        if what == "edit":
            channel = str(body.get("channel") or "")
            if not channel or "value" not in body:
                raise _Denied(400, "give the channel and its value")
            info = await run_in_threadpool(
                lambda: op.edit(run_id, channel, body["value"], actor=user.name, reason=reason)
            )
            return {"run_id": run_id, "seq": info.seq}
        raise _Denied(404, f"no action {what!r}")

    @api(Role.OPERATOR, post=True)
    async def api_run_upgrade(request: Request, user: User, body: dict[str, Any]) -> Any:
        reason = str(body.get("reason") or "").strip()
        if not reason:
            raise _Denied(400, "give a reason (it is recorded with your name)")
        to = str(body.get("to") or "").strip()
        before, run = await run_in_threadpool(
            upgrade_run, user, request.path_params["run_id"], to, reason
        )
        return {**_run_doc(run), "from": before, "to": run.code_version}

    @api(Role.VIEWER, post=False)
    async def api_in_doubt(request: Request, user: User, body: dict[str, Any]) -> Any:
        rows, _pg, _pages, _total = await run_in_threadpool(
            in_doubt, _int(request.query_params.get("page")), 1000
        )
        return [_effect_doc(e) for e in rows]

    @api(Role.OPERATOR, post=True)
    async def api_resolve(request: Request, user: User, body: dict[str, Any]) -> Any:
        key_id = request.path_params["key_id"]
        evidence = str(body.get("evidence") or "").strip()
        happened = body.get("happened")
        if not evidence or not isinstance(happened, bool):
            raise _Denied(400, "give happened (true/false) and the evidence you checked")
        rec = await run_in_threadpool(
            lambda: op.resolve(key_id, happened=happened, evidence=evidence, actor=user.name)
        )
        return _effect_doc(rec)

    async def not_found(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/api/"):
            return _json_error(404, "not_found", "no such route")
        return HTMLResponse("not found", status_code=404, headers=_SECURITY_HEADERS)

    routes = [
        Route("/", home),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/inbox", inbox, methods=["GET"]),
        Route("/inbox/decide", inbox_decide, methods=["POST"]),
        Route("/inbox/batch", inbox_batch, methods=["POST"]),
        Route("/inbox/snooze", inbox_snooze, methods=["POST"]),
        Route("/inbox/edit", edit_page, methods=["GET"]),
        Route("/inbox/edit", edit_approve, methods=["POST"]),
        Route("/runs", runs_page, methods=["GET"]),
        Route("/runs/{run_id}", run_page, methods=["GET"]),
        Route("/runs/{run_id}/upgrade", run_upgrade, methods=["POST"]),
        Route("/runs/{run_id}/{what}", run_action, methods=["POST"]),
        Route("/effects", effects_page, methods=["GET"]),
        Route("/effects/{key_id}/resolve", effect_resolve, methods=["POST"]),
        Route("/approve/{token}", link_page, methods=["GET"]),
        Route("/approve/{token}", link_decide, methods=["POST"]),
        Route("/api/me", api_me, methods=["GET"]),
        Route("/api/approvals", api_approvals, methods=["GET"]),
        Route("/api/approvals/{run_id}/{name}/{decision}", api_decide, methods=["POST"]),
        Route("/api/runs", api_runs, methods=["GET"]),
        Route("/api/runs/{run_id}", api_run, methods=["GET"]),
        Route("/api/runs/{run_id}/upgrade", api_run_upgrade, methods=["POST"]),
        Route("/api/runs/{run_id}/{what}", api_run_action, methods=["POST"]),
        Route("/api/effects/in-doubt", api_in_doubt, methods=["GET"]),
        Route("/api/effects/{key_id}/resolve", api_resolve, methods=["POST"]),
        Mount("/static", StaticFiles(packages=[("onceonly.console", "static")]), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found})


# -- helpers -----------------------------------------------------------------------------


def _page_of(
    query: Callable[[int], tuple[list[T], int]], size: int, asked: int | None
) -> tuple[list[T], int, int, int]:
    """Page ``asked`` of ``query(offset) -> (rows, total)``: its rows, the page, the pages,
    the total. One query for the page asked (a page past the end: the last page, again)."""
    rows, total = query((max(1, asked or 1) - 1) * size)
    pg, count, offset = _queries.pages(total, size, asked)
    if not rows and total:
        rows, total = query(offset)
    return rows, pg, count, total


def _json_error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": code, "message": message}, status_code=status)


def _rn(exc: WaitRefused) -> tuple[str, str]:
    return exc.run_id, exc.name


def _int(value: Any) -> int | None:
    try:
        return None if value is None or value == "" else int(value)
    except (TypeError, ValueError):
        return None


def _hours(value: Any) -> float | None:
    """Hours given in a form, in seconds (None: not a finite number)."""
    try:
        h = float(value)
    except (TypeError, ValueError):
        return None
    return h * 3600.0 if math.isfinite(h) else None


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Denied(400, f"the value is not JSON ({exc.msg} at character {exc.pos})") from None


def _safe_next(request: Request, given: Any = None) -> str:
    nxt = str(given if given is not None else request.query_params.get("next", "/inbox"))
    # only a path on this site: never an open redirect
    if not nxt.startswith("/") or nxt.startswith("//") or "\\" in nxt:
        return "/inbox"
    return nxt


def _run_doc(r: Any) -> dict[str, Any]:
    return {
        "run_id": r.run_id,
        "flow": r.flow,
        "version": r.code_version,
        "status": r.status.value,
        "next_step": r.next_step,
        "lease_owner": r.lease_owner,
        "lease_expires_at": r.lease_expires_at,
        "handoff": r.handoff.to_doc(),
        "created_at": r.created_at,
        "updated_at": r.updated_at,
    }


def _effect_doc(e: Any) -> dict[str, Any]:
    return {
        "key_id": e.key_id,
        "run_id": e.run_id,
        "step_id": e.step_id,
        "effect": e.effect,
        "status": e.status.value,
        "provider_class": e.provider_class.value,
        "epoch": e.epoch,
        "attempts": e.attempts,
        "outcome_class": None if e.outcome_class is None else str(e.outcome_class),
        "created_at": e.created_at,
        "updated_at": e.updated_at,
        "integrity": e.integrity,
    }
