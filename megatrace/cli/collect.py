"""``megatrace collect``, ``megatrace agent`` and ``megatrace job-end``: click commands; the work is in
:mod:`megatrace.collect`.

Only click is imported at module level, so ``megatrace --help`` stays fast.
"""

from __future__ import annotations

import json
import os
import time

import click

from megatrace.cli.settings import CONTEXT_SETTINGS, CommandError
from megatrace.names import TRIGGERS


def _expected(nodes: str | None) -> list[str] | None:
    from megatrace.collect.slurm import expand_hostlist, job_nodes

    if nodes:
        try:
            return expand_hostlist(nodes)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--nodes") from None
    return job_nodes()


@click.command(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  # every node of a running (even hung) job, from inside its allocation:
  srun --overlap --mpi=pmi2 --ntasks-per-node=1 --kill-on-bad-exit=0 \\
       megatrace collect --trigger end --job-dir "$SLURM_SUBMIT_DIR"
  # four emulated nodes on one host:
  mpiexec -n 4 megatrace collect --ring-dir /tmp/rings/%n --job-dir /tmp/job
  # no MPI (an epilog): this node's rings into the job's bundle
  megatrace collect --local --job-dir /home/alice/run1 --job-id 1234
\b
Output: <job-dir>/megatrace-<job>/ (megatrace-<job>.1 when a collection is already there) with
collection.json, rings/, nodes/<node>.json, procs.json, findings.json, summary.txt, report.html.
""")
@click.option("--job-dir", type=click.Path(file_okay=False), envvar=["MEGATRACE_JOB_DIR", "SLURM_SUBMIT_DIR"],
              show_envvar=True, default=".", show_default=True, help="Where the bundle directory is written.")
@click.option("--job-id", envvar=["MEGATRACE_JOB_ID", "SLURM_JOB_ID"], show_envvar=True,
              help="Job id (names the bundle; finds the default ring directory) [default: local].")
@click.option("--ring-dir", help="This node's trace directory; %n is replaced by the node name [default: "
              "$MEGATRACE_DIR when it holds rings, else the newest /dev/shm/megatrace-<uid>/<job>[.<step>] of this "
              "user that does].")
@click.option("--node", envvar="MEGATRACE_NODE_NAME", show_envvar=True,
              help="This node's name [default: SLURMD_NODENAME, else the host name].")
@click.option("--out", type=click.Path(file_okay=False), help="Bundle directory [default: see below].")
@click.option("--trigger", type=click.Choice(TRIGGERS), default="manual", show_default=True,
              envvar="MEGATRACE_COLLECT_TRIGGER", show_envvar=True,
              help="Why the collection runs (recorded; 'hang' marks the job stalled for the analysis).")
@click.option("--detail", default="", envvar="MEGATRACE_COLLECT_DETAIL", show_envvar=True,
              help="Free text recorded with the trigger.")
@click.option("--local", is_flag=True, help="No MPI: copy this node's rings into the bundle directory "
              "(several nodes may add to one bundle; analyse afterwards with megatrace analyze).")
@click.option("--nodes", help="The job's nodes, Slurm host-list syntax, to name missing ones "
              "[default: SLURM_JOB_NODELIST].")
@click.option("--analysis", type=click.Choice(["auto", "full", "quick", "none"]), default="auto",
              show_default=True, help="Analysis on the root after the gather (auto: full, quick for a hang "
              "over 2,048 ranks).")
@click.option("--report/--no-report", default=True, show_default=True,
              help="Write report.html when megatrace.report is available.")
@click.option("--stacks/--no-stacks", default=True, show_default=True,
              help="Python stacks of the live trainers with py-spy (when installed).")
@click.option("--system/--no-system", default=True, show_default=True,
              help="NVML snapshot and kernel-log (Xid, OOM) lines.")
@click.option("--timeout", type=click.FloatRange(5), default=60.0, show_default=True,
              help="Seconds for the whole gather; a node silent by then is named missing.")
@click.option("--group-size", type=click.IntRange(2), default=32, show_default=True,
              help="Nodes per leader in the two-level gather.")
@click.option("--transfer", type=click.Choice(["auto", "stream"]), default="auto", show_default=True,
              help="auto: a node that sees the bundle directory (a job directory on a filesystem every node "
                   "mounts) writes its own rings into it, in parallel, and sends the root only its facts and file "
                   "list; stream: every byte through MPI to the root (in 16 MiB messages).")
@click.option("--on-hang", type=click.Choice(["report", "cancel", "requeue"]), default="report",
              show_default=True, help="With --trigger hang, after the report: keep the job, scancel it, "
              "or scontrol requeue it.")
@click.option("--layout", "layout_file", type=click.Path(dir_okay=False),
              help="The job's parallel layout YAML, copied into the bundle as layout.yaml for the analysis "
                   "(read on the root only).")
def collect(job_dir: str, job_id: str | None, ring_dir: str | None, node: str | None, out: str | None,
            trigger: str, detail: str, local: bool, nodes: str | None, analysis: str, report: bool, stacks: bool,
            system: bool, timeout: float, group_size: int, transfer: str, on_hang: str,
            layout_file: str | None) -> None:
    """Collect every node's rings and node facts into the job directory, then analyse them.

    Run one task per node (srun --overlap --ntasks-per-node=1, or mpiexec): MPI rank 0
    gathers every node's rings (byte for byte), process states, GPU and kernel-log facts
    and Python stacks, writes the bundle and runs the analysis. On a job directory every
    node sees, each node writes its own rings into the bundle (--transfer auto). A node
    that does not answer within --timeout is named missing in collection.json; the rest
    is analysed.
    """
    from megatrace.collect.run import CollectError, CollectOptions, collect_local, collect_mpi, exit_now
    from megatrace.pipeline import analyze_bundle

    if not os.path.isdir(job_dir):
        raise CommandError(f"job directory {job_dir} does not exist")
    opts = CollectOptions(job_dir=job_dir, job_id=job_id, ring_dir=ring_dir, out=out, node=node, trigger=trigger,
                          detail=detail, analysis=analysis, report=report, stacks=stacks, system=system,
                          timeout=timeout, group_size=group_size, transfer=transfer, expected_nodes=_expected(nodes),
                          layout=layout_file,
                          log=lambda msg: click.echo(msg, err=True), analyse=analyze_bundle)
    if local:
        doc = collect_local(opts)
        _print(doc)
        _after_hang(trigger, on_hang, opts.resolved_job_id(), doc)
        return
    def report(doc: dict) -> None:
        _print(doc)
        _after_hang(trigger, on_hang, opts.resolved_job_id(), doc)

    try:
        finalized = collect_mpi(opts, report)
    except CollectError as exc:
        raise CommandError(str(exc)) from None
    if not finalized:
        exit_now(0)


def _print(doc: dict) -> None:
    if "nodes" not in doc:  # --local into a shared bundle
        click.echo(f"collect: node {doc['node']}: {doc['files']} files -> {doc['path']}")
        for p in doc.get("problems", []):
            click.echo(f"  problem: {p}", err=True)
        return
    nodes, ranks = doc["nodes"], doc["ranks"]
    click.echo(f"collect: {len(nodes['collected'])} nodes, {ranks['collected']} of {ranks['world_size']} ranks "
               f"-> {doc.get('path', '')}")
    for m in nodes["missing"]:
        click.echo(f"  missing: {m['node']}: {m['reason']}", err=True)
    if ranks["missing"]:
        click.echo(f"  ranks without a ring: {ranks['missing'][:32]}", err=True)
    if ranks.get("in_init_process_group"):
        click.echo(f"  ranks still in init_process_group (no ring yet): {ranks['in_init_process_group'][:32]}",
                   err=True)
    a = doc.get("analysis") or {}
    if a.get("verdict"):
        click.echo(f"VERDICT {a['verdict']}")
    elif a.get("error"):
        click.echo(f"  analysis failed: {a['error']}", err=True)


def _after_hang(trigger: str, on_hang: str, job_id: str, doc: dict) -> None:
    if trigger != "hang" or on_hang == "report":
        return
    from megatrace.collect.slurm import hang_action

    click.echo(f"on-hang {on_hang}: {hang_action(on_hang, job_id)}", err=True)


@click.command(context_settings=CONTEXT_SETTINGS, epilog="""\b
Examples:
  # one agent per node, beside the training step (batch script or prolog):
  srun --overlap --ntasks-per-node=1 megatrace agent --hang-timeout 300 --on-hang requeue &
  # the batch script's time-limit warning (#SBATCH --signal=B:USR1@300):
  trap 'megatrace agent --trigger timelimit' USR1
  # emulated nodes on one host, each with its own ring directory and an mpiexec collector:
  megatrace agent --node n1 --ring-dir /tmp/rings/n1 --job-dir /tmp/job --hang-timeout 30 \\
      --collect-cmd 'mpiexec -n 2 megatrace collect --ring-dir /tmp/rings/%n --trigger {trigger}'
\b
A hang is confirmed when every node whose ranks still run has stalled for --hang-timeout
(no new record or completion, or a blocking collective outstanding): each agent publishes
its state in <state-dir>/agents/<node>.json, and the first agent to see all of them
suspect runs the collector once (lock file collect-hang.lock), then --on-hang.
Under Slurm the agents also collect --timelimit-lead seconds before the job's time limit
(read from scontrol), so that the report exists before Slurm kills the job.
Signals: USR1 = collect now (trigger timelimit); TERM/INT = stop watching.
""")
@click.option("--ring-dir", help="This node's trace directory [default: $MEGATRACE_DIR when it holds rings, "
              "and every /dev/shm/megatrace-<uid>/<job>[.<step>] of this user with rings, looked up on every "
              "poll]. Only rings whose header names --job-id (when given) are watched.")
@click.option("--steps-dir", type=click.Path(file_okay=False),
              help="Instead of --ring-dir: this node's directory of the job's step-<s> ring directories (the "
                   "SPANK plugin's); every step is watched from the moment its directory appears, each with its "
                   "own confirmation and bundle (--steps-out/step-<s>), until its ranks have all finished.")
@click.option("--steps-out", type=click.Path(file_okay=False),
              help="With --steps-dir: step <s>'s collections write their bundle into <steps-out>/step-<s> "
                   "[default: --job-dir].")
@click.option("--node", envvar="MEGATRACE_NODE_NAME", show_envvar=True,
              help="This node's name [default: SLURMD_NODENAME, else the host name].")
@click.option("--job-id", envvar=["MEGATRACE_JOB_ID", "SLURM_JOB_ID"], show_envvar=True,
              help="Job id [default: local].")
@click.option("--job-dir", type=click.Path(file_okay=False), envvar=["MEGATRACE_JOB_DIR", "SLURM_SUBMIT_DIR"],
              show_envvar=True, default=".", show_default=True,
              help="The job directory (shared by all nodes): the bundle and the state directory go there.")
@click.option("--state-dir", type=click.Path(file_okay=False),
              help="Where the agents meet [default: <job-dir>/.megatrace-<job>].")
@click.option("--out", type=click.Path(file_okay=False),
              help="Bundle directory of the collections it runs (the collector's --out) [default: the "
                   "collector's, <job-dir>/megatrace-<job>].")
@click.option("--timelimit-lead", type=click.FloatRange(0), default=90.0, show_default=True,
              help="Under Slurm: collect this many seconds before the job's time limit, so that the report "
                   "is written before the kill (0: off).")
@click.option("--hang-timeout", type=click.FloatRange(0.5), default=300.0, show_default=True,
              envvar="MEGATRACE_HANG_TIMEOUT", show_envvar=True,
              help="Seconds without progress before a rank counts as stalled.")
@click.option("--poll", type=click.FloatRange(0.1), default=5.0, show_default=True,
              help="Seconds between looks at the rings.")
@click.option("--on-hang", type=click.Choice(["report", "cancel", "requeue"]), default="report",
              show_default=True, envvar="MEGATRACE_ON_HANG", show_envvar=True,
              help="After a confirmed hang is collected: keep the job, scancel it, or scontrol requeue it.")
@click.option("--collect-cmd", help="Collector command line ({trigger} is replaced) [default: srun --overlap "
              "... megatrace collect under Slurm, else megatrace collect --local].")
@click.option("--trigger", "request", type=click.Choice(["timelimit", "end", "failure", "manual"]),
              help="Do not watch: ask the job's agents to collect now, and exit.")
@click.option("--nodes", help="The job's nodes (Slurm host-list syntax): no hang is confirmed before each one's "
              "agent was heard, or a startup grace passed [default: SLURM_JOB_NODELIST].")
@click.option("--once", is_flag=True, help="Look once, print this node's state as JSON, and exit.")
@click.option("--max-runtime", type=click.FloatRange(0), help="Stop watching after this many seconds.")
@click.option("--exit-when-done/--keep-running", default=None,
              help="Stop once every ring of this node was closed by its writer [default: keep running under "
                   "Slurm, where a job may run several training steps and the agent ends with the job].")
def agent(ring_dir: str | None, steps_dir: str | None, steps_out: str | None, node: str | None, job_id: str | None,
          job_dir: str, state_dir: str | None, out: str | None, timelimit_lead: float, hang_timeout: float,
          poll: float, on_hang: str, collect_cmd: str | None, request: str | None,
          nodes: str | None, once: bool, max_runtime: float | None, exit_when_done: bool | None) -> None:
    """Watch this node's rings for a hang, confirm it with the other nodes' agents, then collect.

    Run one per node for the life of the job. Each poll reads only the newest records
    of each local ring. The target: the report is in the job directory within
    --hang-timeout + 60 s of the hang's onset.
    """
    import shlex

    from megatrace.collect import safefs
    from megatrace.collect.agent import Agent, AgentConfig, StepsAgent, default_state_dir, request_trigger
    from megatrace.names import node_name

    job = job_id or "local"
    if not os.path.isdir(job_dir):
        raise CommandError(f"job directory {job_dir} does not exist")
    if steps_dir and (ring_dir or out):
        raise CommandError("--steps-dir watches every step-<s> of a directory: give --steps-out for the "
                                "bundles, not --ring-dir or --out")
    if steps_out and not steps_dir:
        raise CommandError("--steps-out goes with --steps-dir")
    owner = safefs.owner_of(job_dir) if os.geteuid() == 0 else None
    state = state_dir or default_state_dir(job_dir, job)
    if request:
        try:
            path = request_trigger(state, request, owner)
        except OSError as exc:
            raise CommandError(f"cannot write the request into {state}: {exc.strerror or exc}") from None
        click.echo(f"agent: collection requested ({request}): {path}", err=True)
        return
    cfg = AgentConfig(state_dir=state, ring_dir=ring_dir, node=node or node_name(),
                      job_id=job, job_dir=os.path.abspath(job_dir), hang_timeout_s=hang_timeout, poll_s=poll,
                      on_hang=on_hang, collect_cmd=shlex.split(collect_cmd) if collect_cmd else None,
                      exit_when_done=not os.environ.get("SLURM_JOB_ID") if exit_when_done is None else exit_when_done,
                      max_runtime_s=max_runtime, once=once, owner=owner,
                      nodes=_expected(nodes), out_dir=os.path.abspath(out) if out else None,
                      timelimit_lead_s=timelimit_lead or None, only_job=job_id is not None)
    try:
        if steps_dir:
            watcher = StepsAgent(cfg, os.path.abspath(steps_dir), os.path.abspath(steps_out or job_dir),
                                 log=_stamped)
        else:
            watcher = Agent(cfg, log=_stamped)
    except OSError as exc:
        raise CommandError(f"cannot use the state directory {state}: {exc.strerror or exc}") from None
    if once:
        click.echo(json.dumps({"node": cfg.node, "state": watcher.poll()}))
        return
    watcher.install_signals()
    what = f"every step-<s> of {steps_dir}" if steps_dir else cfg.ring_dir
    _stamped(f"agent {cfg.node}: watching {what} (hang timeout {hang_timeout:g} s, poll {poll:g} s); "
             f"state in {state}")
    watcher.run()


def _stamped(msg: str) -> None:
    """An agent's log line, led by the UTC time (the agents of one job run for days, on many nodes)."""
    click.echo(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {msg}", err=True)


@click.command("job-end", context_settings=CONTEXT_SETTINGS, epilog="""\b
Example (the epilog, as the job's user, after copying this node's rings):
  megatrace job-end --job-dir "$HOME/run/megatrace-1234" --node n1 --nodes 'n[1-4]'
\b
Every node marks itself done in <state-dir>/epilog/<node>; the first node of --nodes waits
(at most --wait) for the others, then runs megatrace analyze on each step-<s> directory of
the job directory that has rings and no findings.json yet, handing it the job's output files
(--output, else those Slurm names for --job-id) for the ranks without a ring; when no step
has rings, it analyses the output alone into <job-dir>/job-output/. Exit status 0 unless the
options are wrong: an epilog must not fail because an analysis did.
""")
@click.option("--job-dir", type=click.Path(file_okay=False, exists=True), required=True,
              help="The job directory (the SPANK plugin's dir=, holding step-<s>/rings/).")
@click.option("--state-dir", type=click.Path(file_okay=False),
              help="Where the nodes leave their marks [default: <job-dir>/.agents].")
@click.option("--node", envvar="MEGATRACE_NODE_NAME", show_envvar=True,
              help="This node's name [default: SLURMD_NODENAME, else the host name].")
@click.option("--nodes", help="The job's nodes, Slurm host-list syntax; the first one analyses "
              "[default: SLURM_JOB_NODELIST, else this node alone].")
@click.option("--wait", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds the first node waits for the others' marks.")
@click.option("--analyze-timeout", type=click.FloatRange(1), default=300.0, show_default=True,
              help="Seconds allowed for each step's analysis.")
@click.option("--job-id", envvar="SLURM_JOB_ID", show_envvar=True,
              help="The Slurm job, whose output files (found through scontrol) are read for ranks without rings.")
@click.option("--output", "outputs", multiple=True, type=click.Path(dir_okay=False), metavar="FILE",
              help="The job's output file (repeatable) [default: the StdOut and StdErr of --job-id].")
def job_end(job_dir: str, state_dir: str | None, node: str | None, nodes: str | None, wait: float,
            analyze_timeout: float, job_id: str | None, outputs: tuple[str, ...]) -> None:
    """At the end of a traced job: analyse every step that no collection covered (run by the epilog)."""
    from megatrace.collect.job_end import finish_job
    from megatrace.names import node_name

    this = node or node_name()
    try:
        done = finish_job(job_dir, state_dir or os.path.join(job_dir, ".agents"), this, _expected(nodes), wait,
                          analyze_timeout, log=lambda msg: click.echo(msg, err=True), job_id=job_id,
                          output_files=list(outputs) if outputs else None)
    except OSError as exc:
        raise CommandError(f"cannot mark {this} done in {state_dir or job_dir}: {exc.strerror or exc}") \
            from None
    if done.node != done.leader:
        click.echo(f"job-end: {this} done; {done.leader} writes the reports", err=True)
        return
    for step, why in done.skipped.items():
        click.echo(f"job-end: {step}: skipped ({why})", err=True)
    if not done.analysed and not done.skipped:
        click.echo(f"job-end: no step directory with rings in {job_dir}", err=True)
