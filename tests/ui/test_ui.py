"""The Prefect UI in a real browser: a shrunk `offline-nightly` run on a throwaway server, its pages rendered by
headless Chromium. Fails when the report's text or its inline loss curve is missing from the rendered page, and
saves screenshots under docs/. Run with `make ui-check` (it installs Chromium); `make test` skips it."""

from __future__ import annotations

import base64
import html
import re
import shutil
import subprocess

import pytest

from tests.deployment.server import ROOT, PrefectServer
from tests.flows.toy import ALL_STAGES, TOY

pytestmark = pytest.mark.ui

RUN_NAME = "offline · tiny gemma3 · lora r64"
REPORT_KEY = "offline-nightly-report"
CURVE_KEY = "offline-nightly-train-curve"  # the live training curve, made again at each eval (steps 2 and 4)
DOCS = ROOT / "docs"
# --virtual-time-budget lets the SPA fetch and render before the DOM is dumped or the page is shot;
# without --run-all-compositor-stages-before-draw, screenshots miss lazily shown parts (the artifact timeline).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--virtual-time-budget=20000",
    "--run-all-compositor-stages-before-draw",
    "--window-size=1400,1100",
]


def chromium(url: str, *args: str, profile, timeout: float = 180) -> str:
    """Headless Chromium on `url` with `args` (--dump-dom or --screenshot=FILE); its stdout."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed: run `make ui-check`, which installs it")
    done = subprocess.run(
        [exe, *FLAGS, f"--user-data-dir={profile}", *args, url], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"chromium exited {done.returncode} on {url}:\n{done.stderr[-3000:]}"
    return done.stdout


def render(url: str, screenshot: str, profile) -> str:
    """The page's DOM after its scripts ran (HTML entities decoded), and its screenshot saved as docs/<screenshot>."""
    DOCS.mkdir(exist_ok=True)
    chromium(url, f"--screenshot={DOCS / screenshot}", profile=profile)
    assert (DOCS / screenshot).stat().st_size > 10_000, f"{screenshot} looks empty"
    return html.unescape(chromium(url, "--dump-dom", profile=profile))


def assert_report(dom: str) -> None:
    """The rendered report: its heading, its before/after table, and the loss curve as an inline PNG image."""
    for text in ("jaxtune report", "eval loss"):
        assert text in dom, f"{text!r} is not on the rendered report page (see docs/ui-report.png)"
    images = re.findall(r'<img[^>]*\bsrc="data:image/png;base64,([^"]+)"', dom)
    assert images, "no inline PNG <img> (the loss curve) on the rendered report page"
    png = base64.b64decode(images[0])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1024, f"the loss curve is no real PNG ({len(png)} bytes)"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A completed shrunk offline-nightly run: (server, flow run, report artifact id, task run count)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    store = tmp_path_factory.mktemp("store")
    with PrefectServer() as server:
        server.deploy()
        flow_run_id = server.run_deployment(
            "offline-nightly", overrides=[*TOY, "train.eval_every=2", f"store.root={store}"]
        )
        server.work_once()
        with server.client_settings(), get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(flow_run_id)
            assert flow_run.state.is_completed(), f"{flow_run.state}\n{server.log('server')[-3000:]}"
            this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
            reports = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[REPORT_KEY])), flow_run_filter=this_run
            )
            task_runs = client.read_task_runs(flow_run_filter=this_run)
        assert len(reports) == 1, reports
        yield server, flow_run, reports[0].id, len(task_runs)


def test_report_page_shows_text_and_loss_curve(run, tmp_path):
    server, _, artifact_id, _ = run
    assert_report(render(f"{server.url}/artifacts/artifact/{artifact_id}", "ui-report.png", tmp_path))


def _curve_versions(server, flow_run) -> list:
    """The live curve's versions in this run, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    with server.client_settings(), get_client(sync_client=True) as client:
        versions = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[CURVE_KEY])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
        )
    return sorted(versions, key=lambda a: a.created)


def test_the_live_curve_shows_fewer_steps_mid_run_and_all_at_the_end(run, tmp_path):
    """What the curve's page showed while training ran (the version made at its first eval, step 2 of 4), and what it shows after."""
    server, flow_run, _, _ = run
    versions = _curve_versions(server, flow_run)
    assert len(versions) >= 2, "the curve was made again as training went"
    for version, screenshot, step in (
        (versions[0], "ui-train-curve-mid-run.png", 2),
        (versions[-1], "ui-train-curve.png", 4),
    ):
        dom = render(f"{server.url}/artifacts/artifact/{version.id}", screenshot, tmp_path)
        assert f"Training, step {step} of 4" in dom, (
            f"the curve at step {step} is not on its page (see docs/{screenshot})"
        )
        [image] = re.findall(r'<img[^>]*\bsrc="data:image/png;base64,([^"]+)"', dom)
        assert base64.b64decode(image).startswith(b"\x89PNG\r\n\x1a\n")
    dom = render(f"{server.url}/artifacts/key/{CURVE_KEY}", "ui-train-curve-key.png", tmp_path)
    assert all(f'href="/artifacts/artifact/{v.id}"' in dom for v in versions), "the curve's versions are not listed"


def test_flow_run_page_shows_run_state_and_stages(run, tmp_path):
    server, flow_run, _, task_runs = run
    dom = render(f"{server.url}/runs/flow-run/{flow_run.id}", "ui-flow-run.png", tmp_path)
    assert RUN_NAME in dom and flow_run.name == RUN_NAME
    assert re.search(r"state-badge state--completed.*?<span>Completed</span>", dom, re.S), "no Completed badge"
    assert f"{task_runs} Task runs" in dom
    # The graph is a canvas, so task run names reach the DOM only through the Logs tab (the default one).
    missing = [stage for stage in ALL_STAGES if f"{stage} · tiny gemma3 · lora r64" not in dom]
    assert not missing, f"task runs missing from the flow run page: {missing}"


def test_artifact_pages_list_the_run_s_artifacts(run, tmp_path):
    server, flow_run, artifact_id, _ = run
    dom = render(f"{server.url}/artifacts/key/{REPORT_KEY}", "ui-artifact-key.png", tmp_path)
    assert f'href="/artifacts/artifact/{artifact_id}"' in dom and RUN_NAME in dom, "report's versions not listed"
    dom = render(f"{server.url}/artifacts", "ui-artifacts.png", tmp_path)
    for key in (
        REPORT_KEY,
        "offline-nightly-metrics",
        "offline-nightly-train-progress",
        "offline-nightly-stages",
        "offline-nightly-stage-train",
        CURVE_KEY,
        "offline-nightly-train-latest",
    ):
        assert key in dom, f"{key} missing from the artifacts page"


def test_custom_run_form_offers_the_flows_typed_parameters(run, tmp_path):
    from prefect.client.orchestration import get_client

    server = run[0]
    with server.client_settings(), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("finetune/offline-nightly")
    dom = render(f"{server.url}/deployments/deployment/{deployment.id}/run", "ui-custom-run.png", tmp_path)
    # Each parameter is a field with its docstring's description (docs/ui-custom-run.png shows them filled in).
    for text in (
        "recipe (Optional)",
        "overrides (Optional)",
        "refresh (Optional)",
        "until (Optional)",
        "the last stage to run",
        "section.key=value",
        "stages to recompute",
    ):
        assert text in dom, f"{text!r} missing from the custom run form"
