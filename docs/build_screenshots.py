#!/usr/bin/env python
"""Screenshots of the MLflow UI showing the draft registry, for docs/registry.md.

Populates a demo registry (clusters ``code`` and ``prose``, four versions each, with a
promotion, a gate rejection and a rollback), starts ``mlflow server`` on it, and takes
headless-Chromium screenshots of three pages:

- ``registry_models.png``   the registered models list (``draft-code``, ``draft-prose``, aliases);
- ``registry_versions.png`` the ``draft-code`` model page (versions table with aliases);
- ``registry_version.png``  one version page (``draft-code`` v3: its tags: lineage, gate, tokenizer hash).

Needs Chromium (Debian: ``apt-get install chromium``); this script installs nothing.

    .venv/bin/python docs/build_screenshots.py                 # demo registry -> docs/img/
    .venv/bin/python docs/build_screenshots.py --store-uri sqlite:////abs/.specops/registry/mlflow.db
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("build_screenshots")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "img"
MAX_BYTES = 400_000


@dataclass(frozen=True)
class Page:
    """One screenshot: a UI route (MLflow's UI is a hash-routed React app), a JS condition that
    is true once it has rendered, and UI elements to click first (JS expressions, in order)."""

    name: str
    route: str
    ready: str
    clicks: tuple[str, ...] = ()


def _section_header(title: str) -> str:
    return f"[...document.querySelectorAll('[aria-expanded=true]')].find(e => e.innerText.trim().startsWith('{title}'))"


PAGES = [
    # the models list shows one alias per model and a "+N" menu for the others: open the last one
    Page(
        "registry_models.png",
        "#/models",
        "document.querySelector('a[href*=\"/models/{model}\"]')",
        (
            "[...document.querySelectorAll('button[aria-haspopup=menu]')].filter(b => /^\\+\\d+$/.test(b.innerText.trim())).pop()",
        ),
    ),
    # a model's page: fold its description and tags so the versions table comes first
    Page(
        "registry_versions.png",
        "#/models/{model}",
        "document.querySelector('a[href*=\"/versions/1\"]')",
        (_section_header("Description"), _section_header("Tags")),
    ),
    # a version's page: its tags (the schema section below them is always empty for drafts)
    Page(
        "registry_version.png",
        "#/models/{model}/versions/{version}",
        "document.body.innerText.includes('tokenizer_sha256')",
        (_section_header("Schema"),),
    ),
]

ROLLBACK_REASON = "live acceptance 0.41 < 0.47 - 0.02 over 200 requests"

# localStorage the UI reads (``<key>_v<version>``, JSON): no promo modal, no assistant side panel,
# the "Model training" side bar
UI_STATE = {
    "_mlflow_model_registry_promo_modal_dismissed_v1": True,
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
    "mlflow.assistant.panelOpen_v1": False,
    "mlflow.workflowType_v1": "machine_learning",
}

# let inner scroll boxes (a version's tag table) show everything; return the height the page
# needs to show all of its content pane without scrolling
EXPAND_JS = """(() => {
  const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowY);
  let full = document.documentElement.scrollHeight;
  for (const el of document.querySelectorAll('*')) {
    if (!scrolls(el) || el.scrollHeight <= el.clientHeight + 2) continue;
    if (el.clientHeight < window.innerHeight * 0.6) {
      el.style.maxHeight = 'none'; el.style.height = 'auto'; el.style.overflowY = 'visible';
    }
  }
  for (const el of document.querySelectorAll('*'))
    if (scrolls(el) && el.scrollHeight > el.clientHeight + 2)
      full = Math.max(full, window.innerHeight + el.scrollHeight - el.clientHeight);
  return full;
})()"""

# the bottom of the content: the lowest visible leaf in the main pane (the largest scroll box),
# or of an open menu; the screenshot is cut there
BOTTOM_JS = """(() => {
  let pane = document.body, best = 0;
  for (const el of document.querySelectorAll('*')) {
    if (!['auto', 'scroll'].includes(getComputedStyle(el).overflowY)) continue;
    const r = el.getBoundingClientRect();
    if (r.width * r.height > best) { best = r.width * r.height; pane = el; }
  }
  let bottom = 0;
  for (const el of pane.querySelectorAll('*')) {
    if (el.children.length) continue;
    const r = el.getBoundingClientRect();
    if (r.width && r.height && getComputedStyle(el).visibility !== 'hidden') bottom = Math.max(bottom, r.bottom);
  }
  for (const m of document.querySelectorAll('[role=menu]')) bottom = Math.max(bottom, m.getBoundingClientRect().bottom);
  return Math.ceil(bottom);
})()"""


# ---------------------------------------------------------------- demo registry
def populate(data_dir: Path) -> str:
    """Build the demo registry under ``data_dir``; return its store URI."""
    sys.path.insert(0, str(ROOT))
    from specops.registry import RegistryConfig, RegistryStore, decide
    from specops.trainer.bootstrap import run as bootstrap

    models = data_dir / "bootstrap"
    t0 = time.perf_counter()
    manifest = bootstrap(models, tiny=True)
    log.info("tiny bootstrap at %s (%.1fs)", models, time.perf_counter() - t0)
    draft, tok_sha = models / "draft", manifest["tokenizer_sha256"]

    # explicit URI and artifact root: $SPECOPS_REGISTRY_URI must never send demo versions to a real registry
    db = data_dir / "registry" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    cfg = RegistryConfig.default(data_dir=data_dir, uri=f"sqlite:///{db}", artifact_root=str(db.parent / "artifacts"))
    store = RegistryStore(cfg)
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # MLflow sets its own level on import

    # per cluster: (sampling, greedy) offline acceptance of v1..v4; the gate compares sampling
    story = {
        "code": [(0.512, 0.604), (0.516, 0.611), (0.571, 0.662), (0.574, 0.659)],
        "prose": [(0.401, 0.463), (0.395, 0.455), (0.448, 0.517), (0.487, 0.552)],
    }
    for cluster, scores in story.items():
        champion: tuple[str, float] | None = None
        offset = 0
        for i, (sampling, greedy) in enumerate(scores, start=1):
            n = 120 + 40 * i
            offsets = {"0": [offset, offset + n - 1], "1": [offset // 2, offset // 2 + n // 2 - 1]}
            offset += n
            dv = store.artifact("draft").register(
                cluster,
                draft,
                tokenizer_sha256=tok_sha,
                metrics={"offline_acceptance_sampling": sampling, "offline_acceptance_greedy": greedy},
                lineage={"topic": "spec.misses", "offsets": offsets},
                parent_version=champion[0] if champion else None,
                source_id=f"online-{cluster}-step{500 * i}",
                params={"lr": 2e-4, "steps": 500, "batch_size": 16, "loss": "kl+ce", "cluster": cluster},
            )
            if cluster == "code" and i == 4:
                continue  # the newest challenger: not gated yet
            result = decide(
                dv.version,
                champion[0] if champion else None,
                sampling,
                champion[1] if champion else None,
                margin=0.01,
                num_positions=300,
                min_positions=32,
            )
            if store.artifact("draft").apply_gate(cluster, result) is not None:
                champion = (dv.version, sampling)
        # live acceptance as reported by serving, for the champion (and prose v4 before its rollback)
        live = {"code": [0.55, 0.56, 0.558, 0.562], "prose": [0.47, 0.468, 0.472, 0.471]}[cluster]
        if cluster == "prose":
            for step, value in enumerate([0.45, 0.43, 0.41]):
                store.artifact("draft").log_metric(cluster, "4", "live_acceptance", value, step=step)
            store.artifact("draft").rollback(cluster, reason=ROLLBACK_REASON)
        for step, value in enumerate(live):
            store.artifact("draft").log_metric(cluster, "3", "live_acceptance", value, step=step)
    drafts = store.artifact("draft")
    log.info("demo registry: %s", {c: drafts.aliases(c) for c in drafts.keys()})
    return cfg.uri


# ---------------------------------------------------------------- mlflow server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mlflow_exe() -> str:
    exe = Path(sys.executable).parent / "mlflow"
    if exe.exists():
        return str(exe)
    found = shutil.which("mlflow")
    if not found:
        sys.exit("error: no `mlflow` executable next to this Python or on PATH; run `make venv` first")
    return found


@contextlib.contextmanager
def mlflow_server(uri: str, port: int, workdir: Path, timeout_s: float) -> Iterator[str]:
    """``mlflow server`` on ``uri``; yields its base URL once /health answers OK. Always stopped."""
    cmd = [
        mlflow_exe(),
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--no-serve-artifacts",
        "--default-artifact-root",
        str(workdir / "server-artifacts"),
    ]
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    logfile = workdir / "mlflow-server.log"
    log.info("starting %s", " ".join(cmd))
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{_tail(logfile)}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200 and resp.read().strip() == b"OK":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server not healthy after {timeout_s:.0f}s:\n{_tail(logfile)}")
            time.sleep(0.5)
        log.info("mlflow server up at %s", base)
        yield base
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # its own session: uvicorn/gunicorn workers go too
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.info("mlflow server stopped")


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no server log)"


# ---------------------------------------------------------------- chromium
def find_chromium(arg: str | None) -> str:
    for cand in [arg] if arg else ["chromium", "chromium-browser", "google-chrome"]:
        path = shutil.which(cand) or (cand if Path(cand).is_file() and os.access(cand, os.X_OK) else None)
        if path:
            return path
    sys.exit(
        f"error: Chromium not found ({arg or 'chromium'}). Install it (Debian/Ubuntu: "
        "`sudo apt-get install chromium`) or pass --chromium /path/to/chromium"
    )


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    fd 3 carries commands in, fd 4 replies out, NUL-separated JSON), so no websocket library
    and no Selenium/Playwright are needed."""

    def __init__(self, chromium: str, profile: Path, size: tuple[int, int]) -> None:
        cmd = [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-sync",
            "--disable-background-networking",
            "--disable-component-update",
            "--mute-audio",
            "--force-device-scale-factor=1",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            "about:blank",
        ]
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:  # in the child, before exec: the pipe ends on fds 3 and 4
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.log = profile.parent / "chromium.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                pass_fds=(3, 4),
                preexec_fn=fds,
                start_new_session=True,
            )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None
        try:
            targets = self.send("Target.getTargets")["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            self.session = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True, _session=False)[
                "sessionId"
            ]
            self.send("Page.enable")
            self.resize(*size)
        except BaseException:
            self.close()
            raise

    def send(self, method: str, _session: bool = True, _timeout: float = 60.0, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if _session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + _timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"chromium: {method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise TimeoutError(f"chromium: no reply to {method} in {_timeout:.0f}s")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited ({self.proc.poll()}):\n{_tail(self.log)}")
            self._buf += chunk

    def eval(self, expr: str):
        res = self.send("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"chromium: JS error in {expr[:80]!r}: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    def resize(self, width: int, height: int) -> None:
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url="about:blank")
        self.send("Page.navigate", url=url)

    def wait_for(self, expr: str, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.eval(f"(() => {{ try {{ return Boolean({expr}); }} catch (e) {{ return false; }} }})()"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page did not render {what} in {timeout_s:.0f}s")
            time.sleep(0.25)

    def click(self, target: str) -> bool:
        """A real mouse click (React/Radix menus ignore element.click()) on the centre of the
        element ``target`` (a JS expression) evaluates to; False when there is none."""
        pos = self.eval(
            f"(() => {{ const el = {target}; if (!el) return null; el.scrollIntoView({{block: 'center'}});"
            " const r = el.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        if not pos:
            return False
        x, y = pos
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", buttons=1, clickCount=1)
        return True

    def screenshot(self, out: Path, clip: tuple[int, int] | None = None) -> None:
        params: dict = {"format": "png"}
        if clip:
            params["clip"] = {"x": 0, "y": 0, "width": clip[0], "height": clip[1], "scale": 1}
        data = self.send("Page.captureScreenshot", **params)["data"]
        out.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", _session=False, _timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)


def shrink(path: Path, max_bytes: int) -> None:
    """Re-encode ``path`` as an optimised palette PNG if it is over ``max_bytes`` (needs Pillow)."""
    size = path.stat().st_size
    try:
        from PIL import Image
    except ImportError:
        if size > max_bytes:
            log.warning(
                "%s is %d KB (> %d KB) and Pillow is not installed to shrink it", path, size // 1000, max_bytes // 1000
            )
        return
    with Image.open(path) as im:
        im.load()
        rgb = im.convert("RGB")
    tmp = path.with_suffix(".tmp.png")
    for colors in (256, 128, 64):
        rgb.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(tmp, optimize=True)
        if tmp.stat().st_size <= max_bytes:
            break
    if tmp.stat().st_size < size:
        tmp.replace(path)
    else:
        tmp.unlink()
    log.info("%s: %d KB -> %d KB", path.name, size // 1000, path.stat().st_size // 1000)


def shoot(browser: Browser, base: str, args: argparse.Namespace, size: tuple[int, int]) -> list[Path]:
    browser.goto(f"{base}/")
    browser.eval(
        ";".join(f"localStorage.setItem({json.dumps(k)}, {json.dumps(json.dumps(v))})" for k, v in UI_STATE.items())
    )
    written = []
    for page in PAGES:
        out = args.out_dir / page.name
        url = f"{base}/{page.route.format(model=args.model, version=args.version)}"
        t0 = time.perf_counter()
        browser.resize(*size)
        browser.goto(url)
        browser.wait_for(page.ready.replace("{model}", args.model), args.render_timeout, url)
        time.sleep(args.settle)  # late requests (aliases, run links), fonts, layout
        for target in page.clicks:
            if not browser.click(target):
                log.warning("%s: nothing to click for %s", url, target[:80])
            time.sleep(0.7)
        # grow the viewport to fit; the extra keeps the floating assistant button below the cut
        full = max(min(int(browser.eval(EXPAND_JS)), args.max_height), size[1])
        browser.resize(size[0], full + 120)
        time.sleep(0.7)
        height = min(int(browser.eval(BOTTOM_JS)) + 16, full)
        browser.screenshot(out, clip=(size[0], height))
        log.info("%s -> %s (%dx%d, %.1fs)", url, out, size[0], height, time.perf_counter() - t0)
        shrink(out, args.max_kb * 1000)
        written.append(out)
    return written


# ---------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--data-dir",
        type=Path,
        help="where to build the demo registry, kept and reused by later runs "
        "(default: a temp dir, removed afterwards)",
    )
    src.add_argument(
        "--store-uri",
        help="screenshot this existing MLflow store instead of a demo (e.g. sqlite:////abs/mlflow.db); "
        "this script writes nothing to it",
    )
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help=f"where the PNGs go (default: {DEFAULT_OUT})")
    p.add_argument(
        "--model", default="draft-code", help="registered model for the versions page (default: %(default)s)"
    )
    p.add_argument("--version", default="3", help="version of --model for the version page (default: %(default)s)")
    p.add_argument("--chromium", help="Chromium binary (default: `chromium` on PATH)")
    p.add_argument("--port", type=int, default=0, help="port for mlflow server (default: a free one)")
    p.add_argument("--window-size", default="1440,900", help="browser viewport W,H (default: %(default)s)")
    p.add_argument(
        "--max-height",
        type=int,
        default=3200,
        help="grow the viewport to fit a long page, up to this height (default: %(default)s)",
    )
    p.add_argument(
        "--render-timeout",
        type=float,
        default=60.0,
        help="seconds a page gets to render its content (default: %(default)s)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds to wait after content appears, before the screenshot (default: %(default)s)",
    )
    p.add_argument(
        "--server-timeout",
        type=float,
        default=90.0,
        help="seconds to wait for mlflow server's /health (default: %(default)s)",
    )
    p.add_argument(
        "--max-kb", type=int, default=MAX_BYTES // 1000, help="shrink PNGs above this (default: %(default)s)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("alembic", "mlflow", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    chromium = find_chromium(args.chromium)
    w, h = (int(x) for x in args.window_size.split(","))
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="specops-screenshots-"))
    try:
        if args.store_uri:
            uri = args.store_uri
        else:
            data_dir = (args.data_dir or work / "data").resolve()
            db = data_dir / "registry" / "mlflow.db"
            if db.exists():  # a --data-dir populated by an earlier run: populating again would add versions
                log.info("reusing the demo registry at %s (delete it to rebuild)", db)
                uri = f"sqlite:///{db}"
            else:
                data_dir.mkdir(parents=True, exist_ok=True)
                uri = populate(data_dir)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        with mlflow_server(uri, args.port or free_port(), work, args.server_timeout) as base:
            browser = Browser(chromium, work / "chromium-profile", (w, h))
            try:
                written = shoot(browser, base, args, (w, h))
            finally:
                browser.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("done in %.0fs", time.perf_counter() - t0)
    for out in written:
        print(f"wrote {out} ({out.stat().st_size // 1000} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
