"""No credential in any output: the secret filter of environment values, command lines and messages (issue 20,
item 7), unit by unit and end to end through findings.json and report.html."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.analysis_factory import TraceBuilder

from megatrace.trace.environment import filter_env

JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiJhbGljZSIsImV4cCI6MTc5OTk5OTk5OX0.c2lnbmF0dXJlLXNlY3JldA"
HOOK = "https://hooks.slack.com/services/T0AAAA/B0BBBB/hooksecret123"
SECRETS = {
    "SLURM_JWT": JWT,  # a token under an allowed prefix: Slurm's REST token
    "SLURM_OIDC_TOKEN": "oidc-secret-1",
    "SLURM_OIDC_REFRESH": "oidc-secret-2",
    "TORCH_HUB_COOKIE": "session=cookie-secret",
    "NCCL_PROXY_URL": "http://alice:pw-secret@proxy.example:3128/",  # credentials in a URL
    "MEGATRACE_ALERT_URL": HOOK,  # a webhook URL whose path is the token
    "NCCL_DEBUG_SUBSYS": f"Authorization: Bearer bearer-secret-xyz {JWT}",  # a value that carries a JWT
}
LEAKS = ("hooksecret123", "oidc-secret", "cookie-secret", "pw-secret", "bearer-secret", "c2lnbmF0dXJl", "argv-secret")


def test_each_kind_of_credential_is_dropped_or_masked() -> None:
    kept = filter_env({**SECRETS, "NCCL_DEBUG": "INFO", "SLURM_JOB_ID": "7"})
    assert kept["NCCL_DEBUG"] == "INFO" and kept["SLURM_JOB_ID"] == "7"
    for name in ("SLURM_JWT", "SLURM_OIDC_TOKEN", "SLURM_OIDC_REFRESH", "TORCH_HUB_COOKIE"):
        assert name not in kept, name  # named like a credential: not recorded at all
    assert kept["NCCL_PROXY_URL"] == "http://proxy.example:3128/<redacted>"
    assert kept["MEGATRACE_ALERT_URL"] == "https://hooks.slack.com/<redacted>"
    assert kept["NCCL_DEBUG_SUBSYS"] == "Authorization: Bearer <redacted> <redacted>"
    assert not any(leak in json.dumps(kept) for leak in LEAKS)


def test_command_line_options_that_are_credentials_are_masked() -> None:
    from megatrace.redact import redact_argv

    assert redact_argv(["train.py", "--hf-token=argv-secret", "--api-key", "argv-secret", "--lr", "0.1",
                        f"--resume={HOOK}", "--data", "/scratch/run-123/iter_0001000"]) == [
        "train.py", "--hf-token=<redacted>", "--api-key", "<redacted>", "--lr", "0.1",
        "--resume=https://hooks.slack.com/<redacted>", "--data", "/scratch/run-123/iter_0001000"]


def test_no_credential_of_the_traced_job_reaches_findings_json_or_report_html(tmp_path: Path) -> None:
    from megatrace.cli import main

    b = TraceBuilder(world=2, hosts={0: "h0", 1: "h1"})
    g = b.group("dp", [0, 1])
    b.healthy_steps([g], steps=3)
    b.write(tmp_path, closed=True)
    for rank in range(2):
        with open(tmp_path / "rings" / f"rank-0000{rank}.meta.jsonl", "a") as fh:
            fh.write(json.dumps({"kind": "process", "argv": ["train.py", "--token=argv-secret", HOOK]}) + "\n")
            fh.write(json.dumps({"kind": "env", "vars": {**SECRETS, "NCCL_DEBUG": "INFO"}}) + "\n")
    try:
        main(["analyze", str(tmp_path)])
    except SystemExit as exc:
        assert exc.code in (0, None, 3), exc.code
    for name in ("findings.json", "report.html"):
        text = (tmp_path / name).read_text()
        assert "NCCL_DEBUG" in text or name == "report.html"
        found = [leak for leak in LEAKS if leak in text]
        assert not found, (name, found)
