"""The local Slurm lab: munge, slurmctld and N slurmd on this host, with the MegaTrace plugin, prolog and epilog.

``megatrace lab up|down|status``; one module per concern: :mod:`.paths` (where
things live), :mod:`.install` (packages, plugin, scripts), :mod:`.slurmconf`
(configuration files), :mod:`.daemons` (start, stop, status by recorded pid) and
:mod:`.demo` (the demo job under ``sbatch --megatrace``) and :mod:`.slurm_install` (which Slurm release
it runs: Debian's, one under a prefix, or one built from source).
"""

from megatrace.errors import MegatraceError


class LabError(MegatraceError, RuntimeError):
    """The lab cannot be brought up, down or used; the message says why."""
