"""`yieldgate keys ...` and `yieldgate spend`: clients of a running gateway's admin API.

The gateway URL and admin token come from --url / --admin-token, else the config file and its
YIELDGATE_* environment overrides (YIELDGATE_SERVER__ADMIN_TOKEN, server.host / server.port).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from .config import ConfigError, load_config

keys_app = typer.Typer(help="API keys of a running gateway (admin API).", no_args_is_help=True)
console = Console(stderr=True)
out = Console()

ConfigOpt = typer.Option(None, "--config", "-c", help="TOML config file (gateway URL, admin token).")
UrlOpt = typer.Option(None, "--url", envvar="YIELDGATE_URL", help="Gateway base URL.")
TokenOpt = typer.Option(None, "--admin-token", envvar="YIELDGATE_ADMIN_TOKEN", help="Admin bearer token.")


class AdminClient:
    def __init__(self, url: str, token: str, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                query: dict[str, str] | None = None) -> bytes:
        url = self.url + path
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v})
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method, headers={
            "authorization": f"Bearer {self.token}", "content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            console.print(f"[red]{method} {path}: HTTP {exc.code}: {detail}[/red]")
            raise typer.Exit(1) from None
        except OSError as exc:
            console.print(f"[red]cannot reach the gateway at {self.url}: {exc}[/red]")
            raise typer.Exit(1) from None

    def json(self, method: str, path: str, body: dict[str, Any] | None = None,
             query: dict[str, str] | None = None) -> Any:
        return json.loads(self.request(method, path, body, query))


def client(config: Optional[Path], url: Optional[str], token: Optional[str]) -> AdminClient:
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    host = cfg.server.host if cfg.server.host not in ("0.0.0.0", "::") else "127.0.0.1"
    token = token or cfg.server.admin_token
    if not token:
        console.print("[red]no admin token: pass --admin-token or set YIELDGATE_ADMIN_TOKEN[/red]")
        raise typer.Exit(2)
    return AdminClient(url or f"http://{host}:{cfg.server.port}", token)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def to_since(value: Optional[str]) -> str:
    """"24h", "7d" -> unix seconds that long ago; anything else (ISO, unix) goes to the server."""
    if not value:
        return ""
    m = _DURATION.match(value.strip())
    if m:
        return repr(time.time() - float(m.group(1)) * _UNIT_S[m.group(2)])
    return value


@keys_app.command("create")
def keys_create(
    team: str = typer.Option("", help="Team the key bills to."),
    name: str = typer.Option("", help="Human-readable name."),
    budget_usd: Optional[str] = typer.Option(None, "--budget-usd", help="Budget in USD, e.g. 25.00."),
    budget_kind: str = typer.Option("hard", help="hard (reject) or soft (flag only)."),
    budget_period: str = typer.Option("monthly", help="daily, monthly or total."),
    rpm: Optional[int] = typer.Option(None, help="Requests per minute."),
    tpm: Optional[int] = typer.Option(None, help="Tokens per minute."),
    config: Optional[Path] = ConfigOpt, url: Optional[str] = UrlOpt, admin_token: Optional[str] = TokenOpt,
) -> None:
    """Create an API key; prints the secret (shown once) on stdout."""
    body = {"team": team, "name": name, "budget_usd": budget_usd, "budget_kind": budget_kind,
            "budget_period": budget_period, "rpm": rpm, "tpm": tpm}
    created = client(config, url, admin_token).json(
        "POST", "/admin/keys", {k: v for k, v in body.items() if v is not None})
    key = created["key"]
    console.print(f"created key [bold]{key['id']}[/bold] (team {key['team'] or '-'}); "
                  "the secret below is shown once:")
    out.print(created["secret"], soft_wrap=True)


@keys_app.command("list")
def keys_list(
    team: Optional[str] = typer.Option(None, help="Only this team."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    config: Optional[Path] = ConfigOpt, url: Optional[str] = UrlOpt, admin_token: Optional[str] = TokenOpt,
) -> None:
    """List API keys with budget use in the current period."""
    data = client(config, url, admin_token).json("GET", "/admin/keys", query={"team": team or ""})["data"]
    if as_json:
        out.print_json(data=data)
        return
    table = Table("id", "team", "name", "budget", "spent", "remaining", "rpm", "tpm", "status")
    for entry in data:
        k, b = entry["key"], entry.get("budget") or {}
        budget = "-" if k["budget_usd"] is None else f"${k['budget_usd']} {k['budget_kind']}/{k['budget_period']}"
        table.add_row(k["id"], k["team"], k["name"], budget, _money(b.get("spent_usd")),
                      _money(b.get("remaining_usd")), str(k["rpm"] or "-"), str(k["tpm"] or "-"),
                      "revoked" if k["revoked"] else "active")
    out.print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: str = typer.Argument(..., help="Key id (the part after 'yg-' in the secret)."),
    config: Optional[Path] = ConfigOpt, url: Optional[str] = UrlOpt, admin_token: Optional[str] = TokenOpt,
) -> None:
    """Revoke a key; every gateway refuses it within pricing.limits.key_cache_ttl_s."""
    client(config, url, admin_token).json("DELETE", f"/admin/keys/{urllib.parse.quote(key_id)}")
    console.print(f"revoked {key_id}")


def spend(
    group_by: str = typer.Option("key,team", "--group-by", help="Comma-separated: key, team, model, "
                                 "tier, replica, weight_version, session_id, status, day."),
    since: Optional[str] = typer.Option(None, help="24h, 7d, ISO 8601 or unix seconds."),
    until: Optional[str] = typer.Option(None, help="ISO 8601 or unix seconds."),
    csv: bool = typer.Option(False, "--csv", help="Print CSV instead of a table."),
    focus: bool = typer.Option(False, "--focus", help="Print the FinOps FOCUS billing CSV: charges per key, "
                               "team, model, tier, weight version and day (--group-by does not apply)."),
    config: Optional[Path] = ConfigOpt, url: Optional[str] = UrlOpt, admin_token: Optional[str] = TokenOpt,
) -> None:
    """Spend and tokens from the gateway's ledger, grouped."""
    groups = ",".join("key_id" if g.strip() == "key" else g.strip() for g in group_by.split(","))
    query = {"group_by": groups, "since": to_since(since), "until": to_since(until) if until else ""}
    api = client(config, url, admin_token)
    if focus:
        query.pop("group_by")
        out.file.write(api.request("GET", "/admin/billing/focus.csv", query=query).decode())
        return
    if csv:
        out.file.write(api.request("GET", "/admin/spend.csv", query=query).decode())
        return
    report = api.json("GET", "/admin/spend", query=query)
    cols = report["group_by"]
    table = Table(*cols, "requests", "errors", "prompt", "cached", "completion", "cost USD",
                  title=f"total ${_money(report['total_usd'])} over {report['requests']} requests")
    for row in report["rows"]:
        table.add_row(*(row["group"].get(c) or "-" for c in cols), str(row["requests"]), str(row["errors"]),
                      str(row["prompt_tokens"]), str(row["cached_tokens"]), str(row["completion_tokens"]),
                      _money(row["cost_total"]))
    out.print(table)


def _money(value: Any) -> str:
    if value is None:
        return "-"
    return f"{float(value):.6f}".rstrip("0").rstrip(".") or "0"
