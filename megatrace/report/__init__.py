"""Stage 4, the post-mortem report: ``findings.json`` → one self-contained ``report.html`` (+ ``trace.json``).

``render`` (page and files), ``model`` (the view model from the findings document), ``graph`` (wait-for
graph layout), ``timeline`` (swimlanes), ``perfetto`` (the Chrome/Perfetto export), ``command`` (the
``megatrace report`` click command), ``templates/`` (jinja2, CSS, the page's script). Reads findings only:
nothing here imports the analysis or opens a trace. See docs/report.md.
"""
