"""``python -m glmvit.cli.explorer_serve`` (``make explorer``): the budget explorer served by Voilà behind a token.

Voilà serves without authentication unless told otherwise; this wrapper always gives it a token: ``$JUPYTER_TOKEN``
(jupyter_server's variable, at least ``MIN_TOKEN_CHARS`` characters) or a random one, printed in the URL. The token
is set after Voilà has read every config file, so none can turn it off, and it is never put on a command line
(which every user of the machine can read). Every page, the kernel API and its websocket then ask for it (Voilà's
handlers are ``tornado.web.authenticated``; the websocket checks the same identity); its ``/voila/files/`` route,
which does not ask, is given nothing to serve. Voilà passes only widget (comm) messages to the kernel, never code to
execute, so what a token holder can do is what the widgets do; :mod:`glmvit.cli.explorer_files` bounds the file
fields. Over plain HTTP the token travels unencrypted: from another machine an SSH tunnel is safer than
``HOST=0.0.0.0``.
"""
from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

from .common import Parser
from .explorer_files import WORKSPACE_ENV

TOKEN_ENV = "JUPYTER_TOKEN"  # jupyter_server's variable for a chosen token
MIN_TOKEN_CHARS = 16
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "explorer.ipynb"

AUTH_WORDS = ("token", "password", "identity_provider", "authorizer", "file_allowlist")
# A page's kernel outlives the page (Voilà never shuts it down): a kernel with no page connected for KERNEL_IDLE_S is
# shut down, checked every KERNEL_CULL_INTERVAL_S (jupyter_server's culling; a --MappingKernelManager.cull_* option
# given to Voilà wins). A page left open keeps its kernel: connected kernels are never culled.
KERNEL_IDLE_S = 120
KERNEL_CULL_INTERVAL_S = 30
LOGIN_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>glmvit budget explorer: token needed</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto">
<h1>The budget explorer asks for its token</h1>
<p>Open the address that <code>make explorer</code> (<code>python -m glmvit.cli.explorer_serve</code>) printed when
it started: it ends in <code>?token=…</code>. If you chose the token yourself (<code>JUPYTER_TOKEN=… make
explorer</code>), enter it here.</p>
{message}
<form action="{action}" method="post">{xsrf}
<input type="password" name="password" autocomplete="off" autofocus size="40">
<button type="submit">Open the explorer</button>
</form></body></html>
"""


def explorer_token(environ: Any = os.environ) -> tuple[str, bool]:
    """(token, chosen): ``$JUPYTER_TOKEN`` if set (at least ``MIN_TOKEN_CHARS`` characters), else a random one."""
    chosen = environ.get(TOKEN_ENV)
    if chosen is None:
        return secrets.token_urlsafe(24), False
    if len(chosen.strip()) < MIN_TOKEN_CHARS:
        raise ValueError(f"{TOKEN_ENV} has {len(chosen.strip())} characters: the explorer needs a token of at least "
                         f"{MIN_TOKEN_CHARS} (an empty one would turn authentication off); make one with "
                         "python -c 'import secrets; print(secrets.token_urlsafe(24))'")
    return chosen.strip(), True


def build_server(argv: list[str], token: str) -> Any:
    """Voilà, initialised from ``argv`` (its own options), then made to require ``token`` on every page: set after
    every config file is read, so none can turn it off. Its ``/voila/files/`` route, which serves files without
    asking for a token, is given nothing to serve; the port is exact (no hopping to a free one the URL would miss)."""
    bad = [a for a in argv if any(word in a.lower() for word in AUTH_WORDS)]
    if bad:
        raise ValueError(f"{bad[0]}: the explorer sets its own authentication; choose the token with {TOKEN_ENV}=… "
                         "(a command line is visible to every user of the machine)")
    from voila.app import Voila

    app = Voila()
    app.initialize(argv)
    app.token, app.auto_token = token, False
    app.identity_provider_class = _explorer_identity_provider()
    app.voila_configuration.file_allowlist = []
    app.port_retries = 0
    culling = app.config.MappingKernelManager  # read when start() makes the kernel manager
    culling.setdefault("cull_idle_timeout", KERNEL_IDLE_S)
    culling.setdefault("cull_interval", KERNEL_CULL_INTERVAL_S)
    return app


def _explorer_identity_provider() -> type:
    """jupyter_server's token identity provider, whose login page (no token, or a wrong one) says where the token
    is, instead of Jupyter's generic page (which points at ``jupyter server list``, a command that does not list
    this server)."""
    import html
    from urllib.parse import quote

    from jupyter_server.auth.identity import PasswordIdentityProvider
    from voila.voila_identity_provider import VoilaLoginHandler

    class ExplorerLoginHandler(VoilaLoginHandler):
        def _render(self, message: Any = None) -> None:
            text = "" if not message else " ".join(str(m) for m in dict(message).values())
            shown = f"<p style='color: #a00'>{html.escape(text)}</p>" if text else ""
            action = f"{self.base_url}login?next={quote(self.get_argument('next', default=self.base_url), safe='')}"
            self.write(LOGIN_PAGE.format(message=shown, action=html.escape(action, quote=True),
                                         xsrf=self.xsrf_form_html()))

    class ExplorerIdentityProvider(PasswordIdentityProvider):
        def __init__(self, **kwargs: Any) -> None:
            kwargs["login_handler_class"] = ExplorerLoginHandler
            super().__init__(**kwargs)

    return ExplorerIdentityProvider


def server_urls(host: str, port: int, token: str, chosen: bool) -> list[str]:
    query = f"?token={'<your JUPYTER_TOKEN>' if chosen else token}"
    """Where to open the page: the address it listens on, or for every address this host's name and loopback."""
    hosts = [host] if host not in ("", "0.0.0.0", "::") else [socket.gethostname(), "127.0.0.1"]
    return [f"http://{h}:{port}/{query}" for h in hosts]


def main(argv: list[str] | None = None) -> int:
    """``python -m glmvit.cli.explorer_serve [NOTEBOOK] [VOILA OPTIONS as --name=value]``: serve the explorer."""
    parser = Parser(prog="python -m glmvit.cli.explorer_serve", description=(
        "Serve the budget explorer with Voilà behind a token: every page asks for it. The token is $JUPYTER_TOKEN "
        f"(at least {MIN_TOKEN_CHARS} characters) or a random one printed in the URL. File fields read and write "
        f"only in ${WORKSPACE_ENV} (default: this directory). Other options (--name=value) go to Voilà."))
    _, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not any(not a.startswith("-") for a in rest):
        if not NOTEBOOK.is_file():
            parser.error(f"{NOTEBOOK}: not found (run from a checkout, or name the notebook)")
        rest = [str(NOTEBOOK), *rest]
    try:
        token, chosen = explorer_token()
        os.environ.setdefault(WORKSPACE_ENV, str(Path.cwd()))  # kernels inherit it: their own cwd is notebooks/
        app = build_server(rest, token)
    except ValueError as err:
        parser.error(str(err))
    print("The budget explorer, behind a token (set your own with JUPYTER_TOKEN=… make explorer):", flush=True)
    for url in server_urls(app.ip, app.port, token, chosen):
        print(f"    {url}", flush=True)
    print(f"File fields read and write only in {os.environ[WORKSPACE_ENV]}. Plain HTTP: from another machine, "
          f"prefer an SSH tunnel (ssh -L {app.port}:127.0.0.1:{app.port} HOST) to HOST=0.0.0.0.", flush=True)
    app.start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
