"""``onceonly console``: serve the web console, and manage its accounts and API tokens.

Only click is imported at module level; serving imports the console's extra."""

from __future__ import annotations

import ipaddress
import sys
from typing import TYPE_CHECKING

import click

from ._common import open_store, operator, url_option

if TYPE_CHECKING:
    from onceonly.flow import Flow

__all__ = ["console", "is_loopback", "read_password"]

ROLES = ("viewer", "approver", "operator", "admin")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def read_password() -> str:
    """The new user's password: prompted twice (hidden) on a terminal, else the first
    line of stdin. Never an argument: arguments show in process lists and histories."""
    if sys.stdin.isatty():
        return str(click.prompt("password", hide_input=True, confirmation_prompt=True))
    return sys.stdin.readline().rstrip("\r\n")


@click.group("console", invoke_without_command=True)
@url_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="Listen on a non-loopback address (put TLS in front of it).",
)
@click.option(
    "--trusted-header",
    default=None,
    metavar="HEADER",
    help="SSO: the identity header a proxy in front sets (e.g. X-Forwarded-User).",
)
@click.option(
    "--trusted-proxy",
    "trusted_proxies",
    multiple=True,
    metavar="ADDR",
    help="SSO: a client address the identity header is accepted from (repeatable).",
)
@click.option("--secure-cookies", is_flag=True, help="Mark cookies Secure (served over TLS).")
@click.option(
    "--flows",
    "flows_specs",
    multiple=True,
    metavar="MODULE:ATTR",
    help="The deployed Flow(s), as the worker takes them: runs of another version are "
    "offered an upgrade to theirs (repeatable).",
)
@click.pass_context
def console(
    ctx: click.Context,
    url: str | None,
    host: str,
    port: int,
    allow_remote: bool,
    trusted_header: str | None,
    trusted_proxies: tuple[str, ...],
    secure_cookies: bool,
    flows_specs: tuple[str, ...],
) -> None:
    """Serve the operator console (approvals inbox, runs, effects in doubt).

    It listens on 127.0.0.1 unless --host names another address and --allow-remote is
    given; then TLS belongs in front of it (a reverse proxy). Sign in with a user added
    by `onceonly console user add`. Needs $ONCEONLY_SECRETS (it acts as the operators).
    With --flows, a run page offers to upgrade a run of another version of a flow to the
    deployed one (as `onceonly runs upgrade` does); without, upgrades are done there.
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = url
        return
    from onceonly.console import RemoteBindRefused  # noqa: PLC0415

    if not is_loopback(host) and not allow_remote:
        raise RemoteBindRefused(host)
    if trusted_header and not trusted_proxies:
        raise click.UsageError("--trusted-header needs --trusted-proxy ADDR (the proxy's)")
    from . import load_flows  # noqa: PLC0415  (imports the deployment's code)

    flows = [f for spec in flows_specs for f in load_flows(spec)]
    _serve(url, host, port, trusted_header, trusted_proxies, secure_cookies, flows)


def _serve(
    url: str | None,
    host: str,
    port: int,
    trusted_header: str | None,
    trusted_proxies: tuple[str, ...],
    secure_cookies: bool,
    flows: list[Flow],
) -> None:
    import socket  # noqa: PLC0415

    from onceonly.console import ConsoleConfig, create_app, link_key, session_key  # noqa: PLC0415
    from onceonly.ledger import Keyring  # noqa: PLC0415

    with operator(url) as op:
        ring = Keyring.from_env()
        app = create_app(
            op,
            ConsoleConfig(
                session_key=session_key(ring),
                link_key=link_key(ring),
                trusted_header=trusted_header,
                trusted_proxies=frozenset(trusted_proxies),
                secure_cookies=secure_cookies,
            ),
            flows=flows,
        )
        import uvicorn  # noqa: PLC0415

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        if not is_loopback(host):
            click.echo(
                f"listening on {host}, beyond this machine: put TLS (a reverse proxy) in front",
                err=True,
            )
        click.echo(f"onceonly console on http://{shown}:{bound}/ (Ctrl-C stops it)", err=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        server.run(sockets=[sock])


@console.group("user")
def user() -> None:
    """Console accounts: add, list, remove."""


@user.command("add")
@click.argument("name")
@click.option("--role", type=click.Choice(ROLES), required=True, help="What the user may do.")
@click.option(
    "--flows",
    "grants",
    multiple=True,
    metavar="FLOW[:APPROVAL]",
    help="Approvers: a flow (or one approval of it, or *) they may decide (repeatable).",
)
@click.option("--sso", is_flag=True, help="No password: the user signs in through the SSO proxy.")
@click.pass_obj
def user_add(url: str | None, name: str, role: str, grants: tuple[str, ...], sso: bool) -> None:
    """Add a console user. The password is read from the terminal (twice, hidden) or
    from the first line of stdin, never from an argument."""
    from onceonly.console import Accounts  # noqa: PLC0415

    password = None if sso else read_password()
    if role == "approver" and not grants:
        click.echo(
            "note: an approver without --flows may decide nothing; grant FLOW, FLOW:APPROVAL or *",
            err=True,
        )
    with open_store(url) as store:
        Accounts(store).add(name, role, password, grants=grants)
    click.echo(f"added {name} ({role}{': ' + ', '.join(grants) if grants else ''})")


@user.command("list")
@click.pass_obj
def user_list(url: str | None) -> None:
    """List the console users, their roles and grants."""
    from onceonly.console import Accounts  # noqa: PLC0415

    with open_store(url) as store:
        for u in Accounts(store).users():
            click.echo(f"{u.name}\t{u.role.value}\t{','.join(u.grants) or '-'}")


@user.command("remove")
@click.argument("name")
@click.pass_obj
def user_remove(url: str | None, name: str) -> None:
    """Remove a console user and their API tokens."""
    from onceonly.console import Accounts  # noqa: PLC0415

    with open_store(url) as store:
        Accounts(store).remove(name)
    click.echo(f"removed {name}")


@console.group("token")
def token() -> None:
    """API tokens for bots (each acts as a console user)."""


@token.command("add")
@click.argument("name")
@click.option("--label", default="", help="What the token is for (e.g. slack-bot).")
@click.pass_obj
def token_add(url: str | None, name: str, label: str) -> None:
    """Create an API token acting as user NAME; it is printed once (keep it secret)."""
    from onceonly.console import Accounts  # noqa: PLC0415

    with open_store(url) as store:
        click.echo(Accounts(store).add_token(name, label))
