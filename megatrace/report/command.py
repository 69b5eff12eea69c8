"""``megatrace report FINDINGS_JSON [-o report.html]``: re-render the post-mortem from findings.json.

Only click is imported at module load (``megatrace --help`` stays fast); the renderer (jinja2) is imported
inside the command.
"""

from __future__ import annotations

from pathlib import Path

import click


class ReportCommandError(click.ClickException):
    """A user-facing error: one 'Error:' line, exit status 1."""


def write_report_files(findings_json: str | Path, out: str | Path | None = None,
                       trace: bool = True) -> tuple[Path, Path | None]:
    """Render ``findings_json`` into ``out`` (default: ``report.html`` beside it) and ``trace.json``;
    a :class:`ReportCommandError` on any problem (unreadable input, unwritable output)."""
    from megatrace.report.render import ReportError, write_report

    try:
        return write_report(findings_json, out, trace=trace)
    except ReportError as exc:
        raise ReportCommandError(str(exc)) from None
    except OSError as exc:
        target = out or Path(findings_json).with_name("report.html")
        raise ReportCommandError(f"cannot write the report {target}: {exc.strerror or exc}") from None


@click.command("report", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
               epilog="""\b
Examples:
  megatrace report megatrace-demo-hang/findings.json
  megatrace report out/findings.json -o /tmp/job-1234.html --no-trace
""")
@click.argument("findings_json", type=click.Path(dir_okay=False, path_type=str))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Where to write the report [default: report.html beside FINDINGS_JSON].")
@click.option("--trace/--no-trace", default=True, show_default=True,
              help="Also write the incident window as a Chrome/Perfetto trace (trace.json beside the report).")
def report(findings_json: str, out: str | None, trace: bool) -> None:
    """Render the post-mortem HTML report of an analysis from its findings.json.

    FINDINGS_JSON is what `megatrace analyze` wrote. The report is one self-contained HTML
    file (nothing is fetched when it is opened): the verdict first, then the culprits, the
    wait-for chain, the timeline around the incident, the critical path, stragglers and
    slow links, every finding and the job's facts.
    """
    html, trace_path = write_report_files(findings_json, out, trace)
    click.echo(f"report: {html}", err=True)
    if trace_path is not None:
        click.echo(f"trace: {trace_path}", err=True)
