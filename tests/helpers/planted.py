"""What another user plants before a victim's tracer starts (issue 20): shared by the tracer tests, Python and C.

Made by root with chown, so the tests need root (CI runs as root); the lab tests do the same with two
real ordinary users."""

from __future__ import annotations

import os
from pathlib import Path

from megatrace.trace import ring_format as fmt

OTHER_UID = 4242  # the attacker: another user


def planted_step_dir(tmp_path: Path) -> tuple[Path, Path]:
    """(victim's file, step directory): ``job-7.n1/step-0`` made first by the attacker, both levels mode 0777,
    with rank 0's meta file as the attacker's link to a file of the victim's."""
    victim = tmp_path / "victims-notes"
    victim.write_text("keep\n")
    step = tmp_path / "job-7.n1" / "step-0"
    step.mkdir(parents=True)
    for d in (step.parent, step):
        d.chmod(0o777)
        os.chown(d, OTHER_UID, OTHER_UID)
    (step / fmt.meta_name(0)).symlink_to(victim)
    os.lchown(step / fmt.meta_name(0), OTHER_UID, OTHER_UID)
    return victim, step
