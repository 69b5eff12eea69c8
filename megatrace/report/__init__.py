"""Stage 4, the post-mortem report: ``findings.json`` → one self-contained ``report.html`` (+ ``trace.json``).

``render`` (page and files), ``model`` (the view model from the findings document), ``graph`` (wait-for
graph layout), ``timeline`` (swimlanes), ``perfetto`` (the Chrome/Perfetto export), ``templates/`` (jinja2,
CSS, the page's script); the ``megatrace report`` command is in :mod:`megatrace.cli.analyze`. Reads findings
only: nothing here imports the analysis or opens a trace. See docs/report.md.
"""
